"""`python -m benchmarks.run`: every op family's benchmark on this GPU, one table, ceilings measured in
the same run. The families are the modules of this package that set `FAMILY` (benchmarks/common.py
says what they define); their measurements are also written in long format to --csv (default:
benchmarks-<device>.csv)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

import torch


def families() -> dict[str, object]:
    """FAMILY -> module, for every benchmark module in this package."""
    found = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        module = importlib.import_module(f"{__package__}.{info.name}")
        if hasattr(module, "FAMILY"):
            found[module.FAMILY] = module
    return dict(sorted(found.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run")
    parser.add_argument("--csv", default=None, help="where to write the long-format rows")
    parser.add_argument("--only", default=None, help="comma-separated families (default: all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA or ROCm GPU; none is present", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    from kreg.benchmarks.common import PROVIDER, long_rows, measure_ceilings, write_csv
    from kreg.core.device import detect

    available = families()
    chosen = args.only.split(",") if args.only else list(available)
    unknown = [name for name in chosen if name not in available]
    if unknown:
        print(f"error: --only: expected families among {', '.join(available)}, got {', '.join(unknown)}",
              file=sys.stderr)
        return 2
    device = detect()
    ceilings = measure_ceilings()
    measurements = [m for name in chosen for m in available[name].run()]
    table = Table(title=f"{device.name}: GEMM ceiling {ceilings.gemm_tflops:.0f} TFLOP/s, "
                        f"copy ceiling {ceilings.copy_tbps:.2f} TB/s")
    for col in ("op", "shape", "ours ms", "ours rate", "peer", "peer ms", "ours/peer speed", "of ceiling", "rel err"):
        table.add_column(col)
    for m in (m for m in measurements if m.provider == PROVIDER):
        peer = next((p for p in measurements if p.provider != PROVIDER and (p.op, p.shape) == (m.op, m.shape)), None)
        ceiling = {"TFLOP/s": ceilings.gemm_tflops, "TB/s": ceilings.copy_tbps}.get(m.unit)
        table.add_row(m.op, m.shape, f"{m.median_ms:.3f}", f"{m.rate():.0f} {m.unit}", peer.provider if peer else "-",
                      f"{peer.median_ms:.3f}" if peer else "-", f"{peer.median_ms / m.median_ms:.2f}x" if peer else "-",
                      "-" if ceiling is None else f"{m.rate() / ceiling:.0%}",
                      "-" if m.rel_err is None else f"{m.rel_err:.1e}")
    console = Console(width=200)
    console.print(table)
    for name in chosen:
        for line in getattr(available[name], "notes", list)():
            console.print(line)
    path = args.csv or f"benchmarks-{device.key}.csv"
    write_csv(long_rows(measurements, device.name), path)
    console.print(f"long-format rows: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
