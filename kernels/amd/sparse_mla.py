"""sparse_mla on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared head-block kernel with
AMD's knobs. A wavefront is 64 lanes and the unified VGPR/AGPR file holds 512 registers per lane, so
BLOCK_H 64 and 128 (the K/V reuse that made the MI355 kernel fast) fit; LDS is 64 KiB on gfx942 and
160 KiB on gfx950, which bounds BLOCK_TOPK and num_stages (1-2; 1 is usual for two fused GEMMs).
"""

from kernels.base import Variant, register
from kernels.common.sparse_mla import SparseMLAHeadBlockBase


@register
class SparseMLAHeadBlockAmd(SparseMLAHeadBlockBase, Variant):
    vendor = "amd"
    SPACE = {
        "BLOCK_H": (16, 32, 64, 128),
        "BLOCK_TOPK": (16, 32, 64, 128),
        "D_SPLIT": (1, 2),
        "num_warps": (4, 8),
        "num_stages": (1, 2),
        "waves_per_eu": (0, 1, 2),
        "matrix_instr_nonkdim": (16, 32),
        "kpack": (1, 2),
    }
    ACC_REGS_LIMIT = 256
    Q_IN_SHARED = False
    # The backward's two passes, the widest tiles that compile at the V3.2 dims for gfx942 and gfx950
    # with no spills and LDS within 64 KiB, with room (dq 447-463 VGPRs, 32 KiB; dkv 324 VGPRs, 32 KiB;
    # untimed: no AMD GPU here).
    BACKWARD = {"dq": {"BLOCK_H": 32, "BLOCK_TOPK": 32, "num_warps": 4, "num_stages": 1},
                "dkv": {"BLOCK_H": 16, "BLOCK_TOPK": 64, "num_warps": 4, "num_stages": 1}}
    # At the V3.2 shape with 8 warps (2 waves per SIMD, 256 VGPRs each), no spills and 64 KiB of LDS:
    # gfx942 needs the narrower top-k tile, gfx950 takes 32.
    DEFAULTS = {
        "gfx942": {"BLOCK_H": 64, "BLOCK_TOPK": 16, "num_warps": 8, "num_stages": 2, "waves_per_eu": 0,
                   "matrix_instr_nonkdim": 16, "kpack": 1},
        "*": {"BLOCK_H": 64, "BLOCK_TOPK": 32, "num_warps": 8, "num_stages": 1, "waves_per_eu": 0,
              "matrix_instr_nonkdim": 16, "kpack": 1},
    }

    def _knob_values(self, name: str, device) -> tuple:
        # gfx950 has no kpack choice: Triton forces it to 1 there.
        if name == "kpack" and device.arch == "gfx950":
            return (1,)
        return self.SPACE[name]
