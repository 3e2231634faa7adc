"""decode on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared split-KV kernels with AMD's
config space. A wavefront is 64 lanes, so a program covers twice the rows of an NVIDIA warp with the
same num_warps; num_stages 1-2 (LDS holds one K/V tile set at a time on gfx942's 64 KiB); the MI300X
has 304 CUs and the MI355X 256, so WAVES spreads a batch further than on Hopper. KV_HEADS kv heads per
program keep a step at 32..128 key rows (KV_HEADS * BLOCK_N), v2's tile sizes: a 64-lane wavefront
holds half the accumulator registers per lane of a 32-lane warp, and LDS bounds the tiles; each
wavefront owns whole heads (num_warps <= KV_HEADS). Untimed: no AMD GPU here; the defaults compile
without spills for gfx942 and gfx950.
"""

from kreg.core.space import ConfigSpace
from kreg.kernels.common.decode import COMBINE_SPACE, INTERPRETER_SPLIT, DecodeSplitKVBase, key_rows_between
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class DecodeSplitKVAmd(DecodeSplitKVBase, Variant):
    vendor = "amd"
    spaces = {
        "split": ConfigSpace(
            blocks={"BLOCK_N": (16, 32, 64, 128), "WAVES": (1, 2, 4), "KV_HEADS": (1, 2, 4, 8)},
            knobs={"num_warps": (2, 4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 2, 4),
                   "matrix_instr_nonkdim": (16,), "kpack": (1,)},
            keep=key_rows_between(32, 128),
            defaults={"*": {"BLOCK_N": 64, "WAVES": 2, "KV_HEADS": 1, "num_warps": 4, "num_stages": 1,
                            "waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 1}},
            interpreter=INTERPRETER_SPLIT,
        ),
        "combine": COMBINE_SPACE,
    }
