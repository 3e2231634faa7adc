"""decode (split-KV flash decoding) at the preset's full shapes vs torch SDPA on the same contiguous
cache, plus paged caches, speculative tokens and a window over a long cache.

Bytes: the K and V rows a call reads (`Op.bytes_moved`: every sequence at its cache length here, the
window plus s_q - 1 with a window); the rate is TB/s, against the copy ceiling of the same run. Ours
runs with sinks (the gpt-oss case); SDPA has no sinks. Each call is checked against the reference on a
reduced cache first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kreg import registry
from kreg.benchmarks.common import PROVIDER, Measurement, checked, explore_main, measure
from kreg.ops import OPS

FAMILY = "decode"
OP = OPS["decode"]


def _shapes() -> list[dict]:
    """The target shapes (contiguous and paged at 16 and 64, windows of 128), 4 speculative tokens, a
    window of 4096 over a 128K cache."""
    targets = list(OP.presets["targets"])
    long = {**targets[3], "block_size": None}
    return targets + [{**targets[0], "s_q": 4}, {**long, "window": 4096}]


def _name(s: dict) -> str:
    cache = "contiguous" if s["block_size"] is None else f"paged {s['block_size']}"
    extra = (f" s_q {s['s_q']}" if s["s_q"] > 1 else "") + (f" window {s['window']}" if s["window"] else "")
    return f"b{s['b']} h{s['h_q']}/{s['h_kv']} d{s['d']} n{s['n']} {cache}{extra}"


def run(dtype: torch.dtype = torch.bfloat16) -> list[Measurement]:
    handle = registry.get("decode")
    out: list[Measurement] = []
    for shape in _shapes():
        small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
        err = checked(OP, small, lambda a: handle(**a))
        args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
        name = _name(shape)
        work = OP.bytes_moved(args)
        out.append(measure("decode", name, PROVIDER, lambda a=args: handle(**a), work, "TB/s", err))
        if shape["block_size"] is None and shape["window"] is None:
            # SDPA on the same contiguous cache, [b, h, s, d], one query row per token; no sinks.
            q = args["q"].unsqueeze(1) if args["q"].dim() == 3 else args["q"]
            q, k, v = (t.transpose(1, 2) for t in (q, args["k_cache"], args["v_cache"]))
            causal = q.shape[2] > 1

            def sdpa(q=q, k=k, v=v, causal=causal):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=False) if not causal \
                    else F.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                        attn_mask=_bottom_right(q.shape[2], k.shape[2], q.device))

            out.append(measure("decode", name, "torch-sdpa", sdpa, work, "TB/s", None))
        torch.cuda.empty_cache()
    return out


def _bottom_right(s_q: int, s_k: int, device) -> torch.Tensor:
    """The causal mask of s_q new tokens at the end of s_k keys."""
    rows = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    return torch.arange(s_k, device=device)[None, :] <= rows


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.decode --configs '{"split": [{...}]}' [--shape 0,3]`: explore configs
    (benchmarks.common.explore) at this module's shapes."""
    return explore_main("python -m benchmarks.decode", OP, _shapes(), _name, "TB/s", argv)


if __name__ == "__main__":
    raise SystemExit(main())
