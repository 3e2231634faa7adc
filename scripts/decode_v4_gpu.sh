#!/usr/bin/env bash
# decode version 4 (the combine folded into the split's last program, FUSED 1) on one NVIDIA H200, in
# about 9 minutes: (a) the decode GPU tests (FUSED 1 included: many back-to-back calls racing to the
# last program, CUDA-graph capture with the stream's counters made before capture and inside it),
# (b) the v3 winner tile of each contiguous target with FUSED 0 and 1 and the time of each kernel it
# ran (`benchmarks.decode` config exploration), (c) a sweep of the split role at the three contiguous
# targets into $OUT/decode.db (tables exported to $OUT/tables): the v3 winner tile over WAVES x FUSED,
# then every FUSED 1 tile at WAVES 2 while time is left, (d) the decode benchmark (ours vs SDPA, paged
# vs contiguous) with that database in front of the shipped tables.
#   scripts/decode_v4_gpu.sh            (writes under $OUT, else ./.gpu-out)
# Without network: carry .whl/ (scripts/fetch_wheels.sh) and the wheels are installed by on_device.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${KREG_ON_DEVICE:-}" ] && [ -d .whl ]; then
    KREG_ON_DEVICE=1 exec scripts/on_device.sh bash "$0" "$@"
fi
unset TRITON_INTERPRET
OUT="${OUT:-$PWD/.gpu-out}"
mkdir -p "$OUT"
START=$SECONDS
BUDGET_S=${BUDGET_S:-540}  # the whole script; the benchmark keeps BENCH_S of it
BENCH_S=${BENCH_S:-130}
DB="sqlite:///$OUT/decode.db"
python3 -c "from registry.device import detect; d = detect(); print('device:', d.key, d.name, d.num_sms, 'SMs')" \
    | tee "$OUT/device.txt"

report() {  # name, pid, log: the summary line, and the log's tail when the run failed
    local status=0
    wait "$2" || status=$?
    echo "$1: exit $status: $(tail -n 1 "$3")"
    if [ "$status" -ne 0 ]; then tail -n 40 "$3"; fi
}

# (a) GPU tests (bf16; conftest leaves TRITON_INTERPRET unset when a GPU is present), two processes.
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_kernel.py > "$OUT/test_decode_kernel.log" 2>&1 &
kernel_tests=$!
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_conformance.py -k decode > "$OUT/test_conformance.log" 2>&1 &
conformance_tests=$!
report test_decode_kernel $kernel_tests "$OUT/test_decode_kernel.log"
report "test_conformance -k decode" $conformance_tests "$OUT/test_conformance.log"

# (b) FUSED 0 against 1 at each target's v3 tile (and FUSED 1 at other WAVES: the merge's cost grows with
# the splits), per kernel: b1 n131072 (shape 3), b8 n32768 (0), b32 d128 n8192 (6; WAVES 1 is one split).
explore() {  # shape index, BLOCK_N, KV_HEADS, WAVES of FUSED 0 and 1, other WAVES for FUSED 1
    local configs="" waves
    for waves in $4; do
        for fused in 0 1; do
            configs+="{\"blocks\": {\"BLOCK_N\": $2, \"KV_HEADS\": $3, \"WAVES\": $waves, \"FUSED\": $fused}, "
            configs+="\"num_warps\": 4, \"num_stages\": 3},"
        done
    done
    for waves in $5; do
        configs+="{\"blocks\": {\"BLOCK_N\": $2, \"KV_HEADS\": $3, \"WAVES\": $waves, \"FUSED\": 1}, "
        configs+="\"num_warps\": 4, \"num_stages\": 3},"
    done
    timeout 120 python3 -m benchmarks.decode --shape "$1" --configs "{\"split\": [${configs%,}]}" 2>&1 \
        | tee -a "$OUT/explore.log" || true
}
explore 3 128 1 2 "1 4"
explore 0 16 4 2 "1 4"
explore 6 128 1 1 "2"

# (c) The split role only, three stages, at targets 0, 3 and 6 (contiguous): first each v3 winner tile
# over WAVES 1-8 x FUSED 0/1, then every FUSED 1 tile at WAVES 2 while time is left. Each slice keeps a
# key's stored winner unless it beats it.
sweep() {  # shapes, filter, minutes at most
    local left=$(( BUDGET_S - BENCH_S - (SECONDS - START) ))
    if [ "$left" -lt 30 ]; then
        echo "sweep --shapes $1 --filter $2: skipped, ${left}s left"
        return 0
    fi
    local minutes
    minutes=$(python3 -c "print(round(min(${3}, ${left} / 60 - 0.4), 2))")
    echo "sweep --shapes $1 --filter $2 --max-minutes $minutes"
    timeout $(( left + 20 )) python3 -m tuning.sweep --device auto --op decode --roles split \
        --shapes "$1" --filter "$2" --max-minutes "$minutes" --db "$DB" \
        --export "$OUT/tables" --no-progress 2>&1 | tee -a "$OUT/sweep.log" | tail -n 25 || true
}
sweep targets:0 BLOCK_N=16,KV_HEADS=4,num_warps=4,num_stages=3 1.5
sweep targets:3,6 BLOCK_N=128,KV_HEADS=1,num_warps=4,num_stages=3 2
sweep targets:0,3,6 FUSED=1,WAVES=2,num_stages=3 3

# (d) The benchmark with the swept configs first (keys not swept use the shipped tables).
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
