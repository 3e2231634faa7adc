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

`python -m benchmarks.attention` (main below) times the forward of named variants side by side with
SDPA at the forward target shapes (docs/performance.md), each forced by name (so the tiled variant runs
its tuned entries and the warp-specialized one its default), and explores forward configs with
`--configs`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from kreg import registry
from kreg.benchmarks.common import (
    PROVIDER,
    Measurement,
    checked,
    checked_backward,
    explore,
    long_rows,
    measure,
    write_csv,
)
from kreg.ops import OPS
from kreg.ops.testing import backward_call, cotangent, grad_leaves, max_relative_error
from kreg.tuning.bench import rotating

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


# ----------------------------------------------------------------------------- forward by variant
def _dense(b: int, s: int, h_q: int, h_kv: int, d: int, causal: bool) -> dict:
    return {"b": b, "s_q": s, "s_k": s, "h_q": h_q, "h_kv": h_kv, "d": d, "causal": causal, "window": None}


# The forward targets (op, shape): the dense shapes against SDPA, gpt-oss with sinks against SDPA
# without them.
FORWARD_SHAPES = [
    (FLASH, _dense(2, 8192, 16, 16, 128, True)),
    (FLASH, _dense(2, 8192, 16, 16, 128, False)),
    (FLASH, _dense(1, 16384, 32, 32, 128, True)),
    (FLASH, _dense(4, 8192, 32, 32, 64, True)),
    (SINK, {**_dense(1, 8192, 64, 8, 64, True), "sinks": True}),
]
# Variant kinds by op: the tiled Triton kernel and the Hopper warp-specialized Gluon one.
KINDS = {"tiled": {"flash_attention": "flash_attention_tiled", "sink_attention": "sink_attention_flash"},
         "warpspec": {"flash_attention": "flash_attention_warpspec", "sink_attention": "sink_attention_warpspec"}}


def forward_rows(shapes: list[tuple], kinds: list[str], dtype: torch.dtype = torch.bfloat16) -> list[Measurement]:
    """Per shape: the forward of each variant kind (forced by name, checked against the reference first;
    a kind that fails the check or raises is reported on stderr and not timed) and SDPA's (no sinks),
    in this process."""
    out = []
    for op, shape in shapes:
        name = _shape_name(shape)
        sets = [op.validate(**op.make_inputs(shape, device=DEVICE, dtype=dtype, seed=i)) for i in range(2)]
        flops = op.flops(sets[0])
        for kind in kinds:
            handle = registry.get(op.name, variant=KINDS[kind][op.name])
            call = lambda a, h=handle: h(**a)  # noqa: E731
            try:
                err = checked(op, sets[0], call)
            except Exception as failure:  # noqa: BLE001 - a wrong or failing kind is reported, the others run
                print(f"{op.name} {name} kreg-{kind}: not timed: {type(failure).__name__}: {failure}",
                      file=sys.stderr, flush=True)
                continue
            out.append(measure(f"{op.name} fwd", name, f"kreg-{kind}", rotating(call, sets), flops, "TFLOP/s", err))
        sdpa = _sdpa(shape)
        qkv_sets = [_bhsd(a) for a in sets]
        out.append(measure(f"{op.name} fwd", name, "torch-sdpa", rotating(lambda t, f=sdpa: f(*t), qkv_sets),
                           flops, "TFLOP/s", None))
        del sets, qkv_sets
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.attention [--variants tiled,warpspec] [--shape 0,1,2,3,4]`: forward rows per
    variant kind beside SDPA, with each row's ratio to SDPA; `--configs '{"fwd": [{...}]}' [--explore
    warpspec]`: explore forward configs of one kind at the same shapes (benchmarks.common.explore);
    `--preset sink_attention:1,2`: the variant dispatch picks and the full benchmark's rows (forward,
    forward+backward, the peer) at those indices of the op's full preset, through the registry (as
    `benchmarks.run` times them)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention")
    parser.add_argument("--variants", default="tiled,warpspec", help=f"comma-separated kinds among {list(KINDS)}")
    parser.add_argument("--shape", default=",".join(str(i) for i in range(len(FORWARD_SHAPES))),
                        help="comma-separated indices of: " +
                        "; ".join(f"{i} {_shape_name(s)}" for i, (_, s) in enumerate(FORWARD_SHAPES)))
    parser.add_argument("--configs", default=None, help="JSON: role -> list of LaunchConfig dicts to explore")
    parser.add_argument("--explore", default="warpspec", help="the kind whose configs --configs explores")
    parser.add_argument("--preset", default=None, metavar="OP:I,J",
                        help="the full benchmark's rows at these indices of the op's full preset (sink_attention or "
                             "flash_attention), through the registry")
    parser.add_argument("--csv", default=None, help="where to write the long-format rows")
    opts = parser.parse_args(argv)
    kinds = opts.variants.split(",")
    unknown = [k for k in kinds + [opts.explore] if k not in KINDS]
    if unknown:
        parser.error(f"--variants/--explore: expected kinds among {list(KINDS)}, got {unknown}")
    shapes = [FORWARD_SHAPES[int(i)] for i in opts.shape.split(",")]
    ops = {o.name: o for o in (SINK, FLASH)}
    if opts.preset is not None:
        name, _, indices = opts.preset.partition(":")
        if name not in ops or not indices:
            parser.error(f"--preset: expected OP:I,J with OP among {list(ops)}, got {opts.preset!r}")
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA or ROCm GPU; none is present", file=sys.stderr)
        return 2
    if opts.preset is not None:
        op = ops[name]
        for index in (int(i) for i in indices.split(",")):
            shape = op.presets["full"][index]
            choice = registry.get(name).choice(**op.validate(**op.make_inputs(shape, device=DEVICE,
                                                                             dtype=torch.bfloat16, seed=0)))
            print(f"{_shape_name(shape)}: dispatch {choice.variant.name if choice.variant else 'reference'} "
                  f"({choice.source})", flush=True)
            for m in _bench_shape(op, shape, torch.bfloat16):
                err = "-" if m.rel_err is None else f"{m.rel_err:.1e}"
                print(f"{m.op:24} {m.shape:40} {m.provider:18} {m.median_ms:8.4f} ms  rel err {err}", flush=True)
            torch.cuda.empty_cache()
        return 0
    if opts.configs is not None:
        for op, shape in shapes:
            for m in explore(op, shape, json.loads(opts.configs), name=_shape_name(shape), unit="TFLOP/s",
                             variant_name=KINDS[opts.explore][op.name]):
                print(f"{m.shape:32} {m.provider:110} {m.median_ms:8.3f} ms {m.rate():6.1f} {m.unit}  "
                      f"rel err {m.rel_err:.1e}", flush=True)
        return 0
    rows = forward_rows(shapes, kinds)
    for m in rows:
        sdpa = next(p for p in rows if p.provider == "torch-sdpa" and (p.op, p.shape) == (m.op, m.shape))
        err = "-" if m.rel_err is None else f"{m.rel_err:.1e}"
        print(f"{m.op:22} {m.shape:32} {m.provider:15} {m.median_ms:8.3f} ms {m.rate():6.1f} TFLOP/s "
              f"{sdpa.median_ms / m.median_ms:5.2f}x SDPA  rel err {err}", flush=True)
    if opts.csv:
        from kreg.core.device import detect

        write_csv(long_rows(rows, detect().name), opts.csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
