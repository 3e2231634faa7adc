#!/usr/bin/env bash
# Create .venv and install kreg into it (called by the Makefile when .venv is missing).
#   gpu: reuse the machine's PyTorch/Triton/rich/pytest (no network there); pydantic and SQLAlchemy
#        come from wheels in .whl/ (scripts/fetch_wheels.sh downloads them where there is network).
#   cpu: install the CPU build of PyTorch and the dev and postgres extras from the package index.
set -euo pipefail
mode=$1 python=$2 venv=$3
if [ "$mode" = gpu ]; then
    "$python" -m venv --system-site-packages "$venv"
    # When the system python is itself a virtual environment (as on the GPU image), a nested venv does
    # not see its packages as system packages: point the new venv at them with a .pth file.
    purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$python" -c 'import site; print("\n".join(site.getsitepackages()))' > "$purelib/system-python.pth"
    if [ -d .whl ]; then
        "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
    fi
    "$venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
else
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # Torch first: on this workplace's CPU machines pip finds the CPU build of 2.13.0 on disk. Triton
    # pinned to the GPU machines' 3.6.0: the offline compile checks (spills, shared memory) must see
    # the compiler that runs there; 3.9 spills on configs that 3.6 fits.
    "$venv/bin/python" -m pip install -q torch==2.13.0 triton==3.6.0
    # The postgres extra (psycopg) lets the tuning store's tests run on PostgreSQL too
    # (scripts/test_postgres.sh), the distributed one (Ray) the Ray sweeps and the transformers one the
    # integration's tests; a GPU machine's venv uses what its image has and skips what is missing.
    "$venv/bin/python" -m pip install -q -e '.[dev,postgres,distributed,transformers]'
fi
