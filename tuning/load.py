"""Tuned tables into the database, validated first.

    python -m tuning.load FILE [FILE ...] [--db URL]

Every file is validated whole before anything is written: it must be a strict JSON tuned table
(`tuning_db.table_files.read_table`) whose op and variants are registered and whose configs lie inside
their variants' config spaces (`ops.catalog.entry_problem`). One bad row rejects the load, and the error names
the file, the row (its index in "configs") and the field. All files are then imported in one
transaction: every entry of every file, or nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kreg.ops import OPS
from kreg.ops.catalog import entry_problem
from kreg.tuning_db.errors import TuningDatabaseError
from kreg.tuning_db.store import TuningStore
from kreg.tuning_db.table_files import TableError, TableFile, read_table


def check_table(table: TableFile, path: str | Path) -> None:
    """Raise TableError (naming the file, the row and the problem) unless every entry of `table` fits its
    variant on the table's device (`entry_problem`)."""
    if table.op not in OPS:
        raise TableError(f"{path}: op {table.op!r} is not a registered op (known: {', '.join(OPS)})")
    problems = []
    for i, tuned in enumerate(table.tuned()):
        problem = entry_problem(tuned, table.device)
        if problem is not None:
            problems.append(f"row {i} (configs[{i}]): {problem}")
    if problems:
        more = f"; and {len(problems) - 5} more rows" if len(problems) > 5 else ""
        raise TableError(f"{path}: invalid tuned table: {'; '.join(problems[:5])}{more}")


def read_checked_table(path: str | Path) -> TableFile:
    """The table file at `path`, read (`read_table`) and checked against the registered variants
    (`check_table`); TableError names the file, the row and the problem."""
    table = read_table(path)
    check_table(table, path)
    return table


def _check_no_repeats(loaded: list[tuple[Path, TableFile]]) -> None:
    # Two files with one (op, device, key) would leave the database holding whichever came last.
    seen: dict[tuple, tuple[Path, int]] = {}
    for path, table in loaded:
        for i, tuned in enumerate(table.tuned()):
            where = (table.op, table.device, tuned.tuning_key)
            if where in seen:
                first, row = seen[where]
                raise TableError(f"{path}: row {i} (configs[{i}]): tuning key {tuned.tuning_key} of {table.op} on "
                                 f"{table.device.key} is also row {row} of {first}")
            seen[where] = (path, i)


def _validated(paths: list[str | Path]) -> list[tuple[Path, TableFile]]:
    loaded = [(Path(path), read_checked_table(path)) for path in paths]
    _check_no_repeats(loaded)
    return loaded


def _import(loaded: list[tuple[Path, TableFile]], store: TuningStore) -> list[tuple[TableFile, int]]:
    counts = store.import_tables([(table.tuned(), table.device) for _, table in loaded])
    return [(table, count) for (_, table), count in zip(loaded, counts, strict=True)]


def load_tables(paths: list[str | Path], store: TuningStore) -> list[tuple[TableFile, int]]:
    """Validate every table file of `paths`, then import them all into `store` in one transaction;
    returns (table, entries upserted) per file. Raises TableError (nothing imported) when any file is
    not a valid table, TuningDatabaseError when the database refuses the write (nothing imported)."""
    return _import(_validated(paths), store)


def load_table(path: str | Path, store: TuningStore) -> int:
    """Validate the table file at `path` and import it into `store` in one transaction; returns how many
    entries it upserted. Raises TableError (nothing imported) when the file is not a valid table."""
    return load_tables([path], store)[0][1]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 imported, 2 a file or the database was rejected)."""
    parser = argparse.ArgumentParser(prog="python -m tuning.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="JSON tuned table(s)")
    parser.add_argument("--db", help="SQLAlchemy URL (default: KREG_TUNING_DB or the user cache file)")
    args = parser.parse_args(argv)
    try:
        # Every file is checked before the database is opened: a bad one leaves it as it was.
        loaded = _validated(args.files)
        store = TuningStore(args.db)
        for path, (table, count) in zip(args.files, _import(loaded, store), strict=True):
            print(f"{path}: imported {count} tuned configs of {table.op} for {table.device.key} "
                  f"into {store!r}")
        return 0
    except (TableError, TuningDatabaseError) as err:
        print(f"tuning.load: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
