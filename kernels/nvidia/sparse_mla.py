"""sparse_mla on NVIDIA Hopper: the shared head-block kernel with NVIDIA's config space.

Hopper's register file holds at most 128 fp32 accumulator values per thread next to the other tiles,
so BLOCK_H 128 with d_v 512 is pruned statically; 228 KB of shared memory allows deep pipelining of
the gathered K/V tiles.
"""

from kernels.base import Variant, register
from kernels.common.sparse_mla import SparseMLAHeadBlockBase


@register
class SparseMLAHeadBlockNvidia(SparseMLAHeadBlockBase, Variant):
    vendor = "nvidia"
    SPACE = {
        "BLOCK_H": (16, 32, 64, 128),
        "BLOCK_TOPK": (16, 32, 64, 128),
        "num_warps": (4, 8, 16),
        "num_stages": (1, 2, 3, 4),
    }
    ACC_REGS_LIMIT = 128
    # The backward's two passes, the fastest spill-free pair measured on the H200 at the V3.2 shape
    # (benchmarks/NOTES.md): dq with 32 heads per program (64 spill), dkv with 64-row tiles and
    # 16-head chunks (32-head chunks at 3 stages need 240 KB of shared memory at run time).
    BACKWARD = {"dq": {"BLOCK_H": 32, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 2},
                "dkv": {"BLOCK_H": 16, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 3}}
    # The fastest spill-free config measured on the H200 at the V3.2 shape (benchmarks/NOTES.md): 64
    # heads per program, 64-slot tiles, 3 stages (255 registers with int32 row offsets).
    DEFAULTS = {"*": {"BLOCK_H": 64, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 3}}
