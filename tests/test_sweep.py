"""The sweep: correctness gate before timing, every trial recorded, roles tuned one at a time, clean
stops and resumes, a watchdog for hanging trials, argument errors, device checks, compile-only reports
and stale detection."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kreg.core.device import CPU, detect
from kreg.core.records import CallConfig, LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.variant import CallPlan, Variant
from kreg.tuning.engine import sweep_op
from kreg.tuning_db.store import TuningStore

from .conftest import HAS_GPU

ROOT = Path(__file__).resolve().parents[1]
# Sweeps over the interpreter's config space in this process need the interpreter, which a GPU machine's
# test run does not set (the CLI tests set it in their subprocess).
interpreter_only = pytest.mark.skipif(HAS_GPU, reason="sweeps the interpreter's config space in-process")


def _cli(*args: str, db: str, interpret: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "kreg.tuning.sweep", *args, "--db", db, "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _probe_space(*blocks: int) -> ConfigSpace:
    return ConfigSpace(blocks={"BLOCK": blocks}, defaults={"*": {"BLOCK": blocks[0]}},
                       interpreter=tuple({"BLOCK": b} for b in blocks))


class _Gated(Variant):
    """A fake variant: BLOCK=1 is right, BLOCK=2 is wrong, BLOCK=3 raises, BLOCK=5 hangs (only when
    asked to). Only BLOCK=1 may win."""

    op, vendor, name = "flash_attention", "nvidia", "flash_attention_gate_probe"
    kernels = {"fwd": None}
    spaces = {"fwd": _probe_space(1, 2, 3, 4)}

    def prune_reason(self, role, config, key, device):
        return "too big" if config.blocks["BLOCK"] == 4 else None

    def launch(self, args, plan):
        block = plan.config["fwd"].blocks["BLOCK"]
        out = OPS["flash_attention"].reference(**args)
        if block == 2:
            return out + 1
        if block == 3:
            raise RuntimeError("boom")
        if block == 5:
            time.sleep(3600)  # a kernel that never finishes
        return out


class _Hangs(_Gated):
    spaces = {"fwd": _probe_space(1, 5, 2)}


def _blocks(trials) -> dict:
    return {t.config["fwd"].blocks["BLOCK"]: t.status for t in trials}


def test_gate_rejects_wrong_configs_and_the_right_one_wins(tmp_path):
    store = TuningStore(f"sqlite:///{tmp_path / 's.db'}")
    op = OPS["flash_attention"]
    shape = op.presets["tiny"][0]
    stats, finished = sweep_op(op, [_Gated()], CPU, torch.device("cpu"), [shape], torch.float16, store,
                               resume=False, deadline=None)
    assert finished
    assert _blocks(store.trials()) == {1: "ok", 2: "wrong_result", 3: "runtime_error", 4: "pruned"}
    assert {t.role for t in store.trials()} == {"fwd"}
    assert all(t.time_ms is None for t in store.trials() if t.status != "ok")
    (winner,) = store.tuned(op="flash_attention")
    assert winner.config == CallConfig({"fwd": LaunchConfig(blocks={"BLOCK": 1})}) and winner.device_key == "cpu"
    assert winner.vendor == "nvidia" and winner.backward_ms is None  # no backward role: no backward time


def test_a_hanging_trial_is_killed_and_the_sweep_goes_on(tmp_path):
    """BLOCK=5 never returns: its child process is killed at the trial timeout, the trial is recorded as
    a timeout, and the next trial runs in a new child."""
    store = TuningStore(f"sqlite:///{tmp_path / 'hang.db'}")
    op = OPS["flash_attention"]
    started = time.monotonic()
    _, finished = sweep_op(op, [_Hangs()], CPU, torch.device("cpu"), [op.presets["tiny"][0]], torch.float16, store,
                           resume=False, deadline=None, trial_timeout=8)
    assert finished and time.monotonic() - started < 300
    assert _blocks(store.trials()) == {1: "ok", 5: "timeout", 2: "wrong_result"}
    hung = next(t for t in store.trials() if t.status == "timeout")
    assert "did not finish in 8 s" in hung.error and hung.time_ms is None
    assert store.tuned(op="flash_attention")[0].config["fwd"].blocks == {"BLOCK": 1}


def test_statuses_come_from_exception_types():
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from kreg.tuning.trials import classify

    assert classify(OutOfResources(300000, 232448, "shared memory")) == "out_of_resources"
    assert classify(torch.cuda.OutOfMemoryError("out of memory")) == "out_of_resources"
    assert classify(CompilationError.__new__(CompilationError)) == "compile_error"
    # A message that merely mentions compiling or resources is still a runtime error.
    assert classify(RuntimeError("out of resource: compilation failed")) == "runtime_error"


def test_autotune_call_tunes_one_key_on_its_own_inputs(tmp_path):
    from kreg.tuning.autotune import autotune_call

    store = TuningStore(f"sqlite:///{tmp_path / 'auto.db'}")
    op = OPS["flash_attention"]
    args = op.validate(**op.make_inputs(op.presets["tiny"][1], device="cpu", dtype=torch.float16, seed=3))
    tuned = autotune_call(op, [_Gated()], CPU, args, store)
    assert tuned is not None and tuned.config["fwd"].blocks == {"BLOCK": 1}
    assert store.best("flash_attention", CPU, tuned.tuning_key) == tuned
    assert {t.status for t in store.trials()} == {"ok", "wrong_result", "runtime_error", "pruned"}


def test_a_role_with_role_arguments_is_gated_and_timed_with_them():
    """sparse_mla's deterministic backward roles run only under deterministic=True: their trials pass
    it (gate and timing), the default backward's trials do not."""
    from kreg.tuning.trials import KeyInputs, run_trial

    op = OPS["sparse_mla"]
    real = next(v for v in load_all()["sparse_mla"] if v.name == "sparse_mla_headblock" and v.vendor == "nvidia")
    seen = []

    class Recording(type(real)):
        def bind(self, plan):
            run = super().bind(plan)

            def launch(args):
                seen.append(args["deterministic"])
                return run(args)

            return launch

    device = torch.device("cuda" if HAS_GPU else "cpu")
    here = detect(device) if HAS_GPU else CPU
    args = op.validate(**op.make_inputs(op.presets["tiny"][0], device=device, dtype=torch.float16, seed=2))
    variant = Recording()
    key = dict(op.tuning_key(args))
    plan = CallPlan(variant.default_config(key, here), key, here)
    for role, expected in (("bwd_dq", True), ("bwd_fused", False)):
        seen.clear()
        status, _, error = run_trial(KeyInputs.for_args(op, args), variant, plan, role)
        assert status == "ok", error
        assert seen and set(seen) == {expected}, role


