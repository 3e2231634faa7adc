#!/usr/bin/env bash
# Issue 14: the Gluon fused backward's GPU tests, then a sweep of its role (`bwd_fused`: the producer's
# warps and the gradient warpgroup's registers) at the V3.2 keys of the preset (SHAPES, default
# full:0,1,4), the other roles at their best known configs; the database and the exported tables
# land in $OUT. `TESTS=0` skips the tests.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"

if [ "${TESTS:-1}" = 1 ]; then
    background_tests warpspec 300 tests/test_sparse_mla_warpspec.py
    report_tests
    TEST_RUNS=()
    background_tests kernel 420 tests/test_sparse_mla_kernel.py -k warpspec
    report_tests
fi
timeout 420 python3 -m tuning.sweep --device auto --op sparse_mla --variant sparse_mla_warpspec \
    --shapes "${SHAPES:-full:0,1,4}" --roles bwd_fused --db "sqlite:///$OUT/sweep.db" --export "$OUT/tables" \
    --no-progress --max-minutes 6 2>&1 | tail -n 30 | tee "$OUT/sweep.log"
