"""sparse_mla's variant logic, shared by both vendors: `_SparseMLAFunction` (autograd),
`sparse_mla_forward` (one call, its backward when autograd asks for one), `SparseMLALaunch` (launch,
bind and backward of every sparse_mla variant, around its forward launcher and backward passes),
`SparseMLAHeadBlockBase` (the head-block variant's kernels by role, support, defaults and static
pruning), and what both vendors' spaces take: the `heads_fit_group` keep predicate, the pre pass's
space and the interpreter's block shapes. kernels/nvidia/sparse_mla.py and kernels/amd/sparse_mla.py
subclass it with `Variant` and set their data.
"""

from __future__ import annotations

import functools

import torch

from kreg.core.records import CallConfig, LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.common.launch import LaunchCache
from kreg.kernels.common.sparse_mla.backward import (
    HEAD_BLOCK_PASSES,
    BackwardPasses,
    _backward,
    _sparse_mla_bwd_dkv_kernel,
    _sparse_mla_bwd_dq_kernel,
    _sparse_mla_bwd_fused_kernel,
    _sparse_mla_bwd_pre_kernel,
    _sparse_mla_bwd_sum_kernel,
)
from kreg.kernels.common.sparse_mla.forward import _forward, _sparse_mla_fwd_kernel
from kreg.kernels.common.sparse_mla.gather import d_tiles_that_fit, dim_blocks, group_head_cap
from kreg.ops.sparse_mla import SparseMLAOutput
from kreg.ops.variant import CallPlan


def _batched(x: torch.Tensor | None, batched: bool) -> torch.Tensor | None:
    return x if x is None or batched else x.unsqueeze(0)


class _SparseMLAFunction(torch.autograd.Function):
    """Autograd for sparse MLA. The default backward adds each query's dkv rows with fp32 atomics, so
    its summation order, and the last bits of dkv, vary between runs; with `deterministic` (or
    torch.use_deterministic_algorithms) it takes the passes without atomics."""

    @staticmethod
    def forward(ctx, launchers, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, config: CallConfig,
                deterministic: bool):
        run_forward, ctx.passes = launchers
        out, max_logits, lse = run_forward(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, config["fwd"])
        ctx.save_for_backward(q, kv, indices, attn_sink, topk_length, out, lse)
        ctx.sm_scale, ctx.d_v, ctx.config, ctx.deterministic = sm_scale, d_v, config, deterministic
        ctx.mark_non_differentiable(max_logits, lse)
        return out, max_logits, lse

    @staticmethod
    def backward(ctx, dout, _dmax, _dlse):
        q, kv, indices, attn_sink, topk_length, out, lse = ctx.saved_tensors
        deterministic = ctx.deterministic or torch.are_deterministic_algorithms_enabled()
        dq, dkv, dsink = _backward(q, kv, indices, ctx.sm_scale, ctx.d_v, attn_sink, topk_length, out, lse,
                                   dout, ctx.config, deterministic, ctx.passes)
        return None, dq, dkv, None, None, None, dsink, None, None, None


def sparse_mla_forward(args: dict, config: CallConfig, run_forward, passes: BackwardPasses) -> SparseMLAOutput:
    """Launch sparse MLA on validated arguments (ops.sparse_mla's dict) with the "fwd" role's
    config; a backward, when autograd asks for one, runs the "bwd_pre" and "bwd_fused" roles (or, when
    deterministic, "bwd_pre", "bwd_dq", "bwd_dkv" and "bwd_sum"). `run_forward` is the forward launcher
    (batched-layout tensors in, (out, max_logits, lse) out) and `passes` the backward passes' (see
    BackwardPasses): this module's head-block kernels, or another variant's."""
    q, kv, indices = args["q"], args["kv"], args["indices"]
    batched = q.dim() == 4
    qb, kvb, ib = _batched(q, batched), _batched(kv, batched), _batched(indices, batched)
    lengths = _batched(args["topk_length"], batched)
    sink = args["attn_sink"]
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad
                                              or (sink is not None and sink.requires_grad))
    if wants_grad:
        out, max_logits, lse = _SparseMLAFunction.apply((run_forward, passes), qb, kvb, ib, args["sm_scale"],
                                                        args["d_v"], sink, lengths, config, args["deterministic"])
    else:
        out, max_logits, lse = run_forward(qb, kvb, ib, args["sm_scale"], args["d_v"], sink, lengths, config["fwd"])
    if not batched:
        out, max_logits, lse = out[0], max_logits[0], lse[0]
    return SparseMLAOutput(out, max_logits, lse)


