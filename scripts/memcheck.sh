#!/usr/bin/env bash
# Every kernel of this GPU's vendor on hostile integer inputs under compute-sanitizer's memcheck: exits
# non-zero on any out-of-bounds or misaligned access (scripts/memcheck.py says what runs).
#   scripts/memcheck.sh            (on a GPU machine with the project installed)
set -euo pipefail
cd "$(dirname "$0")/.."
exec compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 20 python3 scripts/memcheck.py "$@"
