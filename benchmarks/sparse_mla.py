"""sparse_mla forward and backward at the DeepSeek-V3.2 shape vs the PyTorch reference and the card's
GEMM ceiling.

FLOPs: forward 2 * s_q * h_q * topk * (d_qk + d_v) (QK^T over all d_qk dims, PV over d_v); backward
2.5x the forward (docs/performance.md). Correctness is checked on the reduced shape (s_q 512: the reference's
gather at s_q 16384 does not fit) with the same config before the full shape is timed.
"""

from __future__ import annotations

import argparse
import json

import torch

import registry
from benchmarks.common import PROVIDER, Measurement, checked, checked_backward, measure
from registry.device import detect
from registry.dispatch import candidates
from registry.ops import OPS
from registry.testing import backward_call
from tuning_db.records import LaunchConfig

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


def explore(configs: dict[str, list[dict]], dtype: torch.dtype = torch.bfloat16, shape: dict = SHAPES[0],
            variant_name: str | None = None) -> list[Measurement]:
    """Time explicit configs of one variant (default: this GPU's highest-priority one for the shape) at
    one shape, each checked first: for each role, its configs in place of the default's (LaunchConfig
    fields as dicts), forward roles timed on the forward, backward roles on the backward with the time
    of each backward kernel in the provider name. Tuned tables are not involved."""
    device = detect()
    small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
    args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
    key = dict(OP.tuning_key(args))
    variant = candidates("sparse_mla", device.vendor, variant_name, key, device)[0]
    default = variant.default_config(key, device)
    flops = OP.flops(args)
    out = []
    for role, fields in ((role, f) for role, listed in configs.items() for f in listed):
        call_config = default.replace(role, LaunchConfig(**fields))
        call = lambda a, c=call_config: variant.launch(a, c)  # noqa: E731
        label = f"{variant.name} {role} {_describe(call_config[role])}"
        if role.startswith("bwd"):
            err = checked_backward(OP, small, call)
            backward = backward_call(OP, call, args)
            m = measure("sparse_mla bwd", _name(shape), label, backward, 2.5 * flops, "TFLOP/s", err)
            split = " + ".join(f"{name.removeprefix('_sparse_mla_bwd_').removesuffix('_kernel')} {k_ms:.1f}"
                               for name, k_ms in _kernel_ms(backward).items())
            m.provider += f" ({split})"
            del backward
        else:
            err = checked(OP, small, call)
            m = measure("sparse_mla fwd", _name(shape), label, lambda c=call: c(args), flops, "TFLOP/s", err)
        out.append(m)
        torch.cuda.empty_cache()
    return out


def _kernel_ms(backward) -> dict[str, float]:
    """Milliseconds per backward kernel in one profiled run of `backward` (which pass to work on next),
    one that has already run (compiled and warm)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        backward()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages() if "_sparse_mla_bwd" in e.key}


def _describe(config: LaunchConfig) -> str:
    blocks = "x".join(str(v) for v in config.blocks.values())
    return f"{blocks} w{config.num_warps} s{config.num_stages}"


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.sparse_mla --configs '{"fwd": [{...}], "bwd_dq": [{...}]}'`: explore configs."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sparse_mla")
    parser.add_argument("--configs", default="{}", help="JSON: role -> list of LaunchConfig dicts")
    parser.add_argument("--variant", default=None, help="variant name (default: the registry's first choice)")
    args = parser.parse_args(argv)
    for m in explore(json.loads(args.configs), variant_name=args.variant):
        print(f"{m.op:15} {m.provider:90} {m.median_ms:9.3f} ms {m.rate():6.0f} {m.unit}  rel err {m.rel_err:.1e}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
