#!/usr/bin/env bash
# Issue 14: one forward and one backward of sparse_mla at the V3.2 shape (s_q 4096, s_kv 8192, h_q 128,
# topk 2048; the registry's pick) under Nsight Compute: speed of light, memory workload, warp states,
# for the warp-specialized forward and fused backward kernels (one launch each, after a warm-up call).
# Reports in $OUT/ncu_*.txt.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"

cat > "$OUT/one_call.py" <<'PY'
import torch
import registry
from registry.ops import OPS
op = OPS["sparse_mla"]
shape = {"s_q": 4096, "s_kv": 8192, "h_q": 128, "h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048}
args = op.validate(**op.make_inputs(shape, device="cuda", dtype=torch.bfloat16, seed=0))
q = args["q"].detach().requires_grad_()
for _ in range(2):
    out = registry.get("sparse_mla")(**{**args, "q": q}).out
    out.backward(torch.ones_like(out))
torch.cuda.synchronize()
PY
for kernel in sparse_mla_fwd_ws sparse_mla_bwd_ws; do
    timeout 240 ncu --kernel-name "regex:$kernel" --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section SchedulerStats python3 "$OUT/one_call.py" > "$OUT/ncu_$kernel.txt" 2>&1 || true
    grep -E "Duration|Throughput|Busy|Hit Rate|Stall|Issued|Eligible|Active Warps|Registers|Shared Memory" \
        "$OUT/ncu_$kernel.txt" | head -60
done
