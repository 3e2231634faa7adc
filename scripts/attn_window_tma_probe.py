"""The short-window forward with TMA loads (kernels/nvidia/attention_window.py) against the tiled no-loop
forward (KEY_LOOPS 2) and FlexAttention with the sink rescale, on one NVIDIA H100/H200, bf16.

First every Gluon config is checked against the reference (fp32) on small odd shapes (s not a
multiple of the block, s_q != s_k, windows of 32/64/128, GQA 4 and 8, sinks of +-30, d 64 and 128, lse);
then the gpt-oss window shapes (b1 h64/8 d64, window 128, s 8192 and 32768) are timed with rotating
inputs. Tables are not involved.

    PYTHONPATH=. python scripts/attn_window_tma_probe.py
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.attention import SINK, _bhsd, _flex_with_sinks
from kernels.common.attention import attention_forward
from kernels.nvidia.attention_window import window_tma_forward, window_tma_served
from registry.device import detect
from registry.testing import relative_error
from tuning.bench import rotating, time_gpu
from tuning_db.records import LaunchConfig

# (tokens, heads, num_warps, MAX_REGS)
GLUON = [(16, 4, 4, 96), (16, 4, 4, 168), (8, 8, 4, 96), (8, 8, 4, 168), (16, 8, 8, 96)]
TILED = [(64, 4), (64, 8)]  # the shipped no-loop entries: BLOCK_M 64 with HEADS 4 (s 8192), 8 (s 32768)


def _config(cfg) -> LaunchConfig:
    tokens, heads, warps, regs = cfg
    return LaunchConfig(blocks={"TOKENS": tokens, "HEADS": heads, "MAX_REGS": regs}, num_warps=warps)


def _gluon(args, cfg, keep_lse=False):
    return window_tma_forward(args, _config(cfg), keep_lse)


def _tiled(args, cfg, keep_lse=False):
    block_m, heads = cfg
    config = LaunchConfig.model_validate({"blocks": {"BLOCK_M": block_m, "BLOCK_N": 32, "HEADS": heads,
                                                     "KEY_LOOPS": 2}, "num_warps": 4, "num_stages": 2})
    return attention_forward(args, config, keep_lse)


def check(cfg) -> float:
    worst = 0.0
    cases = [
        dict(b=2, s_q=333, s_k=333, h_q=16, h_kv=2, d=64, window=128),
        dict(b=1, s_q=77, s_k=301, h_q=8, h_kv=2, d=64, window=64),
        dict(b=1, s_q=200, s_k=150, h_q=8, h_kv=1, d=128, window=32),
        dict(b=1, s_q=3, s_k=200, h_q=8, h_kv=1, d=64, window=128),
        dict(b=1, s_q=1000, s_k=1000, h_q=16, h_kv=4, d=128, window=128),
    ]
    heads = cfg[1]
    for case, sink_scale in itertools.product(cases, (1.0, 30.0)):
        group = case["h_q"] // case["h_kv"]
        if group % heads:
            continue
        g = torch.Generator(device="cuda").manual_seed(case["s_q"] + int(sink_scale))
        q = torch.randn(case["b"], case["s_q"], case["h_q"], case["d"], device="cuda", generator=g).bfloat16()
        k = torch.randn(case["b"], case["s_k"], case["h_kv"], case["d"], device="cuda", generator=g).bfloat16()
        v = torch.randn(case["b"], case["s_k"], case["h_kv"], case["d"], device="cuda", generator=g).bfloat16()
        sinks = torch.randn(case["h_q"], device="cuda", generator=g) * sink_scale
        args = SINK.validate(q=q, k=k, v=v, sinks=sinks, window=case["window"], causal=True, return_lse=True)
        assert window_tma_served(args, _config(cfg)), case
        out, lse = _gluon(args, cfg, keep_lse=True)
        ref_out, ref_lse = SINK.reference(**args)
        finite = torch.isfinite(ref_lse)
        worst = max(worst, relative_error(out, ref_out), relative_error(lse[finite], ref_lse[finite]))
        assert torch.equal(torch.isinf(lse), ~finite), "empty rows"
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/attn_window_tma_probe.py")
    parser.add_argument("--shape", default="1,2", help="indices of sink_attention's full preset")
    opts = parser.parse_args()
    print("device:", detect().name, flush=True)
    for cfg in GLUON:
        print(f"check gluon {cfg}: worst rel err {check(cfg):.2e}", flush=True)
    for index in (int(i) for i in opts.shape.split(",")):
        shape = SINK.presets["full"][index]
        sets = [SINK.validate(**SINK.make_inputs(shape, device="cuda", dtype=torch.bfloat16, seed=i)) for i in range(3)]
        ref = _tiled(sets[0], TILED[0])[0]
        flex = _flex_with_sinks(shape, sets[0]["q"].device)
        peer_args = [(*_bhsd(a), a["sinks"]) for a in sets]
        flex_ms = time_gpu(rotating(lambda t, f=flex: f(*t), peer_args))
        rows = [("flex+sink-rescale", flex_ms, None)]
        for cfg in TILED:
            rows.append((f"tiled no-loop BLOCK_M {cfg[0]} HEADS {cfg[1]}",
                         time_gpu(rotating(lambda a, c=cfg: _tiled(a, c), sets)), None))
        for cfg in GLUON:
            err = relative_error(_gluon(sets[0], cfg)[0], ref)
            rows.append((f"gluon tma tokens {cfg[0]} heads {cfg[1]} warps {cfg[2]} MAX_REGS {cfg[3]}",
                         time_gpu(rotating(lambda a, c=cfg: _gluon(a, c), sets)), err))
        for name, ms, err in rows:
            tail = "" if err is None else f"  vs tiled rel {err:.1e}"
            print(f"s {shape['s_q']:6} {name:56} {ms:8.4f} ms  {flex_ms / ms:5.2f}x Flex{tail}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
