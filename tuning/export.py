"""Tuned tables out of the database: JSON per (device, op), a long CSV, or a Markdown table for docs.

    python -m tuning.export --device h200 [--op OP] --format json|csv|md [--out DIR_OR_FILE] [--db URL]

JSON files (`<device_key>__<op>.json`, the format of `tuning_db.store.TableFile`) are what
`tuning_db/tables/` ships and what `python -m tuning.load` imports on another machine. Every file is
written to a temporary name beside its target and renamed, so a reader never sees half a file.

Names taken from the database become file names only through `file_name` (letters, digits, '.', '_'
and '-'; no '..'), so every JSON file lands in the --out folder; a symbolic link, a device or anything
else that is not a regular file at a target is refused, never replaced. Exporting only reads the
database: a --db path that does not exist is an error, not a new file.

A JSON export adds to the table already at its target rather than replacing it: the store's entries
replace those of the same tuning key, and the file's other keys stay (a store that re-tuned a few keys,
exported over the shipped folder, must not drop the rest). A file there that is not a valid table of the
same op and device is refused.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import stat
import sys
import tempfile
from collections import Counter
from pathlib import Path

from kreg.core.device import PRESETS, DeviceInfo, preset
from kreg.core.records import TunedConfig
from kreg.core.space import KNOB_NAMES
from kreg.tuning_db.errors import TuningDatabaseError
from kreg.tuning_db.matching import match_level
from kreg.tuning_db.rows import StoredDevice
from kreg.tuning_db.store import TuningStore
from kreg.tuning_db.table_files import TableError, TableFile, read_table

_KEY_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class ExportError(ValueError):
    """An export that would write somewhere it must not (outside --out, over a link or a device)."""


def file_name(text: str) -> str:
    """`text` made safe as one file name: every character but letters, digits, '.', '_' and '-' becomes
    '_', and so does every run of dots and a leading '.' or '-' (never a path, a parent, a hidden file or
    an option)."""
    name = re.sub(r"\.{2,}", "_", _UNSAFE.sub("_", text))
    return "_" + name[1:] if name.startswith((".", "-")) or not name else name


def resolve_device(device: str) -> tuple[str, DeviceInfo | None]:
    """(device key, preset or None) of a preset name (h200, mi355, ...) or a device key (nvidia-h200)."""
    try:
        info = preset(device)
        return info.key, info
    except ValueError:
        pass
    for info in PRESETS.values():
        if info.key == device:
            return device, info
    if not _KEY_PATTERN.fullmatch(device):
        raise ValueError(f"device: expected a preset name ({', '.join(sorted(PRESETS))}) or a device key "
                         f"such as 'nvidia-h200', got {device!r}")
    return device, None


def tables(store: TuningStore, device_key: str, op: str | None = None) -> list[TableFile]:
    """One TableFile per op tuned on `device_key` (a preset name or a device key), ops sorted.

    The database may hold several cards under one key (an H100 PCIe and an SXM are both nvidia-h100):
    per tuning key the entry of the card that best matches the preset wins (then the latest one), and
    the table names the card that gave most of its entries.
    """
    key, info = resolve_device(device_key)
    by_op: dict[str, dict[str, tuple[tuple, StoredDevice, TunedConfig]]] = {}
    for stored, tuned in store.tuned_rows(op=op, device_key=key):
        level = match_level(info, stored) if info is not None else 0
        recency = tuned.updated_at.timestamp() if tuned.updated_at else 0.0
        rank = (level, -recency, -stored.id)
        chosen = by_op.setdefault(tuned.op, {})
        if tuned.tuning_key not in chosen or rank < chosen[tuned.tuning_key][0]:
            chosen[tuned.tuning_key] = (rank, stored, tuned)
    out = []
    for name in sorted(by_op):
        picks = list(by_op[name].values())
        counts = Counter(stored.id for _, stored, _ in picks)
        top = min(picks, key=lambda pick: (-counts[pick[1].id], pick[0]))[1]
        out.append(TableFile.build(name, top, [tuned for _, _, tuned in picks]))
    return out


def check_replaceable(path: Path, option: str = "--out") -> None:
    """ExportError unless `path` is free or a regular file (not a link, a folder, a FIFO or a device), and
    its folder is a folder or can become one."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        found = None
    except NotADirectoryError:
        raise ExportError(f"{path.parent}: not a folder; choose another {option}") from None
    if found is not None and stat.S_ISLNK(found.st_mode):
        raise ExportError(f"{path}: refusing to replace a symbolic link; remove it or choose another {option}")
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise ExportError(f"{path}: refusing to replace something that is not a regular file; "
                          f"choose another {option}")
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ExportError(f"{parent}: not a folder; choose another {option}")
            break


