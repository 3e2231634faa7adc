"""decode on NVIDIA Hopper (H100/H200): the shared split-KV kernels with NVIDIA's config space.

Decoding reads every cached key and value once and does little arithmetic per byte, so the split
kernel is bound by memory bandwidth: what matters is enough programs in flight to cover all 132 SMs
(WAVES) and key tiles long enough for wide, pipelined loads (BLOCK_N, num_stages). KV_HEADS kv heads
per program make each key position one contiguous read of KV_HEADS * d elements; a step reads 64..256
key rows (KV_HEADS * BLOCK_N), so several heads come with shorter tiles, and each warp owns whole heads
(num_warps <= KV_HEADS). Pages of 16 with KV_HEADS 4-8 x BLOCK_N 16 read one whole page of every head
per step after one block-table load.
"""

from kreg.core.space import ConfigSpace
from kreg.kernels.common.decode import COMBINE_SPACE, INTERPRETER_SPLIT, DecodeSplitKVBase, key_rows_between
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class DecodeSplitKVNvidia(DecodeSplitKVBase, Variant):
    vendor = "nvidia"
    spaces = {
        "split": ConfigSpace(
            blocks={"BLOCK_N": (16, 32, 64, 128, 256), "WAVES": (1, 2, 4, 8), "KV_HEADS": (1, 2, 4, 8)},
            knobs={"num_warps": (2, 4, 8), "num_stages": (2, 3, 4)},
            keep=key_rows_between(64, 256),
            defaults={"*": {"BLOCK_N": 128, "WAVES": 2, "KV_HEADS": 1, "num_warps": 4, "num_stages": 3}},
            interpreter=INTERPRETER_SPLIT,
        ),
        "combine": COMBINE_SPACE,
    }
