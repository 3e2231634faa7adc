#!/usr/bin/env bash
# The warp-specialized Gluon attention forward (flash_attention_warpspec, sink_attention_warpspec) on one
# NVIDIA H100/H200, in under 8 minutes: (a) its GPU tests (tests/test_attention_warpspec.py, and the
# conformance test's tiny presets in every layout through it), three processes at once; (b) forward rows
# at the issue's shapes beside SDPA, the tiled variant (its tuned tables) and then the warp-specialized
# one (its default config), each in its own process so that a failing kernel cannot take the other's
# rows with it. Logs and CSV rows under $OUT (else ./.gpu-out).
#   export OUT; scripts/on_device.sh bash scripts/attn_gluon_gpu.sh
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
START=$SECONDS
BUDGET_S=${BUDGET_S:-450}  # the whole script
TESTS_S=${TESTS_S:-210}    # each test process

# (a) GPU tests in bf16 (conftest leaves TRITON_INTERPRET unset when a GPU is present).
timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider tests/test_attention_warpspec.py -k "not every_config" \
    > "$OUT/test_warpspec.log" 2>&1 &
cases=$!
timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider tests/test_attention_warpspec.py -k every_config \
    > "$OUT/test_warpspec_space.log" 2>&1 &
space=$!
timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider tests/test_conformance.py -k warpspec \
    > "$OUT/test_conformance.log" 2>&1 &
conformance=$!
report "test_attention_warpspec (cases)" $cases "$OUT/test_warpspec.log"
report "test_attention_warpspec (every config)" $space "$OUT/test_warpspec_space.log"
report "test_conformance -k warpspec" $conformance "$OUT/test_conformance.log"

# (b) Forward rows: b2 s8192 h16 d128 causal and full, b1 s16384 h32 d128 causal, b4 s8192 h32 d64 causal,
# gpt-oss b1 s8192 h64/8 d64 causal with sinks (against SDPA without them).
bench() {  # kind, share of the time left (percent)
    local left=$(( BUDGET_S - (SECONDS - START) ))
    local limit=$(( left * $2 / 100 ))
    if [ "$limit" -lt 30 ]; then
        echo "benchmark $1: skipped, ${left}s left"
        return 0
    fi
    echo "benchmark $1 (limit ${limit}s)"
    timeout "$limit" python3 -m benchmarks.attention --variants "$1" --csv "$OUT/attention-forward-$1.csv" \
        > "$OUT/bench-$1.log" 2>&1 || echo "benchmark $1: exit $?"
    tail -n 12 "$OUT/bench-$1.log"
}
bench tiled 45
bench warpspec 100
echo "total ${SECONDS}s"
