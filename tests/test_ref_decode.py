"""decode contract: contiguous and paged references vs a brute-force loop, validation, presets."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from kreg.ops import decode, sink_attention
from kreg.ops.testing import TOLERANCE, assert_close

from .brute_force import brute_masked_attention

DEC = decode.OP


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def brute_decode(q, keys, values, lens, *, scale, window=None, sinks=None, masked=frozenset()):
    """The brute-force loop over logical cache positions: q [b, s_q, h_q, d]; keys/values
    [b, n, h_kv, d] per sequence; new token t of sequence i sits at lens[i] - s_q + t; `masked` holds
    (seq, pos) pairs whose key is skipped."""
    s_q = q.shape[1]

    def allowed(i, t, j):
        p = lens[i] - s_q + t
        return j < lens[i] and j <= p and (window is None or p - j <= window - 1) and (i, j) not in masked

    return brute_masked_attention(q, keys, values, scale=scale, allowed=allowed, sinks=sinks)


def to_paged(keys, values, block_size, seed):
    """The same logical cache in shuffled blocks of a larger pool (spare blocks hold other data)."""
    b, n, h_kv, d = keys.shape
    max_blocks = n // block_size
    num_blocks = b * max_blocks + 5
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: b * max_blocks]
    table = table.reshape(b, max_blocks)
    k_pool = rand(num_blocks, block_size, h_kv, d, seed=91, dtype=keys.dtype)
    v_pool = rand(num_blocks, block_size, h_kv, d, seed=92, dtype=keys.dtype)
    k_pool[table] = keys.reshape(b, max_blocks, block_size, h_kv, d)
    v_pool[table] = values.reshape(b, max_blocks, block_size, h_kv, d)
    return k_pool, v_pool, table.to(torch.int32)


def make_sinks(kind, h_q):
    if kind is None:
        return None
    if kind == "random":
        return rand(h_q, seed=7) * 2 + 2
    big = 1e4 if kind == "large" else math.inf
    return torch.tensor([big if h % 2 else -big for h in range(h_q)], dtype=torch.float32)


# (id, b, s_q, h_q, h_kv, d, lens, window, sinks)  caches hold 64 positions
CASES = [
    ("single-token", 3, 1, 4, 4, 8, [17, 1, 64], None, None),
    ("gqa8-sinks", 3, 1, 8, 1, 8, [40, 33, 5], None, "random"),
    ("gqa4-window", 2, 1, 8, 2, 8, [40, 3], 7, "random"),
    ("speculative", 3, 3, 4, 2, 8, [20, 64, 3], None, "large"),
    ("speculative-window", 2, 4, 4, 1, 8, [30, 9], 5, "inf"),
    ("shorter-than-queries", 2, 4, 2, 2, 8, [2, 0], None, "inf"),
    ("zero-length", 3, 1, 2, 1, 8, [0, 12, 0], None, "random"),
    ("window1", 2, 2, 2, 2, 8, [17, 40], 1, None),
    ("window-boundary", 2, 1, 2, 2, 8, [17, 40], 40, "random"),
    ("window-larger", 2, 3, 2, 2, 8, [17, 40], 500, None),
]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_contiguous_and_brute_force_agree(case, block_size):
    _, b, s_q, h_q, h_kv, d, lens, window, sinks_kind = case
    n = 64
    keys, values = rand(b, n, h_kv, d, seed=1), rand(b, n, h_kv, d, seed=2)
    q = rand(b, s_q, h_q, d, seed=3)
    q_in = q[:, 0] if s_q == 1 else q  # one new token: the 3-D layout
    sinks = make_sinks(sinks_kind, h_q)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    flat = DEC.reference(**DEC.validate(
        q_in, keys, values, seqlens, sinks=sinks, window=window, return_lse=True
    ))
    k_pool, v_pool, table = to_paged(keys, values, block_size, seed=len(lens) + block_size)
    paged = DEC.reference(**DEC.validate(
        q_in, k_pool, v_pool, seqlens, block_table=table, sinks=sinks, window=window, return_lse=True
    ))
    ref_out, ref_lse = brute_decode(q, keys, values, lens, scale=d**-0.5, window=window, sinks=sinks)
    if s_q == 1:
        ref_out, ref_lse = ref_out[:, 0], ref_lse[..., 0]
    assert flat[0].shape == q_in.shape and flat[1].shape == ref_lse.shape
    assert_close(flat, (ref_out, ref_lse), TOLERANCE[torch.float32])
    assert_close(paged, flat, 1e-6)


def test_zero_length_and_early_queries_are_empty():
    q = rand(3, 4, 2, 8, seed=3)
    k_cache, v_cache = rand(3, 32, 1, 8, seed=1), rand(3, 32, 1, 8, seed=2)
    seqlens = torch.tensor([0, 2, 32], dtype=torch.int32)
    for sink in (math.inf, -math.inf, 3.0):
        out, lse = DEC.reference(**DEC.validate(
            q, k_cache, v_cache, seqlens, sinks=torch.full((2,), sink), return_lse=True
        ))
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isposinf(lse[0]).all()
        # sequence 1 holds 2 keys: of its 4 new tokens the first two sit before every key
        assert torch.equal(out[1, :2], torch.zeros_like(out[1, :2])) and torch.isposinf(lse[1, :, :2]).all()
        assert torch.isfinite(lse[1:, :, 2:]).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("junk", [-1, -7, 2**31 - 1, "num_blocks", "mixed"])
def test_block_table_entries_past_the_sequence_are_never_read(junk):
    b, h_q, h_kv, d, bs = 3, 4, 2, 8, 16
    keys, values = rand(b, 64, h_kv, d, seed=1), rand(b, 64, h_kv, d, seed=2)
    k_pool, v_pool, table = to_paged(keys, values, bs, seed=5)
    q = rand(b, h_q, d, seed=3)
    seqlens = torch.tensor([17, 1, 48], dtype=torch.int32)
    clean = DEC.reference(**DEC.validate(q, k_pool, v_pool, seqlens, block_table=table, return_lse=True))
    dirty = table.clone()
    num_blocks = k_pool.shape[0]
    values_by_kind = {"num_blocks": num_blocks, "mixed": None}
    for i, used in enumerate([2, 1, 3]):
        fill = values_by_kind.get(junk, junk)
        if fill is None:
            dirty[i, used:] = torch.tensor([-1, num_blocks, 2**31 - 1, -7][: 4 - used], dtype=torch.int32)
        else:
            dirty[i, used:] = fill
    out = DEC.reference(**DEC.validate(q, k_pool, v_pool, seqlens, block_table=dirty, return_lse=True))
    assert_close(out, clean, 0.0)


def test_invalid_entry_inside_a_sequence_masks_its_keys():
    b, h_q, h_kv, d, bs = 2, 2, 1, 8, 16
    keys, values = rand(b, 64, h_kv, d, seed=1), rand(b, 64, h_kv, d, seed=2)
    k_pool, v_pool, table = to_paged(keys, values, bs, seed=6)
    table[0, 1] = -1  # positions 16..31 of sequence 0
    table[1, 0] = k_pool.shape[0]  # positions 0..15 of sequence 1
    q = rand(b, 2, h_q, d, seed=3)
    lens = [40, 20]
    out = DEC.reference(**DEC.validate(
        q, k_pool, v_pool, torch.tensor(lens, dtype=torch.int32), block_table=table, return_lse=True
    ))
    masked = {(0, j) for j in range(16, 32)} | {(1, j) for j in range(16)}
    ref = brute_decode(q, keys, values, lens, scale=d**-0.5, masked=masked)
    assert_close(out, ref, TOLERANCE[torch.float32])


def test_lengths_beyond_the_cache_are_clamped():
    q = rand(2, 2, 8, seed=3)
    k_cache, v_cache = rand(2, 20, 2, 8, seed=1), rand(2, 20, 2, 8, seed=2)
    over = DEC.reference(**DEC.validate(q, k_cache, v_cache, torch.tensor([25, -3], dtype=torch.int32)))
    exact = DEC.reference(**DEC.validate(q, k_cache, v_cache, torch.tensor([20, 0], dtype=torch.int32)))
    assert_close(over, exact, 0.0)


def test_decode_equals_sink_attention_on_full_caches():
    """Every sequence at the full cache length: decode is causal bottom-right sink attention."""
    q = rand(2, 3, 8, 16, seed=3)
    k_cache, v_cache = rand(2, 29, 2, 16, seed=1), rand(2, 29, 2, 16, seed=2)
    sinks = make_sinks("random", 8)
    seqlens = torch.full((2,), 29, dtype=torch.int32)
    out = DEC.reference(**DEC.validate(q, k_cache, v_cache, seqlens, sinks=sinks, window=6, return_lse=True))
    ref = sink_attention.OP.reference(**sink_attention.OP.validate(
        q, k_cache, v_cache, sinks=sinks, window=6, return_lse=True
    ))
    assert_close(out, ref, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_paged(dtype):
    b, h_q, h_kv, d = 2, 4, 2, 16
    keys, values = rand(b, 64, h_kv, d, seed=1).to(dtype), rand(b, 64, h_kv, d, seed=2).to(dtype)
    k_pool, v_pool, table = to_paged(keys, values, 64, seed=9)
    q = rand(b, 2, h_q, d, seed=3, dtype=dtype)
    sinks = make_sinks("random", h_q)
    out, lse = DEC.reference(**DEC.validate(
        q, k_pool, v_pool, torch.tensor([50, 9], dtype=torch.int32), block_table=table,
        sinks=sinks, window=20, return_lse=True,
    ))
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref = brute_decode(q, keys, values, [50, 9], scale=d**-0.5, window=20, sinks=sinks)
    assert_close((out, lse), ref, TOLERANCE[dtype])


def test_num_splits_and_strided_caches():
    q = rand(2, 4, 8, seed=3)
    full_k = rand(2, 30, 2, 2, 8, seed=1)  # a [b, n, kv, h_kv, d] buffer: k and v are strided views
    k_cache, v_cache = full_k[:, :, 0], full_k[:, :, 1]
    seqlens = torch.tensor([30, 11], dtype=torch.int32)
    base = DEC.reference(**DEC.validate(q, k_cache, v_cache, seqlens))
    split = DEC.reference(**DEC.validate(q, k_cache, v_cache, seqlens, num_splits=3))
    contiguous = DEC.reference(**DEC.validate(q, k_cache.contiguous(), v_cache.contiguous(), seqlens))
    assert_close(split, base, 0.0)
    assert_close(contiguous, base, 1e-7)


# ----------------------------------------------------------------------------- validation
def _good(paged: bool):
    q = rand(2, 4, 8, seed=3)
    seqlens = torch.tensor([5, 20], dtype=torch.int32)
    if not paged:
        return dict(q=q, k_cache=rand(2, 24, 2, 8), v_cache=rand(2, 24, 2, 8), cache_seqlens=seqlens)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return dict(q=q, k_cache=rand(5, 16, 2, 8), v_cache=rand(5, 16, 2, 8), cache_seqlens=seqlens,
                block_table=table)


BAD = [
    ("q-not-tensor", False, dict(q=[1.0]), TypeError, "q"),
    ("q-rank2", False, dict(q=rand(2, 32)), ValueError, "q"),
    ("q-fp64", False, dict(q=rand(2, 4, 8, dtype=torch.float64)), TypeError, "q"),
    ("q-empty-batch", False, dict(q=rand(0, 4, 8), cache_seqlens=torch.zeros(0, dtype=torch.int32),
                                  k_cache=rand(0, 24, 2, 8), v_cache=rand(0, 24, 2, 8)), ValueError, "q"),
    ("q-last-stride", False, dict(q=rand(2, 4, 16)[..., ::2]), ValueError, "q"),
    ("d-too-big", False, dict(q=rand(2, 4, 300), k_cache=rand(2, 24, 2, 300), v_cache=rand(2, 24, 2, 300)),
     ValueError, "q"),
    ("k-rank3", False, dict(k_cache=rand(2, 24, 16)), ValueError, "k_cache"),
    ("v-shape", False, dict(v_cache=rand(2, 23, 2, 8)), ValueError, "v_cache"),
    ("k-dtype", False, dict(k_cache=rand(2, 24, 2, 8, dtype=torch.float16)), TypeError, "k_cache"),
    ("k-d", False, dict(k_cache=rand(2, 24, 2, 4), v_cache=rand(2, 24, 2, 4)), ValueError, "k_cache"),
    ("k-batch", False, dict(k_cache=rand(3, 24, 2, 8), v_cache=rand(3, 24, 2, 8)), ValueError, "k_cache"),
    ("k-empty", False, dict(k_cache=rand(2, 0, 2, 8), v_cache=rand(2, 0, 2, 8)), ValueError, "k_cache"),
    ("gqa-indivisible", False, dict(k_cache=rand(2, 24, 3, 8), v_cache=rand(2, 24, 3, 8)), ValueError,
     "h_kv"),
    ("v-last-stride", False, dict(v_cache=rand(2, 24, 2, 16)[..., ::2]), ValueError, "v_cache"),
    ("v-device", False, dict(v_cache=torch.empty(2, 24, 2, 8, device="meta")), ValueError, "v_cache"),
    ("seqlens-int64", False, dict(cache_seqlens=torch.tensor([5, 20])), TypeError, "cache_seqlens"),
    ("seqlens-shape", False, dict(cache_seqlens=torch.tensor([5], dtype=torch.int32)), ValueError,
     "cache_seqlens"),
    ("seqlens-device", False, dict(cache_seqlens=torch.empty(2, dtype=torch.int32, device="meta")),
     ValueError, "cache_seqlens"),
    ("table-int64", True, dict(block_table=torch.tensor([[0, 1], [2, 3]])), TypeError, "block_table"),
    ("table-shape", True, dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "block_table"),
    ("table-empty", True, dict(block_table=torch.zeros(2, 0, dtype=torch.int32)), ValueError, "block_table"),
    ("table-list", True, dict(block_table=[[0, 1], [2, 3]]), TypeError, "block_table"),
    ("block-size-24", True, dict(k_cache=rand(5, 24, 2, 8), v_cache=rand(5, 24, 2, 8)), ValueError,
     "block_size"),
    ("block-size-8", True, dict(k_cache=rand(5, 8, 2, 8), v_cache=rand(5, 8, 2, 8)), ValueError,
     "block_size"),
    ("sinks-fp16", False, dict(sinks=torch.zeros(4, dtype=torch.float16)), TypeError, "sinks"),
    ("sinks-shape", False, dict(sinks=torch.zeros(2)), ValueError, "sinks"),
    ("window-zero", False, dict(window=0), ValueError, "window"),
    ("window-float", False, dict(window=4.0), ValueError, "window"),
    ("splits-zero", False, dict(num_splits=0), ValueError, "num_splits"),
    ("splits-bool", False, dict(num_splits=True), ValueError, "num_splits"),
    ("splits-float", False, dict(num_splits=2.0), ValueError, "num_splits"),
    ("return-lse-int", False, dict(return_lse=1), TypeError, "return_lse"),
    ("sm-scale-str", False, dict(sm_scale="x"), TypeError, "sm_scale"),
]


@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_validation_errors(bad):
    _, paged, change, error, name = bad
    with pytest.raises(error, match=name):
        DEC.validate(**{**_good(paged), **change})


def test_validate_returns_every_argument():
    args = DEC.validate(**_good(True))
    assert list(args) == list(inspect.signature(DEC.validate).parameters)
    assert args["sm_scale"] == 8**-0.5 and args["num_splits"] is None
    assert DEC.validate(**_good(False), sm_scale=2)["sm_scale"] == 2.0
    for bs in (16, 32, 64, 128, 256):
        DEC.validate(**{**_good(True), "k_cache": rand(5, bs, 2, 8), "v_cache": rand(5, bs, 2, 8)})


# ----------------------------------------------------------------------------- presets, keys, costs
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_make_inputs_tiny_presets(dtype):
    for shape in DEC.presets["tiny"]:
        kwargs = DEC.make_inputs(shape, device="cpu", dtype=dtype, seed=2)
        args = DEC.validate(**kwargs)
        assert args["q"].abs().sum() > 0 and args["k_cache"].abs().sum() > 0
        assert args["q"].dim() == (3 if shape["s_q"] == 1 else 4)
        lens = args["cache_seqlens"]
        assert lens.max().item() == shape["n"] and (lens >= min(shape["s_q"], shape["n"])).all()
        assert (args["sinks"] is not None) == shape["sinks"] and args["window"] == shape.get("window")
        table = args["block_table"]
        if shape["block_size"] is None:
            assert table is None and args["k_cache"].shape[:2] == (shape["b"], shape["n"])
            continue
        bs = shape["block_size"]
        used = (lens.long() + bs - 1) // bs
        in_use = torch.arange(table.shape[1])[None, :] < used[:, None]
        assert (table[~in_use] == -1).all()
        ids = table[in_use]
        assert ids.unique().numel() == ids.numel()
        assert (ids >= 0).all() and (ids < args["k_cache"].shape[0]).all()
        out = DEC.reference(**args)
        assert out.shape == args["q"].shape and torch.isfinite(out).all()


def test_tuning_key():
    paged = DEC.validate(**_good(True), sinks=torch.zeros(4), window=8)
    assert DEC.tuning_key(paged) == (
        ("b", 2), ("block_size", 16), ("d", 8), ("dtype", "fp32"), ("h_kv", 2), ("h_q", 4), ("n", 32),
        ("paged", True), ("s_q", 1), ("sinks", True), ("window", 8),
    )
    flat = dict(DEC.tuning_key(DEC.validate(**{**_good(False), "q": rand(2, 3, 4, 8)})))
    assert (flat["block_size"], flat["n"], flat["paged"]) == (None, 32, False)
    assert (flat["s_q"], flat["sinks"]) == (3, False)
    # One new token: a 3-D q and a 4-D q with s_q 1 share the key (layouts, not dims).
    one = DEC.validate(**{**_good(True), "q": rand(2, 1, 4, 8)}, sinks=torch.zeros(4), window=8)
    assert DEC.tuning_key(one) == DEC.tuning_key(paged)
    # The batch is bucketed: 3 and 4 sequences pick the same config.
    assert DEC.tuning_key(DEC.validate(**_good(False)))[0] == ("b", 2)
    assert DEC.length_dims == ("b", "n")
    key = DEC.tuning_key(paged)
    assert key == tuple(sorted(key)) and hash(key) is not None


def test_flops_and_bytes():
    args = DEC.validate(**{**_good(False), "q": rand(2, 3, 4, 8, dtype=torch.float16),
                           "k_cache": rand(2, 24, 2, 8, dtype=torch.float16),
                           "v_cache": rand(2, 24, 2, 8, dtype=torch.float16)}, window=5)
    # every sequence at the 24-position capacity; the window reads 5 + 3 - 1 keys
    assert DEC.bytes_moved(args) == 2 * 2 * 2 * 8 * 7 * 2
    assert DEC.flops(args) == 4 * 2 * 4 * 8 * 15  # 3 rows of 5 keys
    paged = DEC.validate(**_good(True))
    assert DEC.bytes_moved(paged) == 2 * 2 * 2 * 8 * 32 * 4
    assert DEC.flops(paged) == 4 * 2 * 4 * 8 * 32


def test_full_presets_and_reduce_shape():
    full, targets = DEC.presets["full"], DEC.presets["targets"]
    assert full[: len(targets)] == targets
    plain = [
        (s["b"], s["h_q"], s["h_kv"], s["d"], s["n"], s["block_size"]) for s in targets if s["window"] is None
    ]
    assert sorted(plain, key=str) == sorted(
        [(b, hq, hk, d, n, bs) for b, hq, hk, d, n in ((8, 64, 8, 64, 32768), (1, 64, 8, 64, 131072),
                                                      (32, 32, 8, 128, 8192)) for bs in (None, 16, 64)],
        key=str,
    )
    assert all(s["sinks"] and s["s_q"] == 1 for s in targets)
    assert {s["b"] for s in full} == {1, 8, 32, 128} and {s["d"] for s in full} == {64, 128}
    assert max(s["b"] * s["n"] for s in full) <= 1 << 21
    for shape in full + DEC.presets["tiny"]:
        small = DEC.reduce_shape(shape)
        assert small["n"] <= 4096 and {**small, "n": shape["n"]} == shape
    assert not DEC.differentiable
