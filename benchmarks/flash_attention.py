"""flash_attention forward vs torch SDPA at the preset's full shapes, and what registry dispatch adds.

FLOPs: 4 * b * h_q * pairs * d (pairs = allowed query-key pairs), from the op's cost model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import registry
from benchmarks.common import PROVIDER, Measurement, checked, host_overhead_us, measure
from registry.ops import OPS
from tuning.bench import rotating

FAMILY = "flash_attention"
OP = OPS["flash_attention"]


def _shape_name(s: dict) -> str:
    flags = "causal" if s.get("causal") else "full"
    return f"b{s['b']} s{s['s_q']} h{s['h_q']}/{s['h_kv']} d{s['d']} {flags}"


def _sdpa(causal: bool, gqa: bool):
    return lambda qkv: F.scaled_dot_product_attention(*qkv, is_causal=causal, enable_gqa=gqa)


def run(dtype: torch.dtype = torch.bfloat16) -> list[Measurement]:
    handle = registry.get("flash_attention")
    out: list[Measurement] = []
    for shape in OP.presets["full"]:
        sets = [OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=i)) for i in range(2)]
        args = sets[0]
        err = checked(OP, args, lambda a: handle(**a))
        flops = OP.flops(args)
        name = _shape_name(shape)
        out.append(measure("flash_attention fwd", name, PROVIDER, rotating(lambda a: handle(**a), sets), flops,
                           "TFLOP/s", err))
        # SDPA in its own [b, h, s, d] layout; bottom-right causal equals top-left when s_q == s_k.
        sdpa_sets = [tuple(a[n].transpose(1, 2).contiguous() for n in ("q", "k", "v")) for a in sets]
        gqa = shape["h_q"] != shape["h_kv"]
        sdpa = _sdpa(bool(shape.get("causal")), gqa)
        out.append(measure("flash_attention fwd", name, "torch-sdpa", rotating(sdpa, sdpa_sets), flops, "TFLOP/s",
                           None))
    return out


def notes() -> list[str]:
    o = dispatch_overhead()
    return [f"dispatch: registry.get(op)(...) {o['registry_us']:.2f} us/call vs direct launch "
            f"{o['direct_us']:.2f} us/call -> overhead {o['overhead_us']:.2f} us (validation alone "
            f"{o['validate_us']:.2f} us; validation + dispatch without a launch {o['dispatch_no_launch_us']:.2f} us)"]


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
