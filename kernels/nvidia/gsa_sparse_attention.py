"""gsa_sparse_attention on NVIDIA Hopper (H100/H200): the shared kernels with NVIDIA's config spaces.

Head-block variant: the kernels gather rows and reduce them with FMAs, so what decides their speed is the
bytes in flight: heads per program (BLOCK_H: wider gathers, longer contiguous runs) times slots per tile
(BLOCK_TOPK) against the registers they take, and warps per program.

Dense variant: its "fwd" kernel is a FlashAttention forward over BLOCK_M x BLOCK_N tiles (wgmma), with a
bitmap tile loaded beside each score tile; 8 warps are two warpgroups of 64 rows, so they need 128-row
tiles. Its extras pass and backward are the head-block kernels, with the head-block spaces.
"""

from kreg.core.space import ConfigSpace
from kreg.kernels.common.gsa_sparse_attention.variant import (
    INTERPRETER_DENSE,
    INTERPRETER_DKV,
    INTERPRETER_FWD,
    GSASparseAttentionDenseBase,
    GSASparseAttentionHeadBlockBase,
    dense_spaces,
    heads_fit,
)
from kreg.kernels.nvidia.flash_attention import two_warpgroups
from kreg.ops.catalog import register
from kreg.ops.variant import Variant

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


@register
class GSASparseAttentionDenseNvidia(GSASparseAttentionDenseBase, Variant):
    vendor = "nvidia"
    # The defaults compile without spills for sm_90 at d 128; the H100 and H200 tables hold swept configs
    # (benchmarks/NOTES.md, "GSA sparse attention, dense masked tiles").
    spaces = dense_spaces(GSASparseAttentionHeadBlockNvidia.spaces, ConfigSpace(
        blocks={"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128)},
        knobs={"num_warps": (4, 8), "num_stages": (2, 3)}, keep=two_warpgroups("BLOCK_M"),
        defaults={"*": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}},
        interpreter=INTERPRETER_DENSE,
    ))
    # Above d 128 every config of the space spills on sm_90; 128 x 16 tiles, unpipelined, take 255
    # registers without spilling at d 256.
    WIDE_HEAD_FWD = {"BLOCK_N": 16, "num_stages": 1}
