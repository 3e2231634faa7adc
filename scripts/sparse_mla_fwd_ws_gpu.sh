#!/usr/bin/env bash
# Issue 14: the warp-specialized Gluon forward (kernels/nvidia/sparse_mla.py) on an sm_90 GPU: a smoke
# run (a hang stops here, in two minutes), its tests, then its configs at the V3.2 shapes (s_q 4096,
# h_q 128 and 64). Logs in $OUT. `TESTS=0` skips the tests; CONFIGS (JSON, role -> configs) replaces
# the configs timed. BASELINE=dir (carried; files laid out as in kernels/nvidia/) times BASE_CONFIGS
# with those files in place of the current ones, in the same run. SWEEP=full:0,2 (preset shapes) sweeps
# the forward role there after the tests (the other roles at their best known configs) into
# $OUT/sweep.db and $OUT/tables, then runs `benchmarks.run --only sparse_mla` with those winners, and
# stops.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
source scripts/sparse_mla_ws_common.sh

timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/smoke.log"
import torch
from registry.ops.sparse_mla import make_inputs, reference, validate
import registry
for shape in (dict(s_q=3, s_kv=300, h_q=128, h_kv=1, d_qk=576, d_v=512, topk=203),
              dict(s_q=2, s_kv=61, h_q=64, h_kv=1, d_qk=96, d_v=64, topk=33)):
    args = validate(**make_inputs(shape, device="cuda", dtype=torch.bfloat16, seed=0))
    out = registry.get("sparse_mla")(**args)
    torch.cuda.synchronize()
    ref = reference(**args)
    err = ((out[0].float() - ref[0].float()).norm() / ref[0].float().norm()).item()
    print(shape, "relative error", err, "lse diff", (out[2] - ref[2]).abs().max().item())
PY
if [ "${TESTS:-1}" = 1 ]; then
    sparse_mla_ws_tests
fi
if [ -n "${SWEEP:-}" ]; then
    sparse_mla_ws_sweep fwd "$SWEEP"
    KREG_TUNING_DB="sqlite:///$OUT/sweep.db" timeout 400 python3 -m benchmarks.run --only sparse_mla 2>&1 \
        | grep -v Warning | tee "$OUT/bench.log"
    exit 0
fi
config() {  # producer warps, follower registers
    echo "{\"blocks\": {\"PRODUCER_WARPS\": $1, \"FOLLOWER_REGS\": $2}, \"num_warps\": 4}"
}
CONFIGS=${CONFIGS:-"{\"fwd\": [$(config 4 200), $(config 4 216), $(config 4 232)]}"}
BASE_CONFIGS=${BASE_CONFIGS:-"{\"fwd\": [$(config 4 208), $(config 2 200)]}"}
explore() {  # log name, configs
    timeout 200 python3 -m benchmarks.sparse_mla --shape 0,4 --configs "$2" 2>&1 | grep -v Warning \
        | tee "$OUT/$1.log"
}
explore explore "$CONFIGS"
if [ -n "${BASELINE:-}" ]; then
    with_baseline explore explore_baseline "$BASE_CONFIGS"
fi
