"""GSA's sparse attention, the variants' shared logic: how a call of either variant runs, and the bases
the vendor files subclass. Every head of a query attends to the query's own top-k keys, through one of
two forwards and one backward:
- the head-block variant (`gsa_sparse_attention_headblock`) gathers each slot's rows
  (kernels.common.gsa_sparse_attention.headblock);
- the dense variant (`gsa_sparse_attention_dense`) attends over dense key tiles masked by a bitmap of
  each query's keys, for key sets that are a large fraction of the sequence
  (kernels.common.gsa_sparse_attention.dense);
- both take the head-block backward (`headblock_backward`: a dq pass, then a dkv pass over per-key
  query lists; no atomics).

Here: the autograd Function over a variant's forward passes and that backward; the entry points that
the bases' launchers and the custom op's backward call (`gsa_sparse_attention_forward`,
`gsa_sparse_attention_backward`); the two bases (`GSASparseAttentionHeadBlockBase`,
`GSASparseAttentionDenseBase`: roles and kernels, support, pruning, defaults); and what both vendors'
spaces are made of (`heads_fit`, the interpreter's block shapes, the build space, `dense_spaces`).
Semantics: `ops.gsa_sparse_attention.reference` (docs/op-contracts.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kreg.core.records import CallConfig, LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.common.gsa_sparse_attention.dense import _gsa_dense_build_kernel, _gsa_dense_fwd_kernel, dense_passes
from kreg.kernels.common.gsa_sparse_attention.headblock import (
    _gsa_sparse_attn_bwd_dkv_kernel,
    _gsa_sparse_attn_bwd_dq_kernel,
    _gsa_sparse_attn_fwd_kernel,
    headblock_backward,
    headblock_passes,
)
from kreg.kernels.common.tiles import cdiv, dot_block, next_pow2
from kreg.ops.variant import CallPlan


# ----------------------------------------------------------------------------- autograd and entry points
class _GSASparseAttentionFunction(torch.autograd.Function):
    """Autograd for GSA's sparse attention, either variant's forward (`passes`: `headblock_passes` or
    `dense_passes`) and the shared backward. The backward uses no atomics: its gradients are the same
    bits from run to run."""

    @staticmethod
    def forward(ctx, q, k, v, indices, sm_scale, topk_length, config: CallConfig, passes):
        out, lse = passes(q, k, v, indices, sm_scale, topk_length, config)
        ctx.save_for_backward(q, k, v, indices, topk_length, out, lse)
        ctx.sm_scale, ctx.config = sm_scale, config
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, indices, topk_length, out, lse = ctx.saved_tensors
        dq, dk, dv = headblock_backward(q, k, v, indices, ctx.sm_scale, topk_length, out, lse, dout.to(q.dtype),
                                        ctx.config["bwd_dq"], ctx.config["bwd_dkv"])
        return dq, dk, dv, None, None, None, None, None


# A variant's forward: (q, k, v, indices, sm_scale, topk_length, call config) -> (out, lse in log2 units).
Passes = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def gsa_sparse_attention_forward(args: dict, config: CallConfig, passes: Passes = headblock_passes) -> torch.Tensor:
    """Launch GSA's sparse attention on validated arguments (ops.gsa_sparse_attention's dict)
    with a variant's forward `passes` and its forward roles' configs; a backward, when autograd asks for
    one, runs the dq and dkv passes with the "bwd_dq" and "bwd_dkv" roles' configs."""
    q, k, v, indices, sm_scale, lengths = (args[n] for n in ("q", "k", "v", "indices", "sm_scale", "topk_length"))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _GSASparseAttentionFunction.apply(q, k, v, indices, sm_scale, lengths, config, passes)
    return passes(q, k, v, indices, sm_scale, lengths, config)[0]


