"""How the tuning store uses SQLite, its default database: one file that every process on the machine
shares, sweeps on several GPUs writing to it at once.

`sqlite_file` says which file a URL names (None for an in-memory database). `configure_sqlite` sets
every new connection up for that sharing: a busy timeout, WAL mode (once the file has pages; a
read-only file keeps its mode), and transactions that the store begins itself, a write with `BEGIN
IMMEDIATE` so that writers queue for the lock instead of failing halfway. `empty_engine` is the
in-memory database with the store's tables and no rows that answers reads before the real one exists.
"""

from __future__ import annotations

import functools
import sqlite3
import threading
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import StaticPool

from kreg.tuning_db.models import Base

BUSY_TIMEOUT_S = 30.0


def sqlite_file(url: URL) -> Path | None:
    """The file a SQLite URL names, resolved; None for an in-memory database."""
    database = url.database or ""
    if database.startswith("file:") and url.query.get("uri") == "true":
        # SQLite URI form (`sqlite:///file:/path/x.db?mode=ro&uri=true`): the file is the URI's path.
        database = "" if url.query.get("mode") == "memory" else database.removeprefix("file:")
    if database and not database.startswith(":memory:"):
        return Path(database).expanduser().resolve()
    return None


def configure_sqlite(engine: Engine) -> None:
    """Set up every connection `engine` opens for a file shared by concurrent writers (see above)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        # Transactions are begun by `_on_begin` below, not by the sqlite3 module's own guesswork.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            # The first query that reads the file: a damaged file fails here. An empty file stays
            # empty until the first write (the store sets WAL then); a read-only one keeps its mode.
            mode = cursor.execute("PRAGMA journal_mode").fetchone()[0]
            if mode.lower() not in ("wal", "memory") and cursor.execute("PRAGMA page_count").fetchone()[0]:
                try:
                    cursor.execute("PRAGMA journal_mode = WAL")
                except sqlite3.OperationalError as err:
                    if "readonly" not in str(err).lower():
                        raise
            # In WAL mode NORMAL keeps every commit across a process crash (not a power cut).
            cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        # A write takes the write lock up front: a deferred transaction that reads first and then
        # writes can fail at once with SQLITE_BUSY in WAL mode instead of waiting for the lock. The store
        # marks a write's connection with the execution option `kreg_write`.
        write = connection.get_execution_options().get("kreg_write", False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


# Reads of a database that does not exist yet run against one in-memory database with the store's
# tables and no rows; it has one connection, so its users take turns under this lock.
EMPTY_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def empty_engine() -> Engine:
    """The shared in-memory database with the store's tables and no rows (hold `EMPTY_LOCK` to use it)."""
    engine = create_engine("sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False})
    Base.metadata.create_all(engine)
    return engine
