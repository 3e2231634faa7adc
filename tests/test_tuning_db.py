"""The tuning database: trials, runs and tuned winners round trip; device and nearest-key matching; many
writers, a killed writer, racing upserts that keep the faster entry, and a damaged file.

Tests that take `store` or `store_url` (tests/conftest.py) run on SQLite and on PostgreSQL (a database of
their own on the server KREG_TEST_POSTGRES_URL names; skipped without one, failed under
KREG_REQUIRE_POSTGRES=1). Tests of files (damaged, migrated from an old SQLite file, made by the first
write) are SQLite's alone.

Spawned worker processes import this module, so it keeps torch (kreg.core.device) out of its top level:
workers describe their device with `DeviceDescriptor`, which has the same identity fields.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import multiprocessing
import random
import socket
import sqlite3
import time
import traceback
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path

import pytest
from sqlalchemy import (
    Column,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    create_engine,
    insert,
    inspect,
    update,
)
from sqlalchemy.engine import make_url

from kreg.core.records import CallConfig, LaunchConfig, TrialResult, TunedConfig, canonical_json
from kreg.tuning_db.environment import default_url
from kreg.tuning_db.errors import TuningDatabaseError
from kreg.tuning_db.matching import key_distance
from kreg.tuning_db.models import TunedRow
from kreg.tuning_db.store import TuningStore
from kreg.tuning_db.table_files import DeviceDescriptor

OP = "sparse_mla"
LENGTHS = ("s_q", "s_kv")  # the test keys' length dims
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def presets():
    from kreg.core.device import preset  # not at the top: see the module docstring

    return {name: preset(name) for name in ("h100", "h200", "mi300x", "mi355x")}


@pytest.fixture
def store(store_url) -> TuningStore:
    db = TuningStore(store_url)  # this test's own SQLite file or PostgreSQL database
    yield db
    db.close()


def descriptor(device) -> dict:
    return DeviceDescriptor.of(device).model_dump()


def make_key(rng: random.Random, **fixed) -> str:
    dims = {"h_q": 128, "d_qk": 576, "topk": 2048, "s_q": 1 << rng.randint(4, 16), "dtype": "bfloat16"}
    return canonical_json({**dims, **fixed})


def make_trials(n: int, device_key: str, seed: int,
                variant: str = "sparse_mla_headblock") -> list[TrialResult]:
    """`n` distinct trials (BLOCK_N differs per trial) with random times, statuses and keys."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        config = LaunchConfig(blocks={"BLOCK_H": rng.choice([16, 32, 64]), "BLOCK_N": 16 * (i + 1)},
                              num_warps=rng.choice([4, 8]), num_stages=rng.randint(1, 3))
        ok = rng.random() < 0.7
        out.append(TrialResult(
            op=OP, variant=variant, source_hash=f"h{seed}", device_key=device_key, tuning_key=make_key(rng),
            config=config, status="ok" if ok else "compile_error",
            time_ms=rng.uniform(0.01, 9.0) if ok else None,
            error=None if ok else f"error {rng.random():.6f}", registers=rng.randint(32, 255) if ok else None,
            spills=rng.randint(0, 9) if ok else None, shared_bytes=rng.randint(1, 1 << 17) if ok else None,
            triton_version="3.6.0", torch_version="2.13.0"))
    return out


def make_tuned(device_key: str, tuning_key: str, rng: random.Random, variant: str = "sparse_mla_headblock",
               source_hash: str = "abc123") -> TunedConfig:
    config = LaunchConfig(blocks={"BLOCK_H": rng.choice([16, 32, 64]), "BLOCK_N": rng.choice([32, 64, 128])},
                          num_warps=rng.choice([4, 8]), num_stages=rng.randint(1, 4))
    return TunedConfig(op=OP, device_key=device_key, tuning_key=tuning_key, variant=variant,
                       source_hash=source_hash, config=config, time_ms=rng.uniform(0.01, 5.0),
                       triton_version="3.6.0", torch_version="2.13.0")


def same_entry(a: TunedConfig | None, b: TunedConfig) -> bool:
    return a is not None and a.model_dump(exclude={"updated_at"}) == b.model_dump(exclude={"updated_at"})


def trial_id(trial: TrialResult) -> tuple[str, str, str, str, str | None]:
    return (trial.variant, trial.source_hash, trial.tuning_key, trial.config.to_json(), trial.role)


# ----------------------------------------------------------------------------- round trips
def test_record_trials_and_done_configs(store, presets):
    h200 = presets["h200"]
    run = store.start_run(OP, h200, {"shapes": "tiny", "max_minutes": 5})
    trials = make_trials(13, h200.key, seed=random.randrange(1 << 30))
    assert all(store.record(run, t) for t in trials)
    assert not store.record(run, trials[4])  # a trial is recorded once per run
    assert store.trials(run_id=run) == trials
    assert store.done_configs(run) == {trial_id(t) for t in trials}
    ok = [t for t in trials if t.status == "ok"]
    assert store.trials(op=OP, device_key=h200.key, status="ok") == ok
    assert store.trials(device_key="amd-mi355x") == []
    # The same trial in another run is another row.
    other = store.start_run(OP, h200, {})
    assert store.record(other, trials[4])
    assert len(store.trials(op=OP)) == len(trials) + 1


