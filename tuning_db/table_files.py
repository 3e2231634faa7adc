"""Tuned tables as files: one JSON file per (device, op), what `tuning.export` writes, `tuning.load`
imports and `tuning_db/tables/` ships. `TableFile` is their pydantic model; `ShippedTables` answers
lookups from the shipped folder like the database does.

Format 2 entries hold a call config (one launch config per kernel role) and the variant's vendor;
format 1 files, written before roles existed, still load: their one config is the forward's.

A file is strict JSON: a repeated key in an object, NaN or Infinity, a number out of range (1e999, an
integer past 64 bits), nesting too deep or bytes that are not UTF-8 make it a `TableError`, never a
traceback. Whether its ops, variants and configs exist is `tuning.load`'s question.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import warnings
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kreg.core.files import NotARegularFile, NotText, read_text
from kreg.core.records import CallConfig, TunedConfig, canonical_json
from kreg.tuning_db.matching import Accept, DeviceIdentity, canonical_key, check_device, pick_best, pick_nearest

SHIPPED_TABLES = Path(__file__).parent / "tables"
# The shipped tables are tens of KiB; a file past this is not a table (or is /dev/zero).
MAX_TABLE_BYTES = 64 << 20
# Integers a table may hold: 64-bit, what every database column takes.
_INT_LIMIT = 1 << 63


class TableError(ValueError):
    """A tuned table file is not valid; the message names the file, the row and the field."""


KeyValue = int | float | bool | str | None


class DeviceDescriptor(BaseModel):
    """The device a table was tuned on, as the database's devices table holds it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Lengths and ranges are the database columns' (models.DeviceRow).
    key: str = Field(min_length=1, max_length=64)
    vendor: str = Field(min_length=1, max_length=16)
    arch: str = Field(min_length=1, max_length=32)
    name: str = Field(max_length=128)
    pci_device_id: int | None = Field(default=None, ge=0, lt=1 << 31)
    num_sms: int = Field(ge=1, lt=1 << 31)

    @classmethod
    def of(cls, device: DeviceIdentity) -> DeviceDescriptor:
        """The descriptor of a DeviceInfo or stored device."""
        return cls(key=device.key, vendor=device.vendor, arch=device.arch, name=device.name,
                   pci_device_id=device.pci_device_id, num_sms=device.num_sms)


