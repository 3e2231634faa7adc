"""flash_attention forward vs torch SDPA at the preset's full shapes (what registry dispatch adds at
tiny shapes: benchmarks/dispatch.py).

FLOPs: 4 * b * h_q * pairs * d (pairs = allowed query-key pairs), from the op's cost model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import registry
from benchmarks.common import PROVIDER, Measurement, checked, measure
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
