"""flash_attention on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared attention kernel
family (kernels/common/attention/) with AMD's config spaces and knobs. sink_attention's AMD variant
(kernels/amd/sink_attention.py) takes the same data.

Two GEMMs (three or four in the backward) are fused in one loop, so num_stages 1 (no software
pipelining) is the usual choice and 2 the only other; LDS (64 KiB on gfx942, 160 KiB on gfx950) holds
one tile at a time. A wavefront is 64 lanes: each owns BLOCK_rows / num_warps rows of the products
(`rows_per_wavefront`). waves_per_eu 2 caps a lane at 256 VGPRs: measured with tuning.compile_check,
the forward at d 128 with BLOCK_M 128 then needs 8 warps on gfx942 (4 warps spill there), d 256 needs
BLOCK_M 64 with BLOCK_N 32. kpack is forced to 1 on gfx950, so the spaces offer kpack 2 on gfx942 only.
"""

from kreg.core.records import LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.common.attention.tile_rules import one_loop_only_for_windows
from kreg.kernels.common.attention.variant import INTERPRETER_TILES, AttentionTiledBase
from kreg.ops.catalog import register
from kreg.ops.variant import Variant

# The block that is the rows of each role's main products: the forward's and dQ's query rows, dK/dV's
# key rows (it works transposed).
_ROWS = {"fwd": "BLOCK_M", "bwd_dq": "BLOCK_M", "bwd_dkv": "BLOCK_N"}
_KNOBS = {"num_warps": (4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 1, 2), "matrix_instr_nonkdim": (16, 32),
          "kpack": (1,)}


def rows_per_wavefront_of(rows: str):
    """The keep predicate for a role whose product rows are the block `rows` (shared with other
    ops' tiled attention kernels)."""

    def rows_per_wavefront(config: LaunchConfig, key: dict) -> bool:
        """Keep: each wavefront owns rows / num_warps rows of the products: at least 16, and at least
        32 for the 32x32 MFMA (matrix_instr_nonkdim 32)."""
        per_wave = config.blocks[rows] // config.num_warps
        return per_wave >= 16 and (config.matrix_instr_nonkdim != 32 or per_wave >= 32)

    return rows_per_wavefront


def forward_tiles(config: LaunchConfig, key: dict) -> bool:
    """Keep (the forward): rows per wavefront as rows_per_wavefront says, one key loop for windows only."""
    return rows_per_wavefront_of(_ROWS["fwd"])(config, key) and one_loop_only_for_windows(config, key)


def _space(role: str, blocks: dict, defaults: dict) -> ConfigSpace:
    return ConfigSpace(blocks=blocks, knobs=_KNOBS, arch={"gfx942": {"kpack": (1, 2)}},
                       keep=forward_tiles if role == "fwd" else rows_per_wavefront_of(_ROWS[role]),
                       defaults={"*": defaults}, interpreter=INTERPRETER_TILES[role])


_DEFAULT_KNOBS = {"waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 1}


class AttentionAmd:
    """AMD's data for the attention family's variants (both ops)."""

    vendor = "amd"
    spaces = {
        "fwd": _space("fwd", {"BLOCK_M": (64, 128), "BLOCK_N": (32, 64), "HEADS": (1, 2, 4, 8, 16),
                              "KEY_LOOPS": (3, 1, 2)},
                      {"BLOCK_M": 128, "BLOCK_N": 64, "HEADS": 1, "KEY_LOOPS": 3, "num_warps": 8, "num_stages": 1,
                       **_DEFAULT_KNOBS}),
        "bwd_pre": ConfigSpace(
            blocks={"BLOCK_M": (32, 64, 128)},
            knobs={"num_warps": (4, 8), "num_stages": (1,)},
            defaults={"*": {"BLOCK_M": 64, "num_warps": 4, "num_stages": 1}},
            interpreter=INTERPRETER_TILES["bwd_pre"],
        ),
        "bwd_dkv": _space("bwd_dkv", {"BLOCK_M": (16, 32, 64), "BLOCK_N": (32, 64, 128)},
                          {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, **_DEFAULT_KNOBS}),
        "bwd_dq": _space("bwd_dq", {"BLOCK_M": (32, 64, 128), "BLOCK_N": (16, 32, 64)},
                         {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, **_DEFAULT_KNOBS}),
    }
    # Backward (untimed; gfx942 and gfx950 compiles, bf16, sinks, windows and varlen, no spills): dK/dV
    # 32x64 with 4 warps, a 16-row query tile at d 128 (gfx942 spills with 32), and at d 256 16x64 with
    # waves_per_eu 1 (up to 512 registers: 415 used; it spills under 256); dQ 64x32, 64x16 at d 256.
    # Forward at d 64: 128x32 (128x64 spilled one VGPR on gfx942 in the varlen window build once the GQA
    # group became a constant).
    HEAD_DIM_DEFAULTS = {
        "fwd": ((64, {"BLOCK_N": 32, "num_warps": 4}), (128, {}),
                (256, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4})),
        "bwd_dkv": ((64, {}), (128, {"BLOCK_M": 16}), (256, {"BLOCK_M": 16, "waves_per_eu": 1})),
        "bwd_dq": ((128, {}), (256, {"BLOCK_N": 16})),
    }

    def shared_bytes(self, role: str, config: LaunchConfig, block_d: int, elem: int) -> int:
        """LDS holds one operand tile set at a time, not all of them (as gfx942/gfx950 compiles show)."""
        blocks, stages = config.blocks, config.num_stages
        if role == "bwd_pre":
            return 0
        if role == "fwd":
            return elem * block_d * max(blocks["BLOCK_M"], stages * blocks["BLOCK_N"])
        resident, streamed = ("BLOCK_N", "BLOCK_M") if role == "bwd_dkv" else ("BLOCK_M", "BLOCK_N")
        return elem * block_d * max(blocks[resident], stages * blocks[streamed])


@register
class FlashAttentionTiledAmd(AttentionAmd, AttentionTiledBase, Variant):
    op = "flash_attention"
    name = "flash_attention_tiled"
