"""sparse_mla's contract: the PyTorch reference against a float64 loop, validation, inputs, key."""

import math

import pytest
import torch

from kreg.ops import contract
from kreg.ops.sparse_mla import OP, reference, validate
from kreg.ops.testing import TOLERANCE, assert_close

INVALID = (-1, -7, None, 2**31 - 1)  # None stands for s_kv, the first index past the end


def brute(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None, deterministic=False):
    """One (batch, query, head) at a time in float64, over the valid slots with multiplicity
    (`deterministic` only concerns backward kernels)."""
    batched = q.dim() == 4
    if not batched:
        q, kv, indices = q[None], kv[None], indices[None]
        topk_length = None if topk_length is None else topk_length[None]
    q, kv = q.double(), kv.double()
    b, s_q, h_q, _ = q.shape
    s_kv, h_kv, topk = kv.shape[1], kv.shape[2], indices.shape[-1]
    out = torch.zeros(b, s_q, h_q, d_v, dtype=torch.float64)
    max_logits = torch.full((b, s_q, h_q), -math.inf, dtype=torch.float64)
    lse = torch.full((b, s_q, h_q), math.inf, dtype=torch.float64)
    for bi in range(b):
        for t in range(s_q):
            n = topk if topk_length is None else int(topk_length[bi, t])
            for h in range(h_q):
                g = h // (h_q // h_kv)
                keys = [j for slot, j in enumerate(indices[bi, t, g].tolist()) if slot < n and 0 <= j < s_kv]
                if not keys:
                    continue
                z = sm_scale * (kv[bi, keys, g] @ q[bi, t, h])
                lse[bi, t, h] = torch.logsumexp(z, 0)
                max_logits[bi, t, h] = z.max()
                out[bi, t, h] = torch.softmax(z, 0) @ kv[bi, keys, g, :d_v]
                if attn_sink is not None:
                    out[bi, t, h] *= torch.sigmoid(lse[bi, t, h] - float(attn_sink[h]))
    if not batched:
        out, max_logits, lse = out[0], max_logits[0], lse[0]
    return out, max_logits, lse


def make_case(s_q, s_kv, h_q, h_kv, d_qk, d_v, topk, *, b=None, sink=False, lengths=False, seed=0,
              dtype=torch.float32):
    """Random inputs with every kind of invalid index, duplicates and one all-invalid query."""
    gen = torch.Generator().manual_seed(seed)
    lead = () if b is None else (b,)
    q = torch.randn(*lead, s_q, h_q, d_qk, generator=gen).to(dtype)
    kv = torch.randn(*lead, s_kv, h_kv, d_qk, generator=gen).to(dtype)
    idx = torch.randint(0, s_kv, (*lead, s_q, h_kv, topk), generator=gen)
    kinds = torch.tensor([s_kv if v is None else v for v in INVALID])
    bad = torch.rand(idx.shape, generator=gen) < 0.2
    idx = torch.where(bad, kinds[torch.randint(0, len(kinds), idx.shape, generator=gen)], idx)
    if topk > 1:
        idx[..., 1] = idx[..., 0]  # duplicates in every row
    idx[..., -1, :, :] = kinds[torch.arange(topk) % len(kinds)]  # the last query sees no key
    args = {"q": q, "kv": kv, "indices": idx.to(torch.int32), "d_v": d_v}
    if sink:
        args["attn_sink"] = torch.randn(h_q, generator=gen) * 2
    if lengths:
        args["topk_length"] = torch.randint(-2, topk + 3, (*lead, s_q), generator=gen, dtype=torch.int32)
    return args


def check_against_brute(args, rtol=TOLERANCE[torch.float32]):
    v = validate(**args)
    got = reference(**v)
    want = brute(**v)
    assert got.out.dtype == args["q"].dtype
    assert got.lse.dtype == got.max_logits.dtype == torch.float32
    assert_close(got, want, rtol, what="sparse_mla")
    return got