def test_record_rejects_bad_input(store, presets):
    h200, mi355x = presets["h200"], presets["mi355x"]
    run = store.start_run(OP, h200, {})
    trial = make_trials(1, h200.key, seed=3)[0]
    with pytest.raises(ValueError, match="run_id"):
        store.record(run + 100, trial)
    with pytest.raises(ValueError, match="device_key"):
        store.record(run, trial.model_copy(update={"device_key": mi355x.key}))
    with pytest.raises(TypeError, match="trial"):
        store.record(run, trial.model_dump())
    with pytest.raises(ValueError, match="tuning_key"):
        store.record(run, trial.model_copy(update={"tuning_key": "[1, 2]"}))
    with pytest.raises(ValueError, match="status"):
        store.trials(status="fine")
    with pytest.raises(TypeError, match="args"):
        store.start_run(OP, h200, {"bad": object()})
    assert store.trials() == []


def test_runs_resume_order(store, presets):
    h200, h100 = presets["h200"], presets["h100"]
    first = store.start_run(OP, h200, {})
    store.finish_run(first)
    assert store.resumable_run(OP, h200) is None
    stopped = store.start_run(OP, h200, {})
    store.finish_run(stopped, "stopped")
    killed = store.start_run(OP, h200, {})  # never finished: a SIGKILL'd sweep
    assert store.resumable_run(OP, h200) == killed
    assert store.resumable_run("decode", h200) is None
    assert store.resumable_run(OP, h100) is None
    store.finish_run(killed)
    assert store.resumable_run(OP, h200) == stopped
    with pytest.raises(ValueError, match="status"):
        store.finish_run(stopped, "done")
    with pytest.raises(ValueError, match="run_id"):
        store.finish_run(killed + 10)


def test_upsert_best_and_stale(store, presets):
    h200 = presets["h200"]
    rng = random.Random()
    keys = sorted({make_key(rng) for _ in range(6)})
    entries = [make_tuned(h200.key, k, rng, variant=f"v{i % 2}", source_hash=f"hash{i % 2}")
               for i, k in enumerate(keys)]
    for tuned in entries:
        store.upsert_tuned(tuned, h200)
    for tuned in entries:
        # Key spelling does not matter: the store canonicalizes it.
        spaced = json.dumps(dict(reversed(json.loads(tuned.tuning_key).items())), indent=1)
        assert same_entry(store.best(OP, h200, spaced), tuned)
    assert store.best("decode", h200, keys[0]) is None
    assert store.best(OP, h200, make_key(rng, h_q=7)) is None

    replaced = make_tuned(h200.key, keys[0], rng, variant="v9", source_hash="new")
    store.upsert_tuned(replaced, h200)
    assert same_entry(store.best(OP, h200, keys[0]), replaced)
    assert len(store.tuned(op=OP, device_key=h200.key)) == len(keys)

    stale = store.stale({("nvidia", "v0"): "hash0", ("nvidia", "v1"): "changed", ("amd", "v0"): "other"})
    assert sorted(t.tuning_key for t in stale) == sorted(t.tuning_key for t in entries if t.variant == "v1")
    assert store.stale({("nvidia", "v0"): "hash0", ("nvidia", "v1"): "hash1", ("nvidia", "v9"): "new"}) == []

    with pytest.raises(ValueError, match="device_key"):
        store.upsert_tuned(replaced, presets["h100"])
    with pytest.raises(ValueError, match="tuning_key"):
        store.best(OP, h200, "not json")


def _faster(new: TunedConfig, current: TunedConfig) -> bool:
    """The sweep's rule for `upsert_tuned(replace=...)`: the new entry replaces a slower stored one."""
    return new.time_ms < current.time_ms


def test_upsert_with_replace_keeps_the_faster_entry(store, presets):
    """`replace` judges the stored winner of the key on this device row: it is not asked when there is
    none, its no keeps the stored entry (False: nothing written), its yes or no `replace` at all writes
    (True); a row too damaged to read is replaced without asking; an exception in it writes nothing."""
    h200 = presets["h200"]
    rng = random.Random()
    key = make_key(rng)
    slow = make_tuned(h200.key, key, rng, variant="slow").model_copy(update={"time_ms": 2.0})
    fast = make_tuned(h200.key, key, rng, variant="fast").model_copy(update={"time_ms": 1.0})
    asked: list[TunedConfig] = []

    def judge(new: TunedConfig):
        return lambda current: asked.append(current) or _faster(new, current)

    assert store.upsert_tuned(slow, h200, replace=judge(slow)) is True
    assert asked == []  # nothing stored yet: nothing to judge
    assert store.upsert_tuned(fast, h200, replace=judge(fast)) is True
    assert len(asked) == 1 and same_entry(asked[0], slow) and asked[0].updated_at is not None
    assert store.upsert_tuned(slow, h200, replace=judge(slow)) is False
    assert same_entry(store.best(OP, h200, key), fast) and len(store.tuned()) == 1
    assert store.upsert_tuned(slow, h200) is True  # without `replace`, as before: always written
    assert same_entry(store.best(OP, h200, key), slow)
    assert store.upsert_tuned(fast, h200, replace=lambda current: True) is True
    assert same_entry(store.best(OP, h200, key), fast)

    # Another card with the same device key is another device row: its own (missing) winner is judged.
    nvl = dataclasses.replace(h200, name="NVIDIA H200 NVL", pci_device_id=0x233B)
    asked.clear()
    assert store.upsert_tuned(slow, nvl, replace=judge(slow)) is True and asked == []
    assert len(store.tuned()) == 2 and same_entry(store.best(OP, nvl, key), slow)

    def broken(current: TunedConfig) -> bool:
        raise RuntimeError("the judge fell over")

    with pytest.raises(RuntimeError, match="the judge fell over"):
        store.upsert_tuned(slow, h200, replace=broken)
    assert same_entry(store.best(OP, h200, key), fast)
    with pytest.raises(TypeError, match="replace"):
        store.upsert_tuned(slow, h200, replace=0.5)

    h200_row = store.ensure_device(h200)
    with store.engine.begin() as conn:
        conn.execute(update(TunedRow).where(TunedRow.device_id == h200_row).values(config_json="[[["))
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert [t.variant for t in store.tuned()] == ["slow"]  # the NVL's; the H200's row is unreadable
    asked.clear()
    assert store.upsert_tuned(slow, h200, replace=judge(slow)) is True and asked == []
    assert sorted(d.name for d, _ in store.tuned_rows()) == sorted([h200.name, nvl.name])
    assert same_entry(store.best(OP, h200, key), slow)


