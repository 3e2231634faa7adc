#!/usr/bin/env bash
# GSA top-k version 2 (gsa_topk_radix) on one H200 or H100, in under 9 minutes: the top-k GPU tests, the
# fused top-k against the indexer + torch.topk at T 8192 and 32768 (default config), then a narrow sweep
# of its launch config at the op's three preset lengths (T 4096, 8192, 32768) into $OUT/sweep.db,
# exported to $OUT/tables (the shipped table tests/test_shipped_coverage.py waits for).
#   scripts/gsa_topk_gpu.sh [tests] [bench] [sweep]     (default: all three, in that order; each step has
#   its own time limit, 180 + 150 + 200 s, so a slow one cuts itself short, not the others)
# Logs go to stdout and to $OUT/*.log. Runs through scripts/on_device.sh (the wheels in .whl/).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${KREG_ON_DEVICE:-}" ]; then
    KREG_ON_DEVICE=1 exec scripts/on_device.sh "$0" "$@"
fi
OUT=${OUT:-.gpu-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench sweep)
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/device.log"

for step in "${steps[@]}"; do
    start=$(date +%s)
    case "$step" in
    tests)
        # Each top-k test runs the default and two more configs of the space; the conformance test runs
        # the default on the op's tiny presets; the NaN test checks indices stay valid.
        timeout 180 python3 -m pytest -q -x tests/test_gsa_kernels.py tests/test_conformance.py tests/test_nan.py \
            -k "topk" 2>&1 | tee "$OUT/tests.log" || echo "tests: failed or timed out (exit ${PIPESTATUS[0]})"
        ;;
    bench)
        timeout 150 python3 -m benchmarks.gsa --only topk 2>&1 | tee "$OUT/bench.log" \
            || echo "bench: failed or timed out (exit ${PIPESTATUS[0]})"
        ;;
    sweep)
        # BLOCK_Q 8/16/32 x WAVES 1/2/4 at BLOCK_K 64, TILE 64, 4 warps, 2 stages (BLOCK_Q 32 spills and is
        # pruned by the compile check); shortest T first. A key cut off by --max-minutes promotes nothing.
        timeout 200 python3 -m tuning.sweep --device auto --op gsa_topk --shapes full --no-progress \
            --filter BLOCK_K=64,TILE=64,num_warps=4,num_stages=2 --db "sqlite:///$OUT/sweep.db" \
            --max-minutes 3 --export "$OUT/tables" 2>&1 | tee "$OUT/sweep.log" \
            || echo "sweep: failed or timed out (exit ${PIPESTATUS[0]})"
        ;;
    *)
        echo "unknown step $step (expected tests, bench, sweep)" >&2
        exit 2
        ;;
    esac
    echo "== $step: $(( $(date +%s) - start )) s"
done
