"""The results table (`python -m kreg.benchmarks.report`) from hand-made CSV files in the format
`python -m kreg.benchmarks.run` writes; no GPU needed."""

import csv
import os
from datetime import date, datetime, timezone

from kreg.benchmarks.common import CSV_FIELDS, Measurement, long_rows, write_csv
from kreg.benchmarks.report import main, report

VERSIONS = {"triton_version": "3.6.0", "torch_version": "2.11.0", "commit": "abc1234", "rel_err": ""}


def _rows(device: str, day: str | None, timed: list[tuple[str, str, str, float]]) -> list[dict]:
    """A time row and a throughput row for each (op, shape, provider, median ms), as long_rows makes them."""
    rows = []
    for op, shape, provider, ms in timed:
        common = {"op": op, "shape": shape, "provider": provider, "device": device, **VERSIONS}
        if day is not None:
            common["date"] = day
        rows.append({**common, "metric": "time", "unit": "ms", "p20": ms * 0.98, "p50": ms, "p80": ms * 1.02})
        rows.append({**common, "metric": "throughput", "unit": "TFLOP/s", "p20": 1.0, "p50": 1.0, "p80": 1.0})
    return rows


def _write(path, rows: list[dict], fields=CSV_FIELDS) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)


def _table(text: str) -> list[list[str]]:
    """The table's body rows as lists of cells (caption, header and rule left out)."""
    lines = [line for line in text.splitlines() if line.startswith("| ")][2:]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def test_one_row_per_op_shape_and_device_with_the_peer_and_the_ratio(tmp_path):
    h200 = tmp_path / "benchmarks-nvidia-h200.csv"
    _write(h200, _rows("NVIDIA H200", "2026-11-28", [
        ("flash_attention fwd", "b2 s8192 h16/16 d128 causal", "kreg", 0.886),
        ("flash_attention fwd", "b2 s8192 h16/16 d128 causal", "torch-sdpa", 0.960),
        ("sparse_mla fwd", "s_q 4096 h 128", "kreg", 4.0),
        ("sparse_mla fwd", "s_q 4096 h 128", "torch-reference", 200.0),
        ("sparse_mla bwd", "s_q 4096 h 128", "kreg", 20.5),
    ]))
    h100 = tmp_path / "benchmarks-nvidia-h100.csv"
    _write(h100, _rows("NVIDIA H100 80GB HBM3", "2026-11-27", [
        ("sparse_mla fwd", "s_q 4096 h 128", "kreg", 4.4),
        ("sparse_mla fwd", "s_q 4096 h 128", "torch-reference", 220.0),
    ]))
    text = report([h200, h100])
    assert text.splitlines()[0].startswith("Median milliseconds per call") and "*" not in text.splitlines()[0]
    assert _table(text) == [
        ["flash_attention fwd", "b2 s8192 h16/16 d128 causal", "0.8860", "torch-sdpa", "0.9600", "1.08x",
         "NVIDIA H200", "2026-11-28"],
        ["sparse_mla fwd", "s_q 4096 h 128", "4.000", "torch-reference", "200.0", "50.00x", "NVIDIA H200",
         "2026-11-28"],
        # The H100's row sits beside the H200's row of the same op and shape.
        ["sparse_mla fwd", "s_q 4096 h 128", "4.400", "torch-reference", "220.0", "50.00x", "NVIDIA H100 80GB HBM3",
         "2026-11-27"],
        ["sparse_mla bwd", "s_q 4096 h 128", "20.50", "-", "-", "-", "NVIDIA H200", "2026-11-28"],
    ]


def test_the_newest_run_of_a_device_wins_and_a_file_without_dates_is_dated_by_its_mtime(tmp_path):
    shape = "b8 h64/8 d64 n32768"
    old = tmp_path / "old.csv"  # written before the CSV had a date column
    _write(old, _rows("NVIDIA H200", None, [("decode", shape, "kreg", 0.132), ("decode", shape, "torch-sdpa", 0.125)]),
           fields=[f for f in CSV_FIELDS if f != "date"])
    stamp = datetime(2026, 11, 23, 12, tzinfo=timezone.utc).timestamp()
    os.utime(old, (stamp, stamp))
    new = tmp_path / "new.csv"
    _write(new, _rows("NVIDIA H200", "2026-11-28", [("decode", shape, "kreg", 0.125),
                                                     ("decode", shape, "torch-sdpa", 0.125)]))
    # Given after the newer file, the older run still loses.
    assert _table(report([new, old])) == [["decode", shape, "0.1250", "torch-sdpa", "0.1250", "1.00x", "NVIDIA H200",
                                           "2026-11-28"]]
    alone = report([old])
    assert _table(alone) == [["decode", shape, "0.1320", "torch-sdpa", "0.1250", "0.95x", "NVIDIA H200",
                              "2026-11-23 *"]]
    assert "modification date" in alone.splitlines()[0] and str(old) in alone.splitlines()[0]


def test_long_rows_carry_the_date_the_report_shows(tmp_path):
    path = tmp_path / "run.csv"
    ours = Measurement("nsa fwd", "b1 t8192", "kreg", (2.8, 2.824, 2.9), 1e12, "TFLOP/s", 1e-3)
    peer = Measurement("nsa fwd", "b1 t8192", "torch-sdpa dense causal", (1.9, 1.964, 2.0), 1e12, "TFLOP/s", None)
    write_csv(long_rows([ours, peer], "NVIDIA H200"), str(path))
    [row] = _table(report([path]))
    assert row[:6] == ["nsa fwd", "b1 t8192", "2.824", "torch-sdpa dense causal", "1.964", "0.70x"]
    assert date.fromisoformat(row[7]) <= datetime.now(timezone.utc).date()


def test_command_line(tmp_path, capsys):
    good = tmp_path / "good.csv"
    _write(good, _rows("NVIDIA H200", "2026-11-28", [("decode", "b1 n131072", "kreg", 0.071)]))
    assert main([str(good)]) == 0
    assert "| decode | b1 n131072 | 0.07100 | - | - | - | NVIDIA H200 | 2026-11-28 |" in capsys.readouterr().out
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main([str(bad)]) == 2
    assert "not a long-format benchmark CSV" in capsys.readouterr().err
