"""The tuning database (`TuningStore`): devices, sweep runs, trials and tuned winners.

The store is any SQLAlchemy database; SQLite and PostgreSQL are supported and tested. The default is one
SQLite file in the user's cache dir, shared by every process on the machine (sweeps on several GPUs
write to it at once; `tuning_db.sqlite` sets its connections up for that). A PostgreSQL database, shared
by sweeps on several machines, is `KREG_TUNING_DB=postgresql+psycopg://user:password@host:5432/db` with
`pip install 'kreg[postgres]'` (`tuning_db.postgres`: its locks and the failures tried again). Every
write runs in its own transaction, retried while the database stays locked (SQLite) or after a
serialization failure or deadlock (PostgreSQL), and each trial is committed on its own, so a killed sweep
loses nothing it already recorded. Writes that read before they insert hold the row they read
(SELECT ... FOR UPDATE; SQLite's write transaction holds the whole file), so concurrent writers never
store a row twice, and `upsert_tuned(..., replace=...)` keeps the faster of two sweeps' winners. A
database written before kernel roles existed is migrated in place the first time it is opened (its
rows kept; `tuning_db.rows`).

The tests run against both: `scripts/test_postgres.sh .venv/bin/python -m pytest tests/test_tuning_db.py`
starts a throwaway PostgreSQL server for them (the `store_url` fixture in tests/conftest.py).

Reading never creates anything: a SQLite file (or its folder) that does not exist yet, or a database
without the store's tables, reads as empty and is made by the first write. A read-only file can be
read. A damaged row is skipped with a warning (once per row), never raised from every read. No message
holds the URL's password (`tuning_db.errors`).

Which entry answers a lookup is `tuning_db.matching`'s job; table files are `tuning_db.table_files`'.
"""

from __future__ import annotations

import json
import sqlite3
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from sqlalchemy import and_, create_engine, or_, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session

from kreg.core.files import NotARegularFile, require_regular_if_present
from kreg.core.records import TRIAL_STATUSES, TrialResult, TunedConfig, canonical_json
from kreg.tuning_db.environment import default_url, installed_torch_version, installed_triton_version
from kreg.tuning_db.errors import TuningDatabaseError, one_line, redact, safe_url
from kreg.tuning_db.matching import Accept, DeviceIdentity, canonical_key, check_device, pick_best, pick_nearest
from kreg.tuning_db.models import RUN_STATUSES, Base, DeviceRow, SweepRun, TrialRow, TunedRow, utcnow
from kreg.tuning_db.postgres import is_retryable
from kreg.tuning_db.postgres import lock as postgres_lock
from kreg.tuning_db.rows import (
    StoredDevice,
    migrate,
    schema_changes,
    stored_device,
    trial_record,
    tuned_pair,
    tuned_record,
)
from kreg.tuning_db.sqlite import EMPTY_LOCK, configure_sqlite, empty_engine, sqlite_file

T = TypeVar("T")

# After SQLite's own busy wait, a write that still finds the database locked is tried again this often;
# so is a PostgreSQL transaction that failed on another one (a serialization failure, a deadlock).
_LOCK_RETRIES = 5


def _is_locked(err: BaseException) -> bool:
    """Whether the transaction may succeed if tried again: SQLite's database stayed locked (raised by
    SQLAlchemy wrapping sqlite3, or by sqlite3 itself from `configure_sqlite`'s PRAGMAs), or PostgreSQL
    gave up on it for another's sake (`tuning_db.postgres.is_retryable`)."""
    if is_retryable(err):
        return True
    cause = getattr(err, "orig", None) or err
    text = str(cause).lower()
    return isinstance(cause, sqlite3.Error) and ("locked" in text or "busy" in text)