def test_import_tuned_is_all_or_nothing(store, presets, monkeypatch):
    h200 = presets["h200"]
    rng = random.Random()
    rows = [make_tuned(h200.key, make_key(rng, s_q=1 << (4 + i)), rng) for i in range(5)]
    with pytest.raises(ValueError, match=r"rows\[3\]\.device_key"):
        store.import_tuned(rows[:3] + [rows[3].model_copy(update={"device_key": "amd-mi355x"})], h200)
    assert store.tuned() == []

    # A failure inside the transaction (after some rows were written) rolls every row back.
    real_upsert = TuningStore._upsert
    written = []

    def failing_upsert(self, session, device_id, tuned):
        if len(written) == 3:
            raise RuntimeError("disk on fire")
        written.append(tuned)
        real_upsert(self, session, device_id, tuned)

    monkeypatch.setattr(TuningStore, "_upsert", failing_upsert)
    with pytest.raises(RuntimeError, match="disk on fire"):
        store.import_tuned(rows, h200)
    assert store.tuned() == []
    monkeypatch.setattr(TuningStore, "_upsert", real_upsert)
    assert store.import_tuned(rows, h200) == 5
    assert all(same_entry(a, b) for a, b in zip(store.tuned(), sorted(rows, key=lambda t: t.tuning_key),
                                                 strict=True))


def test_roles_vendor_and_backward_time_round_trip(store, presets):
    """A tuned entry keeps its call config by role, its vendor and both times; one call config tried
    for two roles (the forward's winner is the backward stage's first candidate) is two trials."""
    h200 = presets["h200"]
    launch = LaunchConfig(blocks={"BLOCK_H": 32, "BLOCK_TOPK": 64}, num_warps=8, num_stages=2)
    call = CallConfig({"fwd": launch, "bwd_dq": launch.model_copy(update={"num_warps": 4})})
    tuned = TunedConfig(op=OP, device_key=h200.key, tuning_key=make_key(random.Random(1)), variant="v",
                        vendor="nvidia", source_hash="h", config=call, time_ms=1.5, backward_ms=7.25,
                        triton_version="3.6.0", torch_version="2.13.0")
    store.upsert_tuned(tuned, h200)
    assert same_entry(store.best(OP, h200, tuned.tuning_key), tuned)
    run = store.start_run(OP, h200, {})
    fields = dict(op=OP, variant="v", vendor="nvidia", source_hash="h", device_key=h200.key,
                  tuning_key=tuned.tuning_key, config=call, status="ok", triton_version="3.6.0",
                  torch_version="2.13.0")
    forward = TrialResult(role="fwd", time_ms=1.5, **fields)
    backward = TrialResult(role="bwd_dq", time_ms=7.25, **fields)
    assert store.record(run, forward) and store.record(run, backward) and not store.record(run, backward)
    assert store.trials(run_id=run) == [forward, backward]
    assert store.done_configs(run) == {trial_id(forward), trial_id(backward)}


