"""flash_attention on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared tiled kernel with
AMD's config space and knobs.

Both GEMMs are fused in one loop, so num_stages 1 (no software pipelining) is the usual choice and 2 the
only other; LDS (64 KiB on gfx942, 160 KiB on gfx950) holds one tile at a time. waves_per_eu 2 caps a
lane at 256 VGPRs: measured with tuning.compile_check, d 128 at BLOCK_M 128 then needs 8 warps on
gfx942 (4 warps spill there), d 256 needs BLOCK_M 64 with BLOCK_N 32. kpack is forced to 1 on gfx950,
so the space offers kpack 2 on gfx942 only.
"""

from kernels.base import Variant
from kernels.common.flash_attention import INTERPRETER_TILES, FlashAttentionTiledBase
from registry.catalog import register
from tuning.space import ConfigSpace
from tuning_db.records import LaunchConfig


def rows_per_wavefront(config: LaunchConfig, key: dict) -> bool:
    """Keep: each wavefront owns BLOCK_M / num_warps query rows: at least 16 (8 warps need BLOCK_M 128),
    and at least 32 for the 32x32 MFMA (matrix_instr_nonkdim 32)."""
    rows = config.blocks["BLOCK_M"] // config.num_warps
    return rows >= 16 and (config.matrix_instr_nonkdim != 32 or rows >= 32)


@register
class FlashAttentionTiledAmd(FlashAttentionTiledBase, Variant):
    vendor = "amd"
    spaces = {"fwd": ConfigSpace(
        blocks={"BLOCK_M": (64, 128), "BLOCK_N": (32, 64)},
        knobs={"num_warps": (4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 1, 2),
               "matrix_instr_nonkdim": (16, 32), "kpack": (1,)},
        arch={"gfx942": {"kpack": (1, 2)}},
        keep=rows_per_wavefront,
        defaults={"*": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "waves_per_eu": 2,
                        "matrix_instr_nonkdim": 16, "kpack": 1}},
        interpreter=INTERPRETER_TILES,
    )}
    HEAD_DIM_DEFAULTS = ((64, {"num_warps": 4}), (128, {}), (256, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4}))

    @staticmethod
    def shared_bytes(config: LaunchConfig, block_d: int, elem: int) -> int:
        """LDS holds the Q tile or the K/V tiles in flight, not both (as gfx942/gfx950 compiles show)."""
        blocks = config.blocks
        return elem * block_d * max(blocks["BLOCK_M"], config.num_stages * blocks["BLOCK_N"])
