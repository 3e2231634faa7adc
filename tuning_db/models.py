"""SQLAlchemy ORM of the tuning database: devices, sweep runs, trials and tuned configs.

Tuning keys and call configs are stored as canonical JSON text (`records.canonical_json`), so the same
key or config always has the same spelling and the unique constraints below can compare them as strings.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import CheckConstraint, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kreg.core.records import TRIAL_STATUSES

RUN_STATUSES: tuple[str, ...] = ("running", "finished", "stopped")


def utcnow() -> datetime:
    """Timestamps are stored in UTC."""
    return datetime.now(timezone.utc)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    """Declarative base of the tuning database tables."""


class DeviceRow(Base):
    """One physical device model. Each identity part is its own column so lookups can fall back from
    the most specific match (key, PCI id, SM count) to the least (vendor and arch)."""

    __tablename__ = "devices"
    __table_args__ = (
        UniqueConstraint("key", "arch", "name", "pci_device_id", "num_sms", name="uq_devices_identity"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(64), index=True)
    vendor: Mapped[str] = mapped_column(String(16))
    arch: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(128))
    pci_device_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    num_sms: Mapped[int] = mapped_column(Integer)


class SweepRun(Base):
    """One sweep of one op on one device; 'running' or 'stopped' runs can be resumed."""

    __tablename__ = "sweep_runs"
    __table_args__ = (CheckConstraint(_in("status", RUN_STATUSES), name="ck_sweep_runs_status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    op: Mapped[str] = mapped_column(String(64), index=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="running")
    args_json: Mapped[str] = mapped_column(Text, default="{}")
    triton_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))


class TrialRow(Base):
    """One call config tried on one shape in one run, timed for the role it varied (a forward role on
    the forward call, a backward role on the backward alone). The unique key makes a resumed run unable
    to record the same trial twice; `role` is NULL for trials recorded before roles existed."""

    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("run_id", "variant", "source_hash", "tuning_key", "config_json", "role",
                         name="uq_trials_run_role"),
        CheckConstraint(_in("status", TRIAL_STATUSES), name="ck_trials_status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("sweep_runs.id"))
    op: Mapped[str] = mapped_column(String(64), index=True)
    variant: Mapped[str] = mapped_column(String(128))
    vendor: Mapped[str | None] = mapped_column(String(16), nullable=True)
    role: Mapped[str | None] = mapped_column(String(64), nullable=True)
    source_hash: Mapped[str] = mapped_column(String(128))
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"), index=True)
    tuning_key: Mapped[str] = mapped_column(Text)
    config_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(32))
    time_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    registers: Mapped[int | None] = mapped_column(Integer, nullable=True)
    spills: Mapped[int | None] = mapped_column(Integer, nullable=True)
    shared_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    triton_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TunedRow(Base):
    """The winning (variant, call config) for (op, device, tuning key); `vendor` is the variant's
    (NULL for entries recorded before it was), `time_ms` the forward's time, `backward_ms` the
    backward's."""

    __tablename__ = "tuned_configs"
    __table_args__ = (UniqueConstraint("op", "device_id", "tuning_key", name="uq_tuned_configs_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    op: Mapped[str] = mapped_column(String(64))
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"), index=True)
    tuning_key: Mapped[str] = mapped_column(Text)
    variant: Mapped[str] = mapped_column(String(128))
    vendor: Mapped[str | None] = mapped_column(String(16), nullable=True)
    source_hash: Mapped[str] = mapped_column(String(128))
    config_json: Mapped[str] = mapped_column(Text)
    time_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    backward_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    triton_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