def test_a_database_from_before_roles_is_migrated_with_every_row(tmp_path, presets):
    """A file written by the first schema (one config per entry, no roles, no vendor) opens, its trials
    and tuned entries are kept (their single config read as the forward's), and new trials that
    differ only by role can be recorded."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE devices (id INTEGER PRIMARY KEY, key VARCHAR(64), vendor VARCHAR(16), arch VARCHAR(32),
            name VARCHAR(128), pci_device_id INTEGER, num_sms INTEGER,
            CONSTRAINT uq_devices_identity UNIQUE (key, arch, name, pci_device_id, num_sms));
        CREATE INDEX ix_devices_key ON devices (key);
        CREATE TABLE sweep_runs (id INTEGER PRIMARY KEY, op VARCHAR(64), device_id INTEGER REFERENCES devices(id),
            started_at DATETIME, finished_at DATETIME, status VARCHAR(16), args_json TEXT,
            triton_version VARCHAR(64), torch_version VARCHAR(64));
        CREATE INDEX ix_sweep_runs_op ON sweep_runs (op);
        CREATE TABLE trials (id INTEGER PRIMARY KEY, run_id INTEGER REFERENCES sweep_runs(id), op VARCHAR(64),
            variant VARCHAR(128), source_hash VARCHAR(128), device_id INTEGER REFERENCES devices(id),
            tuning_key TEXT, config_json TEXT, status VARCHAR(32), time_ms FLOAT, error TEXT, registers INTEGER,
            spills INTEGER, shared_bytes INTEGER, triton_version VARCHAR(64), torch_version VARCHAR(64),
            created_at DATETIME,
            CONSTRAINT uq_trials_run UNIQUE (run_id, variant, source_hash, tuning_key, config_json));
        CREATE INDEX ix_trials_op ON trials (op);
        CREATE INDEX ix_trials_device_id ON trials (device_id);
        CREATE TABLE tuned_configs (id INTEGER PRIMARY KEY, op VARCHAR(64), device_id INTEGER REFERENCES devices(id),
            tuning_key TEXT, variant VARCHAR(128), source_hash VARCHAR(128), config_json TEXT, time_ms FLOAT,
            triton_version VARCHAR(64), torch_version VARCHAR(64), updated_at DATETIME,
            CONSTRAINT uq_tuned_configs_key UNIQUE (op, device_id, tuning_key));
        CREATE INDEX ix_tuned_configs_device_id ON tuned_configs (device_id);
        INSERT INTO devices VALUES (1, 'nvidia-h200', 'nvidia', 'sm_90', 'NVIDIA H200', 9013, 132);
        INSERT INTO sweep_runs VALUES (1, 'sparse_mla', 1, '2026-11-01 10:00:00', NULL, 'stopped', '{}',
            '3.6.0', '2.11');
        INSERT INTO trials VALUES (1, 1, 'sparse_mla', 'v', 'h', 1, '{"s_q":16}',
            '{"blocks":{"BLOCK_H":64},"num_stages":3,"num_warps":8}', 'ok', 1.25, NULL, 255, 0, 1000, '3.6.0', '2.11',
            '2026-11-01 10:00:01');
        INSERT INTO trials VALUES (2, 1, 'sparse_mla', 'v', 'h', 1, '{"s_q":16}',
            '{"blocks":{"BLOCK_H":32},"num_stages":3,"num_warps":8}', 'wrong_result', NULL, 'bad', NULL, NULL, NULL,
            '3.6.0', '2.11', '2026-11-01 10:00:02');
        INSERT INTO tuned_configs VALUES (1, 'sparse_mla', 1, '{"s_q":16}', 'v', 'h',
            '{"blocks":{"BLOCK_H":64},"num_stages":3,"num_warps":8}', 1.25, '3.6.0', '2.11', '2026-11-01 10:00:03');
    """)
    old.close()
    store = TuningStore(f"sqlite:///{path}")
    trials = store.trials()
    assert [(t.status, t.role, t.config.roles(), t.config["fwd"].blocks) for t in trials] == [
        ("ok", None, ("fwd",), {"BLOCK_H": 64}), ("wrong_result", None, ("fwd",), {"BLOCK_H": 32})]
    (tuned,) = store.tuned()
    assert tuned.config["fwd"] == LaunchConfig(blocks={"BLOCK_H": 64}, num_warps=8, num_stages=3)
    assert (tuned.vendor, tuned.backward_ms, tuned.time_ms) == (None, None, 1.25)
    # Without a recorded vendor, the variant's vendor is the device key's (NVIDIA for the interpreter).
    assert tuned.variant_vendor == "nvidia"
    assert tuned.model_copy(update={"device_key": "amd-mi355x"}).variant_vendor == "amd"
    assert tuned.model_copy(update={"device_key": "cpu"}).variant_vendor == "nvidia"
    assert tuned.model_copy(update={"device_key": "cpu", "vendor": "amd"}).variant_vendor == "amd"
    assert store.resumable_run(OP, presets["h200"]) == 1
    again = trials[0].model_copy(update={"role": "bwd_dq"})
    assert store.record(1, again) and len(store.trials(run_id=1)) == 3
    store.close()
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    names = {row[0] for row in check.execute("SELECT name FROM sqlite_master")}
    assert "trials_before_roles" not in names and {"ix_trials_op", "ix_trials_device_id"} <= names
    check.close()
    TuningStore(f"sqlite:///{path}").close()  # a migrated file opens as it is


def _first_schema() -> MetaData:
    """The tables as the first kreg's models made them on any database (no roles, no vendors, no
    backward times), built by SQLAlchemy as that kreg's first write did."""
    schema = MetaData()

    def versions() -> tuple[Column, Column]:
        return Column("triton_version", String(64)), Column("torch_version", String(64))

    Table("devices", schema, Column("id", Integer, primary_key=True), Column("key", String(64), index=True),
          Column("vendor", String(16)), Column("arch", String(32)), Column("name", String(128)),
          Column("pci_device_id", Integer, nullable=True), Column("num_sms", Integer),
          UniqueConstraint("key", "arch", "name", "pci_device_id", "num_sms", name="uq_devices_identity"))
    Table("sweep_runs", schema, Column("id", Integer, primary_key=True), Column("op", String(64), index=True),
          Column("device_id", ForeignKey("devices.id")), Column("started_at", DateTime(timezone=True)),
          Column("finished_at", DateTime(timezone=True), nullable=True), Column("status", String(16)),
          Column("args_json", Text), *versions())
    Table("trials", schema, Column("id", Integer, primary_key=True), Column("run_id", ForeignKey("sweep_runs.id")),
          Column("op", String(64), index=True), Column("variant", String(128)), Column("source_hash", String(128)),
          Column("device_id", ForeignKey("devices.id"), index=True), Column("tuning_key", Text),
          Column("config_json", Text), Column("status", String(32)), Column("time_ms", Float, nullable=True),
          Column("error", Text, nullable=True), Column("registers", Integer, nullable=True),
          Column("spills", Integer, nullable=True), Column("shared_bytes", Integer, nullable=True),
          *versions(), Column("created_at", DateTime(timezone=True)),
          UniqueConstraint("run_id", "variant", "source_hash", "tuning_key", "config_json", name="uq_trials_run"))
    Table("tuned_configs", schema, Column("id", Integer, primary_key=True), Column("op", String(64)),
          Column("device_id", ForeignKey("devices.id"), index=True), Column("tuning_key", Text),
          Column("variant", String(128)), Column("source_hash", String(128)), Column("config_json", Text),
          Column("time_ms", Float, nullable=True), *versions(),
          Column("updated_at", DateTime(timezone=True)),
          UniqueConstraint("op", "device_id", "tuning_key", name="uq_tuned_configs_key"))
    return schema


