#!/usr/bin/env bash
# Run a command beside a throwaway PostgreSQL server, e.g.
#   scripts/test_postgres.sh .venv/bin/python -m pytest -q tests/test_tuning_db.py
# The server is made for this run only (initdb into a fresh temp dir), listens on 127.0.0.1 at a free
# port and on a socket in that dir, and has a database kreg_test owned by user kreg with a random
# password (kreg may create databases: the tests make one per test). The command runs with
# KREG_TEST_POSTGRES_URL=postgresql+psycopg://kreg:PASSWORD@127.0.0.1:PORT/kreg_test exported; on exit
# the server stops and the dir is removed, and the command's exit code is returned.
# Needs PostgreSQL's server binaries: the newest /usr/lib/postgresql/*/bin (Debian), else initdb on
# PATH, or PG_BIN=/path/to/bin. As root the server runs as user postgres (initdb refuses root).
set -euo pipefail

if [ $# -eq 0 ]; then
    echo "usage: $0 COMMAND [ARG...]" >&2
    exit 2
fi

bin=${PG_BIN:-}
if [ -z "$bin" ]; then
    bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
fi
if [ -z "$bin" ] && command -v initdb >/dev/null; then
    bin=$(dirname "$(command -v initdb)")
fi
if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
    echo "$0: PostgreSQL's initdb not found (Debian: apt-get install postgresql; or set PG_BIN)" >&2
    exit 2
fi

as_server=()
if [ "$(id -u)" -eq 0 ]; then
    as_server=(runuser -u postgres --)
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/kreg-postgres.XXXXXX")
data=$dir/data
started=

cleanup() {
    if [ -n "$started" ]; then
        "${as_server[@]}" "$bin/pg_ctl" stop -D "$data" -m immediate -s >/dev/null 2>&1 || true
    fi
    rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "$(id -u)" -eq 0 ]; then
    chown postgres: "$dir"
fi
password=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

# Local socket connections are trusted (only the server's own user can reach the dir); TCP needs the
# password. Durability is off: the server lives for one test run.
"${as_server[@]}" "$bin/initdb" -D "$data" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
    -E UTF8 --no-locale --no-sync >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; exit 2; }

# A free port: ask the kernel for one; another process may take it before the server does, so retry.
for _ in 1 2 3 4 5; do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    if "${as_server[@]}" "$bin/pg_ctl" start -D "$data" -l "$dir/server.log" -w -t 60 -s \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
        >/dev/null 2>&1; then
        started=1
        break
    fi
done
if [ -z "$started" ]; then
    echo "$0: the PostgreSQL server did not start; its log:" >&2
    cat "$dir/server.log" >&2 || true
    exit 2
fi

"$bin/psql" -h "$dir" -p "$port" -U postgres -d postgres -q -v ON_ERROR_STOP=1 >/dev/null <<SQL
CREATE ROLE kreg LOGIN CREATEDB PASSWORD '$password';
CREATE DATABASE kreg_test OWNER kreg;
SQL

export KREG_TEST_POSTGRES_URL="postgresql+psycopg://kreg:$password@127.0.0.1:$port/kreg_test"
set +e
"$@"
status=$?
set -e
exit "$status"
