"""The tuning database (`TuningStore`) and the shipped tuned tables (`ShippedTables`).

The store is any SQLAlchemy database; the default is one SQLite file in the user's cache dir, shared by
every process on the machine (sweeps on several GPUs write to it at once). SQLite is opened in WAL mode
with a busy timeout, and every write runs in its own `BEGIN IMMEDIATE` transaction: writers queue for
the lock instead of failing halfway, and each trial is committed on its own, so a killed sweep loses
nothing it already recorded.

Tables are JSON files, one per (device, op): what `tuning.export` writes, `tuning.load` imports and
`tuning_db/tables/` ships. `TableFile` is their pydantic model.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from sqlalchemy import and_, create_engine, event, inspect, or_, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from tuning_db.models import RUN_STATUSES, Base, DeviceRow, SweepRun, TrialRow, TunedRow, utcnow
from tuning_db.records import TRIAL_STATUSES, LaunchConfig, TrialResult, TunedConfig, canonical_json

T = TypeVar("T")

BUSY_TIMEOUT_S = 30.0
# After SQLite's own busy wait, a write that still finds the database locked is tried again this often.
_LOCK_RETRIES = 5
# Sequence-length dims that `nearest` may bridge; every other dim must match exactly.
LENGTH_FIELDS = ("n", "t")
LENGTH_PREFIX = "s_"
SHIPPED_TABLES = Path(__file__).parent / "tables"


class TuningDatabaseError(RuntimeError):
    """The tuning database cannot be opened or read (a damaged file, a file that is not a database)."""


class TableError(ValueError):
    """A tuned table file is not valid; the message names the file, the row and the field."""


class DeviceIdentity(Protocol):
    """What the store keeps of a device: `registry.device.DeviceInfo`, `StoredDevice` and
    `DeviceDescriptor` all have these attributes."""

    key: str
    vendor: str
    arch: str
    name: str
    pci_device_id: int | None
    num_sms: int


@dataclass(frozen=True)
class StoredDevice:
    """A device row of the database."""

    id: int
    key: str
    vendor: str
    arch: str
    name: str
    pci_device_id: int | None
    num_sms: int


def default_url() -> str:
    """`KREG_TUNING_DB` (any SQLAlchemy URL), else a SQLite file `kreg/tuning.db` in the user cache dir
    (`$XDG_CACHE_HOME` or `~/.cache`), whose folder is created."""
    url = os.environ.get("KREG_TUNING_DB")
    if url:
        return url
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kreg"
    cache.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{cache.resolve() / 'tuning.db'}"


def installed_version(*distributions: str) -> str:
    """Version of the first installed distribution of `distributions`, else 'unknown'."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def installed_triton_version() -> str:
    """Installed Triton version (ROCm machines have it as pytorch-triton-rocm)."""
    return installed_version("triton", "pytorch-triton-rocm", "pytorch-triton")


def installed_torch_version() -> str:
    """Installed PyTorch version."""
    return installed_version("torch")


# ----------------------------------------------------------------------------- matching
def match_level(want: DeviceIdentity, have: DeviceIdentity) -> int | None:
    """How closely a stored device matches the asked one: 0 same key, PCI id and SM count; 1 same key;
    2 same vendor and arch (another card of that arch); None no match."""
    if have.key == want.key:
        same_card = have.pci_device_id == want.pci_device_id and have.num_sms == want.num_sms
        return 0 if same_card else 1
    if have.vendor == want.vendor and have.arch == want.arch:
        return 2
    return None


