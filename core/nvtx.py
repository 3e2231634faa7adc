"""NVTX ranges for Nsight Systems and Nsight Compute: `with nvtx_range("gsa/indexer"): ...`.

Kernel launchers and layers mark their steps with these; the ranges show as timeline rows in nsys and as
the kernel's context in ncu. Without CUDA (the CPU, the Triton interpreter) a range is a null context.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

# Read once: a range is on every launch path, so it must cost nothing where there is no profiler target.
_ENABLED = torch.cuda.is_available()


def nvtx_range(name: str) -> AbstractContextManager[None]:
    """A context manager pushing the NVTX range `name` for its body (a no-op without CUDA)."""
    return torch.cuda.nvtx.range(name) if _ENABLED else contextlib.nullcontext()
