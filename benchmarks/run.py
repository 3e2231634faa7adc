"""`python -m benchmarks.run`: every op family's benchmark on this GPU, one table, ceilings measured in
the same run. Rows are also written in long format to --csv (default: benchmarks-<device>.csv)."""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run")
    parser.add_argument("--csv", default=None, help="where to write the long-format rows")
    parser.add_argument("--only", default=None, help="comma-separated families (flash_attention, sparse_mla)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA or ROCm GPU; none is present", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    from benchmarks import flash_attention, sparse_mla
    from benchmarks.common import measure_ceilings, write_csv
    from registry.device import detect

    device = detect()
    ceilings = measure_ceilings()
    families = {"flash_attention": flash_attention.run, "sparse_mla": sparse_mla.run}
    chosen = args.only.split(",") if args.only else list(families)
    rows = [row for name in chosen for row in families[name]()]
    table = Table(title=f"{device.name}: GEMM ceiling {ceilings.gemm_tflops:.0f} TFLOP/s, "
                        f"copy ceiling {ceilings.copy_tbps:.2f} TB/s")
    for col in ("op", "shape", "ours ms", "ours rate", "peer", "peer ms", "ours/peer speed", "of ceiling", "rel err"):
        table.add_column(col)
    ours = [r for r in rows if r.provider == "kreg"]
    for r in ours:
        peer = next((p for p in rows if p.provider != "kreg" and (p.op, p.shape) == (r.op, r.shape)), None)
        ceiling = ceilings.gemm_tflops if r.unit == "TFLOP/s" else ceilings.copy_tbps
        table.add_row(r.op, r.shape, f"{r.ms:.3f}", f"{r.rate:.0f} {r.unit}", peer.provider if peer else "-",
                      f"{peer.ms:.3f}" if peer else "-", f"{peer.ms / r.ms:.2f}x" if peer else "-",
                      f"{r.rate / ceiling:.0%}", f"{r.rel_err:.1e}")
    console = Console(width=200)
    console.print(table)
    if "flash_attention" in chosen:
        o = flash_attention.dispatch_overhead()
        console.print(f"dispatch: registry.get(op)(...) {o['registry_us']:.2f} us/call vs direct launch "
                      f"{o['direct_us']:.2f} us/call -> overhead {o['overhead_us']:.2f} us "
                      f"(validation alone {o['validate_us']:.2f} us; validation + dispatch without a launch "
                      f"{o['dispatch_no_launch_us']:.2f} us)")
    write_csv(rows, args.csv or f"benchmarks-{device.key}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
