"""Test setup: without a GPU, Triton kernels run in the interpreter (read when kernels are decorated,
so it is set before anything imports them)."""

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA or ROCm GPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `long` start first, spread over the workers. pytest-xdist's work stealing hands each
    of its w workers a contiguous share of the collection (what remains // workers left) and an idle
    worker steals from the end of a busy one's share: each share begins with every w-th long test, so
    that no long test starts last and no worker holds them all."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    long = [item for item in items if item.get_closest_marker("long")]
    rest = [item for item in items if not item.get_closest_marker("long")]
    ordered: list[pytest.Item] = []
    for share in range(workers):
        mine = long[share::workers]
        take = max(0, (len(items) - len(ordered)) // (workers - share) - len(mine))
        ordered += mine + rest[:take]
        rest = rest[take:]
    items[:] = ordered + rest


ROOT = Path(__file__).resolve().parents[1]


def run_compile_check(*argv: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`python -m kreg.tuning.compile_check --json ARGV` in a process without the interpreter (the repo
    first on its path, then whatever supplies the dependencies: a GPU machine's carried wheels), with
    this worker's share of the cores as `--jobs` (pytest-xdist's workers may all be compiling at once; a
    pool per worker over every core would oversubscribe them). The process and its JSON rows."""
    jobs = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-m", "kreg.tuning.compile_check", "--json", "--jobs", str(jobs), *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests run: the GPU when there is one, else the CPU through the interpreter."""
    return torch.device("cuda" if HAS_GPU else "cpu")


@pytest.fixture(autouse=True)
def _isolated_tuning_db(tmp_path, monkeypatch):
    """Every test gets its own empty tuning database, so no test reads the user's cache."""
    monkeypatch.setenv("KREG_TUNING_DB", f"sqlite:///{tmp_path / 'tuning.db'}")


# ----------------------------------------------------------------------------- tuning store backends
# The store's tests run on SQLite (a file in tmp_path) and on PostgreSQL when KREG_TEST_POSTGRES_URL
# names a server database whose user may create databases (scripts/test_postgres.sh starts one and sets
# it). Without it the PostgreSQL cases are skipped, unless KREG_REQUIRE_POSTGRES=1 (CI), where they fail.
POSTGRES_URL_VAR = "KREG_TEST_POSTGRES_URL"


def _postgres_url() -> str:
    """The test server's URL; skips the test without one, or fails it where PostgreSQL is required."""
    url = os.environ.get(POSTGRES_URL_VAR)
    if url:
        return url
    if os.environ.get("KREG_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"KREG_REQUIRE_POSTGRES=1 but {POSTGRES_URL_VAR} is not set: run the tests under "
                    "scripts/test_postgres.sh", pytrace=False)
    pytest.skip(f"PostgreSQL: {POSTGRES_URL_VAR} is not set (scripts/test_postgres.sh CMD sets it)")


@pytest.fixture
def postgres_url() -> str:
    """The PostgreSQL test server's own URL (its database is shared: tests that write use `store_url`)."""
    return _postgres_url()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> Iterator[str]:
    """A URL of an empty tuning database of its own for this test: a SQLite file, or a new PostgreSQL
    database (named from a uuid, so tests on parallel workers never meet; dropped afterwards)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    server = make_url(_postgres_url())
    name = f"kreg_test_{uuid.uuid4().hex}"
    # CREATE and DROP DATABASE cannot run inside a transaction.
    admin = create_engine(server, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            # FORCE: a store a test left open (or a killed process's session) must not keep it alive.
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