# ----------------------------------------------------------------------------- the variants
def heads_fit_group(config: LaunchConfig, key: dict) -> bool:
    """Keep: a head block (dkv's head chunk too) no wider than the group's heads rounded up to a power
    of two; a wider one would only compute masked rows."""
    return config.blocks["BLOCK_H"] <= group_head_cap(key["h_q"] // key["h_kv"])


class SparseMLALaunch:
    """`launch` and `bind` of every sparse_mla variant: its forward launcher (`run_forward`) and backward
    passes (`passes`: the fused pass and the deterministic dq pass) around this module's backward. The deterministic
    backward's roles are gated and timed under `deterministic=True` (`role_arguments`), the only calls
    that run them."""

    run_forward = staticmethod(_forward)
    passes = HEAD_BLOCK_PASSES
    role_arguments = {role: {"deterministic": True} for role in ("bwd_dq", "bwd_dkv", "bwd_sum")}

    def launch(self, args: dict, plan: CallPlan) -> SparseMLAOutput:
        return sparse_mla_forward(args, plan.config, self.run_forward, self.passes)

    def bind(self, plan: CallPlan):
        config, run_forward, passes = plan.config, self.run_forward, self.passes
        return lambda args: sparse_mla_forward(args, config, run_forward, passes)

    def bind_cached(self, plan: CallPlan):
        """`bind`, the forward launched through a `LaunchCache` (the backward keeps Triton's launch)."""
        config, passes = plan.config, self.passes
        run_forward = functools.partial(self.run_forward, launch=LaunchCache())
        return lambda args: sparse_mla_forward(args, config, run_forward, passes)

    def backward(self, args: dict, plan: CallPlan, outputs: tuple, grad: torch.Tensor) -> dict:
        """The backward passes on the forward's saved out and lse (what `_SparseMLAFunction` runs)."""
        batched = args["q"].dim() == 4
        q, kv, indices, lengths, out, lse, dout = (
            _batched(t, batched)
            for t in (args["q"], args["kv"], args["indices"], args["topk_length"], outputs[0], outputs[2], grad))
        deterministic = args["deterministic"] or torch.are_deterministic_algorithms_enabled()
        dq, dkv, dsink = _backward(q, kv, indices, args["sm_scale"], args["d_v"], args["attn_sink"], lengths, out,
                                   lse, dout, plan.config, deterministic, self.passes)
        if not batched:
            dq, dkv = dq[0], dkv[0]
        return {"q": dq, "kv": dkv, "attn_sink": dsink}


class SparseMLAHeadBlockBase(SparseMLALaunch):
    """The head-block variant's logic; each vendor file subclasses it with `Variant` and sets its data:

    spaces: a ConfigSpace per role: "fwd" (blocks BLOCK_H, BLOCK_TOPK and D_SPLIT, the value part of
        d_qk in 1 or 2 D tiles); the default backward's "bwd_pre" (BLOCK_H) and "bwd_fused" (BLOCK_H,
        BLOCK_TOPK and D_SPLIT, the value part of [Q; dO] in that many column chunks); the deterministic
        backward's "bwd_dq" (BLOCK_H, BLOCK_TOPK), "bwd_dkv" (BLOCK_H, its head chunk, and BLOCK_TOPK)
        and "bwd_sum" (BLOCK_D columns per program); each with a head block keeps `heads_fit_group`;
    ACC_REGS_LIMIT: the fp32 accumulator registers per thread (out's BLOCK_H * BLOCK_DV, dq's the same,
        dkv's BLOCK_TOPK * BLOCK_DV, over the threads) above which a config cannot avoid spilling on
        that vendor (AMD's unified VGPR/AGPR file is larger), further capped at half of each thread's
        share of the register file;
    Q_IN_SHARED: whether Q stays in shared memory for the whole loop (Hopper's wgmma reads its A
        operand from there) or only passes through it once on its way to registers (AMD).
    """

    op = "sparse_mla"
    name = "sparse_mla_headblock"
    kernels = {"fwd": _sparse_mla_fwd_kernel, "bwd_pre": _sparse_mla_bwd_pre_kernel,
               "bwd_fused": _sparse_mla_bwd_fused_kernel, "bwd_dq": _sparse_mla_bwd_dq_kernel,
               "bwd_dkv": _sparse_mla_bwd_dkv_kernel, "bwd_sum": _sparse_mla_bwd_sum_kernel}
    ACC_REGS_LIMIT = 128
    Q_IN_SHARED = True

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d_qk"] <= 1024

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        """The space's default as a launch runs it: the head block capped by the group's heads, and (fwd,
        bwd_fused) no more D tiles than leave each 16 columns (a narrow value part), so that the default
        a compile-only report judges at a key is the kernel that runs there."""
        config = super().role_default(role, key, device)
        blocks = dict(config.blocks)
        if "BLOCK_H" in blocks:
            blocks["BLOCK_H"] = min(blocks["BLOCK_H"], group_head_cap(key["h_q"] // key["h_kv"]))
        if role in ("fwd", "bwd_fused") and "D_SPLIT" in blocks:
            block_dv, _ = dim_blocks(key["d_qk"], key["d_v"])
            blocks["D_SPLIT"] = d_tiles_that_fit(blocks["D_SPLIT"], block_dv)
        return config if blocks == config.blocks else config.model_copy(update={"blocks": blocks})

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        """Static pruning of what cannot fit; loose on purpose (the compile check is authoritative)."""
        if device.key == "cpu" or role == "bwd_sum":
            return None
        block_dv, block_dt = dim_blocks(key["d_qk"], key["d_v"])
        blocks = config.blocks
        threads = config.num_warps * device.warp_size
        # The accumulator may take at most half of a thread's share of the register file.
        limit = min(self.ACC_REGS_LIMIT, device.registers_per_sm // threads // 2)
        rows = blocks["BLOCK_TOPK"] if role == "bwd_dkv" else blocks["BLOCK_H"]
        acc_regs = rows * block_dv // threads
        if acc_regs > limit:
            return f"accumulator needs {acc_regs} registers per thread (> {limit})"
        if role not in ("fwd", "bwd_fused"):
            return None
        tiles = blocks["D_SPLIT"]
        if block_dv // tiles < 16:
            return f"D tiles of {block_dv // tiles} columns (< 16, tl.dot's K)"
        # The value part dominates the tiles: the gathered kv tile stays resident for the pipeline's
        # stages in flight; Q (the fused backward: [Q; dO] and Q's tail) stays resident on NVIDIA and
        # passes through once on AMD, where the operands go through LDS one dot (one D tile) at a time.
        if role == "fwd":
            kv_tile = blocks["BLOCK_TOPK"] * block_dv * 2
            q_tile = blocks["BLOCK_H"] * block_dv * 2
            resident = kv_tile * max(1, config.num_stages - 1)
        else:
            kv_tile = blocks["BLOCK_TOPK"] * (block_dv + block_dt) * 2
            q_tile = blocks["BLOCK_H"] * (2 * block_dv + block_dt) * 2
            resident = kv_tile * max(1, config.num_stages)
        smem = resident + q_tile if self.Q_IN_SHARED else max(resident, q_tile) // tiles
        if smem > device.shared_mem_bytes:
            return f"needs ~{smem} B of shared memory/LDS (> {device.shared_mem_bytes})"
        return None


# The interpreter's block shapes, shared by both vendors (their defaults first).
INTERPRETER_FWD = ({"BLOCK_H": 16, "BLOCK_TOPK": 16, "D_SPLIT": 1}, {"BLOCK_H": 16, "BLOCK_TOPK": 32, "D_SPLIT": 2})
INTERPRETER_PRE = ({"BLOCK_H": 16},)
# The pre pass (Delta, shift, sink terms: row reductions, no products) has no vendor-specific knob:
# both vendors' variants take this space.
BWD_PRE_SPACE = ConfigSpace(blocks={"BLOCK_H": (16, 32)}, knobs={"num_warps": (4,)}, keep=heads_fit_group,
                            defaults={"*": {"BLOCK_H": 16, "num_warps": 4}}, interpreter=INTERPRETER_PRE)
INTERPRETER_FUSED = ({"BLOCK_H": 16, "BLOCK_TOPK": 16, "D_SPLIT": 2}, {"BLOCK_H": 32, "BLOCK_TOPK": 32, "D_SPLIT": 1})
INTERPRETER_DQ = ({"BLOCK_H": 32, "BLOCK_TOPK": 64}, {"BLOCK_H": 16, "BLOCK_TOPK": 32})
INTERPRETER_DKV = ({"BLOCK_H": 16, "BLOCK_TOPK": 64}, {"BLOCK_H": 16, "BLOCK_TOPK": 32})
INTERPRETER_SUM = ({"BLOCK_D": 64},)