def test_a_first_schema_database_is_migrated_on_every_backend(store_url, presets):
    """The first schema as SQLAlchemy made it on this database (on PostgreSQL: id sequences, a primary
    key index named after the table) migrates with every row, new rows get fresh ids (the sequences
    still count right), and the migrated database opens as it is."""
    h200 = presets["h200"]
    old = create_engine(store_url)
    schema = _first_schema()
    schema.create_all(old)
    at = datetime(2026, 11, 1, 10, tzinfo=timezone.utc)
    key, configs = '{"s_q":16}', [LaunchConfig(blocks={"BLOCK_H": b}, num_warps=8, num_stages=3) for b in (64, 32)]
    versions = {"triton_version": "3.6.0", "torch_version": "2.11"}
    devices, runs, trials, tuned = (schema.tables[n] for n in ("devices", "sweep_runs", "trials", "tuned_configs"))
    with old.begin() as conn:  # ids come from the database, as the old kreg's did
        device_id = conn.execute(insert(devices).values(
            key=h200.key, vendor=h200.vendor, arch=h200.arch, name=h200.name, pci_device_id=h200.pci_device_id,
            num_sms=h200.num_sms).returning(devices.c.id)).scalar_one()
        run_id = conn.execute(insert(runs).values(op=OP, device_id=device_id, started_at=at, status="stopped",
                                                  args_json="{}", **versions).returning(runs.c.id)).scalar_one()
        for config, status in zip(configs, ("ok", "wrong_result"), strict=True):
            conn.execute(insert(trials).values(
                run_id=run_id, op=OP, variant="v", source_hash="h", device_id=device_id, tuning_key=key,
                config_json=config.to_json(), status=status, time_ms=1.25 if status == "ok" else None,
                created_at=at, **versions))
        conn.execute(insert(tuned).values(op=OP, device_id=device_id, tuning_key=key, variant="v", source_hash="h",
                                          config_json=configs[0].to_json(), time_ms=1.25, updated_at=at, **versions))
    old.dispose()

    store = TuningStore(store_url)
    kept = store.trials()
    assert [(t.status, t.role, t.config["fwd"]) for t in kept] == [("ok", None, configs[0]),
                                                                   ("wrong_result", None, configs[1])]
    (entry,) = store.tuned()
    assert (entry.config["fwd"], entry.vendor, entry.backward_ms, entry.time_ms) == (configs[0], None, None, 1.25)
    assert store.resumable_run(OP, h200) == run_id
    assert store.record(run_id, kept[0].model_copy(update={"role": "bwd_dq"}))
    assert len(store.trials(run_id=run_id)) == 3
    second = store.start_run(OP, h200, {})  # the runs' id sequence counts on from the old rows
    assert second > run_id and store.record(second, kept[0])
    assert store.ensure_device(h200) == device_id and len(store.devices()) == 1
    found = inspect(store.engine)
    assert "trials_before_roles" not in found.get_table_names()
    assert {"ix_trials_op", "ix_trials_device_id"} <= {i["name"] for i in found.get_indexes("trials")}
    assert {"role", "vendor"} <= {c["name"] for c in found.get_columns("trials")}
    store.close()
    again = TuningStore(store_url)  # a migrated database opens as it is
    assert len(again.trials()) == 4
    again.close()


# ----------------------------------------------------------------------------- device matching
def test_device_matching_order(store, presets):
    h200, h100, mi300x, mi355x = presets["h200"], presets["h100"], presets["mi300x"], presets["mi355x"]
    nvl = dataclasses.replace(h200, name="NVIDIA H200 NVL", pci_device_id=0x233B, num_sms=132)
    other_sku = dataclasses.replace(h200, name="NVIDIA H200 (other)", pci_device_id=0x9999, num_sms=120)
    mi325x = dataclasses.replace(mi300x, key="amd-mi325x", name="AMD Instinct MI325X", pci_device_id=0x74A5)
    rng = random.Random()
    key = make_key(rng)

    sxm_entry = make_tuned(h200.key, key, rng, variant="sxm")
    store.upsert_tuned(sxm_entry, h200)
    nvl_entry = make_tuned(nvl.key, key, rng, variant="nvl")
    store.upsert_tuned(nvl_entry, nvl)
    assert len(store.devices()) == 2

    assert same_entry(store.best(OP, h200, key), sxm_entry)  # same key, PCI id and SM count
    assert same_entry(store.best(OP, nvl, key), nvl_entry)
    # Same key only: both cards match equally, the latest update wins.
    assert same_entry(store.best(OP, other_sku, key), nvl_entry)
    # Same vendor and arch (sm_90): another model's entry, and it says where it was tuned.
    fallback = store.best(OP, h100, key)
    assert fallback is not None and fallback.device_key == h200.key
    h100_entry = make_tuned(h100.key, key, rng, variant="h100")
    store.upsert_tuned(h100_entry, h100)
    assert same_entry(store.best(OP, h100, key), h100_entry)
    assert same_entry(store.best(OP, h200, key), sxm_entry)

    amd_key = make_key(rng)
    mi300_entry = make_tuned(mi300x.key, amd_key, rng, variant="amd")
    store.upsert_tuned(mi300_entry, mi300x)
    assert same_entry(store.best(OP, mi325x, amd_key), mi300_entry)  # both gfx942
    assert store.best(OP, mi355x, amd_key) is None  # gfx950
    assert store.best(OP, mi355x, key) is None  # another vendor
    assert store.ensure_device(h200) == store.ensure_device(h200)
    assert {d.key for d in store.devices()} == {h200.key, h100.key, mi300x.key}


