"""What every benchmark module shares: ceilings measured in the same run, correctness before timing,
and the measurements `run.py` prints as one table and writes as long-format CSV rows.

A benchmark module (`benchmarks/<family>.py`) sets `FAMILY` (its name for `--only`) and defines
`run() -> list[Measurement]`; it may define `notes() -> list[str]`, lines printed under the table.
`run.py` finds such modules by itself.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from kreg.core.records import LaunchConfig
from kreg.ops.testing import GRAD_TOLERANCE, TOLERANCE, backward_call, gradient_error, output_error
from kreg.tuning.bench import time_gpu, time_gpu_quantiles

PROVIDER = "kreg"  # our own rows; every other provider is a peer


@dataclass
class Measurement:
    """One provider timed on one op and shape: (p20, p50, p80) milliseconds, the work one call does
    (FLOPs for "TFLOP/s", bytes for "TB/s") and its relative error against the reference (None for a
    peer that was not checked)."""

    op: str
    shape: str
    provider: str
    ms: tuple[float, float, float]
    work: float
    unit: str
    rel_err: float | None

    @property
    def median_ms(self) -> float:
        return self.ms[1]

    def rate(self, ms: float | None = None) -> float:
        """TFLOP/s or TB/s at `ms` (default: the median)."""
        return self.work / (self.median_ms if ms is None else ms) / 1e9


@dataclass
class Ceilings:
    gemm_tflops: float
    copy_tbps: float


def measure_ceilings() -> Ceilings:
    """bf16 GEMM 8192^3 through torch and a 1 GiB device-to-device copy (bytes read + written)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_ms = time_gpu(lambda: a @ b)
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB of fp32
    dst = torch.empty_like(src)
    copy_ms = time_gpu(lambda: dst.copy_(src))
    return Ceilings(2 * n**3 / gemm_ms / 1e9, 2 * src.numel() * 4 / copy_ms / 1e9)


def measure(op: str, shape: str, provider: str, fn, work: float, unit: str, rel_err: float | None) -> Measurement:
    """Time `fn` (quantiles, CUDA graphs for microsecond calls) into a Measurement."""
    return Measurement(op, shape, provider, time_gpu_quantiles(fn), work, unit, rel_err)


def checked(op, args: dict, call) -> float:
    """Error of `call(args)` against the op's reference (`ops.testing.output_error`: relative error,
    or the op's own measure); raises when over the budget."""
    dtype = args[next(iter(args))].dtype
    err = output_error(op, call(args), op.reference(**args), args)
    if not err <= TOLERANCE[dtype]:
        raise AssertionError(f"{op.name}: relative error {err:.3g} > {TOLERANCE[dtype]:.3g}; not timing a wrong kernel")
    return err


def checked_backward(op, args: dict, call) -> float:
    """Relative error of `call`'s gradients against the reference's (fp32) autograd; raises when over
    the budget."""
    dtype = args[next(iter(args))].dtype
    err = gradient_error(op, call, args)
    if not err <= GRAD_TOLERANCE[dtype]:
        raise AssertionError(f"{op.name} backward: relative error {err:.3g}; not timing it")
    return err


def versions() -> dict[str, str]:
    """Triton, torch and this checkout's commit, for every CSV row."""
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"triton_version": triton.__version__, "torch_version": torch.__version__, "commit": commit}


CSV_FIELDS = ("op", "shape", "provider", "metric", "unit", "p20", "p50", "p80", "rel_err", "device", "date",
              "triton_version", "torch_version", "commit")


def long_rows(measurements: list[Measurement], device: str) -> list[dict]:
    """Long format: per measurement a time row (ms) and a throughput row (its unit; p20 is the rate at
    the p80 time), each with the device, the day of the run (UTC, ISO) and versions, so any plot (and
    `benchmarks/report.py`) can read them."""
    base = {"device": device, "date": datetime.now(timezone.utc).date().isoformat(), **versions()}
    rows = []
    for m in measurements:
        common = {"op": m.op, "shape": m.shape, "provider": m.provider, "rel_err": m.rel_err, **base}
        rows.append({**common, "metric": "time", "unit": "ms", "p20": m.ms[0], "p50": m.ms[1], "p80": m.ms[2]})
        rows.append({**common, "metric": "throughput", "unit": m.unit,
                     "p20": m.rate(m.ms[2]), "p50": m.rate(), "p80": m.rate(m.ms[0])})
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_FIELDS))
        writer.writeheader()
        writer.writerows(rows)