class TableEntry(BaseModel):
    """One tuned winner in a table file; the tuning key is a JSON object, not its text. `config` is a
    call config by role (a format 1 file's single launch config reads as the forward's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tuning_key: dict[str, KeyValue]
    variant: str = Field(min_length=1, max_length=128)
    vendor: str | None = Field(default=None, max_length=16)
    source_hash: str = Field(min_length=1, max_length=128)
    config: CallConfig
    time_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    backward_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    triton_version: str = Field(max_length=64)
    torch_version: str = Field(max_length=64)


class TableFile(BaseModel):
    """A tuned table: every winner of one op on one device (`<device_key>__<op>.json`). The top-level
    versions are the entries' versions when they all agree, else null."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal[1, 2]
    op: str = Field(min_length=1, max_length=64)
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
            format=2, op=op, device=DeviceDescriptor.of(device),
            triton_version=tritons.pop() if len(tritons) == 1 else None,
            torch_version=torches.pop() if len(torches) == 1 else None,
            configs=[TableEntry(tuning_key=json.loads(t.tuning_key), variant=t.variant, vendor=t.vendor,
                                source_hash=t.source_hash, config=t.config, time_ms=t.time_ms,
                                backward_ms=t.backward_ms, triton_version=t.triton_version,
                                torch_version=t.torch_version)
                     for t in entries],
        )

    def tuned(self) -> list[TunedConfig]:
        """The entries as TunedConfig records of this table's op and device."""
        return [TunedConfig(op=self.op, device_key=self.device.key, tuning_key=canonical_json(e.tuning_key),
                            variant=e.variant, vendor=e.vendor, source_hash=e.source_hash, config=e.config,
                            time_ms=e.time_ms, backward_ms=e.backward_ms, triton_version=e.triton_version,
                            torch_version=e.torch_version)
                for e in self.configs]

    def to_json(self) -> str:
        """The file's text: call configs as objects by role, AMD knobs left out where unset, a trailing
        newline."""
        data = self.model_dump(mode="json")
        data["configs"] = [{**row, "config": entry.config.to_data()}
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


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, value in pairs:
        if name in out:
            raise ValueError(f"key {name!r} appears twice in one object")
        out[name] = value
    return out


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    # Checked on the digits before converting: a 5000-digit integer must not cost a conversion.
    if len(text.lstrip("-")) > 19 or not -_INT_LIMIT <= int(text) < _INT_LIMIT:
        raise ValueError(f"integer {text[:40]}{'...' if len(text) > 40 else ''} is out of the 64-bit range")
    return int(text)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def strict_json(text: str) -> object:
    """`json.loads` that refuses what JSON files from a program never hold: a key twice in one object,
    NaN and Infinity, numbers out of range. Raises ValueError (RecursionError for deep nesting)."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_float=_finite, parse_int=_bounded_int,
                      parse_constant=_no_constant)


def read_table(path: str | Path) -> TableFile:
    """Read and validate a whole table file; any problem raises TableError naming the file, the row and
    the field."""
    path = Path(path)
    try:
        text = read_text(path, MAX_TABLE_BYTES)
    except (NotARegularFile, NotText) as err:
        raise TableError(f"{path}: not a tuned table: {err}") from None
    except OSError as err:
        raise TableError(f"{path}: cannot read tuned table: {err}") from None
    try:
        strict_json(text)
    except RecursionError:
        raise TableError(f"{path}: not a JSON tuned table: nested too deeply") from None
    except ValueError as err:
        raise TableError(f"{path}: not a JSON tuned table: {err}") from None
    try:
        # Strict: a table is written by a program, so "4" where 4 belongs is a broken file, not a guess.
        return TableFile.model_validate_json(text, strict=True)
    except ValidationError as err:
        raise TableError(f"{path}: invalid tuned table: {_describe_errors(err)}") from None


class ShippedTables:
    """The tuned tables shipped in a folder (default `tuning_db/tables/`), read on the first lookup.

    Lookups match devices like `TuningStore.best`, through the device descriptor each table carries. A
    file that is not a valid table is left out with a RuntimeWarning naming it (once: files are read
    once); the other files still answer.
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
                        try:
                            table = read_table(path)
                        except TableError as err:
                            warnings.warn(f"kreg: shipped tuned table left out: {err}", RuntimeWarning,
                                          stacklevel=4)
                            continue
                        by_op.setdefault(table.op, []).extend((table.device, t) for t in table.tuned())
                    self._by_op = by_op
        return self._by_op.get(op, [])

    def best(self, op: str, device: DeviceIdentity, tuning_key: str, accept: Accept | None = None
             ) -> TunedConfig | None:
        """The shipped winner for exactly this key (device matching and `accept` as `TuningStore.best`)."""
        check_device(device)
        key = canonical_key(tuning_key)
        return pick_best(device, ((d, t) for d, t in self._entries(op) if t.tuning_key == key), accept)

    def nearest(self, op: str, device: DeviceIdentity, dims: Mapping[str, object],
                length_dims: Collection[str], accept: Accept | None = None) -> TunedConfig | None:
        """The shipped key nearest to `dims` in its length dims (as `TuningStore.nearest`)."""
        check_device(device)
        if not isinstance(dims, Mapping):
            raise TypeError(f"dims: expected a dict of tuning-key dims, got {type(dims).__name__}")
        return pick_nearest(device, dims, self._entries(op), length_dims, accept)

    def tuned(self, op: str | None = None) -> list[TunedConfig]:
        """Every shipped entry (of `op` when given)."""
        if op is not None:
            return [t for _, t in self._entries(op)]
        self._entries("")
        return [t for entries in (self._by_op or {}).values() for _, t in entries]


@functools.lru_cache(maxsize=1)
def shipped_tables() -> ShippedTables:
    """The shipped tuned tables (`tuning_db/tables/`), read once per process."""
    return ShippedTables()
