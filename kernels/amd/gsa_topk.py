"""gsa_topk on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared radix-select kernel with AMD's
knobs. The 512-register unified file holds the score, counter and prefix-sum tiles (281 VGPRs at the
default, no spills); the MI300X has 304 CUs and the MI355X 256, so one program per CU already deals out
every query block of a long sequence; num_stages 1-2 as usual on AMD; kpack 2 on gfx942 only (Triton
forces 1 on gfx950). At the default the MFMA warps split the (head, query) columns 2 x 2, so a query's
heads sit in two warps and the head sum of each score tile goes through LDS (on NVIDIA it stays in
registers); untimed, no AMD GPU is reachable.
"""

from kreg.core.space import ConfigSpace
from kreg.kernels.common.gsa_indexer import score_tile_fits
from kreg.kernels.common.gsa_topk import INTERPRETER_TOPK, GSATopkRadixBase
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class GSATopkRadixAmd(GSATopkRadixBase, Variant):
    vendor = "amd"
    spaces = {"fwd": ConfigSpace(
        blocks={"BLOCK_Q": (8, 16, 32), "BLOCK_K": (32, 64, 128), "TILE": (32, 64, 128, 256), "WAVES": (1, 2, 4)},
        knobs={"num_warps": (4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 1, 2),
               "matrix_instr_nonkdim": (16, 32), "kpack": (1,)},
        arch={"gfx942": {"kpack": (1, 2)}},
        keep=score_tile_fits,
        # Untimed (no AMD GPU here).
        defaults={"*": {"BLOCK_Q": 16, "BLOCK_K": 64, "TILE": 64, "WAVES": 1, "num_warps": 4, "num_stages": 1,
                        "waves_per_eu": 0, "matrix_instr_nonkdim": 16, "kpack": 1}},
        interpreter=INTERPRETER_TOPK,
    )}
    ACC_REGS_LIMIT = 256
