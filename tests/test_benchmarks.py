"""The benchmark runner without a GPU: it finds every op family's module by itself and writes
long-format rows any plot can read (timing itself needs a GPU: `python -m benchmarks.run`)."""

import csv

import pytest
import torch

from kreg.benchmarks.common import CSV_FIELDS, Measurement, long_rows, write_csv
from kreg.benchmarks.run import families, main


@pytest.fixture
def no_gpu(monkeypatch):
    """The tools as a machine without a GPU sees them (on a GPU machine they would run the benchmarks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


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


def test_without_a_gpu_the_runner_says_so(capsys, no_gpu):
    assert main([]) == 2
    assert "need a CUDA or ROCm GPU" in capsys.readouterr().err


def test_dispatch_stub_timing_runs_anywhere():
    """The dispatch-alone timing (stub launcher) that `python -m benchmarks.dispatch` prints (CPU tensors
    through the interpreter's variants when there is no GPU)."""
    import torch

    from kreg.benchmarks.dispatch import stub_dispatch_us

    device, vendor = ("cuda", None) if torch.cuda.is_available() else ("cpu", "nvidia")
    validate_us, dispatch_us = stub_dispatch_us("decode", device, torch.float16, vendor, iters=20, repeats=2)
    assert 0 < validate_us and 0 < dispatch_us


def test_gsa_tool_without_a_gpu_and_its_arguments(capsys, no_gpu):
    """`python -m benchmarks.gsa`: argument errors before anything runs, the no-GPU message, the
    layer's FLOP count."""
    from kreg.benchmarks import gsa

    assert gsa.main([]) == 2
    assert "need a CUDA or ROCm GPU" in capsys.readouterr().err
    for bad in (["--profile", "--ncu"], ["--profile-ref-only", "--profile-opt-only"], ["--T", "0"],
                ["--dtype", "int8"], ["--only", "topk", "--ncu"], ["--only", "nothing"]):
        with pytest.raises(SystemExit) as stop:
            gsa.parse_args(bad)
        assert stop.value.code == 2
    args = gsa.parse_args(["--T", "256,512", "--profile", "--profile-T", "1024", "--profile-opt-only"])
    assert args.T == [256, 512] and args.profile_T == 1024 and gsa._which(False, True) == ("registry",)
    assert gsa.parse_args(["--only", "topk"]).only == "topk" and set(gsa.TARGET_ROWS) == {"layer", "topk", "attention"}
    cfg = {**gsa.LAYER, "d_model": 8, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4, "d_indexer": 2,
           "n_indexer_heads": 3, "k": 2}
    # t 3: projections 2*3*8*(3*2*4 + 3*1*4 + 3*2 + 2 + 3); scoring 2*3*6*2; attention 4*2*(1+2+2)*4.
    assert gsa.layer_flops(1, 3, cfg) == 2 * 3 * 8 * 47 + 2 * 3 * 6 * 2 + 4 * 2 * 5 * 4


def test_gsa_table_csv_and_plot_from_rows(tmp_path, capsys):
    """The sweep's table, CSV rows and plot from measured rows, an OOM and a skipped reference among them."""
    from kreg.benchmarks import gsa

    rows = [{"T": 1024, "reference": ((9.0, 10.0, 11.0), 2**30), "registry": ((0.9, 1.0, 1.1), 2**26)},
            {"T": 65536, "reference": "skipped", "registry": "OOM"}]
    gsa.print_table(rows, 1)
    table = capsys.readouterr().out
    assert "10.0x" in table and "0.06x" in table and "skipped" in table and "OOM" in table
    csv_rows = gsa.sweep_csv_rows(rows, 1, "NVIDIA H200")
    assert [(r["provider"], r["metric"]) for r in csv_rows] == [
        ("torch-reference", "time"), ("torch-reference", "throughput"), ("torch-reference", "peak_memory"),
        ("kreg", "time"), ("kreg", "throughput"), ("kreg", "peak_memory")]
    assert csv_rows[2]["p50"] == 1024.0 and csv_rows[5]["unit"] == "MiB"
    path = tmp_path / "gsa.png"
    drawn = gsa.plot(rows, 1, path, "test")
    assert drawn == path.exists()
    if not drawn:
        assert "matplotlib is not installed" in capsys.readouterr().out


def test_gsa_causal_topk_indices_are_distinct_causal_keys():
    """The attention rows' top-k indices: per query min(k, i + 1) distinct keys in [0, i], -1 after."""
    from kreg.benchmarks import gsa

    t, k = 23, 8
    indices = gsa.causal_topk_indices(2, t, k, "cpu", seed=3)
    assert indices.shape == (2, t, k) and indices.dtype == torch.int32
    for rows in indices.tolist():
        for i, row in enumerate(rows):
            keys = [j for j in row if j != -1]
            assert row == keys + [-1] * (k - len(keys))
            assert len(keys) == min(k, i + 1) == len(set(keys)) and all(0 <= j <= i for j in keys)


@pytest.mark.parametrize("t", [8192, 65536, 77])
def test_nsa_overlapping_selection_is_a_causal_top_k_that_neighbours_share(t):
    """The nsa benchmark's trained-like selection at the target's blocks: every token selects its own
    block and min(16, own + 1) distinct causal blocks (-1 after), and consecutive tokens of a kv head
    share 50-75% of them at the benchmark's KEEP (the short t 77 shares nearly all: two blocks)."""
    from kreg.benchmarks.nsa import KEEP, overlapping_selection, shared_fraction

    ids = overlapping_selection(1, t, 4, 64, 16, KEEP, seed=1)
    assert ids.shape == (1, t, 4, 16) and ids.dtype == torch.int32
    own = (torch.arange(t) // 64)[None, :, None, None]
    valid = ids >= 0
    assert torch.equal(valid.sum(-1), torch.clamp(own[..., 0] + 1, max=16).expand(1, t, 4))
    assert bool((ids[~valid] == -1).all()) and bool((ids.long() <= own).all())
    assert bool((ids.long() == own).any(-1).all())
    ordered = ids.long().sort(-1).values  # duplicates, if any, would sit side by side
    assert not bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any())
    assert bool((valid[..., :-1] >= valid[..., 1:]).all())
    shared = shared_fraction(ids)
    assert 0.5 <= shared <= 0.75 if t > 4096 else shared > 0.9
    with pytest.raises(ValueError, match="keep"):
        overlapping_selection(1, t, 4, 64, 16, 1.5)


def test_nsa_shared_fraction_counts_what_the_previous_token_also_selects():
    from kreg.benchmarks.nsa import shared_fraction

    ids = torch.tensor([[[[0, 1, -1]], [[1, 2, -1]], [[3, -1, -1]]]], dtype=torch.int32)  # [1, 3, 1, 3]
    assert shared_fraction(ids) == pytest.approx(1 / 3)  # token 1 shares 1 of 2, token 2 none of 1


def test_attention_forward_tool_without_a_gpu_and_its_arguments(capsys, no_gpu):
    """`python -m benchmarks.attention`: its variant kinds name registered variants of each op, a wrong
    kind or --preset is an argument error, and without a GPU it says so."""
    from kreg.benchmarks import attention
    from kreg.ops.catalog import load_all

    for names in attention.KINDS.values():
        for op, name in names.items():
            assert any(v.name == name and v.vendor == "nvidia" for v in load_all()[op])
    assert {op.name for op, _ in attention.FORWARD_SHAPES} == {"flash_attention", "sink_attention"}
    with pytest.raises(SystemExit):
        attention.main(["--variants", "tiled,fastest"])
    assert "expected kinds" in capsys.readouterr().err
    assert attention.main(["--shape", "0"]) == 2
    assert "need a CUDA or ROCm GPU" in capsys.readouterr().err
    for bad in ("decode:0", "sink_attention"):
        with pytest.raises(SystemExit):
            attention.main(["--preset", bad])
        assert "--preset: expected OP:I,J" in capsys.readouterr().err
    assert attention.main(["--preset", "sink_attention:1,2"]) == 2
