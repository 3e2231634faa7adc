"""What an eager call costs beyond its GPU work: kreg's eager call against SDPA's at the same shapes,
and every op's eager call against the same call replayed in a CUDA graph.

An eager row is the wall time per call of calls made back to back, the GPU drained at the end of each
sample (so a host-bound call shows its host time, a GPU-bound one its GPU time); the graph row replays
CALLS captured calls, which costs no host time per call. eager - graph is what the host adds to a call
as a user sees it (0 when the GPU is the bound). Rows:
- the serving calls of the eager-cost table (dense prefill, decode steps), beside SDPA on the same
  tensors in [b, h, s, d] layout (SDPA's decode: one query, GQA through `enable_gqa`);
- a decode step whose cache is one key longer every call (a generation loop's: every call a new raw
  key of one tuning key), on views of one [1, 16384, 8, 128] cache, beside SDPA on the same views:
  kreg's samples on its second pass over the lengths, with its first pass (where Triton compiles the
  specializations the lengths meet) on its own row;
- each op at the smallest shape of its full preset (the fewest FLOPs), forward only.

    python -m benchmarks.host                      # the table
    python -m benchmarks.host --serving            # its serving rows only (no op's smallest shape)
    python -m benchmarks.host --profile decode     # cProfile of 2000 eager calls of one row's op
    python -m benchmarks.host --stages decode      # where one eager call's host time goes
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import pstats
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kreg import registry
from kreg.benchmarks.common import checked, host_us
from kreg.benchmarks.dispatch import _graph_us, _positional
from kreg.kernels.common.launch import LaunchCache
from kreg.ops import OPS

SERVING = {
    "flash_attention b1 s512 h32 d128 causal": (
        "flash_attention", {"b": 1, "s_q": 512, "s_k": 512, "h_q": 32, "h_kv": 32, "d": 128, "causal": True}),
    "decode b1 n1024 h32/8 d128": (
        "decode", {"b": 1, "s_q": 1, "h_q": 32, "h_kv": 8, "d": 128, "n": 1024, "block_size": None, "sinks": False,
                   "window": None}),
    "decode b1 n4096 h32/8 d128": (
        "decode", {"b": 1, "s_q": 1, "h_q": 32, "h_kv": 8, "d": 128, "n": 4096, "block_size": None, "sinks": False,
                   "window": None}),
}


def _sdpa(name: str, kw: dict) -> Callable[[], torch.Tensor]:
    """SDPA on the same tensors: [b, h, s, d] views of kreg's [b, s, h, d] inputs."""
    if name == "flash_attention":
        q, k, v = (kw[n].transpose(1, 2) for n in ("q", "k", "v"))
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=kw["causal"])
    q = kw["q"].unsqueeze(2)  # [b, h_q, 1, d]
    k, v = kw["k_cache"].transpose(1, 2), kw["v_cache"].transpose(1, 2)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


GROWING = "decode b1 h32/8 d128, cache from n1024 one key longer each call"


# The growing row's samples: GROWING_ITERS calls each, GROWING_REPEATS of them, over one pass of lengths.
GROWING_ITERS, GROWING_REPEATS = 500, 5
GROWING_FIRST = 1024


