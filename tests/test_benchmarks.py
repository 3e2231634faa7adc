"""The benchmark runner without a GPU: it finds every op family's module by itself and writes
long-format rows any plot can read (timing itself needs a GPU: `python -m benchmarks.run`)."""

import csv

from benchmarks.common import CSV_FIELDS, Measurement, long_rows, write_csv
from benchmarks.run import families, main


def test_families_are_discovered():
    found = families()
    assert {"attention", "decode", "sparse_mla"} <= set(found)
    for name, module in found.items():
        assert module.FAMILY == name and callable(module.run)


def test_long_rows_hold_quantiles_units_and_versions(tmp_path):
    m = Measurement("sparse_mla fwd", "s_q 4096", "kreg", (4.9, 5.0, 5.2), 2.0e12, "TFLOP/s", 2e-3)
    peer = Measurement("sparse_mla fwd", "s_q 4096", "torch-reference", (140.0, 148.0, 150.0), 2.0e12, "TFLOP/s",
                       None)
    rows = long_rows([m, peer], "NVIDIA H200")
    assert [(r["provider"], r["metric"], r["unit"]) for r in rows] == [
        ("kreg", "time", "ms"), ("kreg", "throughput", "TFLOP/s"),
        ("torch-reference", "time", "ms"), ("torch-reference", "throughput", "TFLOP/s")]
    time_row, rate_row = rows[:2]
    assert (time_row["p20"], time_row["p50"], time_row["p80"]) == (4.9, 5.0, 5.2)
    # The rate's p20 comes from the slow end of the times.
    assert rate_row["p20"] == 2.0e12 / 5.2 / 1e9 < rate_row["p50"] == 400.0 < rate_row["p80"]
    assert all(r["device"] == "NVIDIA H200" and r["triton_version"] and r["torch_version"] for r in rows)
    path = tmp_path / "rows.csv"
    write_csv(rows, str(path))
    read = list(csv.DictReader(path.open()))
    assert tuple(read[0]) == CSV_FIELDS and len(read) == 4


def test_without_a_gpu_the_runner_says_so(capsys):
    assert main([]) == 2
    assert "need a CUDA or ROCm GPU" in capsys.readouterr().err


def test_dispatch_stub_timing_runs_without_a_gpu():
    """The dispatch-alone timing (stub launcher) that `python -m benchmarks.dispatch` prints."""
    import torch

    from benchmarks.dispatch import stub_dispatch_us

    validate_us, dispatch_us = stub_dispatch_us("decode", "cpu", torch.float16, "nvidia", iters=20, repeats=2)
    assert 0 < validate_us and 0 < dispatch_us
