"""The GSA layer's elementwise steps as Triton kernels both vendors share, with their backward kernels.

`rope_value_gate(q, k, v, gate, inv_freq)`: RoPE (rotate-half) on q [b, t, h_q, d] and k [b, t, h_kv, d]
at positions 0..t-1, and the value gate v * sigmoid(gate), in one pass: each input is read once and
each output ([b, t, h, d], contiguous: what the GSA ops take) written once. cos and sin come from
position * inv_freq in fp32 inside the kernel, as the layer's PyTorch math computes them (no cos/sin
tensors); a program computes them for its tokens and applies them to its heads of q and of k.

`output_gate(o, gate)`: o * sigmoid(gate), o and gate [b, t, h, d], out contiguous.

Both are differentiable through autograd Functions whose backward is one kernel each: RoPE's
transpose is the inverse rotation (the same formula with -sin; no activation of q or k is kept), the
gates' is the product rule with sigmoid' = s (1 - s). Math is fp32 in registers, the outputs and
gradients are stored in the inputs' dtype.

Elementwise work has nothing to tune per shape beyond tile sizes, so these are not registry ops: a
vendor differs only by `VENDOR_TILES` (elements per program, warps: a wavefront is 64 lanes). Reads
top-down: helpers, the four kernels, launchers, autograd Functions, the public functions, compile specs.
Semantics: the PyTorch math of `layers.gated_sparse_attention` (RotaryEmbedding, SigmoidGate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kreg.core.device import INTERPRETER_VENDOR, detect, interpreter_enabled
from kreg.core.nvtx import nvtx_range
from kreg.kernels.common.tiles import cdiv, next_pow2

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _leading_bits(x: float, bits: int) -> float:
    """x truncated to its `bits` leading significant bits (so that small multiples of it are exact)."""
    scale = 2.0 ** (bits - 1 - math.floor(math.log2(x)))
    return math.floor(x * scale) / scale


# pi / 2 in three parts for the angle reduction of `_sincos`: two of 8 significant bits (their products
# with a 16-bit integer are exact in fp32), then the rest.
_HALF_PI_1 = _leading_bits(math.pi / 2, 8)
_HALF_PI_2 = _leading_bits(math.pi / 2 - _HALF_PI_1, 8)
HALF_PI_1 = tl.constexpr(_HALF_PI_1)
HALF_PI_2 = tl.constexpr(_HALF_PI_2)
HALF_PI_3 = tl.constexpr(math.pi / 2 - _HALF_PI_1 - _HALF_PI_2)
TWO_OVER_PI = tl.constexpr(2 / math.pi)


@dataclass(frozen=True)
class ElementwiseTiles:
    """One vendor's launch shape: about `elements` values of each tensor per program (a [BLOCK_H,
    BLOCK_T, d] tile, or [BLOCK_R, BLOCK_N] for the output gate), up to `heads` heads per RoPE program,
    `num_warps` warps. With 32 values of a tensor per thread, a program keeps a few 16-byte loads of
    every input in flight."""

    elements: int
    heads: int
    num_warps: int


# The vendor difference, as data: 4 warps of 32 lanes (NVIDIA) or of 64 (AMD) with 32 values of each
# tensor per thread. Untimed defaults.
VENDOR_TILES = {
    "nvidia": ElementwiseTiles(elements=4096, heads=2, num_warps=4),
    "amd": ElementwiseTiles(elements=8192, heads=2, num_warps=4),
}


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _head_tile(b, t0, h0, t, n_heads, stride_b, stride_t, stride_h,
               BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Offsets [BLOCK_H, BLOCK_T, HALF_PAD] (int64) of the first half of heads h0.. of tokens t0.. of
    batch row b (the second half is + HALF), and the mask of the ones inside the tensor."""
    heads = h0 + tl.arange(0, BLOCK_H)
    tokens = t0 + tl.arange(0, BLOCK_T)
    offs = tl.arange(0, HALF_PAD)
    off = (b * stride_b + tokens.to(tl.int64)[None, :, None] * stride_t + heads.to(tl.int64)[:, None, None] * stride_h
           + offs[None, None, :])
    ok = (heads[:, None, None] < n_heads) & (tokens[None, :, None] < t) & (offs[None, None, :] < HALF)
    return off, ok


