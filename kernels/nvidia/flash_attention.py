"""flash_attention on NVIDIA Hopper (H100/H200): the shared tiled kernel with NVIDIA's config space.

Triton pipelines K and V through shared memory with `num_stages` buffers each, next to the Q tile, so
deep pipelines fit the 227 KiB only with narrow key tiles. Measured with tuning.compile_check (sm_90,
bf16, causal): d 128 needs 8 warps for BLOCK_M 128 (4 warps spill), d 256 needs 8 warps at BLOCK_M 128.
8 warps are two warpgroups of 64 query rows each (wgmma's M), which is why BLOCK_M 64 keeps 4.
"""

from kernels.base import Variant
from kernels.common.flash_attention import INTERPRETER_TILES, FlashAttentionTiledBase
from registry.catalog import register
from tuning.space import ConfigSpace
from tuning_db.records import LaunchConfig


def two_warpgroups_need_128_rows(config: LaunchConfig, key: dict) -> bool:
    """Keep: 8 warps are two warpgroups of 64 query rows each; with BLOCK_M 64 they only split the keys."""
    return not (config.num_warps == 8 and config.blocks["BLOCK_M"] < 128)


@register
class FlashAttentionTiledNvidia(FlashAttentionTiledBase, Variant):
    vendor = "nvidia"
    spaces = {"fwd": ConfigSpace(
        blocks={"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128)},
        knobs={"num_warps": (4, 8), "num_stages": (2, 3, 4, 5)},
        keep=two_warpgroups_need_128_rows,
        defaults={"*": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}},
        interpreter=INTERPRETER_TILES,
    )}
    # Measured on an H100/H200 at s 8192, bf16 (2026-11): d 64 128x64 with 8 warps (405 TFLOP/s causal
    # vs 370 with 4). d 128: 128x128 w8 is ~4% faster (459 vs 442) but sits at 255 registers and spills
    # under varlen, so the default stays 128x64 (d 64 and 128 alike). d 256 spills at num_stages 2 under
    # varlen or a window: its default takes num_stages 1, outside the sweep's space.
    HEAD_DIM_DEFAULTS = ((128, {}), (256, {"BLOCK_N": 32, "num_stages": 1}))

    @staticmethod
    def shared_bytes(config: LaunchConfig, block_d: int, elem: int) -> int:
        """The Q tile plus `num_stages` buffers of the K and V tiles (matches sm_90 compiles exactly)."""
        blocks = config.blocks
        return elem * block_d * (blocks["BLOCK_M"] + 2 * config.num_stages * blocks["BLOCK_N"])
