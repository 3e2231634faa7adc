"""Fan-out sweeps (`tuning.fleet`): the process pool (`--gpus N`) and Ray (`--ray`) run the same work
units a plain sweep runs, into one store; a worker killed mid-unit has its unit run again, resuming
its run (nothing recorded is lost or repeated); `--ray` without Ray is one clear line. On the CPU the
workers run the interpreter (`--gpus N` is then N processes)."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kreg.core.device import usable_cores
from kreg.tuning_db.store import TuningStore

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("--op", "decode", "--shapes", "tiny:0,1")  # two units of a few trials each


def _argv(db: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "kreg.tuning.sweep", "--device", "cpu", *SHAPES, "--db", db, "--no-progress", *args]


def _env(**extra: str) -> dict:
    return {**os.environ, "TRITON_INTERPRET": "1", **extra}


def _sweep(db: str, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(_argv(db, *args), cwd=ROOT, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)


def _trials(db: str) -> list[tuple]:
    # Each trial by its own role's config: a later role is tuned beside the earlier roles' winners, and
    # which of two near-equal configs wins is timing (on a loaded GPU machine it differs run to run).
    trials = TuningStore(db).trials()
    return sorted((t.variant, t.tuning_key, t.role, t.config[t.role].model_dump_json()) for t in trials)


def _runs_by_unit(db: str) -> dict[tuple, list[str]]:
    store = TuningStore(db)
    out: dict[tuple, list[str]] = {}
    for _, status, args in store.runs("decode", "cpu"):
        unit = args["unit"]
        out.setdefault((unit["preset"], unit["index"], unit["variant"]), []).append(status)
    return out


def _kill_when_recording(proc: subprocess.Popen, db: str, is_worker) -> int:
    """Wait for the sweep's first trial, then SIGKILL the process `is_worker(cmdline)` picks among the
    sweep's descendants; returns how many trials were stored before the kill."""
    store = TuningStore(db)
    deadline = time.monotonic() + 300
    while not store.trials() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before a worker could be killed"
    victims = [pid for pid in _descendants(proc.pid) if is_worker(_cmdline(pid))]
    assert victims, "no worker process found"
    os.kill(victims[0], signal.SIGKILL)
    return len(store.trials())


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += children
            todo += children
    return out


