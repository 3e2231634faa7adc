"""sparse_mla on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared head-block kernel with
AMD's knobs. A wavefront is 64 lanes and the unified VGPR/AGPR file holds 512 registers per lane, so
BLOCK_H 64 and 128 (the K/V reuse that made the MI355 kernel fast) fit; LDS is 64 KiB on gfx942 and
160 KiB on gfx950, which bounds BLOCK_TOPK and num_stages (1-2; 1 is usual for two fused GEMMs).
kpack is forced to 1 on gfx950 by Triton, so the space offers it there only.
"""

from kreg.core.space import ConfigSpace
from kreg.kernels.common.sparse_mla.backward import HEAD_BLOCK_PASSES
from kreg.kernels.common.sparse_mla.variant import (
    BWD_PRE_SPACE,
    INTERPRETER_DKV,
    INTERPRETER_DQ,
    INTERPRETER_FUSED,
    INTERPRETER_FWD,
    INTERPRETER_SUM,
    SparseMLAHeadBlockBase,
    heads_fit_group,
)
from kreg.ops.catalog import register
from kreg.ops.variant import Variant

# The knobs every role's default takes (untimed: no AMD GPU here).
_KNOBS = {"waves_per_eu": 0, "matrix_instr_nonkdim": 16, "kpack": 1}


@register
class SparseMLAHeadBlockAmd(SparseMLAHeadBlockBase, Variant):
    vendor = "amd"
    # Q and dO rows stacked by two masked loads: Triton 3.6's AMD pointer canonicalization asserts on a
    # select between two tensors' pointers once they fit 32-bit buffer offsets (every V3.2 shape).
    passes = HEAD_BLOCK_PASSES._replace(rows_by_select=False)
    spaces = {
        # 64 heads per program at the V3.2 shape, without spills in every specialization a call compiles
        # to (32-bit buffer offsets for tensors under 2 GiB, a sink, top-k lengths): on gfx942 4 warps
        # (512 VGPRs a lane; ~394 used) with 16-slot tiles, as Q alone fills its 64 KiB of LDS; on gfx950
        # 8 warps (256 VGPRs; ~225 used) with 16-slot tiles (32 leaves 3 registers to spare).
        "fwd": ConfigSpace(
            blocks={"BLOCK_H": (16, 32, 64, 128), "BLOCK_TOPK": (16, 32, 64, 128), "D_SPLIT": (1, 2)},
            knobs={"num_warps": (4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 1, 2),
                   "matrix_instr_nonkdim": (16, 32), "kpack": (1, 2)},
            arch={"gfx950": {"kpack": (1,)}},
            keep=heads_fit_group,
            defaults={
                "gfx942": {"BLOCK_H": 64, "BLOCK_TOPK": 16, "D_SPLIT": 1, "num_warps": 4, "num_stages": 1, **_KNOBS},
                "*": {"BLOCK_H": 64, "BLOCK_TOPK": 16, "D_SPLIT": 1, "num_warps": 8, "num_stages": 1, **_KNOBS},
            },
            interpreter=INTERPRETER_FWD,
        ),
        # The default backward: the pre pass, then the fused pass. With 8 warps (256 VGPRs per lane)
        # every fused tile spills, so the space keeps 4; there 32 heads x 16 slots fits on both targets in
        # every specialization a call compiles to (~400 VGPRs; 32 x 32 spills on gfx950 once tensors under
        # 2 GiB get 32-bit buffer offsets, 64 heads spill). Its dkv atomics are scalar
        # global_atomic_add_f32 (no vector f32 atomics).
        "bwd_pre": BWD_PRE_SPACE,
        "bwd_fused": ConfigSpace(
            blocks={"BLOCK_H": (16, 32, 64), "BLOCK_TOPK": (16, 32), "D_SPLIT": (2, 4)},
            knobs={"num_warps": (4,), "num_stages": (1,), "waves_per_eu": (0, 1), "matrix_instr_nonkdim": (16,),
                   "kpack": (1,)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 32, "BLOCK_TOPK": 16, "D_SPLIT": 4, "num_warps": 4, "num_stages": 1, **_KNOBS}},
            interpreter=INTERPRETER_FUSED,
        ),
        # The deterministic backward's dq and dkv passes: the widest tiles that compile at the V3.2
        # dims for gfx942 and gfx950 with no spills and LDS within 64 KiB in every specialization
        # (dq 32 heads x 16 slots, 347-395 VGPRs, 32 KiB; dkv 324 VGPRs, 32 KiB).
        "bwd_dq": ConfigSpace(
            blocks={"BLOCK_H": (16, 32), "BLOCK_TOPK": (16, 32, 64)},
            knobs={"num_warps": (4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 1, 2),
                   "matrix_instr_nonkdim": (16,), "kpack": (1,)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 32, "BLOCK_TOPK": 16, "num_warps": 4, "num_stages": 1, **_KNOBS}},
            interpreter=INTERPRETER_DQ,
        ),
        "bwd_dkv": ConfigSpace(
            blocks={"BLOCK_H": (16, 32), "BLOCK_TOPK": (32, 64)},
            knobs={"num_warps": (4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 1, 2),
                   "matrix_instr_nonkdim": (16,), "kpack": (1,)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 16, "BLOCK_TOPK": 64, "num_warps": 4, "num_stages": 1, **_KNOBS}},
            interpreter=INTERPRETER_DKV,
        ),
        "bwd_sum": ConfigSpace(
            blocks={"BLOCK_D": (64, 128, 256)},
            knobs={"num_warps": (1, 2, 4)},
            defaults={"*": {"BLOCK_D": 128, "num_warps": 1}},
            interpreter=INTERPRETER_SUM,
        ),
    }
    ACC_REGS_LIMIT = 256
    Q_IN_SHARED = False
