"""Test setup: without a GPU, Triton kernels run in the interpreter (read when kernels are decorated,
so it is set before anything imports them)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA or ROCm GPU")


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests run: the GPU when there is one, else the CPU through the interpreter."""
    return torch.device("cuda" if HAS_GPU else "cpu")


@pytest.fixture(autouse=True)
def _isolated_tuning_db(tmp_path, monkeypatch):
    """Every test gets its own empty tuning database, so no test reads the user's cache."""
    monkeypatch.setenv("KREG_TUNING_DB", f"sqlite:///{tmp_path / 'tuning.db'}")
