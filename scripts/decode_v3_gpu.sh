#!/usr/bin/env bash
# decode version 3 on one NVIDIA H200, in about 9 minutes: (a) the decode GPU tests, (b) a narrow sweep
# of the split role's new blocks (KV_HEADS, short tiles for several heads) at the three target keys
# and their paged-16 twins into $OUT/decode.db (tables exported to $OUT/tables), (c) the decode
# benchmark (ours vs SDPA, paged vs contiguous) with that database in front of the shipped tables.
#   scripts/decode_v3_gpu.sh            (writes under $OUT, else ./.gpu-out)
# Without network: carry .whl/ (scripts/fetch_wheels.sh) and the wheels are installed by on_device.sh.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
START=$SECONDS
BUDGET_S=${BUDGET_S:-530}  # the whole script; the benchmark keeps BENCH_S of it
BENCH_S=${BENCH_S:-130}
DB="sqlite:///$OUT/decode.db"

# (a) GPU tests (bf16; conftest leaves TRITON_INTERPRET unset when a GPU is present), two processes.
background_tests test_decode_kernel 200 tests/test_decode_kernel.py
background_tests test_conformance 200 tests/test_conformance.py -k decode
report_tests

# (b) The split role only, at targets 6, 7 (b32 h32/8 d128 n8192 contiguous, paged 16), 0, 1 (b8 h64/8
# d64 n32768) and 3, 4 (b1 n131072), three stages: first WAVES 2 (every KV_HEADS x BLOCK_N x num_warps
# the space keeps: 24 configs a key), then WAVES 1 at 4 warps while time is left. Each slice keeps
# a key's stored winner unless it beats it.
sweep() {
    local left=$(( BUDGET_S - BENCH_S - (SECONDS - START) ))
    if [ "$left" -lt 30 ]; then
        echo "sweep --filter $1: skipped, ${left}s left"
        return 0
    fi
    local minutes
    minutes=$(python3 -c "print(round(min(${2}, ${left} / 60 - 0.4), 2))")
    echo "sweep --filter $1 --max-minutes $minutes"
    timeout $(( left + 20 )) python3 -m tuning.sweep --device auto --op decode --roles split \
        --shapes targets:6,7,0,1,3,4 --filter "$1" --max-minutes "$minutes" --db "$DB" \
        --export "$OUT/tables" --no-progress 2>&1 | tee -a "$OUT/sweep.log" | tail -n 25 || true
}
sweep WAVES=2,num_stages=3 4
sweep WAVES=1,num_stages=3,num_warps=4 2

# (c) The benchmark with the swept configs first (keys not swept use the shipped tables).
bench_s=$(( BUDGET_S + 30 - (SECONDS - START) ))
KREG_TUNING_DB="$DB" timeout $(( bench_s > 90 ? bench_s : 90 )) python3 -m benchmarks.run --only decode \
    --csv "$OUT/benchmarks-decode.csv" 2>&1 | tee "$OUT/bench.log" || true
# The swept winners, from the exported table.
python3 - "$OUT"/tables/*decode*.json <<'EOF' 2>&1 | tee "$OUT/winners.txt" || true
import json, sys
for path in sys.argv[1:]:
    for entry in json.load(open(path))["configs"]:
        k, split = entry["tuning_key"], entry["config"]["split"]
        print(f"b{k['b']} h{k['h_q']}/{k['h_kv']} d{k['d']} n{k['n']} block {k['block_size']}: {split['blocks']} "
              f"warps {split['num_warps']} stages {split['num_stages']} {entry['time_ms']:.4f} ms")
EOF
echo "total ${SECONDS}s"
