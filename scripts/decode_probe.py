"""decode on a GPU: where the time of a call goes, ours against SDPA, at the issue's three contiguous
target shapes (bf16, sinks on for ours).

    python scripts/decode_probe.py                     # the table below, every target
    python scripts/decode_probe.py --ncu 0             # one call of SDPA and of ours, for ncu -k regex:...

For each shape: the call through the registry (shipped table), then the same split config with other
combine configs, and a few split configs (the combine as shipped); each row gives the call's
time (`tuning.bench`, as the benchmarks time it) and the profiled time of each kernel. SDPA's rows list
its kernels by name (on Hopper our combine is resident from the split's start, so its profiled time
includes its wait). Each of our configs is checked against the reference on the full shape first.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import registry
from registry.device import detect
from registry.ops import OPS
from registry.testing import TOLERANCE, output_error
from tuning.bench import time_gpu_quantiles
from tuning_db.records import LaunchConfig

OP = OPS["decode"]
INFO = detect()
TARGETS = (0, 3, 6)  # b8 h64/8 d64 n32768, b1 n131072, b32 h32/8 d128 n8192; contiguous
COMBINES = (
    {"blocks": {"ROWS": 1, "CHUNK": 8}, "num_warps": 2},
    {"blocks": {"ROWS": 1, "CHUNK": 32}, "num_warps": 2},
)
SPLITS = (  # (BLOCK_N, KV_HEADS, WAVES), 4 warps, 3 stages
    (256, 1, 1), (128, 1, 1), (128, 1, 2), (64, 1, 2), (16, 4, 1), (16, 4, 2),
)


def kernel_times(fn, calls: int = 20) -> str:
    """Each kernel `fn` launches, by name (shortened) and average device microseconds."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    found = [(e.key, e.self_device_time_total / e.count) for e in prof.key_averages()
             if e.self_device_time_total > 0 and e.count >= calls]
    return " + ".join(f"{name.split('(')[0].split('<')[0].split('::')[-1][:28]} {us:.1f}us" for name, us in found)


def sdpa_call(args: dict):
    q = args["q"].unsqueeze(2)  # [b, h, 1, d]
    k, v = args["k_cache"].transpose(1, 2), args["v_cache"].transpose(1, 2)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def rows(index: int) -> None:
    shape = OP.presets["targets"][index]
    args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=torch.bfloat16, seed=0))
    expected = OP.reference(**args)
    name = f"b{shape['b']} h{shape['h_q']}/{shape['h_kv']} d{shape['d']} n{shape['n']}"
    gbytes = OP.bytes_moved(args) / 1e9
    handle = registry.get("decode")
    choice = handle.choice(**args)
    variant, shipped = choice.variant, choice.config
    print(f"{name}: {gbytes:.3f} GB; shipped ({choice.source}) split {shipped['split'].blocks} "
          f"w{shipped['split'].num_warps} s{shipped['split'].num_stages}", flush=True)

    def row(label: str, fn):
        ms = time_gpu_quantiles(fn)[1]
        print(f"  {label:58} {ms * 1e3:8.1f} us {gbytes / ms:5.2f} TB/s | {kernel_times(fn)}", flush=True)

    row("sdpa (no sinks)", sdpa_call(args))
    row("registry", lambda: handle(**args))
    calls = [(f"combine {json.dumps(c['blocks'])} w{c['num_warps']}", shipped.replace("combine", LaunchConfig(**c)))
             for c in COMBINES]
    for block_n, kv_heads, waves in SPLITS:
        cfg = shipped.replace("split", LaunchConfig(blocks={"BLOCK_N": block_n, "KV_HEADS": kv_heads, "WAVES": waves},
                                                    num_warps=4, num_stages=3))
        calls.append((f"split {block_n} keys x {kv_heads} kv heads, WAVES {waves}", cfg))
    key = dict(OP.tuning_key(args))
    for label, cfg in calls:
        reason = variant.prune_reason("split", cfg["split"], key, INFO)
        if reason is not None:
            print(f"  {label:58} skipped: {reason}", flush=True)
            continue
        err = output_error(OP, variant.launch(args, cfg), expected, args)
        assert err <= TOLERANCE[torch.bfloat16], (label, err)
        row(label, lambda cfg=cfg: variant.launch(args, cfg))
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ncu", type=int, default=None, help="target index: one SDPA call and one of ours")
    opts = parser.parse_args()
    if opts.ncu is not None:
        args = OP.validate(**OP.make_inputs(OP.presets["targets"][opts.ncu], device="cuda", dtype=torch.bfloat16,
                                            seed=0))
        handle, sdpa = registry.get("decode"), sdpa_call(args)
        for fn in (sdpa, lambda: handle(**args)):
            fn()
            torch.cuda.synchronize()
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    for index in TARGETS:
        rows(index)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
