#!/usr/bin/env bash
# decode v5 (online combine, wave-filling split counts, one-split calls without a combine) on one GPU,
# about 9 minutes: (a) the decode GPU tests, (b) the probe table (scripts/decode_probe.py: ours per
# kernel against SDPA's kernels at the three contiguous targets), (c) narrow sweeps into
# $OUT/decode.db (tables exported to $OUT/tables): the split role at one kv head per program, WAVES 1,
# 4 warps, 3 stages (BLOCK_N 64/128/256) over $SPLIT_SHAPES (default targets:0-8; the serving grid is
# full:12-39), then the combine role at one row per program and 2 warps (CHUNK 4-64) over targets 0-8,
# (d) the decode benchmark with that database first. PROBE=0 skips (b).
# With NCU=<target index>, (b) is followed by ncu's view of SDPA's kernels and ours at that target.
#   scripts/decode_v5_gpu.sh            (writes under $OUT, else ./.gpu-out)
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
DB="sqlite:///$OUT/decode.db"

background_tests test_decode_kernel 300 tests/test_decode_kernel.py
background_tests test_conformance 300 tests/test_conformance.py -k decode
if [ "${PROBE:-1}" = 1 ]; then python3 scripts/decode_probe.py 2>&1 | grep -v Warn | tee "$OUT/probe.log" || true; fi
report_tests

if [ -n "${NCU:-}" ]; then
    METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
    METRICS=$METRICS,launch__grid_size,launch__block_size,launch__registers_per_thread
    METRICS=$METRICS,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
    timeout 240 ncu --metrics "$METRICS" -k regex:'cudnn|flash|lean|_decode' python3 scripts/decode_probe.py \
        --ncu "$NCU" > "$OUT/ncu.log" 2>&1 || echo "ncu: exit $?"
    grep -vE "^==PROF==|^device" "$OUT/ncu.log" | head -80
fi

sweep() {  # roles, shapes, filter, minutes
    timeout 400 python3 -m tuning.sweep --device auto --op decode --roles "$1" --shapes "$2" \
        ${3:+--filter "$3"} --max-minutes "$4" --db "$DB" --export "$OUT/tables" --no-progress 2>&1 \
        | tee -a "$OUT/sweep.log" | tail -n 14 || true
}
sweep split "${SPLIT_SHAPES:-targets:0,1,2,3,4,5,6,7,8}" KV_HEADS=1,WAVES=1,num_warps=4,num_stages=3 "${SPLIT_MIN:-2.5}"
sweep combine targets:0,1,2,3,4,5,6,7,8 ROWS=1,num_warps=2 "${COMBINE_MIN:-1.5}"

KREG_TUNING_DB="$DB" timeout 200 python3 -m benchmarks.run --only decode --csv "$OUT/benchmarks-decode.csv" 2>&1 \
    | tee "$OUT/bench.log" | tail -n 30 || true
