#!/usr/bin/env bash
# On a lent GPU machine without network (PyTorch and Triton preinstalled): install the wheels carried in
# .whl/ (scripts/fetch_wheels.sh downloads them) into /tmp/site, then run the given command with them
# and this checkout importable:  scripts/on_device.sh python3 -m kreg.tuning.sweep --device auto ...
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
