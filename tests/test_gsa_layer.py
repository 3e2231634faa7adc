"""layers.GatedSparseAttention: the registry backend (Triton kernels, the fused RoPE and gate kernels
included; the interpreter on the CPU, both vendors) against the reference backend of the same module:
outputs, parameter gradients, adaptive k, the indexer's one-GEMM projections, the shared state_dict,
NVTX ranges and argument errors."""

from __future__ import annotations

import pytest
import torch

from kreg import layers
from kreg.layers import gated_sparse_attention as gsa_layer
from kreg.ops.testing import GRAD_TOLERANCE, TOLERANCE, assert_close

from .conftest import HAS_GPU

DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
DTYPE = torch.bfloat16 if HAS_GPU else torch.float16
VENDORS = [None] if HAS_GPU else ["nvidia", "amd"]
TINY = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, d_indexer=16, n_indexer_heads=2, k=5)
STEPS = ["qkv_proj", "value_gate", "rotary_emb", "indexer", "topk_select", "sparse_attn", "output_gate", "o_proj"]


def _layer(**overrides) -> layers.GatedSparseAttention:
    torch.manual_seed(0)
    layer = layers.GatedSparseAttention(**{**TINY, **overrides})
    with torch.no_grad():
        layer.indexer.idx_bias.normal_(0.0, 0.5)
    return layer.to(device=DEVICE, dtype=DTYPE)


def _x(b: int, t: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, TINY["d_model"], generator=gen).to(DEVICE, DTYPE)


def _run(layer, x, backend: str, vendor: str | None):
    """(output, gradients of every parameter that gets one) for a seeded cotangent."""
    layer.backend, layer.vendor = backend, vendor
    layer.zero_grad()
    out = layer(x)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device, out.dtype)
    out.backward(cotangent)
    grads = {name: p.grad.float().clone() for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), grads


CASES = {  # layer arguments over TINY, (b, t)
    "fixed-k": ({}, (2, 11)),
    "adaptive-k": (dict(adaptive_k=True, k_min=2, k_max=7), (2, 11)),
    "d32-t17": (dict(head_dim=32), (1, 17)),
}


@pytest.mark.parametrize("vendor", VENDORS, ids=lambda v: v or "device")
@pytest.mark.parametrize("case", list(CASES))
def test_registry_backend_matches_reference_and_trains(vendor, case):
    extra, (b, t) = CASES[case]
    layer = _layer(**extra)
    x = _x(b, t)
    want, want_grads = _run(layer, x, "reference", None)
    got, got_grads = _run(layer, x, "registry", vendor)
    assert_close(got, want, TOLERANCE[DTYPE], what="layer output")
    assert set(got_grads) == set(want_grads)
    # The indexer's parameters get no gradient (selection is not differentiable); everything else does.
    assert not any(name.startswith("indexer.") for name in got_grads)
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "value_gate.gate_proj.weight",
            "output_gate.gate_proj.weight"} <= set(got_grads)
    for name, grad in got_grads.items():
        assert torch.isfinite(grad).all(), name
        assert_close(grad, want_grads[name], GRAD_TOLERANCE[DTYPE], what=f"gradient of {name}")


def test_adaptive_k_follows_the_score_spread():
    """k_i within [k_min, min(k_max, i + 1)], larger where a query's scores are flatter than the
    sequence's average, and one sequence's scores never change another's counts."""
    layer = _layer(adaptive_k=True, k=8, k_min=3, k_max=10)
    x = _x(2, 24, seed=5)
    q_idx, k_idx, w, bias = (y.float() for y in layer.indexer(x))
    lengths = gsa_layer.adaptive_topk_length(q_idx, k_idx, w, bias, 8, 3, 10)
    positions = torch.arange(1, 25, device=DEVICE)
    assert lengths.dtype == torch.int32 and lengths.shape == (2, 24)
    assert (lengths <= torch.clamp(positions, max=10)).all()
    assert (lengths[:, 2:] >= 3).all() and (lengths > 4).any() and (lengths < 8).any()
    alone = gsa_layer.adaptive_topk_length(q_idx[:1], k_idx[:1], w[:1], bias, 8, 3, 10)
    assert torch.equal(alone, lengths[:1])


