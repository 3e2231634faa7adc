"""gsa_topk on NVIDIA Hopper (H100/H200): the shared radix-select kernel with NVIDIA's config space.

Every pass over a query block's keys is the indexer's math without its store (a wgmma per key block,
two MUFU operations per head and pair) plus about a dozen integer operations per pair to count the key
or place it; the emit pass also prefix-sums and stores its keys. With keys as the dot's rows, all of
a query's heads sit in one thread's registers when the warps split the keys only (BLOCK_K >= 16 *
num_warps); BLOCK_Q 16 at 4 warps takes 255 registers, so two programs share an SM (WAVES 2). TILE
sizes the list select's steps, reads of the lists.
"""

from kreg.core.space import ConfigSpace
from kreg.kernels.common.gsa_indexer import score_tile_fits
from kreg.kernels.common.gsa_topk import INTERPRETER_TOPK, GSATopkRadixBase
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class GSATopkRadixNvidia(GSATopkRadixBase, Variant):
    vendor = "nvidia"
    spaces = {"fwd": ConfigSpace(
        blocks={"BLOCK_Q": (8, 16, 32), "BLOCK_K": (32, 64, 128), "TILE": (32, 64, 128), "WAVES": (1, 2, 4)},
        knobs={"num_warps": (4, 8), "num_stages": (1, 2, 3)},
        keep=score_tile_fits,
        # The H100 and H200 sweeps' pick at T 32768; 255 registers, no spills on sm_90 (TILE 64 spills
        # 8 bytes since scores are clamped into the first bracket).
        defaults={"*": {"BLOCK_Q": 16, "BLOCK_K": 64, "TILE": 128, "WAVES": 2, "num_warps": 4, "num_stages": 2}},
        interpreter=INTERPRETER_TOPK,
    )}
