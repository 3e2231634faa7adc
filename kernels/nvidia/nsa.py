"""nsa on NVIDIA Hopper (H100/H200): the shared NSA kernels (kernels/common/nsa/) with NVIDIA's config
spaces; the window role takes flash_attention's NVIDIA forward space and head-dim rules unchanged.

The compressed branch is a FlashAttention forward whose rows are tokens x the GQA group's heads, a
warpgroup (4 warps) per 64 rows (wgmma's M; `a_warpgroup_per_64_rows`). Its
second pass (the selection) streams the compressed keys again, so its shared memory holds three
streamed tiles per stage. The selected branch has only the group's heads as rows (16 at the target,
an mma.sync tile, not a wgmma one); what decides its speed is the K and V bytes in flight per SM from
L2 (BLOCK_N keys per step, num_stages buffers) against the registers and shared memory they take.
"""

from dataclasses import replace

from kreg.core.records import LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.common.nsa.backward import INTERPRETER, SWA_ROLES
from kreg.kernels.common.nsa.forward import cmp_tokens, slc_heads
from kreg.kernels.common.nsa.variant import INTERPRETER_TILES, NSAGroupCentricBase
from kreg.kernels.common.tiles import dot_block, next_pow2
from kreg.kernels.nvidia.flash_attention import AttentionNvidia
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


def a_warpgroup_per_64_rows(config: LaunchConfig, key: dict) -> bool:
    """Keep: a warpgroup (4 warps) per 64 rows (tokens x the group's heads, padded): 8 warps with fewer
    than 128 rows only split the other dimension, 4 warps with 128 rows hold a 128 x d fp32 accumulator
    and spill at d 128 (sm_90 compiles)."""
    group = key["h_q"] // key["h_kv"]
    rows = cmp_tokens(config.blocks["BLOCK_M"], group) * next_pow2(group)
    return rows >= 16 * config.num_warps and (config.num_warps == 8 or rows <= 64 or key["d"] <= 64)


@register
class NSAGroupCentricNvidia(NSAGroupCentricBase, Variant):
    vendor = "nvidia"
    WINDOW = AttentionNvidia()
    # Untimed until the first H100/H200 sweep; the defaults compile without spills for sm_90 at the
    # full preset's key (d 128, group 16).
    spaces = {
        "compress": ConfigSpace(
            blocks={"BLOCK_N": (16, 32)}, knobs={"num_warps": (4, 8), "num_stages": (1, 2)},
            defaults={"*": {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2}},
            interpreter=INTERPRETER_TILES["compress"],
        ),
        "cmp": ConfigSpace(
            blocks={"BLOCK_M": (64, 128), "BLOCK_N": (32, 64, 128)},
            knobs={"num_warps": (4, 8), "num_stages": (1, 2, 3)}, keep=a_warpgroup_per_64_rows,
            defaults={"*": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}},
            interpreter=INTERPRETER_TILES["cmp"],
        ),
        "swa": replace(AttentionNvidia.spaces["fwd"], interpreter=INTERPRETER_TILES["swa"]),
        "slc": ConfigSpace(
            blocks={"BLOCK_N": (16, 32, 64, 128)}, knobs={"num_warps": (2, 4, 8), "num_stages": (2, 3, 4)},
            defaults={"*": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}},
            interpreter=INTERPRETER_TILES["slc"],
        ),
        # Backward (kernels/common/nsa/backward.py). Defaults: the H200 sweep's picks at the target (t
        # 65536, d 128, group 16; backward 102.8 -> 69.1 ms), no spills on sm_90. The selected-branch
        # dK/dV runs 32 key rows against 64 query rows a step at 4 warps (64 key rows need 8 warps and
        # fit only 32 query rows; half the rows a step was 1.7x slower there).
        "bwd_gate": ConfigSpace(
            blocks={"BLOCK_M": (16, 32, 64)}, knobs={"num_warps": (4, 8), "num_stages": (1,)},
            defaults={"*": {"BLOCK_M": 32, "num_warps": 4, "num_stages": 1}}, interpreter=INTERPRETER["bwd_gate"],
        ),
        "bwd_cmp_dq": ConfigSpace(
            blocks={"BLOCK_M": (64, 128), "BLOCK_N": (32, 64)}, knobs={"num_warps": (4, 8), "num_stages": (2, 3)},
            defaults={"*": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}},
            interpreter=INTERPRETER["bwd_cmp_dq"],
        ),
        "bwd_cmp_dkv": ConfigSpace(
            blocks={"BLOCK_M": (16, 32), "BLOCK_N": (64, 128), "BLOCK_T": (1024, 2048, 4096)},
            knobs={"num_warps": (4, 8), "num_stages": (2, 3)},
            defaults={"*": {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_T": 1024, "num_warps": 4, "num_stages": 3}},
            interpreter=INTERPRETER["bwd_cmp_dkv"],
        ),
        "bwd_slc_dq": ConfigSpace(
            blocks={"BLOCK_N": (32, 64)}, knobs={"num_warps": (2, 4, 8), "num_stages": (1, 2, 3)},
            defaults={"*": {"BLOCK_N": 64, "num_warps": 2, "num_stages": 2}}, interpreter=INTERPRETER["bwd_slc_dq"],
        ),
        "bwd_slc_dkv": ConfigSpace(
            blocks={"BLOCK_M": (16, 32, 64), "BLOCK_N": (32, 64)},
            knobs={"num_warps": (4, 8), "num_stages": (1, 2, 3)},
            defaults={"*": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}},
            interpreter=INTERPRETER["bwd_slc_dkv"],
        ),
        **{role: replace(AttentionNvidia.spaces[name], interpreter=INTERPRETER[role])
           for role, name in SWA_ROLES.items()},
    }
    HEAD_DIM_DEFAULTS = {
        "cmp": ((128, {}), (256, {"BLOCK_N": 32, "num_stages": 1})),
        "slc": ((128, {}), (256, {"BLOCK_N": 32, "num_stages": 2})),
    }

    def shared_bytes(self, role: str, config: LaunchConfig, key: dict) -> int:
        """Resident Q plus the streamed K/V buffers (bf16/fp16), as sm_90 compiles at d 128 show: the
        compressed branch holds num_stages buffers of K and V (its selection pass and the head sum
        reuse them), the selected branch num_stages - 1 (its first stage goes to the hoisted ids)."""
        blocks, stages, block_d = config.blocks, config.num_stages, dot_block(key["d"])
        group = key["h_q"] // key["h_kv"]
        if role == "compress":
            return 2 * block_d * 2 * stages * blocks["BLOCK_N"] if stages > 1 else 0
        if role == "slc":
            return 2 * block_d * (slc_heads(group) + 2 * max(stages - 1, 1) * blocks["BLOCK_N"])
        rows = cmp_tokens(blocks["BLOCK_M"], group) * next_pow2(group)
        return 2 * block_d * (rows + 2 * stages * blocks["BLOCK_N"])
