"""nsa on AMD CDNA3/CDNA4 (MI300X gfx942, MI355X gfx950): the shared NSA kernels (kernels/common/nsa/)
with AMD's config spaces and knobs; the window role takes flash_attention's AMD forward space and
head-dim rules unchanged.

A wavefront is 64 lanes and owns rows / num_warps rows of the compressed branch's products (at least
16; 32 for the 32x32 MFMA, `rows_per_wavefront`). The selected branch has 16 rows at the target (the
group's heads), one 16x16 MFMA tile: matrix_instr_nonkdim 16 only. Two GEMMs in one loop, so
num_stages 1 or 2, LDS (64 KiB on gfx942, 160 KiB on gfx950) holding about one operand tile set at a
time; waves_per_eu trades registers for waves in flight that hide the L2 reads of the selected blocks.
kpack 2 exists on gfx942 only.
"""

from dataclasses import replace

from kreg.core.records import LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.amd.flash_attention import AttentionAmd
from kreg.kernels.common.nsa.backward import INTERPRETER, SWA_ROLES
from kreg.kernels.common.nsa.forward import cmp_tokens, slc_heads
from kreg.kernels.common.nsa.variant import INTERPRETER_TILES, NSAGroupCentricBase
from kreg.kernels.common.tiles import dot_block, next_pow2
from kreg.ops.catalog import register
from kreg.ops.variant import Variant

_KNOBS = {"num_warps": (4, 8), "num_stages": (1, 2), "waves_per_eu": (0, 1, 2), "matrix_instr_nonkdim": (16, 32),
          "kpack": (1,)}
_DEFAULT_KNOBS = {"waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 1}


def rows_per_wavefront(config: LaunchConfig, key: dict) -> bool:
    """Keep: each wavefront owns rows / num_warps rows of the compressed branch's products (tokens x
    the group's heads, padded): at least 16, and at least 32 for the 32x32 MFMA."""
    group = key["h_q"] // key["h_kv"]
    per_wave = cmp_tokens(config.blocks["BLOCK_M"], group) * next_pow2(group) // config.num_warps
    return per_wave >= 16 and (config.matrix_instr_nonkdim != 32 or per_wave >= 32)


@register
class NSAGroupCentricAmd(NSAGroupCentricBase, Variant):
    vendor = "amd"
    WINDOW = AttentionAmd()
    # Untimed (no AMD GPU here); the defaults compile without spills for gfx942 and gfx950 at the full
    # preset's key (d 128, group 16).
    spaces = {
        "compress": ConfigSpace(
            blocks={"BLOCK_N": (8, 16, 32, 64)},
            knobs={"num_warps": (2, 4, 8), "num_stages": (1,), "waves_per_eu": (0, 1, 2)},
            defaults={"*": {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "waves_per_eu": 0}},
            interpreter=INTERPRETER_TILES["compress"],
        ),
        "cmp": ConfigSpace(
            blocks={"BLOCK_M": (64, 128), "BLOCK_N": (32, 64)}, knobs=_KNOBS, arch={"gfx942": {"kpack": (1, 2)}},
            keep=rows_per_wavefront,
            defaults={"*": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1, **_DEFAULT_KNOBS}},
            interpreter=INTERPRETER_TILES["cmp"],
        ),
        "swa": replace(AttentionAmd.spaces["fwd"], interpreter=INTERPRETER_TILES["swa"]),
        "slc": ConfigSpace(
            blocks={"BLOCK_N": (16, 32, 64, 128)},
            knobs={**_KNOBS, "num_warps": (2, 4, 8), "matrix_instr_nonkdim": (16,)},
            arch={"gfx942": {"kpack": (1, 2)}},
            defaults={"*": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1, **_DEFAULT_KNOBS}},
            interpreter=INTERPRETER_TILES["slc"],
        ),
        # Backward (kernels/common/nsa/backward.py). Defaults compile without spills for gfx942 and
        # gfx950 at d 128, group 16; 8-warp 64-row dK/dV tiles spill on gfx942.
        "bwd_gate": ConfigSpace(
            blocks={"BLOCK_M": (16, 32, 64)}, knobs={"num_warps": (4, 8), "num_stages": (1,)},
            defaults={"*": {"BLOCK_M": 32, "num_warps": 4, "num_stages": 1}}, interpreter=INTERPRETER["bwd_gate"],
        ),
        "bwd_cmp_dq": ConfigSpace(
            blocks={"BLOCK_M": (32, 64, 128), "BLOCK_N": (16, 32, 64)}, knobs=_KNOBS,
            arch={"gfx942": {"kpack": (1, 2)}},
            defaults={"*": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1, **_DEFAULT_KNOBS}},
            interpreter=INTERPRETER["bwd_cmp_dq"],
        ),
        "bwd_cmp_dkv": ConfigSpace(
            blocks={"BLOCK_M": (16, 32), "BLOCK_N": (32, 64, 128), "BLOCK_T": (1024, 2048, 4096)}, knobs=_KNOBS,
            arch={"gfx942": {"kpack": (1, 2)}},
            defaults={"*": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_T": 2048, "num_warps": 4, "num_stages": 1,
                            **_DEFAULT_KNOBS}},
            interpreter=INTERPRETER["bwd_cmp_dkv"],
        ),
        "bwd_slc_dq": ConfigSpace(
            blocks={"BLOCK_N": (16, 32, 64)}, knobs={**_KNOBS, "matrix_instr_nonkdim": (16,)},
            arch={"gfx942": {"kpack": (1, 2)}},
            defaults={"*": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1, **_DEFAULT_KNOBS}},
            interpreter=INTERPRETER["bwd_slc_dq"],
        ),
        "bwd_slc_dkv": ConfigSpace(
            blocks={"BLOCK_M": (16, 32), "BLOCK_N": (32, 64)}, knobs=_KNOBS, arch={"gfx942": {"kpack": (1, 2)}},
            defaults={"*": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, **_DEFAULT_KNOBS}},
            interpreter=INTERPRETER["bwd_slc_dkv"],
        ),
        **{role: replace(AttentionAmd.spaces[name], interpreter=INTERPRETER[role])
           for role, name in SWA_ROLES.items()},
    }
    HEAD_DIM_DEFAULTS = {
        "cmp": ((128, {}), (256, {"BLOCK_M": 64, "num_warps": 4, "waves_per_eu": 1})),
        "slc": ((128, {}), (256, {"BLOCK_N": 32})),
    }

    def shared_bytes(self, role: str, config: LaunchConfig, key: dict) -> int:
        """LDS holds about one operand tile set at a time (as the attention family's compiles show)."""
        blocks, stages, block_d = config.blocks, config.num_stages, dot_block(key["d"])
        group = key["h_q"] // key["h_kv"]
        if role == "compress":
            return 0
        if role == "slc":
            return 2 * block_d * max(slc_heads(group), stages * blocks["BLOCK_N"])
        rows = cmp_tokens(blocks["BLOCK_M"], group) * next_pow2(group)
        return 2 * block_d * max(rows, stages * blocks["BLOCK_N"])