def gsa_sparse_attention_backward(args: dict, config: CallConfig, grad: torch.Tensor,
                                  passes: Passes = headblock_passes) -> dict:
    """The gradients of q, k and v for the custom op's backward (registry/library.py): the op returns no
    lse, so the forward `passes` run again to get it, then the dq and dkv passes."""
    q, k, v, indices, sm_scale, lengths = (args[n] for n in ("q", "k", "v", "indices", "sm_scale", "topk_length"))
    out, lse = passes(q, k, v, indices, sm_scale, lengths, config)
    dq, dk, dv = headblock_backward(q, k, v, indices, sm_scale, lengths, out, lse, grad.to(q.dtype),
                                    config["bwd_dq"], config["bwd_dkv"])
    return {"q": dq, "k": dk, "v": dv}


# ----------------------------------------------------------------------------- the variants
def heads_fit(config: LaunchConfig, key: dict) -> bool:
    """Keep: a head block no wider than the query heads rounded up to a power of two (a wider one only
    gathers masked rows)."""
    return config.blocks["BLOCK_H"] <= next_pow2(key["h_q"])


class GSASparseAttentionHeadBlockBase:
    """The head-block variant's logic; each vendor file subclasses it with `Variant` and sets `spaces`
    ("fwd" and "bwd_dq": BLOCK_H heads by BLOCK_TOPK slots per gathered tile; "bwd_dkv": BLOCK_H heads
    by BLOCK_Q listed queries; each keeps `heads_fit`) and TILE_REGS_LIMIT (fp32 values per thread of
    one gathered tile above which a config spills)."""

    op = "gsa_sparse_attention"
    name = "gsa_sparse_attention_headblock"
    kernels = {"fwd": _gsa_sparse_attn_fwd_kernel, "bwd_dq": _gsa_sparse_attn_bwd_dq_kernel,
               "bwd_dkv": _gsa_sparse_attn_bwd_dkv_kernel}
    TILE_REGS_LIMIT = 128
    passes = staticmethod(headblock_passes)  # the forward's kernels (`Passes`)

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d"] <= 256

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        """Static pruning of what cannot stay in registers; loose (the compile check is authoritative)."""
        if device.key == "cpu":
            return None
        blocks = config.blocks
        rows = blocks["BLOCK_Q"] if role == "bwd_dkv" else blocks["BLOCK_TOPK"]
        per_thread = rows * blocks["BLOCK_H"] * dot_block(key["d"]) // (config.num_warps * device.warp_size)
        if per_thread > self.TILE_REGS_LIMIT:
            return f"a gathered tile holds {per_thread} fp32 values per thread (> {self.TILE_REGS_LIMIT})"
        return None

    def launch(self, args: dict, plan: CallPlan) -> torch.Tensor:
        return gsa_sparse_attention_forward(args, plan.config, self.passes)

    def bind(self, plan: CallPlan):
        config, passes = plan.config, self.passes
        return lambda args: gsa_sparse_attention_forward(args, config, passes)

    def backward(self, args: dict, plan: CallPlan, outputs: tuple, grad: torch.Tensor) -> dict:
        """The dq and dkv passes for the custom op's backward (registry/library.py); the op returns no
        lse, so the forward runs again to keep it."""
        return gsa_sparse_attention_backward(args, plan.config, grad, self.passes)


# Where the dense variant serves a key: its bucketed length (at least the call's) at most this many
# times k (dense tiles cost ~2 t^2 h d tensor-core FLOPs against the gathers' 4 t k h d bytes: break-even
# near t = 130 k, benchmarks/NOTES.md; half of that, to be safe), and a bitmap of at most this many
# bytes per batch row (the tuning key holds no batch size).
DENSE_T_PER_TOPK = 64
BITMAP_MAX_BYTES = 1 << 30