@triton.jit
def _rotate(x1, x2, cos, sin):
    """Rotate-half RoPE of a head's halves (x1, x2) in fp32; with -sin it is the inverse rotation."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _load_halves(X, off, ok, HALF: tl.constexpr):
    """A head tile's two halves (offsets `off` and `off + HALF`) as fp32, zeros where masked."""
    return (tl.load(X + off, mask=ok, other=0.0).to(tl.float32),
            tl.load(X + off + HALF, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def _store_halves(X, off, ok, y1, y2, HALF: tl.constexpr):
    """Store a head tile's two halves in X's dtype."""
    tl.store(X + off, y1.to(X.dtype.element_ty), mask=ok)
    tl.store(X + off + HALF, y2.to(X.dtype.element_ty), mask=ok)


@triton.jit
def _sincos(angle):
    """(sin, cos) of fp32 angles to ~1e-7, with no library call: Triton's tl.sin and tl.cos are
    libdevice's on NVIDIA, whose path for arguments past ~1e5 keeps a 32-byte local array (stack memory
    in every program). j = the nearest multiple of pi/2; r = angle - j pi/2 by FMAs with pi/2 in three
    parts (exact up to the last FMA: the first two parts end in few bits; without FMA, as in the
    interpreter, still exact for |j| < 2**16); Taylor polynomials on |r| <= pi/4 (truncation < 2e-9);
    the quadrant j mod 4 swaps and negates them."""
    j = tl.floor(angle * TWO_OVER_PI + 0.5)
    r = tl.fma(-j, HALF_PI_1, angle)
    r = tl.fma(-j, HALF_PI_2, r)
    r = tl.fma(-j, HALF_PI_3, r)
    r2 = r * r
    s = r + r * r2 * (-1.0 / 6 + r2 * (1.0 / 120 + r2 * (-1.0 / 5040 + r2 * (1.0 / 362880))))
    c = 1.0 + r2 * (-0.5 + r2 * (1.0 / 24 + r2 * (-1.0 / 720 + r2 * (1.0 / 40320 + r2 * (-1.0 / 3628800)))))
    quadrant = j.to(tl.int32) & 3
    swap = (quadrant & 1) != 0
    sin = tl.where(swap, c, s)
    cos = tl.where(swap, s, c)
    return tl.where((quadrant & 2) != 0, -sin, sin), tl.where(((quadrant + 1) & 2) != 0, -cos, cos)


@triton.jit
def _angles(INV_FREQ, t0, BLOCK_T: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """(cos, sin) [1, BLOCK_T, HALF_PAD] fp32 of positions t0.. times inv_freq, broadcast over a program's
    heads (the fp32 product is the layer's PyTorch angle, bit for bit). The layout may repeat them in
    the threads of different heads: ~30 FLOPs a value, small next to the loads."""
    offs = tl.arange(0, HALF_PAD)
    inv_freq = tl.load(INV_FREQ + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    angle = (t0 + tl.arange(0, BLOCK_T)).to(tl.float32)[:, None] * inv_freq[None, :]
    sin, cos = _sincos(angle)
    return cos[None, :, :], sin[None, :, :]


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _gsa_rope_value_gate_kernel(
    Q, K, V, G, INV_FREQ, QO, KO, VO,
    t, h_q, h_kv,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_gb, stride_gt, stride_gh,
    stride_qob, stride_qot, stride_qoh, stride_kob, stride_kot, stride_koh,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program: tokens program_id(0) * BLOCK_T.. and heads program_id(1) * BLOCK_H.. of batch row
    program_id(2): RoPE of those q heads (if < h_q) and k heads (if < h_kv) and v * sigmoid(g) of those
    v heads, each head in its two halves of HALF values. VO has KO's strides. Every load of a part is
    issued before its stores (the outputs might alias the inputs as far as the compiler knows)."""
    t0 = tl.program_id(0) * BLOCK_T
    h0 = tl.program_id(1) * BLOCK_H
    b = tl.program_id(2).to(tl.int64)
    cos, sin = _angles(INV_FREQ, t0, BLOCK_T, HALF, HALF_PAD)
    if h0 < h_kv:
        k_in, ok = _head_tile(b, t0, h0, t, h_kv, stride_kb, stride_kt, stride_kh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        v_in, _ = _head_tile(b, t0, h0, t, h_kv, stride_vb, stride_vt, stride_vh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        g_in, _ = _head_tile(b, t0, h0, t, h_kv, stride_gb, stride_gt, stride_gh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        k1, k2 = _load_halves(K, k_in, ok, HALF)
        v1, v2 = _load_halves(V, v_in, ok, HALF)
        g1, g2 = _load_halves(G, g_in, ok, HALF)
        out, _ = _head_tile(b, t0, h0, t, h_kv, stride_kob, stride_kot, stride_koh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        y1, y2 = _rotate(k1, k2, cos, sin)
        _store_halves(KO, out, ok, y1, y2, HALF)
        _store_halves(VO, out, ok, v1 * tl.sigmoid(g1), v2 * tl.sigmoid(g2), HALF)
    if h0 < h_q:
        q_in, ok = _head_tile(b, t0, h0, t, h_q, stride_qb, stride_qt, stride_qh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        q1, q2 = _load_halves(Q, q_in, ok, HALF)
        out, _ = _head_tile(b, t0, h0, t, h_q, stride_qob, stride_qot, stride_qoh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        y1, y2 = _rotate(q1, q2, cos, sin)
        _store_halves(QO, out, ok, y1, y2, HALF)


@triton.jit
def _gsa_rope_value_gate_bwd_kernel(
    DQO, DKO, DVO, V, G, INV_FREQ, DQ, DK, DV, DG,
    t, h_q, h_kv,
    stride_dqob, stride_dqot, stride_dqoh, stride_dkob, stride_dkot, stride_dkoh,
    stride_dvob, stride_dvot, stride_dvoh,
    stride_vb, stride_vt, stride_vh, stride_gb, stride_gt, stride_gh,
    stride_dqb, stride_dqt, stride_dqh, stride_dkb, stride_dkt, stride_dkh,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program: the gradients of `_gsa_rope_value_gate_kernel`'s program with the same ids. dq and
    dk are the output gradients rotated back (the inverse rotation: -sin); with s = sigmoid(g),
    dv = dvo * s and dg = dvo * v * s * (1 - s). DK, DV and DG share strides."""
    t0 = tl.program_id(0) * BLOCK_T
    h0 = tl.program_id(1) * BLOCK_H
    b = tl.program_id(2).to(tl.int64)
    cos, sin = _angles(INV_FREQ, t0, BLOCK_T, HALF, HALF_PAD)
    if h0 < h_kv:
        dk_in, ok = _head_tile(b, t0, h0, t, h_kv, stride_dkob, stride_dkot, stride_dkoh, BLOCK_H, BLOCK_T, HALF,
                               HALF_PAD)
        dv_in, _ = _head_tile(b, t0, h0, t, h_kv, stride_dvob, stride_dvot, stride_dvoh, BLOCK_H, BLOCK_T, HALF,
                              HALF_PAD)
        v_in, _ = _head_tile(b, t0, h0, t, h_kv, stride_vb, stride_vt, stride_vh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        g_in, _ = _head_tile(b, t0, h0, t, h_kv, stride_gb, stride_gt, stride_gh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        dk1, dk2 = _load_halves(DKO, dk_in, ok, HALF)
        dv1, dv2 = _load_halves(DVO, dv_in, ok, HALF)
        v1, v2 = _load_halves(V, v_in, ok, HALF)
        g1, g2 = _load_halves(G, g_in, ok, HALF)
        s1, s2 = tl.sigmoid(g1), tl.sigmoid(g2)
        out, _ = _head_tile(b, t0, h0, t, h_kv, stride_dkb, stride_dkt, stride_dkh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        x1, x2 = _rotate(dk1, dk2, cos, -sin)
        _store_halves(DK, out, ok, x1, x2, HALF)
        _store_halves(DV, out, ok, dv1 * s1, dv2 * s2, HALF)
        _store_halves(DG, out, ok, dv1 * v1 * s1 * (1.0 - s1), dv2 * v2 * s2 * (1.0 - s2), HALF)
    if h0 < h_q:
        dq_in, ok = _head_tile(b, t0, h0, t, h_q, stride_dqob, stride_dqot, stride_dqoh, BLOCK_H, BLOCK_T, HALF,
                               HALF_PAD)
        dq1, dq2 = _load_halves(DQO, dq_in, ok, HALF)
        out, _ = _head_tile(b, t0, h0, t, h_q, stride_dqb, stride_dqt, stride_dqh, BLOCK_H, BLOCK_T, HALF, HALF_PAD)
        x1, x2 = _rotate(dq1, dq2, cos, -sin)
        _store_halves(DQ, out, ok, x1, x2, HALF)


@triton.jit
def _row_tile(r0, c0, rows, t, n, stride_b, stride_t, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets [BLOCK_R, BLOCK_N] (int64) of rows r0.. (row = batch * t + token) and columns c0.. of a
    [b, t, n] tensor whose last dimension is contiguous, and their mask."""
    row = r0 + tl.arange(0, BLOCK_R)
    col = c0 + tl.arange(0, BLOCK_N)
    batch = (row // t).to(tl.int64)
    token = (row % t).to(tl.int64)
    off = (batch * stride_b + token * stride_t)[:, None] + col[None, :]
    return off, (row[:, None] < rows) & (col[None, :] < n)


@triton.jit
def _gsa_output_gate_kernel(O, G, OUT, t, rows, n, stride_ob, stride_ot, stride_gb, stride_gt, stride_xb, stride_xt,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: out = o * sigmoid(g) over rows program_id(0) * BLOCK_R.. and features
    program_id(1) * BLOCK_N.. (a row is one token's h * d features; rows on the grid's first axis, which
    has no 65535 limit)."""
    r0 = tl.program_id(0) * BLOCK_R
    c0 = tl.program_id(1) * BLOCK_N
    o_off, ok = _row_tile(r0, c0, rows, t, n, stride_ob, stride_ot, BLOCK_R, BLOCK_N)
    g_off, _ = _row_tile(r0, c0, rows, t, n, stride_gb, stride_gt, BLOCK_R, BLOCK_N)
    x_off, _ = _row_tile(r0, c0, rows, t, n, stride_xb, stride_xt, BLOCK_R, BLOCK_N)
    o = tl.load(O + o_off, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + g_off, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + x_off, (o * tl.sigmoid(g)).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _gsa_output_gate_bwd_kernel(DOUT, O, G, DO, DG, t, rows, n, stride_db, stride_dt, stride_ob, stride_ot,
                                stride_gb, stride_gt, stride_xb, stride_xt,
                                BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: with s = sigmoid(g), do = dout * s and dg = dout * o * s * (1 - s) over the tile of
    `_gsa_output_gate_kernel`'s program with the same ids. DO and DG share strides."""
    r0 = tl.program_id(0) * BLOCK_R
    c0 = tl.program_id(1) * BLOCK_N
    d_off, ok = _row_tile(r0, c0, rows, t, n, stride_db, stride_dt, BLOCK_R, BLOCK_N)
    o_off, _ = _row_tile(r0, c0, rows, t, n, stride_ob, stride_ot, BLOCK_R, BLOCK_N)
    g_off, _ = _row_tile(r0, c0, rows, t, n, stride_gb, stride_gt, BLOCK_R, BLOCK_N)
    x_off, _ = _row_tile(r0, c0, rows, t, n, stride_xb, stride_xt, BLOCK_R, BLOCK_N)
    dout = tl.load(DOUT + d_off, mask=ok, other=0.0).to(tl.float32)
    o = tl.load(O + o_off, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(tl.load(G + g_off, mask=ok, other=0.0).to(tl.float32))
    tl.store(DO + x_off, (dout * s).to(DO.dtype.element_ty), mask=ok)
    tl.store(DG + x_off, (dout * o * s * (1.0 - s)).to(DG.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- launchers
def rope_blocks(tiles: ElementwiseTiles, d: int, heads: int) -> dict[str, int]:
    """The RoPE kernels' constexprs for head dim d and max(h_q, h_kv) heads: HALF = d / 2, HALF_PAD its
    power of two, BLOCK_H heads (at most `tiles.heads`) and BLOCK_T tokens per program (about
    `tiles.elements` values of each tensor)."""
    half_pad = next_pow2(d // 2)
    block_h = min(tiles.heads, next_pow2(heads))
    block_t = max(1, tiles.elements // (block_h * 2 * half_pad))
    return {"HALF": d // 2, "HALF_PAD": half_pad, "BLOCK_T": next_pow2(block_t), "BLOCK_H": block_h}


def output_gate_blocks(tiles: ElementwiseTiles, n: int) -> dict[str, int]:
    """The output gate kernels' constexprs for n features per row: BLOCK_N (at most 1024, and a quarter
    of `tiles.elements`: a program spans 4 rows or more) and BLOCK_R rows per program (about
    `tiles.elements` values of each tensor)."""
    block_n = min(1024, tiles.elements // 4, next_pow2(n))
    return {"BLOCK_R": max(1, tiles.elements // block_n), "BLOCK_N": block_n}


def _rope_grid(q: torch.Tensor, k: torch.Tensor, blocks: dict) -> tuple[int, int, int]:
    b, t, h_q, _ = q.shape
    return cdiv(t, blocks["BLOCK_T"]), cdiv(max(h_q, k.shape[2]), blocks["BLOCK_H"]), b


def _rope_value_gate_forward(q, k, v, gate, inv_freq, tiles: ElementwiseTiles):
    """Launch the fused forward: (RoPE'd q, RoPE'd k, gated v), contiguous, in q's dtype."""
    b, t, h_q, d = q.shape
    qo = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    ko, vo = torch.empty((2, *k.shape), device=q.device, dtype=q.dtype).unbind(0)
    if qo.numel() == 0 and ko.numel() == 0:
        return qo, ko, vo
    blocks = rope_blocks(tiles, d, max(h_q, k.shape[2]))
    with nvtx_range("gsa/rope_value_gate_kernel"):
        _gsa_rope_value_gate_kernel[_rope_grid(q, k, blocks)](
            q, k, v, gate, inv_freq, qo, ko, vo,
            t, h_q, k.shape[2],
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *gate.stride()[:3], *qo.stride()[:3], *ko.stride()[:3],
            **blocks, num_warps=tiles.num_warps, num_stages=1,
        )
    return qo, ko, vo


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is contiguous, else a contiguous copy (autograd may hand the
    backward an expanded gradient)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope_value_gate_backward(dqo, dko, dvo, v, gate, inv_freq, tiles: ElementwiseTiles):
    """Launch the fused backward: (dq, dk, dv, dgate), contiguous, in v's dtype."""
    b, t, h_q, d = dqo.shape
    h_kv = v.shape[2]
    dqo, dko, dvo = (_last_contiguous(g) for g in (dqo, dko, dvo))
    dq = torch.empty((b, t, h_q, d), device=v.device, dtype=v.dtype)
    dk, dv, dg = torch.empty((3, b, t, h_kv, d), device=v.device, dtype=v.dtype).unbind(0)
    if dq.numel() == 0 and dk.numel() == 0:
        return dq, dk, dv, dg
    blocks = rope_blocks(tiles, d, max(h_q, h_kv))
    with nvtx_range("gsa/rope_value_gate_bwd_kernel"):
        _gsa_rope_value_gate_bwd_kernel[_rope_grid(dqo, v, blocks)](
            dqo, dko, dvo, v, gate, inv_freq, dq, dk, dv, dg,
            t, h_q, h_kv,
            *dqo.stride()[:3], *dko.stride()[:3], *dvo.stride()[:3], *v.stride()[:3], *gate.stride()[:3],
            *dq.stride()[:3], *dk.stride()[:3],
            **blocks, num_warps=tiles.num_warps, num_stages=1,
        )
    return dq, dk, dv, dg


def _gate_grid(o: torch.Tensor, blocks: dict) -> tuple[int, int]:
    b, t, h, d = o.shape
    return cdiv(b * t, blocks["BLOCK_R"]), cdiv(h * d, blocks["BLOCK_N"])


def _output_gate_forward(o, gate, tiles: ElementwiseTiles) -> torch.Tensor:
    """Launch the output gate: o * sigmoid(gate), contiguous, in o's dtype."""
    b, t, h, d = o.shape
    out = torch.empty((b, t, h, d), device=o.device, dtype=o.dtype)
    if out.numel() == 0:
        return out
    blocks = output_gate_blocks(tiles, h * d)
    with nvtx_range("gsa/output_gate_kernel"):
        _gsa_output_gate_kernel[_gate_grid(o, blocks)](
            o, gate, out, t, b * t, h * d, *o.stride()[:2], *gate.stride()[:2], *out.stride()[:2],
            **blocks, num_warps=tiles.num_warps, num_stages=1,
        )
    return out


def _output_gate_backward(dout, o, gate, tiles: ElementwiseTiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the output gate's backward: (do, dgate), contiguous, in o's dtype."""
    b, t, h, d = o.shape
    if dout.stride(-1) != 1 or dout.stride(-2) != d:
        dout = dout.contiguous()
    do, dg = torch.empty((2, b, t, h, d), device=o.device, dtype=o.dtype).unbind(0)
    if do.numel() == 0:
        return do, dg
    blocks = output_gate_blocks(tiles, h * d)
    with nvtx_range("gsa/output_gate_bwd_kernel"):
        _gsa_output_gate_bwd_kernel[_gate_grid(o, blocks)](
            dout, o, gate, do, dg, t, b * t, h * d, *dout.stride()[:2], *o.stride()[:2], *gate.stride()[:2],
            *do.stride()[:2], **blocks, num_warps=tiles.num_warps, num_stages=1,
        )
    return do, dg


# ----------------------------------------------------------------------------- autograd
class _RopeValueGateFunction(torch.autograd.Function):
    """Autograd for `rope_value_gate`: keeps v, the gate logits and inv_freq (RoPE's backward needs no
    activation), and runs the one backward kernel."""

    @staticmethod
    def forward(ctx, q, k, v, gate, inv_freq, tiles: ElementwiseTiles):
        ctx.save_for_backward(v, gate, inv_freq)
        ctx.tiles = tiles
        return _rope_value_gate_forward(q, k, v, gate, inv_freq, tiles)

    @staticmethod
    def backward(ctx, dqo, dko, dvo):
        v, gate, inv_freq = ctx.saved_tensors
        return (*_rope_value_gate_backward(dqo, dko, dvo, v, gate, inv_freq, ctx.tiles), None, None)


class _OutputGateFunction(torch.autograd.Function):
    """Autograd for `output_gate`: keeps o and the gate logits, and runs the one backward kernel."""

    @staticmethod
    def forward(ctx, o, gate, tiles: ElementwiseTiles):
        ctx.save_for_backward(o, gate)
        ctx.tiles = tiles
        return _output_gate_forward(o, gate, tiles)

    @staticmethod
    def backward(ctx, dout):
        o, gate = ctx.saved_tensors
        return (*_output_gate_backward(dout, o, gate, ctx.tiles), None)


# ----------------------------------------------------------------------------- public functions
def _tiles(x: torch.Tensor, vendor: str | None) -> ElementwiseTiles:
    """The launch shape for tensors on x's device: the GPU's vendor (a `vendor` that differs is an
    error), or on CPU tensors the interpreter with `vendor`'s tiles (NVIDIA's by default)."""
    if vendor is not None and vendor not in VENDOR_TILES:
        raise ValueError(f"vendor: expected one of {tuple(VENDOR_TILES)} or None, got {vendor!r}")
    if x.device.type == "cpu":
        if not interpreter_enabled():
            raise RuntimeError("gsa layer kernels on CPU tensors need the interpreter; set TRITON_INTERPRET=1 "
                               "before importing kreg, or pass CUDA/ROCm tensors")
        return VENDOR_TILES[vendor or INTERPRETER_VENDOR]
    info = detect(x.device)
    if vendor is not None and vendor != info.vendor:
        raise ValueError(f"vendor: {vendor!r} kernels cannot run on {info.name} ({info.vendor})")
    return VENDOR_TILES[info.vendor]


def _check_tensor(name: str, x, dims: int, dtype: torch.dtype | None, device: torch.device | None) -> None:
    """TypeError unless x is a tensor of `dtype` (one of DTYPES when None); ValueError unless it has
    `dims` dimensions, lives on `device` and its last dimension is contiguous."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if dtype is None and x.dtype not in DTYPES:
        raise TypeError(f"{name}: expected float16, bfloat16 or float32, got {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype} (the dtype of the first argument), got {x.dtype}")
    if x.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimensions, got shape {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {x.device}")
    if x.dim() and x.stride(-1) != 1 and x.shape[-1] != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {tuple(x.stride())}")


def rope_value_gate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor,
                    inv_freq: torch.Tensor, *, vendor: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(RoPE(q), RoPE(k), v * sigmoid(gate)) in one kernel, differentiable for q, k, v and gate.

    q [b, t, h_q, d], k, v and gate [b, t, h_kv, d], one dtype (fp16, bf16 or fp32), d even, each last
    dimension contiguous (other strides are free); inv_freq [d / 2] (any float dtype, used in fp32).
    Token i rotates by the angles i * inv_freq (rotate-half: halves (x1, x2) -> (x1 cos - x2 sin,
    x2 cos + x1 sin)). Returns contiguous tensors of the inputs' shapes and dtype. `vendor` picks the
    tiles on CPU tensors (the interpreter) and must match a GPU's vendor."""
    _check_tensor("q", q, 4, None, None)
    for name, x in (("k", k), ("v", v), ("gate", gate)):
        _check_tensor(name, x, 4, q.dtype, q.device)
    if not isinstance(inv_freq, torch.Tensor) or not inv_freq.is_floating_point():
        raise TypeError(f"inv_freq: expected a floating-point tensor, got {getattr(inv_freq, 'dtype', type(inv_freq))}")
    b, t, h_q, d = q.shape
    if d % 2:
        raise ValueError(f"q: expected an even head dim, got shape {list(q.shape)}")
    if k.shape[:2] != (b, t) or k.shape[3] != d:
        raise ValueError(f"k: expected shape [{b}, {t}, h_kv, {d}], got {list(k.shape)}")
    for name, x in (("v", v), ("gate", gate)):
        if x.shape != k.shape:
            raise ValueError(f"{name}: expected k's shape {list(k.shape)}, got {list(x.shape)}")
    if inv_freq.shape != (d // 2,) or inv_freq.device != q.device:
        raise ValueError(f"inv_freq: expected shape [{d // 2}] on {q.device}, got {list(inv_freq.shape)} on "
                         f"{inv_freq.device}")
    inv_freq = _last_contiguous(inv_freq)
    tiles = _tiles(q, vendor)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, gate)):
        return _RopeValueGateFunction.apply(q, k, v, gate, inv_freq, tiles)
    return _rope_value_gate_forward(q, k, v, gate, inv_freq, tiles)


def output_gate(o: torch.Tensor, gate: torch.Tensor, *, vendor: str | None = None) -> torch.Tensor:
    """o * sigmoid(gate) in one kernel, differentiable for o and gate.

    o and gate [b, t, h, d], one dtype (fp16, bf16 or fp32), each with its (h, d) dimensions contiguous
    (one token's h * d features in a row; batch and token strides are free). Returns a contiguous
    tensor like o. `vendor` as in `rope_value_gate`."""
    _check_tensor("o", o, 4, None, None)
    _check_tensor("gate", gate, 4, o.dtype, o.device)
    if gate.shape != o.shape:
        raise ValueError(f"gate: expected o's shape {list(o.shape)}, got {list(gate.shape)}")
    for name, x in (("o", o), ("gate", gate)):
        if x.shape[2] > 1 and x.stride(2) != x.shape[3]:
            raise ValueError(f"{name}: expected each token's [h, d] features contiguous, got strides "
                             f"{tuple(x.stride())}")
    tiles = _tiles(o, vendor)
    if torch.is_grad_enabled() and (o.requires_grad or gate.requires_grad):
        return _OutputGateFunction.apply(o, gate, tiles)
    return _output_gate_forward(o, gate, tiles)
