"""kreg.compat.flash_mla against FlashMLA's sparse prefill semantics, written here: each query head reads
the kv rows its kv group's indices name (an index outside [0, s_kv), or a slot at or past topk_length,
is unused); lse and max_logits are over the used slots only; a sink scales the output by
sigmoid(lse - sink); a row with no used slot is 0 with lse +inf and max_logits -inf.

FlashAttention's tolerance rule, as in test_compat_flash_attn.py: our error against an fp64 reference
is at most twice that of plain PyTorch at the input precision (fp16), plus a tiny absolute term. The
plain backend (CPU tensors: the op's reference) runs the grid, and each vendor's kernels run a case in
the interpreter."""

import inspect

import pytest
import torch

import kreg.compat.flash_mla as fm
from tests.conftest import HAS_GPU

DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
DTYPE = torch.float16
INF = float("inf")


def sparse_ref(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None, dtype=torch.float64):
    """(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q]) computed in `dtype`."""
    s_q, h_q, _ = q.shape
    s_kv, h_kv = kv.shape[:2]
    topk = indices.shape[-1]
    idx = indices.to("cpu", torch.long)
    used = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        used &= torch.arange(topk)[None, None, :] < topk_length.to("cpu")[:, None, None]
    rows = kv.to("cpu", dtype)[torch.where(used, idx, 0), torch.arange(h_kv)[None, :, None]]  # [s_q, h_kv, topk, d]
    group = h_q // h_kv
    rows, used = rows.repeat_interleave(group, dim=1), used.repeat_interleave(group, dim=1)
    z = ((rows @ q.to("cpu", dtype)[..., None]).squeeze(-1) * sm_scale).masked_fill(~used, -INF)
    lse, max_logits = torch.logsumexp(z, dim=-1), z.max(dim=-1).values
    total = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.to("cpu", dtype)[None, :])
    probs = torch.exp(z - total[..., None]).masked_fill(~used, 0)
    out = (probs[..., None, :] @ rows[..., :d_v]).squeeze(-2)
    return out, max_logits, lse.masked_fill(lse == -INF, INF)


def check(got, ref, plain, what, atol=1e-4):
    got, ref, plain = (t.detach().to("cpu", torch.float64) for t in (got, ref, plain))
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    assert torch.equal(got[~finite], ref[~finite]), f"{what}: rows without slots differ"
    err = (got[finite] - ref[finite]).abs().max().item()
    base = (plain[finite] - ref[finite]).abs().max().item()
    assert err <= 2 * base + atol, f"{what}: error {err:.3g} vs plain PyTorch's {base:.3g}"


@pytest.fixture(params=[None])
def vendor(request):
    """The backend a test runs on: None is the plain one (on CPU tensors, the op's reference)."""
    previous = fm.use_vendor(request.param)
    yield request.param
    fm.use_vendor(previous)


SHAPES = [  # s_q, s_kv, h_q, h_kv, d_qk, d_v, topk
    (5, 37, 16, 1, 96, 64, 40),
    (17, 13, 8, 2, 48, 32, 16),
]


def make_case(shape, sink, lengths, seed):
    s_q, s_kv, h_q, h_kv, d_qk, d_v, topk = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=gen).to(DEVICE, DTYPE)
    kv = torch.randn(s_kv, h_kv, d_qk, generator=gen).to(DEVICE, DTYPE)
    indices = torch.randint(0, s_kv, (s_q, h_kv, topk), generator=gen)
    indices[:, :, -3:] = torch.tensor([-1, s_kv, 2**31 - 1])  # unused slots
    indices[1, :, :] = -1  # a query with none
    indices[2, :, 1] = indices[2, :, 0]  # a duplicate counts twice
    attn_sink = (torch.randn(h_q, generator=gen) * 2).to(DEVICE) if sink else None
    topk_length = torch.randint(0, topk + 1, (s_q,), generator=gen).to(DEVICE, torch.int32) if lengths else None
    return q, kv, indices.to(DEVICE, torch.int32), d_qk**-0.5 * 1.3, d_v, attn_sink, topk_length


def test_signature_is_flashmlas():
    assert str(inspect.signature(fm.flash_mla_sparse_fwd)) == (
        "(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None)")


@pytest.mark.parametrize("lengths", [False, True])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_fwd(vendor, shape, sink, lengths):
    args = make_case(shape, sink, lengths, seed=sum(shape))
    res = fm.flash_mla_sparse_fwd(*args)  # FlashMLA's positional form
    assert isinstance(res, tuple) and len(res) == 3
    out, max_logits, lse = res
    assert out.dtype == DTYPE and max_logits.dtype == lse.dtype == torch.float32
    ref, plain = sparse_ref(*args), sparse_ref(*args, dtype=DTYPE)
    for what, got, r, p in zip(("out", "max_logits", "lse"), res, ref, plain, strict=True):
        check(got, r, p, what)
    q, kv, indices, sm_scale, d_v, attn_sink, topk_length = args
    by_name = fm.flash_mla_sparse_fwd(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink,
                                      topk_length=topk_length)
    assert all(torch.equal(a, b) for a, b in zip(res, by_name, strict=True))


@pytest.mark.skipif(HAS_GPU, reason="on a GPU the plain backend runs the kernels")
@pytest.mark.parametrize("vendor", ["nvidia", "amd"], indirect=True)
def test_vendor_kernels(vendor):
    """One case through `vendor`'s kernels in the interpreter (on a GPU, on it)."""
    args = make_case(SHAPES[1], True, True, seed=1)
    variant = fm._sparse_mla.choice(*args).variant
    assert variant is not None and variant.vendor == vendor
    ref, plain = sparse_ref(*args), sparse_ref(*args, dtype=DTYPE)
    for what, got, r, p in zip(("out", "max_logits", "lse"), fm.flash_mla_sparse_fwd(*args), ref, plain, strict=True):
        check(got, r, p, what)


def test_what_it_refuses_raises_naming_it():
    q, kv, indices, sm_scale, d_v, attn_sink, topk_length = make_case(SHAPES[1], False, False, seed=2)
    with pytest.raises(TypeError, match="indexer_topk"):
        fm.flash_mla_sparse_fwd(q, kv, indices, sm_scale, indexer_topk=512)
    with pytest.raises(TypeError, match="^indices:"):
        fm.flash_mla_sparse_fwd(q, kv, indices.long(), sm_scale)
    with pytest.raises(ValueError, match="^d_v"):
        fm.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=q.shape[-1] + 1)
