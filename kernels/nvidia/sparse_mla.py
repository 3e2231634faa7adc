"""sparse_mla on NVIDIA Hopper: two variants, their config spaces and what decides where each runs.

`sparse_mla_headblock`: the shared head-block kernels (kernels/common/sparse_mla/) with NVIDIA's config
space. Hopper's register file holds at most 128 fp32 accumulator values per thread next to the other
tiles, so BLOCK_H 128 with d_v 512 is pruned statically; 228 KB of shared memory allows deep pipelining
of the gathered K/V tiles.

`sparse_mla_warpspec`: warp-specialized Gluon kernels for the forward (sparse_mla_warpspec_fwd.py) and
for the fused backward pass and the deterministic dq pass (sparse_mla_warpspec_bwd.py); its other
backward passes are the head-block variant's. Their tiles are fixed, so its spaces hold the split of
warps and registers between the kernels' partitions; it runs where `supports` says (sm_90, kv rows
aligned to 16 elements, d_v and the rope tail in the ranges the kernels take).
"""

from __future__ import annotations

from kreg.core.records import LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.common.sparse_mla.backward import BackwardPasses
from kreg.kernels.common.sparse_mla.variant import (
    BWD_PRE_SPACE,
    INTERPRETER_DKV,
    INTERPRETER_DQ,
    INTERPRETER_FUSED,
    INTERPRETER_FWD,
    INTERPRETER_SUM,
    SparseMLAHeadBlockBase,
    heads_fit_group,
)
from kreg.kernels.nvidia.sparse_mla_gather import COLS
from kreg.kernels.nvidia.sparse_mla_warpspec_bwd import _sparse_mla_bwd_ws_kernel, dq_pass_ws, fused_pass_ws
from kreg.kernels.nvidia.sparse_mla_warpspec_bwd import shared_bytes as bwd_shared_bytes
from kreg.kernels.nvidia.sparse_mla_warpspec_fwd import _forward_ws, _sparse_mla_fwd_ws_kernel, shared_bytes
from kreg.ops.catalog import register
from kreg.ops.variant import Variant


@register
class SparseMLAHeadBlockNvidia(SparseMLAHeadBlockBase, Variant):
    vendor = "nvidia"
    spaces = {
        # The default: the fastest spill-free config measured on the H200 at the V3.2 shape
        # (benchmarks/NOTES.md): 64 heads per program, 64-slot tiles, 3 stages (255 registers with int32
        # row offsets).
        "fwd": ConfigSpace(
            blocks={"BLOCK_H": (16, 32, 64, 128), "BLOCK_TOPK": (16, 32, 64, 128), "D_SPLIT": (1, 2)},
            knobs={"num_warps": (4, 8, 16), "num_stages": (1, 2, 3, 4)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 64, "BLOCK_TOPK": 64, "D_SPLIT": 1, "num_warps": 8, "num_stages": 3}},
            interpreter=INTERPRETER_FWD,
        ),
        # The default backward: a small pre pass (Delta, shift, sink terms), then the fused pass. Its
        # default is the widest tile that compiles at every V3.2 preset key for sm_90 with no spill and
        # fits in shared memory: [Q; dO] of 64 heads (136 KB) and Q's tail stay resident beside the
        # pipelined 16-slot gathers (190 KB); it runs at 255 registers, and 2 stages spill 8 B at
        # h_q 64. 32-slot tiles spill at one stage and overflow shared memory at two (242 KB).
        "bwd_pre": BWD_PRE_SPACE,
        "bwd_fused": ConfigSpace(
            blocks={"BLOCK_H": (16, 32, 64), "BLOCK_TOPK": (16, 32), "D_SPLIT": (2, 4)},
            knobs={"num_warps": (4, 8), "num_stages": (1, 2, 3)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 64, "BLOCK_TOPK": 16, "D_SPLIT": 4, "num_warps": 8, "num_stages": 3}},
            interpreter=INTERPRETER_FUSED,
        ),
        # The deterministic backward's dq and dkv passes: the fastest spill-free pair measured on the
        # H200 at the V3.2 shape when they were the default backward (benchmarks/NOTES.md): dq with 32
        # heads per program (64 spill), dkv with 64-row tiles and 16-head chunks (32-head chunks at 3
        # stages need 240 KB of shared memory at run time).
        "bwd_dq": ConfigSpace(
            blocks={"BLOCK_H": (16, 32, 64), "BLOCK_TOPK": (32, 64)},
            knobs={"num_warps": (4, 8), "num_stages": (2, 3)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 32, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 2}},
            interpreter=INTERPRETER_DQ,
        ),
        "bwd_dkv": ConfigSpace(
            blocks={"BLOCK_H": (16, 32), "BLOCK_TOPK": (32, 64, 128)},
            knobs={"num_warps": (4, 8), "num_stages": (2, 3)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 16, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 3}},
            interpreter=INTERPRETER_DKV,
        ),
        # Adds the dkv pass's rows per kv row: bound by the rows' bytes and the latency of each load.
        "bwd_sum": ConfigSpace(
            blocks={"BLOCK_D": (64, 128, 256)},
            knobs={"num_warps": (1, 2, 4)},
            defaults={"*": {"BLOCK_D": 128, "num_warps": 1}},
            interpreter=INTERPRETER_SUM,
        ),
    }
    ACC_REGS_LIMIT = 128


