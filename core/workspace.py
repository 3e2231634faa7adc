"""Whether a launcher may keep workspace buffers from one call for the next.

Decode keeps its split partials' buffers between eager calls (one allocation a call instead of three).
A call made from a compiled graph must not: CUDA-graph trees (torch.compile's "reduce-overhead") run a
graph's first calls with its allocations routed into the graph's private memory pool, and a buffer kept
alive past such a call is a pool tensor the graph does not own ("Detected 2 tensor(s) in the cudagraph
pool not tracked as outputs"). The custom ops' bodies (registry/library.py) run under
`fresh_workspace()`, and launchers ask `keep_workspace()` before keeping anything.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_KEEP = contextvars.ContextVar("kreg_keep_workspace", default=True)


def keep_workspace() -> bool:
    """Whether the running call may keep (and take again) buffers between calls."""
    return _KEEP.get()


@contextlib.contextmanager
def fresh_workspace() -> Iterator[None]:
    """Within it, launchers allocate their workspace on every call and keep none."""
    token = _KEEP.set(False)
    try:
        yield
    finally:
        _KEEP.reset(token)
