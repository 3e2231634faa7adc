"""Non-finite inputs: a NaN reaches exactly the outputs it reaches in the reference (kernels and
references agree, element by element, on every output), garbage past a sequence reaches nothing, and a
non-finite sm_scale is a ValueError in every op."""

from __future__ import annotations

import pytest
import torch

from kreg import registry
from kreg.core.device import detect
from kreg.core.space import INTERPRETER_DTYPE
from kreg.ops import OPS
from kreg.ops.catalog import load_all

from .conftest import HAS_GPU

DEVICE = "cuda" if HAS_GPU else "cpu"
DTYPE = torch.bfloat16 if HAS_GPU else INTERPRETER_DTYPE
VENDOR = detect().vendor if HAS_GPU else "nvidia"
NAN = float("nan")


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("scale", [NAN, float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_sm_scale_is_rejected(name, scale):
    op = OPS[name]
    kw = op.make_inputs(op.presets["tiny"][0], device="cpu", dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="sm_scale: expected a finite float"):
        op.validate(**kw, sm_scale=scale)


def _nan_masks(value) -> list[torch.Tensor]:
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    return [torch.isnan(t.float()).cpu() for t in tensors]


def _check(name: str, kw: dict, expect_nan: bool, skip: tuple[int, ...] = ()) -> None:
    """Kernels (the vendor's variant) and reference put NaN at the same elements of every output but
    those in `skip`; the reference has some NaN exactly when `expect_nan`, so the case tests something."""
    op = OPS[name]
    want = _nan_masks(op.reference(**op.validate(**kw)))
    got = _nan_masks(registry.get(name, vendor=VENDOR)(**kw))
    assert any(bool(m.any()) for m in want) == expect_nan
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i not in skip:
            assert torch.equal(g, w), f"{name} output {i}: NaN at {int(g.sum())} elements, reference {int(w.sum())}"


def _poisoned(t: torch.Tensor, index: tuple) -> torch.Tensor:
    t = t.clone()
    t[index] = NAN
    return t


def test_every_op_with_kernels_is_covered():
    assert sorted(name for name, variants in load_all().items() if variants) == sorted({**CASES, **NO_FLOAT_OUTPUT})


def _dense(name: str, layout: int, preset: int):
    op = OPS[name]
    return {**op.make_inputs(op.layouts(op.presets["tiny"][preset])[layout], device=DEVICE, dtype=DTYPE, seed=3),
            "return_lse": True}


def _decode(preset: int):
    op = OPS["decode"]
    return {**op.make_inputs(op.presets["tiny"][preset], device=DEVICE, dtype=DTYPE, seed=3), "return_lse": True}


def _sparse_mla(preset: int, layout: int = 0):
    op = OPS["sparse_mla"]
    return op.make_inputs(op.layouts(op.presets["tiny"][preset])[layout], device=DEVICE, dtype=DTYPE, seed=3)


def _dense_cases(name: str, cases: tuple[tuple[int, int], ...]):
    for preset, layout in cases:  # layout 0 padded, 1 packed (varlen)
        kw = _dense(name, layout, preset)
        lead = (0,) if kw["q"].dim() == 4 else ()
        # One query element (its row only); a key element at the first and last key (every row that
        # sees it); a value element of key 0 (seen by every row without a window).
        yield {**kw, "q": _poisoned(kw["q"], (*lead, 3, 0, 5))}, True
        yield {**kw, "k": _poisoned(kw["k"], (*lead, 0, 0, 1))}, True
        yield {**kw, "k": _poisoned(kw["k"], (*lead, -1, 0, 1))}, True
        if kw.get("window") is None:
            yield {**kw, "v": _poisoned(kw["v"], (*lead, 0, 0, 1))}, True
        if kw.get("sinks") is not None:  # a NaN sink: its head's out, never lse (the sink is not in it)
            yield {**kw, "sinks": _poisoned(kw["sinks"], (1,))}, True


def _flash_cases():
    return _dense_cases("flash_attention", ((0, 0), (1, 1), (2, 0), (2, 1)))


def _sink_cases():
    return _dense_cases("sink_attention", tuple((i, i % 2) for i in range(len(OPS["sink_attention"].presets["tiny"]))))


def _cache_slot(table: torch.Tensor | None, page: int | None, seq: int, pos: int) -> tuple[int, int]:
    """(cache row, offset) of position `pos` of sequence `seq` in a contiguous or paged cache."""
    if table is None:
        return seq, pos
    return int(table[seq, pos // page]), pos % page


def _decode_cases():
    for preset in range(len(OPS["decode"].presets["tiny"])):
        kw = _decode(preset)
        table, lengths = kw.get("block_table"), kw["cache_seqlens"].tolist()
        page = kw["k_cache"].shape[1] if table is not None else None

        last = _cache_slot(table, page, 0, lengths[0] - 1)  # the newest key of sequence 0
        yield {**kw, "q": _poisoned(kw["q"], (0,) * (kw["q"].dim() - 1) + (2,))}, True
        yield {**kw, "k_cache": _poisoned(kw["k_cache"], (*last, 0, 1))}, True
        yield {**kw, "v_cache": _poisoned(kw["v_cache"], (*last, 0, 1))}, True
        # NaN garbage in every cache slot past each sequence's length (and in unused blocks) reaches nothing.
        k_cache = kw["k_cache"].clone()
        if table is None:
            for seq, length in enumerate(lengths):
                k_cache[seq, length:] = NAN
        else:
            live = {(int(table[s, p // page]), p % page) for s, n in enumerate(lengths) for p in range(n)}
            for block in range(k_cache.shape[0]):
                for offset in range(page):
                    if (block, offset) not in live:
                        k_cache[block, offset] = NAN
        yield {**kw, "k_cache": k_cache, "v_cache": torch.where(torch.isnan(k_cache), NAN, kw["v_cache"])}, False


def _sparse_mla_cases():
    for preset, layout in ((0, 0), (1, 0)):
        kw = _sparse_mla(preset, layout)
        lead = (0,) if kw["q"].dim() == 4 else ()
        # A NaN in q makes every logit of its row NaN; max_logits skips NaN logits (IEEE maxNum, what the
        # GPU's max gives: -inf for that row), but the interpreter's maxNum is numpy's maximum, which
        # propagates NaN, so there only out and lse are compared for it.
        yield {**kw, "q": _poisoned(kw["q"], (*lead, 1, 2, 3))}, True, () if HAS_GPU else (1,)
        # kv row 0 is also what an invalid slot would read if a kernel dereferenced it: only queries
        # that select row 0 may see its NaN (key dims and value dims alike).
        yield {**kw, "kv": _poisoned(kw["kv"], (*lead, 0, 0, 1))}, True, ()
        yield {**kw, "kv": _poisoned(kw["kv"], (*lead, 3, 0, kw["kv"].shape[-1] - 1))}, True, ()


def _gsa_indexer_cases():
    op = OPS["gsa_indexer"]
    for preset in range(len(op.presets["tiny"])):
        kw = op.make_inputs(op.presets["tiny"][preset], device=DEVICE, dtype=DTYPE, seed=3)
        # A query row (its causal scores), a key (its column from its own row on), one head's gate.
        yield {**kw, "q_idx": _poisoned(kw["q_idx"], (0, 5, 1, 2))}, True
        yield {**kw, "k_idx": _poisoned(kw["k_idx"], (0, 3, 1))}, True
        yield {**kw, "w": _poisoned(kw["w"], (0, 6, 0))}, True


def _gsa_sparse_attention_cases():
    op = OPS["gsa_sparse_attention"]
    for preset in range(len(op.presets["tiny"])):
        kw = op.make_inputs(op.presets["tiny"][preset], device=DEVICE, dtype=DTYPE, seed=3)
        # A query row; key row 0 (also what an invalid slot would read if dereferenced). Not a value
        # row: the reference multiplies dense probabilities by every value row, so a NaN value reaches
        # rows that never select it there (a known gap; the head block gathers selected rows only, the
        # dense variant's tiles reach the query blocks whose key range covers it: docs/op-contracts.md).
        yield {**kw, "q": _poisoned(kw["q"], (0, 4, 1, 2))}, True
        yield {**kw, "k": _poisoned(kw["k"], (0, 0, 0, 1))}, True


def _nsa_cases():
    op = OPS["nsa"]
    for preset in range(len(op.presets["tiny"])):
        kw = op.make_inputs(op.presets["tiny"][preset], device=DEVICE, dtype=DTYPE, seed=3)
        # Three poisons that each reach few rows, on different rows, in one call: a query element (its
        # (token, head) in every branch, no other row: its group's selection at that token ignores the
        # NaN importance in the kernel, picks among NaNs in the reference, finite either way); a gate
        # (its own (token, head)); the last key (the last query only: its own block, its window, and the
        # compressed block it completes, if it does).
        local = {"q": _poisoned(kw["q"], (0, 4, 1, 2)), "g_slc": _poisoned(kw["g_slc"], (0, 2, 3)),
                 "k": _poisoned(kw["k"], (0, -1, 0, 1))}
        yield {**kw, **local}, True
        # Key 0: the first compressed block (every query past it) and the own block and window of the
        # first queries, so every row of its kv group. Not a value element: the reference multiplies
        # dense probabilities (0 where not attended) by every value row, so a NaN value reaches rows that
        # never attend it there (the gap gsa_sparse_attention's reference has too).
        yield {**kw, "k": _poisoned(kw["k"], (0, 0, 0, 1))}, True


CASES = {"flash_attention": _flash_cases, "sink_attention": _sink_cases, "decode": _decode_cases,
         "sparse_mla": _sparse_mla_cases, "gsa_indexer": _gsa_indexer_cases,
         "gsa_sparse_attention": _gsa_sparse_attention_cases, "nsa": _nsa_cases}
# Ops with kernels whose outputs cannot hold NaN.
NO_FLOAT_OUTPUT = {"gsa_topk": "int32 indices (NaN scores only change which keys it selects)"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_nan_reaches_what_it_reaches_in_the_reference(name):
    for kw, expect_nan, *skip in CASES[name]():
        _check(name, kw, expect_nan, *skip)
