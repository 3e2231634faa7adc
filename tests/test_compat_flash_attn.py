"""kreg.compat.flash_attn against FlashAttention 2.8's semantics, written here from its documented
masks: query i of a sequence at p = i + s_k - s_q keeps key j when p - left <= j <= p + right (a
negative bound is none, causal sets right = 0); a row without keys is 0 with lse +inf; sinks (kreg's
extension) are one extra logit per query head with no value.

FlashAttention's tolerance rule: our error against an fp64 reference is at most twice that of the same
computation in plain PyTorch at the input precision (fp16), plus a tiny absolute term. The grid
follows FlashAttention's public tests at tiny sizes (causal and not, local windows, MHA/GQA/MQA, odd
lengths, s_q != s_k, uneven varlen sequences, pages with a shuffled block table, cache lengths, new
keys appended to the cache, sinks), on the plain backend (CPU tensors: the ops' PyTorch references)
and, for a few cases, through each vendor's Triton kernels in the interpreter (`use_vendor`)."""

import inspect

import pytest
import torch

import kreg.compat.flash_attn as fa
from tests.conftest import HAS_GPU

DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
DTYPE = torch.float16
INF = float("inf")


# ----------------------------------------------------------------------------- reference
def attention_ref(q, k, v, causal=False, window=(-1, -1), scale=None, sinks=None, dtype=torch.float64):
    """One sequence: `q [s_q, h_q, d]`, `k, v [s_k, h_kv, d]` -> (out [s_q, h_q, d], lse [h_q, s_q]),
    computed in `dtype` (fp64: the reference; fp16: plain PyTorch at the input precision)."""
    s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[:2]
    scale = d**-0.5 if scale is None else scale
    group = h_q // h_kv
    q, k, v = (t.to("cpu", dtype) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.transpose(0, 1) @ k.permute(1, 2, 0)) * scale  # [h_q, s_q, s_k]
    left, right = window
    if causal:
        right = 0
    pos = torch.arange(s_q)[:, None] + s_k - s_q
    key = torch.arange(s_k)[None, :]
    keep = torch.ones(s_q, s_k, dtype=torch.bool)
    if right >= 0:
        keep &= key <= pos + right
    if left >= 0:
        keep &= key >= pos - left
    scores = scores.masked_fill(~keep, -INF)
    lse = torch.logsumexp(scores, dim=-1)
    total = lse if sinks is None else torch.logaddexp(lse, sinks.to("cpu", dtype)[:, None])
    probs = torch.exp(scores - total[..., None]).masked_fill(~keep, 0)
    out = (probs @ v.transpose(0, 1)).transpose(0, 1)
    return out, lse.masked_fill(lse == -INF, INF)


def batched_ref(q, k, v, **kwargs):
    """[b, s, h, d] tensors: (out [b, s_q, h_q, d], lse [b, h_q, s_q])."""
    outs, lses = zip(*(attention_ref(q[i], k[i], v[i], **kwargs) for i in range(q.shape[0])), strict=True)
    return torch.stack(outs), torch.stack(lses)


def packed_ref(q, k, v, q_lens, k_lens, **kwargs):
    """Packed rows: (out [total_q, h_q, d], lse [h_q, total_q])."""
    outs, lses, qi, ki = [], [], 0, 0
    for lq, lk in zip(q_lens, k_lens, strict=True):
        out, lse = attention_ref(q[qi:qi + lq], k[ki:ki + lk], v[ki:ki + lk], **kwargs)
        outs.append(out)
        lses.append(lse)
        qi, ki = qi + lq, ki + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