@pytest.fixture(scope="session")
def plain(tmp_path_factory, worker_id) -> tuple[list[tuple], set[str]]:
    """The trials and tuned keys of the same sweep run plainly (one process, one unit after another):
    run once per test run, whichever pytest-xdist worker asks first (the others wait for its file)."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # the run's folder, above the workers'
    result = shared / "fleet-plain.json"
    with open(shared / "fleet-plain.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            db = f"sqlite:///{tmp_path_factory.mktemp('plain') / 'plain.db'}"
            done = _sweep(db)
            assert done.returncode == 0, done.stderr
            keys = sorted({t.tuning_key for t in TuningStore(db).tuned()})
            result.write_text(json.dumps({"trials": _trials(db), "keys": keys}))
        found = json.loads(result.read_text())
    return [tuple(t) for t in found["trials"]], set(found["keys"])


@pytest.mark.long
def test_a_pool_of_two_stores_what_a_plain_sweep_does_though_a_worker_is_killed(tmp_path, plain):
    """Two worker processes at once; one killed mid-unit: its unit runs again and resumes its run."""
    db = f"sqlite:///{tmp_path / 'killed.db'}"
    proc = subprocess.Popen(_argv(db, "--gpus", "2"), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stored = _kill_when_recording(proc, db, lambda cmd: "spawn_main" in cmd)
    kept = TuningStore(db).trials()[:stored]
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "retrying decode tiny:" in err and "2 finished, 0 stopped, 0 failed" in err
    trials = _trials(db)
    assert len(trials) == len(set(trials)), "a trial was repeated"
    assert TuningStore(db).trials()[:stored] == kept
    # The killed unit resumed its own run: one run per unit, every one finished.
    assert all(statuses == ["finished"] for statuses in _runs_by_unit(db).values())
    assert trials == plain[0] and {t.tuning_key for t in TuningStore(db).tuned()} == plain[1]
    # Units ran in worker processes, not in the coordinator.
    pids = {int(line.split(" pid ")[1].split(";")[0].split()[0]) for line in err.splitlines() if " pid " in line}
    assert len(pids) == 2 and proc.pid not in pids


def test_ray_without_ray_installed_is_one_line_and_exit_2(tmp_path):
    fake = tmp_path / "no_ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    path = os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])
    done = _sweep(f"sqlite:///{tmp_path / 'x.db'}", "--ray", env=_env(PYTHONPATH=path))
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --ray needs Ray: pip install 'kreg[distributed]'"


def test_gpus_it_cannot_use_are_argument_errors(tmp_path, capsys, monkeypatch):
    from kreg.tuning.sweep import main

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what --device cpu sets, undone after the test
    for count in ("0", "-1", str(usable_cores() + 1)):
        assert main(["--device", "cpu", *SHAPES, "--db", f"sqlite:///{tmp_path / 'x.db'}", "--gpus", count]) == 2
        assert "--gpus" in capsys.readouterr().err


@pytest.fixture
def ray_installed() -> None:
    """Ray is an optional extra (kreg[distributed]): skipped without it, except where CI says it must be
    there (KREG_REQUIRE_RAY=1), so CI never skips these silently."""
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("KREG_REQUIRE_RAY") == "1":
            pytest.fail("KREG_REQUIRE_RAY=1 but Ray is not installed")
        pytest.skip("Ray is not installed (pip install 'kreg[distributed]')")


# Into PostgreSQL, the store a cluster of hosts shares (the pool's test covers SQLite's many writers).
@pytest.mark.long
@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_a_ray_sweep_stores_what_a_plain_sweep_does_though_a_worker_is_killed(store_url, ray_installed, plain):
    """On a local cluster; one Ray worker killed mid-unit: Ray runs the task again and it resumes its run."""
    db = store_url
    proc = subprocess.Popen(_argv(db, "--ray"), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _kill_when_recording(proc, db, lambda cmd: cmd.startswith("ray::run_unit"))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "on Ray (local cluster)" in err and "2 finished, 0 stopped, 0 failed" in err
    trials = _trials(db)
    assert len(trials) == len(set(trials)), "a trial was repeated"
    assert all(statuses == ["finished"] for statuses in _runs_by_unit(db).values())
    assert trials == plain[0]


def test_retune_stale_tunes_exactly_the_devices_stale_entries(tmp_path):
    """Each stale entry of the device is one unit (its key's preset shape, its variant); another device's
    stale entry, an entry whose key no preset shape has and, with --op, another op's entry are left
    alone."""
    import torch

    from kreg.core.device import CPU, preset
    from kreg.core.records import LaunchConfig, TunedConfig, canonical_json
    from kreg.ops import OPS
    from kreg.ops.catalog import load_all
    from kreg.tuning.engine import shape_key

    db = f"sqlite:///{tmp_path / 'stale.db'}"
    op = OPS["decode"]
    tiny = [canonical_json(shape_key(op, shape, torch.float16)) for shape in op.presets["tiny"][:2]]
    old = dict(op="decode", variant="decode_splitkv", source_hash="0000older0000000",
               config=LaunchConfig(blocks={"BLOCK_N": 16}), triton_version="3.6.0", torch_version="2.13.0")
    store = TuningStore(db)
    for device, key in ((CPU, tiny[0]), (CPU, '{"d":64}'), (preset("h200"), tiny[1])):
        store.upsert_tuned(TunedConfig(device_key=device.key, tuning_key=key, **old), device)
    dense = OPS["flash_attention"]
    dense_key = canonical_json(shape_key(dense, dense.presets["tiny"][0], torch.float16))
    store.upsert_tuned(TunedConfig(device_key=CPU.key, tuning_key=dense_key, **{
        **old, "op": "flash_attention", "variant": "flash_attention_tiled",
        "config": LaunchConfig(blocks={"BLOCK_M": 16, "BLOCK_N": 16})}), CPU)
    done = subprocess.run([sys.executable, "-m", "kreg.tuning.sweep", "--device", "cpu", "--retune-stale", "--db", db,
                           "--op", "decode", "--no-progress"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "1 stale entry of cpu to re-tune, 1 without a preset shape" in done.stderr
    assert {t.tuning_key for t in store.trials()} == {tiny[0]}
    now = {(t.device_key, t.tuning_key): t.source_hash for t in store.tuned()}
    current = next(v for v in load_all()["decode"]
                   if v.name == "decode_splitkv").source_hash
    assert now == {("cpu", tiny[0]): current, ("cpu", '{"d":64}'): "0000older0000000",
                   (preset("h200").key, tiny[1]): "0000older0000000", ("cpu", dense_key): "0000older0000000"}
