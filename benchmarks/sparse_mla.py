"""sparse_mla forward and backward at the DeepSeek-V3.2 shape vs the PyTorch reference and the card's
GEMM ceiling.

FLOPs: forward 2 * s_q * h_q * topk * (d_qk + d_v) (QK^T over all d_qk dims, PV over d_v); backward
2.5x the forward (PERF.md). Correctness is checked on the reduced shape (s_q 512: the reference's
gather at s_q 16384 does not fit) with the same config before the full shape is timed.
"""

from __future__ import annotations

import torch

import registry
from benchmarks.common import Row, checked
from registry.device import detect
from registry.ops import OPS
from registry.testing import TOLERANCE, max_relative_error
from tuning.bench import time_gpu

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
    q, kv, out, dout = _grads(small, call)
    got = torch.autograd.grad(out, [q, kv], dout)
    qf, kvf = small["q"].float().requires_grad_(), small["kv"].float().requires_grad_()
    want = torch.autograd.grad(OP.reference(**{**small, "q": qf, "kv": kvf}).out, [qf, kvf], dout.float())
    bwd_err = max(max_relative_error(g.float(), w) for g, w in zip(got, want, strict=True))
    if not bwd_err <= 2 * TOLERANCE[dtype]:
        raise AssertionError(f"sparse_mla backward: relative error {bwd_err:.3g}; not timing it")
    q, kv, out, dout = _grads(args, call)
    bwd_ms = time_gpu(lambda: torch.autograd.grad(out, [q, kv], dout, retain_graph=True))
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
