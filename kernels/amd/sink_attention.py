"""sink_attention on AMD CDNA3/CDNA4: the attention kernel family (kernels/common/attention.py) with
its sink switch on, and flash_attention's AMD spaces and defaults (a sink is O(rows) work next to the
O(rows * keys) of the products)."""

from kernels.amd.flash_attention import AttentionAmd
from kernels.base import Variant
from kernels.common.attention import AttentionTiledBase
from registry.catalog import register


@register
class SinkAttentionFlashAmd(AttentionAmd, AttentionTiledBase, Variant):
    op = "sink_attention"
    name = "sink_attention_flash"
