"""decode on NVIDIA Hopper (H100/H200): the shared split-KV kernels with NVIDIA's config space.

Decoding reads every cached key and value once and does little arithmetic per byte, so the split
kernel is bound by memory bandwidth: what matters is enough programs in flight to cover all 132 SMs
(WAVES) and key tiles long enough for wide, pipelined loads (BLOCK_N, num_stages). KV_HEADS kv heads
per program make each key position one contiguous read of KV_HEADS * d elements; a step reads 64..256
key rows (KV_HEADS * BLOCK_N), so several heads come with shorter tiles, and each warp owns whole heads
(num_warps <= KV_HEADS). Pages of 16 with KV_HEADS 4-8 x BLOCK_N 16 read one whole page of every head
per step after one block-table load.

LOADS picks how K and V tiles are read: 1, pointer loads (Triton pipelines them as cp.async); 2, TMA
bulk copies through tensor descriptors the split kernel builds per program (pipelined with mbarriers),
one box of [KV_HEADS, BLOCK_N, d] per tile in the [heads, keys, d] order the products take, so no
register permute is needed for several heads. It is kept only for contiguous caches and pages holding
whole tiles (`tma_on_whole_tiles`); the default stays 1 until the sweep has timed 2. The AMD space has
no LOADS block (its calls read through pointers).
"""

from kernels.base import Variant
from kernels.common.decode import (
    COMBINE_SPACE,
    INTERPRETER_SPLIT,
    LOADS_POINTERS,
    LOADS_TMA,
    DecodeSplitKVBase,
    key_rows_between,
    tma_on_whole_tiles,
)
from registry.catalog import register
from tuning.space import ConfigSpace


@register
class DecodeSplitKVNvidia(DecodeSplitKVBase, Variant):
    vendor = "nvidia"
    spaces = {
        "split": ConfigSpace(
            blocks={"BLOCK_N": (16, 32, 64, 128, 256), "WAVES": (1, 2, 4, 8), "KV_HEADS": (1, 2, 4, 8),
                    "LOADS": (LOADS_POINTERS, LOADS_TMA)},
            knobs={"num_warps": (2, 4, 8), "num_stages": (2, 3, 4)},
            keep=tma_on_whole_tiles(key_rows_between(64, 256)),
            defaults={"*": {"BLOCK_N": 128, "WAVES": 2, "KV_HEADS": 1, "LOADS": LOADS_POINTERS, "num_warps": 4,
                            "num_stages": 3}},
            interpreter=tuple({**shape, "LOADS": LOADS_POINTERS} for shape in INTERPRETER_SPLIT),
        ),
        "combine": COMBINE_SPACE,
    }
