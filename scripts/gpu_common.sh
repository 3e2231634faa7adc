# Sourced by the scripts/*_gpu.sh runs (after `set -euo pipefail`): re-executes the calling script
# through scripts/on_device.sh where the carried wheels (.whl/) must be installed first, leaves the
# Triton interpreter off, makes $OUT (default ./.gpu-out), records the device in $OUT/device.txt and
# defines `report`, `background_tests` and `report_tests`.
cd "$(dirname "$0")/.."
if [ -z "${KREG_ON_DEVICE:-}" ] && [ -d .whl ]; then
    KREG_ON_DEVICE=1 exec scripts/on_device.sh bash "$0" "$@"
fi
unset TRITON_INTERPRET
OUT="${OUT:-$PWD/.gpu-out}"
mkdir -p "$OUT"
python3 -c "from registry.device import detect; d = detect(); print('device:', d.key, d.name, d.num_sms, 'SMs')" \
    | tee "$OUT/device.txt"

report() {  # name, pid, log: the summary line, and the log's tail when the run failed
    local status=0
    wait "$2" || status=$?
    echo "$1: exit $status: $(tail -n 1 "$3")"
    if [ "$status" -ne 0 ]; then tail -n 40 "$3"; fi
}

TEST_RUNS=()
background_tests() {  # name, timeout in seconds, pytest arguments: one pytest process, log in $OUT/<name>.log
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" python3 -m pytest -q -x -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1 &
    TEST_RUNS+=("$name:$!")
}

report_tests() {  # waits for every background_tests run and reports each
    local run
    for run in "${TEST_RUNS[@]}"; do
        report "${run%%:*}" "${run##*:}" "$OUT/${run%%:*}.log"
    done
}