def is_length_field(name: str, value: object) -> bool:
    """Sequence-length dims ('s_q', 's_kv', 'n', 't'): numeric, named 's_*', 'n' or 't'."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return numeric and (name.startswith(LENGTH_PREFIX) or name in LENGTH_FIELDS)


def key_distance(want: Mapping[str, object], have: Mapping[str, object]) -> float | None:
    """Sum of |log2(a/b)| over the length dims; None when any other dim differs."""
    if want.keys() != have.keys():
        return None
    total = 0.0
    for name, a in want.items():
        b = have[name]
        if is_length_field(name, a) and is_length_field(name, b):
            # Lengths are bucketed to >= 16; clamping at 1 only guards log2 against 0.
            total += abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))  # type: ignore[arg-type]
        elif a != b or isinstance(a, bool) != isinstance(b, bool):
            return None
    return total


def _recency(tuned: TunedConfig) -> float:
    return tuned.updated_at.timestamp() if tuned.updated_at is not None else 0.0


def pick_best(
    want: DeviceIdentity, candidates: Iterable[tuple[DeviceIdentity, TunedConfig]]
) -> TunedConfig | None:
    """The candidate of the most specific device match; among equals, the most recently updated."""
    ranked = []
    for have, tuned in candidates:
        level = match_level(want, have)
        if level is not None:
            ranked.append(((level, -_recency(tuned)), tuned))
    return min(ranked, key=lambda item: item[0])[1] if ranked else None


def pick_nearest(
    want: DeviceIdentity, dims: Mapping[str, object], candidates: Iterable[tuple[DeviceIdentity, TunedConfig]]
) -> TunedConfig | None:
    """At the most specific device level that has a comparable key, the key nearest to `dims` in
    sequence length (see `key_distance`)."""
    scored = []
    for have, tuned in candidates:
        level = match_level(want, have)
        if level is None:
            continue
        distance = key_distance(dims, json.loads(tuned.tuning_key))
        if distance is not None:
            scored.append(((level, distance, -_recency(tuned), tuned.tuning_key), tuned))
    return min(scored, key=lambda item: item[0])[1] if scored else None


def _canonical_key(tuning_key: str | Mapping[str, object], name: str = "tuning_key") -> str:
    if isinstance(tuning_key, Mapping):
        return canonical_json(dict(tuning_key))
    if not isinstance(tuning_key, str):
        raise TypeError(f"{name}: expected a JSON object string or a dict, got {type(tuning_key).__name__}")
    try:
        value = json.loads(tuning_key)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: expected a JSON object, got {tuning_key!r} ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object, got {tuning_key!r}")
    return canonical_json(value)


def _check_device(device: object, name: str = "device") -> None:
    for attr in ("key", "vendor", "arch", "name", "num_sms"):
        if not hasattr(device, attr):
            raise TypeError(f"{name}: expected a DeviceInfo (key, vendor, arch, name, pci_device_id, "
                            f"num_sms), got {type(device).__name__}")


def _aware(moment: datetime | None) -> datetime | None:
    # SQLite drops the time zone; every stored timestamp is UTC.
    if moment is not None and moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    return moment


def _stored_device(row: DeviceRow) -> StoredDevice:
    return StoredDevice(row.id, row.key, row.vendor, row.arch, row.name, row.pci_device_id, row.num_sms)


def _tuned_record(row: TunedRow, device: DeviceRow) -> TunedConfig:
    return TunedConfig(
        op=row.op, device_key=device.key, tuning_key=row.tuning_key, variant=row.variant,
        source_hash=row.source_hash, config=LaunchConfig.from_json(row.config_json), time_ms=row.time_ms,
        triton_version=row.triton_version, torch_version=row.torch_version, updated_at=_aware(row.updated_at),
    )


def _trial_record(row: TrialRow, device: DeviceRow) -> TrialResult:
    return TrialResult(
        op=row.op, variant=row.variant, source_hash=row.source_hash, device_key=device.key,
        tuning_key=row.tuning_key, config=LaunchConfig.from_json(row.config_json), status=row.status,
        time_ms=row.time_ms, error=row.error, registers=row.registers, spills=row.spills,
        shared_bytes=row.shared_bytes, triton_version=row.triton_version, torch_version=row.torch_version,
    )


def _is_locked(err: BaseException) -> bool:
    # Raised by SQLAlchemy (wrapping sqlite3) or by sqlite3 itself from the connect listener's PRAGMAs.
    text = str(getattr(err, "orig", None) or err).lower()
    return "locked" in text or "busy" in text


# ----------------------------------------------------------------------------- the store
class TuningStore:
    """Trials, sweep runs and tuned winners in one SQLAlchemy database (default: `default_url()`)."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or default_url()
        try:
            self.engine: Engine = create_engine(self.url)
        except (sa_exc.ArgumentError, ImportError) as err:
            raise TuningDatabaseError(f"tuning database URL {self.url!r} cannot be used: {err}. "
                                      "Set KREG_TUNING_DB (or --db) to a SQLAlchemy URL.") from err
        self._sqlite_path: Path | None = None
        if self.engine.dialect.name == "sqlite":
            self._setup_sqlite()
        self._ensure_schema()

    def __repr__(self) -> str:
        return f"TuningStore({self.engine.url.render_as_string(hide_password=True)!r})"

    def close(self) -> None:
        """Close pooled connections (the store opens new ones if used again)."""
        self.engine.dispose()

    # -- plumbing
    def _setup_sqlite(self) -> None:
        database = self.engine.url.database
        if database and database != ":memory:" and not database.startswith("file:"):
            self._sqlite_path = Path(database).expanduser().resolve()
            try:
                self._sqlite_path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise self._error(err) from err

        @event.listens_for(self.engine, "connect")
        def _on_connect(dbapi_connection, _record) -> None:
            # Transactions are begun by `_on_begin` below, not by the sqlite3 module's own guesswork.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
                cursor.execute("PRAGMA foreign_keys = ON")
                # The first query that reads the file: a damaged file fails here.
                mode = cursor.execute("PRAGMA journal_mode").fetchone()[0]
                if mode.lower() not in ("wal", "memory"):
                    cursor.execute("PRAGMA journal_mode = WAL")
                # In WAL mode NORMAL keeps every commit across a process crash (not a power cut).
                cursor.execute("PRAGMA synchronous = NORMAL")
            finally:
                cursor.close()

        @event.listens_for(self.engine, "begin")
        def _on_begin(connection) -> None:
            # A write takes the write lock up front: a deferred transaction that reads first and then
            # writes can fail at once with SQLITE_BUSY in WAL mode instead of waiting for the lock.
            write = connection.get_execution_options().get("kreg_write", False)
            connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    def _error(self, err: BaseException) -> TuningDatabaseError:
        where = self.engine.url.render_as_string(hide_password=True)
        cause = getattr(err, "orig", None) or err
        if self._sqlite_path is not None:
            fix = (f"move the file {self._sqlite_path} away (a new one is made) or set KREG_TUNING_DB to "
                   "another database URL")
        else:
            fix = "check the database or set KREG_TUNING_DB to another database URL"
        return TuningDatabaseError(f"tuning database {where} cannot be used: {cause}. To fix it, {fix}.")

    def _run(self, fn: Callable[[Session], T], *, write: bool = False) -> T:
        """Run `fn(session)` in one transaction (committed when `write`). It is retried when the
        database stays locked, and writes once on a unique-key race with another process (`fn` reads first,
        so the retry sees the other process's row); database failures become TuningDatabaseError."""
        integrity_retries = 1 if write else 0
        attempt = 0
        while True:
            try:
                with self.engine.connect() as conn:
                    if write:
                        conn.execution_options(kreg_write=True)
                    with Session(bind=conn) as session:
                        result = fn(session)
                        if write:
                            session.commit()
                        return result
            except sa_exc.IntegrityError:
                if integrity_retries == 0:
                    raise
                integrity_retries -= 1
            except (sa_exc.DatabaseError, sqlite3.DatabaseError) as err:
                if not _is_locked(err) or attempt >= _LOCK_RETRIES:
                    raise self._error(err) from err
                time.sleep(0.05 * 2**attempt)
                attempt += 1

    def _ensure_schema(self) -> None:
        def missing(session: Session) -> set[str]:
            return set(Base.metadata.tables) - set(inspect(session.connection()).get_table_names())

        if self._run(missing):
            self._run(lambda session: Base.metadata.create_all(session.connection()), write=True)

    @staticmethod
    def _find_device(session: Session, device: DeviceIdentity) -> DeviceRow | None:
        return session.scalars(
            select(DeviceRow).where(
                DeviceRow.key == device.key, DeviceRow.arch == device.arch, DeviceRow.name == device.name,
                DeviceRow.pci_device_id == device.pci_device_id, DeviceRow.num_sms == device.num_sms,
            ).order_by(DeviceRow.id)
        ).first()

    def _get_or_create_device(self, session: Session, device: DeviceIdentity) -> DeviceRow:
        row = self._find_device(session, device)
        if row is None:
            row = DeviceRow(key=device.key, vendor=device.vendor, arch=device.arch, name=device.name,
                            pci_device_id=device.pci_device_id, num_sms=device.num_sms)
            session.add(row)
            session.flush()
        return row

    @staticmethod
    def _matching_devices(device: DeviceIdentity):
        # Every device `match_level` could accept; the ranking itself happens in Python.
        return or_(DeviceRow.key == device.key,
                   and_(DeviceRow.vendor == device.vendor, DeviceRow.arch == device.arch))

    # -- devices and runs
    def ensure_device(self, info: DeviceIdentity) -> int:
        """The id of `info`'s device row, created if missing (safe with concurrent writers)."""
        _check_device(info, "info")
        return self._run(lambda s: self._get_or_create_device(s, info).id, write=True)

    def devices(self) -> list[StoredDevice]:
        """Every device the database knows."""
        stmt = select(DeviceRow).order_by(DeviceRow.id)
        return self._run(lambda s: [_stored_device(r) for r in s.scalars(stmt)])

    def start_run(self, op: str, device: DeviceIdentity, args: dict, *, triton_version: str | None = None,
                  torch_version: str | None = None) -> int:
        """Open a sweep run of `op` on `device` (status 'running'); `args` is the sweep's arguments, kept
        as JSON. The versions default to the installed ones."""
        _check_device(device)
        if not isinstance(op, str) or not op:
            raise ValueError(f"op: expected a non-empty op name, got {op!r}")
        try:
            args_json = canonical_json(args)
        except (TypeError, ValueError) as err:
            raise TypeError(f"args: expected a JSON-serializable dict, got {args!r} ({err})") from None

        def fn(session: Session) -> int:
            run = SweepRun(op=op, device_id=self._get_or_create_device(session, device).id, status="running",
                           args_json=args_json, triton_version=triton_version or installed_triton_version(),
                           torch_version=torch_version or installed_torch_version())
            session.add(run)
            session.flush()
            return run.id

        return self._run(fn, write=True)

    def finish_run(self, run_id: int, status: str = "finished") -> None:
        """Close a sweep run: 'finished' (done) or 'stopped' (ended early, e.g. by --max-minutes)."""
        if status not in RUN_STATUSES:
            raise ValueError(f"status: expected one of {RUN_STATUSES}, got {status!r}")

        def fn(session: Session) -> None:
            done = session.execute(update(SweepRun).where(SweepRun.id == run_id)
                                   .values(status=status, finished_at=utcnow()))
            if done.rowcount == 0:
                raise ValueError(f"run_id: no sweep run {run_id}")

        self._run(fn, write=True)

    def resumable_run(self, op: str, device: DeviceIdentity) -> int | None:
        """The latest run of `op` on exactly this device that did not finish ('running' after a kill,
        or 'stopped' after a time slice), else None."""
        _check_device(device)

        def fn(session: Session) -> int | None:
            row = self._find_device(session, device)
            if row is None:
                return None
            return session.scalar(
                select(SweepRun.id).where(SweepRun.op == op, SweepRun.device_id == row.id,
                                          SweepRun.status.in_(("running", "stopped")))
                .order_by(SweepRun.id.desc()).limit(1)
            )

        return self._run(fn)

    # -- trials
    def record(self, run_id: int, trial: TrialResult) -> bool:
        """Store one trial of a run in its own committed transaction. False (nothing changed) when the
        run already has this (variant, source hash, tuning key, config)."""
        if not isinstance(trial, TrialResult):
            raise TypeError(f"trial: expected a TrialResult, got {type(trial).__name__}")
        tuning_key = _canonical_key(trial.tuning_key, "trial.tuning_key")
        config_json = trial.config.to_json()

        def fn(session: Session) -> bool:
            run = session.get(SweepRun, run_id)
            if run is None:
                raise ValueError(f"run_id: no sweep run {run_id}")
            device = session.get(DeviceRow, run.device_id)
            if device.key != trial.device_key:
                raise ValueError(f"trial.device_key: run {run_id} is on device {device.key!r}, "
                                 f"got {trial.device_key!r}")
            exists = session.scalar(select(TrialRow.id).where(
                TrialRow.run_id == run_id, TrialRow.variant == trial.variant,
                TrialRow.source_hash == trial.source_hash, TrialRow.tuning_key == tuning_key,
                TrialRow.config_json == config_json))
            if exists is not None:
                return False
            session.add(TrialRow(
                run_id=run_id, op=trial.op, variant=trial.variant, source_hash=trial.source_hash,
                device_id=device.id, tuning_key=tuning_key, config_json=config_json, status=trial.status,
                time_ms=trial.time_ms, error=trial.error, registers=trial.registers, spills=trial.spills,
                shared_bytes=trial.shared_bytes, triton_version=trial.triton_version,
                torch_version=trial.torch_version))
            return True

        return self._run(fn, write=True)

    def done_configs(self, run_id: int) -> set[tuple[str, str, str, str]]:
        """(variant, source_hash, tuning_key, config_json) of every trial a run recorded: what a resumed
        sweep skips. Keys and configs are canonical JSON (`LaunchConfig.to_json`)."""
        stmt = select(TrialRow.variant, TrialRow.source_hash, TrialRow.tuning_key,
                      TrialRow.config_json).where(TrialRow.run_id == run_id)
        return self._run(lambda s: {tuple(r) for r in s.execute(stmt)})

    def trials(self, *, op: str | None = None, device_key: str | None = None, run_id: int | None = None,
               status: str | None = None) -> list[TrialResult]:
        """Recorded trials, oldest first, filtered by whichever arguments are given."""
        if status is not None and status not in TRIAL_STATUSES:
            raise ValueError(f"status: expected one of {TRIAL_STATUSES}, got {status!r}")
        stmt = select(TrialRow, DeviceRow).join(DeviceRow, TrialRow.device_id == DeviceRow.id)
        for column, value in ((TrialRow.op, op), (DeviceRow.key, device_key), (TrialRow.run_id, run_id),
                              (TrialRow.status, status)):
            if value is not None:
                stmt = stmt.where(column == value)
        stmt = stmt.order_by(TrialRow.id)
        return self._run(lambda s: [_trial_record(t, d) for t, d in s.execute(stmt)])

    # -- tuned winners
    @staticmethod
    def _check_tuned(tuned: TunedConfig, device: DeviceIdentity, name: str = "tuned") -> None:
        if not isinstance(tuned, TunedConfig):
            raise TypeError(f"{name}: expected a TunedConfig, got {type(tuned).__name__}")
        if tuned.device_key != device.key:
            raise ValueError(f"{name}.device_key: expected the device's key {device.key!r}, "
                             f"got {tuned.device_key!r}")

    def _upsert(self, session: Session, device_id: int, tuned: TunedConfig) -> None:
        values = dict(variant=tuned.variant, source_hash=tuned.source_hash,
                      config_json=tuned.config.to_json(), time_ms=tuned.time_ms,
                      triton_version=tuned.triton_version, torch_version=tuned.torch_version,
                      updated_at=tuned.updated_at or utcnow())
        row = session.scalars(select(TunedRow).where(
            TunedRow.op == tuned.op, TunedRow.device_id == device_id, TunedRow.tuning_key == tuned.tuning_key)
        ).first()
        if row is None:
            session.add(TunedRow(op=tuned.op, device_id=device_id, tuning_key=tuned.tuning_key, **values))
        else:
            for name, value in values.items():
                setattr(row, name, value)
        session.flush()

    def upsert_tuned(self, tuned: TunedConfig, device: DeviceIdentity) -> None:
        """Insert or replace the winner for (tuned.op, device, tuned.tuning_key)."""
        _check_device(device)
        self._check_tuned(tuned, device)
        self._run(lambda s: self._upsert(s, self._get_or_create_device(s, device).id, tuned), write=True)

    def import_tuned(self, rows: list[TunedConfig], device: DeviceIdentity) -> int:
        """Upsert every row for `device` in one transaction (all or nothing); returns how many."""
        _check_device(device)
        rows = list(rows)
        for i, tuned in enumerate(rows):
            self._check_tuned(tuned, device, f"rows[{i}]")

        def fn(session: Session) -> int:
            device_id = self._get_or_create_device(session, device).id
            for tuned in rows:
                self._upsert(session, device_id, tuned)
            return len(rows)

        return self._run(fn, write=True)

    def _candidates(self, op: str, device: DeviceIdentity, tuning_key: str | None = None):
        stmt = (select(TunedRow, DeviceRow).join(DeviceRow, TunedRow.device_id == DeviceRow.id)
                .where(TunedRow.op == op, self._matching_devices(device)).order_by(TunedRow.id))
        if tuning_key is not None:
            stmt = stmt.where(TunedRow.tuning_key == tuning_key)
        return self._run(lambda s: [(_stored_device(d), _tuned_record(t, d)) for t, d in s.execute(stmt)])

    def best(self, op: str, device: DeviceIdentity, tuning_key: str) -> TunedConfig | None:
        """The tuned winner for exactly this key, from the most specific device match: same key, PCI id
        and SM count; then same key; then same vendor and arch. Its device_key says where it was tuned."""
        _check_device(device)
        return pick_best(device, self._candidates(op, device, _canonical_key(tuning_key)))

    def nearest(self, op: str, device: DeviceIdentity, dims: Mapping[str, object]) -> TunedConfig | None:
        """The tuned key of `op` on this device (same matching order as `best`) whose dims equal `dims`
        except the sequence lengths, nearest in sum of |log2| length ratios; None if there is none."""
        _check_device(device)
        if not isinstance(dims, Mapping):
            raise TypeError(f"dims: expected a dict of tuning-key dims, got {type(dims).__name__}")
        return pick_nearest(device, dims, self._candidates(op, device))

    def tuned_rows(self, *, op: str | None = None, device_key: str | None = None
                   ) -> list[tuple[StoredDevice, TunedConfig]]:
        """Tuned winners with the device row each belongs to, ordered by op, device and key."""
        stmt = select(TunedRow, DeviceRow).join(DeviceRow, TunedRow.device_id == DeviceRow.id)
        if op is not None:
            stmt = stmt.where(TunedRow.op == op)
        if device_key is not None:
            stmt = stmt.where(DeviceRow.key == device_key)
        stmt = stmt.order_by(TunedRow.op, DeviceRow.key, DeviceRow.id, TunedRow.tuning_key)
        return self._run(lambda s: [(_stored_device(d), _tuned_record(t, d)) for t, d in s.execute(stmt)])

    def tuned(self, *, op: str | None = None, device_key: str | None = None) -> list[TunedConfig]:
        """Tuned winners, filtered by op and device key."""
        return [tuned for _, tuned in self.tuned_rows(op=op, device_key=device_key)]

    def stale(self, variant_hashes: Mapping[tuple[str, str], str]) -> list[TunedConfig]:
        """Tuned entries whose source hash differs from their variant's current hash.

        `variant_hashes` maps (vendor, variant name) to the hash; the vendor is the entry's device's
        (interpreter entries, device "cpu", are judged against the NVIDIA variant, which CPU sweeps time).
        Variants missing from the mapping are not judged."""
        out = []
        for device, tuned in self.tuned_rows():
            vendor = "nvidia" if device.vendor == "cpu" else device.vendor
            current = variant_hashes.get((vendor, tuned.variant))
            if current is not None and current != tuned.source_hash:
                out.append(tuned)
        return out


