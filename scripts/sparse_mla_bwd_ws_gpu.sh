#!/usr/bin/env bash
# Issue 14: the warp-specialized Gluon fused backward (kernels/nvidia/sparse_mla_warpspec_bwd.py) on an
# sm_90 GPU: its tests first (alone on the GPU), then the backward benchmark at the V3.2 shapes (s_q
# 4096, h_q 128 and 64), the head-block kernel's fused pass at the same shapes for the comparison in
# one process, the Gluon backward's other configs, and the forward (whose producer it shares).
# Logs in $OUT. `TESTS=0` skips the tests, `EXPLORE=0` the config rows, `BENCH=0` the registry's
# backward rows. BASELINE=dir (carried; files laid out as in kernels/nvidia/) times the config rows
# again with those files in place of the current ones, in the same run. SWEEP=full:0,1,4 (preset
# shapes) sweeps the Gluon pass's role (`bwd_fused`) there after the tests, the other roles at their
# best known configs, into $OUT/sweep.db and $OUT/tables, and stops.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
source scripts/sparse_mla_ws_common.sh

if [ "${TESTS:-1}" = 1 ]; then
    sparse_mla_ws_tests
fi
if [ -n "${SWEEP:-}" ]; then
    sparse_mla_ws_sweep bwd_fused "$SWEEP"
    exit 0
fi
if [ "${BENCH:-1}" = 1 ]; then
    timeout 240 python3 -m benchmarks.sparse_mla --backward --shape 0,4 2>&1 | tee "$OUT/bwd.log"
fi
explore() {  # log name: the Gluon kernels' configs at both shapes
    timeout 240 python3 -m benchmarks.sparse_mla --shape 0,4 --configs \
        '{"bwd_fused": [{"blocks": {"PRODUCER_WARPS": 4, "GRADIENT_REGS": 208}, "num_warps": 4},
                        {"blocks": {"PRODUCER_WARPS": 2, "GRADIENT_REGS": 216}, "num_warps": 4}],
          "fwd": [{"blocks": {"PRODUCER_WARPS": 4, "FOLLOWER_REGS": 208}, "num_warps": 4},
                  {"blocks": {"PRODUCER_WARPS": 4, "FOLLOWER_REGS": 200}, "num_warps": 4}]}' \
        2>&1 | grep -v Warning | tee "$OUT/$1.log"
}
if [ "${EXPLORE:-1}" = 1 ]; then
    timeout 200 python3 -m benchmarks.sparse_mla --variant sparse_mla_headblock --shape 0,4 --configs \
        '{"bwd_fused": [{"blocks": {"BLOCK_H": 64, "BLOCK_TOPK": 16, "D_SPLIT": 4}, "num_warps": 8, "num_stages": 3}]}' \
        2>&1 | tee "$OUT/headblock.log"
    explore explore
fi
if [ -n "${BASELINE:-}" ]; then
    with_baseline explore explore_baseline
fi
