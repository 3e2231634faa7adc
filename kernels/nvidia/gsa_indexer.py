"""gsa_indexer on NVIDIA Hopper (H100/H200): the shared tiled kernel with NVIDIA's config space.

The kernel writes b * t * t fp32 scores, so it is bound by that store and by the two MUFU operations per
head and pair (exp2 and the reciprocal of the sigmoid); the tile shape decides how many queries share a
key block's load and how long each program's store stream is. There is no loop, so num_stages only
matters for the overlap of the Q and K loads.
"""

from kreg.core.space import ConfigSpace
from kreg.kernels.common.gsa_indexer import INTERPRETER_INDEXER, GSAIndexerTiledBase, score_tile_fits
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class GSAIndexerTiledNvidia(GSAIndexerTiledBase, Variant):
    vendor = "nvidia"
    spaces = {"fwd": ConfigSpace(
        blocks={"BLOCK_Q": (16, 32, 64, 128), "BLOCK_K": (32, 64, 128, 256)},
        knobs={"num_warps": (4, 8), "num_stages": (1, 2)},
        keep=score_tile_fits,
        # Untimed until the first H100/H200 sweep: 128 rows (4 heads) by 128 keys, 64 registers of
        # scores per thread at 8 warps.
        defaults={"*": {"BLOCK_Q": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 1}},
        interpreter=INTERPRETER_INDEXER,
    )}
