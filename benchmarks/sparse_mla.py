"""sparse_mla forward and backward at the DeepSeek-V3.2 shape vs the PyTorch reference and the card's
GEMM ceiling.

FLOPs: forward 2 * s_q * h_q * topk * (d_qk + d_v) (QK^T over all d_qk dims, PV over d_v); backward
2.5x the forward (docs/performance.md). Correctness is checked on the reduced shape (s_q 512: the reference's
gather at s_q 16384 does not fit) with the same config before the full shape is timed.
"""

from __future__ import annotations

import torch

import registry
from benchmarks.common import PROVIDER, Measurement, checked, checked_backward, explore_main, measure
from registry.ops import OPS
from registry.testing import backward_call

FAMILY = "sparse_mla"
OP = OPS["sparse_mla"]
SHAPES = [
    {"s_q": 4096, "s_kv": 8192, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    {"s_q": 8192, "s_kv": 16384, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    {"s_q": 16384, "s_kv": 16384, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
    {"s_q": 8192, "s_kv": 8192, "h_q": 64, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048},
]


def _name(s: dict) -> str:
    return f"s_q {s['s_q']} s_kv {s['s_kv']} h {s['h_q']} topk {s['topk']}"


def _bench_shape(shape: dict, call, dtype: torch.dtype, time_reference: bool) -> list[Measurement]:
    small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
    err = checked(OP, small, call)
    args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
    flops = OP.flops(args)
    out = [measure("sparse_mla fwd", _name(shape), PROVIDER, lambda: call(args), flops, "TFLOP/s", err)]
    if time_reference:
        # The reference's gather runs for seconds at these sizes: a few repetitions only.
        from tuning.bench import time_gpu_quantiles

        ms = time_gpu_quantiles(lambda: OP.reference(**args), warmup_ms=1, rep_ms=1)
        out.append(Measurement("sparse_mla fwd", _name(shape), "torch-reference", ms, flops, "TFLOP/s", None))
    # Backward: dq/dkv checked on the small shape, then timed on the full one.
    bwd_err = checked_backward(OP, small, call)
    out.append(measure("sparse_mla bwd", _name(shape), PROVIDER, backward_call(OP, call, args), 2.5 * flops,
                       "TFLOP/s", bwd_err))
    return out


def run(dtype: torch.dtype = torch.bfloat16, time_reference: bool = True) -> list[Measurement]:
    handle = registry.get("sparse_mla")
    out: list[Measurement] = []
    for i, shape in enumerate(SHAPES):
        out += _bench_shape(shape, lambda a: handle(**a), dtype, time_reference and i == 0)
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.sparse_mla --configs '{"fwd": [{...}], "bwd_dq": [{...}]}' [--shape 0,3]`:
    explore configs (benchmarks.common.explore)."""
    return explore_main("python -m benchmarks.sparse_mla", OP, SHAPES, _name, "TFLOP/s", argv)


if __name__ == "__main__":
    raise SystemExit(main())
