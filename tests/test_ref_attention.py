"""flash_attention and sink_attention contracts: references vs a brute-force loop, validation, presets."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from kreg.ops import contract, dense_attention, flash_attention, sink_attention
from kreg.ops.testing import TOLERANCE, assert_close

from .brute_force import brute_masked_attention

FA, SA = flash_attention.OP, sink_attention.OP


# ----------------------------------------------------------------------------- brute force
def brute_attention(q, k, v, *, scale, causal, window=None, sinks=None):
    """The brute-force loop with bottom-right causal alignment and the window, as docs/op-contracts.md defines them."""
    s_q, s_k = q.shape[1], k.shape[1]

    def allowed(_b, i, j):
        p = s_k - s_q + i
        return not (causal and j > p) and (window is None or 0 <= p - j <= window - 1)

    return brute_masked_attention(q, k, v, scale=scale, allowed=allowed, sinks=sinks)


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def make_sinks(kind: str | None, h_q: int):
    if kind is None:
        return None
    if kind == "random":
        return rand(h_q, seed=7) * 2 + 1
    big = 1e4 if kind == "large" else math.inf
    return torch.tensor([big if h % 2 else -big for h in range(h_q)], dtype=torch.float32)


# (id, b, s_q, s_k, h_q, h_kv, d, causal, window)
CASES = [
    ("gqa1-noncausal", 2, 17, 17, 2, 2, 16, False, None),
    ("gqa4-causal", 1, 17, 17, 8, 2, 8, True, None),
    ("gqa8-len1", 2, 1, 1, 8, 1, 8, True, None),
    ("gqa16", 1, 5, 9, 16, 1, 4, True, None),
    ("sq<sk-causal", 2, 5, 23, 4, 1, 8, True, None),
    ("sq>sk-causal", 1, 23, 5, 4, 2, 8, True, None),
    ("sq>sk-noncausal", 1, 9, 4, 2, 1, 8, False, None),
    ("sq<sk-noncausal", 1, 4, 19, 2, 2, 8, False, None),
    ("window1", 1, 17, 17, 4, 4, 8, True, 1),
    ("window7-sq<sk", 2, 6, 20, 2, 1, 8, True, 7),
    ("window-boundary", 1, 17, 17, 2, 1, 8, True, 17),
    ("window-larger", 1, 13, 13, 2, 2, 8, True, 100),
    ("window-sq>sk", 1, 20, 6, 2, 2, 8, True, 3),
]


def case_inputs(b, s_q, s_k, h_q, h_kv, d, dtype=torch.float32):
    return rand(b, s_q, h_q, d, dtype=dtype, seed=1), rand(b, s_k, h_kv, d, dtype=dtype, seed=2), \
        rand(b, s_k, h_kv, d, dtype=dtype, seed=3)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_matches_brute_force(case):
    _, b, s_q, s_k, h_q, h_kv, d, causal, window = case
    q, k, v = case_inputs(b, s_q, s_k, h_q, h_kv, d)
    args = FA.validate(q, k, v, causal=causal, window=window, return_lse=True)
    out, lse = FA.reference(**args)
    ref_out, ref_lse = brute_attention(q, k, v, scale=d**-0.5, causal=causal, window=window)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert lse.shape == (b, h_q, s_q)
    assert_close((out, lse), (ref_out, ref_lse), TOLERANCE[torch.float32])


@pytest.mark.parametrize("sinks_kind", ["random", "large", "inf"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sink_matches_brute_force(case, sinks_kind):
    _, b, s_q, s_k, h_q, h_kv, d, causal, window = case
    q, k, v = case_inputs(b, s_q, s_k, h_q, h_kv, d)
    sinks = make_sinks(sinks_kind, h_q)
    args = SA.validate(q, k, v, sinks=sinks, window=window, causal=causal, return_lse=True)
    out, lse = SA.reference(**args)
    ref_out, ref_lse = brute_attention(q, k, v, scale=d**-0.5, causal=causal, window=window, sinks=sinks)
    assert_close((out, lse), (ref_out, ref_lse), TOLERANCE[torch.float32])


def test_sink_extremes_and_lse_without_sink():
    q, k, v = case_inputs(2, 9, 9, 4, 2, 8)
    sinks = torch.tensor([math.inf, -math.inf, 1e4, -1e4])
    out, lse = SA.reference(**SA.validate(q, k, v, sinks=sinks, return_lse=True))
    plain, plain_lse = FA.reference(**FA.validate(q, k, v, causal=True, return_lse=True))
    assert torch.equal(lse, plain_lse), "the sink must never enter lse"
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))  # +inf sink takes everything
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))  # 1e4 sink: sigmoid underflows to 0
    assert_close(out[:, :, 1], plain[:, :, 1], 1e-7)  # -inf sink takes nothing
    assert_close(out[:, :, 3], plain[:, :, 3], 1e-7)


@pytest.mark.parametrize("sink_value", [math.inf, -math.inf, 1e4, -1e4, 0.5])
def test_empty_rows_give_zero_and_inf_lse(sink_value):
    # causal with s_q > s_k: the first s_q - s_k queries sit before every key.
    q, k, v = case_inputs(2, 11, 4, 4, 2, 8)
    sinks = torch.full((4,), sink_value)
    out, lse = SA.reference(**SA.validate(q, k, v, sinks=sinks, return_lse=True))
    assert torch.equal(out[:, :7], torch.zeros_like(out[:, :7]))
    assert torch.isinf(lse[:, :, :7]).all() and (lse[:, :, :7] > 0).all()
    assert torch.isfinite(lse[:, :, 7:]).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    q, k, v = case_inputs(2, 19, 27, 4, 2, 16, dtype=dtype)
    sinks = make_sinks("random", 4)
    out, lse = SA.reference(**SA.validate(q, k, v, sinks=sinks, window=9, return_lse=True))
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = brute_attention(q, k, v, scale=16**-0.5, causal=True, window=9, sinks=sinks)
    assert_close((out, lse), (ref_out, ref_lse), TOLERANCE[dtype])


def test_custom_sm_scale():
    q, k, v = case_inputs(1, 7, 7, 2, 2, 8)
    args = FA.validate(q, k, v, sm_scale=1)
    assert args["sm_scale"] == 1.0 and isinstance(args["sm_scale"], float)
    ref_out, _ = brute_attention(q, k, v, scale=1.0, causal=False)
    assert_close(FA.reference(**args), ref_out, TOLERANCE[torch.float32])


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5)])
def test_chunking_is_invisible(monkeypatch, causal, window):
    """Tiny query chunks (with their narrowed key ranges) give the same result as one chunk."""
    q, k, v = case_inputs(2, 21, 30, 4, 1, 8)
    sinks = make_sinks("random", 4)
    args = SA.validate(q, k, v, sinks=sinks, causal=causal, window=window, return_lse=True)
    whole = SA.reference(**args)
    # 3 query rows a chunk: 2 temporaries of b * h_q * s_k = 2 * 4 * 30 elements per row.
    monkeypatch.setattr(contract, "REFERENCE_CHUNK_ELEMS", 2 * (2 * 4 * 30) * 3)
    assert_close(SA.reference(**args), whole, 1e-6)


# ----------------------------------------------------------------------------- varlen
def _pack(lengths, h, d, seed):
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return rand(total, h, d, seed=seed), cu


@pytest.mark.parametrize("op", [FA, SA], ids=["flash", "sink"])
def test_varlen_matches_each_sequence_alone(op):
    lens_q, lens_k = [5, 0, 17, 1, 3, 6], [9, 3, 17, 1, 0, 2]
    h_q, h_kv, d = 4, 2, 8
    q, cu_q = _pack(lens_q, h_q, d, 1)
    k, cu_k = _pack(lens_k, h_kv, d, 2)
    v, _ = _pack(lens_k, h_kv, d, 3)
    extra = {"sinks": make_sinks("random", h_q)} if op is SA else {}
    args = op.validate(
        q, k, v, causal=True, window=6, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=17, max_seqlen_k=17, **extra,
    )
    out, lse = op.reference(**args)
    assert out.shape == q.shape and lse.shape == (h_q, q.shape[0])
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        if q1 == q0:
            continue
        ref_out, ref_lse = brute_attention(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale=d**-0.5, causal=True, window=6,
            sinks=extra.get("sinks"),
        )
        assert_close((out[q0:q1], lse[:, q0:q1]), (ref_out[0], ref_lse[0]), TOLERANCE[torch.float32])


def test_varlen_equals_padded_batch():
    """Equal-length packed sequences give exactly the batched computation."""
    q, k, v = case_inputs(3, 8, 13, 4, 2, 16)
    sinks = make_sinks("random", 4)
    cu_q = torch.tensor([0, 8, 16, 24], dtype=torch.int32)
    cu_k = torch.tensor([0, 13, 26, 39], dtype=torch.int32)
    packed = SA.reference(**SA.validate(
        q.reshape(24, 4, 16), k.reshape(39, 2, 16), v.reshape(39, 2, 16), sinks=sinks, window=4,
        return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=8, max_seqlen_k=13,
    ))
    out, lse = SA.reference(**SA.validate(q, k, v, sinks=sinks, window=4, return_lse=True))
    assert_close(packed, (out.reshape(24, 4, 16), lse.permute(1, 0, 2).reshape(4, 24)), 1e-6)


def test_varlen_rows_outside_sequences():
    q, k, v = rand(10, 2, 8, seed=1), rand(6, 2, 8, seed=2), rand(6, 2, 8, seed=3)
    cu_q = torch.tensor([2, 5, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 6], dtype=torch.int32)
    out, lse = FA.reference(**FA.validate(
        q, k, v, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=3
    ))
    outside = torch.tensor([0, 1, 7, 8, 9])
    assert torch.equal(out[outside], torch.zeros_like(out[outside]))
    assert torch.isinf(lse[:, outside]).all()
    ref_out, _ = brute_attention(q[None, 2:5], k[None, :3], v[None, :3], scale=8**-0.5, causal=False)
    assert_close(out[2:5], ref_out[0], TOLERANCE[torch.float32])


def test_varlen_reference_checks_offsets():
    q, k, v = rand(6, 2, 8), rand(6, 2, 8), rand(6, 2, 8)
    good = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        FA.reference(**FA.validate(
            q, k, v, cu_seqlens_q=good, cu_seqlens_k=good, max_seqlen_q=3, max_seqlen_k=4
        ))
    bad = torch.tensor([0, 4, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        FA.reference(**FA.validate(
            q, k, v, cu_seqlens_q=bad, cu_seqlens_k=good, max_seqlen_q=6, max_seqlen_k=6
        ))
    past_end = torch.tensor([0, 2, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        FA.reference(**FA.validate(
            q, k, v, cu_seqlens_q=good, cu_seqlens_k=past_end, max_seqlen_q=6, max_seqlen_k=6
        ))


# ----------------------------------------------------------------------------- autograd
def test_gradcheck_fp64_with_sinks_window_and_empty_rows():
    # s_q > s_k with causal leaves empty rows; the window leaves partial ones. fp64 goes straight to
    # the reference (validate accepts fp16/bf16/fp32 only).
    q = rand(1, 6, 4, 3, dtype=torch.float64, seed=1).requires_grad_()
    k = rand(1, 4, 2, 3, dtype=torch.float64, seed=2).requires_grad_()
    v = rand(1, 4, 2, 3, dtype=torch.float64, seed=3).requires_grad_()
    sinks = rand(4, dtype=torch.float64, seed=4).requires_grad_()

    def fn(q, k, v, sinks):
        out, lse = sink_attention.reference(q, k, v, sinks=sinks, window=3, return_lse=True)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_gradcheck_fp64_flash_noncausal_gqa():
    q = rand(2, 3, 4, 5, dtype=torch.float64, seed=1).requires_grad_()
    k = rand(2, 4, 1, 5, dtype=torch.float64, seed=2).requires_grad_()
    v = rand(2, 4, 1, 5, dtype=torch.float64, seed=3).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention.reference(q, k, v), (q, k, v))


def test_sinks_gradient_matches_spec_formula():
    """d sinks[h] = -sum_{b,i} exp(sinks[h] - lse_tot) * Delta, lse_tot = logaddexp(lse, sinks[h])."""
    q, k, v = case_inputs(2, 13, 9, 4, 2, 8)
    sinks = make_sinks("random", 4).requires_grad_()
    out, lse = SA.reference(**SA.validate(q, k, v, sinks=sinks, window=5, return_lse=True))
    d_out = rand(*out.shape, seed=11)
    (grad,) = torch.autograd.grad((out * d_out).sum(), sinks)
    delta = (d_out * out.detach()).sum(-1).permute(0, 2, 1)  # [b, h_q, s_q]
    s = sinks.detach()[None, :, None]
    lse_tot = torch.logaddexp(lse.detach(), s)
    formula = -(torch.exp(s - lse_tot) * delta).sum(dim=(0, 2))
    assert_close(grad, formula, 1e-5)


@pytest.mark.parametrize("sink_value", [math.inf, -math.inf, 2.0])
def test_empty_rows_have_zero_finite_gradients(sink_value):
    q = rand(1, 9, 2, 8, seed=1).requires_grad_()
    k = rand(1, 4, 2, 8, seed=2).requires_grad_()
    v = rand(1, 4, 2, 8, seed=3).requires_grad_()
    sinks = torch.full((2,), sink_value).requires_grad_()
    out = SA.reference(**SA.validate(q, k, v, sinks=sinks))
    out.backward(rand(*out.shape, seed=4))
    for t in (q, k, v, sinks):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :5], torch.zeros_like(q.grad[:, :5]))
    if sink_value != math.inf:
        assert q.grad[:, 5:].abs().sum() > 0 and k.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- layouts and validation
def test_strided_views_accepted():
    qkv = rand(2, 11, 3, 4, 8, seed=1)  # packed QKV: q and v are strided views, last dim contiguous
    q, v = qkv[:, :, 0], qkv[:, :, 2]
    k_t = rand(2, 4, 11, 8, seed=2).transpose(1, 2)  # [b, h, s, d] storage seen as [b, s, h, d]
    out = FA.reference(**FA.validate(q, k_t, v, causal=True))
    ref = FA.reference(**FA.validate(q.contiguous(), k_t.contiguous(), v.contiguous(), causal=True))
    assert_close(out, ref, 1e-7)
    assert out.is_contiguous() and out.shape == q.shape
    # varlen views of a packed tensor
    packed = rand(11, 3, 4, 8, seed=3)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    FA.validate(packed[:, 0], packed[:, 1], packed[:, 2], cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=7, max_seqlen_k=7)


def _good():
    q, k, v = case_inputs(2, 5, 6, 4, 2, 8)
    return dict(q=q, k=k, v=v, causal=True)


BAD = [
    ("q-not-tensor", dict(q=[[1.0]]), TypeError, "q"),
    ("q-rank3-no-cu", dict(q=rand(5, 4, 8)), ValueError, "q"),
    ("k-batch", dict(k=rand(3, 6, 2, 8), v=rand(3, 6, 2, 8)), ValueError, "k"),
    ("v-shape", dict(v=rand(2, 7, 2, 8)), ValueError, "v"),
    ("fp64", dict(q=rand(2, 5, 4, 8, dtype=torch.float64)), TypeError, "q"),
    ("int-q", dict(q=torch.ones(2, 5, 4, 8, dtype=torch.int32)), TypeError, "q"),
    ("k-dtype", dict(k=rand(2, 6, 2, 8, dtype=torch.float16)), TypeError, "k"),
    ("d-mismatch", dict(k=rand(2, 6, 2, 4), v=rand(2, 6, 2, 4)), ValueError, "k"),
    ("d-too-big", dict(q=rand(1, 2, 1, 264), k=rand(1, 2, 1, 264), v=rand(1, 2, 1, 264)), ValueError, "q"),
    ("gqa-indivisible", dict(k=rand(2, 6, 3, 8), v=rand(2, 6, 3, 8)), ValueError, "h_kv"),
    ("q-last-stride", dict(q=rand(2, 5, 4, 16)[..., ::2]), ValueError, "q"),
    ("v-last-stride", dict(v=rand(2, 6, 8, 2).transpose(-1, -2)), ValueError, "v"),
    ("k-device", dict(k=torch.empty(2, 6, 2, 8, device="meta")), ValueError, "k"),
    ("empty-batch", dict(q=rand(0, 5, 4, 8), k=rand(0, 6, 2, 8), v=rand(0, 6, 2, 8)), ValueError, "q"),
    ("empty-keys", dict(k=rand(2, 0, 2, 8), v=rand(2, 0, 2, 8)), ValueError, "k"),
    ("causal-int", dict(causal=1), TypeError, "causal"),
    ("return-lse-str", dict(return_lse="yes"), TypeError, "return_lse"),
    ("window-noncausal", dict(window=4, causal=False), ValueError, "window"),
    ("window-zero", dict(window=0), ValueError, "window"),
    ("window-bool", dict(window=True), ValueError, "window"),
    ("window-beyond-int32", dict(window=2**31), ValueError, "window"),
    ("deterministic-int", dict(deterministic=1), TypeError, "deterministic"),
    ("sm-scale-str", dict(sm_scale="0.1"), TypeError, "sm_scale"),
]


@pytest.mark.parametrize("op", [FA, SA], ids=["flash", "sink"])
@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_validation_errors(op, bad):
    _, change, error, name = bad
    with pytest.raises(error, match=name):
        op.validate(**{**_good(), **change})


@pytest.mark.parametrize(
    "sinks,error",
    [
        (torch.zeros(4, dtype=torch.float16), TypeError),
        (torch.zeros(2), ValueError),
        (torch.zeros(1, 4), ValueError),
        ([0.0] * 4, TypeError),
        (torch.zeros(4, device="meta"), ValueError),
    ],
    ids=["fp16", "wrong-heads", "rank2", "list", "device"],
)
def test_sinks_validation(sinks, error):
    with pytest.raises(error, match="sinks"):
        SA.validate(**_good(), sinks=sinks)


def _varlen_good():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return dict(q=rand(7, 4, 8), k=rand(7, 2, 8), v=rand(7, 2, 8), cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=4, max_seqlen_k=4)


VARLEN_BAD = [
    ("no-max-q", dict(max_seqlen_q=None), ValueError, "max_seqlen_q"),
    ("no-max-k", dict(max_seqlen_k=None), ValueError, "max_seqlen_k"),
    ("max-zero", dict(max_seqlen_k=0), ValueError, "max_seqlen_k"),
    ("only-cu-q", dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k"),
    ("cu-int64", dict(cu_seqlens_q=torch.tensor([0, 3, 7])), TypeError, "cu_seqlens_q"),
    ("cu-rank2", dict(cu_seqlens_q=torch.zeros(1, 3, dtype=torch.int32)), ValueError, "cu_seqlens_q"),
    ("cu-one-entry", dict(cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
                          cu_seqlens_k=torch.zeros(1, dtype=torch.int32)), ValueError, "cu_seqlens_q"),
    ("cu-lengths", dict(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "cu_seqlens_k"),
    ("q-4d", dict(q=rand(1, 7, 4, 8)), ValueError, "q"),
    ("k-4d", dict(k=rand(1, 7, 2, 8), v=rand(1, 7, 2, 8)), ValueError, "k"),
    ("empty-total", dict(q=rand(0, 4, 8)), ValueError, "q"),
    ("max-q-past-rows", dict(max_seqlen_q=8), ValueError, "max_seqlen_q"),
    ("max-k-past-rows", dict(max_seqlen_k=8), ValueError, "max_seqlen_k"),
]


@pytest.mark.parametrize("op", [FA, SA], ids=["flash", "sink"])
@pytest.mark.parametrize("bad", VARLEN_BAD, ids=[b[0] for b in VARLEN_BAD])
def test_varlen_validation_errors(op, bad):
    _, change, error, name = bad
    with pytest.raises(error, match=name):
        op.validate(**{**_varlen_good(), **change})


@pytest.mark.parametrize("op", [FA, SA], ids=["flash", "sink"])
def test_validate_returns_every_argument(op):
    args = op.validate(**_good())
    assert list(args) == list(inspect.signature(op.validate).parameters)
    assert args["sm_scale"] == 8**-0.5
    assert (args["causal"], args["window"], args["return_lse"], args["deterministic"]) == (True, None, False, False)
    assert op.validate(**_good(), window=2**31 - 1, deterministic=True)["deterministic"] is True


def test_defaults():
    q, k, v = case_inputs(1, 3, 3, 2, 2, 8)
    assert FA.validate(q, k, v)["causal"] is False
    assert SA.validate(q, k, v)["causal"] is True


# ----------------------------------------------------------------------------- presets, keys, costs
@pytest.mark.parametrize("op", [FA, SA], ids=["flash", "sink"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_make_inputs_tiny_presets(op, dtype):
    for shape in op.presets["tiny"]:
        kwargs = op.make_inputs(shape, device="cpu", dtype=dtype, seed=3)
        args = op.validate(**kwargs)
        assert args["q"].dtype == dtype and args["q"].abs().sum() > 0 and args["v"].abs().sum() > 0
        assert (args["causal"], args["window"]) == (shape["causal"], shape.get("window"))
        assert args["q"].shape == (shape["b"], shape["s_q"], shape["h_q"], shape["d"])
        assert args["k"].shape == (shape["b"], shape["s_k"], shape["h_kv"], shape["d"])
        assert (op is SA) == ("sinks" in kwargs)
        again = op.make_inputs(shape, device="cpu", dtype=dtype, seed=3)
        assert torch.equal(kwargs["q"], again["q"])
        assert not torch.equal(kwargs["q"], op.make_inputs(shape, device="cpu", dtype=dtype, seed=4)["q"])


def test_make_inputs_varlen():
    shape = {**SA.presets["tiny"][2], "varlen": True, "b": 4}
    args = SA.validate(**SA.make_inputs(shape, device="cpu", dtype=torch.float16, seed=0))
    lens_q = args["cu_seqlens_q"].diff()
    assert args["q"].dim() == 3 and lens_q.max().item() == shape["s_q"] == args["max_seqlen_q"]
    out = SA.reference(**args)
    assert out.shape == args["q"].shape and torch.isfinite(out).all()


def test_tuning_key():
    q, k, v = case_inputs(2, 37, 100, 4, 2, 64, dtype=torch.bfloat16)
    key = FA.tuning_key(FA.validate(q, k, v, causal=True, window=16))
    assert key == (
        ("causal", True), ("d", 64), ("dtype", "bf16"), ("h_kv", 2), ("h_q", 4),
        ("s_k", 128), ("s_q", 64), ("window", 16),
    )
    assert key == tuple(sorted(key)) and hash(key) is not None
    q2, k2, v2 = case_inputs(2, 60, 127, 4, 2, 64, dtype=torch.bfloat16)
    assert FA.tuning_key(FA.validate(q2, k2, v2, causal=True, window=16)) == key
    sink_key = SA.tuning_key(SA.validate(q, k, v, sinks=torch.zeros(4), window=16))
    assert sink_key == tuple(sorted(key + (("sinks", True),)))
    assert dict(SA.tuning_key(SA.validate(q, k, v, window=16)))["sinks"] is False
    args = {**_varlen_good(), "q": rand(40, 4, 8), "k": rand(300, 2, 8), "v": rand(300, 2, 8)}
    args["max_seqlen_q"], args["max_seqlen_k"] = 40, 300
    vkey = dict(FA.tuning_key(FA.validate(**args)))
    # Packed varlen keys by max_seqlen and shares the padded layout's key (no layout dim).
    assert (vkey["s_q"], vkey["s_k"], vkey["dtype"], "varlen" in vkey) == (64, 512, "fp32", False)


def _count_pairs(s_q, s_k, causal, window):
    count = 0
    for i in range(s_q):
        p = s_k - s_q + i
        for j in range(s_k):
            if window is not None:
                count += 0 <= p - j <= window - 1
            else:
                count += (not causal) or j <= p
    return count


@pytest.mark.parametrize("s_q,s_k", [(1, 1), (17, 17), (5, 23), (23, 5), (64, 100), (100, 64)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 1), (True, 7), (True, 300)])
def test_allowed_pairs_closed_form(s_q, s_k, causal, window):
    assert dense_attention.allowed_pairs(s_q, s_k, causal, window) == _count_pairs(s_q, s_k, causal, window)


def test_flops_and_bytes():
    q, k, v = case_inputs(2, 23, 30, 4, 2, 16, dtype=torch.float16)
    args = SA.validate(q, k, v, sinks=torch.zeros(4), window=7, return_lse=True)
    assert SA.flops(args) == 4 * 2 * 4 * 16 * _count_pairs(23, 30, True, 7)
    expected = (2 * q.numel() + k.numel() + v.numel()) * 2 + 4 * 2 * 4 * 23 + 4 * 4
    assert SA.bytes_moved(args) == expected
    # varlen: every sequence counted at (max_seqlen_q, max_seqlen_k), an upper bound
    lens_q, lens_k = [3, 4], [5, 2]
    qv, cu_q = _pack(lens_q, 4, 16, 1)
    kv, cu_k = _pack(lens_k, 2, 16, 2)
    vargs = FA.validate(qv, kv, kv, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                        max_seqlen_k=5)
    exact = 4 * 4 * 16 * sum(_count_pairs(a, b, True, None) for a, b in zip(lens_q, lens_k, strict=True))
    assert FA.flops(vargs) == 4 * 2 * 4 * 16 * _count_pairs(4, 5, True, None) >= exact


def test_full_presets_and_reduce_shape():
    full = FA.presets["full"]
    assert {"b": 2, "s_q": 8192, "s_k": 8192, "h_q": 16, "h_kv": 16, "d": 128, "causal": True,
            "window": None} in full
    assert len(full) == 17
    assert {(s["h_q"], s["s_q"], s["causal"]) for s in full if s["d"] == 64} == {
        (h, s, c) for h in (8, 32) for s in (1024, 2048, 4096, 8192) for c in (True, False)
    }
    sink_full = SA.presets["full"]
    assert {(s["s_q"], s["window"]) for s in sink_full if s["h_q"] == 64} == {
        (8192, None), (8192, 128), (32768, 128)
    }
    assert all(s["sinks"] for s in sink_full)
    for op in (FA, SA):
        for shape in op.presets["full"] + op.presets["tiny"]:
            small = op.reduce_shape(shape)
            assert max(small["s_q"], small["s_k"]) <= 2048
            assert {n: small[n] for n in small if n not in ("s_q", "s_k")} == {
                n: shape[n] for n in shape if n not in ("s_q", "s_k")
            }
    assert FA.reduce_shape({**full[0], "s_q": 4096}) == {**full[0], "s_q": 1024, "s_k": 2048}
    assert FA.reduce_shape({**full[0], "s_q": 100, "s_k": 100}) == {**full[0], "s_q": 100, "s_k": 100}
    assert FA.differentiable and SA.differentiable
