"""The attention family's backward: the Triton kernels of the `bwd_pre`, `bwd_dkv` and `bwd_dq` roles
and their launchers.

- `_attention_bwd_pre_kernel` reads dO and O once per row and writes Delta = rowsum(dO * O), the
  row's lse with the sink in log2 units (Lse2, +inf for a row with no key) and, with sinks, one
  partial sum of d sink per program, summed on the host in a fixed order.
- `_attention_bwd_dkv_kernel` owns a key block of one kv head: it walks the GQA group's query heads
  and the query blocks that may see its keys (masks.py's `_query_range`, masked edges and unmasked
  middle), works transposed (keys as rows) and writes dK and dV once; K/V are never expanded.
- `_attention_bwd_dq_kernel` has the forward's program layout and key ranges and writes dQ.

No atomics: gradients are bitwise reproducible. `attention_backward` runs the three kernels (the
Hopper Gluon variants run `backward_pre` and then their own dK/dV and dQ kernels, or
`attention_backward_dq`), each through a launch function as the forward does; NSA's window branch
runs `attention_backward` too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.attention.layout import _geometry, _lse_strides, _masks, _strides
from kreg.kernels.common.attention.masks import _allowed_keys, _block_order, _key_range, _query_range, _sequence
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.launch import triton_launch
from kreg.kernels.common.tiles import cdiv, dot_block


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _attention_bwd_pre_kernel(
        Out, DOut, Lse, Sinks, Delta, Lse2, DSinks,
        rows,
        stride_ob, stride_om, stride_oh,
        stride_dob, stride_dom, stride_doh,
        stride_lb, stride_lh,
        HAS_SINKS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program: BLOCK_M rows of one query head of one batch entry (varlen: of the packed rows,
    which need no sequence bounds here). Grid: (row blocks, h_q, batch).

    Writes Delta = rowsum(dO * O) (fp32, from the stored O) and Lse2 = logaddexp(lse, sink) * log2(e)
    (+inf for a row with no key, so its P is 0 downstream), both laid out like Lse; with sinks, the
    program's sum of -sigmoid(sink - lse) * Delta over its rows to DSinks[h, batch * row blocks], one
    slot per program, for a fixed-order sum on the host.
    """
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < rows
    tile_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows64 = offs_m.to(tl.int64)[:, None]
    o = tl.load(Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh + rows64 * stride_om
                + offs_d[None, :], mask=tile_ok, other=0.0)
    do = tl.load(DOut + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh + rows64 * stride_dom
                 + offs_d[None, :], mask=tile_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    l_offs = off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m
    lse = tl.load(Lse + l_offs, mask=row_ok, other=float("inf"))
    empty = lse == float("inf")
    lse_tot = lse
    if HAS_SINKS:
        sink = tl.load(Sinks + off_h)
        lse_f = tl.where(empty, 0.0, lse)
        # logaddexp and sigmoid in forms that stay exact for sinks of +-inf.
        lse_tot = tl.maximum(lse_f, sink) + tl.log(1.0 + tl.exp(-tl.abs(lse_f - sink)))
        lse_tot = tl.where(empty, float("inf"), lse_tot)
        p_sink = 1.0 / (1.0 + tl.exp(lse_f - sink))
        dsink = tl.where(empty | ~row_ok, 0.0, -p_sink * delta)
        part = off_h * tl.num_programs(2) * tl.num_programs(0) + off_b * tl.num_programs(0) + start_m
        tl.store(DSinks + part, tl.sum(dsink, 0))
    tl.store(Delta + l_offs, delta, mask=row_ok)
    tl.store(Lse2 + l_offs, lse_tot * LOG2E, mask=row_ok)


@triton.jit
def _attention_bwd_dkv_inner(dk, dv, k, v, q_head, do_head, lse2_head, delta_head, stride_qm, stride_dom,
                             start, end, offs_n, seqlen_q, seqlen_k, window, qk_scale,
                             MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Add query blocks [start, end) of one query head to the key block's dK (unscaled) and dV.

    Works transposed (keys as rows): P^T = exp2(K Q^T * qk_scale - Lse2), dV += P^T dO,
    dS^T = P^T * (V dO^T - Delta), dK += dS^T Q. MASKED applies the row-length, causal, window and
    key-length masks; the unmasked stage only runs on blocks every key of the block is allowed for.
    """
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_blk = q_head + tl.cast(start, tl.int64) * stride_qm
    do_blk = do_head + tl.cast(start, tl.int64) * stride_dom
    q_offs = offs_r[:, None] * stride_qm + offs_d[None, :]
    do_offs = offs_r[:, None] * stride_dom + offs_d[None, :]
    diag = seqlen_k - seqlen_q
    # The masked edges are a few blocks each: pipelining them only costs registers (sm_90 compiles).
    for start_m in tl.range(start, end, BLOCK_M, num_stages=1 if MASKED else None):
        rows = start_m + offs_r
        if MASKED:
            row_ok = rows < seqlen_q
            tile_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
            q = tl.load(q_blk + q_offs, mask=tile_ok, other=0.0)
            do = tl.load(do_blk + do_offs, mask=tile_ok, other=0.0)
            lse2 = tl.load(lse2_head + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_head + rows, mask=row_ok, other=0.0)
        elif HEAD_DIM < BLOCK_D:
            q = tl.load(q_blk + q_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            do = tl.load(do_blk + do_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            lse2 = tl.load(lse2_head + rows)
            delta = tl.load(delta_head + rows)
        else:
            q = tl.load(q_blk + q_offs)
            do = tl.load(do_blk + do_offs)
            lse2 = tl.load(lse2_head + rows)
            delta = tl.load(delta_head + rows)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASKED:
            pos = diag + rows
            allowed = (offs_n[:, None] < seqlen_k) & row_ok[None, :]
            if IS_CAUSAL:
                allowed = allowed & (offs_n[:, None] <= pos[None, :])
            if HAS_WINDOW:
                allowed = allowed & (pos[None, :] - offs_n[:, None] < window)
            p_t = tl.where(allowed, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
        q_blk += BLOCK_M * stride_qm
        do_blk += BLOCK_M * stride_dom
    return dk, dv


def _attention_bwd_dkv_block_body(q_base, k_base, v_base, do_base, dk_base, dv_base, lse2_base, delta_base,
                                  start_n, seqlen_q, seqlen_k, window, off_hk, qk_scale, sm_scale,
                                  stride_qm, stride_qh, stride_kn, stride_vn, stride_dom, stride_doh,
                                  stride_dkn, stride_dvn, stride_lh,
                                  GROUP: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr):
    """Key block `start_n` of one (sequence, kv head): dK and dV summed over the group's query heads."""
    n0 = start_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tile_ok = (offs_n < seqlen_k)[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = tl.arange(0, BLOCK_N)[:, None]
    k = tl.load(k_base + n0.to(tl.int64) * stride_kn + rows * stride_kn + offs_d[None, :], mask=tile_ok, other=0.0)
    v = tl.load(v_base + n0.to(tl.int64) * stride_vn + rows * stride_vn + offs_d[None, :], mask=tile_ok, other=0.0)
    lo, mid_lo, mid_hi, hi = _query_range(n0, seqlen_q, seqlen_k, window, IS_CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # The group's heads are consecutive: the head pointers step by one head's stride (sm_90 compiles
    # of the d 128 GQA default spilled 8 B with the offsets recomputed from the head index instead).
    first = (off_hk * GROUP).to(tl.int64)
    q_head = q_base + first * stride_qh
    do_head = do_base + first * stride_doh
    lse2_head = lse2_base + first * stride_lh
    delta_head = delta_base + first * stride_lh
    for _ in tl.range(GROUP, disable_licm=True):
        # Stage 1: the causal diagonal; stage 2: rows that see the whole block; stage 3: the window's
        # far edge and the tail.
        dk, dv = _attention_bwd_dkv_inner(dk, dv, k, v, q_head, do_head, lse2_head, delta_head, stride_qm,
                                          stride_dom, lo, mid_lo, offs_n, seqlen_q, seqlen_k, window, qk_scale,
                                          True, IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_M, BLOCK_D)
        dk, dv = _attention_bwd_dkv_inner(dk, dv, k, v, q_head, do_head, lse2_head, delta_head, stride_qm,
                                          stride_dom, mid_lo, mid_hi, offs_n, seqlen_q, seqlen_k, window, qk_scale,
                                          False, IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_M, BLOCK_D)
        dk, dv = _attention_bwd_dkv_inner(dk, dv, k, v, q_head, do_head, lse2_head, delta_head, stride_qm,
                                          stride_dom, mid_hi, hi, offs_n, seqlen_q, seqlen_k, window, qk_scale,
                                          True, IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_M, BLOCK_D)
        q_head += stride_qh
        do_head += stride_doh
        lse2_head += stride_lh
        delta_head += stride_lh
    dk_ptrs = dk_base + n0.to(tl.int64) * stride_dkn + rows * stride_dkn + offs_d[None, :]
    dv_ptrs = dv_base + n0.to(tl.int64) * stride_dvn + rows * stride_dvn + offs_d[None, :]
    tl.store(dk_ptrs, (dk * sm_scale).to(dk_base.dtype.element_ty), mask=tile_ok)
    tl.store(dv_ptrs, dv.to(dv_base.dtype.element_ty), mask=tile_ok)


_attention_bwd_dkv_block = triton.jit(_attention_bwd_dkv_block_body)
_attention_bwd_dkv_block_called = triton.jit(noinline=True)(_attention_bwd_dkv_block_body)  # see the forward's


@triton.jit
def _attention_bwd_dkv_kernel(
        Q, K, V, DOut, Lse2, Delta, DK, DV, cu_seqlens_q, cu_seqlens_k,
        qk_scale, sm_scale, rows_q, rows_k, window,
        stride_qb, stride_qm, stride_qh,
        stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh,
        stride_dob, stride_dom, stride_doh,
        stride_dkb, stride_dkn, stride_dkh,
        stride_dvb, stride_dvn, stride_dvh,
        stride_lb, stride_lh,
        GROUP: tl.constexpr, IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dK and dV of BLOCK_N keys of one kv head of one sequence (grid: key blocks, h_kv,
    batch), summed over the GROUP query heads that read it (a compile-time constant, as in the
    forward) and over every query block that may see those keys; written once, no atomics. Lse2 and
    Delta come from the pre kernel (laid out like lse). Varlen bounds as in the forward; a program
    strides over the sequence's key blocks.
    """
    off_hk = tl.program_id(1)
    off_b = tl.program_id(2)
    if IS_VARLEN:
        q_start, seqlen_q = _sequence(cu_seqlens_q, off_b, rows_q)
        k_start, seqlen_k = _sequence(cu_seqlens_k, off_b, rows_k)
        q_base = Q + q_start.to(tl.int64) * stride_qm
        do_base = DOut + q_start.to(tl.int64) * stride_dom
        lse2_base = Lse2 + q_start
        delta_base = Delta + q_start
        k_base = K + k_start.to(tl.int64) * stride_kn + off_hk.to(tl.int64) * stride_kh
        v_base = V + k_start.to(tl.int64) * stride_vn + off_hk.to(tl.int64) * stride_vh
        dk_base = DK + k_start.to(tl.int64) * stride_dkn + off_hk.to(tl.int64) * stride_dkh
        dv_base = DV + k_start.to(tl.int64) * stride_dvn + off_hk.to(tl.int64) * stride_dvh
        n_blocks = (seqlen_k + BLOCK_N - 1) // BLOCK_N
        for start_n in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            _attention_bwd_dkv_block_called(q_base, k_base, v_base, do_base, dk_base, dv_base, lse2_base,
                                            delta_base, start_n, seqlen_q, seqlen_k, window, off_hk,
                                            qk_scale, sm_scale, stride_qm, stride_qh, stride_kn, stride_vn,
                                            stride_dom, stride_doh, stride_dkn, stride_dvn, stride_lh,
                                            GROUP, IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
    else:
        b64 = off_b.to(tl.int64)
        q_base = Q + b64 * stride_qb
        do_base = DOut + b64 * stride_dob
        lse2_base = Lse2 + b64 * stride_lb
        delta_base = Delta + b64 * stride_lb
        k_base = K + b64 * stride_kb + off_hk.to(tl.int64) * stride_kh
        v_base = V + b64 * stride_vb + off_hk.to(tl.int64) * stride_vh
        dk_base = DK + b64 * stride_dkb + off_hk.to(tl.int64) * stride_dkh
        dv_base = DV + b64 * stride_dvb + off_hk.to(tl.int64) * stride_dvh
        _attention_bwd_dkv_block(q_base, k_base, v_base, do_base, dk_base, dv_base, lse2_base, delta_base,
                                 tl.program_id(0), rows_q, rows_k, window, off_hk, qk_scale, sm_scale,
                                 stride_qm, stride_qh, stride_kn, stride_vn, stride_dom, stride_doh,
                                 stride_dkn, stride_dvn, stride_lh,
                                 GROUP, IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)


@triton.jit
def _attention_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, start, end,
                            pos_m, seqlen_k, window, qk_scale,
                            MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Add key blocks [start, end) to one query block's dQ (unscaled): P = exp2(Q K^T * qk_scale -
    Lse2), dS = P * (dO V^T - Delta), dQ += dS K. Masks as in the forward's inner loop."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :]
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :]
    k_blk = k_base + tl.cast(start, tl.int64) * stride_kn
    v_blk = v_base + tl.cast(start, tl.int64) * stride_vn
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_blk + k_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_blk + v_offs, mask=kv_mask, other=0.0)
        elif HEAD_DIM < BLOCK_D:
            k = tl.load(k_blk + k_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_blk + v_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_blk + k_offs)
            v = tl.load(v_blk + v_offs)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(_allowed_keys(pos_m, cols, seqlen_k, window, IS_CAUSAL, HAS_WINDOW), p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        k_blk += BLOCK_N * stride_kn
        v_blk += BLOCK_N * stride_vn
    return dq


def _attention_bwd_dq_block_body(q_base, k_base, v_base, do_base, dq_base, lse2_base, delta_base, start_m,
                                 seqlen_q, seqlen_k, window, qk_scale, sm_scale,
                                 stride_qm, stride_kn, stride_vn, stride_dom, stride_dqm,
                                 IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
                                 BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query block `start_m` of one (sequence, head): dQ over the forward's three key stages."""
    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    tile_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = tl.arange(0, BLOCK_M)[:, None]
    q = tl.load(q_base + m0.to(tl.int64) * stride_qm + rows * stride_qm + offs_d[None, :], mask=tile_ok, other=0.0)
    do = tl.load(do_base + m0.to(tl.int64) * stride_dom + rows * stride_dom + offs_d[None, :], mask=tile_ok,
                 other=0.0)
    lse2 = tl.load(lse2_base + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
    pos_m = seqlen_k - seqlen_q + offs_m
    lo, mid_lo, mid_hi, hi = _key_range(m0, seqlen_q, seqlen_k, window, IS_CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _attention_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, lo, mid_lo, pos_m,
                                 seqlen_k, window, qk_scale, True, IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_N, BLOCK_D)
    dq = _attention_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, mid_lo, mid_hi,
                                 pos_m, seqlen_k, window, qk_scale, False, IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_N,
                                 BLOCK_D)
    dq = _attention_bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, mid_hi, hi, pos_m,
                                 seqlen_k, window, qk_scale, True, IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_N, BLOCK_D)
    dq_ptrs = dq_base + m0.to(tl.int64) * stride_dqm + rows * stride_dqm + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(dq_base.dtype.element_ty), mask=tile_ok)


_attention_bwd_dq_block = triton.jit(_attention_bwd_dq_block_body)
_attention_bwd_dq_block_called = triton.jit(noinline=True)(_attention_bwd_dq_block_body)  # see the forward's


@triton.jit
def _attention_bwd_dq_kernel(
        Q, K, V, DOut, Lse2, Delta, DQ, cu_seqlens_q, cu_seqlens_k,
        qk_scale, sm_scale, rows_q, rows_k, window,
        stride_qb, stride_qm, stride_qh,
        stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh,
        stride_dob, stride_dom, stride_doh,
        stride_dqb, stride_dqm, stride_dqh,
        stride_lb, stride_lh,
        GROUP: tl.constexpr, IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dQ of BLOCK_M queries of one query head of one sequence (the forward's grid and
    key ranges), from Lse2 and Delta of the pre kernel. Head h reads kv head h // GROUP (a constant:
    as a run-time integer the GQA kernel took ~20 more registers). Varlen bounds and striding as in
    the forward.
    """
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // GROUP
    h64 = off_h.to(tl.int64)
    if IS_VARLEN:
        q_start, seqlen_q = _sequence(cu_seqlens_q, off_b, rows_q)
        k_start, seqlen_k = _sequence(cu_seqlens_k, off_b, rows_k)
        q_base = Q + q_start.to(tl.int64) * stride_qm + h64 * stride_qh
        do_base = DOut + q_start.to(tl.int64) * stride_dom + h64 * stride_doh
        dq_base = DQ + q_start.to(tl.int64) * stride_dqm + h64 * stride_dqh
        lse2_base = Lse2 + h64 * stride_lh + q_start
        delta_base = Delta + h64 * stride_lh + q_start
        k_base = K + k_start.to(tl.int64) * stride_kn + off_hk.to(tl.int64) * stride_kh
        v_base = V + k_start.to(tl.int64) * stride_vn + off_hk.to(tl.int64) * stride_vh
        n_blocks = (seqlen_q + BLOCK_M - 1) // BLOCK_M
        for i in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            _attention_bwd_dq_block_called(q_base, k_base, v_base, do_base, dq_base, lse2_base, delta_base,
                                           _block_order(i, n_blocks, IS_CAUSAL), seqlen_q, seqlen_k, window,
                                           qk_scale, sm_scale, stride_qm, stride_kn, stride_vn, stride_dom,
                                           stride_dqm, IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)
    else:
        b64 = off_b.to(tl.int64)
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        do_base = DOut + b64 * stride_dob + h64 * stride_doh
        dq_base = DQ + b64 * stride_dqb + h64 * stride_dqh
        lse2_base = Lse2 + b64 * stride_lb + h64 * stride_lh
        delta_base = Delta + b64 * stride_lb + h64 * stride_lh
        k_base = K + b64 * stride_kb + off_hk.to(tl.int64) * stride_kh
        v_base = V + b64 * stride_vb + off_hk.to(tl.int64) * stride_vh
        start_m = tl.program_id(0)
        if IS_CAUSAL:
            start_m = tl.num_programs(0) - 1 - start_m
        _attention_bwd_dq_block(q_base, k_base, v_base, do_base, dq_base, lse2_base, delta_base, start_m,
                                rows_q, rows_k, window, qk_scale, sm_scale,
                                stride_qm, stride_kn, stride_vn, stride_dom, stride_dqm,
                                IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N)


# ----------------------------------------------------------------------------- launchers
def backward_pre(q: torch.Tensor, sinks: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                 dout: torch.Tensor, args: Mapping, config: LaunchConfig, launch: Callable[..., Any] = triton_launch
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the pre kernel with `config` (the "bwd_pre" role's) through `launch`: (dout in q's dtype with
    a unit last stride, lse made dense, delta, lse2, d sinks or None). delta and lse2 share lse's (dense) layout:
    [b, h_q, s_q], or [h_q, total rows] for varlen calls."""
    varlen, batch, rows_q, _, _, _ = _geometry({**args, "q": q, "k": q})
    h_q, d = q.shape[-2], q.shape[-1]
    # The kernels read dO through q's element type with a unit last stride.
    dout = dout.to(q.dtype)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    # delta and lse2 are indexed with lse's strides: a dense lse makes them match.
    lse = lse.contiguous()
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    pre_batch = 1 if varlen else batch  # packed rows need no sequence bounds here
    pre_grid = (cdiv(rows_q, config.blocks["BLOCK_M"]), h_q, pre_batch)
    dsink_parts = None
    if sinks is not None:
        dsink_parts = torch.empty((h_q, pre_batch * pre_grid[0]), dtype=torch.float32, device=q.device)
    launch(
        _attention_bwd_pre_kernel, pre_grid, out, dout, lse, sinks, delta, lse2, dsink_parts, rows_q,
        *_strides(out, varlen), *_strides(dout, varlen), *_lse_strides(lse, varlen),
        HAS_SINKS=sinks is not None, HEAD_DIM=d, BLOCK_D=dot_block(d), BLOCK_M=config.blocks["BLOCK_M"],
        **config.knobs())
    # One slot per pre program, summed in a fixed order: no atomics, the same bits every run.
    dsinks = dsink_parts.sum(dim=1) if dsink_parts is not None else None
    return dout, lse, delta, lse2, dsinks


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, out: torch.Tensor,
                       lse: torch.Tensor, dout: torch.Tensor, args: Mapping, config: CallConfig,
                       launch: Callable[..., Any] = triton_launch):
    """Run the pre, dK/dV and dQ kernels (through `launch`, as the forward); returns (dq, dk, dv, dsinks
    or None). `args` holds the call's non-tensor arguments and cu_seqlens."""
    varlen, batch, _, _, _, span_k = _geometry({**args, "q": q, "k": k})
    h_kv = k.shape[-2]
    dout, lse, delta, lse2, dsinks = backward_pre(q, sinks, out, lse, dout, args, config["bwd_pre"], launch)

    # Varlen rows outside every sequence get no program: their gradients are the zeros allocated here.
    alloc = torch.zeros if varlen else torch.empty
    dk, dv = (alloc(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
    common, constexprs = _backward_arguments(q, k, v, dout, args)
    cu_q, cu_k = (args["cu_seqlens_q"], args["cu_seqlens_k"]) if varlen else (q, q)
    dkv = config["bwd_dkv"]
    launch(
        _attention_bwd_dkv_kernel, (cdiv(span_k, dkv.blocks["BLOCK_N"]), h_kv, batch),
        q, k, v, dout, lse2, delta, dk, dv, cu_q, cu_k, *common,
        *_strides(dk, varlen), *_strides(dv, varlen), *_lse_strides(lse, varlen),
        **constexprs, **dkv.blocks, **dkv.knobs())
    dq = attention_backward_dq(q, k, v, dout, lse, lse2, delta, args, config["bwd_dq"], (common, constexprs), launch)
    return dq, dk, dv, dsinks


def _backward_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, args: Mapping
                        ) -> tuple[tuple, dict]:
    """The dK/dV and dQ kernels' shared run-time arguments (scales, lengths, window, the strides of q,
    k, v and dO) and constexprs."""
    varlen, _, rows_q, rows_k, _, _ = _geometry({**args, "q": q, "k": k})
    masks = _masks(args, rows_k)
    window = masks.pop("window")
    sm_scale = float(args["sm_scale"])
    common = (sm_scale * LOG2E.value, sm_scale, rows_q, rows_k, window,
              *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(dout, varlen))
    d = q.shape[-1]
    return common, {"GROUP": q.shape[-2] // k.shape[-2], "IS_VARLEN": varlen, "HEAD_DIM": d,
                    "BLOCK_D": dot_block(d), **masks}


def attention_backward_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                          lse2: torch.Tensor, delta: torch.Tensor, args: Mapping, config: LaunchConfig,
                          arguments: tuple[tuple, dict] | None = None, launch: Callable[..., Any] = triton_launch
                          ) -> torch.Tensor:
    """dQ by the tiled dQ kernel with `config` (the "bwd_dq" role's) through `launch`, from what
    `backward_pre` returned (dout, the dense lse, delta and lse2); `arguments`: `_backward_arguments`'
    result when the caller already has it."""
    varlen, batch, _, _, span_q, _ = _geometry({**args, "q": q, "k": k})
    dq = (torch.zeros if varlen else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    common, constexprs = arguments if arguments is not None else _backward_arguments(q, k, v, dout, args)
    cu_q, cu_k = (args["cu_seqlens_q"], args["cu_seqlens_k"]) if varlen else (q, q)
    launch(
        _attention_bwd_dq_kernel, (cdiv(span_q, config.blocks["BLOCK_M"]), q.shape[-2], batch),
        q, k, v, dout, lse2, delta, dq, cu_q, cu_k, *common, *_strides(dq, varlen), *_lse_strides(lse, varlen),
        **constexprs, **config.blocks, **config.knobs())
    return dq