# ----------------------------------------------------------------------------- nearest key
def test_length_dims_come_from_the_op():
    """Only the dims an op declares as lengths are bridged; every other dim must match exactly, and a
    length dim must hold numbers (not bools or strings) on both sides."""
    assert key_distance({"s_q": 1024, "h_q": 8}, {"s_q": 4096, "h_q": 8}, LENGTHS) == pytest.approx(2.0)
    assert key_distance({"n": 64, "t": 128}, {"n": 256, "t": 128}, ("n",)) == pytest.approx(2.0)
    assert key_distance({"s_q": 1024, "h_q": 8}, {"s_q": 4096, "h_q": 8}, ()) is None  # not a length here
    assert key_distance({"s_q": 1024, "h_q": 8}, {"s_q": 1024, "h_q": 16}, LENGTHS) is None
    assert key_distance({"h_q": 8, "topk": 2048}, {"h_q": 8, "topk": 1024}, LENGTHS) is None
    assert key_distance({"s_q": True}, {"s_q": 16}, LENGTHS) is None
    assert key_distance({"s_q": "4096"}, {"s_q": 4096}, LENGTHS) is None
    assert key_distance({"s_q": 1024}, {"s_q": 1024, "window": 128}, LENGTHS) is None
    assert key_distance({"causal": True, "t": 64}, {"causal": 1, "t": 64}, ("t",)) is None


def test_nearest_matches_brute_force(store, presets):
    h200, h100 = presets["h200"], presets["h100"]
    rng = random.Random()
    fixed = {"h_q": 128, "d_qk": 576, "topk": 2048, "dtype": "bfloat16"}
    pairs = set()
    while len(pairs) < 12:
        pairs.add((1 << rng.randint(4, 17), 1 << rng.randint(10, 20)))
    entries = [make_tuned(h200.key, canonical_json({**fixed, "s_q": s_q, "s_kv": s_kv}), rng)
               for s_q, s_kv in pairs]
    for tuned in entries:
        store.upsert_tuned(tuned, h200)
    # Closer in length but other heads: never a candidate.
    decoy = {**fixed, "h_q": 64}
    for s_q, s_kv in pairs:
        store.upsert_tuned(make_tuned(h200.key, canonical_json({**decoy, "s_q": s_q + 1, "s_kv": s_kv}), rng),
                           h200)

    def reference_distance(dims: dict, tuned: TunedConfig) -> float:
        have = json.loads(tuned.tuning_key)
        return sum(abs(math.log2(dims[f] / have[f])) for f in ("s_q", "s_kv"))

    checked = 0
    while checked < 20:
        dims = {**fixed, "s_q": rng.randint(16, 1 << 17), "s_kv": rng.randint(1024, 1 << 20)}
        ranked = sorted(entries, key=lambda t: reference_distance(dims, t))
        if reference_distance(dims, ranked[1]) - reference_distance(dims, ranked[0]) < 1e-9:
            continue  # a tie: either answer is right
        assert same_entry(store.nearest(OP, h200, dims, LENGTHS), ranked[0])
        # Another sm_90 card falls back to the h200 entries, with the same choice.
        assert same_entry(store.nearest(OP, h100, dims, LENGTHS), ranked[0])
        checked += 1
    assert store.nearest(OP, h200, {**fixed, "h_q": 32, "s_q": 128, "s_kv": 1024}, LENGTHS) is None
    assert store.nearest(OP, h200, {**fixed, "s_q": 128}, LENGTHS) is None  # s_kv missing: another key shape
    assert store.nearest(OP, presets["mi355x"], {**fixed, "s_q": 128, "s_kv": 1024}, LENGTHS) is None
    with pytest.raises(TypeError, match="dims"):
        store.nearest(OP, h200, [("s_q", 128)], LENGTHS)


def test_nearest_prefers_the_most_specific_device(store, presets):
    h200, h100 = presets["h200"], presets["h100"]
    rng = random.Random()
    own = make_tuned(h100.key, make_key(rng, s_q=256), rng, variant="own")
    store.upsert_tuned(own, h100)
    # An exact length match on another sm_90 model loses to a far one tuned on this model.
    store.upsert_tuned(make_tuned(h200.key, make_key(rng, s_q=65536), rng, variant="other"), h200)
    assert same_entry(store.nearest(OP, h100, json.loads(make_key(rng, s_q=65536)), LENGTHS), own)


# ----------------------------------------------------------------------------- files and processes
def test_default_url(monkeypatch, tmp_path):
    monkeypatch.setenv("KREG_TUNING_DB", "sqlite:////somewhere/else.db")
    assert default_url() == "sqlite:////somewhere/else.db"
    monkeypatch.delenv("KREG_TUNING_DB")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_url() == f"sqlite:///{tmp_path.resolve() / 'cache' / 'kreg' / 'tuning.db'}"
    assert not (tmp_path / "cache").exists()  # the store makes the folder on its first write


