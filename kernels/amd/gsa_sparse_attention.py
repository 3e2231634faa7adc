"""gsa_sparse_attention on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared head-block kernels
with AMD's knobs. They use no matrix instructions (a head's scores are a matrix-vector product), so
matrix_instr_nonkdim and kpack stay at their defaults; a 64-lane wavefront covers a 128-wide head row
twice over, so a program spreads BLOCK_H up to 128 heads over fewer waves than NVIDIA warps, and
waves_per_eu trades registers for the waves in flight that hide the gathers' latency.
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

_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
_KNOBS = {"num_warps": (2, 4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 1, 2, 4),
          "matrix_instr_nonkdim": (16,), "kpack": (1,)}
_DEFAULT_KNOBS = {"num_warps": 4, "num_stages": 1, "waves_per_eu": 0, "matrix_instr_nonkdim": 16, "kpack": 1}


@register
class GSASparseAttentionHeadBlockAmd(GSASparseAttentionHeadBlockBase, Variant):
    vendor = "amd"
    # Untimed (no AMD GPU here); the defaults compile without spills for gfx942 and gfx950 at d 128.
    spaces = {
        "fwd": ConfigSpace(
            blocks={"BLOCK_H": _HEADS, "BLOCK_TOPK": (4, 8, 16, 32)}, knobs=_KNOBS, keep=heads_fit,
            defaults={"*": {"BLOCK_H": 16, "BLOCK_TOPK": 8, **_DEFAULT_KNOBS}},
            interpreter=INTERPRETER_FWD,
        ),
        "bwd_dq": ConfigSpace(
            blocks={"BLOCK_H": _HEADS, "BLOCK_TOPK": (4, 8, 16, 32)}, knobs=_KNOBS, keep=heads_fit,
            defaults={"*": {"BLOCK_H": 16, "BLOCK_TOPK": 8, **_DEFAULT_KNOBS}},
            interpreter=INTERPRETER_FWD,
        ),
        "bwd_dkv": ConfigSpace(
            blocks={"BLOCK_H": _HEADS, "BLOCK_Q": (4, 8, 16, 32)}, knobs=_KNOBS, keep=heads_fit,
            defaults={"*": {"BLOCK_H": 16, "BLOCK_Q": 8, **_DEFAULT_KNOBS}},
            interpreter=INTERPRETER_DKV,
        ),
    }
    TILE_REGS_LIMIT = 256
