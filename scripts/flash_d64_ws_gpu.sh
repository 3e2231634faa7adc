#!/usr/bin/env bash
# flash_attention_warpspec at flash_attention's d 64 keys (default: full preset 15, b4 s8192 h32 d64 causal,
# the issue's shape; SHAPES=16 its non-causal twin, comma-separated for several) on one NVIDIA H100/H200,
# in under 10 minutes a key: a sweep of its forward with three consumer warpgroups, then of its Gluon
# dK/dV and dQ roles, into $OUT/d64.db (tables exported to $OUT/tables), then benchmarks.attention's rows
# for those shapes (ours through the registry with that database, SDPA).
#   [SHAPES=15,16] scripts/flash_d64_ws_gpu.sh        (writes under $OUT, else ./.gpu-out)
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
export KREG_TUNING_DB="sqlite:///$OUT/d64.db"
SHAPES="${SHAPES:-15}"

for roles in fwd bwd_dkv,bwd_dq; do
    filter=()
    [ "$roles" = fwd ] && filter=(--filter CONSUMERS=3)
    timeout 200 python3 -m tuning.sweep --device auto --op flash_attention --variant flash_attention_warpspec \
        --shapes "full:$SHAPES" --roles "$roles" "${filter[@]}" --export "$OUT/tables" --no-progress 2>&1 \
        | tee -a "$OUT/sweep.log" | grep -v "^│  " | tail -n 6 || true
done
timeout 150 python3 -m benchmarks.attention --preset "flash_attention:$SHAPES" 2>&1 | grep -v "Warning\|_warn_once"
