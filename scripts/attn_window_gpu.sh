#!/usr/bin/env bash
# The window forward without a loop (KEY_LOOPS 2) on one NVIDIA H100/H200, in about 8 minutes: (a) the
# attention GPU tests, (b) a sweep of the forward role's KEY_LOOPS 2 configs at the two gpt-oss window
# keys (b1 h64/8 d64, window 128, s 8192 and 32768) into $OUT/window.db (tables exported to
# $OUT/tables), (c) benchmarks.attention's rows for those shapes (ours vs Flex + sink rescale, forward
# and forward+backward) with that database in front of the shipped tables.
#   scripts/attn_window_gpu.sh            (writes under $OUT, else ./.gpu-out)
# Without network: carry .whl/ (scripts/fetch_wheels.sh) and the wheels are installed by on_device.sh.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
export KREG_TUNING_DB="sqlite:///$OUT/window.db"

# (a) GPU tests (bf16; conftest leaves TRITON_INTERPRET unset when a GPU is present), two processes. The
# conformance run alone took 229 s on an H100.
background_tests test_attention_kernel 300 tests/test_attention_kernel.py
background_tests test_conformance 300 tests/test_conformance.py -k "sink_attention or flash_attention"
report_tests

# (b) Forward only; the backward roles keep the shipped entries' configs.
timeout 200 python3 -m tuning.sweep --device auto --op sink_attention --variant sink_attention_flash \
    --shapes full:1,2 --roles fwd --filter KEY_LOOPS=2 --export "$OUT/tables" --no-progress 2>&1 \
    | tee "$OUT/sweep.log" | tail -n 12 || true

# (c) The benchmark's rows for the window shapes, through the registry (the database above first).
timeout 200 python3 -m benchmarks.attention --preset sink_attention:1,2 2>&1 | grep -v "Warning\|_warn_once"
