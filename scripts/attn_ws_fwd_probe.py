"""Times the warp-specialized Gluon forward on one NVIDIA H100/H200, config by config, beside torch SDPA
on the same tensors: two consumer warpgroups (the shipped gpt-oss config and the d 64 default) against
every three-consumer config of FORWARD_SPACE (or, with --all, every config of the space). Each config's
output is first checked against SDPA's (with sinks, against the op's fp32 reference, since SDPA has
none); a config that fails the check is reported and not timed.

    PYTHONPATH=. python scripts/attn_ws_fwd_probe.py              # both shapes, < 120 s on an H200
    PYTHONPATH=. python scripts/attn_ws_fwd_probe.py --only gpt-oss --all

Shapes (bf16, causal): sink_attention gpt-oss b1 s8192 h64/8 d64 with sinks (SDPA runs it without,
GQA through enable_gqa); flash_attention b4 s8192 h32 d64. The forward is timed without lse, as an
inference call runs it.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
import triton.testing

from kernels.nvidia.attention_warpspec import FORWARD_SPACE, warpspec_forward
from registry.device import detect
from registry.ops import OPS
from registry.testing import TOLERANCE, relative_error
from tuning_db.records import LaunchConfig

SHAPES = {
    "gpt-oss": ("sink_attention", 1, 8192, 64, 8, 64),
    "b4-h32": ("flash_attention", 4, 8192, 32, 32, 64),
}
# Two consumers: the shipped H200 gpt-oss entry's forward (64 x 128, 2 stages, 232 registers) and the
# d 64 default (3 stages, 240).
BASELINES = [
    {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 2, "CONSUMERS": 2, "CONSUMER_REGS": 232, "MMA_WAITS": 2},
    {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 3, "CONSUMERS": 2, "CONSUMER_REGS": 240, "MMA_WAITS": 2},
]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def _configs(key: dict, every: bool) -> list[LaunchConfig]:
    space = FORWARD_SPACE.configs(key, detect())
    if every:
        return space
    chosen = [LaunchConfig(blocks=blocks, num_warps=4) for blocks in BASELINES]
    return chosen + [c for c in space if c.blocks["CONSUMERS"] == 3]


def _label(config: LaunchConfig) -> str:
    b = config.blocks
    return (f"{b['CONSUMERS']} x {b['BLOCK_M']} rows, {b['BLOCK_N']} keys, {b['NUM_STAGES']} stages, "
            f"{b['CONSUMER_REGS']} regs, {b['MMA_WAITS']} wait{'s' if b['MMA_WAITS'] > 1 else ''}")


def probe(label: str, every: bool) -> None:
    op_name, b, s, h_q, h_kv, d = SHAPES[label]
    op = OPS[op_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    extra = {}
    if op_name == "sink_attention":
        extra["sinks"] = torch.randn(h_q, device="cuda", generator=gen) + math.log(s)
    args = op.validate(q, k, v, causal=True, **extra)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = {"enable_gqa": True} if h_q != h_kv else {}
    sdpa_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, **gqa).transpose(1, 2)
    # SDPA has no sinks: with them the check is against the op's reference (fp32, chunked).
    expected, against = (op.reference(**args), "reference") if extra else (sdpa_out, "SDPA")
    sdpa = _ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, **gqa))
    # Two [s, s, d] products over the causal half, 2 FLOPs a multiply-add.
    gflop = 2 * b * h_q * s * s * d / 1e9
    print(f"\n{label}: {op_name} b{b} s{s} h{h_q}/{h_kv} d{d} causal bf16{' sinks' if extra else ''} on "
          f"{torch.cuda.get_device_name()}")
    print(f"SDPA{' (no sinks)' if extra else ''}: {sdpa:.3f} ms ({gflop / sdpa:.0f} TFLOP/s)")
    print(f"| config | rel err vs {against} | ms | TFLOP/s | vs SDPA |\n| --- | --- | --- | --- | --- |")
    for config in _configs(dict(op.tuning_key(args)), every):
        out, _ = warpspec_forward(args, config, keep_lse=False)
        err = relative_error(out, expected)
        if not err <= TOLERANCE[torch.bfloat16]:
            print(f"| {_label(config)} | {err:.2e} FAILED | | | |", flush=True)
            continue
        ms = _ms(lambda config=config: warpspec_forward(args, config, keep_lse=False))
        print(f"| {_label(config)} | {err:.1e} | {ms:.3f} | {gflop / ms:.0f} | {sdpa / ms:.3f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(SHAPES), help="one shape")
    parser.add_argument("--all", action="store_true", help="every config of the d 64 space, not only the "
                        "two-consumer baselines and the three-consumer configs (slower: one compile each)")
    opts = parser.parse_args()
    start = time.perf_counter()
    for label in [opts.only] if opts.only else list(SHAPES):
        probe(label, opts.all)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
