"""What `registry.get(op)(...)` costs over launching the same variant and config directly, at tiny
(decode-like) shapes where a call is bound by the host: eagerly, and replayed inside a CUDA graph.

Eager rows time host microseconds per call (interleaved repeats of many calls, the GPU drained
between repeats) of four ways to run one call: `registry.get(op)(...)` (the handle's lookup,
validation, two dict lookups, the launcher it keeps); `variant.launch(args, plan)` on arguments
validated once ("direct": what a user who picked the variant and config would call, launching through
Triton's `kernel[grid](...)`); the variant's `bind(plan)` launcher on those arguments ("bound": the
config read out once, Triton's launch); and the launcher the registry keeps for the call's tuning key
("cached": `bind_cached`, whose launches skip Triton's specialization when it matches an earlier
launch, kernels/common/launch.py). registry - cached is what dispatch itself costs; registry - direct
is what a user sees against launching the kernels themselves. Graph rows time a replay of a CUDA graph
of CALLS calls captured through registry and direct: dispatch runs only at capture, so the replays
launch the same kernels. `python -m benchmarks.dispatch` prints the dispatch alone (a stub launcher, no
GPU work) on any device, the interpreter's on a CPU.
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kreg import registry
from kreg.benchmarks.common import PROVIDER, Measurement, checked, host_us
from kreg.ops import OPS
from kreg.registry.dispatch import OpHandle

FAMILY = "dispatch"
# A decode step of one sequence and a short causal prefill: both host-bound on an H100/H200.
SHAPES = {
    "decode": {"b": 1, "s_q": 1, "h_q": 8, "h_kv": 1, "d": 64, "n": 1024, "block_size": None, "sinks": True,
               "window": None},
    "flash_attention": {"b": 1, "s_q": 128, "s_k": 128, "h_q": 2, "h_kv": 2, "d": 64, "causal": True},
}
LABELS = {"decode": "b1 h8/1 d64 n1024 sinks", "flash_attention": "b1 s128 h2 d64 causal"}
CALLS = 100  # calls per CUDA graph
# Rates are calls per second: Measurement.rate is work / ms / 1e9, so work = 1e12 gives 1000 / ms.
CALLS_PER_S = 1e12
_notes: list[str] = []


def _positional(name: str, kw: dict) -> tuple[tuple, dict]:
    """A call spelled as users write it: the required arguments positionally, the rest by keyword."""
    params = inspect.signature(OPS[name].validate).parameters.values()
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    return tuple(kw[n] for n in required), {k: v for k, v in kw.items() if k not in required}


def _quantiles_ms(us: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(us, n=10)
    return q[1] / 1e3, statistics.median(us) / 1e3, q[7] / 1e3


def _graph_us(fn: Callable[[], object]) -> list[float]:
    """Device microseconds per call of a CUDA graph of CALLS calls of `fn`, per replay, 50 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(CALLS):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    out = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / CALLS)
    return out


def stub_dispatch_us(name: str, device: str, dtype: torch.dtype, vendor: str | None = None,
                     iters: int = 20000, repeats: int = 15) -> tuple[float, float]:
    """(validation alone, validation + dispatch with a launcher that does nothing): the fastest of
    `repeats` thread-CPU-time samples of `iters` calls, microseconds per call."""
    op = OPS[name]
    args, kwargs = _positional(name, op.make_inputs(SHAPES[name], device=device, dtype=dtype, seed=0))
    probe = OpHandle(op, vendor, None)
    probe.launcher(*args, **kwargs)
    for launchers in probe._launchers.values():
        for key in launchers:
            launchers[key] = _stub

    def best(fn: Callable[[], object]) -> float:
        for _ in range(1000):
            fn()
        fastest = float("inf")
        for _ in range(repeats):
            start = time.thread_time()
            for _ in range(iters):
                fn()
            fastest = min(fastest, (time.thread_time() - start) / iters * 1e6)
        return fastest

    return best(lambda: op.validate(*args, **kwargs)), best(lambda: probe(*args, **kwargs))


def _stub(args: dict) -> None:
    return None


def run(dtype: torch.dtype = torch.bfloat16) -> list[Measurement]:
    out: list[Measurement] = []
    _notes.clear()
    for name, shape in SHAPES.items():
        op = OPS[name]
        kw = op.make_inputs(shape, device="cuda", dtype=dtype, seed=0)
        args, kwargs = _positional(name, kw)
        handle = registry.get(name)
        validated = op.validate(**kw)
        choice = handle.choice(**kw)
        cached = handle.launcher(**kw)
        paths = {
            "registry": lambda n=name, a=args, k=kwargs: registry.get(n)(*a, **k),
            "direct": lambda c=choice, v=validated: c.variant.launch(v, c.plan),
            "bound": lambda c=choice, v=validated: c.launcher(v),
            "cached": lambda c=cached, v=validated: c(v),
        }
        label = LABELS[name]
        err = checked(op, validated, lambda a, n=name: registry.get(n)(**a))
        host = host_us(paths)
        graph = {path: _graph_us(paths[path]) for path in ("registry", "direct")}
        for path, provider in (("registry", PROVIDER), ("direct", "direct-launch")):
            rel_err = err if path == "registry" else None
            out.append(Measurement(f"dispatch {name} (host)", label, provider, _quantiles_ms(host[path]),
                                   CALLS_PER_S, "calls/s", rel_err))
            out.append(Measurement(f"dispatch {name} (CUDA graph)", label, provider, _quantiles_ms(graph[path]),
                                   CALLS_PER_S, "calls/s", rel_err))
        med = {path: statistics.median(v) for path, v in host.items()}
        graphs = {path: statistics.median(v) for path, v in graph.items()}
        validate_us, dispatch_us = stub_dispatch_us(name, "cuda", dtype)
        _notes.append(
            f"dispatch {name}: registry {med['registry']:.2f} us/call, direct launch {med['direct']:.2f}, bound "
            f"launcher {med['bound']:.2f}, cached launcher {med['cached']:.2f} -> registry adds "
            f"{med['registry'] - med['direct']:+.2f} us over direct ({med['registry'] - med['cached']:+.2f} over "
            f"the cached launcher it runs: the dispatch); alone (stub launcher): validation "
            f"{validate_us:.2f} us, validation + dispatch {dispatch_us:.2f} us; CUDA graph replay "
            f"{graphs['registry']:.2f} vs {graphs['direct']:.2f} us/call "
            f"({graphs['registry'] - graphs['direct']:+.2f})")
    return out


def notes() -> list[str]:
    return list(_notes)


def main() -> int:
    """Print the dispatch alone per op (stub launcher): on the GPU, or through the interpreter on a CPU."""
    if torch.cuda.is_available():
        device, dtype, vendor = "cuda", torch.bfloat16, None
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are first imported
        device, dtype, vendor = "cpu", torch.float16, "nvidia"
    for name in SHAPES:
        validate_us, dispatch_us = stub_dispatch_us(name, device, dtype, vendor)
        print(f"{name:16s} validation {validate_us:.2f} us, validation + dispatch {dispatch_us:.2f} us "
              f"(dispatch {dispatch_us - validate_us:.2f} us) per call on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