@pytest.mark.parametrize("content", ["random", "text"])
def test_corrupted_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "tuning.db"
    if content == "random":
        path.write_bytes(random.randbytes(8192))
    else:
        path.write_text("these are my notes, not a database\n" * 40)
    with pytest.raises(TuningDatabaseError) as info:
        TuningStore(f"sqlite:///{path}")
    message = str(info.value)
    assert str(path) in message and "not a database" in message
    assert "move the file" in message and "KREG_TUNING_DB" in message


def test_damaged_pages_fail_at_first_query(tmp_path, presets):
    path = tmp_path / "tuning.db"
    url = f"sqlite:///{path}"
    db = TuningStore(url)
    run = db.start_run(OP, presets["h200"], {})
    for trial in make_trials(300, presets["h200"].key, seed=random.randrange(1 << 30)):
        db.record(run, trial)
    db.close()
    page = 4096
    data = bytearray(path.read_bytes())
    assert len(data) > 4 * page
    data[page:] = b"\xff" * (len(data) - page)  # keep the header and schema page, wreck the rest
    path.write_bytes(bytes(data))
    with pytest.raises(TuningDatabaseError, match="malformed|not a database") as info:
        TuningStore(url).trials()
    assert str(path) in str(info.value)


def _concurrent_writer(url: str, run_id: int, worker: int, n: int, device: dict, shared: TrialResult,
                       start, results) -> None:
    store = TuningStore(url)
    device_info = DeviceDescriptor(**device)
    start.wait(timeout=60)
    won = store.record(run_id, shared)  # every worker at once (it has no role: a NULL in its unique key)
    assert store.ensure_device(device_info) > 0
    trials = make_trials(n, device_info.key, seed=1000 + worker, variant=f"worker{worker}")
    new = sum(store.record(run_id, t) for t in trials)
    results.put((worker, new, won))


def test_four_processes_lose_no_trial(store_url, presets):
    url = store_url
    h200 = presets["h200"]
    store = TuningStore(url)
    run = store.start_run(OP, h200, {})
    shared = make_trials(1, h200.key, seed=7, variant="everyone")[0]
    start, results = SPAWN.Barrier(4), SPAWN.Queue()
    workers = [SPAWN.Process(target=_concurrent_writer,
                             args=(url, run, w, 50, descriptor(h200), shared, start, results))
               for w in range(4)]
    for proc in workers:
        proc.start()
    got = [results.get(timeout=120) for _ in workers]
    for proc in workers:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert sorted(new for _, new, _ in got) == [50] * 4
    assert sum(won for _, _, won in got) == 1  # exactly one writer recorded the shared trial
    recorded = store.trials(run_id=run)
    assert len(recorded) == 201
    expected = {trial_id(t) for w in range(4) for t in make_trials(50, h200.key, 1000 + w, f"worker{w}")}
    assert {trial_id(t) for t in recorded} == expected | {trial_id(shared)}
    assert len(store.devices()) == 1
    store.close()


def _slow_writer(url: str, run_id: int, trials: list[TrialResult]) -> None:
    store = TuningStore(url)
    for trial in trials:
        store.record(run_id, trial)
        time.sleep(0.01)


def test_killed_writer_loses_nothing_and_resumes(store_url, presets):
    url = store_url
    h200 = presets["h200"]
    store = TuningStore(url)
    run = store.start_run(OP, h200, {"shapes": "full"})
    trials = make_trials(400, h200.key, seed=random.randrange(1 << 30))
    writer = SPAWN.Process(target=_slow_writer, args=(url, run, trials))
    writer.start()
    deadline = time.monotonic() + 120
    while len(store.trials(run_id=run)) < 20:
        assert time.monotonic() < deadline and writer.is_alive(), "the writer recorded nothing"
        time.sleep(0.02)
    writer.kill()  # SIGKILL, mid-sweep
    writer.join()
    store.close()

    if store.engine.dialect.name == "sqlite":
        check = sqlite3.connect(store.engine.url.database)
        assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        check.close()
    reopened = TuningStore(url)
    kept = reopened.trials(run_id=run)
    assert 20 <= len(kept) < len(trials)
    assert kept == trials[: len(kept)]  # every committed trial, in order, intact

    assert reopened.resumable_run(OP, h200) == run
    done = reopened.done_configs(run)
    resumed = [reopened.record(run, t) for t in trials if trial_id(t) not in done]
    assert all(resumed) and len(resumed) == len(trials) - len(kept)
    assert not any(reopened.record(run, t) for t in trials[:5])  # already there: nothing changes
    assert reopened.trials(run_id=run) == trials  # each exactly once
    reopened.finish_run(run)
    assert reopened.resumable_run(OP, h200) is None
    reopened.close()


def _racing_upserter(url: str, device: dict, keys: list[str], times: list[float], start, results) -> None:
    store = TuningStore(url)
    device_info = DeviceDescriptor(**device)
    wrote = {}
    for key in keys:
        start.wait(timeout=60)  # every worker starts each key at once
        for time_ms in times:
            tuned = make_tuned(device_info.key, key, random.Random(time_ms), variant=f"at{time_ms}").model_copy(
                update={"time_ms": time_ms})
            wrote[key, time_ms] = store.upsert_tuned(tuned, device_info, replace=functools.partial(_faster, tuned))
    results.put(wrote)


