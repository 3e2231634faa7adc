#!/usr/bin/env bash
# One op on a GPU machine: its tests, a sweep, then its benchmark family, each step's log in $OUT
# (default ./.gpu-out). The sweep's database is $OUT/tuning.db (unless KREG_TUNING_DB names another)
# and its tables go to $OUT/tables, so the benchmark times the configs the sweep just picked.
#   scripts/gpu_op.sh OP [DEVICE]      e.g. scripts/gpu_op.sh decode h200   (DEVICE defaults to auto)
# SWEEP_ARGS adds sweep options, e.g. SWEEP_ARGS="--max-minutes 30 --resume" or "--shapes full:0".
# With a .whl/ folder (scripts/fetch_wheels.sh) it runs itself through scripts/on_device.sh.
# Every step runs even when an earlier one fails; the exit status says whether any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: scripts/gpu_op.sh OP [DEVICE]" >&2
    exit 2
fi
if [ -z "${KREG_ON_DEVICE:-}" ] && [ -d .whl ]; then
    KREG_ON_DEVICE=1 exec scripts/on_device.sh bash "$0" "$@"
fi
op=$1 device=${2:-auto}
case $op in  # the benchmark family (benchmarks/run.py `families()`) that times this op
    flash_attention | sink_attention) family=attention ;;
    gsa_indexer | gsa_topk | gsa_sparse_attention) family=gsa ;;
    *) family=$op ;;
esac
unset TRITON_INTERPRET
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/.gpu-out}
mkdir -p "$OUT"
export KREG_TUNING_DB=${KREG_TUNING_DB:-sqlite:///$OUT/tuning.db}

failed=0
step() {  # name, command...: runs the command with its output in $OUT/<name>.log, then says how it went
    local name=$1 status=0
    shift
    echo "== $name: $*"
    "$@" > "$OUT/$name.log" 2>&1 || status=$?
    echo "== $name: exit $status: $(tail -n 1 "$OUT/$name.log")"
    if [ "$status" -ne 0 ]; then
        tail -n 30 "$OUT/$name.log"
        failed=1
    fi
}

step tests "$PYTHON" -m pytest -q -p no:cacheprovider tests/ -k "$op"
# shellcheck disable=SC2086  # SWEEP_ARGS is a list of options
step sweep "$PYTHON" -m kreg.tuning.sweep --device "$device" --op "$op" --export "$OUT/tables" --no-progress ${SWEEP_ARGS:-}
step bench "$PYTHON" -m kreg.benchmarks.run --only "$family" --csv "$OUT/benchmarks-$op.csv"
exit $failed
