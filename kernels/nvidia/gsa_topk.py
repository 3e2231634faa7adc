"""gsa_topk on NVIDIA Hopper (H100/H200): the shared radix-select kernel with NVIDIA's config space.

Each pass over a query block's keys is the indexer's math without its store: a dot per key block and
two MUFU operations per head and pair, plus a few integer operations per pair to count or place the key;
so the score tile (BLOCK_Q * 4 heads by BLOCK_K) and the programs in flight (WAVES per SM) decide the
speed. TILE sizes the list select's steps, which are L2 reads of the lists.
"""

from kernels.base import Variant
from kernels.common.gsa_indexer import score_tile_fits
from kernels.common.gsa_topk import INTERPRETER_TOPK, GSATopkRadixBase
from registry.catalog import register
from tuning.space import ConfigSpace


@register
class GSATopkRadixNvidia(GSATopkRadixBase, Variant):
    vendor = "nvidia"
    spaces = {"fwd": ConfigSpace(
        blocks={"BLOCK_Q": (16, 32, 64), "BLOCK_K": (32, 64, 128), "TILE": (32, 64, 128), "WAVES": (1, 2, 4)},
        knobs={"num_warps": (4, 8), "num_stages": (1, 2, 3)},
        keep=score_tile_fits,
        # Untimed until the first H100/H200 sweep.
        defaults={"*": {"BLOCK_Q": 16, "BLOCK_K": 64, "TILE": 64, "WAVES": 2, "num_warps": 4, "num_stages": 2}},
        interpreter=INTERPRETER_TOPK,
    )}
