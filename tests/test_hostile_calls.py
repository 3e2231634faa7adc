"""Calls a hostile user makes, each once a defect: windows and split counts at the int32 end, 1-D
parameters given as strided views, NaN among the top-k's scores. Both vendors' variants, on the GPU
when there is one, else in the interpreter. The property tests (test_properties.py) draw the classes
these belong to; these pin the cases found."""

from __future__ import annotations

import pytest
import torch

from kreg import registry
from kreg.ops import OPS
from kreg.ops.gsa_topk import selection_error
from kreg.ops.testing import TOLERANCE, assert_close

from .conftest import HAS_GPU

DEVICE = "cuda" if HAS_GPU else "cpu"
VENDORS = [None] if HAS_GPU else ["nvidia", "amd"]  # on a GPU, the GPU's own vendor


def _decode_inputs(s_q: int, length: int):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, s_q, 2, 16, generator=gen).half().to(DEVICE)
    k = torch.randn(1, 32, 1, 16, generator=gen).half().to(DEVICE)
    v = torch.randn(1, 32, 1, 16, generator=gen).half().to(DEVICE)
    return q, k, v, torch.tensor([length], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("num_splits", [None, 1, 2, 3, 2**16, 2**40])
def test_decode_window_and_splits_at_the_int32_end(vendor, num_splits):
    """window 2**31 - 1 with a sequence shorter than s_q - 2 once wrapped the kernel's first key in int32
    (one split: a wrong row; more: reads far outside the cache); a num_splits past the key tiles (or the
    grid's limit) reached the allocator. Both are every key and the device's own split count."""
    q, k, v, lengths = _decode_inputs(s_q=4, length=1)
    call = dict(window=2**31 - 1, num_splits=num_splits, return_lse=True)
    got = registry.get("decode", vendor=vendor)(q, k, v, lengths, **call)
    op = OPS["decode"]
    assert_close(got, op.reference(**op.validate(q, k, v, lengths, **call)), TOLERANCE[torch.float16])


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("op_name", ["decode", "sink_attention"])
def test_strided_sinks_are_refused(vendor, op_name):
    """Kernels read sinks[h] at SINKS + h: a stride-2 view was read as contiguous (relative error up to
    0.5). A broadcast one (stride 0) is refused too; a contiguous copy is accepted."""
    q, k, v, lengths = _decode_inputs(s_q=4, length=20)
    args = (q, k, v, lengths) if op_name == "decode" else (q, k, v)
    call = registry.get(op_name, vendor=vendor)
    wide = torch.randn(2, 2, device=DEVICE)
    for view in (wide[:, 0], wide[:1, 0].expand(2)):
        with pytest.raises(ValueError, match=r"sinks: the last dimension must be contiguous"):
            call(*args, sinks=view)
    op = OPS[op_name]
    sinks = wide[:, 0].contiguous()
    assert_close(call(*args, sinks=sinks), op.reference(**op.validate(*args, sinks=sinks)), TOLERANCE[torch.float16])


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("poison", ["nan k_idx", "nan q_idx", "nan w", "inf k_idx", "-inf bias", "nan everywhere"])
def test_non_finite_scores_keep_the_top_k_contract(vendor, poison):
    """One NaN in k_idx once gave indices outside [0, i] that changed from run to run (slots left
    unwritten). Whatever the scores, every row holds min(k, i + 1) distinct keys in [0, i], then -1."""
    op = OPS["gsa_topk"]
    kw = op.make_inputs(op.presets["tiny"][0], device=DEVICE, dtype=torch.float16, seed=4)
    value, name = poison.split()
    where = {"k_idx": (0, 3, 1), "q_idx": (1, 9, 0, 2), "w": (0, 11, 1), "bias": (2,)}
    if name == "everywhere":
        for target, index in where.items():
            kw[target] = kw[target].clone()
            kw[target][index] = float(value)
    else:
        kw[name] = kw[name].clone()
        kw[name][where[name]] = float(value)
    got = registry.get("gsa_topk", vendor=vendor)(**kw)
    args = op.validate(**kw)
    assert selection_error(got, op.reference(**args), args) <= TOLERANCE[torch.float16]
    again = registry.get("gsa_topk", vendor=vendor)(**kw)
    assert torch.equal(got, again)
