"""How the tuning store uses PostgreSQL (`postgresql+psycopg://...`, `pip install 'kreg[postgres]'`), where
sweeps on several machines share one server database.

Transactions run at the server's isolation level (READ COMMITTED unless configured otherwise), so the
store serializes the few writes that read before they insert: `lock` takes a transaction-scoped
advisory lock (schema changes, new device rows; a NULL in the devices' unique key would let two
inserts through), and row locks (SELECT ... FOR UPDATE) cover the rest. `is_retryable` names the
failures a transaction is simply tried again after: a serialization failure, a deadlock, a lock that
was not granted. Nothing here runs on other databases.
"""

from __future__ import annotations

from sqlalchemy import text

# SQLSTATEs after which the whole transaction is tried again: serialization_failure, deadlock_detected,
# lock_not_available (a lock_timeout the server sets), transaction_rollback.
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03", "40000"})

# pg_advisory_xact_lock(namespace, what): the namespace is "kreg" in ASCII, so other users of advisory
# locks on the same server are unlikely to meet it.
_NAMESPACE = 0x6B726567
LOCKS = {"schema": 1, "devices": 2}


def is_postgres(conn) -> bool:
    return conn.dialect.name == "postgresql"


def is_retryable(err: BaseException) -> bool:
    """Whether `err` (a SQLAlchemy error wrapping a driver's, or the driver's own) is a PostgreSQL failure
    that a new attempt of the same transaction can get past."""
    sqlstate = getattr(getattr(err, "orig", None) or err, "sqlstate", None)
    return sqlstate in RETRYABLE_SQLSTATES


def lock(conn, what: str) -> None:
    """Hold the advisory lock `what` (a key of LOCKS) until the transaction ends; no-op on other
    databases (SQLite's writes already hold its one write lock)."""
    if is_postgres(conn):
        conn.execute(text(f"SELECT pg_advisory_xact_lock({_NAMESPACE}, {LOCKS[what]})"))
