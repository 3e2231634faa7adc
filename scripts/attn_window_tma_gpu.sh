#!/usr/bin/env bash
# sink_attention_window_tma (kernels/nvidia/attention_window.py) on one NVIDIA H100/H200, in two steps
# of at most 10 minutes each:
#   scripts/attn_window_tma_gpu.sh tests   the GPU tests that run it, and the probe (kernel against the
#                                          tiled no-loop forward and Flex + sink rescale, no tables)
#   scripts/attn_window_tma_gpu.sh sweep   its forward, then its dK/dV and dQ roles (4 warps, the tiled
#                                          winners' count) at the gpt-oss window keys (b1 h64/8 d64,
#                                          window 128, s 8192 and 32768) into $OUT/window.db, tables
#                                          exported to $OUT/tables, then benchmarks.attention's rows for
#                                          those shapes through the registry with that database
#   scripts/attn_window_tma_gpu.sh bench   the same rows with the shipped tables only (an empty database)
# (writes under $OUT, else ./.gpu-out). Without network: carry .whl/ (scripts/fetch_wheels.sh).
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
export KREG_TUNING_DB="sqlite:///$OUT/window.db"

case "${1:-}" in
tests)
    background_tests test_attention_window_tma 300 tests/test_attention_window_tma.py
    background_tests test_warpspec_dispatch 300 tests/test_attention_warpspec.py -k dispatch
    background_tests test_dispatch_cache 300 tests/test_dispatch_cache.py
    report_tests
    TEST_RUNS=()
    background_tests test_conformance 360 tests/test_conformance.py -k sink_attention
    PYTHONPATH=".:${PYTHONPATH:-}" timeout 200 python3 scripts/attn_window_tma_probe.py 2>&1 | grep -v "Warning\|_warn_once"
    report_tests
    ;;
sweep|bench)
    if [ "$1" = bench ]; then
        export KREG_TUNING_DB="sqlite:///$OUT/empty.db"
    fi
    for roles in fwd bwd_dkv,bwd_dq; do
        [ "$1" = sweep ] || break
        filter=()
        [ "$roles" = fwd ] || filter=(--filter num_warps=4)
        timeout 240 python3 -m tuning.sweep --device auto --op sink_attention --variant sink_attention_window_tma \
            --shapes full:1,2 --roles "$roles" "${filter[@]}" --export "$OUT/tables" --no-progress 2>&1 \
            | tee -a "$OUT/sweep.log" | tail -n 8 || true
    done
    # Host time per eager forward call (no sync inside the loop): what a call costs before the GPU runs it.
    timeout 100 python3 - <<'PY' 2>&1 | grep -v "Warning\|_warn_once"
import statistics

import torch

import registry
from benchmarks.attention import SINK
from benchmarks.common import host_us

for index in (1, 2):
    args = SINK.validate(**SINK.make_inputs(SINK.presets["full"][index], device="cuda", dtype=torch.bfloat16, seed=0))
    calls = {name: (lambda handle=registry.get("sink_attention", variant=name): handle(**args))
             for name in ("sink_attention_window_tma", "sink_attention_flash")}
    for name, samples in host_us(calls, iters=200, repeats=3).items():
        print(f"full:{index} host time per forward call, {name}: {statistics.median(samples):.0f} us")
PY
    timeout 200 python3 -m benchmarks.attention --preset sink_attention:1,2 2>&1 | grep -v "Warning\|_warn_once"
    ;;
*)
    echo "usage: $0 tests|sweep|bench" >&2
    exit 2
    ;;
esac
