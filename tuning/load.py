"""Tuned tables into the database, validated first.

    python -m tuning.load FILE [FILE ...] [--db URL]

Every file is validated whole (`tuning_db.table_files.read_table`) before anything is written: one bad row
rejects the file, and the error names the row (its index in "configs") and the field. A good file is
imported in one transaction, upserting its entries for the device its table names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tuning_db.store import TuningDatabaseError, TuningStore
from tuning_db.table_files import TableError, read_table


def load_table(path: str | Path, store: TuningStore) -> int:
    """Validate the table file at `path` and import it into `store` in one transaction; returns how many
    entries it upserted. Raises TableError (nothing imported) when the file is not a valid table."""
    table = read_table(path)
    return store.import_tuned(table.tuned(), table.device)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 imported, 2 a file or the database was rejected)."""
    parser = argparse.ArgumentParser(prog="python -m tuning.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="JSON tuned table(s)")
    parser.add_argument("--db", help="SQLAlchemy URL (default: KREG_TUNING_DB or the user cache file)")
    args = parser.parse_args(argv)
    try:
        # All files are checked before the first import, so a bad one leaves the database as it was.
        loaded = [(path, read_table(path)) for path in args.files]
        store = TuningStore(args.db)
        for path, table in loaded:
            count = store.import_tuned(table.tuned(), table.device)
            print(f"{path}: imported {count} tuned configs of {table.op} for {table.device.key} "
                  f"into {store!r}")
        return 0
    except (TableError, TuningDatabaseError) as err:
        print(f"tuning.load: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
