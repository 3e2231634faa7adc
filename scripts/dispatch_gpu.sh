#!/usr/bin/env bash
# Dispatch on a GPU: the launch cache's correctness tests first (cached launches against Triton's, bit
# for bit), then the dispatch benchmark (registry vs direct vs bound vs cached launcher, CUDA graphs,
# the dispatch alone), then the other GPU tests that go through dispatch (custom ops and CUDA graphs,
# the registry, decode's CUDA-graph serving pattern), meant to take under 6 minutes on an H100 (written
# without a GPU, so not timed yet). Every step runs even if one fails; the exit status says whether any
# did. The benchmark's CSV goes to $OUT (or here).
#   scripts/on_device.sh bash scripts/dispatch_gpu.sh        (on a lent machine without network)
#   bash scripts/dispatch_gpu.sh                             (with the project installed)
# Inductor compiles of every op (tests/test_library.py -k inductor) take longer and are left out.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-.}
failed=0

step() {
    echo "=== $*"
    "$@" || { echo "=== failed ($?): $*"; failed=1; }
}

step "$PYTHON" -m pytest -q -x tests/test_dispatch_cache.py --durations=5
step "$PYTHON" -m benchmarks.run --only dispatch --csv "$OUT/dispatch.csv"
step "$PYTHON" -m benchmarks.dispatch
step "$PYTHON" -m pytest -q tests/test_library.py -k "not inductor" --durations=5
step "$PYTHON" -m pytest -q tests/test_registry.py --durations=5
step "$PYTHON" -m pytest -q tests/test_decode_kernel.py -k cuda_graph
exit $failed
