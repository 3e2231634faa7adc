"""What every benchmark script shares: ceilings measured in the same run, correctness before timing,
and long-format result rows (one row per op, shape and provider) that run.py prints as one table."""

from __future__ import annotations

import csv
import time
from dataclasses import asdict, dataclass

import torch

from registry.testing import TOLERANCE, max_relative_error
from tuning.bench import time_gpu


@dataclass
class Row:
    op: str
    shape: str
    provider: str          # "kreg" or the peer's name
    ms: float
    rate: float | None     # TFLOP/s or TB/s
    unit: str              # "TFLOP/s" or "TB/s"
    rel_err: float | None  # vs the op's reference, checked before timing
    device: str


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


def checked(op, args: dict, call) -> float:
    """Relative error of `call(args)` against the op's reference; raises when over the budget."""
    dtype = args[next(iter(args))].dtype
    err = max_relative_error(call(args), op.reference(**args))
    if not err <= TOLERANCE[dtype]:
        raise AssertionError(f"{op.name}: relative error {err:.3g} > {TOLERANCE[dtype]:.3g}; not timing a wrong kernel")
    return err


def write_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def host_overhead_us(fn, direct, iters: int = 2000, repeats: int = 7) -> tuple[float, float]:
    """Median host microseconds per call of `fn` and of `direct` (interleaved repeats, GPU drained)."""
    samples: dict[str, list[float]] = {"fn": [], "direct": []}
    for _ in range(repeats):
        for name, f in (("fn", fn), ("direct", direct)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                f()
            elapsed = time.perf_counter() - start
            torch.cuda.synchronize()
            samples[name].append(elapsed / iters * 1e6)
    med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    return med["fn"], med["direct"]