def _growing(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """kreg's and SDPA's decode calls on one token over a cache view one key longer at every call (from
    1024 keys through the lengths one row's samples take, then from 1024 again; the lengths tensor says
    16384, which decode clamps to the view's keys)."""
    op = OPS["decode"]
    kw = op.make_inputs({"b": 1, "s_q": 1, "h_q": 32, "h_kv": 8, "d": 128, "n": 16384, "block_size": None,
                         "sinks": False, "window": None}, device="cuda", dtype=dtype, seed=0)
    q, k, v = kw["q"], kw["k_cache"], kw["v_cache"]
    kt, vt, q4 = k.transpose(1, 2), v.transpose(1, 2), q.unsqueeze(2)
    handle = registry.get("decode")
    lengths = torch.full((1,), 16384, dtype=torch.int32, device="cuda")  # clamped to each view's n keys
    span = range(GROWING_FIRST, GROWING_FIRST + GROWING_ITERS * GROWING_REPEATS)
    steps = {"kreg": itertools.cycle(span), "sdpa": itertools.cycle(span)}

    def ours() -> object:
        n = next(steps["kreg"])
        return handle(q, k[:, :n], v[:, :n], lengths)

    def sdpa() -> object:
        n = next(steps["sdpa"])
        return F.scaled_dot_product_attention(q4, kt[:, :, :n], vt[:, :, :n], enable_gqa=True)

    return {"kreg": ours, "sdpa": sdpa}


def smallest_full_shape(name: str) -> dict:
    """The shape of the op's full preset with the fewest FLOPs (its flops() on meta tensors)."""
    op = OPS[name]

    def flops(shape: dict) -> float:
        return op.flops(op.validate(**op.make_inputs(shape, device=torch.device("meta"), dtype=torch.bfloat16,
                                                     seed=0)))

    return min(op.presets["full"], key=flops)


def _kreg(name: str, kw: dict) -> Callable[[], object]:
    args, kwargs = _positional(name, kw)
    handle = registry.get(name)
    return lambda: handle(*args, **kwargs)


def wall_us(fns: dict[str, Callable[[], object]], iters: int, repeats: int = 7) -> dict[str, float]:
    """Median wall microseconds per call of calls made back to back (`host_us` with `wall`)."""
    return {name: statistics.median(v) for name, v in host_us(fns, iters, repeats, wall=True).items()}


def rows(dtype: torch.dtype = torch.bfloat16, every_op: bool = True) -> list[str]:
    lines = ["| call | kreg eager us | SDPA eager us | kreg graph us | SDPA graph us | eager / SDPA eager |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, (name, shape) in SERVING.items():
        op = OPS[name]
        kw = op.make_inputs(shape, device="cuda", dtype=dtype, seed=0)
        checked(op, op.validate(**kw), lambda a, n=name: registry.get(n)(**a))
        fns = {"kreg": _kreg(name, kw), "sdpa": _sdpa(name, kw)}
        eager = wall_us(fns, iters=1000)
        graph = {k: statistics.median(_graph_us(fn)) for k, fn in fns.items()}
        lines.append(f"| {label} | {eager['kreg']:.1f} | {eager['sdpa']:.1f} | {graph['kreg']:.1f} | "
                     f"{graph['sdpa']:.1f} | {eager['kreg'] / eager['sdpa']:.2f}x |")
    fns = _growing(dtype)
    # kreg's first pass over the lengths is one sample of its own: each specialization a growing cache
    # makes (the split count, which sizes 16 divides) is compiled, or loaded from Triton's cache, there.
    # Its samples are taken on the second pass, so they time the host and not Triton's compiles. SDPA
    # takes tens of milliseconds a call on these views (its fallback's, not a peer's number), so it is
    # warmed and sampled on few lengths.
    (first_pass,) = host_us({"kreg": fns["kreg"]}, iters=GROWING_ITERS * GROWING_REPEATS, repeats=1, wall=True)["kreg"]
    growing = wall_us({"kreg": fns["kreg"]}, iters=GROWING_ITERS, repeats=GROWING_REPEATS)
    for _ in range(8):
        fns["sdpa"]()
    growing |= wall_us({"sdpa": fns["sdpa"]}, iters=20, repeats=3)
    lines.append(f"| {GROWING} | {growing['kreg']:.1f} | {growing['sdpa']:.1f} | - | - | "
                 f"{growing['kreg'] / growing['sdpa']:.2f}x |")
    last = GROWING_FIRST + GROWING_ITERS * GROWING_REPEATS - 1
    lines.append(f"| the same, kreg's first pass over n {GROWING_FIRST}-{last} (compiles included) | "
                 f"{first_pass:.1f} | - | - | - | - |")
    if not every_op:
        return lines
    lines += ["", "| op at its smallest full-preset shape | variant (config from) | eager us | graph us | "
              "eager - graph |", "| --- | --- | --- | --- | --- |"]
    for name in OPS:
        op = OPS[name]
        shape = smallest_full_shape(name)
        kw = op.make_inputs(shape, device="cuda", dtype=dtype, seed=0)
        checked(op, op.validate(**kw), lambda a, n=name: registry.get(n)(**a))
        fn = _kreg(name, kw)
        eager = wall_us({"kreg": fn}, iters=200)["kreg"]
        graph = statistics.median(_graph_us(fn))
        short = ",".join(f"{k}={v}" for k, v in shape.items() if v not in (None, False))
        # Which launcher ran: host paths differ per variant (a signed launch, or records matched).
        choice = registry.get(name).choice(**kw)
        variant = choice.variant.name if choice.variant is not None else "reference"
        lines.append(f"| {name} {short} | {variant} ({choice.source}) | {eager:.1f} | {graph:.1f} | "
                     f"{eager - graph:+.1f} |")
    return lines


def profile(name: str, dtype: torch.dtype = torch.bfloat16, calls: int = 2000) -> None:
    """cProfile of `calls` eager calls of the op's serving row (or its smallest full shape)."""
    shape = next((s for n, s in SERVING.values() if n == name), None) or smallest_full_shape(name)
    fn = _kreg(name, OPS[name].make_inputs(shape, device="cuda", dtype=dtype, seed=0))
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _launch_caches() -> list[LaunchCache]:
    """Every LaunchCache alive (found through the garbage collector: a benchmark's way in, not a
    kernel's)."""
    return [cache for cache in gc.get_objects() if isinstance(cache, LaunchCache)]


def stages(name: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Host microseconds per eager call of the op's serving row (or its smallest full shape), split:
    the validation alone, the whole call with its kernel launches left out (every launch replaced by a
    no-op at the LaunchCache record it hits: what Python costs), and the whole call; beside one
    torch.empty of the output's size and SDPA's call where the row has one. Host time, not wall time:
    the GPU is not waited for between calls."""
    label, shape = next(((lbl, s) for lbl, (n, s) in SERVING.items() if n == name), (name, None))
    shape = shape or smallest_full_shape(name)
    op = OPS[name]
    kw = op.make_inputs(shape, device="cuda", dtype=dtype, seed=0)
    handle = registry.get(name)
    call = _kreg(name, kw)
    for _ in range(50):
        call()
    out = call()
    out = out[0] if isinstance(out, tuple) else out
    caches = _launch_caches()
    records = [rec for cache in caches for site in cache._sites.values() for rec in site.records]
    runs = [rec.run for rec in records]
    signed = [dict(cache._signed) for cache in caches]  # signed hits launch through the run kept with them
    fns = {"validate": lambda: handle._validate(**kw), "call": call,
           "torch.empty (output)": lambda: torch.empty(out.shape, dtype=out.dtype, device=out.device)}
    if name in ("flash_attention", "decode"):
        fns["SDPA"] = _sdpa(name, kw)
    us = {k: statistics.median(v) for k, v in host_us(fns, iters=2000, repeats=7).items()}
    for rec in records:
        rec.run = lambda stream, grid, args: None
    for cache in caches:
        cache._signed.update({key: (rec, tensors, lambda stream, grid, args: None)
                              for key, (rec, tensors, _) in cache._signed.items()})
    try:
        us["call, launches left out"] = statistics.median(host_us({"x": call}, iters=2000, repeats=7)["x"])
    finally:
        for rec, run in zip(records, runs, strict=True):
            rec.run = run
        for cache, kept in zip(caches, signed, strict=True):
            cache._signed.clear()
            cache._signed.update(kept)
    print(f"{label} ({len(records)} recorded launches)")
    for stage, value in us.items():
        print(f"  {stage:28s} {value:7.1f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host")
    parser.add_argument("--profile", metavar="OP", help="profile one op's eager calls instead of the table")
    parser.add_argument("--stages", metavar="OP", help="split one op's eager host time into its stages")
    parser.add_argument("--serving", action="store_true", help="the serving rows only (they compile in seconds)")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.host times GPU calls: no GPU here", file=sys.stderr)
        return 2
    if opts.profile:
        profile(opts.profile)
        return 0
    if opts.stages:
        stages(opts.stages)
        return 0
    print(f"{torch.cuda.get_device_name()}, bf16, torch {torch.__version__}")
    print("\n".join(rows(every_op=not opts.serving)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
