"""sink_attention on NVIDIA Hopper: the attention kernel family (kernels/common/attention/) with
its sink switch on, and flash_attention's NVIDIA spaces and defaults (a sink is O(rows) work next to
the O(rows * keys) of the products, so the best tiles are the same); `sink_attention_warpspec` swaps
in the Hopper Gluon forward and dK/dV kernels (kernels/nvidia/attention_warpspec.py, attention_warpspec_bwd.py),
`sink_attention_window_tma` the Gluon short-window forward whose K/V arrive by TMA
(kernels/nvidia/attention_window.py; gpt-oss's window-128 layers)."""

from kreg.kernels.common.attention.variant import AttentionTiledBase
from kreg.kernels.nvidia.attention_warpspec import AttentionWarpSpecHopper
from kreg.kernels.nvidia.attention_window import AttentionWindowTmaHopper
from kreg.kernels.nvidia.flash_attention import AttentionNvidia
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class SinkAttentionFlashNvidia(AttentionNvidia, AttentionTiledBase, Variant):
    op = "sink_attention"
    name = "sink_attention_flash"


@register
class SinkAttentionWarpSpecHopper(AttentionWarpSpecHopper, SinkAttentionFlashNvidia):
    name = "sink_attention_warpspec"
    tiled = SinkAttentionFlashNvidia


@register
class SinkAttentionWindowTmaHopper(AttentionWindowTmaHopper, SinkAttentionFlashNvidia):
    name = "sink_attention_window_tma"
    tiled = SinkAttentionFlashNvidia
