"""nsa's contract: the PyTorch reference against a float64 loop, validation, inputs, key, costs."""

import pytest
import torch

from kreg.ops import contract
from kreg.ops.nsa import OP, reference, select_blocks, validate
from kreg.ops.testing import TOLERANCE, assert_close


def _attend(q, keys, values, sm_scale):
    """Softmax attention of one query over rows of keys/values (float64); 0 without keys."""
    if len(keys) == 0:
        return torch.zeros_like(q)
    return torch.softmax(sm_scale * (torch.stack(keys) @ q), 0) @ torch.stack(values)


def brute(q, k, v, g_cmp, g_slc, g_swa, block_size, block_count, window, sm_scale, block_indices=None):
    """NSA one (batch, query, head) at a time in float64. Returns (out, blocks chosen per group,
    importance per group as {block: summed probability})."""
    q, k, v = q.double(), k.double(), v.double()
    b, t, h_q, _ = q.shape
    h_kv = k.shape[2]
    r, bs = h_q // h_kv, block_size
    out = torch.zeros(q.shape, dtype=torch.float64)
    chosen, importance = {}, {}
    for bi in range(b):
        k_cmp = [k[bi, c * bs:(c + 1) * bs].mean(0) for c in range(t // bs)]
        v_cmp = [v[bi, c * bs:(c + 1) * bs].mean(0) for c in range(t // bs)]
        for i in range(t):
            visible = [c for c in range(t // bs) if (c + 1) * bs - 1 <= i]
            own = i // bs
            for g in range(h_kv):
                heads = range(g * r, (g + 1) * r)
                imp = {c: 0.0 for c in range(own + 1)}
                o_cmp = {}
                for h in heads:
                    o_cmp[h] = _attend(q[bi, i, h], [k_cmp[c][g] for c in visible],
                                       [v_cmp[c][g] for c in visible], sm_scale)
                    if visible:
                        z = torch.stack([sm_scale * (q[bi, i, h] @ k_cmp[c][g]) for c in visible])
                        for c, p in zip(visible, torch.softmax(z, 0).tolist(), strict=True):
                            imp[c] += p
                if block_indices is None:
                    others = sorted((c for c in imp if c != own), key=lambda c: -imp[c])
                    blocks = [own] + others[: block_count - 1]
                else:
                    blocks = [c for c in block_indices[bi, i, g].tolist() if 0 <= c <= own]
                chosen[bi, i, g], importance[bi, i, g] = blocks, imp
                selected = [j for c in blocks for j in range(c * bs, min((c + 1) * bs, i + 1))]
                in_window = range(max(0, i - window + 1), i + 1)
                for h in heads:
                    o_slc = _attend(q[bi, i, h], [k[bi, j, g] for j in selected],
                                    [v[bi, j, g] for j in selected], sm_scale)
                    o_swa = _attend(q[bi, i, h], [k[bi, j, g] for j in in_window],
                                    [v[bi, j, g] for j in in_window], sm_scale)
                    out[bi, i, h] = (float(g_cmp[bi, i, h]) * o_cmp[h] + float(g_slc[bi, i, h]) * o_slc
                                     + float(g_swa[bi, i, h]) * o_swa)
    return out, chosen, importance


def make_case(b, t, h_q, h_kv, d, block_size, block_count, window, *, blocks=False, seed=0,
              dtype=torch.float32):
    """Random inputs; with `blocks`, block_indices holding every kind of invalid id, duplicates and
    one query without a valid id."""
    gen = torch.Generator().manual_seed(seed)
    args = {
        "q": torch.randn(b, t, h_q, d, generator=gen).to(dtype),
        "k": torch.randn(b, t, h_kv, d, generator=gen).to(dtype),
        "v": torch.randn(b, t, h_kv, d, generator=gen).to(dtype),
        "g_cmp": torch.rand(b, t, h_q, generator=gen).to(dtype),
        "g_slc": torch.rand(b, t, h_q, generator=gen).to(dtype),
        "g_swa": torch.rand(b, t, h_q, generator=gen).to(dtype),
        "block_size": block_size,
        "block_count": block_count,
        "window": window,
    }
    if blocks:
        own = (torch.arange(t) // block_size)[None, :, None, None]
        ids = (torch.rand(b, t, h_kv, block_count, generator=gen) * (own + 1)).long()
        n_blocks = -(-t // block_size)
        kinds = torch.stack(torch.broadcast_tensors(
            torch.tensor(-1), torch.tensor(-7), own + 1, torch.tensor(n_blocks), torch.tensor(2**31 - 1)), -1)
        pick = torch.randint(0, 5, ids.shape, generator=gen)
        bad = kinds.expand(b, t, h_kv, block_count, 5).gather(-1, pick[..., None])[..., 0]
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.25, bad, ids)
        if block_count > 1:
            ids[..., 1] = ids[..., 0]
        ids[:, -1] = -1  # the last query selects nothing valid
        ids[:, -1, :, 0] = own[0, -1, 0, 0] + 1  # a future block
        args["block_indices"] = ids.to(torch.int32)
    return args


def check(args, rtol=TOLERANCE[torch.float32]):
    v = validate(**args)
    out = reference(**v)
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    want, _, _ = brute(**v)
    assert_close(out, want, rtol, what="nsa")
    return out


CASES = {
    "basic": dict(b=2, t=37, h_q=8, h_kv=2, d=16, block_size=8, block_count=3, window=11),
    "gqa1": dict(b=1, t=17, h_q=4, h_kv=4, d=8, block_size=4, block_count=2, window=5),
    "gqa8": dict(b=1, t=20, h_q=8, h_kv=1, d=8, block_size=4, block_count=3, window=6),
    "gqa16": dict(b=1, t=12, h_q=16, h_kv=1, d=8, block_size=4, block_count=2, window=3),
    "t1": dict(b=2, t=1, h_q=2, h_kv=1, d=8, block_size=4, block_count=2, window=4),
    "count_gt_blocks": dict(b=1, t=17, h_q=4, h_kv=2, d=8, block_size=4, block_count=10, window=7),
    "window1": dict(b=1, t=13, h_q=2, h_kv=1, d=8, block_size=4, block_count=2, window=1),
    "window_eq_t": dict(b=1, t=13, h_q=2, h_kv=1, d=8, block_size=4, block_count=2, window=13),
    "window_gt_t": dict(b=1, t=13, h_q=2, h_kv=1, d=8, block_size=5, block_count=2, window=100),
    "block1": dict(b=1, t=9, h_q=4, h_kv=2, d=8, block_size=1, block_count=3, window=2),
    "block_gt_t": dict(b=1, t=7, h_q=2, h_kv=1, d=8, block_size=16, block_count=2, window=3),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_matches_loop(case):
    check(make_case(**case))


@pytest.mark.parametrize("case", ["basic", "gqa16", "count_gt_blocks", "t1"])
def test_given_block_indices_match_loop(case):
    out = check(make_case(**CASES[case], blocks=True))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_inputs(dtype):
    check(make_case(2, 19, 4, 2, 16, 4, 3, 5, dtype=dtype), TOLERANCE[dtype])


@pytest.mark.parametrize("case", ["basic", "gqa8", "count_gt_blocks", "block1"])
def test_selection_picks_own_block_then_most_important(case):
    args = validate(**make_case(**CASES[case]))
    blocks = select_blocks(args["q"], args["k"], args["block_size"], args["block_count"], args["sm_scale"])
    b, t, h_q, _ = args["q"].shape
    h_kv, count = args["k"].shape[2], args["block_count"]
    assert blocks.dtype == torch.int32 and blocks.shape == (b, t, h_kv, count)
    _, chosen, importance = brute(**args)
    for (bi, i, g), want in chosen.items():
        row = blocks[bi, i, g].tolist()
        n = min(count, i // args["block_size"] + 1)
        assert row[0] == i // args["block_size"] and row[n:] == [-1] * (count - n)
        got = sorted(importance[bi, i, g][c] for c in row[1:n])
        assert len(set(row[:n])) == n
        assert got == pytest.approx(sorted(importance[bi, i, g][c] for c in want[1:]), abs=1e-6)


def test_branches_alone():
    args = make_case(1, 21, 4, 2, 8, 4, 2, 1)
    ones, zeros = torch.ones_like(args["g_cmp"]), torch.zeros_like(args["g_cmp"])
    # Window 1: each query sees only itself.
    swa = reference(**validate(**{**args, "g_cmp": zeros, "g_slc": zeros, "g_swa": ones}))
    assert torch.allclose(swa, args["v"].repeat_interleave(2, dim=2))
    # No compressed block is visible before the first block ends.
    cmp = reference(**validate(**{**args, "g_cmp": ones, "g_slc": zeros, "g_swa": zeros}))
    assert torch.all(cmp[:, :3] == 0) and torch.all(cmp[:, 3:].abs().sum(-1) > 0)
    # Selection with every candidate chosen is full causal attention, like a window wider than t.
    only_slc = {**args, "g_cmp": zeros, "g_slc": ones, "g_swa": zeros}
    only_swa = {**args, "g_cmp": zeros, "g_slc": zeros, "g_swa": ones}
    full_sel = reference(**validate(**{**only_slc, "block_count": 6}))
    full_win = reference(**validate(**{**only_swa, "window": 50}))
    assert_close(full_sel, full_win, 1e-6)


def test_empty_and_duplicate_block_indices():
    args = make_case(1, 12, 2, 1, 8, 4, 3, 2)
    args.update(g_cmp=torch.zeros_like(args["g_cmp"]), g_swa=torch.zeros_like(args["g_swa"]))
    ids = torch.full((1, 12, 1, 3), -1, dtype=torch.int32)
    ids[0, 8:, 0, 0] = 2
    ids[0, 8:, 0, 1] = 0
    once = reference(**validate(**args, block_indices=ids))
    assert torch.all(once[:, :8] == 0)  # no valid id: o_slc = 0
    ids[0, 8:, 0, 2] = 0
    twice = reference(**validate(**args, block_indices=ids))
    assert not torch.allclose(once[:, 8:], twice[:, 8:])  # block 0 now counts twice
    assert_close(twice, brute(**validate(**args, block_indices=ids))[0], TOLERANCE[torch.float32])


def test_noncontiguous_inputs_and_chunking(monkeypatch):
    args = make_case(2, 15, 4, 2, 8, 4, 2, 5, blocks=True)
    whole = reference(**validate(**args))
    strided = {**args, "q": torch.stack([args["q"], -args["q"]], 3)[..., 0, :],
               "k": args["k"].transpose(0, 1).contiguous().transpose(0, 1),
               "g_slc": torch.stack([args["g_slc"], args["g_cmp"]], -1)[..., 0].contiguous(),
               "block_indices": torch.cat([args["block_indices"]] * 2, -1)[..., :2]}
    assert not strided["q"].is_contiguous() and not strided["k"].is_contiguous()
    monkeypatch.setattr(contract, "REFERENCE_CHUNK_ELEMS", 1)
    assert_close(reference(**validate(**strided)), whole, 1e-6)


# ----------------------------------------------------------------------------- validation
def _good():
    return make_case(2, 9, 4, 2, 8, 4, 2, 3, blocks=True)


BAD = {
    "q_not_tensor": (lambda a: {**a, "q": None}, TypeError, "^q:"),
    "q_rank": (lambda a: {**a, "q": a["q"][0]}, ValueError, "^q:"),
    "q_fp64": (lambda a: {**a, **{n: a[n].double() for n in "qkv"}}, TypeError, "^q:"),
    "k_dtype": (lambda a: {**a, "k": a["k"].half()}, TypeError, "^k:"),
    "k_shape": (lambda a: {**a, "k": a["k"][:, :8]}, ValueError, "^k:"),
    "v_shape": (lambda a: {**a, "v": a["v"][:, :, :1]}, ValueError, "^v:"),
    "gqa": (lambda a: {**a, "k": torch.randn(2, 9, 3, 8), "v": torch.randn(2, 9, 3, 8)}, ValueError, "^k:"),
    "gate_shape": (lambda a: {**a, "g_slc": a["g_slc"][..., :2]}, ValueError, "^g_slc:"),
    "gate_dtype": (lambda a: {**a, "g_swa": a["g_swa"].bool()}, TypeError, "^g_swa:"),
    "gate_device": (lambda a: {**a, "g_cmp": a["g_cmp"].to("meta")}, ValueError, "^g_cmp:"),
    "gate_strided": (lambda a: {**a, "g_cmp": torch.stack([a["g_cmp"]] * 2, -1)[..., 0]}, ValueError,
                     "^g_cmp:"),
    "block_size": (lambda a: {**a, "block_size": 0}, ValueError, "^block_size:"),
    "block_count": (lambda a: {**a, "block_count": 2.0}, ValueError, "^block_count:"),
    "window": (lambda a: {**a, "window": None}, ValueError, "^window:"),
    "blocks_dtype": (lambda a: {**a, "block_indices": a["block_indices"].long()}, TypeError,
                     "^block_indices:"),
    "blocks_count": (lambda a: {**a, "block_indices": a["block_indices"][..., :1]}, ValueError,
                     "^block_indices:"),
    "blocks_h_kv": (lambda a: {**a, "block_indices": a["block_indices"][:, :, :1]}, ValueError,
                    "^block_indices:"),
    "blocks_device": (lambda a: {**a, "block_indices": a["block_indices"].to("meta")}, ValueError,
                      "^block_indices:"),
    "empty_batch": (lambda a: {n: x[:0] if isinstance(x, torch.Tensor) else x for n, x in a.items()},
                    ValueError, "^q:"),
    "sm_scale": (lambda a: {**a, "sm_scale": "x"}, TypeError, "^sm_scale:"),
    "q_strided": (lambda a: {**a, "q": torch.cat([a["q"]] * 2, -1)[..., ::2]}, ValueError, "^q:"),
}


@pytest.mark.parametrize("mutate, error, match", BAD.values(), ids=BAD.keys())
def test_validation_rejects(mutate, error, match):
    with pytest.raises(error, match=match):
        validate(**mutate(_good()))


def test_validate_resolves_defaults():
    a = make_case(1, 5, 2, 1, 16, 64, 16, 512)
    for n in ("block_size", "block_count", "window"):
        del a[n]
    # 5 tokens are one block of 64: the default block_count of 16 is capped at it.
    assert validate(**a) == {**a, "block_size": 64, "block_count": 1, "window": 512, "sm_scale": 0.25,
                             "block_indices": None}
    assert validate(**a, block_size=2)["block_count"] == 3 and validate(**a, block_size=1)["block_count"] == 5


# ----------------------------------------------------------------------------- inputs, key, costs
@pytest.mark.parametrize("shape", OP.presets["tiny"], ids=["selected", "given_blocks"])
def test_make_inputs(shape):
    args = OP.make_inputs(shape, device="cpu", dtype=torch.bfloat16, seed=4)
    v = validate(**args)
    assert v["q"].abs().sum() > 0
    for gate in ("g_cmp", "g_slc", "g_swa"):
        assert ((v[gate] >= 0) & (v[gate] <= 1)).all() and v[gate].std() > 0
    if shape.get("block_indices"):
        ids = v["block_indices"]
        own = (torch.arange(shape["t"]) // shape["block_size"])[None, :, None, None]
        assert ((ids >= -1) & (ids <= own)).all() and (ids == -1).any()
        rows = [[c for c in r if c >= 0] for r in ids.reshape(-1, shape["block_count"]).tolist()]
        assert any(len(r) > len(set(r)) for r in rows)
    else:
        assert v["block_indices"] is None
    assert torch.isfinite(reference(**v)).all()
    assert torch.equal(OP.make_inputs(shape, device="cpu", dtype=torch.bfloat16, seed=4)["k"], args["k"])


def test_presets_and_reduce_shape():
    full, short = OP.presets["full"]  # the target, and t 8192 (where it must not lose to dense attention)
    assert full == {"b": 1, "t": 65536, "h_q": 64, "h_kv": 4, "d": 128, "block_size": 64, "block_count": 16,
                    "window": 512}
    assert short == {**full, "t": 8192}
    assert OP.reduce_shape(full) == {**full, "t": 2048}
    assert OP.grad_inputs == ("q", "k", "v", "g_cmp", "g_slc", "g_swa") and OP.outputs == ("out",)


def test_tuning_key_buckets_length():
    def key(t, blocks=False):
        return dict(OP.tuning_key(validate(**make_case(1, t, 4, 2, 8, 4, 2, 3, blocks=blocks))))

    assert key(17) == {"block_count": 2, "block_indices": False, "block_size": 4, "d": 8, "dtype": "fp32",
                       "h_kv": 2, "h_q": 4, "t": 32, "window": 3}
    assert key(17) == key(30) != key(33)
    assert key(17, blocks=True)["block_indices"] is True
    assert hash(OP.tuning_key(validate(**_good())))


def _pairs_by_loop(t, bs, count, window):
    total = 0
    for i in range(t):
        total += (i + 1) // bs  # compressed blocks
        total += min(i + 1, i % bs + 1 + (count - 1) * bs)  # selected tokens
        total += min(i + 1, window)  # window
    return total


@pytest.mark.parametrize(
    "t, bs, count, window",
    [(1, 4, 2, 3), (37, 8, 3, 11), (100, 7, 4, 100), (64, 64, 16, 5), (1000, 16, 5, 200)],
)
def test_flops_count_pairs_in_closed_form(t, bs, count, window):
    q = torch.empty(2, t, 4, 8)
    k = torch.empty(2, t, 2, 8)
    args = {"q": q, "k": k, "block_size": bs, "block_count": count, "window": window}
    assert OP.flops(args) == 4 * 2 * 4 * 8 * _pairs_by_loop(t, bs, count, window)


def test_bytes():
    args = validate(**_good())  # b 2, t 9, h_q 4, h_kv 2, d 8, block_count 2, fp32
    inputs = (2 * 9 * 4 * 8 + 2 * (2 * 9 * 2 * 8) + 3 * 2 * 9 * 4) * 4 + 2 * 9 * 2 * 2 * 4
    assert OP.bytes_moved(args) == inputs + 2 * 9 * 4 * 8 * 4