def host_us(fns: dict, iters: int = 2000, repeats: int = 9, wall: bool = False) -> dict[str, list[float]]:
    """Host microseconds per call of each zero-argument function: `repeats` samples of `iters` calls
    each, the functions interleaved and the GPU drained around every sample. With `wall`, a sample
    ends when the GPU has drained: the wall time per call of calls made back to back (host time for a
    host-bound call, GPU time for a GPU-bound one)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            if wall:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            torch.cuda.synchronize()
            samples[name].append(elapsed / iters * 1e6)
    return samples


# ----------------------------------------------------------------------------- config exploration
def kernel_ms(fn, kernels) -> str:
    """One profiled run of `fn` (already compiled and warm): milliseconds per kernel among `kernels`
    (Triton jit functions), as "name ms + name ms"."""
    from torch.profiler import ProfilerActivity, profile

    names = [k.__name__ for k in kernels]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    found = {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages() if e.key in names}
    return " + ".join(f"{name.strip('_').removesuffix('_kernel')} {found[name]:.3f}" for name in names if name in found)


def describe(config: LaunchConfig) -> str:
    """A launch config in one short word: its block values, then warps and stages."""
    blocks = "x".join(str(v) for v in config.blocks.values())
    return f"{blocks} w{config.num_warps} s{config.num_stages}"


def explore(op, shape: dict, configs: dict[str, list[dict]], *, name: str, unit: str,
            dtype: torch.dtype = torch.bfloat16, variant_name: str | None = None) -> list[Measurement]:
    """Time explicit configs of one variant (default: this GPU's highest-priority one for the shape) at
    one shape, each checked on the op's reduced shape first: for each role, its configs (LaunchConfig
    fields as dicts) in place of the default's. Forward roles are timed on the call, backward roles on
    the backward alone, each with the role's `Variant.role_arguments` (as a sweep runs it); each row's
    provider names the config and the time of each kernel it ran.
    `unit` "TFLOP/s" counts the op's FLOPs (backward 2.5x), "TB/s" its bytes. Tuned tables are not
    involved."""
    from kreg.core.device import detect
    from kreg.registry.dispatch import candidates

    device = detect()
    small = op.validate(**op.make_inputs(op.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
    args = op.validate(**op.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
    key = dict(op.tuning_key(args))
    variant = candidates(op.name, device.vendor, variant_name, key, device)[0]
    default = variant.default_config(key, device)
    work = op.flops(args) if unit == "TFLOP/s" else op.bytes_moved(args)
    out = []
    for role, fields in ((role, f) for role, listed in configs.items() for f in listed):
        call_config = default.replace(role, LaunchConfig(**fields))
        label = f"{variant.name} {role} {describe(call_config[role])}"
        # A config the variant rules out, or one the GPU cannot hold, is reported and passed over so
        # the rest of the list still runs.
        reason = variant.prune_reason(role, call_config[role], key, device)
        if reason is None:
            try:
                out.append(_explore_one(op, variant, role, call_config, small, args, name, label, work, unit))
            except OutOfResources as error:
                reason = f"out of resources: {error}"
        if reason is not None:
            print(f"{name:45} {label:100} skipped: {reason}", flush=True)
        torch.cuda.empty_cache()
    return out


def _explore_one(op, variant, role: str, call_config, small: dict, args: dict, name: str, label: str, work: float,
                 unit: str) -> Measurement:
    """One config of `explore`: checked on the reduced shape, then timed (backward roles on the
    backward alone), run as a sweep runs it (with the role's `Variant.role_arguments`)."""
    extra = variant.role_arguments.get(role, {})
    call = lambda a: variant.call({**a, **extra}, call_config)  # noqa: E731
    if role.startswith("bwd"):
        err = checked_backward(op, small, call)
        timed = backward_call(op, call, args)
        m = measure(f"{op.name} bwd", name, label, timed, 2.5 * work, unit, err)
        kernels = [k for r, k in variant.kernels.items() if r.startswith("bwd")]
    else:
        err = checked(op, small, call)
        timed = lambda: call(args)  # noqa: E731
        m = measure(op.name, name, label, timed, work, unit, err)
        kernels = [k for r, k in variant.kernels.items() if not r.startswith("bwd")]
    m.provider += f" ({kernel_ms(timed, kernels)})"
    return m


def explore_main(prog: str, op, shapes: list[dict], name, unit: str, argv: list[str] | None = None) -> int:
    """The command line of a family's config exploration: `--configs` (JSON role -> list of
    LaunchConfig dicts), `--variant`, `--shape` (indices into `shapes`, default the first)."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--configs", default="{}", help="JSON: role -> list of LaunchConfig dicts")
    parser.add_argument("--variant", default=None, help="variant name (default: the registry's first choice)")
    parser.add_argument("--shape", default="0", help="comma-separated indices of: " +
                        "; ".join(f"{i} {name(s)}" for i, s in enumerate(shapes)))
    args = parser.parse_args(argv)
    for index in (int(i) for i in args.shape.split(",")):
        for m in explore(op, shapes[index], json.loads(args.configs), name=name(shapes[index]), unit=unit,
                         variant_name=args.variant):
            print(f"{m.shape:45} {m.provider:100} {m.median_ms:9.4f} ms {m.rate():6.2f} {m.unit}  "
                  f"rel err {m.rel_err:.1e}", flush=True)
    return 0