CASES = {
    "topk_gt_keys": dict(s_q=5, s_kv=37, h_q=16, h_kv=1, d_qk=96, d_v=64, topk=40),
    "gqa1": dict(s_q=17, s_kv=127, h_q=4, h_kv=4, d_qk=32, d_v=16, topk=24),
    "gqa4": dict(s_q=17, s_kv=63, h_q=8, h_kv=2, d_qk=40, d_v=40, topk=17),
    "gqa8": dict(s_q=7, s_kv=17, h_q=8, h_kv=1, d_qk=24, d_v=8, topk=9),
    "gqa16": dict(s_q=3, s_kv=1000, h_q=16, h_kv=1, d_qk=64, d_v=32, topk=65),
    "one_query_one_key": dict(s_q=1, s_kv=1, h_q=2, h_kv=1, d_qk=8, d_v=8, topk=3),
    "s_q_gt_s_kv": dict(s_q=17, s_kv=5, h_q=4, h_kv=2, d_qk=16, d_v=8, topk=6),
    "batched_sink_lengths": dict(b=2, s_q=9, s_kv=13, h_q=8, h_kv=2, d_qk=48, d_v=32, topk=16, sink=True,
                                 lengths=True),
    "sink_unbatched": dict(s_q=6, s_kv=20, h_q=4, h_kv=1, d_qk=16, d_v=16, topk=7, sink=True),
    "lengths_unbatched": dict(s_q=8, s_kv=11, h_q=2, h_kv=1, d_qk=16, d_v=4, topk=5, lengths=True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_matches_loop(case):
    got = check_against_brute(make_case(**case))
    # The all-invalid last query: out 0, lse +inf, max_logits -inf (never NaN), whatever the sink.
    assert torch.all(got.out[..., -1, :, :] == 0)
    assert torch.all(got.lse[..., -1, :] == math.inf)
    assert torch.all(got.max_logits[..., -1, :] == -math.inf)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_inputs(dtype):
    args = make_case(s_q=9, s_kv=33, h_q=8, h_kv=1, d_qk=64, d_v=32, topk=12, b=2, sink=True, dtype=dtype)
    check_against_brute(args, TOLERANCE[dtype])


def test_sinks_of_large_and_infinite_values():
    args = make_case(s_q=5, s_kv=19, h_q=8, h_kv=2, d_qk=16, d_v=16, topk=8)
    args["attn_sink"] = torch.tensor([math.inf, -math.inf, 1e4, -1e4, 0.0, 3.0, -3.0, 30.0])
    got = check_against_brute(args)
    plain = reference(**validate(**{**args, "attn_sink": None}))
    assert torch.all(got.out[:, [0, 2]] == 0)  # a sink of +inf or 1e4 takes all the mass
    assert torch.equal(got.out[:, [1, 3]], plain.out[:, [1, 3]])  # -inf and -1e4 take none
    assert torch.equal(got.lse, plain.lse) and torch.equal(got.max_logits, plain.max_logits)


def test_duplicates_count_with_multiplicity():
    gen = torch.Generator().manual_seed(3)
    q, kv = torch.randn(1, 1, 16, generator=gen), torch.randn(4, 1, 16, generator=gen)

    def run(idx):
        return reference(**validate(q, kv, torch.tensor([[idx]], dtype=torch.int32), d_v=16))

    once, twice = run([2, -1]), run([2, 2])
    assert torch.allclose(twice.lse, once.lse + math.log(2))
    assert torch.allclose(twice.out, once.out)
    # Key 1 counted twice weighs 2:1 against key 3.
    z = (kv[[1, 3], 0] @ q[0, 0]) / 4.0
    w = torch.softmax(z + torch.log(torch.tensor([2.0, 1.0])), 0)
    assert torch.allclose(run([1, 3, 1]).out[0, 0], w @ kv[[1, 3], 0], atol=1e-6)


def test_topk_length_masks_the_tail_and_zero_length_rows_are_empty():
    args = make_case(s_q=4, s_kv=10, h_q=2, h_kv=1, d_qk=8, d_v=8, topk=6)
    args["indices"] = torch.randint(0, 10, (4, 1, 6), dtype=torch.int32)
    args["topk_length"] = torch.tensor([0, 3, 6, 100], dtype=torch.int32)
    got = reference(**validate(**args))
    cut = reference(**validate(**{**args, "indices": args["indices"][1:2, :, :3], "q": args["q"][1:2],
                                  "topk_length": None}))
    assert torch.all(got.out[0] == 0) and torch.all(got.lse[0] == math.inf)
    assert torch.equal(got.out[1:2], cut.out)
    assert_close(got, brute(**validate(**args)), TOLERANCE[torch.float32])


def test_noncontiguous_inputs_are_handled():
    args = make_case(b=2, s_q=6, s_kv=21, h_q=8, h_kv=2, d_qk=16, d_v=8, topk=9, lengths=True)
    strided = {
        **args,
        "q": torch.stack([args["q"], -args["q"]], 3)[..., 0, :],  # a head stride of 2 rows
        "kv": args["kv"].transpose(0, 1).contiguous().transpose(0, 1),  # batch and position swapped
        "indices": torch.cat([args["indices"]] * 2, -1)[..., :9],
    }
    assert not strided["q"].is_contiguous() and not strided["kv"].is_contiguous()
    assert_close(reference(**validate(**strided)), reference(**validate(**args)), 0.0)


def test_chunking_does_not_change_results(monkeypatch):
    args = make_case(b=2, s_q=11, s_kv=30, h_q=4, h_kv=2, d_qk=16, d_v=16, topk=10, sink=True, lengths=True)
    whole = reference(**validate(**args))
    monkeypatch.setattr(contract, "REFERENCE_CHUNK_ELEMS", 1)  # one query per chunk
    assert_close(reference(**validate(**args)), whole, 1e-6)


def test_gradcheck_q_kv_sink():
    args = make_case(b=2, s_q=3, s_kv=6, h_q=4, h_kv=2, d_qk=6, d_v=4, topk=5, sink=True, lengths=True,
                     dtype=torch.float64)
    args["attn_sink"] = args["attn_sink"].double()
    q, kv, sink = (args[n].requires_grad_() for n in ("q", "kv", "attn_sink"))

    def f(q, kv, sink):
        res = reference(q, kv, args["indices"], 0.4, 4, sink, args["topk_length"])
        return res.out, torch.where(torch.isfinite(res.lse), res.lse, 0.0)

    assert torch.autograd.gradcheck(f, (q, kv, sink))


def test_invalid_slots_get_no_gradient():
    q = torch.randn(2, 4, 8, requires_grad=True)
    kv = torch.randn(6, 1, 8, requires_grad=True)
    # Key 4 sits past topk_length, key 5 is never named; both must get exactly zero gradient.
    indices = torch.tensor([[[0, 1, 4]], [[2, -1, 3]]], dtype=torch.int32)
    res = reference(**validate(q, kv, indices, d_v=8, topk_length=torch.tensor([2, 3], dtype=torch.int32)))
    (res.out.sum() + res.lse.sum()).backward()
    assert torch.all(kv.grad[4:] == 0) and torch.all(kv.grad[:4].abs().sum(-1) > 0)
    assert torch.isfinite(q.grad).all()


def test_empty_row_gradients_are_finite_zero():
    q = torch.randn(2, 2, 8, requires_grad=True)
    kv = torch.randn(3, 1, 8, requires_grad=True)
    sink = torch.tensor([math.inf, -math.inf], requires_grad=True)
    indices = torch.tensor([[[-1, 3]], [[0, 1]]], dtype=torch.int32)
    res = reference(**validate(q, kv, indices, d_v=8, attn_sink=sink))
    res.out.sum().backward()
    assert torch.all(q.grad[0] == 0)
    for grad in (q.grad, kv.grad, sink.grad):
        assert torch.isfinite(grad).all()


# ----------------------------------------------------------------------------- validation
def _good():
    return make_case(b=2, s_q=4, s_kv=9, h_q=4, h_kv=2, d_qk=16, d_v=8, topk=5, sink=True, lengths=True)


BAD = {
    "q_not_tensor": (lambda a: {**a, "q": a["q"].tolist()}, TypeError, "^q:"),
    "q_rank": (lambda a: {**a, "q": a["q"][0, 0]}, ValueError, "^q:"),
    "q_int": (lambda a: {**a, "q": a["q"].int(), "kv": a["kv"].int()}, TypeError, "^q:"),
    "q_fp64": (lambda a: {**a, "q": a["q"].double(), "kv": a["kv"].double()}, TypeError, "^q:"),
    "kv_dtype": (lambda a: {**a, "kv": a["kv"].half()}, TypeError, "^kv:"),
    "kv_rank": (lambda a: {**a, "kv": a["kv"][0]}, ValueError, "^kv:"),
    "kv_batch": (lambda a: {**a, "kv": a["kv"][:1]}, ValueError, "^kv:"),
    "kv_d_qk": (lambda a: {**a, "kv": a["kv"][..., :8]}, ValueError, "^kv:"),
    "gqa": (lambda a: {**a, "kv": torch.randn(2, 9, 3, 16), "indices": a["indices"][:, :, [0, 1, 1]]},
            ValueError, "^kv:"),
    "indices_int64": (lambda a: {**a, "indices": a["indices"].long()}, TypeError, "^indices:"),
    "indices_h_kv": (lambda a: {**a, "indices": a["indices"][:, :, :1]}, ValueError, "^indices:"),
    "indices_s_q": (lambda a: {**a, "indices": a["indices"][:, :3]}, ValueError, "^indices:"),
    "indices_rank": (lambda a: {**a, "indices": a["indices"][0]}, ValueError, "^indices:"),
    "indices_last_dim_strided": (lambda a: {**a, "indices": torch.cat([a["indices"]] * 2, -1)[..., ::2]},
                                 ValueError, "^indices:"),
    "q_last_dim_strided": (lambda a: {**a, "q": torch.cat([a["q"]] * 2, -1)[..., ::2]}, ValueError, "^q:"),
    "empty_batch": (lambda a: {**a, "q": a["q"][:0], "kv": a["kv"][:0], "indices": a["indices"][:0],
                               "topk_length": a["topk_length"][:0]}, ValueError, "^q:"),
    "empty_topk": (lambda a: {**a, "indices": a["indices"][..., :0]}, ValueError, "^indices:"),
    "d_v_too_large": (lambda a: {**a, "d_v": 17}, ValueError, "^d_v:"),
    "d_v_zero": (lambda a: {**a, "d_v": 0}, ValueError, "^d_v:"),
    "d_v_float": (lambda a: {**a, "d_v": 8.0}, ValueError, "^d_v:"),
    "sm_scale_str": (lambda a: {**a, "sm_scale": "0.1"}, TypeError, "^sm_scale:"),
    "sink_dtype": (lambda a: {**a, "attn_sink": a["attn_sink"].half()}, TypeError, "^attn_sink:"),
    "sink_shape": (lambda a: {**a, "attn_sink": a["attn_sink"][:2]}, ValueError, "^attn_sink:"),
    "sink_device": (lambda a: {**a, "attn_sink": a["attn_sink"].to("meta")}, ValueError, "^attn_sink:"),
    "lengths_dtype": (lambda a: {**a, "topk_length": a["topk_length"].long()}, TypeError, "^topk_length:"),
    "lengths_shape": (lambda a: {**a, "topk_length": a["topk_length"][0]}, ValueError, "^topk_length:"),
    "kv_device": (lambda a: {**a, "kv": a["kv"].to("meta")}, ValueError, "^kv:"),
    "deterministic_int": (lambda a: {**a, "deterministic": 1}, TypeError, "^deterministic:"),
}


@pytest.mark.parametrize("mutate, error, match", BAD.values(), ids=BAD.keys())
def test_validation_rejects(mutate, error, match):
    with pytest.raises(error, match=match):
        validate(**mutate(_good()))


def test_validate_resolves_defaults():
    q, kv = torch.randn(3, 2, 576), torch.randn(5, 1, 576)
    indices = torch.zeros(3, 1, 4, dtype=torch.int32)
    v = validate(q, kv, indices)
    assert v == {"q": q, "kv": kv, "indices": indices, "sm_scale": 576**-0.5, "d_v": 512,
                 "attn_sink": None, "topk_length": None, "deterministic": False}
    assert validate(q, kv, indices, deterministic=True)["deterministic"] is True
    with pytest.raises(ValueError, match="^d_v:"):  # the default d_v = 512 exceeds d_qk = 64
        validate(q[..., :64], kv[..., :64], indices)


# ----------------------------------------------------------------------------- inputs, key, costs
@pytest.mark.parametrize("shape", OP.presets["tiny"], ids=["unbatched", "batched_sink_lengths"])
def test_make_inputs_are_valid_and_causal_like(shape):
    args = OP.make_inputs(shape, device="cpu", dtype=torch.bfloat16, seed=5)
    v = validate(**args)
    assert v["q"].abs().sum() > 0 and v["kv"].abs().sum() > 0
    idx = v["indices"]
    s_q, s_kv = shape["s_q"], shape["s_kv"]
    assert ((idx >= -1) & (idx < s_kv)).all() and (idx == -1).any()
    # Query t picks from [0, s_kv - s_q + t] (at least key 0).
    limit = (torch.arange(s_q) + s_kv - s_q).clamp(min=0)[:, None, None]
    assert (idx <= limit).all()
    rows = idx.reshape(-1, idx.shape[-1]).tolist()
    assert any(len([j for j in r if j >= 0]) > len({j for j in r if j >= 0}) for r in rows)  # duplicates
    assert ("attn_sink" in args) == bool(shape.get("sink"))
    assert ("topk_length" in args) == bool(shape.get("topk_length"))
    again = OP.make_inputs(shape, device="cpu", dtype=torch.bfloat16, seed=5)
    other = OP.make_inputs(shape, device="cpu", dtype=torch.bfloat16, seed=6)
    assert torch.equal(again["q"], args["q"]) and not torch.equal(other["q"], args["q"])
    out = reference(**v)
    assert torch.isfinite(out.out).all()


def test_presets_and_reduce_shape():
    full = OP.presets["full"]
    assert {(s["s_q"], s["h_q"]) for s in full} >= {(4096, 128), (8192, 128), (16384, 128), (8192, 64)}
    # The target axes: s_q from 1 to 16384, topk 512/1024/2048, h_q 16/64/128, all at V3.2 head dims.
    assert {s["s_q"] for s in full} >= {1, 16384} and {s["topk"] for s in full} == {512, 1024, 2048}
    assert {s["h_q"] for s in full} == {16, 64, 128}
    for shape in full:
        assert (shape["h_kv"], shape["d_qk"], shape["d_v"]) == (1, 576, 512)
        small = OP.reduce_shape(shape)
        assert small == {**shape, "s_q": min(shape["s_q"], 512)}


def test_tuning_key_is_hashable_and_buckets_lengths():
    def key(s_q, b=None, dtype=torch.float16):
        shape = {"s_q": s_q, "s_kv": 40, "h_q": 16, "h_kv": 1, "d_qk": 64, "d_v": 32, "topk": 8}
        if b is not None:
            shape["b"] = b
        return dict(OP.tuning_key(validate(**OP.make_inputs(shape, device="cpu", dtype=dtype, seed=0))))

    k5 = key(5)
    assert hash(OP.tuning_key(validate(**_good())))
    assert k5 == {"d_qk": 64, "d_v": 32, "dtype": "fp16", "h_kv": 1, "h_q": 16, "kv_aligned": True, "s_q": 16,
                  "topk": 8}
    assert key(9) == k5 and key(17)["s_q"] == 32 and key(33)["s_q"] == 64
    assert key(17, b=3) == {**k5, "s_q": 64}  # 3 * 17 query rows; the layout is not part of the key
    assert key(17, b=1) == key(17)  # batched and unbatched spellings of the same rows share a key
    assert key(5, dtype=torch.bfloat16)["dtype"] == "bf16"
    names = [n for n, _ in OP.tuning_key(validate(**_good()))]
    assert names == sorted(names)


def test_kv_row_alignment_is_a_key_dim():
    """The warp-specialized kernel copies 16-byte chunks: a kv whose rows are not 16-element aligned
    gets its own key (and its own raw dispatch key), which that variant does not support."""
    from kreg.ops.sparse_mla import kv_rows_aligned

    args = validate(**_good())
    assert dict(OP.tuning_key(args))["kv_aligned"] is (args["kv"].stride(-2) % 16 == 0)
    assert kv_rows_aligned(torch.empty(2, 8, 1, 576, dtype=torch.bfloat16))
    padded = torch.empty(8, 1, 584, dtype=torch.bfloat16)[..., :576]  # row stride 584
    assert not kv_rows_aligned(padded)
    assert not kv_rows_aligned(torch.empty(1, 8 * 576 + 1, dtype=torch.bfloat16)[:, 1:].view(1, 8, 1, 576))
    good = dict(q=torch.randn(3, 16, 576).bfloat16(), kv=torch.randn(8, 1, 576).bfloat16(),
                indices=torch.zeros(3, 1, 4, dtype=torch.int32))
    bad = {**good, "kv": torch.randn(8, 1, 584).bfloat16()[..., :576]}
    assert validate(**good).key != validate(**bad).key
    assert dict(OP.tuning_key(validate(**bad)))["kv_aligned"] is False


def test_flops_and_bytes():
    args = validate(**_good())  # b 2, s_q 4, h_q 4, topk 5, d_qk 16, d_v 8, fp32
    assert OP.flops(args) == 2 * (2 * 4) * 4 * 5 * (16 + 8)
    inputs = (2 * 4 * 4 * 16 + 2 * 9 * 2 * 16) * 4 + 2 * 4 * 2 * 5 * 4 + 4 * 4 + 2 * 4 * 4
    outputs = 2 * 4 * 4 * (8 * 4 + 4 + 4)
    assert OP.bytes_moved(args) == inputs + outputs
    assert OP.outputs == ("out", "max_logits", "lse") and OP.differentiable