# ----------------------------------------------------------------------------- table files
KeyValue = int | float | bool | str | None


class DeviceDescriptor(BaseModel):
    """The device a table was tuned on, as the database's devices table holds it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1)
    vendor: str = Field(min_length=1)
    arch: str = Field(min_length=1)
    name: str
    pci_device_id: int | None = None
    num_sms: int = Field(ge=1)

    @classmethod
    def of(cls, device: DeviceIdentity) -> DeviceDescriptor:
        """The descriptor of a DeviceInfo or stored device."""
        return cls(key=device.key, vendor=device.vendor, arch=device.arch, name=device.name,
                   pci_device_id=device.pci_device_id, num_sms=device.num_sms)


class TableEntry(BaseModel):
    """One tuned winner in a table file; the tuning key is a JSON object, not its text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tuning_key: dict[str, KeyValue]
    variant: str = Field(min_length=1)
    source_hash: str = Field(min_length=1)
    config: LaunchConfig
    time_ms: float | None = Field(default=None, ge=0)
    triton_version: str
    torch_version: str


class TableFile(BaseModel):
    """A tuned table: every winner of one op on one device (`<device_key>__<op>.json`). The top-level
    versions are the entries' versions when they all agree, else null."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1]
    op: str = Field(min_length=1)
    device: DeviceDescriptor
    triton_version: str | None = None
    torch_version: str | None = None
    configs: list[TableEntry]

    @model_validator(mode="after")
    def _keys_unique(self) -> TableFile:
        seen: dict[str, int] = {}
        for i, entry in enumerate(self.configs):
            key = canonical_json(entry.tuning_key)
            if key in seen:
                raise ValueError(f"row {i} (configs[{i}]), field 'tuning_key': {key} repeats row {seen[key]}")
            seen[key] = i
        return self

    @classmethod
    def build(cls, op: str, device: DeviceIdentity, tuned: Iterable[TunedConfig]) -> TableFile:
        """The table of `tuned` (entries of `op`), sorted by tuning key."""
        entries = sorted(tuned, key=lambda t: t.tuning_key)
        tritons = {t.triton_version for t in entries}
        torches = {t.torch_version for t in entries}
        return cls(
            format=1, op=op, device=DeviceDescriptor.of(device),
            triton_version=tritons.pop() if len(tritons) == 1 else None,
            torch_version=torches.pop() if len(torches) == 1 else None,
            configs=[TableEntry(tuning_key=json.loads(t.tuning_key), variant=t.variant,
                                source_hash=t.source_hash, config=t.config, time_ms=t.time_ms,
                                triton_version=t.triton_version, torch_version=t.torch_version)
                     for t in entries],
        )

    def tuned(self) -> list[TunedConfig]:
        """The entries as TunedConfig records of this table's op and device."""
        return [TunedConfig(op=self.op, device_key=self.device.key, tuning_key=canonical_json(e.tuning_key),
                            variant=e.variant, source_hash=e.source_hash, config=e.config, time_ms=e.time_ms,
                            triton_version=e.triton_version, torch_version=e.torch_version)
                for e in self.configs]

    def to_json(self) -> str:
        """The file's text: configs as objects, AMD knobs left out where unset, a trailing newline."""
        data = self.model_dump(mode="json")
        data["configs"] = [{**row, "config": entry.config.model_dump(exclude_none=True)}
                           for row, entry in zip(data["configs"], self.configs, strict=True)]
        return json.dumps(data, indent=2) + "\n"


