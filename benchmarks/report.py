"""`python -m kreg.benchmarks.report CSV [CSV ...]`: the results table, in Markdown, of the long-format
CSV files that `python -m kreg.benchmarks.run` writes (`benchmarks.common.long_rows`).

One row per op, shape and device: our median time, the peer's (the first other provider of the same op
and shape in the file, as run.py's table pairs them), how many times faster ours is, the device and the
day of the run. Several files (an H200 run and an H100 run) make one table, the devices of one op and
shape on adjacent rows. When files repeat an op, shape and device, the newest run's row is kept (by
date, then the later file). A file without a date column (written before there was one) is dated by
its modification time, and the caption says so.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kreg.benchmarks.common import PROVIDER
from kreg.core.files import NotARegularFile, NotText, read_text
from kreg.tuning.export import markdown_cell

MAX_CSV_BYTES = 64 << 20  # a whole benchmark run is well under a MiB
NEEDED = ("op", "shape", "provider", "metric", "unit", "p50", "device")
COLUMNS = ("op", "shape", "ours ms", "peer", "peer ms", "ours/peer speed", "device", "date")


@dataclass
class Result:
    """Our median and the peer's at one op, shape and device, from one run."""

    op: str
    shape: str
    device: str
    date: str
    ours_ms: float
    peer: str | None
    peer_ms: float | None
    file_date: bool = False  # the date is the file's modification date: the row had none

    @property
    def speed(self) -> float | None:
        """How many times faster ours is than the peer (above 1: faster)."""
        return None if self.peer_ms is None or self.ours_ms <= 0 else self.peer_ms / self.ours_ms


def read_results(path: Path) -> list[Result]:
    """The results of one CSV file; a row without a date takes the file's modification date."""
    try:
        text = read_text(path, MAX_CSV_BYTES)
    except (NotARegularFile, NotText) as err:
        raise ValueError(f"{path}: not a benchmark CSV: {err}") from None
    with io.StringIO(text, newline="") as f:
        reader = csv.DictReader(f)
        missing = [name for name in NEEDED if name not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: not a long-format benchmark CSV (no column {', '.join(missing)})")
        times = [row for row in reader if row["metric"] == "time" and row["unit"] == "ms"]
    modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).date().isoformat()
    results = []
    for row in times:
        if row["provider"] != PROVIDER:
            continue
        place = (row["op"], row["shape"], row["device"])
        peer = next((p for p in times if p["provider"] != PROVIDER and (p["op"], p["shape"], p["device"]) == place),
                    None)
        date = row.get("date") or ""
        results.append(Result(row["op"], row["shape"], row["device"], date or modified, _number(path, row),
                              None if peer is None else peer["provider"], None if peer is None else _number(path, peer),
                              file_date=not date))
    return results


def _number(path: Path, row: dict) -> float:
    try:
        return float(row["p50"])
    except ValueError:
        raise ValueError(f"{path}: p50 of {row['op']} {row['shape']} ({row['provider']}) is not a number: "
                         f"{row['p50']!r}") from None


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 1000 else f"{value:#.4g}"


def report(paths: list[Path]) -> str:
    """The Markdown table of the results in `paths`: a caption line, then the table."""
    newest: dict[tuple[str, str], dict[str, tuple[tuple[str, int], Result]]] = {}
    undated = []
    for index, path in enumerate(paths):
        results = read_results(path)
        if any(r.file_date for r in results):
            undated.append(str(path))
        for r in results:
            devices = newest.setdefault((r.op, r.shape), {})
            rank = (r.date, index)
            if r.device not in devices or devices[r.device][0] <= rank:
                devices[r.device] = (rank, r)
    caption = (f"Median milliseconds per call from `python -m kreg.benchmarks.run` ({', '.join(map(str, paths))}); "
               "ours/peer speed is the peer's time over ours (above 1x: ours is faster).")
    if undated:
        caption += f" Dates marked * are the file's modification date ({', '.join(undated)}: no date column)."
    lines = [caption, "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for devices in newest.values():
        for _, r in devices.values():
            cells = [r.op, r.shape, _ms(r.ours_ms), r.peer or "-", "-" if r.peer_ms is None else _ms(r.peer_ms),
                     "-" if r.speed is None else f"{r.speed:.2f}x", r.device, r.date + (" *" if r.file_date else "")]
            lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kreg.benchmarks.report",
                                     description="One Markdown results table from benchmarks.run's CSV files.")
    parser.add_argument("csv", nargs="+", type=Path, metavar="CSV", help="long-format rows of benchmarks.run")
    args = parser.parse_args(argv)
    try:
        print(report(args.csv))
    except (OSError, ValueError, csv.Error) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
