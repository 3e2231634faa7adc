"""gsa_sparse_attention on NVIDIA Hopper (H100/H200): the shared head-block kernels with NVIDIA's config
space. The kernels gather rows and reduce them with FMAs, so what decides their speed is the bytes in
flight: heads per program (BLOCK_H: wider gathers, longer contiguous runs) times slots per tile
(BLOCK_TOPK) against the registers they take, and warps per program.
"""

from kernels.base import Variant
from kernels.common.gsa_sparse_attention import (
    INTERPRETER_DKV,
    INTERPRETER_FWD,
    GSASparseAttentionHeadBlockBase,
    heads_fit,
)
from registry.catalog import register
from tuning.space import ConfigSpace

_GATHER = {"BLOCK_H": (1, 2, 4, 8, 16, 32, 64), "BLOCK_TOPK": (4, 8, 16, 32)}


@register
class GSASparseAttentionHeadBlockNvidia(GSASparseAttentionHeadBlockBase, Variant):
    vendor = "nvidia"
    # Untimed until the first H100/H200 sweep; the defaults compile without spills for sm_90 at d 128.
    spaces = {
        "fwd": ConfigSpace(
            blocks=_GATHER, knobs={"num_warps": (2, 4, 8, 16), "num_stages": (1, 2, 3)}, keep=heads_fit,
            defaults={"*": {"BLOCK_H": 16, "BLOCK_TOPK": 8, "num_warps": 8, "num_stages": 2}},
            interpreter=INTERPRETER_FWD,
        ),
        "bwd_dq": ConfigSpace(
            blocks=_GATHER, knobs={"num_warps": (2, 4, 8, 16), "num_stages": (1, 2, 3)}, keep=heads_fit,
            defaults={"*": {"BLOCK_H": 16, "BLOCK_TOPK": 8, "num_warps": 8, "num_stages": 2}},
            interpreter=INTERPRETER_FWD,
        ),
        "bwd_dkv": ConfigSpace(
            blocks={"BLOCK_H": (1, 2, 4, 8, 16, 32, 64), "BLOCK_Q": (4, 8, 16, 32)},
            knobs={"num_warps": (2, 4, 8, 16), "num_stages": (1, 2, 3)}, keep=heads_fit,
            defaults={"*": {"BLOCK_H": 16, "BLOCK_Q": 8, "num_warps": 8, "num_stages": 2}},
            interpreter=INTERPRETER_DKV,
        ),
    }