class GSASparseAttentionDenseBase(GSASparseAttentionHeadBlockBase):
    """The dense variant's logic (the `dense` module says how it works); each vendor file subclasses it
    with `Variant` and sets `spaces`: "build" (BLOCK_SLOTS slots per tile), "fwd" (BLOCK_M queries by
    BLOCK_N keys), and "fwd_extras", "bwd_dq", "bwd_dkv" (the head-block kernels, their spaces and
    TILE_REGS_LIMIT as the head-block variant's). Its priority is above the head block's, so untuned
    calls on the keys it serves take it; a tuned entry naming the head block still runs the head block."""

    name = "gsa_sparse_attention_dense"
    priority = 5
    kernels = {"build": _gsa_dense_build_kernel, "fwd_extras": _gsa_sparse_attn_fwd_kernel,
               "fwd": _gsa_dense_fwd_kernel, "bwd_dq": _gsa_sparse_attn_bwd_dq_kernel,
               "bwd_dkv": _gsa_sparse_attn_bwd_dkv_kernel}
    passes = staticmethod(dense_passes)
    # Fields of the dense kernel's default that change for head dims above 128 (vendor data).
    WIDE_HEAD_FWD: dict[str, int] = {}

    def supports(self, key: dict, device) -> bool:
        t = key["t"]
        return (super().supports(key, device) and t <= DENSE_T_PER_TOPK * key["topk"]
                and t * cdiv(t, 32) * 4 <= BITMAP_MAX_BYTES)

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        """The gather roles' pruning; the build and dense kernels are left to the compile check."""
        if role in ("build", "fwd"):
            return None
        return super().prune_reason(role, config, key, device)

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        config = super().role_default(role, key, device)
        if role != "fwd" or key["d"] <= 128 or device.key == "cpu":
            return config
        return self.spaces[role].make({**config.blocks, **config.knobs(), **self.WIDE_HEAD_FWD})


# The interpreter's block shapes, both vendors (the default first): head blocks narrower and wider than
# the tiny presets' heads, slot tiles that leave partial tiles.
INTERPRETER_FWD = ({"BLOCK_H": 8, "BLOCK_TOPK": 8}, {"BLOCK_H": 4, "BLOCK_TOPK": 16})
INTERPRETER_DKV = ({"BLOCK_H": 8, "BLOCK_Q": 8}, {"BLOCK_H": 4, "BLOCK_Q": 4})
# The dense variant's: its own kernels' tiles (the default first; 16 is tl.dot's smallest), and the
# head-block kernels' defaults only (the head-block variant runs their other shapes).
INTERPRETER_BUILD = ({"BLOCK_SLOTS": 8}, {"BLOCK_SLOTS": 32})
INTERPRETER_DENSE = ({"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 32, "BLOCK_N": 32})
# The build kernel's space, both vendors: it uses no matrix instructions or vendor knobs. One program per
# query; the atomics' latency is hidden by programs in flight, not by stages.
BUILD_SPACE = ConfigSpace(
    blocks={"BLOCK_SLOTS": (128, 256, 512, 1024)}, knobs={"num_warps": (1, 2, 4, 8), "num_stages": (1,)},
    defaults={"*": {"BLOCK_SLOTS": 256, "num_warps": 4, "num_stages": 1}},
    interpreter=INTERPRETER_BUILD,
)


def dense_spaces(headblock: dict[str, ConfigSpace], fwd: ConfigSpace) -> dict[str, ConfigSpace]:
    """The dense variant's spaces for a vendor: its own `fwd` space, the shared build space, and the
    head-block kernels' spaces for the extras pass and the backward (interpreter runs keep only their
    default tiles: the head-block variant covers the other shapes)."""
    return {
        "build": BUILD_SPACE,
        "fwd_extras": replace(headblock["fwd"], interpreter=INTERPRETER_FWD[:1]),
        "fwd": fwd,
        "bwd_dq": replace(headblock["bwd_dq"], interpreter=INTERPRETER_FWD[:1]),
        "bwd_dkv": replace(headblock["bwd_dkv"], interpreter=INTERPRETER_DKV[:1]),
    }
