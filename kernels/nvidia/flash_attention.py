"""flash_attention on NVIDIA Hopper (H100/H200): the shared attention kernel family
(kernels/common/attention/) with NVIDIA's config spaces. sink_attention's NVIDIA variant
(kernels/nvidia/sink_attention.py) takes the same data: a sink adds O(rows) work to O(rows * keys).

Triton pipelines the streamed tiles through shared memory with `num_stages` buffers each, next to the
resident ones (the forward's and dQ's K and V stream past a resident Q tile; dK/dV's Q and dO stream
past resident K and V), so deep pipelines fit the 227 KiB only with narrow streamed tiles. 8 warps are
two warpgroups of 64 rows each (wgmma's M): a tile with fewer rows than 128 gives the second one
nothing to split, which is what `two_warpgroups_need_128_rows` keeps out.

`flash_attention_warpspec` (registered last) is the same variant with the Hopper Gluon forward of
kernels/nvidia/attention_warpspec.py in place of the tiled forward and the Gluon dK/dV kernel of
kernels/nvidia/attention_warpspec_bwd.py in place of the tiled one.
"""

from kreg.core.records import LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.common.attention.tile_rules import one_loop_only_for_windows
from kreg.kernels.common.attention.variant import INTERPRETER_TILES, AttentionTiledBase
from kreg.kernels.nvidia.attention_warpspec import AttentionWarpSpecHopper
from kreg.ops.catalog import register
from kreg.ops.variant import Variant

# The block that is the rows (wgmma's M) of each role's main products: the forward's and dQ's query
# rows, dK/dV's key rows (it works transposed).
_ROWS = {"fwd": "BLOCK_M", "bwd_dq": "BLOCK_M", "bwd_dkv": "BLOCK_N"}


def two_warpgroups(rows: str):
    """The keep predicate for a role whose product rows are the block `rows` (shared with other
    ops' tiled attention kernels)."""

    def two_warpgroups_need_128_rows(config: LaunchConfig, key: dict) -> bool:
        """Keep: 8 warps are two warpgroups of 64 rows each; with fewer than 128 rows they only split
        the other dimension."""
        return not (config.num_warps == 8 and config.blocks[rows] < 128)

    return two_warpgroups_need_128_rows


def forward_tiles(config: LaunchConfig, key: dict) -> bool:
    """Keep (the forward): two warpgroups need 128 rows, and one key loop is for windows only."""
    return two_warpgroups(_ROWS["fwd"])(config, key) and one_loop_only_for_windows(config, key)


def _space(role: str, blocks: dict, defaults: dict) -> ConfigSpace:
    return ConfigSpace(blocks=blocks, knobs={"num_warps": (4, 8), "num_stages": (2, 3, 4)},
                       keep=two_warpgroups(_ROWS[role]), defaults={"*": defaults},
                       interpreter=INTERPRETER_TILES[role])


class AttentionNvidia:
    """NVIDIA's data for the attention family's variants (both ops)."""

    vendor = "nvidia"
    spaces = {
        "fwd": ConfigSpace(
            # HEADS: query heads of one kv head per program, packed along the rows (BLOCK_M // HEADS
            # tokens each); it must divide the GQA group. KEY_LOOPS: 3 loops over the key blocks, 1, or
            # 2: no loop (short windows, see kernels/common/attention/forward.py).
            blocks={"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128), "HEADS": (1, 2, 4, 8, 16), "KEY_LOOPS": (3, 1, 2)},
            knobs={"num_warps": (4, 8), "num_stages": (2, 3, 4, 5)},
            keep=forward_tiles,
            defaults={"*": {"BLOCK_M": 128, "BLOCK_N": 64, "HEADS": 1, "KEY_LOOPS": 3, "num_warps": 8,
                            "num_stages": 3}},
            interpreter=INTERPRETER_TILES["fwd"],
        ),
        # One pass over dO and O: no loop to pipeline, only the row tile and the warps.
        "bwd_pre": ConfigSpace(
            blocks={"BLOCK_M": (32, 64, 128)},
            knobs={"num_warps": (4, 8)},
            defaults={"*": {"BLOCK_M": 64, "num_warps": 4}},
            interpreter=INTERPRETER_TILES["bwd_pre"],
        ),
        "bwd_dkv": _space("bwd_dkv", {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (32, 64, 128)},
                          {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}),
        "bwd_dq": _space("bwd_dq", {"BLOCK_M": (32, 64, 128), "BLOCK_N": (16, 32, 64, 128)},
                         {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3}),
    }
    # Forward, measured on an H100/H200 at s 8192, bf16 (2026-11): d 64 128x64 with 8 warps (405 TFLOP/s
    # causal vs 370 with 4). d 128: 128x128 w8 is ~4% faster (459 vs 442) but sits at 255 registers and
    # spills under varlen, so the default stays 128x64 (d 64 and 128 alike). d 256 spills under varlen
    # with 32-key tiles or 2 stages: its default takes 16-key tiles and num_stages 1, outside the space.
    # Backward (untimed; sm_90 compiles, bf16, sinks, windows and varlen, no spills): dK/dV keeps 128 key
    # rows for two warpgroups and narrows its query tile as d grows (32, then 16 at d 128: 255
    # registers; d 256 fits only 16x32 with 4 warps); dQ 128x32 up to d 128, 128x16 at d 256.
    HEAD_DIM_DEFAULTS = {
        "fwd": ((128, {}), (256, {"BLOCK_N": 16, "num_stages": 1})),
        "bwd_dkv": ((64, {}), (128, {"BLOCK_M": 16, "num_stages": 2}),
                    (256, {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1})),
        "bwd_dq": ((128, {}), (256, {"BLOCK_N": 16, "num_stages": 2})),
    }

    def shared_bytes(self, role: str, config: LaunchConfig, block_d: int, elem: int) -> int:
        """The resident tiles plus `num_stages` buffers of the two streamed ones (the forward's
        estimate matches sm_90 compiles exactly)."""
        blocks, stages = config.blocks, config.num_stages
        if role == "bwd_pre":
            return 0
        resident, streamed = ("BLOCK_N", "BLOCK_M") if role == "bwd_dkv" else ("BLOCK_M", "BLOCK_N")
        tiles = 1 if role == "fwd" else 2  # Q; Q and dO; K and V
        return elem * block_d * (tiles * blocks[resident] + 2 * stages * blocks[streamed])


@register
class FlashAttentionTiledNvidia(AttentionNvidia, AttentionTiledBase, Variant):
    op = "flash_attention"
    name = "flash_attention_tiled"


@register
class FlashAttentionWarpSpecHopper(AttentionWarpSpecHopper, FlashAttentionTiledNvidia):
    name = "flash_attention_warpspec"
    tiled = FlashAttentionTiledNvidia
