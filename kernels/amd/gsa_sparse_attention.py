"""gsa_sparse_attention on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared kernels with AMD's
config spaces and knobs.

Head-block variant: its kernels use no matrix instructions (a head's scores are a matrix-vector
product), so matrix_instr_nonkdim and kpack stay at their defaults; a 64-lane wavefront covers a
128-wide head row twice over, so a program spreads BLOCK_H up to 128 heads over fewer waves than NVIDIA
warps, and waves_per_eu trades registers for the waves in flight that hide the gathers' latency.

Dense variant: its "fwd" kernel is a FlashAttention forward (MFMA) whose score tile has a bitmap tile
beside it, so its tiles are narrower than the dense attention's (kernels/amd/flash_attention.py): two
fused GEMMs want num_stages 1, each wavefront at least 16 query rows (32 for the 32x32 MFMA), and
waves_per_eu 2 caps a lane at 256 VGPRs. Its extras pass and backward are the head-block kernels, with
the head-block spaces.
"""

from kreg.core.space import ConfigSpace
from kreg.kernels.amd.flash_attention import rows_per_wavefront_of
from kreg.kernels.common.gsa_sparse_attention.variant import (
    INTERPRETER_DENSE,
    INTERPRETER_DKV,
    INTERPRETER_FWD,
    GSASparseAttentionDenseBase,
    GSASparseAttentionHeadBlockBase,
    dense_spaces,
    heads_fit,
)
from kreg.ops.catalog import register
from kreg.ops.variant import Variant

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


@register
class GSASparseAttentionDenseAmd(GSASparseAttentionDenseBase, Variant):
    vendor = "amd"
    # Untimed (no AMD GPU here); the defaults compile without spills for gfx942 and gfx950 at d 128
    # (benchmarks/NOTES.md, "GSA sparse attention, dense masked tiles").
    spaces = dense_spaces(GSASparseAttentionHeadBlockAmd.spaces, ConfigSpace(
        blocks={"BLOCK_M": (32, 64, 128), "BLOCK_N": (16, 32, 64)},
        knobs={"num_warps": (2, 4, 8), "num_stages": (1,), "waves_per_eu": (0, 1, 2),
               "matrix_instr_nonkdim": (16, 32), "kpack": (1,)},
        arch={"gfx942": {"kpack": (1, 2)}}, keep=rows_per_wavefront_of("BLOCK_M"),
        defaults={"*": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "waves_per_eu": 2,
                        "matrix_instr_nonkdim": 16, "kpack": 1}},
        interpreter=INTERPRETER_DENSE,
    ))
    TILE_REGS_LIMIT = 256
