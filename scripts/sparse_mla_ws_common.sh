# Sourced by the sparse_mla Gluon scripts (scripts/sparse_mla_fwd_ws_gpu.sh, sparse_mla_bwd_ws_gpu.sh)
# after scripts/gpu_common.sh: the variant's GPU tests, a sweep of one of its roles, and a command run
# with earlier kernel files in place.

sparse_mla_ws_tests() {  # the Gluon variant's test files, one after the other, alone on the GPU
    background_tests warpspec 300 tests/test_sparse_mla_warpspec.py
    report_tests
    TEST_RUNS=()
    background_tests kernel 420 tests/test_sparse_mla_kernel.py -k warpspec
    report_tests
}

sparse_mla_ws_sweep() {  # role, preset shapes (full:0,2): into $OUT/sweep.db and $OUT/tables
    timeout 420 python3 -m tuning.sweep --device auto --op sparse_mla --variant sparse_mla_warpspec \
        --shapes "$2" --roles "$1" --db "sqlite:///$OUT/sweep.db" --export "$OUT/tables" \
        --no-progress --max-minutes 6 2>&1 | tail -n 30 | tee "$OUT/sweep.log"
}

with_baseline() {  # command...: runs it with $BASELINE's files (laid out as kernels/nvidia/) in place
    mkdir -p "$OUT/current"
    for f in "$BASELINE"/*.py; do
        cp "kernels/nvidia/$(basename "$f")" "$OUT/current/"
        cp "$f" "kernels/nvidia/"
    done
    "$@"
    cp "$OUT"/current/*.py kernels/nvidia/
}