def _describe_errors(err: ValidationError) -> str:
    lines = []
    for problem in err.errors():
        loc = list(problem["loc"])
        where = ""
        if len(loc) >= 2 and loc[0] == "configs" and isinstance(loc[1], int):
            where = f"row {loc[1]} (configs[{loc[1]}]), "
            loc = loc[2:]
        field = ".".join(str(part) for part in loc)
        message = problem["msg"].removeprefix("Value error, ")
        # Our validators already say what they got; pydantic's own messages do not.
        shown = repr(problem.get("input"))
        got = f" (got {shown[:60]})" if field and problem["type"] not in ("missing", "value_error") else ""
        lines.append(f"{where}field '{field}': {message}{got}" if field else where + message)
    return "; ".join(lines)


def read_table(path: str | Path) -> TableFile:
    """Read and validate a whole table file; any problem raises TableError naming the file, the row and
    the field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TableError(f"{path}: cannot read tuned table: {err}") from None
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        raise TableError(f"{path}: not a JSON tuned table: {err}") from None
    try:
        # Strict: a table is written by a program, so "4" where 4 belongs is a broken file, not a guess.
        return TableFile.model_validate_json(text, strict=True)
    except ValidationError as err:
        raise TableError(f"{path}: invalid tuned table: {_describe_errors(err)}") from None


class ShippedTables:
    """The tuned tables shipped in a folder (default `tuning_db/tables/`), read on the first lookup.

    Lookups match devices like `TuningStore.best`, through the device descriptor each table carries.
    """

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else SHIPPED_TABLES
        self._by_op: dict[str, list[tuple[DeviceDescriptor, TunedConfig]]] | None = None
        self._lock = threading.Lock()

    def _entries(self, op: str) -> list[tuple[DeviceDescriptor, TunedConfig]]:
        if self._by_op is None:
            with self._lock:
                if self._by_op is None:
                    by_op: dict[str, list[tuple[DeviceDescriptor, TunedConfig]]] = {}
                    paths = sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []
                    for path in paths:
                        table = read_table(path)
                        by_op.setdefault(table.op, []).extend((table.device, t) for t in table.tuned())
                    self._by_op = by_op
        return self._by_op.get(op, [])

    def best(self, op: str, device: DeviceIdentity, tuning_key: str) -> TunedConfig | None:
        """The shipped winner for exactly this key (device matching as `TuningStore.best`)."""
        _check_device(device)
        key = _canonical_key(tuning_key)
        return pick_best(device, ((d, t) for d, t in self._entries(op) if t.tuning_key == key))

    def nearest(self, op: str, device: DeviceIdentity, dims: Mapping[str, object]) -> TunedConfig | None:
        """The shipped key nearest to `dims` in sequence length (as `TuningStore.nearest`)."""
        _check_device(device)
        if not isinstance(dims, Mapping):
            raise TypeError(f"dims: expected a dict of tuning-key dims, got {type(dims).__name__}")
        return pick_nearest(device, dims, self._entries(op))

    def tuned(self, op: str | None = None) -> list[TunedConfig]:
        """Every shipped entry (of `op` when given)."""
        if op is not None:
            return [t for _, t in self._entries(op)]
        self._entries("")
        return [t for entries in (self._by_op or {}).values() for _, t in entries]
