"""sink_attention on AMD CDNA3/CDNA4: the attention kernel family (kernels/common/attention/) with
its sink switch on, and flash_attention's AMD spaces and defaults (a sink is O(rows) work next to the
O(rows * keys) of the products)."""

from kreg.kernels.amd.flash_attention import AttentionAmd
from kreg.kernels.common.attention.variant import AttentionTiledBase
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class SinkAttentionFlashAmd(AttentionAmd, AttentionTiledBase, Variant):
    op = "sink_attention"
    name = "sink_attention_flash"
