"""The GSA layer's fused elementwise kernels (kernels.common.gsa_layer: RoPE with the value gate, the
output gate) against the layer's PyTorch math in fp32: outputs in relative error, gradients against
autograd of that math, odd lengths, GQA, head dims whose half is no power of two, strided inputs, large
angles, argument errors; and their offline compiles for sm_90, gfx942 and gfx950 without spills.

On the CPU the kernels run in the interpreter in fp16 with each vendor's tiles; on a GPU in bf16 with
the GPU's, plus a sequence long enough for angles past 2**16 quarter turns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kreg.kernels.common import gsa_layer
from kreg.kernels.common.gsa_layer import output_gate, rope_value_gate
from kreg.layers.gated_sparse_attention import RotaryEmbedding
from kreg.ops.testing import GRAD_TOLERANCE, TOLERANCE, assert_close

from .conftest import HAS_GPU, gpu

DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
DTYPE = torch.bfloat16 if HAS_GPU else torch.float16
VENDORS = [None] if HAS_GPU else ["nvidia", "amd"]
ROOT = Path(__file__).resolve().parents[1]


def _randn(*shape: int, seed: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _inputs(b: int, t: int, h: int, h_kv: int, d: int, strided: bool = False):
    """q, k, v and the gate logits; strided: token-major views of wider rows (as column slices of one
    projection output would be)."""
    shapes = ((h, 0), (h_kv, 1), (h_kv, 2), (h_kv, 3))
    if not strided:
        return [_randn(b, t, heads, d, seed=seed) for heads, seed in shapes]
    return [_randn(b, t, heads * d + 24, seed=seed)[..., 8:8 + heads * d].view(b, t, heads, d)
            for heads, seed in shapes]


def _rope_math(q, k, v, gate, inv_freq):
    """The layer's PyTorch math in fp32: RotaryEmbedding, then v * sigmoid(gate)."""
    rope = RotaryEmbedding(q.shape[-1], 10000.0).to(q.device)
    rope.inv_freq.copy_(inv_freq.float())
    q32, k32 = rope(q.float(), k.float())
    return q32, k32, v.float() * torch.sigmoid(gate.float())


def _leaves(tensors):
    return [x.detach().requires_grad_() for x in tensors]


def _grads(outputs, inputs, seed: int) -> list[torch.Tensor]:
    """Gradients of inputs for seeded cotangents of every output (in fp32 for comparison)."""
    cotangents = [_randn(*o.shape, seed=seed + i, dtype=o.dtype) for i, o in enumerate(outputs)]
    return [g.float() for g in torch.autograd.grad(outputs, inputs, cotangents)]


CASES = [  # b, t, h_q, h_kv, d: GQA 2, MHA with a half of 24 (padded to 32), more kv heads than q heads
    (2, 17, 4, 2, 32),
    (1, 17, 4, 4, 48),
    (1, 9, 2, 4, 64),
]


def _small_tiles(monkeypatch) -> None:
    """Tiles of 256 values per tensor for every vendor: several token blocks at t 17 (the defaults take
    all 17 tokens in one program at these head dims)."""
    for vendor, tiles in gsa_layer.VENDOR_TILES.items():
        monkeypatch.setitem(gsa_layer.VENDOR_TILES, vendor, dataclasses.replace(tiles, elements=256))


@pytest.mark.parametrize("vendor", VENDORS, ids=lambda v: v or "device")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-t{}-h{}-kv{}-d{}".format(*c))
@pytest.mark.parametrize("layout", ["contiguous", "strided", "small-tiles"])
def test_rope_value_gate_matches_the_layer_math(monkeypatch, vendor, case, layout):
    b, t, h, h_kv, d = case
    strided = layout == "strided"
    if layout == "small-tiles":
        _small_tiles(monkeypatch)
    inputs = _leaves(_inputs(b, t, h, h_kv, d, strided))
    inv_freq = RotaryEmbedding(d, 10000.0).inv_freq.to(DEVICE)
    got = rope_value_gate(*inputs, inv_freq, vendor=vendor)
    want = _rope_math(*[x.detach().float() for x in inputs], inv_freq)
    for out, x in zip(got, inputs[:3], strict=True):
        assert out.shape == x.shape and out.dtype == DTYPE and out.is_contiguous()
    assert_close(list(got), list(want), TOLERANCE[DTYPE], what="rope_value_gate")

    refs = _leaves([x.float() for x in inputs])
    got_grads = _grads(got, inputs, seed=10)
    want_grads = _grads(_rope_math(*refs, inv_freq), refs, seed=10)
    assert_close(got_grads, want_grads, GRAD_TOLERANCE[DTYPE], what="rope_value_gate gradients")


