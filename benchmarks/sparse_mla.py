"""sparse_mla forward and backward at the DeepSeek-V3.2 shape vs the PyTorch reference and the card's
GEMM ceiling.

FLOPs: forward 2 * s_q * h_q * topk * (d_qk + d_v) (QK^T over all d_qk dims, PV over d_v); backward
2.5x the forward (PERF.md). Correctness is checked on the reduced shape (s_q 512: the reference's
gather at s_q 16384 does not fit) with the same config before the full shape is timed.
"""

from __future__ import annotations

import argparse
import json

import torch

import registry
from benchmarks.common import Row, checked
from kernels.common.sparse_mla import sparse_mla_forward
from registry.device import detect
from registry.dispatch import candidates
from registry.ops import OPS
from registry.testing import TOLERANCE, max_relative_error
from tuning.bench import time_gpu
from tuning_db.records import LaunchConfig

OP = OPS["sparse_mla"]
SHAPES = [
    {"s_q": 4096, "s_kv": 8192, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    {"s_q": 8192, "s_kv": 16384, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    {"s_q": 16384, "s_kv": 16384, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    {"s_q": 8192, "s_kv": 8192, "h_q": 64, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
]


def _name(s: dict) -> str:
    return f"s_q {s['s_q']} s_kv {s['s_kv']} h {s['h_q']} topk {s['topk']}"


def _grads(args: dict, call):
    q = args["q"].detach().requires_grad_()
    kv = args["kv"].detach().requires_grad_()
    out = call({**args, "q": q, "kv": kv}).out
    dout = torch.randn_like(out)
    return q, kv, out, dout


def _checked_backward(small: dict, call, dtype: torch.dtype) -> float:
    """Relative error of dq and dkv against the fp32 reference's autograd; raises when over budget."""
    q, kv, out, dout = _grads(small, call)
    got = torch.autograd.grad(out, [q, kv], dout)
    qf, kvf = small["q"].float().requires_grad_(), small["kv"].float().requires_grad_()
    want = torch.autograd.grad(OP.reference(**{**small, "q": qf, "kv": kvf}).out, [qf, kvf], dout.float())
    err = max(max_relative_error(g.float(), w) for g, w in zip(got, want, strict=True))
    if not err <= 2 * TOLERANCE[dtype]:
        raise AssertionError(f"sparse_mla backward: relative error {err:.3g}; not timing it")
    return err


def _time_backward(grads) -> float:
    q, kv, out, dout = grads
    return time_gpu(lambda: torch.autograd.grad(out, [q, kv], dout, retain_graph=True))


def _bench_shape(shape: dict, call, dtype: torch.dtype, time_reference: bool, device_name: str) -> list[Row]:
    small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
    err = checked(OP, small, call)
    args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
    flops = OP.flops(args)
    ms = time_gpu(lambda: call(args))
    rows = [Row("sparse_mla fwd", _name(shape), "kreg", ms, flops / ms / 1e9, "TFLOP/s", err, device_name)]
    if time_reference:
        # The reference's gather runs for seconds at these sizes: a few repetitions only.
        ref_ms = time_gpu(lambda: OP.reference(**args), warmup_ms=1, rep_ms=1)
        rows.append(Row("sparse_mla fwd", _name(shape), "torch-reference", ref_ms, flops / ref_ms / 1e9,
                        "TFLOP/s", None, device_name))
    # Backward: dq/dkv checked on the small shape, then timed on the full one.
    bwd_err = _checked_backward(small, call, dtype)
    bwd_ms = _time_backward(_grads(args, call))
    rows.append(Row("sparse_mla bwd", _name(shape), "kreg", bwd_ms, 2.5 * flops / bwd_ms / 1e9, "TFLOP/s",
                    bwd_err, device_name))
    return rows


def run(dtype: torch.dtype = torch.bfloat16, time_reference: bool = True) -> list[Row]:
    device = detect()
    handle = registry.get("sparse_mla")
    rows: list[Row] = []
    for i, shape in enumerate(SHAPES):
        rows += _bench_shape(shape, lambda a: handle(**a), dtype, time_reference and i == 0, device.name)
        torch.cuda.empty_cache()
    return rows


def explore(fwd_configs: list[dict], bwd_configs: list[tuple[dict, dict]], dtype: torch.dtype = torch.bfloat16,
            shape: dict = SHAPES[0], variant_name: str | None = None) -> list[Row]:
    """Time explicit configs of one variant (default: this GPU's highest-priority one for the shape) at
    one shape, each checked first: forward configs, then (dq, dkv) pairs for the backward (run after the
    variant's default forward). Configs are LaunchConfig fields as dicts; tuned tables are not involved."""
    device = detect()
    small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
    args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
    key = dict(OP.tuning_key(args))
    variant = candidates("sparse_mla", device.vendor, variant_name, key, device)[0]
    flops = OP.flops(args)
    rows = []
    for fields in fwd_configs:
        config = LaunchConfig(**fields)
        err = checked(OP, small, lambda a, c=config: variant.launch(a, c))
        ms = time_gpu(lambda c=config: variant.launch(args, c))
        rows.append(Row("sparse_mla fwd", _name(shape), f"{variant.name} {_describe(config)}", ms, flops / ms / 1e9,
                        "TFLOP/s", err, device.name))
    forward = variant.default_config(key, device)
    for dq_fields, dkv_fields in bwd_configs:
        passes = (LaunchConfig(**dq_fields), LaunchConfig(**dkv_fields))
        call = lambda a, p=passes: sparse_mla_forward(a, forward, p, variant.run_forward)  # noqa: E731
        err = _checked_backward(small, call, dtype)
        grads = _grads(args, call)
        ms = _time_backward(grads)
        split = " + ".join(f"{name.removeprefix('_sparse_mla_bwd_').removesuffix('_kernel')} {k_ms:.1f}"
                           for name, k_ms in _kernel_ms(grads).items())
        del grads
        rows.append(Row("sparse_mla bwd", _name(shape), " / ".join(_describe(c) for c in passes) + f" ({split})",
                        ms, 2.5 * flops / ms / 1e9, "TFLOP/s", err, device.name))
        torch.cuda.empty_cache()
    return rows


def _kernel_ms(grads) -> dict[str, float]:
    """Milliseconds per backward kernel in one profiled backward (which pass to work on next), on a
    graph `_time_backward` has already run (compiled and warm)."""
    from torch.profiler import ProfilerActivity, profile

    q, kv, out, dout = grads
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(out, [q, kv], dout, retain_graph=True)
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages() if "_sparse_mla_bwd" in e.key}


def _describe(config: LaunchConfig) -> str:
    blocks = "x".join(str(v) for v in config.blocks.values())
    return f"{blocks} w{config.num_warps} s{config.num_stages}"


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.sparse_mla --fwd '[{...}]' --bwd '[[{dq}, {dkv}]]'`: explore configs."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sparse_mla")
    parser.add_argument("--fwd", default="[]", help="JSON list of forward LaunchConfig dicts")
    parser.add_argument("--bwd", default="[]", help="JSON list of [dq, dkv] LaunchConfig dict pairs")
    parser.add_argument("--variant", default=None, help="variant name (default: the registry's first choice)")
    args = parser.parse_args(argv)
    for r in explore(json.loads(args.fwd), [tuple(p) for p in json.loads(args.bwd)], variant_name=args.variant):
        print(f"{r.op:15} {r.provider:74} {r.ms:9.3f} ms {r.rate:6.0f} {r.unit}  rel err {r.rel_err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