def test_racing_upserts_keep_the_fastest_entry(store_url, presets):
    """Four processes upsert a key with their own times at once, each replacing only a slower stored
    entry: none fails, and the one entry left is the fastest of all. For the first key the device is new
    too (it has no PCI id: a NULL in its unique key) and one device row is made; the second key's first
    inserts meet on the unique key, and the losers judge the winner's entry when they try again."""
    device = dataclasses.replace(presets["h200"], name="NVIDIA H200 (no PCI id)", pci_device_id=None)
    store = TuningStore(store_url)
    store.ensure_device(presets["h100"])  # the tables are there, the racing device is not
    rng = random.Random(5)
    keys = [make_key(rng, s_q=16), make_key(rng, s_q=32)]
    times = [round(0.05 * (i + 1), 2) for i in range(4 * 5)]
    random.shuffle(times)
    start, results = SPAWN.Barrier(4), SPAWN.Queue()
    workers = [SPAWN.Process(target=_racing_upserter,
                             args=(store_url, descriptor(device), keys, times[w::4], start, results))
               for w in range(4)]
    for proc in workers:
        proc.start()
    wrote = {}
    for _ in workers:
        wrote.update(results.get(timeout=120))
    for proc in workers:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    fastest = min(times)
    assert sorted(wrote) == sorted((key, t) for key in keys for t in times)
    assert all(wrote[key, fastest] for key in keys)
    stored = store.tuned()
    assert sorted((t.tuning_key, t.time_ms, t.variant) for t in stored) == [
        (key, fastest, f"at{fastest}") for key in sorted(keys)]
    assert [d.name for d in store.devices()] == [presets["h100"].name, device.name]
    store.close()


def test_store_file_location_is_created_by_the_first_write(tmp_path, presets):
    nested = tmp_path / "a" / "b" / "tuning.db"
    store = TuningStore(f"sqlite:///{nested}")
    assert store.tuned() == [] and store.devices() == [] and not (tmp_path / "a").exists()
    store.ensure_device(presets["h200"])
    store.close()
    assert nested.is_file() and Path(nested).stat().st_size > 0


# ----------------------------------------------------------------------------- PostgreSQL's server
def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("case", ["wrong password", "no such database", "nothing listening"])
def test_postgres_refusals_never_show_the_password(postgres_url, case):
    """The test server refuses a wrong password and a database it does not have, and nothing listens on
    another port: each is one TuningDatabaseError naming the server with its password as ***, with the
    server's reason, and neither the wrong nor the real password is in its message, its traceback or a
    warning."""
    server = make_url(postgres_url)
    wrong = "Wr0ng-S3cret-Passw0rd"
    url, reason = {
        "wrong password": (server.set(password=wrong), "password authentication failed"),
        "no such database": (server.set(database=f"kreg_missing_{uuid.uuid4().hex}"), "does not exist"),
        "nothing listening": (server.set(port=_unused_port()), "refused"),
    }[case]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TuningDatabaseError) as info:
            TuningStore(url.render_as_string(hide_password=False))
    message = str(info.value)
    assert reason in message and f"{server.username}:***@127.0.0.1" in message and "\n" not in message
    shown = "".join(traceback.format_exception(info.value)) + repr(info.value)
    shown += "".join(str(w.message) for w in caught)
    assert server.password not in shown and wrong not in shown


def test_which_failures_are_tried_again():
    """A write is tried again after SQLite's locked or busy database and after PostgreSQL's serialization
    failure, deadlock or lock not granted (by SQLSTATE); never after other failures of either."""
    from sqlalchemy.exc import OperationalError

    from kreg.tuning_db.store import _is_locked

    class ServerError(Exception):  # what psycopg raises: the SQLSTATE is an attribute
        def __init__(self, sqlstate: str, text: str) -> None:
            super().__init__(text)
            self.sqlstate = sqlstate

    def wrapped(orig: BaseException) -> OperationalError:
        return OperationalError("SELECT 1", {}, orig)

    for again in (sqlite3.OperationalError("database is locked"), sqlite3.OperationalError("database is busy"),
                  ServerError("40001", "could not serialize access"), ServerError("40P01", "deadlock detected"),
                  ServerError("55P03", "could not obtain lock on row")):
        assert _is_locked(wrapped(again)) and _is_locked(again), again
    for final in (sqlite3.OperationalError("file is not a database"), ServerError("28P01", "password failed"),
                  ServerError("42P01", "table tuned_configs is locked"), ServerError("3D000", "no database busy")):
        assert not _is_locked(wrapped(final)) and not _is_locked(final), final


@pytest.mark.parametrize("bad", ["long op name", "NUL in the op name"])
def test_values_postgresql_refuses_are_clear_errors(store, presets, bad):
    """SQLite stores any text; PostgreSQL refuses one longer than its column or holding a NUL: one
    TuningDatabaseError that says a value was refused (not that the database is unusable), with nothing
    written, and the database works on."""
    h200 = presets["h200"]
    rng = random.Random(3)
    good = make_tuned(h200.key, make_key(rng), rng)
    store.upsert_tuned(good, h200)
    odd = good.model_copy(update={"op": "x" * 65 if bad == "long op name" else "x\x00y"})
    if store.engine.dialect.name == "sqlite":
        store.upsert_tuned(odd, h200)
        assert len(store.tuned()) == 2
        return
    with pytest.raises(TuningDatabaseError, match="refused a value: .*(too long|NUL)") as info:
        store.upsert_tuned(odd, h200)
    assert "cannot be used" not in str(info.value) and make_url(store.url).password not in str(info.value)
    (only,) = store.tuned()
    assert same_entry(only, good)
    store.upsert_tuned(good, h200)  # the database works on
    assert len(store.tuned()) == 1