@pytest.mark.long
def test_cli_sweeps_every_role_in_the_interpreter_and_prints_winners(tmp_path):
    """sparse_mla's call launches a forward and its backward kernels (the default and the deterministic
    passes): each role is tuned in turn (the backward ones gated on gradients and timed on the
    backward), and the winner holds all of them."""
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    done = _cli("--device", "cpu", "--op", "sparse_mla", "--shapes", "tiny:0", db=db)
    assert done.returncode == 0, done.stderr
    store = TuningStore(db)
    trials = store.trials(op="sparse_mla")
    assert trials and all(t.device_key == "cpu" for t in trials)
    assert {t.status for t in trials} == {"ok"}, [t.error for t in trials]
    variant = next(v for v in load_all()["sparse_mla"] if v.name == "sparse_mla_headblock" and v.vendor == "nvidia")
    sizes = {role: len(c) for role, c in variant.space({}, CPU).items()}
    assert {r: sum(t.role == r for t in trials) for r in sizes} == sizes
    # Each stage varies its own role only, from the winner of the stages before it.
    fwd_winner = min((t for t in trials if t.role == "fwd"), key=lambda t: t.time_ms).config["fwd"]
    assert all(t.config["fwd"] == fwd_winner for t in trials if t.role != "fwd")
    assert "tuned configs on cpu" in done.stdout and "sparse_mla_headblock" in done.stdout
    (tuned,) = store.tuned(op="sparse_mla", device_key="cpu")
    assert tuned.config.roles() == ("bwd_dkv", "bwd_dq", "fwd") or set(tuned.config.roles()) == set(sizes)
    assert tuned.time_ms > 0 and tuned.backward_ms > 0 and tuned.vendor == "nvidia"