def table_path(out_dir: str | Path, device_key: str, op: str) -> Path:
    """Where export_json writes the table of `op` on `device_key`."""
    return Path(out_dir) / f"{file_name(device_key)}__{file_name(op)}.json"


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to a temporary file beside `path`, then rename it over `path`. A symbolic link or
    anything but a regular file at `path` is refused (ExportError), not replaced."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes the file private; a table is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def export_json(store: TuningStore, device_key: str, op: str | None = None,
                out_dir: str | Path = ".") -> list[Path]:
    """Write `<device_key>__<op>.json` (names made safe by `file_name`) into `out_dir` for each op tuned
    on the device, each merged into the table already there (`merged_into_file`); returns the paths.
    Nothing is written when two tables would share a file or a target is refused."""
    out = Path(out_dir)
    found = tables(store, device_key, op)
    targets: dict[Path, TableFile] = {}
    for table in found:
        path = table_path(out, table.device.key, table.op)
        if path in targets:
            raise ExportError(f"ops {targets[path].op!r} and {table.op!r} would both be written to {path}")
        targets[path] = table
    for path in targets:  # all refusals before the first write
        check_replaceable(path)
    targets = {path: merged_into_file(table, path) for path, table in targets.items()}
    return [write_atomic(path, table.to_json()) for path, table in targets.items()]


def merged_into_file(table: TableFile, path: Path) -> TableFile:
    """`table` plus the entries of the table file at `path` whose tuning keys `table` lacks (`table` as it
    is when there is no file). ExportError when the file is not a valid table of the same op and device:
    it is not this export's to replace."""
    if not path.exists():
        return table
    try:
        there = read_table(path)
    except TableError as err:
        raise ExportError(f"{err}; move it away or choose another --out") from None
    if (there.op, there.device.key) != (table.op, table.device.key):
        raise ExportError(f"{path}: holds {there.op} on {there.device.key}, not {table.op} on {table.device.key}; "
                          "move it away or choose another --out")
    mine = {tuned.tuning_key for tuned in table.tuned()}
    kept = [tuned for tuned in there.tuned() if tuned.tuning_key not in mine]
    return TableFile.build(table.op, table.device, [*table.tuned(), *kept]) if kept else table


def export_csv(store: TuningStore, device_key: str, op: str | None = None) -> str:
    """Long-format CSV, one row per tuned entry and kernel role, the role's config flattened to columns
    (block sizes by name, then the launch knobs; empty where a kernel has no such field)."""
    rows = [(tuned, role, config) for table in tables(store, device_key, op) for tuned in table.tuned()
            for role, config in tuned.config.items()]
    blocks = sorted({name for _, _, config in rows for name in config.blocks})
    header = ["op", "device_key", "tuning_key", "variant", "vendor", "source_hash", "role", *blocks, *KNOB_NAMES,
              "time_ms", "backward_ms", "triton_version", "torch_version"]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for tuned, role, config in rows:
        knobs = [getattr(config, name) for name in KNOB_NAMES]
        writer.writerow([tuned.op, tuned.device_key, tuned.tuning_key, tuned.variant, tuned.vendor or "",
                         tuned.source_hash, role, *(config.blocks.get(name, "") for name in blocks),
                         *("" if value is None else value for value in knobs),
                         *("" if ms is None else ms for ms in (tuned.time_ms, tuned.backward_ms)),
                         tuned.triton_version, tuned.torch_version])
    return buffer.getvalue()


def markdown_cell(text: str) -> str:
    """`text` safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def export_markdown(store: TuningStore, device_key: str, op: str | None = None) -> str:
    """A Markdown table of the device's tuned entries for docs: op, key dims, variant, call config,
    forward and backward times."""
    found = tables(store, device_key, op)
    lines = ["| op | key | variant | config | time (ms) | backward (ms) |", "|---|---|---|---|---:|---:|"]
    for table in found:
        for tuned in table.tuned():
            dims = " ".join(f"{k}={v}" for k, v in json.loads(tuned.tuning_key).items())
            times = ["" if ms is None else f"{ms:.4g}" for ms in (tuned.time_ms, tuned.backward_ms)]
            cells = [table.op, dims, tuned.variant, str(tuned.config), *times]
            lines.append("| " + " | ".join(markdown_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _target(out: str | None, default_name: str) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    return path / file_name(default_name) if path.is_dir() or out.endswith(os.sep) else path


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 written, 1 nothing tuned for the device, 2 error)."""
    parser = argparse.ArgumentParser(prog="python -m tuning.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", required=True, help="preset name (h200, mi355, ...) or device key")
    parser.add_argument("--op", help="only this op (default: every tuned op)")
    parser.add_argument("--format", choices=("json", "csv", "md"), default="json")
    parser.add_argument("--out", help="json: folder (default .); csv/md: file or folder (default stdout)")
    parser.add_argument("--db", help="SQLAlchemy URL (default: KREG_TUNING_DB or the user cache file)")
    args = parser.parse_args(argv)
    try:
        key, _ = resolve_device(args.device)
        store = TuningStore(args.db)
        if not store.exists():
            print(f"tuning.export: no tuning database at {store!r}: the file does not exist (check --db or "
                  "KREG_TUNING_DB)", file=sys.stderr)
            return 2
        if not store.tuned_rows(op=args.op, device_key=key):
            what = f" of {args.op}" if args.op else ""
            print(f"nothing tuned{what} for device {key} in {store!r}", file=sys.stderr)
            return 1
        if args.format == "json":
            for path in export_json(store, args.device, args.op, args.out or "."):
                print(path)
            return 0
        text = (export_csv if args.format == "csv" else export_markdown)(store, args.device, args.op)
        suffix = f"__{args.op}" if args.op else ""
        target = _target(args.out, f"{key}{suffix}.{args.format}")
        if target is None:
            sys.stdout.write(text)
        else:
            print(write_atomic(target, text))
        return 0
    except (ValueError, TuningDatabaseError, OSError) as err:
        print(f"tuning.export: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
