"""gsa_topk on NVIDIA Hopper (H100/H200): the shared streaming kernel with NVIDIA's config space.

The stream is the indexer's math without its store: a dot per key block and two MUFU operations per
head and pair, so the score tile (BLOCK_Q * 4 heads by BLOCK_K) and the programs in flight (WAVES per
SM, each with its own workspace lists) decide the speed; TILE sizes the compaction's steps, which are
L2 reads of the lists.
"""

from kernels.base import Variant
from kernels.common.gsa_indexer import score_tile_fits
from kernels.common.gsa_topk import INTERPRETER_TOPK, GSATopkStreamingBase
from registry.catalog import register
from tuning.space import ConfigSpace


@register
class GSATopkStreamingNvidia(GSATopkStreamingBase, Variant):
    vendor = "nvidia"
    spaces = {"fwd": ConfigSpace(
        blocks={"BLOCK_Q": (16, 32, 64), "BLOCK_K": (32, 64, 128), "TILE": (32, 64, 128), "WAVES": (1, 2, 4)},
        knobs={"num_warps": (4, 8), "num_stages": (1, 2, 3)},
        keep=score_tile_fits,
        # Untimed until the first H100/H200 sweep; 234 registers, no spills on sm_90 (a 256-entry list
        # tile spills hundreds of bytes).
        defaults={"*": {"BLOCK_Q": 32, "BLOCK_K": 64, "TILE": 64, "WAVES": 2, "num_warps": 8, "num_stages": 2}},
        interpreter=INTERPRETER_TOPK,
    )}