@pytest.mark.long
@interpreter_only
def test_a_resumed_multi_role_sweep_finds_its_stage_winners_in_the_database(tmp_path):
    """Resuming reads the earlier trials back from the database (their call configs' roles in another
    order): every trial is skipped and the same winner is promoted again."""
    from kreg.tuning_db.models import SweepRun

    store = TuningStore(f"sqlite:///{tmp_path / 'resume.db'}")
    op = OPS["sparse_mla"]
    variant = next(v for v in load_all()["sparse_mla"] if v.name == "sparse_mla_headblock" and v.vendor == "nvidia")
    shape = op.presets["tiny"][0]
    first, finished = sweep_op(op, [variant], CPU, torch.device("cpu"), [shape], torch.float16, store,
                               resume=False, deadline=None, isolate=False)
    assert finished and len(first.winners) == 1
    trials = store.trials()
    store._run(lambda s: s.query(SweepRun).update({"status": "stopped"}), write=True)  # as if cut short
    again, finished = sweep_op(op, [variant], CPU, torch.device("cpu"), [shape], torch.float16, store,
                               resume=True, deadline=None, isolate=False)
    assert finished and again.done == 0 and again.skipped == len(trials) and store.trials() == trials
    assert [w.config for w in again.winners] == [w.config for w in first.winners]


@pytest.mark.long
def test_roles_tunes_only_those_and_times_the_rest_once(tmp_path):
    db = f"sqlite:///{tmp_path / 'roles.db'}"
    done = _cli("--device", "cpu", "--op", "sparse_mla", "--shapes", "tiny:0", "--roles", "bwd_dkv", db=db)
    assert done.returncode == 0, done.stderr
    trials = TuningStore(db).trials(op="sparse_mla")
    # The bwd_dkv stage (timed under deterministic=True), then one forward and one default backward
    # timing of the call config as it stands: the table's backward time is the backward a call gets
    # without arguments, not the deterministic one its stage timed.
    assert sorted(t.role for t in trials) == ["bwd_dkv", "bwd_dkv", "bwd_pre", "fwd"]
    (tuned,) = TuningStore(db).tuned(op="sparse_mla")
    default_backward = next(t for t in trials if t.role == "bwd_pre")
    assert tuned.config == default_backward.config
    assert tuned.backward_ms == default_backward.time_ms
    assert tuned.time_ms == next(t for t in trials if t.role == "fwd").time_ms


def _space_size(op_name: str, preset_index: int = 0) -> int:
    op = OPS[op_name]
    args = op.validate(**op.make_inputs(op.presets["tiny"][preset_index], device="cpu", dtype=torch.float16, seed=0))
    variant = next(v for v in load_all()[op_name] if v.vendor == "nvidia" and v.runs_in_interpreter)
    return sum(len(configs) for configs in variant.space(dict(op.tuning_key(args)), CPU).values())


def _assert_one_complete_run(store: TuningStore, expected: int) -> None:
    trials = store.trials()
    keys = [(t.variant, t.tuning_key, t.config.to_json(), t.role) for t in trials]
    assert len(keys) == len(set(keys)) == expected


@pytest.mark.long
def test_max_minutes_stops_cleanly_and_resume_finishes_without_duplicates(tmp_path):
    db = f"sqlite:///{tmp_path / 'slices.db'}"
    first = _cli("--device", "cpu", "--op", "flash_attention", "--shapes", "tiny:1", "--max-minutes", "0", db=db)
    assert first.returncode == 0, first.stderr
    assert "--resume" in first.stderr
    store = TuningStore(db)
    assert store.trials() == []
    second = _cli("--device", "cpu", "--op", "flash_attention", "--shapes", "tiny:1", "--resume", db=db)
    assert second.returncode == 0, second.stderr
    _assert_one_complete_run(store, _space_size("flash_attention", 1))