class TuningStore:
    """Trials, sweep runs and tuned winners in one SQLAlchemy database (default: `default_url()`).

    Opening checks an existing database (a damaged file fails here, an older schema is migrated) and
    creates nothing; the first write creates a missing SQLite file, its folder and the tables."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or default_url()
        self._warned_rows: set[tuple[str, int]] = set()
        try:
            parsed = make_url(self.url)
        except (sa_exc.ArgumentError, ValueError, TypeError) as err:
            raise self._url_error("does not parse (in a password, write @ as %40, : as %3A, / as %2F)", err) from None
        try:
            self.engine: Engine = create_engine(parsed)
        except sa_exc.NoSuchModuleError as err:
            raise self._url_error(f"names an unknown database dialect {parsed.drivername!r}", err) from None
        except ImportError as err:
            raise self._url_error("needs a database driver that is not installed (PostgreSQL: "
                                  "pip install 'kreg[postgres]')", err) from None
        except sa_exc.ArgumentError as err:
            raise self._url_error("cannot be used", err) from None
        self._sqlite_path: Path | None = None
        # Whether the database holds the current schema; until then reads see no rows.
        self._ready = False
        if self.engine.dialect.name == "sqlite":
            self._sqlite_path = sqlite_file(self.engine.url)
            if self._sqlite_path is not None:
                try:  # SQLite would block on a FIFO, or read a device
                    require_regular_if_present(self._sqlite_path)
                except NotARegularFile as err:
                    raise self._error(err) from None
            configure_sqlite(self.engine)
        if self.exists():
            self._open()

    def __repr__(self) -> str:
        return f"TuningStore({safe_url(self.url)!r})"

    def close(self) -> None:
        """Close pooled connections (the store opens new ones if used again)."""
        self.engine.dispose()

    def exists(self) -> bool:
        """Whether the database is there: False only for a SQLite file not created yet (by a first write).
        A server's database (PostgreSQL) is never created by the store: a missing one is an error at the
        first use, while one without the store's tables reads as empty until the first write."""
        return self._sqlite_path is None or self._sqlite_path.exists()

    # -- plumbing
    def _url_error(self, what: str, err: BaseException) -> TuningDatabaseError:
        return TuningDatabaseError(
            f"tuning database URL {safe_url(self.url)!r} {what}: {redact(one_line(err), self.url)}. Set "
            "KREG_TUNING_DB (or --db) to a SQLAlchemy URL such as sqlite:////path/to/tuning.db or "
            "postgresql+psycopg://user:password@host:5432/kreg.")

    def _error(self, err: BaseException) -> TuningDatabaseError:
        where = safe_url(self.url)
        cause = redact(one_line(getattr(err, "orig", None) or err), self.url)
        if "readonly" in cause.lower().replace("-", "").replace(" ", ""):
            fix = ("write to another database: set KREG_TUNING_DB (or --db) to a writable one; reading this "
                   "one still works")
        elif isinstance(err, sa_exc.DataError):
            # A value the database does not hold (PostgreSQL keeps to the columns' lengths and refuses NUL
            # characters, where SQLite stores anything); the database itself is fine.
            return TuningDatabaseError(f"tuning database {where} refused a value: {cause}. To fix it, keep "
                                       "names within the columns' lengths (tuning_db.models) and without NUL "
                                       "characters.")
        elif self._sqlite_path is not None:
            fix = (f"move the file {self._sqlite_path} away (a new one is made) or set KREG_TUNING_DB to "
                   "another database URL")
        else:
            fix = "check the database or set KREG_TUNING_DB to another database URL"
        return TuningDatabaseError(f"tuning database {where} cannot be used: {cause}. To fix it, {fix}.")

    def _warn_damaged(self, table: str, row_id: int, err: BaseException) -> None:
        if (table, row_id) in self._warned_rows:
            return
        self._warned_rows.add((table, row_id))
        warnings.warn(f"kreg: tuning database {safe_url(self.url)}: {table} row {row_id} is damaged and "
                      f"ignored ({redact(one_line(err), self.url)}); the next sweep or tuning.load of its "
                      "key replaces it", RuntimeWarning, stacklevel=4)

    def _convert(self, table: str, rows, convert: Callable[..., T]) -> list[T]:
        """`convert(*row)` of each row; a row that does not convert (bad JSON, a value its record rejects)
        is skipped with a warning, once per row."""
        out = []
        for row in rows:
            try:
                out.append(convert(*row))
            except (ValueError, TypeError, RecursionError) as err:
                self._warn_damaged(table, row[0].id, err)
        return out

    def _run(self, fn: Callable[[Session], T], *, write: bool = False) -> T:
        """Run `fn(session)` in one transaction (see `_transact`). Before the database exists, or holds
        the store's tables, a read runs against an empty database and a write creates it first."""
        if not self._ready:
            if write:
                self._create()
            elif self.exists():
                self._open()  # another process may have created it since
            if not self._ready:
                with EMPTY_LOCK, empty_engine().connect() as conn, Session(bind=conn) as session:
                    return fn(session)
        return self._transact(fn, write=write)

    def _transact(self, fn: Callable[[Session], T], *, write: bool = False) -> T:
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
            except (sa_exc.DBAPIError, sqlite3.Error) as err:
                if not _is_locked(err) or attempt >= _LOCK_RETRIES:
                    raise self._error(err) from None
                time.sleep(0.05 * 2**attempt)
                attempt += 1

    def _open(self) -> None:
        """Check an existing database's schema: an older kreg's is migrated (every row kept); one
        without any of the store's tables (an empty file) is left alone until the first write."""
        changes = self._transact(lambda session: schema_changes(session.connection()))
        if changes and all(f"table {name}" in changes for name in Base.metadata.tables):
            return
        if changes:
            self._transact(lambda session: migrate(session.connection()), write=True)
        self._ready = True

    def _create(self) -> None:
        """Make the database a write needs: the SQLite file's folder, the file, the tables."""
        if self._sqlite_path is not None:
            try:
                self._sqlite_path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise self._error(err) from None
        if self._transact(lambda session: schema_changes(session.connection())):
            self._transact(lambda session: migrate(session.connection()), write=True)
        if self.engine.dialect.name == "sqlite":
            try:
                # Outside any transaction (SQLite refuses it inside one): the raw connection autocommits.
                with self.engine.connect() as conn:
                    conn.connection.dbapi_connection.execute("PRAGMA journal_mode = WAL")
            except (sa_exc.DBAPIError, sqlite3.Error) as err:
                raise self._error(err) from None
        self._ready = True

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
            # On PostgreSQL, writers that both miss the row take turns here and the second finds the
            # first's (a NULL pci_device_id makes the unique key let both rows in); SQLite's writes
            # already take turns.
            postgres_lock(session.connection(), "devices")
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
        check_device(info, "info")
        return self._run(lambda s: self._get_or_create_device(s, info).id, write=True)

    def devices(self) -> list[StoredDevice]:
        """Every device the database knows."""
        stmt = select(DeviceRow).order_by(DeviceRow.id)
        return self._run(lambda s: [stored_device(r) for r in s.scalars(stmt)])

    def start_run(self, op: str, device: DeviceIdentity, args: dict, *, triton_version: str | None = None,
                  torch_version: str | None = None) -> int:
        """Open a sweep run of `op` on `device` (status 'running'); `args` is the sweep's arguments, kept
        as JSON. The versions default to the installed ones."""
        check_device(device)
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
        check_device(device)

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

    def runs(self, op: str, device_key: str) -> list[tuple[int, str, dict]]:
        """(id, status, arguments) of every sweep run of `op` on devices with this key, oldest first (the
        cards of a fleet share a key); a run whose arguments do not parse reads as having none."""
        stmt = (select(SweepRun.id, SweepRun.status, SweepRun.args_json)
                .join(DeviceRow, SweepRun.device_id == DeviceRow.id)
                .where(SweepRun.op == op, DeviceRow.key == device_key).order_by(SweepRun.id))
        out = []
        for run_id, status, args_json in self._run(lambda s: list(s.execute(stmt))):
            try:
                args = json.loads(args_json)
            except (ValueError, TypeError):
                args = {}
            out.append((run_id, status, args if isinstance(args, dict) else {}))
        return out

    # -- trials
    def record(self, run_id: int, trial: TrialResult) -> bool:
        """Store one trial of a run in its own committed transaction. False (nothing changed) when the
        run already has this (variant, source hash, tuning key, call config, role)."""
        if not isinstance(trial, TrialResult):
            raise TypeError(f"trial: expected a TrialResult, got {type(trial).__name__}")
        tuning_key = canonical_key(trial.tuning_key, "trial.tuning_key")
        config_json = trial.config.to_json()

        def fn(session: Session) -> bool:
            # The run's row is locked (PostgreSQL; SQLite's writes take turns anyway) so that writers of
            # one run take turns: a trial without a role has a NULL in its unique key, which would
            # let two processes record it twice.
            run = session.get(SweepRun, run_id, with_for_update={"key_share": True})
            if run is None:
                raise ValueError(f"run_id: no sweep run {run_id}")
            device = session.get(DeviceRow, run.device_id)
            if device.key != trial.device_key:
                raise ValueError(f"trial.device_key: run {run_id} is on device {device.key!r}, "
                                 f"got {trial.device_key!r}")
            exists = session.scalar(select(TrialRow.id).where(
                TrialRow.run_id == run_id, TrialRow.variant == trial.variant,
                TrialRow.source_hash == trial.source_hash, TrialRow.tuning_key == tuning_key,
                TrialRow.config_json == config_json,
                TrialRow.role.is_(None) if trial.role is None else TrialRow.role == trial.role))
            if exists is not None:
                return False
            session.add(TrialRow(
                run_id=run_id, op=trial.op, variant=trial.variant, vendor=trial.vendor, role=trial.role,
                source_hash=trial.source_hash,
                device_id=device.id, tuning_key=tuning_key, config_json=config_json, status=trial.status,
                time_ms=trial.time_ms, error=trial.error, registers=trial.registers, spills=trial.spills,
                shared_bytes=trial.shared_bytes, triton_version=trial.triton_version,
                torch_version=trial.torch_version))
            return True

        return self._run(fn, write=True)

    def done_configs(self, run_id: int) -> set[tuple[str, str, str, str, str | None]]:
        """(variant, source_hash, tuning_key, config_json, role) of every trial a run recorded: what a
        resumed sweep skips. Keys and configs are canonical JSON (`CallConfig.to_json`)."""
        stmt = select(TrialRow.variant, TrialRow.source_hash, TrialRow.tuning_key,
                      TrialRow.config_json, TrialRow.role).where(TrialRow.run_id == run_id)
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
        return self._run(lambda s: self._convert("trials", s.execute(stmt), trial_record))

    # -- tuned winners
    @staticmethod
    def _check_tuned(tuned: TunedConfig, device: DeviceIdentity, name: str = "tuned") -> None:
        if not isinstance(tuned, TunedConfig):
            raise TypeError(f"{name}: expected a TunedConfig, got {type(tuned).__name__}")
        if tuned.device_key != device.key:
            raise ValueError(f"{name}.device_key: expected the device's key {device.key!r}, "
                             f"got {tuned.device_key!r}")

    def _upsert(self, session: Session, device_id: int, tuned: TunedConfig,
                replace: Callable[[TunedConfig], bool] | None = None) -> bool:
        """Write `tuned` as the winner of its key on the device row `device_id`, unless `replace` is given
        and says no to the stored winner (a row that does not convert is always replaced). The stored row
        is read locked (FOR UPDATE; SQLite's write already holds the database), so a concurrent writer
        of the key waits and then judges what this one wrote. Returns whether it wrote."""
        values = dict(variant=tuned.variant, vendor=tuned.vendor, source_hash=tuned.source_hash,
                      config_json=tuned.config.to_json(), time_ms=tuned.time_ms, backward_ms=tuned.backward_ms,
                      triton_version=tuned.triton_version, torch_version=tuned.torch_version,
                      updated_at=tuned.updated_at or utcnow())
        row = session.scalars(
            select(TunedRow).where(TunedRow.op == tuned.op, TunedRow.device_id == device_id,
                                   TunedRow.tuning_key == tuned.tuning_key)
            .with_for_update().execution_options(populate_existing=True)
        ).first()
        if row is None:
            session.add(TunedRow(op=tuned.op, device_id=device_id, tuning_key=tuned.tuning_key, **values))
        else:
            if replace is not None:
                try:
                    current = tuned_record(row, session.get(DeviceRow, device_id))
                except (ValueError, TypeError, RecursionError):
                    current = None  # damaged: whatever it held, the new entry replaces it
                if current is not None and not replace(current):
                    return False
            for name, value in values.items():
                setattr(row, name, value)
        session.flush()
        return True

    def upsert_tuned(self, tuned: TunedConfig, device: DeviceIdentity, *,
                     replace: Callable[[TunedConfig], bool] | None = None) -> bool:
        """Insert or replace the winner for (tuned.op, device, tuned.tuning_key). With `replace`, an
        existing winner of that key on this device row is replaced only when replace(existing) is True,
        decided inside the write transaction with the row locked, so sweeps writing at once keep the
        faster entry. Returns whether it wrote.

        `replace` sees the stored entry as a TunedConfig (a row too damaged to read is replaced without
        asking); it is not called when the key has no entry yet. When two writers insert the first entry
        of a key at once, the second one's insert meets the unique key, and the transaction is tried again:
        then it finds the first one's entry and asks `replace` about it. An exception from `replace`
        rolls the write back and propagates."""
        check_device(device)
        self._check_tuned(tuned, device)
        if replace is not None and not callable(replace):
            raise TypeError(f"replace: expected a function of the stored TunedConfig, got {type(replace).__name__}")
        return self._run(
            lambda s: self._upsert(s, self._get_or_create_device(s, device).id, tuned, replace=replace),
            write=True)

    def import_tuned(self, rows: list[TunedConfig], device: DeviceIdentity) -> int:
        """Upsert every row for `device` in one transaction (all or nothing); returns how many."""
        return self.import_tables([(rows, device)])[0]

    def import_tables(self, tables: Iterable[tuple[Iterable[TunedConfig], DeviceIdentity]]) -> list[int]:
        """Upsert the rows of several tables, each `(rows, device)`, in one transaction: all of them or
        nothing (`tuning.load` of several files). Returns how many rows each table upserted."""
        checked = []
        for t, (rows, device) in enumerate(tables):
            check_device(device)
            rows = list(rows)
            for i, tuned in enumerate(rows):
                self._check_tuned(tuned, device, f"rows[{i}]" if t == 0 else f"tables[{t}] rows[{i}]")
            checked.append((rows, device))

        def fn(session: Session) -> list[int]:
            for rows, device in checked:
                device_id = self._get_or_create_device(session, device).id
                for tuned in rows:
                    self._upsert(session, device_id, tuned)
            return [len(rows) for rows, _ in checked]

        return self._run(fn, write=True)

    def _candidates(self, op: str, device: DeviceIdentity, tuning_key: str | None = None):
        stmt = (select(TunedRow, DeviceRow).join(DeviceRow, TunedRow.device_id == DeviceRow.id)
                .where(TunedRow.op == op, self._matching_devices(device)).order_by(TunedRow.id))
        if tuning_key is not None:
            stmt = stmt.where(TunedRow.tuning_key == tuning_key)
        return self._run(lambda s: self._convert("tuned_configs", s.execute(stmt), tuned_pair))

    def best(self, op: str, device: DeviceIdentity, tuning_key: str, accept: Accept | None = None
             ) -> TunedConfig | None:
        """The tuned winner for exactly this key, from the most specific device match: same key, PCI id
        and SM count; then same key; then same vendor and arch. Its device_key says where it was tuned.
        With `accept`, entries it refuses are passed over (dispatch: entries outside their space)."""
        check_device(device)
        return pick_best(device, self._candidates(op, device, canonical_key(tuning_key)), accept)

    def nearest(self, op: str, device: DeviceIdentity, dims: Mapping[str, object],
                length_dims: Collection[str], accept: Accept | None = None) -> TunedConfig | None:
        """The tuned key of `op` on this device (same matching order as `best`) whose dims equal `dims`
        except the length dims (the op's `length_dims`), nearest in sum of |log2| length ratios; None
        if there is none. `accept` as in `best`."""
        check_device(device)
        if not isinstance(dims, Mapping):
            raise TypeError(f"dims: expected a dict of tuning-key dims, got {type(dims).__name__}")
        return pick_nearest(device, dims, self._candidates(op, device), length_dims, accept)

    def tuned_rows(self, *, op: str | None = None, device_key: str | None = None
                   ) -> list[tuple[StoredDevice, TunedConfig]]:
        """Tuned winners with the device row each belongs to, ordered by op, device and key."""
        stmt = select(TunedRow, DeviceRow).join(DeviceRow, TunedRow.device_id == DeviceRow.id)
        if op is not None:
            stmt = stmt.where(TunedRow.op == op)
        if device_key is not None:
            stmt = stmt.where(DeviceRow.key == device_key)
        stmt = stmt.order_by(TunedRow.op, DeviceRow.key, DeviceRow.id, TunedRow.tuning_key)
        return self._run(lambda s: self._convert("tuned_configs", s.execute(stmt), tuned_pair))

    def tuned(self, *, op: str | None = None, device_key: str | None = None) -> list[TunedConfig]:
        """Tuned winners, filtered by op and device key."""
        return [tuned for _, tuned in self.tuned_rows(op=op, device_key=device_key)]

    def stale(self, variant_hashes: Mapping[tuple[str, str], str]) -> list[TunedConfig]:
        """Tuned entries whose source hash differs from their variant's current hash.

        `variant_hashes` maps (vendor, variant name) to the hash (`TunedConfig.variant_vendor`).
        Variants missing from the mapping are not judged."""
        out = []
        for tuned in self.tuned():
            current = variant_hashes.get((tuned.variant_vendor, tuned.variant))
            if current is not None and current != tuned.source_hash:
                out.append(tuned)
        return out
