"""flash_attention and sink_attention, forward and forward+backward, against torch SDPA and
FlexAttention at the ops' full preset shapes (what registry dispatch adds at tiny shapes:
benchmarks/dispatch.py).

FLOPs: forward `4 * b * h_q * pairs * d` (pairs = allowed query-key pairs, the op's cost model); a
backward counts 2.5x its forward, so forward+backward 3.5x (docs/performance.md).

Peers, measured in this process on the same inputs:
- torch SDPA (dense, no sinks: the PERF targets compare our sink kernel with SDPA without sinks) for
  every shape without a window, forward and forward+backward;
- FlexAttention, compiled, with a sliding-window block mask and the sink applied through its lse
  (`out * sigmoid(lse - sink)`), for the window shapes, forward and forward+backward;
- our own backward without sinks (flash_attention) beside sink_attention's backward, and the
  `deterministic=True` backward beside the default one.
Ours and every peer whose output we can compare are checked against the reference before timing (the
gradients on the op's reduced shape, where the fp32 reference's autograd fits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import registry
from benchmarks.common import PROVIDER, Measurement, checked, checked_backward, measure
from registry.ops import OPS
from registry.testing import backward_call, cotangent, grad_leaves, max_relative_error
from tuning.bench import rotating

FAMILY = "attention"
FLASH, SINK = OPS["flash_attention"], OPS["sink_attention"]
BACKWARD = 2.5  # a backward's FLOPs, in forwards
DEVICE = "cuda"


def _shape_name(s: dict) -> str:
    mask = f"window {s['window']}" if s.get("window") else ("causal" if s.get("causal") else "full")
    sinks = " sinks" if s.get("sinks") else ""
    return f"b{s['b']} s{s['s_q']} h{s['h_q']}/{s['h_kv']} d{s['d']} {mask}{sinks}"


def _forward_backward(op, call, args: dict):
    """A zero-argument function running one forward and its backward (fresh leaves, a fixed cotangent)."""
    leaves = grad_leaves(op, args)
    full = {**args, **leaves}
    first = call(full)
    dout = cotangent(first if isinstance(first, torch.Tensor) else first[0])
    inputs = list(leaves.values())

    def run():
        out = call(full)
        return torch.autograd.grad(out if isinstance(out, torch.Tensor) else out[0], inputs, dout)

    return run


# ----------------------------------------------------------------------------- peers
def _bhsd(args: dict, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """q, k, v in SDPA's [b, h, s, d] layout (copies, leaves when asked)."""
    return tuple(args[n].transpose(1, 2).contiguous().requires_grad_(requires_grad) for n in ("q", "k", "v"))


def _sdpa(shape: dict):
    causal, gqa = bool(shape.get("causal")), shape["h_q"] != shape["h_kv"]
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _flex_with_sinks(shape: dict, device: torch.device):
    """Compiled FlexAttention over a causal sliding window of shape["window"] keys, the sink applied
    through its lse: (q, k, v, sinks) in [b, h, s, d] -> out in [b, h, s, d]."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    window = shape["window"]

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    mask = create_block_mask(sliding_window, None, None, shape["s_q"], shape["s_k"], device=device)
    flex = torch.compile(flex_attention, dynamic=False)
    gqa = shape["h_q"] != shape["h_kv"]

    def call(q, k, v, sinks):
        out, lse = flex(q, k, v, block_mask=mask, enable_gqa=gqa, return_lse=True)
        return out * torch.sigmoid(lse - sinks[None, :, None]).unsqueeze(-1).to(out.dtype)

    return call


def _peer_error(peer_out: torch.Tensor, op, args: dict) -> float:
    """The peer's relative error against the reference (its output back in [b, s, h, d])."""
    return max_relative_error(peer_out.transpose(1, 2), op.reference(**args))


# ----------------------------------------------------------------------------- one shape
def _bench_shape(op, shape: dict, dtype: torch.dtype) -> list[Measurement]:
    handle = registry.get(op.name)
    call = lambda a: handle(**a)  # noqa: E731
    name, fwd_op, both_op = _shape_name(shape), f"{op.name} fwd", f"{op.name} fwd+bwd"
    sets = [op.validate(**op.make_inputs(shape, device=DEVICE, dtype=dtype, seed=i)) for i in range(2)]
    args = sets[0]
    flops = op.flops(args)
    small = op.validate(**op.make_inputs(op.reduce_shape(shape), device=DEVICE, dtype=dtype, seed=7))
    err, bwd_err = checked(op, args, call), checked_backward(op, small, call)
    out = [measure(fwd_op, name, PROVIDER, rotating(call, sets), flops, "TFLOP/s", err),
           measure(both_op, name, PROVIDER, _forward_backward(op, call, args), (1 + BACKWARD) * flops, "TFLOP/s",
                   bwd_err)]

    if shape.get("window") is None:
        sdpa = _sdpa(shape)
        qkv_sets = [_bhsd(a) for a in sets]
        out.append(measure(fwd_op, name, "torch-sdpa", rotating(lambda t: sdpa(*t), qkv_sets), flops, "TFLOP/s",
                           None))
        leaves = _bhsd(args, requires_grad=True)
        dout = cotangent(sdpa(*leaves))
        fwd_bwd = lambda: torch.autograd.grad(sdpa(*leaves), leaves, dout)  # noqa: E731
        out.append(measure(both_op, name, "torch-sdpa", fwd_bwd, (1 + BACKWARD) * flops, "TFLOP/s", None))
    else:
        flex = _flex_with_sinks(shape, args["q"].device)
        peer_args = [(*_bhsd(a), a["sinks"]) for a in sets]
        peer_err = _peer_error(flex(*peer_args[0]), op, args)
        out.append(measure(fwd_op, name, "flex+sink-rescale", rotating(lambda t: flex(*t), peer_args), flops,
                           "TFLOP/s", peer_err))
        leaves = (*_bhsd(args, requires_grad=True), args["sinks"].clone().requires_grad_())
        dout = cotangent(flex(*leaves))
        fwd_bwd = lambda: torch.autograd.grad(flex(*leaves), leaves, dout)  # noqa: E731
        out.append(measure(both_op, name, "flex+sink-rescale", fwd_bwd, (1 + BACKWARD) * flops, "TFLOP/s", None))

    if op is SINK and shape.get("window") is None:
        # The backward alone: with sinks, against the same kernels without (flash_attention), and the
        # deterministic flag against the default.
        bwd_op = f"{op.name} bwd"
        out.append(measure(bwd_op, name, PROVIDER, backward_call(op, call, args), BACKWARD * flops, "TFLOP/s",
                           bwd_err))
        plain = {n: args[n] for n in ("q", "k", "v", "causal", "window")}
        flash = registry.get("flash_attention")
        out.append(measure(bwd_op, name, "kreg-no-sinks", backward_call(FLASH, lambda a: flash(**a),
                                                                        FLASH.validate(**plain)),
                           BACKWARD * flops, "TFLOP/s", None))
        det = {**args, "deterministic": True}
        out.append(measure(f"{op.name} bwd deterministic", name, PROVIDER, backward_call(op, call, det),
                           BACKWARD * flops, "TFLOP/s", bwd_err))
        out.append(measure(f"{op.name} bwd deterministic", name, "kreg-default", backward_call(op, call, args),
                           BACKWARD * flops, "TFLOP/s", None))
    return out


def run(dtype: torch.dtype = torch.bfloat16) -> list[Measurement]:
    out: list[Measurement] = []
    for op in (SINK, FLASH):
        for shape in op.presets["full"]:
            out += _bench_shape(op, shape, dtype)
            torch.cuda.empty_cache()
    return out