def test_backends_share_one_state_dict():
    layer = _layer()
    keys = set(layer.state_dict())
    assert {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "indexer.idx_q_proj.weight",
            "indexer.idx_k_proj.weight", "indexer.idx_w_proj.weight", "indexer.idx_bias",
            "value_gate.gate_proj.weight", "output_gate.gate_proj.weight", "rotary_emb.inv_freq"} == keys
    other = layers.GatedSparseAttention(**TINY, backend="reference").to(device=DEVICE, dtype=DTYPE)
    other.load_state_dict(layer.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), other.state_dict().values(),
                                                 strict=True))


def test_indexer_projections_in_one_gemm():
    """The registry path's indexer inputs: the three projections' values, no autograd, and views whose
    token stride and starts are 16-element aligned."""
    layer = _layer()
    x = _x(2, 9)
    got, want = layer.indexer.selection_inputs(x), layer.indexer(x)
    for a, e in zip(got, want, strict=True):
        assert not a.requires_grad
        assert_close(a, e.detach(), TOLERANCE[DTYPE], what="indexer input")
    q_idx, k_idx, w, _ = got
    assert q_idx.stride(1) == k_idx.stride(1) == w.stride(1) == 64  # 2 x 16 + 16 + 2 features, padded
    assert all(y.data_ptr() % 32 == 0 for y in (q_idx, k_idx, w))


@pytest.mark.parametrize("backend", ["reference", "registry"])
def test_every_step_runs_in_its_nvtx_range(monkeypatch, backend):
    """The same ranges in the same order with either backend; the registry backend runs the fused
    kernels (the value gate's product inside gsa/rotary_emb)."""
    opened, fused = [], []

    def record(name):
        opened.append(name)
        return torch.autograd.profiler.record_function(name)

    def spy(fn):
        return lambda *args, **kwargs: fused.append((opened[-1], fn.__name__)) or fn(*args, **kwargs)

    monkeypatch.setattr(gsa_layer, "nvtx_range", record)
    for name in ("rope_value_gate", "output_gate"):
        monkeypatch.setattr(gsa_layer, name, spy(getattr(gsa_layer, name)))
    _layer(backend=backend, vendor=VENDORS[0])(_x(1, 4))
    assert opened == [f"gsa/{step}" for step in STEPS]
    if backend == "registry":
        assert fused == [("gsa/rotary_emb", "rope_value_gate"), ("gsa/output_gate", "output_gate")]
    else:
        assert fused == []


def test_defaults_and_argument_errors():
    layer = layers.GatedSparseAttention(d_model=64, head_dim=8, d_indexer=8)
    assert (layer.n_heads, layer.n_kv_heads, layer.k, layer.indexer.n_heads) == (16, 16, 2048, 4)
    assert layer.backend == "registry" and not layer.adaptive_k
    with pytest.raises(ValueError, match="^backend:"):
        layers.GatedSparseAttention(**TINY, backend="triton")
    with pytest.raises(ValueError, match="^backend:"):
        layer.backend = "fast"
    with pytest.raises(ValueError, match="^n_kv_heads:"):
        layers.GatedSparseAttention(**{**TINY, "n_kv_heads": 3})
    with pytest.raises(ValueError, match="^k_min:"):
        layers.GatedSparseAttention(**TINY, k_min=9, k_max=8)
    with pytest.raises(ValueError, match="^k:"):
        layers.GatedSparseAttention(**{**TINY, "k": 0})
    with pytest.raises(ValueError, match="^x:"):
        _layer()(torch.zeros(2, 3, 31, device=DEVICE, dtype=DTYPE))