@pytest.mark.parametrize("vendor", VENDORS, ids=lambda v: v or "device")
def test_rope_large_angles_in_fp32(monkeypatch, vendor):
    """inv_freq up to 6000 turns 16 positions into angles near 1e5 (about 2**16 quarter turns): the
    kernel's own angle reduction against float64 cos and sin of the same fp32 angles (in several
    token blocks)."""
    _small_tiles(monkeypatch)
    b, t, h, d = 1, 17, 2, 16
    q, k, v, gate = _inputs(b, t, h, h, d)
    q, k, v, gate = (x.float() for x in (q, k, v, gate))
    inv_freq = torch.linspace(6000.0, 0.01, d // 2, device=DEVICE)
    got_q, got_k, _ = rope_value_gate(q, k, v, gate, inv_freq, vendor=vendor)
    angle = (torch.arange(t, device=DEVICE, dtype=torch.float32)[:, None] * inv_freq).double()
    cos, sin = (torch.cat([f(angle)] * 2, -1)[None, :, None, :] for f in (torch.cos, torch.sin))
    for got, x in ((got_q, q), (got_k, k)):
        x = x.double()
        first, second = x.chunk(2, -1)
        assert_close(got, x * cos + torch.cat([-second, first], -1) * sin, 2e-6, what="large-angle RoPE")


@pytest.mark.parametrize("vendor", VENDORS, ids=lambda v: v or "device")
def test_unused_outputs_and_broadcast_gradients(vendor):
    """A loss on the rotated q alone: autograd hands the backward an expanded cotangent and zeros for k
    and v; dq is the inverse rotation of ones, the other gradients are zero."""
    inputs = _leaves(_inputs(1, 17, 4, 2, 32))
    inv_freq = RotaryEmbedding(32, 10000.0).inv_freq.to(DEVICE)
    q_out, _, _ = rope_value_gate(*inputs, inv_freq, vendor=vendor)
    q_out.sum().backward()
    ref = inputs[0].detach().float().requires_grad_()
    _rope_math(ref, *[x.detach().float() for x in inputs[1:]], inv_freq)[0].sum().backward()
    assert_close(inputs[0].grad, ref.grad, GRAD_TOLERANCE[DTYPE], what="dq")
    for x in inputs[1:]:
        assert x.grad is not None and not x.grad.any()


@pytest.mark.parametrize("vendor", VENDORS, ids=lambda v: v or "device")
@pytest.mark.parametrize("shape", [(2, 17, 4, 32), (1, 9, 3, 48)], ids=["b2-t17-h4-d32", "b1-t9-h3-d48"])
def test_output_gate_matches_the_layer_math(monkeypatch, vendor, shape):
    """Rows of b2-t17 cross the batch boundary inside a program; a row of b1-t9 has 144 features, a
    partial column block (on the CPU with small tiles: several blocks of rows and of columns)."""
    b, t, h, d = shape
    if not HAS_GPU:
        _small_tiles(monkeypatch)
    o = _randn(b, t, h, d, seed=4).requires_grad_()
    # The gate as the layer passes it: a view of a projection, here a slice of wider rows.
    gate = _randn(b, t, h * d + 16, seed=5)[..., 16:].view(b, t, h, d).detach().requires_grad_()
    got = output_gate(o, gate, vendor=vendor)
    assert got.shape == o.shape and got.dtype == DTYPE and got.is_contiguous()
    o32, g32 = _leaves([o.float(), gate.float()])
    want = o32 * torch.sigmoid(g32)
    assert_close(got, want, TOLERANCE[DTYPE], what="output_gate")
    assert_close(_grads([got], [o, gate], seed=20), _grads([want], [o32, g32], seed=20), GRAD_TOLERANCE[DTYPE],
                 what="output_gate gradients")


def test_no_autograd_without_grad():
    q, k, v, gate = _inputs(1, 5, 2, 2, 16)
    inv_freq = RotaryEmbedding(16, 10000.0).inv_freq.to(DEVICE)
    vendor = VENDORS[0]
    assert all(y.grad_fn is None for y in rope_value_gate(q, k, v, gate, inv_freq, vendor=vendor))
    with torch.no_grad():
        assert output_gate(q.requires_grad_(), gate, vendor=vendor).grad_fn is None


def test_argument_errors(monkeypatch):
    q, k, v, gate = _inputs(1, 5, 2, 2, 16)
    inv_freq = RotaryEmbedding(16, 10000.0).inv_freq.to(DEVICE)
    vendor = VENDORS[0]

    def rope(**changes):
        args = {"q": q, "k": k, "v": v, "gate": gate, "inv_freq": inv_freq, **changes}
        return rope_value_gate(args["q"], args["k"], args["v"], args["gate"], args["inv_freq"], vendor=vendor)

    with pytest.raises(TypeError, match="^q: expected float16, bfloat16 or float32"):
        rope(q=q.to(torch.int32))
    with pytest.raises(TypeError, match="^v: expected"):
        rope(v=v.float())
    with pytest.raises(TypeError, match="^gate: expected a tensor"):
        rope(gate=None)
    with pytest.raises(TypeError, match="^inv_freq:"):
        rope(inv_freq=torch.ones(8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="^q: expected 4 dimensions"):
        rope(q=q[0])
    with pytest.raises(ValueError, match="^q: expected an even head dim"):
        rope(q=q[..., :15], k=k[..., :15], v=v[..., :15], gate=gate[..., :15])
    with pytest.raises(ValueError, match=r"^k: expected shape \[1, 5, h_kv, 16\]"):
        rope(k=k[:, :4])
    with pytest.raises(ValueError, match="^gate: expected k's shape"):
        rope(gate=gate[:, :, :1])
    with pytest.raises(ValueError, match=r"^inv_freq: expected shape \[8\]"):
        rope(inv_freq=inv_freq[:7])
    with pytest.raises(ValueError, match="^k: the last dimension must be contiguous"):
        rope(k=k.transpose(2, 3))
    with pytest.raises(ValueError, match="^vendor: expected one of"):
        rope_value_gate(q, k, v, gate, inv_freq, vendor="intel")
    with pytest.raises(ValueError, match="^gate: expected o's shape"):
        output_gate(q, gate[:, :4], vendor=vendor)
    with pytest.raises(ValueError, match=r"^o: expected each token's \[h, d\] features contiguous"):
        output_gate(q.transpose(1, 2), q.transpose(1, 2).contiguous(), vendor=vendor)
    with pytest.raises(TypeError, match="^gate: expected"):
        output_gate(q, q.to(torch.float64), vendor=vendor)
    if HAS_GPU:
        other = "amd" if gsa_layer.detect(DEVICE).vendor == "nvidia" else "nvidia"
        with pytest.raises(ValueError, match=f"^vendor: '{other}' kernels cannot run"):
            output_gate(q, q, vendor=other)
    else:
        monkeypatch.setattr(gsa_layer, "interpreter_enabled", lambda: False)
        with pytest.raises(RuntimeError, match="need the interpreter"):
            output_gate(q, q, vendor="amd")


@gpu
def test_long_sequence_angles():
    """Positions up to 131071 (angles past 2**16 quarter turns at inv_freq 1) on the GPU, fp32."""
    t, d = 131072, 64
    q, k, v, gate = (x.float() for x in _inputs(1, t, 1, 1, d))
    inv_freq = RotaryEmbedding(d, 10000.0).inv_freq.to(DEVICE)
    got = rope_value_gate(q, k, v, gate, inv_freq)
    assert_close(list(got), list(_rope_math(q, k, v, gate, inv_freq)),
                 1e-5, what="long-sequence RoPE")


def test_default_tiles_compile_without_spills():
    """The four kernels at the layer's defaults (d 128, 16 heads, bf16) with each vendor's tiles: sm_90,
    gfx942 and gfx950 compiles (in a process without TRITON_INTERPRET) fit without spills."""
    script = textwrap.dedent("""
        import json
        import torch
        from kreg.kernels.common import gsa_layer
        from kreg.core.device import preset
        from kreg.tuning.compile_check import compile_job
        from kreg.tuning.launch_record import KernelLaunch, recorded_launches, specialize

        b, t, heads, d = 1, 4096, 16, 128
        meta = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.bfloat16)
        q, k, v, gate, o = meta(b, t, heads, d), meta(b, t, heads, d), meta(b, t, heads, d), meta(b, t, heads, d), \
            meta(b, t, heads, d)
        inv_freq = torch.empty(d // 2, device="meta", dtype=torch.float32)
        for vendor, targets in (("nvidia", ("h200",)), ("amd", ("mi300x", "mi355x"))):
            tiles = gsa_layer.VENDOR_TILES[vendor]
            with recorded_launches() as launches:  # the layer's four launches, as it makes them
                gsa_layer._rope_value_gate_forward(q, k, v, gate, inv_freq, tiles)
                gsa_layer._rope_value_gate_backward(q, k, v, v, gate, inv_freq, tiles)
                gsa_layer._output_gate_forward(o, gate, tiles)
                gsa_layer._output_gate_backward(o, o, gate, tiles)
            for kernel, args, kwargs in launches:
                for target in targets:
                    device = preset(target)
                    r = compile_job(specialize(KernelLaunch(kernel, args, kwargs, frozenset()), device), device)
                    print(json.dumps({"kernel": r.kernel, "target": target, "fits": r.fits, "spills": r.spills,
                                      "registers": r.registers, "reason": r.reason}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(rows) == 12, proc.stderr[-3000:]
    kernels = {"_gsa_rope_value_gate_kernel", "_gsa_rope_value_gate_bwd_kernel", "_gsa_output_gate_kernel",
               "_gsa_output_gate_bwd_kernel"}
    assert {(r["kernel"], r["target"]) for r in rows} == {(k, t) for k in kernels for t in ("h200", "mi300x", "mi355x")}
    for row in rows:
        assert row["fits"] and row["spills"] == 0 and 0 < row["registers"] <= 255, row
