"""Between the database's tables and kreg's records: a row read back becomes a `StoredDevice`,
`TunedConfig` or `TrialResult` here, and a database written by an older kreg is brought to the
current schema here (`schema_changes` says what it lacks, `migrate` adds it, keeping every row), on
SQLite and PostgreSQL alike (plain SQL and SQLAlchemy's inspector; no PRAGMAs).

A row that does not convert raises ValueError or TypeError from its record; the store skips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import inspect, text

from kreg.core.records import CallConfig, TrialResult, TunedConfig
from kreg.tuning_db.models import Base, DeviceRow, TrialRow, TunedRow
from kreg.tuning_db.postgres import lock as postgres_lock


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


# ----------------------------------------------------------------------------- rows to records
def aware(moment: datetime | None) -> datetime | None:
    """`moment` in UTC: SQLite drops the time zone, and every stored timestamp is UTC."""
    if moment is not None and moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    return moment


def stored_device(row: DeviceRow) -> StoredDevice:
    return StoredDevice(row.id, row.key, row.vendor, row.arch, row.name, row.pci_device_id, row.num_sms)


def tuned_record(row: TunedRow, device: DeviceRow) -> TunedConfig:
    return TunedConfig(
        op=row.op, device_key=device.key, tuning_key=row.tuning_key, variant=row.variant, vendor=row.vendor,
        source_hash=row.source_hash, config=CallConfig.from_json(row.config_json), time_ms=row.time_ms,
        backward_ms=row.backward_ms, triton_version=row.triton_version, torch_version=row.torch_version,
        updated_at=aware(row.updated_at),
    )


def tuned_pair(row: TunedRow, device: DeviceRow) -> tuple[StoredDevice, TunedConfig]:
    return stored_device(device), tuned_record(row, device)


def trial_record(row: TrialRow, device: DeviceRow) -> TrialResult:
    return TrialResult(
        op=row.op, variant=row.variant, vendor=row.vendor, source_hash=row.source_hash, device_key=device.key,
        tuning_key=row.tuning_key, config=CallConfig.from_json(row.config_json), role=row.role,
        status=row.status, time_ms=row.time_ms, error=row.error, registers=row.registers, spills=row.spills,
        shared_bytes=row.shared_bytes, triton_version=row.triton_version, torch_version=row.torch_version,
    )


# ----------------------------------------------------------------------------- schema migration
# Columns added since the first schema: (table, column, SQL type). Trials also changed their unique key
# (the role joined it), which SQL cannot alter in place: that table is rebuilt.
_ADDED_COLUMNS = (("tuned_configs", "vendor", "VARCHAR(16)"), ("tuned_configs", "backward_ms", "FLOAT"))
_TRIALS_BEFORE_ROLES = "trials_before_roles"


def schema_changes(conn) -> list[str]:
    """What the database lacks of the current schema: missing tables, missing columns, old trials."""
    found = inspect(conn)
    tables = set(found.get_table_names())
    changes = [f"table {name}" for name in Base.metadata.tables if name not in tables]
    for table, column, _ in _ADDED_COLUMNS:
        if table in tables and column not in {c["name"] for c in found.get_columns(table)}:
            changes.append(f"column {table}.{column}")
    if "trials" in tables and "role" not in {c["name"] for c in found.get_columns("trials")}:
        changes.append("trials without roles")
    return changes


def migrate(conn) -> None:
    """Bring the database to the current schema in one write transaction, keeping every row. Checked
    again here: another process may have migrated it since `schema_changes` looked (on PostgreSQL,
    migrations take turns under an advisory lock, and each looks once it holds the lock; on SQLite the
    write transaction holds the database)."""
    postgres_lock(conn, "schema")
    changes = schema_changes(conn)
    for table, column, sql_type in _ADDED_COLUMNS:
        if f"column {table}.{column}" in changes:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}"))
    rebuild = "trials without roles" in changes
    if rebuild:
        conn.execute(text(f"ALTER TABLE trials RENAME TO {_TRIALS_BEFORE_ROLES}"))
        # Index names are global: the renamed table's plain indexes would clash with the new table's.
        # (PostgreSQL names the new table's primary key and id sequence apart from the old one's itself.)
        for index in inspect(conn).get_indexes(_TRIALS_BEFORE_ROLES):
            if index["name"] and index["name"].startswith("ix_"):
                conn.execute(text(f"DROP INDEX {index['name']}"))
    Base.metadata.create_all(conn)
    if rebuild:
        # Ids are left to the new table (in order), so its id sequence stays right on every database.
        kept = ("run_id, op, variant, source_hash, device_id, tuning_key, config_json, status, time_ms, error, "
                "registers, spills, shared_bytes, triton_version, torch_version, created_at")
        conn.execute(text(f"INSERT INTO trials ({kept}) SELECT {kept} FROM {_TRIALS_BEFORE_ROLES} ORDER BY id"))
        conn.execute(text(f"DROP TABLE {_TRIALS_BEFORE_ROLES}"))
