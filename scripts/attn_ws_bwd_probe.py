"""Times the attention backward on one NVIDIA H100/H200: the warp-specialized variant's (tiled pre,
Gluon dK/dV, Gluon dQ) against the tiled variant's (pre, dK/dV, dQ), kernel by kernel (the Gluon dQ
beside the tiled dQ at the tiled variant's default config), beside torch
SDPA's forward and forward+backward on the same tensors. Gradients of the two backward paths (and
SDPA's, at shapes without sinks) are checked against each other before anything is timed.

    PYTHONPATH=. python scripts/attn_ws_bwd_probe.py            # both shapes
    PYTHONPATH=. python scripts/attn_ws_bwd_probe.py --only d128

Shapes: flash_attention b2 s8192 h16 d128 causal bf16; sink_attention gpt-oss b1 s8192 h64/8 d64
causal bf16 (SDPA runs it without sinks, with GQA through enable_gqa). Each variant runs its default
call config (no tuned table), so the rows show the kernels, not a sweep.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
import triton.testing

from kernels.common.attention import attention_backward, attention_backward_dq, backward_pre
from kernels.nvidia.attention_warpspec_bwd import warpspec_dkv, warpspec_dq
from registry.catalog import load_all
from registry.device import detect
from registry.ops import OPS
from registry.testing import max_relative_error

SHAPES = {
    "d128": ("flash_attention", 2, 8192, 16, 16, 128),
    "gpt-oss": ("sink_attention", 1, 8192, 64, 8, 64),
}


def _variant(op: str, name: str):
    return next(v for v in load_all()[op] if v.name == name and v.vendor == "nvidia")


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def _tflops(gflop: float, ms: float) -> str:
    return f"{gflop / ms:.0f}"


def probe(label: str) -> None:
    op_name, b, s, h_q, h_kv, d = SHAPES[label]
    op = OPS[op_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(b, s, h_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    extra = {}
    if op_name == "sink_attention":
        extra["sinks"] = torch.randn(h_q, device="cuda", generator=gen) + math.log(s)
    args = op.validate(q, k, v, causal=True, return_lse=True, **extra)
    key = dict(op.tuning_key(args))
    device = detect()
    suffix = "flash" if op_name == "sink_attention" else "tiled"
    ws = _variant(op_name, op_name + "_warpspec")
    tiled = _variant(op_name, f"{op_name}_{suffix}")
    ws_config, tiled_config = ws.default_config(key, device), tiled.default_config(key, device)
    out, lse = ws.run_forward(args, ws_config["fwd"], keep_lse=True)
    sinks = args.get("sinks")
    rest = {name: value for name, value in args.items() if name not in ("q", "k", "v", "sinks")}

    # Gradients first: the two backward paths on the same out and lse, and SDPA's where it computes
    # the same function (no sinks).
    got_ws = ws.run_backward(q, k, v, sinks, out, lse, dout, rest, ws_config)
    got_tiled = attention_backward(q, k, v, sinks, out, lse, dout, rest, tiled_config)
    pairs = [(a.float(), t.float()) for a, t in zip(got_ws, got_tiled, strict=True) if a is not None]
    print(f"{label}: warpspec vs tiled gradients, max relative error "
          f"{max_relative_error([a for a, _ in pairs], [t for _, t in pairs]):.2e}")
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    gqa = {"enable_gqa": True} if h_q != h_kv else {}
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, **gqa)
    sdpa_grads = torch.autograd.grad(ref, (qt, kt, vt), dout.transpose(1, 2))
    if sinks is None:
        err = max_relative_error([g.float() for g in got_ws[:3]], [g.transpose(1, 2).float() for g in sdpa_grads])
        print(f"{label}: warpspec vs SDPA gradients, max relative error {err:.2e}")

    # Kernel by kernel on the same inputs.
    dout_c, lse_c, delta, lse2, _ = backward_pre(q, sinks, out, lse, dout, rest, ws_config["bwd_pre"])
    # One [s, s, d] product over the causal half, 2 FLOPs a multiply-add: b * h_q * s^2 * d.
    product = b * h_q * s * s * d / 1e9
    gflop = {"dkv": 4 * product, "dq": 3 * product}
    rows = [
        ("pre", _ms(lambda: backward_pre(q, sinks, out, lse, dout, rest, ws_config["bwd_pre"])), None),
        ("dK/dV Gluon", _ms(lambda: warpspec_dkv(q, k, v, dout_c, lse2, delta, args["sm_scale"], True,
                                                 ws_config["bwd_dkv"])), gflop["dkv"]),
        ("dQ Gluon", _ms(lambda: warpspec_dq(q, k, v, dout_c, lse2, delta, args["sm_scale"], True,
                                             ws_config["bwd_dq"])), gflop["dq"]),
        ("dQ tiled (tiled config)", _ms(lambda: attention_backward_dq(q, k, v, dout_c, lse_c, lse2, delta, rest,
                                                                      tiled_config["bwd_dq"])), gflop["dq"]),
        ("backward warpspec", _ms(lambda: ws.run_backward(q, k, v, sinks, out, lse, dout, rest, ws_config)),
         gflop["dkv"] + gflop["dq"]),
        ("backward tiled", _ms(lambda: attention_backward(q, k, v, sinks, out, lse, dout, rest, tiled_config)),
         gflop["dkv"] + gflop["dq"]),
        ("forward warpspec", _ms(lambda: ws.run_forward(args, ws_config["fwd"], keep_lse=True)), None),
    ]
    fwd_sdpa = _ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, **gqa))

    def sdpa_step():
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, **gqa)
        torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2))

    step_sdpa = _ms(sdpa_step)
    rows += [("SDPA forward", fwd_sdpa, None), ("SDPA backward (fwd+bwd - fwd)", step_sdpa - fwd_sdpa, None)]
    print(f"\n{label}: {op_name} b{b} s{s} h{h_q}/{h_kv} d{d} causal bf16 on {torch.cuda.get_device_name()}")
    print("| kernel | ms | TFLOP/s (2 per multiply-add, causal half) |\n| --- | --- | --- |")
    for name, ms, work in rows:
        print(f"| {name} | {ms:.3f} | {_tflops(work, ms) if work else ''} |")
    ours = {name: ms for name, ms, _ in rows}
    total = ours["forward warpspec"] + ours["backward warpspec"]
    print(f"fwd+bwd: warpspec {total:.3f} ms, SDPA {step_sdpa:.3f} ms: {step_sdpa / total:.2f}x SDPA"
          f" (tiled backward: {step_sdpa / (ours['forward warpspec'] + ours['backward tiled']):.2f}x)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(SHAPES), help="one shape")
    opts = parser.parse_args()
    for label in [opts.only] if opts.only else list(SHAPES):
        probe(label)


if __name__ == "__main__":
    main()
