"""sparse_mla forward and backward at the DeepSeek-V3.2 shape vs the PyTorch reference and the card's
GEMM ceiling.

FLOPs: forward 2 * s_q * h_q * topk * (d_qk + d_v) (QK^T over all d_qk dims, PV over d_v); backward
2.5x the forward (docs/performance.md). Correctness is checked on the reduced shape (s_q 512: the reference's
gather at s_q 16384 does not fit) with the same config before the full shape is timed.

The backward is timed twice: the default (pre pass + fused pass, dkv by fp32 atomics) and
`deterministic=True` (pre, dq, dkv and sum passes, no atomics), whose row compares itself with the
default as its peer. `notes()` gives each one's time per kernel (one profiled run).

`python -m benchmarks.sparse_mla --backward [--shape 0,4]` times both backwards alone at the chosen
shapes (default: s_q 4096 at h_q 128 and at h_q 64) with their kernels; `--configs` explores configs
(benchmarks.common.explore).
"""

from __future__ import annotations

import argparse

import torch

from kreg import registry
from kreg.benchmarks.common import (
    PROVIDER,
    Measurement,
    checked,
    checked_backward,
    explore_main,
    kernel_ms,
    measure,
)
from kreg.ops import OPS
from kreg.ops.testing import backward_call

FAMILY = "sparse_mla"
OP = OPS["sparse_mla"]
SHAPES = [
    {"s_q": 4096, "s_kv": 8192, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    {"s_q": 8192, "s_kv": 16384, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    {"s_q": 16384, "s_kv": 16384, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    {"s_q": 8192, "s_kv": 8192, "h_q": 64, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    # TileLang's public example's shape (its backward's 176 TFLOP/s was measured there).
    {"s_q": 4096, "s_kv": 8192, "h_q": 64, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
]
# Per-kernel times of the backwards timed by run(), printed under the table by benchmarks.run.
_NOTES: list[str] = []


def _name(s: dict) -> str:
    return f"s_q {s['s_q']} s_kv {s['s_kv']} h {s['h_q']} topk {s['topk']}"


def _backward_kernels() -> list:
    """Every backward kernel a sparse_mla call may launch (both paths, every variant)."""
    kernels = [k for v in registry.variants("sparse_mla") for role, k in v.kernels.items() if role.startswith("bwd")]
    return list(dict.fromkeys(kernels))


def _backwards(shape: dict, call, args: dict, small: dict, flops: float) -> list[Measurement]:
    """The default and the deterministic backward at one shape (each gated on the reduced shape), with
    their per-kernel times in _NOTES."""
    out = []
    det = {**args, "deterministic": True}
    bwd_err = checked_backward(OP, small, call)
    det_err = checked_backward(OP, {**small, "deterministic": True}, call)
    default_bwd, det_bwd = backward_call(OP, call, args), backward_call(OP, call, det)
    out.append(measure("sparse_mla bwd", _name(shape), PROVIDER, default_bwd, 2.5 * flops, "TFLOP/s", bwd_err))
    out.append(measure("sparse_mla bwd deterministic", _name(shape), PROVIDER, det_bwd, 2.5 * flops, "TFLOP/s",
                       det_err))
    out.append(measure("sparse_mla bwd deterministic", _name(shape), "kreg-default", default_bwd, 2.5 * flops,
                       "TFLOP/s", None))
    kernels = _backward_kernels()
    _NOTES.append(f"sparse_mla bwd {_name(shape)} per kernel, ms: {kernel_ms(default_bwd, kernels)}")
    _NOTES.append(f"sparse_mla bwd deterministic {_name(shape)} per kernel, ms (all query chunks): "
                  f"{kernel_ms(det_bwd, kernels)}")
    return out


def _bench_shape(shape: dict, call, dtype: torch.dtype, time_reference: bool) -> list[Measurement]:
    small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
    err = checked(OP, small, call)
    args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
    flops = OP.flops(args)
    out = [measure("sparse_mla fwd", _name(shape), PROVIDER, lambda: call(args), flops, "TFLOP/s", err)]
    if time_reference:
        # The reference's gather runs for seconds at these sizes: a few repetitions only.
        from kreg.tuning.bench import time_gpu_quantiles

        ms = time_gpu_quantiles(lambda: OP.reference(**args), warmup_ms=1, rep_ms=1)
        out.append(Measurement("sparse_mla fwd", _name(shape), "torch-reference", ms, flops, "TFLOP/s", None))
    return out + _backwards(shape, call, args, small, flops)


def run(dtype: torch.dtype = torch.bfloat16, time_reference: bool = True) -> list[Measurement]:
    handle = registry.get("sparse_mla")
    out: list[Measurement] = []
    _NOTES.clear()
    for i, shape in enumerate(SHAPES):
        out += _bench_shape(shape, lambda a: handle(**a), dtype, time_reference and i == 0)
        torch.cuda.empty_cache()
    return out


def notes() -> list[str]:
    return list(_NOTES)


def backward_main(shapes: list[dict], dtype: torch.dtype = torch.bfloat16) -> int:
    """Both backwards alone at `shapes` through the registry (tuned tables, else defaults): a line each
    with ms, TFLOP/s and the relative error, then the per-kernel times."""
    handle = registry.get("sparse_mla")
    call = lambda a: handle(**a)  # noqa: E731
    _NOTES.clear()
    for shape in shapes:
        small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
        args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
        for m in _backwards(shape, call, args, small, OP.flops(args)):
            err = "-" if m.rel_err is None else f"{m.rel_err:.1e}"
            print(f"{m.op:30} {m.shape:40} {m.provider:13} {m.median_ms:9.3f} ms {m.rate():6.1f} {m.unit}  "
                  f"rel err {err}", flush=True)
        torch.cuda.empty_cache()
    for line in _NOTES:
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.sparse_mla --backward [--shape 0,4]`: both backwards per kernel;
    `python -m benchmarks.sparse_mla --configs '{"fwd": [{...}], "bwd_fused": [{...}]}' [--shape 0,3]
    [--variant ...]`: explore configs (benchmarks.common.explore)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sparse_mla", add_help=False)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--shape", default="0,4")
    known, _ = parser.parse_known_args(argv)
    if known.backward:
        return backward_main([SHAPES[int(i)] for i in known.shape.split(",")])
    return explore_main("python -m benchmarks.sparse_mla", OP, SHAPES, _name, "TFLOP/s", argv)


if __name__ == "__main__":
    raise SystemExit(main())