def check(got, ref, plain, what="out", atol=1e-4):
    """FlashAttention's rule: |got - ref| <= 2 |plain - ref| + atol (max over elements); the reference's
    infinities (the lse of rows without keys) must be matched exactly."""
    got, ref, plain = (t.detach().to("cpu", torch.float64) for t in (got, ref, plain))
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    assert torch.equal(got[~finite], ref[~finite]), f"{what}: rows without keys differ"
    err = (got[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    base = (plain[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= 2 * base + atol, f"{what}: error {err:.3g} vs plain PyTorch's {base:.3g}"


def check_pair(res, ref_fn, **kwargs):
    """`res` (out, lse) against ref_fn in fp64 and in fp16."""
    ref, plain = ref_fn(dtype=torch.float64, **kwargs), ref_fn(dtype=DTYPE, **kwargs)
    check(res[0], ref[0], plain[0], "out")
    check(res[1], ref[1], plain[1], "lse")


def rand(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, DTYPE)


def make_sinks(gen, h_q):
    return (torch.randn(h_q, generator=gen) * 2).to(DEVICE)


def pages_for(gen, k_lens, page, h_kv, d, spare=3):
    """A page pool with the keys of each sequence spread over shuffled pages: (k_pages, v_pages,
    block_table with -1 past each sequence's pages, dense per-sequence k and v for the reference)."""
    b, most = len(k_lens), max(-(-n // page) for n in k_lens)
    num = b * most + spare
    table = torch.randperm(num, generator=gen)[: b * most].view(b, most)
    k_pages, v_pages = rand(gen, num, page, h_kv, d), rand(gen, num, page, h_kv, d)
    dense_k = [k_pages[table[i]].reshape(-1, h_kv, d)[:n] for i, n in enumerate(k_lens)]
    dense_v = [v_pages[table[i]].reshape(-1, h_kv, d)[:n] for i, n in enumerate(k_lens)]
    used = torch.tensor([-(-n // page) for n in k_lens])
    table = torch.where(torch.arange(most)[None] < used[:, None], table, -1)
    return k_pages, v_pages, table.to(DEVICE, torch.int32), dense_k, dense_v


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


@pytest.fixture(params=[None])
def vendor(request):
    """The backend a test runs on: None is the plain one (on CPU tensors, the ops' references)."""
    previous = fa.use_vendor(request.param)
    yield request.param
    fa.use_vendor(previous)


# ----------------------------------------------------------------------------- the API
def test_signatures_are_flash_attn_2_8s_plus_sinks():
    expected = {
        "flash_attn_func": "(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                           "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *, "
                           "sinks=None)",
        "flash_attn_varlen_func": "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
                                  "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                                  "alibi_slopes=None, deterministic=False, return_attn_probs=False, "
                                  "block_table=None, *, sinks=None)",
        "flash_attn_with_kvcache": "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
                                   "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
                                   "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                                   "rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
                                   "return_softmax_lse=False, *, sinks=None)",
    }
    for name, signature in expected.items():
        assert str(inspect.signature(getattr(fa, name))) == signature, name


# ----------------------------------------------------------------------------- flash_attn_func
SHAPES = [  # b, s_q, s_k, h_q, h_kv, d, softmax_scale
    (2, 13, 13, 4, 4, 32, None),
    (1, 9, 29, 4, 2, 16, 0.3),
    (2, 29, 9, 6, 1, 16, None),  # MQA, more queries than keys: the first rows see nothing under causal
    (2, 1, 17, 4, 2, 16, None),
]
MASKS = [  # causal, window_size: each one kreg expresses
    (False, (-1, -1)),
    (True, (-1, -1)),
    (True, (5, -1)),
    (True, (3, 9)),  # causal sets the right bound to 0
    (False, (4, 0)),  # a right bound of 0 is causal
    (False, (-1, 100)),  # bounds past every key are none
    (False, (100, -1)),
]


@pytest.mark.parametrize("causal, window_size", MASKS)
@pytest.mark.parametrize("shape, sinks", [(shape, False) for shape in SHAPES] + [(SHAPES[1], True), (SHAPES[2], True)])
def test_func(vendor, shape, causal, window_size, sinks):
    b, s_q, s_k, h_q, h_kv, d, scale = shape
    gen = torch.Generator().manual_seed(s_q * 100 + s_k)
    q, k, v = rand(gen, b, s_q, h_q, d), rand(gen, b, s_k, h_kv, d), rand(gen, b, s_k, h_kv, d)
    sink = make_sinks(gen, h_q) if sinks else None
    out, lse, probs = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window_size,
                                         return_attn_probs=True, sinks=sink)
    assert out.dtype == DTYPE and lse.dtype == torch.float32
    assert probs.shape == (0,) and probs.dtype == DTYPE  # 2.8 returns probabilities only with dropout
    check_pair((out, lse), lambda dtype: batched_ref(q, k, v, causal=causal, window=window_size, scale=scale,
                                                     sinks=sink, dtype=dtype))
    plain = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window_size, sinks=sink)
    assert torch.equal(plain, out)


def test_func_gradients(vendor):
    """Gradients of q, k, v and the sinks through a GQA causal window, against fp64 autograd."""
    gen = torch.Generator().manual_seed(7)
    b, s_q, s_k, h_q, h_kv, d = 2, 11, 19, 4, 2, 16
    q, k, v = rand(gen, b, s_q, h_q, d), rand(gen, b, s_k, h_kv, d), rand(gen, b, s_k, h_kv, d)
    sinks, grad_out = make_sinks(gen, h_q), rand(gen, b, s_q, h_q, d)

    def grads(run, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        xs.append(sinks.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_())
        out = run(*xs)
        (out * grad_out.to(out.device, out.dtype)).sum().backward()
        return [x.grad for x in xs]

    def ref(dtype):
        return grads(lambda *xs: batched_ref(*xs[:3], causal=True, window=(6, 0), sinks=xs[3], dtype=dtype)[0], dtype)

    got = grads(lambda *xs: fa.flash_attn_func(*xs[:3], causal=True, window_size=(6, 0), sinks=xs[3]), DTYPE)
    for name, g, r, p in zip(("dq", "dk", "dv", "dsinks"), got, ref(torch.float64), ref(DTYPE), strict=True):
        check(g, r, p, name, atol=1e-3)


# ----------------------------------------------------------------------------- flash_attn_varlen_func
Q_LENS, K_LENS = [5, 1, 13, 7], [9, 4, 13, 3]  # uneven, odd, s_q > s_k in the last


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("causal, window_size", [MASKS[0], MASKS[1], MASKS[2], MASKS[4]])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (4, 1)])
def test_varlen(vendor, heads, causal, window_size, sinks):
    h_q, h_kv = heads
    d = 16
    gen = torch.Generator().manual_seed(h_q * 10 + h_kv)
    q, k, v = rand(gen, sum(Q_LENS), h_q, d), rand(gen, sum(K_LENS), h_kv, d), rand(gen, sum(K_LENS), h_kv, d)
    sink = make_sinks(gen, h_q) if sinks else None
    out, lse, probs = fa.flash_attn_varlen_func(q, k, v, cu(Q_LENS), cu(K_LENS), max(Q_LENS), max(K_LENS),
                                                causal=causal, window_size=window_size, return_attn_probs=True,
                                                sinks=sink)
    assert probs.shape == (0,)
    check_pair((out, lse), lambda dtype: packed_ref(q, k, v, Q_LENS, K_LENS, causal=causal, window=window_size,
                                                    sinks=sink, dtype=dtype))


@pytest.mark.parametrize("rows", [fa.DECODE_ROWS, 8])  # 8: several segments per sequence
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("causal, window_size", [MASKS[0], MASKS[1], MASKS[2]])
def test_varlen_paged(vendor, causal, window_size, sinks, rows, monkeypatch):
    monkeypatch.setattr(fa, "DECODE_ROWS", rows)
    h_q, h_kv, d, page = 4, 2, 16, 16
    k_lens = [20, 4, 33, 3]
    gen = torch.Generator().manual_seed(rows + 1)
    q = rand(gen, sum(Q_LENS), h_q, d)
    k_pages, v_pages, table, dense_k, dense_v = pages_for(gen, k_lens, page, h_kv, d)
    sink = make_sinks(gen, h_q) if sinks else None
    out, lse, _ = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu(Q_LENS), cu(k_lens), max(Q_LENS), max(k_lens),
                                            causal=causal, window_size=window_size, return_attn_probs=True,
                                            block_table=table, sinks=sink)
    k, v = torch.cat(dense_k), torch.cat(dense_v)
    check_pair((out, lse), lambda dtype: packed_ref(q, k, v, Q_LENS, k_lens, causal=causal, window=window_size,
                                                    sinks=sink, dtype=dtype))
    assert torch.equal(out, fa.flash_attn_varlen_func(q, k_pages, v_pages, cu(Q_LENS), cu(k_lens), max(Q_LENS),
                                                      max(k_lens), causal=causal, window_size=window_size,
                                                      block_table=table, sinks=sink))


def test_varlen_paged_rows_outside_sequences_are_zero(vendor):
    h_q, h_kv, d = 2, 1, 16
    gen = torch.Generator().manual_seed(3)
    q_lens, k_lens = [3, 2], [5, 17]
    q = rand(gen, sum(q_lens) + 2, h_q, d)  # two rows past the last sequence
    k_pages, v_pages, table, dense_k, dense_v = pages_for(gen, k_lens, 16, h_kv, d)
    out, lse, _ = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu(q_lens), cu(k_lens), 3, 17, causal=True,
                                            return_attn_probs=True, block_table=table)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    assert torch.equal(lse[:, -2:], torch.full_like(lse[:, -2:], INF))
    check_pair((out[:-2], lse[:, :-2]), lambda dtype: packed_ref(q[:-2], torch.cat(dense_k), torch.cat(dense_v),
                                                                 q_lens, k_lens, causal=True, dtype=dtype))


# ----------------------------------------------------------------------------- flash_attn_with_kvcache
def kvcache_case(gen, b, s_q, h_q, h_kv, d, n_max, lens, s_new, paged, page=16):
    """Inputs of one kvcache call, and the caches as dense per-sequence views for the reference."""
    q = rand(gen, b, s_q, h_q, d)
    new = (rand(gen, b, s_new, h_kv, d), rand(gen, b, s_new, h_kv, d)) if s_new else (None, None)
    if paged:
        k_cache, v_cache, table, _, _ = pages_for(gen, [n_max] * b, page, h_kv, d)
        table = table.clone()
        dense = lambda cache: cache[table.long()].reshape(b, -1, h_kv, d)  # noqa: E731
    else:
        k_cache, v_cache, table = rand(gen, b, n_max, h_kv, d), rand(gen, b, n_max, h_kv, d), None
        dense = lambda cache: cache  # noqa: E731
    return q, new, k_cache, v_cache, table, dense


KVCACHE = [  # b, s_q, h_q, h_kv, d, n_max, cache lengths (None: the whole cache), s_new, paged, causal, window, sinks
    (3, 1, 4, 2, 32, 48, [0, 17, 45], 1, False, True, (-1, -1), False),  # a decode step appending one token
    (3, 1, 4, 1, 16, 48, [3, 30, 47], 1, True, True, (-1, -1), True),
    (2, 3, 4, 2, 16, 40, [5, 30], 3, False, True, (7, 0), False),  # speculative tokens, a window
    (2, 3, 6, 2, 16, 64, [2, 40], 3, True, True, (-1, -1), True),
    (2, 4, 4, 2, 16, 40, [6, 21], 0, False, False, (-1, -1), False),  # non-causal: every query sees every key
    (2, 4, 4, 4, 16, 48, [6, 21], 2, True, False, (-1, -1), True),
    (2, 1, 4, 2, 16, 32, None, 0, False, False, (-1, -1), False),  # the whole cache
    (2, 2, 4, 2, 16, 32, None, 0, True, True, (5, -1), False),
    (2, 5, 2, 2, 16, 40, 9, 2, False, True, (-1, -1), False),  # an int cache length
    (2, 5, 2, 2, 16, 48, 9, 2, True, False, (-1, -1), True),
    (2, 7, 4, 2, 16, 40, [2, 30], 0, False, True, (-1, -1), False),  # more queries than cached keys in one
]


@pytest.mark.parametrize("case", KVCACHE)
def test_kvcache(vendor, case):
    b, s_q, h_q, h_kv, d, n_max, lens, s_new, paged, causal, window_size, sinks = case
    gen = torch.Generator().manual_seed(n_max + s_q)
    q, (k, v), k_cache, v_cache, table, dense = kvcache_case(gen, b, s_q, h_q, h_kv, d, n_max, lens, s_new, paged)
    sink = make_sinks(gen, h_q) if sinks else None
    seqlens = lens if lens is None or isinstance(lens, int) else torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    before_k, before_v = dense(k_cache).clone(), dense(v_cache).clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                          causal=causal, window_size=window_size, return_softmax_lse=True,
                                          sinks=sink)
    starts = [n_max] * b if lens is None else [lens] * b if isinstance(lens, int) else lens
    after_k, after_v = dense(k_cache), dense(v_cache)
    # The cache holds the new keys and values at each sequence's length, and nothing else changed.
    want_k, want_v = before_k.clone(), before_v.clone()
    for i, start in enumerate(starts):
        if s_new:
            want_k[i, start:start + s_new], want_v[i, start:start + s_new] = k[i], v[i]
    assert torch.equal(after_k, want_k) and torch.equal(after_v, want_v)

    def ref(dtype):
        outs, lses = zip(*(attention_ref(q[i], after_k[i, :start + s_new], after_v[i, :start + s_new], causal=causal,
                                         window=window_size, sinks=sink, dtype=dtype)
                           for i, start in enumerate(starts)), strict=True)
        return torch.stack(outs), torch.stack(lses)

    check_pair((out, lse), ref)


def test_kvcache_long_query_blocks_are_cut(vendor, monkeypatch):
    """Query blocks beyond DECODE_ROWS rows per kv head run as several decode calls: same answer."""
    gen = torch.Generator().manual_seed(11)
    b, s_q, h_q, h_kv, d, n_max = 2, 9, 4, 2, 16, 48
    q, _, k_cache, v_cache, table, dense = kvcache_case(gen, b, s_q, h_q, h_kv, d, n_max, None, 0, True)
    seqlens = torch.tensor([12, 47], dtype=torch.int32, device=DEVICE)
    sink = make_sinks(gen, h_q)
    keys, values = dense(k_cache), dense(v_cache)

    def ref(causal, window_size, dtype):
        outs, lses = zip(*(attention_ref(q[i], keys[i, :n], values[i, :n], causal=causal, window=window_size,
                                         sinks=sink, dtype=dtype) for i, n in enumerate(seqlens.tolist())), strict=True)
        return torch.stack(outs), torch.stack(lses)

    for causal, window_size in ((True, (4, 0)), (False, (-1, -1))):
        for rows in (fa.DECODE_ROWS, 4):  # 4: 2 queries of the GQA group of 2 per piece
            monkeypatch.setattr(fa, "DECODE_ROWS", rows)
            res = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                             causal=causal, window_size=window_size, return_softmax_lse=True,
                                             sinks=sink)
            monkeypatch.undo()
            check_pair(res, lambda dtype, c=causal, w=window_size: ref(c, w, dtype))


# ----------------------------------------------------------------------------- each vendor's kernels
@pytest.mark.skipif(HAS_GPU, reason="on a GPU the plain backend runs the kernels")
@pytest.mark.parametrize("vendor", ["nvidia", "amd"], indirect=True)
def test_vendor_kernels(vendor, monkeypatch):
    """A few cases of each function through `vendor`'s kernels in the interpreter (on a GPU, on it):
    every op call runs one of that vendor's variants, none the reference."""
    ran = []

    def spy(handle):
        def call(*args, **kwargs):
            variant = handle.choice(*args, **kwargs).variant
            ran.append((handle.op.name, variant and variant.vendor))
            return handle(*args, **kwargs)
        return call

    for name in ("_flash", "_sink", "_decode"):
        assert getattr(fa, name).vendor == vendor
        monkeypatch.setattr(fa, name, spy(getattr(fa, name)))
    test_func(vendor, SHAPES[1], True, (5, -1), False)
    test_varlen(vendor, (4, 2), True, (-1, -1), True)
    test_kvcache(vendor, KVCACHE[1])
    test_kvcache(vendor, KVCACHE[5])
    test_varlen_paged(vendor, True, (5, -1), False, 8, monkeypatch)
    test_func_gradients(vendor)  # sink_attention's backward kernels
    assert {op for op, _ in ran} == {"flash_attention", "sink_attention", "decode"}
    assert {v for _, v in ran} == {vendor}, ran


def test_window_bounds_at_the_edge(vendor):
    """A left bound of s_k - 2 still cuts key 0 off the last query; s_k - 1 cuts nothing. Without causal,
    a right bound of s_q - 2 cuts the last key off the first query (no kreg form); s_q - 1 cuts nothing."""
    gen = torch.Generator().manual_seed(5)
    b, s_q, s_k, h_q, h_kv, d = 1, 7, 13, 2, 1, 16
    q, k, v = rand(gen, b, s_q, h_q, d), rand(gen, b, s_k, h_kv, d), rand(gen, b, s_k, h_kv, d)
    for causal, window_size in ((True, (s_k - 2, 0)), (True, (s_k - 1, 0)), (False, (-1, s_q - 1)), (True, (0, 0))):
        res = fa.flash_attn_func(q, k, v, causal=causal, window_size=window_size, return_attn_probs=True)[:2]
        check_pair(res, lambda dtype, c=causal, w=window_size: batched_ref(q, k, v, causal=c, window=w, dtype=dtype))
    with pytest.raises(ValueError, match="^window_size:"):
        fa.flash_attn_func(q, k, v, window_size=(-1, s_q - 2))


# ----------------------------------------------------------------------------- what raises
def _dense_args():
    gen = torch.Generator().manual_seed(0)
    return rand(gen, 1, 13, 2, 16), rand(gen, 1, 13, 1, 16), rand(gen, 1, 13, 1, 16)


def _varlen_args():
    q, k, v = _dense_args()
    return q[0], k[0], v[0], cu([13]), cu([13]), 13, 13


REFUSED = [
    ("func", dict(dropout_p=0.1), "dropout_p"),
    ("func", dict(softcap=30.0), "softcap"),
    ("func", dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
    ("func", dict(window_size=(4, -1)), "window_size"),  # a left window without causal
    ("func", dict(window_size=(-1, 2)), "window_size"),  # a right window inside the sequence
    ("func", dict(window_size=(3, 3)), "window_size"),
    ("func", dict(window_size=(1, 2, 3)), "window_size"),
    ("varlen", dict(dropout_p=0.5), "dropout_p"),
    ("varlen", dict(window_size=(-1, 4)), "window_size"),
    ("varlen", dict(softcap=1.0), "softcap"),
    ("kvcache", dict(rotary_cos=torch.ones(13, 8)), "rotary_cos"),
    ("kvcache", dict(rotary_sin=torch.ones(13, 8)), "rotary_sin"),
    ("kvcache", dict(cache_batch_idx=torch.zeros(1, dtype=torch.int32)), "cache_batch_idx"),
    ("kvcache", dict(cache_leftpad=torch.zeros(1, dtype=torch.int32)), "cache_leftpad"),
    ("kvcache", dict(softcap=5.0), "softcap"),
    ("kvcache", dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
    ("kvcache", dict(window_size=(2, 1), causal=False), "window_size"),
    ("kvcache", dict(k="new"), "v"),  # k without v
    ("kvcache", dict(v="new"), "k"),
    ("kvcache", dict(k="new", v="new", cache_seqlens=None), "cache_seqlens"),
    ("kvcache", dict(k="new", v="new", cache_seqlens=12), "cache_seqlens"),  # 2 new tokens past 13 slots
    ("kvcache", dict(k="wide", v="wide"), "k"),
    ("kvcache", dict(k="new", v="new", cache_seqlens="int64"), "cache_seqlens"),
    ("kvcache", dict(num_splits=1.5), "num_splits"),
    ("kvcache", dict(k="new", v="new", sinks=torch.zeros(3)), "sinks"),
    ("kvcache", dict(k="new", v="new", softmax_scale=float("nan")), "softmax_scale"),
    ("kvcache", dict(k="new", v="new", num_splits=None), "num_splits"),
]


@pytest.mark.parametrize("function, kwargs, name", REFUSED)
def test_what_kreg_cannot_express_raises_naming_it(function, kwargs, name):
    if function == "func":
        call = lambda: fa.flash_attn_func(*_dense_args(), **kwargs)  # noqa: E731
    elif function == "varlen":
        call = lambda: fa.flash_attn_varlen_func(*_varlen_args(), **kwargs)  # noqa: E731
    else:
        q, k_cache, v_cache = _dense_args()
        q = q[:, :2]
        gen = torch.Generator().manual_seed(1)
        new = {"new": rand(gen, 1, 2, 1, 16), "wide": rand(gen, 1, 2, 2, 16)}
        kwargs = {key: new.get(value, value) if isinstance(value, str) else value for key, value in kwargs.items()}
        if kwargs.get("cache_seqlens") == "int64":
            kwargs["cache_seqlens"] = torch.tensor([3], device=DEVICE)
        kwargs.setdefault("cache_seqlens", torch.tensor([3], dtype=torch.int32, device=DEVICE))
        before = k_cache.clone(), v_cache.clone()
        call = lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)  # noqa: E731
    with pytest.raises((ValueError, TypeError), match=rf"^{name}:"):
        call()
    if function == "kvcache":  # a refused call writes nothing
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
