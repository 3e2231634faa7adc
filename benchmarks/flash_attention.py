"""flash_attention forward vs torch SDPA at PERF.md's shapes, and what registry dispatch adds.

FLOPs: 4 * b * h_q * pairs * d (pairs = allowed query-key pairs), from the op's cost model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import registry
from benchmarks.common import Row, checked, host_overhead_us
from registry.device import detect
from registry.ops import OPS
from tuning.bench import rotating, time_gpu

OP = OPS["flash_attention"]


def _shape_name(s: dict) -> str:
    flags = "causal" if s.get("causal") else "full"
    return f"b{s['b']} s{s['s_q']} h{s['h_q']}/{s['h_kv']} d{s['d']} {flags}"


def _sdpa(causal: bool, gqa: bool):
    return lambda qkv: F.scaled_dot_product_attention(*qkv, is_causal=causal, enable_gqa=gqa)


def run(dtype: torch.dtype = torch.bfloat16) -> list[Row]:
    device = detect()
    handle = registry.get("flash_attention")
    rows: list[Row] = []
    for shape in OP.presets["full"]:
        sets = [OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=i)) for i in range(2)]
        args = sets[0]
        err = checked(OP, args, lambda a: handle(**a))
        flops = OP.flops(args)
        ms = time_gpu(rotating(lambda a: handle(**a), sets))
        name = _shape_name(shape)
        rows.append(Row("flash_attention", name, "kreg", ms, flops / ms / 1e9, "TFLOP/s", err, device.name))
        # SDPA in its own [b, h, s, d] layout; bottom-right causal equals top-left when s_q == s_k.
        sdpa_sets = [tuple(a[n].transpose(1, 2).contiguous() for n in ("q", "k", "v")) for a in sets]
        gqa = shape["h_q"] != shape["h_kv"]
        sdpa = _sdpa(bool(shape.get("causal")), gqa)
        peer_ms = time_gpu(rotating(sdpa, sdpa_sets))
        rows.append(Row("flash_attention", name, "torch-sdpa", peer_ms, flops / peer_ms / 1e9, "TFLOP/s", None,
                        device.name))
    return rows


def dispatch_overhead() -> dict[str, float]:
    """Host microseconds per call: registry.get(op)(...) vs the same variant and config launched
    directly, and the parts of the difference (validation alone; the dispatch without a launch)."""
    import time

    args = OP.validate(**OP.make_inputs({"b": 1, "s_q": 128, "s_k": 128, "h_q": 2, "h_kv": 2, "d": 64,
                                         "causal": True}, device="cuda", dtype=torch.bfloat16, seed=0))
    choice = registry.get("flash_attention").choice(**args)
    q, k, v = args["q"], args["k"], args["v"]
    via_registry = lambda: registry.get("flash_attention")(q, k, v, causal=True)
    direct = lambda: choice.variant.launch(args, choice.config)
    ours, theirs = host_overhead_us(via_registry, direct)

    def per_call_us(fn, n: int = 20000) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    validate_us = per_call_us(lambda: OP.validate(q, k, v, causal=True))
    # The dispatch alone: a private handle whose cached launchers do nothing.
    from dataclasses import replace

    from registry.dispatch import OpHandle

    probe = OpHandle(OP, None, None)
    probe(q, k, v, causal=True)
    for _, _, choices in probe._devices.values():
        for raw, cached in list(choices.items()):
            choices[raw] = replace(cached, launcher=lambda a: None)
    no_launch_us = per_call_us(lambda: probe(q, k, v, causal=True))
    return {"registry_us": ours, "direct_us": theirs, "overhead_us": ours - theirs, "validate_us": validate_us,
            "dispatch_no_launch_us": no_launch_us}
