"""What the tuning database takes from the machine it runs on: which database to use when none is
named (`default_url`), and the installed Triton and PyTorch versions a sweep run is stamped with.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path


def default_url() -> str:
    """`KREG_TUNING_DB` (any SQLAlchemy URL), else a SQLite file `kreg/tuning.db` in the user cache dir
    (`$XDG_CACHE_HOME` or `~/.cache`). Nothing is created here: the store makes the folder on its first
    write."""
    url = os.environ.get("KREG_TUNING_DB")
    if url:
        return url
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kreg"
    return f"sqlite:///{cache.resolve() / 'tuning.db'}"


def installed_version(*distributions: str) -> str:
    """Version of the first installed distribution of `distributions`, else 'unknown'."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def installed_triton_version() -> str:
    """Installed Triton version (ROCm machines have it as pytorch-triton-rocm)."""
    return installed_version("triton", "pytorch-triton-rocm", "pytorch-triton")


def installed_torch_version() -> str:
    """Installed PyTorch version."""
    return installed_version("torch")
