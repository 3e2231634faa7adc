"""Whether a launcher may keep workspace buffers from one call for the next (decode keeps its split
partials' buffers between eager calls: one allocation a call instead of three).

Not while the current CUDA stream is being captured: the graph keeps the buffers its capture made, and
a replay may run beside eager calls. Nor in a call made from a compiled graph: CUDA-graph trees
(torch.compile's "reduce-overhead") run a graph's first calls with its allocations routed into the
graph's private memory pool, and a buffer kept alive past such a call is a pool tensor the graph does
not own ("Detected 2 tensor(s) in the cudagraph pool not tracked as outputs"). The custom ops' bodies
(registry/library.py) run under `fresh_workspace()`, and launchers ask `keep_workspace(device)` before
keeping anything.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_KEEP = contextvars.ContextVar("kreg_keep_workspace", default=True)


# Whether the current CUDA stream is capturing (absent in a PyTorch without CUDA).
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def keep_workspace(device: torch.device) -> bool:
    """Whether the running call on `device` may keep (and take again) buffers between calls."""
    return _KEEP.get() and not (device.type == "cuda" and (_capturing is None or _capturing()))


@contextlib.contextmanager
def fresh_workspace() -> Iterator[None]:
    """Within it, launchers allocate their workspace on every call and keep none."""
    token = _KEEP.set(False)
    try:
        yield
    finally:
        _KEEP.reset(token)