# ----------------------------------------------------------------------------- the warp-specialized variant
# The roles whose kernels are the Gluon ones (fixed tiles), and the space of the Gluon backward kernel's
# two roles. Its default: the fused pass's winner at most of the 11 V3.2 keys swept on the H100
# (benchmarks/NOTES.md); every config is within ~1.5% of the best at the s_q 4096 keys. 224 registers
# spill at d_v 512.
GLUON_ROLES = ("fwd", "bwd_fused", "bwd_dq")
GLUON_BACKWARD_SPACE = ConfigSpace(
    blocks={"PRODUCER_WARPS": (2, 4), "GRADIENT_REGS": (208, 216, 224)},
    knobs={"num_warps": (4,)},
    defaults={"*": {"PRODUCER_WARPS": 2, "GRADIENT_REGS": 208, "num_warps": 4}},
)


@register
class SparseMLAWarpSpecializedHopper(SparseMLAHeadBlockNvidia):
    """Hopper only (wgmma, setmaxnreg); d_v a power of two in [64, 512] (each warpgroup's half of an
    accumulator, the forward's out and the backward's dQ, is one wgmma of N = d_v / 2 <= 256), a rope
    tail of at most 64 dims in 8-dim steps (whole 16-byte copies), kv rows aligned to 16 elements.
    Higher priority than the head-block kernel: it is the default where it runs. Its fused backward
    pass and the deterministic backward's dq pass are its own (one kernel, with and without its dkv
    atomics: kernels/nvidia/sparse_mla_warpspec_bwd.py); the pre pass and the deterministic dkv and sum
    passes are the head-block variant's (same kernels, same spaces).

    The tiles are fixed (forward: two buffers of one 64-slot block each, what fits beside Q; backward:
    32 slots, two stages, what fits beside [Q; dO]); the spaces are the producer's warps and the
    registers of the second warpgroup (the default partition gets the rest), the splits that compile
    without spills on sm_90."""

    name = "sparse_mla_warpspec"
    priority = 10
    runs_in_interpreter = False
    run_forward = staticmethod(_forward_ws)
    passes = BackwardPasses(fused_pass_ws, dq_pass_ws)
    kernels = {**SparseMLAHeadBlockNvidia.kernels, "fwd": _sparse_mla_fwd_ws_kernel,
               "bwd_fused": _sparse_mla_bwd_ws_kernel, "bwd_dq": _sparse_mla_bwd_ws_kernel}
    spaces = {
        **SparseMLAHeadBlockNvidia.spaces,
        # Four producer warps: with two, each holds twice the rows' indices and the producer spills at
        # its 56 registers. The default: the fastest at the V3.2 shape on the H100 (benchmarks/NOTES.md).
        "fwd": ConfigSpace(
            blocks={"PRODUCER_WARPS": (4,), "FOLLOWER_REGS": (200, 208, 216, 224, 232)},
            knobs={"num_warps": (4,)},
            defaults={"*": {"PRODUCER_WARPS": 4, "FOLLOWER_REGS": 216, "num_warps": 4}},
        ),
        "bwd_fused": GLUON_BACKWARD_SPACE,
        # The same kernel without its dkv atomics (the H100 table's winners: 224 registers).
        "bwd_dq": GLUON_BACKWARD_SPACE,
    }

    def supports(self, key: dict, device) -> bool:
        d_v, tail = key["d_v"], key["d_qk"] - key["d_v"]
        return (device.arch == "sm_90" and key["dtype"] in ("fp16", "bf16") and key["kv_aligned"]
                and 64 <= d_v <= 512 and d_v & (d_v - 1) == 0 and 0 <= tail <= COLS.value and tail % 8 == 0)

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        if role in GLUON_ROLES:  # no head block to cap: the tile is fixed
            return self.spaces[role].default(device)
        return super().role_default(role, key, device)

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        if role not in GLUON_ROLES:
            return super().prune_reason(role, config, key, device)
        need = (shared_bytes if role == "fwd" else bwd_shared_bytes)(key["d_v"], key["d_qk"] - key["d_v"])
        if need > device.shared_mem_bytes:
            return f"needs {need} B of shared memory (> {device.shared_mem_bytes})"
        return None