@pytest.mark.long
def test_sweep_killed_with_sigkill_resumes_without_duplicates(tmp_path):
    db = f"sqlite:///{tmp_path / 'killed.db'}"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    shapes = ("--shapes", "tiny:1,2")  # two shapes: long enough to be killed in the middle
    proc = subprocess.Popen([sys.executable, "-m", "kreg.tuning.sweep", "--device", "cpu", "--op", "flash_attention",
                             *shapes, "--db", db, "--no-progress"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = TuningStore(db)
    deadline = time.monotonic() + 300
    while not store.trials() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    trials = store.trials()
    assert trials and all(t.status in ("ok", "pruned") for t in trials), [t.error for t in trials]
    done = _cli("--device", "cpu", "--op", "flash_attention", *shapes, "--resume", db=db)
    assert done.returncode == 0, done.stderr
    _assert_one_complete_run(store, _space_size("flash_attention", 1) + _space_size("flash_attention", 2))


def test_timing_a_device_that_is_not_present_is_a_clear_error(tmp_path):
    done = _cli("--device", "mi355", "--op", "flash_attention", db=f"sqlite:///{tmp_path / 'x.db'}")
    assert done.returncode == 2
    assert "--compile-only" in done.stderr and "amd-mi355x" in done.stderr


def test_unknown_device_op_and_filter_are_clear_errors(tmp_path):
    db = f"sqlite:///{tmp_path / 'x.db'}"
    assert "unknown device" in _cli("--device", "tpu", db=db).stderr
    assert "--op" in _cli("--device", "cpu", "--op", "nope", db=db).stderr
    assert "--op: unknown op 'nope'" in _cli("--device", "cpu", "--retune-stale", "--op", "nope", db=db).stderr
    assert "--filter" in _cli("--device", "cpu", "--filter", "BLOCK_H", db=db).stderr


@pytest.mark.parametrize("args,message", [
    (("--shapes", "tiny:99"), "--shapes: flash_attention's 'tiny' preset has shapes 0..2, got '99'"),
    (("--shapes", "tiny:x"), "--shapes"),
    (("--shapes", "huge"), "--shapes: flash_attention has presets tiny, full, got 'huge'"),
    (("--max-minutes", "-5"), "--max-minutes"),
    (("--trial-timeout", "0"), "--trial-timeout"),
    (("--variant", "nope"), "--variant: flash_attention has nvidia variants flash_attention_warpspec, "
                            "flash_attention_tiled, got 'nope'"),
    (("--filter", "BLOCK_Z=3"), "--filter BLOCK_Z=3: selects no config of flash_attention"),
    (("--filter", "speed=3"), "--filter: 'speed' is neither a block"),
    (("--roles", "split"), "--roles: flash_attention's variants have the roles bwd_dkv, bwd_dq, bwd_pre, fwd, "
                           "got split"),
])
def test_arguments_that_select_nothing_exit_2_with_a_message(tmp_path, args, message):
    """Nothing is swept, no traceback: one line naming the argument."""
    done = _cli("--device", "cpu", "--op", "flash_attention", *args, db=f"sqlite:///{tmp_path / 'x.db'}")
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert TuningStore(f"sqlite:///{tmp_path / 'x.db'}").trials() == []


def test_corrupted_database_is_a_clear_cli_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_text("not sqlite\n" * 100)
    done = _cli("--device", "cpu", "--op", "flash_attention", db=f"sqlite:///{bad}")
    assert done.returncode == 2 and str(bad) in done.stderr


def test_compile_only_records_resources_for_gfx950(tmp_path):
    db = f"sqlite:///{tmp_path / 'cc.db'}"
    done = _cli("--device", "mi355x", "--compile-only", "--op", "sparse_mla", "--shapes", "tiny:0",
                "--filter", "BLOCK_TOPK=32,num_warps=4,waves_per_eu=0,matrix_instr_nonkdim=16", "--roles", "fwd",
                db=db, interpret=False)
    assert done.returncode == 0, done.stderr
    assert "compile-only resources for amd-mi355x" in done.stdout
    trials = TuningStore(db).trials(op="sparse_mla")
    assert trials and all(t.device_key == "amd-mi355x" and t.role == "fwd" for t in trials)
    ok = [t for t in trials if t.status == "ok"]
    assert ok and all(t.registers and t.spills == 0 and t.shared_bytes is not None for t in ok)


def test_compile_only_draws_each_roles_default_and_a_seeded_sample(tmp_path):
    """By default --compile-only compiles each role's default and --sample others, the same ones on every
    machine (a seed of op, key, variant and role); a line per op."""
    from kreg.tuning.engine import sample_configs

    db = f"sqlite:///{tmp_path / 'sample.db'}"
    done = _cli("--device", "mi355x", "--compile-only", "--op", "gsa_indexer", "--shapes", "tiny:0", "--no-progress",
                "--sample", "2", "--export", str(tmp_path / "report"), db=db, interpret=False)
    assert done.returncode == 0, done.stderr
    assert "gsa_indexer -> gfx950: " in done.stderr and " configs compiled, " in done.stderr
    # The resource report: a row per compiled config, occupancy estimated for those that fit.
    rows = list(csv.DictReader((tmp_path / "report" / "amd-mi355x__gsa_indexer__resources.csv").open()))
    assert len(rows) == len(TuningStore(db).trials()) and {r["op"] for r in rows} == {"gsa_indexer"}
    fits = [r for r in rows if r["status"] == "ok"]
    assert fits and all(0 < float(r["occupancy"]) <= 1 and r["limited_by"] for r in fits)
    summary = (tmp_path / "report" / "amd-mi355x__gsa_indexer__resources.md").read_text()
    groups = {(r["tuning_key"], r["variant"], r["role"]) for r in rows}  # a summary line each
    assert "| best occupancy |" in summary and summary.count("| gsa_indexer |") == len(groups)
    by_role: dict[str, list] = {}
    for t in TuningStore(db).trials(op="gsa_indexer"):
        by_role.setdefault(t.role, []).append(t.config[t.role])
    variant = next(v for v in load_all()["gsa_indexer"] if v.vendor == "amd")
    assert set(by_role) == set(variant.roles) and all(len(c) == 3 for c in by_role.values())
    # A finished compile-only run is not compiled again under --resume: its report is exported at once.
    again = _cli("--device", "mi355x", "--compile-only", "--op", "gsa_indexer", "--shapes", "tiny:0", "--no-progress",
                 "--sample", "2", "--resume", "--export", str(tmp_path / "again"), db=db, interpret=False)
    assert again.returncode == 0, again.stderr
    assert "gsa_indexer -> gfx950: 0 configs compiled" in again.stderr
    assert (tmp_path / "again" / "amd-mi355x__gsa_indexer__resources.csv").read_text() == \
        (tmp_path / "report" / "amd-mi355x__gsa_indexer__resources.csv").read_text()
    space = list(range(20))
    drawn = sample_configs(space, 7, 4, "op key variant role")
    assert drawn[0] == 7 and len(set(drawn)) == 5 and drawn == sample_configs(space, 7, 4, "op key variant role")
    assert sorted(sample_configs(space, 99, 30, "seed")) == space  # a default outside the space: all others


def test_stale_lists_configs_of_an_older_kernel(tmp_path):
    from kreg.core.records import TunedConfig

    db = f"sqlite:///{tmp_path / 'stale.db'}"
    store = TuningStore(db)
    store.upsert_tuned(TunedConfig(op="flash_attention", device_key="cpu", tuning_key='{"d":64}',
                                   variant="flash_attention_tiled", source_hash="0000older0000000",
                                   config=LaunchConfig(blocks={"BLOCK_M": 16, "BLOCK_N": 16}),
                                   triton_version="3.6.0", torch_version="2.13.0"), CPU)
    done = _cli("--device", "cpu", "--stale", db=db)
    assert done.returncode == 0
    # Shipped tables of a kernel changed since their sweep are listed too: count only the database's.
    listed = [line for line in done.stdout.splitlines() if line.startswith("stale (database)")]
    assert len(listed) == 1 and "0000older0000000" in listed[0] and "stale tuned config(s)" in done.stdout


@pytest.mark.long
@pytest.mark.parametrize("device", ["h100", "h200"])
def test_compile_only_refuses_cpu_and_accepts_nvidia_targets(tmp_path, device):
    db = f"sqlite:///{tmp_path / 'n.db'}"
    assert _cli("--device", "cpu", "--compile-only", db=db).returncode == 2
    done = _cli("--device", device, "--compile-only", "--op", "sparse_mla", "--shapes", "tiny:0",
                "--filter", "BLOCK_TOPK=32,num_warps=4,num_stages=1", db=db, interpret=False)
    assert done.returncode == 0, done.stderr
    assert TuningStore(db).trials(op="sparse_mla")


@pytest.mark.parametrize("args,message", [
    (("--shapes", "tiny:\u00b2"), "--shapes: flash_attention's 'tiny' preset has shapes 0..2, got '\u00b2'"),
    (("--filter", "BLOCK_N=\u00b2"), "--filter: expected K=V pairs with integer values, got 'BLOCK_N=\u00b2'"),
    (("--trial-timeout", "inf"), "--trial-timeout: expected seconds above 0, at most 86400"),
    (("--trial-timeout", "nan"), "--trial-timeout: expected seconds above 0, at most 86400"),
    (("--trial-timeout", "1e300"), "--trial-timeout: expected seconds above 0, at most 86400"),
    (("--max-minutes", "nan"), "--max-minutes: expected minutes from 0 to 10080"),
])
def test_numbers_it_cannot_use_are_argument_errors(tmp_path, monkeypatch, capsys, args, message):
    """Digits Python's int() refuses (superscripts pass str.isdigit) and floats no timer can use: one
    line and exit 2, before anything is swept."""
    from kreg.tuning.sweep import main

    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))  # main may set it
    db = f"sqlite:///{tmp_path / 'x.db'}"
    assert main(["--device", "cpu", "--op", "flash_attention", *args, "--db", db, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert TuningStore(db).trials() == []


@pytest.mark.parametrize("target", ["file", "link", "link to a folder"])
def test_an_export_target_it_would_refuse_is_refused_before_sweeping(tmp_path, monkeypatch, capsys, target):
    """--export names a file, or a folder whose table would replace a link: refused in one line before the
    first trial (export refuses both; a sweep must not run for an hour first)."""
    from kreg.tuning.sweep import main

    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))
    out = tmp_path / "out"
    if target == "file":
        out.write_text("a file, not a folder\n")
    elif target == "link":
        out.mkdir()
        (out / "cpu__flash_attention.json").symlink_to(tmp_path / "elsewhere.json")
    else:
        (tmp_path / "real").mkdir()
        out.symlink_to(tmp_path / "real")
        (tmp_path / "real" / "cpu__flash_attention.json").symlink_to(tmp_path / "elsewhere.json")
    db = f"sqlite:///{tmp_path / 'x.db'}"
    assert main(["--device", "cpu", "--op", "flash_attention", "--export", str(out), "--db", db, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--export" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert TuningStore(db).trials() == [] and not (tmp_path / "elsewhere.json").exists()


def test_stale_lists_only_the_devices_entries(tmp_path, capsys):
    """--stale honours --device: an H100 entry of an older kernel is not an H200 one."""
    from kreg.core.device import preset
    from kreg.core.records import TunedConfig
    from kreg.tuning.sweep import main

    db = f"sqlite:///{tmp_path / 'stale.db'}"
    store = TuningStore(db)
    for name in ("h100", "h200"):
        store.upsert_tuned(TunedConfig(op="flash_attention", device_key=preset(name).key, tuning_key='{"d":64}',
                                       variant="flash_attention_tiled", source_hash=f"0000older{name}",
                                       config=LaunchConfig(blocks={"BLOCK_M": 16, "BLOCK_N": 16}),
                                       triton_version="3.6.0", torch_version="2.13.0"), preset(name))
    for name, other in (("h100", "h200"), ("h200", "h100")):
        assert main(["--device", name, "--stale", "--db", db]) == 0
        out = capsys.readouterr().out
        listed = [line for line in out.splitlines() if line.startswith("stale")]
        assert listed and all(f" {preset(name).key} " in line for line in listed)
        assert f"0000older{name}" in out and f"0000older{other}" not in out
