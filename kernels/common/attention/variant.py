"""The attention family as a variant: the autograd Function over the forward and backward launchers,
the entry point a call runs (`attention_call`), the interpreter's tiles per role, and
`AttentionTiledBase`, the variant logic (support, pruning, defaults per head dim and shared memory,
launch and bind, the custom op's backward) each vendor's flash_attention and sink_attention files
subclass with their spaces. A variant with kernels of its own (the Hopper Gluon ones) keeps this
logic and replaces the launchers (`launchers`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.attention.backward import (
    _attention_bwd_dkv_kernel,
    _attention_bwd_dq_kernel,
    _attention_bwd_pre_kernel,
    attention_backward,
)
from kreg.kernels.common.attention.forward import _attention_fwd_kernel, attention_forward
from kreg.kernels.common.attention.tile_rules import packing_reason, tile_blocks
from kreg.kernels.common.launch import LaunchCache, triton_launch
from kreg.kernels.common.tiles import dot_block
from kreg.ops.variant import CallPlan


# ----------------------------------------------------------------------------- autograd and the entry point
class _AttentionFunction(torch.autograd.Function):
    """Autograd for the family: the forward kernel (`forward`: `attention_forward` or another variant's
    forward launcher with its signature) keeps lse for the backward (`backward`: `attention_backward`
    or another variant's backward launcher with its signature). The returned lse is not
    differentiable (as in FlashAttention); gradients flow from `out` to q, k, v and sinks. No atomics
    anywhere, so gradients are bitwise reproducible."""

    @staticmethod
    def forward(ctx, forward, backward, q, k, v, sinks, args: Mapping, config: CallConfig, launch):
        out, lse = forward(args, config["fwd"], keep_lse=True, launch=launch)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.rest = {name: value for name, value in args.items() if name not in ("q", "k", "v", "sinks")}
        ctx.config = config
        ctx.backward = backward
        ctx.launch = launch
        ctx.mark_non_differentiable(lse)
        return (out, lse) if args["return_lse"] else out

    @staticmethod
    def backward(ctx, dout, *_lse_grad):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dq, dk, dv, dsinks = ctx.backward(q, k, v, sinks, out, lse, dout, ctx.rest, ctx.config, ctx.launch)
        return None, None, dq, dk, dv, dsinks, None, None, None


def attention_call(args: Mapping, config: CallConfig, launch: Callable[..., Any] = triton_launch,
                   forward: Callable[..., tuple] = attention_forward,
                   backward: Callable[..., tuple] = attention_backward):
    """flash_attention or sink_attention on the op contract's validated args (sink_attention's carry
    `sinks`): `out`, or `(out, lse)` with `return_lse`.

    The forward runs with the "fwd" role's config; when grad is enabled and an input requires grad it
    runs under `_AttentionFunction`, whose backward launches the "bwd_pre", "bwd_dkv" and "bwd_dq"
    roles' configs. `deterministic` needs nothing: no kernel here uses atomics. `launch` runs every
    kernel of the call, forward and backward (a dispatch plan's `LaunchCache`, or Triton's launch);
    `forward` is the forward launcher (`attention_forward`'s signature) and `backward` the backward
    launcher (`attention_backward`'s): this module's kernels, or another variant's.
    """
    q, k, v = args["q"], args["k"], args["v"]
    sinks = args.get("sinks")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return _AttentionFunction.apply(forward, backward, q, k, v, sinks, args, config, launch)
    out, lse = forward(args, config["fwd"], keep_lse=False, launch=launch)
    return (out, lse) if args["return_lse"] else out


# ----------------------------------------------------------------------------- the variants
# The interpreter's tiles per role, its default first. Every extra tile is another interpreted run of
# each tiny preset in the conformance test (a backward one, a backward too), so the backward roles
# have one each; tests/test_attention_kernel.py runs the other tile shapes.
INTERPRETER_TILES = {
    "fwd": ({"BLOCK_M": 32, "BLOCK_N": 32, "HEADS": 1, "KEY_LOOPS": 3},
            {"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 2, "KEY_LOOPS": 1}),
    "bwd_pre": ({"BLOCK_M": 32},),
    "bwd_dkv": ({"BLOCK_M": 16, "BLOCK_N": 32},),
    "bwd_dq": ({"BLOCK_M": 32, "BLOCK_N": 16},),
}
# Which block a role's sequence-length dim bounds, and which block streams through the pipeline (the
# one to narrow when shared memory runs short).
_BLOCK_DIMS = {"BLOCK_M": "s_q", "BLOCK_N": "s_k"}
_STREAMED = {"fwd": "BLOCK_N", "bwd_dkv": "BLOCK_M", "bwd_dq": "BLOCK_N"}


class AttentionTiledBase:
    """The tiled family's variant logic; each (vendor, op) file subclasses it with `Variant` and sets:

    op, name: flash_attention's "flash_attention_tiled", sink_attention's "sink_attention_flash";
    spaces: a ConfigSpace per role: "fwd", "bwd_dkv" and "bwd_dq" (blocks BLOCK_M, BLOCK_N), "bwd_pre"
        (BLOCK_M), each with the vendor's knobs, keep rule and d 128 default;
    HEAD_DIM_DEFAULTS: per role, (largest head dim, fields) rows: the first row whose head dim fits
        changes those fields of the space's default;
    shared_bytes(role, config, block_d, elem): shared memory/LDS estimate, calibrated on real compiles.
    fp32 inputs are not supported (`supports` is False): dispatch sends them to the reference.
    """

    kernels = {"fwd": _attention_fwd_kernel, "bwd_pre": _attention_bwd_pre_kernel,
               "bwd_dkv": _attention_bwd_dkv_kernel, "bwd_dq": _attention_bwd_dq_kernel}
    HEAD_DIM_DEFAULTS: Mapping[str, tuple[tuple[int, dict], ...]] = {}

    def shared_bytes(self, role: str, config: LaunchConfig, block_d: int, elem: int) -> int:
        raise NotImplementedError

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d"] <= 256

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        blocks = config.blocks
        expected = set(self.spaces[role].blocks)
        if set(blocks) != expected:
            return f"blocks must be {sorted(expected)}, got {sorted(blocks)}"
        tiles = tile_blocks(blocks)
        if role != "bwd_pre" and min(tiles.values()) < 16:
            return f"tl.dot needs tiles of at least 16, got {blocks}"
        reason = packing_reason(blocks, key)
        if reason is not None:
            return reason
        # A tile longer than the (bucketed) sequence only computes masked rows or keys, unless no
        # smaller tile exists to take its place.
        smallest = self._smallest_blocks(role, device)
        for block, size in tiles.items():
            dim = _BLOCK_DIMS[block]
            if size > key[dim] and size > smallest[block]:
                return f"{block}={size} is longer than the {dim} bucket {key[dim]}"
        if device.key == "cpu":
            return None
        elem = 4 if key["dtype"] == "fp32" else 2
        need = self.shared_bytes(role, config, dot_block(key["d"]), elem)
        if need > device.shared_mem_bytes:
            return f"needs ~{need} B of shared memory/LDS (> {device.shared_mem_bytes} B)"
        return None

    def _smallest_blocks(self, role: str, device) -> dict[str, int]:
        return {name: min(values) for name, values in self.spaces[role].block_values(device).items()}

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        space = self.spaces[role]
        if device.key == "cpu":
            return space.default(device)
        base = space.default(device)
        fields = {**base.blocks, **base.knobs()}
        rows = self.HEAD_DIM_DEFAULTS.get(role, ())
        fields.update(next((row for d_max, row in rows if key["d"] <= d_max), {}))
        smallest = self._smallest_blocks(role, device)
        # Short sequences: no tile longer than its bucket (down to the space's smallest tile; a default
        # below that one stays).
        blocks = {name: min(fields.pop(name), max(smallest[name], key[_BLOCK_DIMS[name]])) if name in _BLOCK_DIMS
                  else fields.pop(name) for name in space.blocks}
        config = LaunchConfig(blocks=blocks, **fields)
        if space.keep is not None and not space.keep(config, key):
            config = config.model_copy(update={"num_warps": 4})
        # A device with less shared memory than the table assumes: fewer stages, then a narrower
        # streamed tile.
        streamed = _STREAMED.get(role)
        while self.prune_reason(role, config, key, device) is not None:
            if config.num_stages > 1:
                config = config.model_copy(update={"num_stages": config.num_stages - 1})
            elif streamed is not None and config.blocks[streamed] > 16:
                blocks = {**config.blocks, streamed: config.blocks[streamed] // 2}
                config = config.model_copy(update={"blocks": LaunchConfig(blocks=blocks).blocks})
            else:
                break
        return config

    def launchers(self, plan: CallPlan) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
        """The forward launcher (args, fwd config, keep_lse, launch) -> (out, lse or None) and the backward
        launcher (q, k, v, sinks, out, lse, dout, args, call config, launch) -> (dq, dk, dv, dsinks or
        None) of calls under `plan`: this module's kernels (the forward keeps its launch arguments per call
        signature for the plan's own config); a variant with other kernels replaces them."""
        own, prepared = plan.config["fwd"], {}

        def forward(args: Mapping, config: LaunchConfig, keep_lse: bool,
                    launch: Callable[..., Any] = triton_launch) -> tuple[torch.Tensor, torch.Tensor | None]:
            return attention_forward(args, config, keep_lse, launch, prepared if config is own else None)

        return forward, attention_backward

    def launch(self, args: dict, plan: CallPlan):
        forward, backward = self.launchers(plan)
        return attention_call(args, plan.config, forward=forward, backward=backward)

    def bind(self, plan: CallPlan):
        (forward, backward), config = self.launchers(plan), plan.config
        return lambda args: attention_call(args, config, forward=forward, backward=backward)

    def bind_cached(self, plan: CallPlan):
        (forward, backward), config, launches = self.launchers(plan), plan.config, LaunchCache()
        return lambda args: attention_call(args, config, launches, forward, backward)

    def backward(self, args: dict, plan: CallPlan, outputs: tuple, grad: torch.Tensor) -> dict:
        """The backward kernels on the forward's saved out and lse (registry/library.py's custom op);
        a call that returned no lse runs the forward again to keep it."""
        forward, backward = self.launchers(plan)
        out, lse = outputs[0], outputs[1]
        if not lse.numel():
            out, lse = forward(args, plan.config["fwd"], keep_lse=True)
        sinks = args.get("sinks")
        dq, dk, dv, dsinks = backward(args["q"], args["k"], args["v"], sinks, out, lse, grad, args, plan.config)
        return {"q": dq, "k": dk, "v": dv, "sinks": dsinks}
