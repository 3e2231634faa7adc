#!/usr/bin/env bash
# Issue 15: one nsa forward at the target shape (b 1, t 65536, h_q 64, h_kv 4, d 128, block 64, 16
# blocks, window 512; the registry's pick) under Nsight Compute: speed of light, memory workload, warp
# states, for the selected-branch kernel and the compressed branch with its selection (one launch
# each, after a warm-up call). Reports in $OUT/ncu_*.txt. T=8192 picks another length.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"

cat > "$OUT/one_call.py" <<PY
import torch
import registry
from registry.ops import OPS
op = OPS["nsa"]
shape = {**next(s for s in op.presets["full"] if s["t"] == 65536), "t": ${T:-65536}}
args = op.validate(**op.make_inputs(shape, device="cuda", dtype=torch.bfloat16, seed=0))
for _ in range(2):
    registry.get("nsa")(**args)
torch.cuda.synchronize()
PY
for kernel in _nsa_slc_kernel _nsa_cmp_kernel; do
    timeout 240 ncu --kernel-name "regex:$kernel" --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section SchedulerStats --section LaunchStats python3 "$OUT/one_call.py" > "$OUT/ncu$kernel.txt" 2>&1 || true
    grep -E "Duration|Throughput|Busy|Hit Rate|Stall|Issued|Eligible|Active Warps|Registers|Shared Memory|Block Size|Grid Size|Waves|Bandwidth" \
        "$OUT/ncu$kernel.txt" | head -70
done
