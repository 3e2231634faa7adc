"""The three GSA ops' contracts: references against float64 loops, validation, inputs, keys, costs."""

import math

import pytest
import torch

from kreg.ops import contract, gsa_indexer, gsa_sparse_attention, gsa_topk
from kreg.ops.testing import TOLERANCE, assert_close

INDEXER, TOPK, ATTN = gsa_indexer.OP, gsa_topk.OP, gsa_sparse_attention.OP
INVALID = (-1, -7, None, 2**31 - 1)  # None stands for t, the first index past the end


def brute_scores(q_idx, k_idx, w, bias, sm_scale):
    """Indexer scores one (batch, query, key) at a time in float64."""
    q, k, w, bias = q_idx.double(), k_idx.double(), w.double(), bias.double()
    b, t = q.shape[:2]
    scores = torch.full((b, t, t), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for i in range(t):
            for j in range(i + 1):
                gate = torch.sigmoid(w[bi, i])
                scores[bi, i, j] = (gate * torch.sigmoid(sm_scale * (q[bi, i] @ k[bi, j]) + bias)).sum()
    return scores


def brute_attention(q, k, v, indices, sm_scale, topk_length=None):
    """Sparse attention one (batch, query, head) at a time in float64, duplicates counted."""
    q, k, v = q.double(), k.double(), v.double()
    b, t, h_q, _ = q.shape
    h_kv, topk = k.shape[2], indices.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for bi in range(b):
        for i in range(t):
            n = topk if topk_length is None else int(topk_length[bi, i])
            keys = [j for slot, j in enumerate(indices[bi, i].tolist()) if slot < n and 0 <= j < t]
            if not keys:
                continue
            for h in range(h_q):
                g = h // (h_q // h_kv)
                p = torch.softmax(sm_scale * (k[bi, keys, g] @ q[bi, i, h]), 0)
                out[bi, i, h] = p @ v[bi, keys, g]
    return out


def indexer_case(b, t, h_i, d_i, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {
        "q_idx": torch.randn(b, t, h_i, d_i, generator=gen).to(dtype),
        "k_idx": torch.randn(b, t, d_i, generator=gen).to(dtype),
        "w": torch.randn(b, t, h_i, generator=gen).to(dtype),
        "bias": torch.randn(h_i, generator=gen),
    }


def attention_case(b, t, h_q, h_kv, d, topk, *, lengths=False, seed=0, dtype=torch.float32):
    """Random inputs with every kind of invalid index, duplicates and one all-invalid query."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, t, (b, t, topk), generator=gen)
    kinds = torch.tensor([t if v is None else v for v in INVALID])
    bad = torch.rand(idx.shape, generator=gen) < 0.2
    idx = torch.where(bad, kinds[torch.randint(0, len(kinds), idx.shape, generator=gen)], idx)
    if topk > 1:
        idx[..., 1] = idx[..., 0]
    idx[:, -1] = kinds[torch.arange(topk) % len(kinds)]
    args = {
        "q": torch.randn(b, t, h_q, d, generator=gen).to(dtype),
        "k": torch.randn(b, t, h_kv, d, generator=gen).to(dtype),
        "v": torch.randn(b, t, h_kv, d, generator=gen).to(dtype),
        "indices": idx.to(torch.int32),
    }
    if lengths:
        args["topk_length"] = torch.randint(-2, topk + 3, (b, t), generator=gen, dtype=torch.int32)
    return args


# ----------------------------------------------------------------------------- gsa_indexer
@pytest.mark.parametrize("b, t, h_i, d_i", [(2, 37, 4, 16), (1, 1, 1, 8), (1, 17, 3, 5)])
def test_indexer_matches_loop(b, t, h_i, d_i):
    args = gsa_indexer.validate(**indexer_case(b, t, h_i, d_i), sm_scale=0.3)
    scores = gsa_indexer.reference(**args)
    assert scores.dtype == torch.float32 and scores.shape == (b, t, t)
    assert_close(scores, brute_scores(**args), TOLERANCE[torch.float32])
    assert torch.all(scores.isneginf() == torch.ones(t, t, dtype=torch.bool).triu(1))


def test_indexer_half_inputs_and_default_scale():
    args = gsa_indexer.validate(**indexer_case(2, 9, 4, 16, dtype=torch.bfloat16))
    assert args["sm_scale"] == 16**-0.5
    assert_close(gsa_indexer.reference(**args), brute_scores(**args), TOLERANCE[torch.float32])


def test_indexer_chunking_and_noncontiguous(monkeypatch):
    args = indexer_case(2, 13, 4, 8)
    whole = gsa_indexer.reference(**gsa_indexer.validate(**args))
    strided = {**args, "q_idx": torch.stack([args["q_idx"], -args["q_idx"]], 3)[..., 0, :],
               "k_idx": args["k_idx"].transpose(0, 1).contiguous().transpose(0, 1)}
    assert not strided["q_idx"].is_contiguous() and not strided["k_idx"].is_contiguous()
    monkeypatch.setattr(contract, "REFERENCE_CHUNK_ELEMS", 1)
    assert_close(gsa_indexer.reference(**gsa_indexer.validate(**strided)), whole, 1e-6)


# ----------------------------------------------------------------------------- gsa_topk
def check_topk(args):
    """The selected keys' score set equals the brute-force top-n set, slot order aside."""
    v = gsa_topk.validate(**args)
    indices = gsa_topk.reference(**v)
    b, t = args["q_idx"].shape[:2]
    k = args["k"]
    assert indices.dtype == torch.int32 and indices.shape == (b, t, k)
    scores = brute_scores(v["q_idx"], v["k_idx"], v["w"], v["bias"], v["sm_scale"])
    lengths = args.get("topk_length")
    for bi in range(b):
        for i in range(t):
            n = min(k, i + 1, max(int(lengths[bi, i]), 0) if lengths is not None else k)
            row = indices[bi, i].tolist()
            chosen = [j for j in row if j != -1]
            assert len(chosen) == n and row.count(-1) == k - n
            assert len(set(chosen)) == n and all(0 <= j <= i for j in chosen)
            got = scores[bi, i, chosen].sort().values
            want = scores[bi, i, : i + 1].sort().values[i + 1 - n:]
            assert torch.allclose(got, want, rtol=0, atol=1e-5)
    return indices


@pytest.mark.parametrize(
    "b, t, h_i, d_i, k, lengths",
    [(2, 37, 4, 16, 8, False), (1, 17, 2, 8, 40, False), (2, 19, 3, 8, 6, True), (1, 1, 1, 4, 1, False),
     (1, 127, 2, 8, 16, True)],
    ids=["basic", "k_gt_t", "lengths", "t1", "t127"],
)
def test_topk_selects_the_best_scores(b, t, h_i, d_i, k, lengths):
    args = {**indexer_case(b, t, h_i, d_i, seed=t), "k": k}
    if lengths:
        gen = torch.Generator().manual_seed(1)
        args["topk_length"] = torch.randint(-2, k + 3, (b, t), generator=gen, dtype=torch.int32)
    check_topk(args)


def test_topk_half_inputs_and_chunking(monkeypatch):
    args = {**indexer_case(2, 21, 4, 16, dtype=torch.float16), "k": 5}
    whole = check_topk(args)
    monkeypatch.setattr(contract, "REFERENCE_CHUNK_ELEMS", 1)
    assert torch.equal(gsa_topk.reference(**gsa_topk.validate(**args)), whole)


def test_topk_feeds_sparse_attention():
    args = {**indexer_case(2, 23, 4, 16), "k": 6}
    indices = gsa_topk.reference(**gsa_topk.validate(**args))
    attn = attention_case(2, 23, 4, 2, 8, 6)
    v = gsa_sparse_attention.validate(attn["q"], attn["k"], attn["v"], indices)
    assert_close(gsa_sparse_attention.reference(**v), brute_attention(**v), TOLERANCE[torch.float32])


# ----------------------------------------------------------------------------- gsa_sparse_attention
ATTN_CASES = {
    "gqa1": dict(b=2, t=17, h_q=4, h_kv=4, d=16, topk=6),
    "gqa4": dict(b=1, t=37, h_q=8, h_kv=2, d=32, topk=12, lengths=True),
    "gqa8": dict(b=1, t=9, h_q=8, h_kv=1, d=8, topk=5),
    "gqa16": dict(b=1, t=5, h_q=16, h_kv=1, d=8, topk=3),
    "topk_gt_t": dict(b=2, t=7, h_q=2, h_kv=1, d=16, topk=20, lengths=True),
    "t1": dict(b=1, t=1, h_q=2, h_kv=2, d=4, topk=2),
}


@pytest.mark.parametrize("case", ATTN_CASES.values(), ids=ATTN_CASES.keys())
def test_sparse_attention_matches_loop(case):
    v = gsa_sparse_attention.validate(**attention_case(**case))
    out = gsa_sparse_attention.reference(**v)
    assert out.dtype == torch.float32 and out.shape == v["q"].shape
    assert_close(out, brute_attention(**v), TOLERANCE[torch.float32])
    assert torch.all(out[:, -1] == 0)  # the all-invalid query


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sparse_attention_half_inputs(dtype):
    v = gsa_sparse_attention.validate(**attention_case(2, 11, 4, 2, 16, 7, lengths=True, dtype=dtype))
    out = gsa_sparse_attention.reference(**v)
    assert out.dtype == dtype
    assert_close(out, brute_attention(**v), TOLERANCE[dtype])


def test_sparse_attention_duplicates_count():
    case = attention_case(1, 5, 2, 1, 8, 3)
    q, k, v = case["q"], case["k"], case["v"]
    run = lambda idx: gsa_sparse_attention.reference(  # noqa: E731
        **gsa_sparse_attention.validate(q, k, v, torch.tensor(idx, dtype=torch.int32).expand(1, 5, 3)))
    z = q[0, 4] @ k[0, [1, 3], 0].T / math.sqrt(8)
    p = torch.softmax(z + torch.log(torch.tensor([2.0, 1.0])), -1)
    assert torch.allclose(run([1, 3, 1])[0, 4], p @ v[0, [1, 3], 0], atol=1e-6)
    assert torch.allclose(run([2, 2, -1]), run([2, -1, -1]))


def test_sparse_attention_noncontiguous_and_chunking(monkeypatch):
    args = attention_case(2, 10, 4, 2, 8, 5, lengths=True)
    whole = gsa_sparse_attention.reference(**gsa_sparse_attention.validate(**args))
    strided = {**args, "q": torch.stack([args["q"], -args["q"]], 3)[..., 0, :],
               "v": args["v"].transpose(1, 2).contiguous().transpose(1, 2),
               "indices": torch.cat([args["indices"]] * 2, -1)[..., :5]}
    assert not strided["q"].is_contiguous() and not strided["v"].is_contiguous()
    monkeypatch.setattr(contract, "REFERENCE_CHUNK_ELEMS", 1)
    assert_close(gsa_sparse_attention.reference(**gsa_sparse_attention.validate(**strided)), whole, 1e-6)


def test_sparse_attention_gradcheck():
    args = attention_case(2, 5, 4, 2, 3, 4, lengths=True, dtype=torch.float64)
    q, k, v = (args[n].requires_grad_() for n in ("q", "k", "v"))
    f = lambda q, k, v: gsa_sparse_attention.reference(  # noqa: E731
        q, k, v, args["indices"], 0.7, args["topk_length"])
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_sparse_attention_unreferenced_keys_get_no_gradient():
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    k = torch.randn(1, 3, 1, 8, requires_grad=True)
    v = torch.randn(1, 3, 1, 8, requires_grad=True)
    indices = torch.tensor([[[0, -1], [0, 1], [1, 2]]], dtype=torch.int32)
    lengths = torch.tensor([[2, 2, 1]], dtype=torch.int32)  # key 2 only sits past topk_length
    args = gsa_sparse_attention.validate(q, k, v, indices, topk_length=lengths)
    gsa_sparse_attention.reference(**args).sum().backward()
    assert torch.all(k.grad[0, 2] == 0) and torch.all(v.grad[0, 2] == 0)
    assert torch.all(v.grad[0, :2] != 0)


# ----------------------------------------------------------------------------- validation
def _indexer_good():
    return indexer_case(2, 6, 4, 8)


def _topk_good():
    return {**_indexer_good(), "k": 3, "topk_length": torch.ones(2, 6, dtype=torch.int32)}


def _attn_good():
    return attention_case(2, 6, 4, 2, 8, 3, lengths=True)


BATCHED = ("q_idx", "k_idx", "w", "topk_length")
INDEXER_BAD = {
    "q_not_tensor": (lambda a: {**a, "q_idx": 1.0}, TypeError, "^q_idx:"),
    "q_rank": (lambda a: {**a, "q_idx": a["q_idx"][0]}, ValueError, "^q_idx:"),
    "q_int": (lambda a: {**a, "q_idx": a["q_idx"].int(), "k_idx": a["k_idx"].int()}, TypeError, "^q_idx:"),
    "k_dtype": (lambda a: {**a, "k_idx": a["k_idx"].half()}, TypeError, "^k_idx:"),
    "k_shape": (lambda a: {**a, "k_idx": a["k_idx"][:, :5]}, ValueError, "^k_idx:"),
    "k_d": (lambda a: {**a, "k_idx": a["k_idx"][..., :4]}, ValueError, "^k_idx:"),
    "w_shape": (lambda a: {**a, "w": a["w"][..., :3]}, ValueError, "^w:"),
    "w_dtype": (lambda a: {**a, "w": a["w"].int()}, TypeError, "^w:"),
    "bias_shape": (lambda a: {**a, "bias": a["bias"][None]}, ValueError, "^bias:"),
    "bias_device": (lambda a: {**a, "bias": a["bias"].to("meta")}, ValueError, "^bias:"),
    "q_strided": (lambda a: {**a, "q_idx": torch.cat([a["q_idx"]] * 2, -1)[..., ::2]}, ValueError, "^q_idx:"),
    "empty_batch": (lambda a: {n: x[:0] if n in BATCHED else x for n, x in a.items()}, ValueError, "^q_idx:"),
    "sm_scale": (lambda a: {**a, "sm_scale": [0.1]}, TypeError, "^sm_scale:"),
}


@pytest.mark.parametrize("mutate, error, match", INDEXER_BAD.values(), ids=INDEXER_BAD.keys())
def test_indexer_and_topk_validation(mutate, error, match):
    with pytest.raises(error, match=match):
        gsa_indexer.validate(**mutate(_indexer_good()))
    with pytest.raises(error, match=match):  # gsa_topk shares the indexer's checks
        gsa_topk.validate(**mutate(_topk_good()))


TOPK_BAD = {
    "k_zero": (lambda a: {**a, "k": 0}, ValueError, "^k:"),
    "k_float": (lambda a: {**a, "k": 2.0}, ValueError, "^k:"),
    "k_bool": (lambda a: {**a, "k": True}, ValueError, "^k:"),
    "lengths_dtype": (lambda a: {**a, "topk_length": a["topk_length"].long()}, TypeError, "^topk_length:"),
    "lengths_shape": (lambda a: {**a, "topk_length": a["topk_length"][:, :5]}, ValueError, "^topk_length:"),
    "lengths_device": (lambda a: {**a, "topk_length": a["topk_length"].to("meta")}, ValueError,
                       "^topk_length:"),
    "lengths_type": (lambda a: {**a, "topk_length": [1, 2]}, TypeError, "^topk_length:"),
}


@pytest.mark.parametrize("mutate, error, match", TOPK_BAD.values(), ids=TOPK_BAD.keys())
def test_topk_validation(mutate, error, match):
    with pytest.raises(error, match=match):
        gsa_topk.validate(**mutate(_topk_good()))


ATTN_BAD = {
    "q_rank": (lambda a: {**a, "q": a["q"][0]}, ValueError, "^q:"),
    "q_fp64": (lambda a: {**a, **{n: a[n].double() for n in "qkv"}}, TypeError, "^q:"),
    "k_dtype": (lambda a: {**a, "k": a["k"].half()}, TypeError, "^k:"),
    "k_shape": (lambda a: {**a, "k": a["k"][:, :5]}, ValueError, "^k:"),
    "v_shape": (lambda a: {**a, "v": a["v"][..., :4]}, ValueError, "^v:"),
    "gqa": (lambda a: {**a, "k": torch.randn(2, 6, 3, 8), "v": torch.randn(2, 6, 3, 8)}, ValueError, "^k:"),
    "indices_dtype": (lambda a: {**a, "indices": a["indices"].long()}, TypeError, "^indices:"),
    "indices_shape": (lambda a: {**a, "indices": a["indices"][:, :5]}, ValueError, "^indices:"),
    "indices_empty": (lambda a: {**a, "indices": a["indices"][..., :0]}, ValueError, "^indices:"),
    "indices_device": (lambda a: {**a, "indices": a["indices"].to("meta")}, ValueError, "^indices:"),
    "v_strided": (lambda a: {**a, "v": torch.cat([a["v"]] * 2, -1)[..., ::2]}, ValueError, "^v:"),
    "lengths_shape": (lambda a: {**a, "topk_length": a["topk_length"][0]}, ValueError, "^topk_length:"),
    "lengths_dtype": (lambda a: {**a, "topk_length": a["topk_length"].float()}, TypeError, "^topk_length:"),
    "empty_batch": (lambda a: {n: x[:0] for n, x in a.items()}, ValueError, "^q:"),
    "sm_scale": (lambda a: {**a, "sm_scale": "x"}, TypeError, "^sm_scale:"),
}


@pytest.mark.parametrize("mutate, error, match", ATTN_BAD.values(), ids=ATTN_BAD.keys())
def test_sparse_attention_validation(mutate, error, match):
    with pytest.raises(error, match=match):
        gsa_sparse_attention.validate(**mutate(_attn_good()))


def test_validate_resolves_defaults():
    a = _indexer_good()
    assert gsa_indexer.validate(**a) == {**a, "sm_scale": 8**-0.5}
    assert gsa_topk.validate(**a, k=4) == {**a, "sm_scale": 8**-0.5, "k": 4, "topk_length": None}
    b = _attn_good()
    del b["topk_length"]
    assert gsa_sparse_attention.validate(**b) == {**b, "sm_scale": 8**-0.5, "topk_length": None}


# ----------------------------------------------------------------------------- inputs, keys, costs
@pytest.mark.parametrize("op", [INDEXER, TOPK, ATTN], ids=lambda op: op.name)
def test_make_inputs_and_presets(op):
    for shape in op.presets["tiny"]:
        args = op.make_inputs(shape, device="cpu", dtype=torch.bfloat16, seed=2)
        v = op.validate(**args)
        name, first = next(iter(args.items()))
        assert first.abs().sum() > 0
        assert torch.equal(op.make_inputs(shape, device="cpu", dtype=torch.bfloat16, seed=2)[name], first)
        out = op.reference(**v)
        assert out.shape[:2] == (shape["b"], shape["t"])
        assert hash(op.tuning_key(v))
        assert op.flops(v) > 0 and op.bytes_moved(v) > 0
    for shape in op.presets["full"]:
        assert shape["t"] in (4096, 8192, 32768)
        # The top-k keeps twice k positions, so that the gate's queries select among more keys than k.
        t = 4096 if op is TOPK else 2048
        assert op.reduce_shape(shape) == {**shape, "t": t}


def test_sparse_attention_inputs_are_causal_with_fillers_and_duplicates():
    shape = ATTN.presets["tiny"][0]
    idx = ATTN.make_inputs(shape, device="cpu", dtype=torch.float16, seed=0)["indices"]
    t = shape["t"]
    assert (idx >= -1).all() and (idx <= torch.arange(t)[None, :, None]).all() and (idx == -1).any()
    rows = [[j for j in r if j >= 0] for r in idx.reshape(-1, shape["k"]).tolist()]
    assert any(len(r) > len(set(r)) for r in rows)
    with_lengths = ATTN.make_inputs(ATTN.presets["tiny"][1], device="cpu", dtype=torch.float16, seed=0)
    assert with_lengths["topk_length"].dtype == torch.int32


def test_full_presets_match_perf():
    for shape in ATTN.presets["full"]:
        assert (shape["h_q"], shape["h_kv"], shape["d"], shape["k"]) == (16, 16, 128, 2048)
    for shape in INDEXER.presets["full"] + TOPK.presets["full"]:
        assert (shape["h_i"], shape["d_i"]) == (4, 64)
    assert all(shape["k"] == 2048 for shape in TOPK.presets["full"])


def test_tuning_keys_bucket_lengths():
    def keys(t):
        shape = {"b": 2, "t": t, "h_i": 4, "d_i": 16, "k": 8, "h_q": 8, "h_kv": 2, "d": 32}
        return [dict(op.tuning_key(op.validate(**op.make_inputs(shape, device="cpu", dtype=torch.float16,
                                                                 seed=0)))) for op in (INDEXER, TOPK, ATTN)]

    k17, k20, k33 = keys(17), keys(20), keys(33)
    assert k17 == k20 and k33 != k17
    assert k17[0] == {"d_i": 16, "dtype": "fp16", "h_i": 4, "t": 32}
    assert k17[1] == {**k17[0], "k": 8}
    assert k17[2] == {"d": 32, "dtype": "fp16", "h_kv": 2, "h_q": 8, "t": 32, "topk": 8}
    assert k33[2]["t"] == 64
    for op in (INDEXER, TOPK, ATTN):
        args = op.validate(**op.make_inputs(op.presets["tiny"][0], device="cpu", dtype=torch.float16, seed=0))
        names = [n for n, _ in op.tuning_key(args)]
        assert names == sorted(names)


def test_costs():
    a = gsa_indexer.validate(**indexer_case(2, 6, 4, 8))
    assert INDEXER.flops(a) == 2 * 2 * 4 * 21 * 8
    assert INDEXER.bytes_moved(a) == (2 * 6 * 4 * 8 + 2 * 6 * 8 + 2 * 6 * 4 + 4) * 4 + 2 * 6 * 6 * 4
    t = gsa_topk.validate(**a, k=3)
    assert TOPK.flops(t) == INDEXER.flops(a)
    assert TOPK.bytes_moved(t) == INDEXER.bytes_moved(a) - 2 * 6 * 6 * 4 + 2 * 6 * 3 * 4
    s = gsa_sparse_attention.validate(**attention_case(2, 6, 4, 2, 8, 3))
    assert ATTN.flops(s) == 4 * 2 * 4 * 6 * 3 * 8
    gathered = 2 * (2 * 6 * 3 * 2 * 8) * 4
    assert ATTN.bytes_moved(s) == gathered + 2 * 6 * 3 * 4 + 2 * (2 * 6 * 4 * 8 * 4)
    assert ATTN.differentiable and not INDEXER.differentiable and not TOPK.differentiable


def test_topk_selection_error_ignores_order_and_catches_contract_breaks():
    """gsa_topk's Op.error: 0 for the reference's picks in any slot order; infinite for a repeated key,
    a future key, a wrong count or a filler before a pick; for a worse pick, the largest gap between
    the sorted picked scores over the largest picked score."""
    args = gsa_topk.validate(**indexer_case(1, 12, 2, 8, seed=4), k=4)
    want = gsa_topk.reference(**args)
    assert TOPK.error is gsa_topk.selection_error
    assert gsa_topk.selection_error(want.flip(-1).roll(1, 1).flip(-1).roll(-1, 1), want, args) == 0.0
    shuffled = want.clone()
    shuffled[0, 11] = want[0, 11].flip(0)
    assert gsa_topk.selection_error(shuffled, want, args) == 0.0
    breaks = {
        "repeat": (11, 1, want[0, 11, 0]),
        "future": (5, 0, 9),
        "count": (2, 3, 0),  # row 2 holds 3 picks: one more is a wrong count
        "filler_first": (11, 0, -1),
    }
    for name, (row, slot, value) in breaks.items():
        bad = want.clone()
        bad[0, row, slot] = value
        assert gsa_topk.selection_error(bad, want, args) == float("inf"), name
    scores = gsa_indexer.reference(**gsa_indexer.validate(*(args[n] for n in ("q_idx", "k_idx", "w", "bias"))))
    worst = scores[0, 11].argmin().item()
    bad = want.clone()
    bad[0, 11, 0] = worst
    got_sorted = scores[0, 11, bad[0, 11].long()].sort().values
    want_sorted = scores[0, 11, want[0, 11].long()].sort().values
    picked = scores[0].gather(-1, want[0].clamp(min=0).long())[want[0] >= 0]
    expected = (got_sorted - want_sorted).abs().max() / picked.abs().max()
    assert gsa_topk.selection_error(bad, want, args) == pytest.approx(expected.item(), rel=1e-5)
    assert gsa_topk.selection_error(want[..., :3], want, args) == float("inf")
