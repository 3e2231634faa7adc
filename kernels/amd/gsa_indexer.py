"""gsa_indexer on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared tiled kernel with AMD's
knobs. A wavefront is 64 lanes, so a tile spreads over twice the lanes of an NVIDIA warp and the unified
VGPR/AGPR file (512 per lane) leaves room for wide score tiles; there is no loop to pipeline, so
num_stages stays at 1-2; kpack is forced to 1 on gfx950 by Triton, so the space offers 2 on gfx942 only.
"""

from kreg.core.space import ConfigSpace
from kreg.kernels.common.gsa_indexer import INTERPRETER_INDEXER, GSAIndexerTiledBase, score_tile_fits
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class GSAIndexerTiledAmd(GSAIndexerTiledBase, Variant):
    vendor = "amd"
    spaces = {"fwd": ConfigSpace(
        blocks={"BLOCK_Q": (16, 32, 64, 128), "BLOCK_K": (32, 64, 128, 256)},
        knobs={"num_warps": (4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 1, 2),
               "matrix_instr_nonkdim": (16, 32), "kpack": (1,)},
        arch={"gfx942": {"kpack": (1, 2)}},
        keep=score_tile_fits,
        # Untimed (no AMD GPU here); compiles without spills for gfx942 and gfx950.
        defaults={"*": {"BLOCK_Q": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "waves_per_eu": 0,
                        "matrix_instr_nonkdim": 16, "kpack": 1}},
        interpreter=INTERPRETER_INDEXER,
    )}
    ACC_REGS_LIMIT = 256
