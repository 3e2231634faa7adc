"""sparse_mla's head-block backward: its Triton kernels, their launchers and `_backward`, which runs
them in order, for both vendors; `BackwardPasses`, through which a variant brings its own fused and dq
passes (the Gluon ones for Hopper: kernels/nvidia/sparse_mla_warpspec_bwd.py).

The backward starts with a small pre pass (Delta = rowsum(dO * O), the shift of P, the sink's
per-query terms). By default one fused pass follows, in the forward's program layout: per top-k tile it
recomputes P, computes dP and dS, accumulates dQ in registers and adds the tile's dKV rows (both the
key role through Q and the value role through dO, summed over the program's heads) to an fp32 dkv with
atomics, so every gathered tile is read once for all of it. With `deterministic` (no atomics, the same
bits every run) three passes run per chunk of queries instead: the dq pass (dQ, and dS and P into a
16-bit workspace), the dkv pass (one top-k tile of one query, dS^T Q + P^T dO over all heads, each
row's sum into an fp32 workspace) and the sum pass (each kv row adds its workspace rows in a fixed
order). Chunks are sized so that the workspaces stay under WORKSPACE_BYTES.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kreg.core.nvtx import nvtx_range
from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.sparse_mla.gather import (
    _gather_rows,
    _grid,
    _row_offsets,
    _rows_fit_int32,
    _strides,
    d_tiles_that_fit,
    dim_blocks,
    group_head_cap,
)
from kreg.kernels.common.tiles import cdiv

# Kernels can only read globals that are constexprs.


@triton.jit
def _q_or_dout(q_row, do_row, cols, is_do, mask, BY_SELECT: tl.constexpr):
    """A tile whose rows are dO where `is_do` and Q elsewhere, from row pointers `q_row`/`do_row` [R, 1]
    and columns `cols` [1, C]: one load through a select between the two tensors' row pointers, or
    (BY_SELECT False: AMD, whose pointer canonicalization in Triton 3.6 cannot take such a select once
    the tensors fit 32-bit offsets) two loads with disjoint masks."""
    if BY_SELECT:
        return tl.load(tl.where(is_do[:, None], do_row, q_row) + cols, mask=mask, other=0.0)
    else:
        q = tl.load(q_row + cols, mask=mask & ~is_do[:, None], other=0.0)
        do = tl.load(do_row + cols, mask=mask & is_do[:, None], other=0.0)
        return q + do


@triton.jit
def _sparse_mla_bwd_pre_kernel(
    SINK, OUT, DOUT, LSE, DELTA, SHIFT, DSINK,
    heads_per_group, head_blocks,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_mb, stride_ms,
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """Backward, preprocessing. One program: BLOCK_H heads of one kv group of one query.

    Writes, laid out like lse: Delta = rowsum(dO * O); the shift of P in log2 units,
    lse_tot * log2(e) with lse_tot = logaddexp(lse, sink) (+inf for a row with no valid slot, so every
    P of it is 0); with a sink, this query's term of d sink[h], -sigmoid(sink - lse) * Delta (0 for an
    empty row), summed over queries by the launcher in a fixed order (no atomics).
    """
    t = tl.program_id(0)
    g = tl.program_id(1) // head_blocks
    hb = tl.program_id(1) % head_blocks
    b = tl.program_id(2).to(tl.int64)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = offs_h < heads_per_group
    heads = g * heads_per_group + offs_h
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = head_ok[:, None] & (offs_dv[None, :] < D_V)
    o = tl.load(OUT + b * stride_ob + t.to(tl.int64) * stride_os + heads[:, None].to(tl.int64) * stride_oh
                + offs_dv[None, :], mask=dv_mask, other=0.0)
    do = tl.load(DOUT + b * stride_dob + t.to(tl.int64) * stride_dos + heads[:, None].to(tl.int64) * stride_doh
                 + offs_dv[None, :], mask=dv_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)

    m_off = b * stride_mb + t.to(tl.int64) * stride_ms + heads
    lse = tl.load(LSE + m_off, mask=head_ok, other=float("inf"))
    empty = lse == float("inf")
    lse_tot = tl.where(empty, 0.0, lse)
    if HAS_SINK:
        sink = tl.load(SINK + heads, mask=head_ok, other=0.0)
        # logaddexp as hi + log(1 + exp(lo - hi)) and the sink's weight as a sigmoid: both stay
        # NaN-free for sinks of +-inf (a +inf sink makes lse_tot +inf and every P 0).
        hi = tl.maximum(lse_tot, sink)
        lo = tl.minimum(lse_tot, sink)
        lse_tot = hi + tl.log(1.0 + tl.exp(lo - hi))
        dsink = -delta / (1.0 + tl.exp(tl.where(empty, 0.0, lse) - sink))
        tl.store(DSINK + m_off, tl.where(empty, 0.0, dsink), mask=head_ok)
    tl.store(DELTA + m_off, delta, mask=head_ok)
    tl.store(SHIFT + m_off, tl.where(empty, float("inf"), lse_tot * LOG2E), mask=head_ok)


@triton.jit
def _sparse_mla_bwd_fused_kernel(
    Q, KV, IDX, TOPK_LEN, DOUT, DELTA, SHIFT, DQ, DKV,
    s_kv, topk, heads_per_group, head_blocks, sm_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs, stride_kvh,
    stride_ib, stride_is, stride_ih,
    stride_lb, stride_ls,
    stride_dob, stride_dos, stride_doh,
    stride_mb, stride_ms,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_TOPK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, ROWS_I32: tl.constexpr,
    D_SPLIT: tl.constexpr, ROWS_BY_SELECT: tl.constexpr,
):
    """Backward in one pass. One program: BLOCK_H heads of one kv group of one query.

    Q and dO of the heads are stacked into one tile Z = [Q; dO] (2 * BLOCK_H rows, the value part of
    d_qk in D_SPLIT column chunks) that stays resident; Q's rope tail is its own tile. Per top-k tile of
    gathered rows K (V is its first d_v columns):
    - [S; dP] = Z K^T in one product (2 * BLOCK_H rows: Triton gives a dot whose result feeds
      another dot all warps along M, so with one BLOCK_H-row product per warpgroup neither is computed
      twice), plus Q_tail K_tail^T for S; P = exp2(S * log2(e) * sm_scale - shift), dS = P (dP - Delta)
      sm_scale, with Delta and the shift from the pre pass;
    - dQ += dS K, in registers (one accumulator per D chunk and one for the tail);
    - the dKV rows of the tile, per D chunk c: dKV_c^T = Z_c^T [dS; P] (the key role through Q and the
      value role through dO in one product: M = the chunk's columns, so wgmma spreads it over all warps
      whatever BLOCK_TOPK), and the tail's Q_tail^T dS; each added to the fp32 dkv with relaxed
      atomics (vector reductions on sm_90), since other queries, the group's other head blocks and
      duplicate slots add to the same rows.
    Invalid slots gather zeros, get P = 0 and add nothing; dQ is stored once at the end.
    """
    t = tl.program_id(0)
    g = tl.program_id(1) // head_blocks
    hb = tl.program_id(1) % head_blocks
    b = tl.program_id(2).to(tl.int64)
    BLOCK_DS: tl.constexpr = BLOCK_DV // D_SPLIT
    offs_d = tl.arange(0, BLOCK_DS)
    offs_t = tl.arange(0, BLOCK_TOPK)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = offs_h < heads_per_group
    heads = g * heads_per_group + offs_h

    # Row r of Z: Q of head r (r < BLOCK_H), else dO of head r - BLOCK_H; heads past the group read 0.
    offs_r = tl.arange(0, 2 * BLOCK_H)
    is_do = offs_r >= BLOCK_H
    row_h = hb * BLOCK_H + offs_r % BLOCK_H
    row_ok = row_h < heads_per_group
    rows_h = (g * heads_per_group + row_h).to(tl.int64)
    q_row = Q + b * stride_qb + t.to(tl.int64) * stride_qs + rows_h[:, None] * stride_qh
    do_row = DOUT + b * stride_dob + t.to(tl.int64) * stride_dos + rows_h[:, None] * stride_doh
    z = ()
    for c in tl.static_range(D_SPLIT):
        z = z + (_q_or_dout(q_row, do_row, c * BLOCK_DS + offs_d[None, :], is_do,
                            row_ok[:, None] & (offs_d[None, :] < D_V - c * BLOCK_DS), ROWS_BY_SELECT),)
    if D_TAIL > 0:
        offs_dt = tl.arange(0, BLOCK_DT)
        q_tail = tl.load(Q + b * stride_qb + t.to(tl.int64) * stride_qs + heads[:, None].to(tl.int64) * stride_qh
                         + D_V + offs_dt[None, :], mask=head_ok[:, None] & (offs_dt[None, :] < D_TAIL), other=0.0)
    m_off = b * stride_mb + t.to(tl.int64) * stride_ms + heads
    delta = tl.load(DELTA + m_off, mask=head_ok, other=0.0)
    shift = tl.load(SHIFT + m_off, mask=head_ok, other=float("inf"))
    qk_scale = sm_scale * LOG2E

    n_slots = topk
    if HAS_TOPK_LEN:
        n_slots = tl.minimum(tl.load(TOPK_LEN + b * stride_lb + t.to(tl.int64) * stride_ls), topk)
    idx_row = IDX + b * stride_ib + t.to(tl.int64) * stride_is + g.to(tl.int64) * stride_ih
    kv_base = KV + b * stride_kvb + g.to(tl.int64) * stride_kvh
    dkv_base = DKV + b * stride_dkb + g.to(tl.int64) * stride_dkh

    dq = ()
    for _ in tl.static_range(D_SPLIT):
        dq = dq + (tl.zeros([BLOCK_H, BLOCK_DS], tl.float32),)
    if D_TAIL > 0:
        dq_tail = tl.zeros([BLOCK_H, BLOCK_DT], tl.float32)
    for start in range(0, n_slots, BLOCK_TOPK):
        slots = start + offs_t
        idx = tl.load(idx_row + slots, mask=slots < n_slots, other=-1)
        valid = (idx >= 0) & (idx < s_kv)
        kv_row = kv_base + _row_offsets(idx, valid, stride_kvs, ROWS_I32)
        k = ()
        for c in tl.static_range(D_SPLIT):
            k = k + (_gather_rows(kv_row + c * BLOCK_DS, offs_d, valid, D_V - c * BLOCK_DS, BLOCK_DS),)
        if D_TAIL > 0:
            k_tail = _gather_rows(kv_row + D_V, offs_dt, valid, D_TAIL, BLOCK_DT)
        sdp = tl.dot(z[0], tl.trans(k[0]))
        for c in tl.static_range(1, D_SPLIT):
            sdp = tl.dot(z[c], tl.trans(k[c]), sdp)
        # Rows of Q to S, rows of dO to dP: the split moves them into the same threads.
        s, dp = tl.split(tl.permute(tl.reshape(sdp, (2, BLOCK_H, BLOCK_TOPK)), (1, 2, 0)))
        if D_TAIL > 0:
            s += tl.dot(q_tail, tl.trans(k_tail))
        p = tl.math.exp2(s * qk_scale - shift[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        ds = p * (dp - delta[:, None]) * sm_scale
        ds16 = ds.to(k[0].dtype)
        new_dq = ()
        for c in tl.static_range(D_SPLIT):
            new_dq = new_dq + (tl.dot(ds16, k[c], dq[c]),)
        dq = new_dq
        if D_TAIL > 0:
            dq_tail = tl.dot(ds16, k_tail, dq_tail)
        w = tl.reshape(tl.permute(tl.join(ds, p), (2, 0, 1)), (2 * BLOCK_H, BLOCK_TOPK)).to(k[0].dtype)
        dkv_row = dkv_base + _row_offsets(idx, valid, stride_dks, ROWS_I32)
        for c in tl.static_range(D_SPLIT):
            dkv_c = tl.dot(tl.trans(z[c]), w)
            tl.atomic_add(dkv_row[None, :] + c * BLOCK_DS + offs_d[:, None], dkv_c,
                          mask=valid[None, :] & (offs_d[:, None] < D_V - c * BLOCK_DS), sem="relaxed")
        if D_TAIL > 0:
            dkv_tail = tl.dot(tl.trans(q_tail), ds16)
            tl.atomic_add(dkv_row[None, :] + D_V + offs_dt[:, None], dkv_tail,
                          mask=valid[None, :] & (offs_dt[:, None] < D_TAIL), sem="relaxed")

    dq_row = DQ + b * stride_dqb + t.to(tl.int64) * stride_dqs + heads[:, None].to(tl.int64) * stride_dqh
    for c in tl.static_range(D_SPLIT):
        tl.store(dq_row + c * BLOCK_DS + offs_d[None, :], dq[c].to(DQ.dtype.element_ty),
                 mask=head_ok[:, None] & (offs_d[None, :] < D_V - c * BLOCK_DS))
    if D_TAIL > 0:
        tl.store(dq_row + D_V + offs_dt[None, :], dq_tail.to(DQ.dtype.element_ty),
                 mask=head_ok[:, None] & (offs_dt[None, :] < D_TAIL))


@triton.jit
def _sparse_mla_bwd_dq_kernel(
    Q, KV, IDX, TOPK_LEN, DOUT, DELTA, SHIFT, DQ, PDS,
    s_kv, topk, heads_per_group, head_blocks, sm_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs, stride_kvh,
    stride_ib, stride_is, stride_ih,
    stride_lb, stride_ls,
    stride_dob, stride_dos, stride_doh,
    stride_mb, stride_ms,
    stride_dqb, stride_dqs, stride_dqh,
    stride_pb, stride_ps, stride_pg, stride_pt,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_TOPK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, ROWS_I32: tl.constexpr,
):
    """Deterministic backward, first pass. One program: dQ of BLOCK_H heads of one kv group of one query.

    Recomputes P = exp2(z * log2(e) - shift) per top-k tile, with Delta and the shift from the pre
    pass, dP = dO V^T, dS = P (dP - Delta); dQ = sum over tiles of dS K stays in registers. Writes dS^T
    and P^T (16-bit, as the dots consume them) to the workspace PDS [b, s_q, h_kv, topk,
    2 * heads_per_group] for the dkv pass: columns h for dS, heads_per_group + h for P, one row per
    top-k slot it visits (slots past topk_length are not written).
    """
    t = tl.program_id(0)
    g = tl.program_id(1) // head_blocks
    hb = tl.program_id(1) % head_blocks
    b = tl.program_id(2).to(tl.int64)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = offs_h < heads_per_group
    heads = g * heads_per_group + offs_h
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_t = tl.arange(0, BLOCK_TOPK)
    dv_mask = head_ok[:, None] & (offs_dv[None, :] < D_V)

    q_row = Q + b * stride_qb + t.to(tl.int64) * stride_qs + heads[:, None].to(tl.int64) * stride_qh
    q_main = tl.load(q_row + offs_dv[None, :], mask=dv_mask, other=0.0)
    if D_TAIL > 0:
        offs_dt = tl.arange(0, BLOCK_DT)
        dt_mask = head_ok[:, None] & (offs_dt[None, :] < D_TAIL)
        q_tail = tl.load(q_row + D_V + offs_dt[None, :], mask=dt_mask, other=0.0)
    do_off = b * stride_dob + t.to(tl.int64) * stride_dos + heads[:, None].to(tl.int64) * stride_doh
    do = tl.load(DOUT + do_off + offs_dv[None, :], mask=dv_mask, other=0.0)
    m_off = b * stride_mb + t.to(tl.int64) * stride_ms + heads
    delta = tl.load(DELTA + m_off, mask=head_ok, other=0.0)
    shift = tl.load(SHIFT + m_off, mask=head_ok, other=float("inf"))
    qk_scale = sm_scale * LOG2E
    pds_base = PDS + b * stride_pb + t.to(tl.int64) * stride_ps + g.to(tl.int64) * stride_pg

    n_slots = topk
    if HAS_TOPK_LEN:
        n_slots = tl.minimum(tl.load(TOPK_LEN + b * stride_lb + t.to(tl.int64) * stride_ls), topk)
    idx_row = IDX + b * stride_ib + t.to(tl.int64) * stride_is + g.to(tl.int64) * stride_ih
    kv_base = KV + b * stride_kvb + g.to(tl.int64) * stride_kvh

    dq_main = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
    if D_TAIL > 0:
        dq_tail = tl.zeros([BLOCK_DT, BLOCK_H], tl.float32)
    for start in range(0, n_slots, BLOCK_TOPK):
        slots = start + offs_t
        idx = tl.load(idx_row + slots, mask=slots < n_slots, other=-1)
        valid = (idx >= 0) & (idx < s_kv)
        kv_row = kv_base + _row_offsets(idx, valid, stride_kvs, ROWS_I32)
        kv_main = _gather_rows(kv_row, offs_dv, valid, D_V, BLOCK_DV)
        scores = tl.dot(q_main, tl.trans(kv_main))
        if D_TAIL > 0:
            kv_tail = _gather_rows(kv_row + D_V, offs_dt, valid, D_TAIL, BLOCK_DT)
            scores += tl.dot(q_tail, tl.trans(kv_tail))
        p = tl.math.exp2(scores * qk_scale - shift[:, None])
        p = tl.where(valid[None, :] & head_ok[:, None], p, 0.0)
        dp = tl.dot(do, tl.trans(kv_main))
        ds_t = tl.trans((p * (dp - delta[:, None]) * sm_scale).to(kv_main.dtype))
        pds_row = pds_base + slots[:, None] * stride_pt + offs_h[None, :]
        pds_mask = (slots < n_slots)[:, None] & head_ok[None, :]
        tl.store(pds_row, ds_t, mask=pds_mask)
        tl.store(pds_row + heads_per_group, tl.trans(p.to(kv_main.dtype)), mask=pds_mask)
        # dQ^T = K^T dS^T: 512 rows of M let wgmma split them over all warps (dS K has only BLOCK_H).
        dq_main = tl.dot(tl.trans(kv_main), ds_t, dq_main)
        if D_TAIL > 0:
            dq_tail = tl.dot(tl.trans(kv_tail), ds_t, dq_tail)

    dq_row = DQ + b * stride_dqb + t.to(tl.int64) * stride_dqs + heads[:, None].to(tl.int64) * stride_dqh
    tl.store(dq_row + offs_dv[None, :], tl.trans(dq_main).to(DQ.dtype.element_ty), mask=dv_mask)
    if D_TAIL > 0:
        tl.store(dq_row + D_V + offs_dt[None, :], tl.trans(dq_tail).to(DQ.dtype.element_ty), mask=dt_mask)


@triton.jit
def _sparse_mla_bwd_dkv_kernel(
    Q, IDX, TOPK_LEN, DOUT, PDS, WS,
    s_kv, topk, heads_per_group, topk_tiles,
    stride_qb, stride_qs, stride_qh,
    stride_ib, stride_is, stride_ih,
    stride_lb, stride_ls,
    stride_dob, stride_dos, stride_doh,
    stride_pb, stride_ps, stride_pg, stride_pt,
    stride_wb, stride_ws, stride_wg, stride_wt,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_TOPK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, ROWS_I32: tl.constexpr,
    ROWS_BY_SELECT: tl.constexpr,
):
    """Deterministic backward, second pass. One program: the dKV contribution of one top-k tile of one
    query.

    A GEMM over the group's heads, in chunks of BLOCK_H, from the first pass's dS^T and P^T: every row
    of the tile gets dS^T Q (key role, all d_qk dims) plus P^T dO (value role, first d_v dims). Q's
    value dims and dO are stacked into one [2 * BLOCK_H, d_v] tile against [dS^T | P^T], so one dot
    does both (two accumulating dots in a row would get two layouts for the accumulator from Triton,
    and a conversion between them every step). Each valid slot's row is stored (fp32) at its own place
    of the workspace WS [b, s_q, h_kv, topk, d_qk] (ROWS_I32: a query's topk rows are addressed in
    int32); the sum pass adds them into dkv in a fixed order. Nothing is gathered: no kv read at all.
    """
    t = tl.program_id(0)
    g = tl.program_id(1) // topk_tiles
    start = (tl.program_id(1) % topk_tiles) * BLOCK_TOPK
    b = tl.program_id(2).to(tl.int64)

    n_slots = topk
    if HAS_TOPK_LEN:
        n_slots = tl.minimum(tl.load(TOPK_LEN + b * stride_lb + t.to(tl.int64) * stride_ls), topk)
    if start < n_slots:
        offs_dv = tl.arange(0, BLOCK_DV)
        slots = start + tl.arange(0, BLOCK_TOPK)
        idx_row = IDX + b * stride_ib + t.to(tl.int64) * stride_is + g.to(tl.int64) * stride_ih
        idx = tl.load(idx_row + slots, mask=slots < n_slots, other=-1)
        valid = (idx >= 0) & (idx < s_kv)
        dkv_main = tl.zeros([BLOCK_TOPK, BLOCK_DV], tl.float32)
        if D_TAIL > 0:
            offs_dt = tl.arange(0, BLOCK_DT)
            dkv_tail = tl.zeros([BLOCK_TOPK, BLOCK_DT], tl.float32)

        q_base = Q + b * stride_qb + t.to(tl.int64) * stride_qs
        do_base = DOUT + b * stride_dob + t.to(tl.int64) * stride_dos
        pds_row = PDS + b * stride_pb + t.to(tl.int64) * stride_ps + g.to(tl.int64) * stride_pg
        pds_row += slots[:, None] * stride_pt
        offs_r = tl.arange(0, 2 * BLOCK_H)
        is_do = offs_r >= BLOCK_H
        for h0 in range(0, heads_per_group, BLOCK_H):
            # Row r of the stacked tile: Q (r < BLOCK_H) or dO of head h0 + r % BLOCK_H; column r of
            # [dS^T | P^T] is the matching dS or P column of the workspace.
            row_h = h0 + offs_r % BLOCK_H
            row_ok = row_h < heads_per_group
            rows_h = (g * heads_per_group + row_h).to(tl.int64)
            qd = _q_or_dout(q_base + rows_h[:, None] * stride_qh, do_base + rows_h[:, None] * stride_doh,
                            offs_dv[None, :], is_do, row_ok[:, None] & (offs_dv[None, :] < D_V), ROWS_BY_SELECT)
            pds_col = tl.where(is_do, heads_per_group, 0) + row_h
            pds = tl.load(pds_row + pds_col[None, :], mask=valid[:, None] & row_ok[None, :], other=0.0)
            dkv_main = tl.dot(pds, qd, dkv_main)
            if D_TAIL > 0:
                offs_h = h0 + tl.arange(0, BLOCK_H)
                head_ok = offs_h < heads_per_group
                q_tail = tl.load(q_base + (g * heads_per_group + offs_h)[:, None].to(tl.int64) * stride_qh + D_V
                                 + offs_dt[None, :], mask=head_ok[:, None] & (offs_dt[None, :] < D_TAIL), other=0.0)
                ds_t = tl.load(pds_row + offs_h[None, :], mask=valid[:, None] & head_ok[None, :], other=0.0)
                dkv_tail = tl.dot(ds_t, q_tail, dkv_tail)

        ws_row = WS + b * stride_wb + t.to(tl.int64) * stride_ws + g.to(tl.int64) * stride_wg
        ws_row += _row_offsets(slots, valid, stride_wt, ROWS_I32)[:, None]
        tl.store(ws_row + offs_dv[None, :], dkv_main, mask=valid[:, None] & (offs_dv[None, :] < D_V))
        if D_TAIL > 0:
            tl.store(ws_row + D_V + offs_dt[None, :], dkv_tail, mask=valid[:, None] & (offs_dt[None, :] < D_TAIL))


@triton.jit
def _sparse_mla_bwd_sum_kernel(WS, ORDER, SEGMENTS, DKV, d_qk, BLOCK_D: tl.constexpr):
    """Deterministic backward, third pass. One program: BLOCK_D columns of one row of the fp32 dkv
    (row r of dkv viewed as [b * s_kv * h_kv, d_qk]).

    Adds to it the workspace rows ORDER[SEGMENTS[r]:SEGMENTS[r + 1]], every valid (query, slot) of the
    chunk that selected that row, in query and slot order: a fixed summation order, no atomics (the
    program owns its row). Rows the chunk does not select are not touched.
    """
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < d_qk
    first = tl.load(SEGMENTS + r)
    last = tl.load(SEGMENTS + r + 1)
    if first < last:
        acc = tl.zeros([BLOCK_D], tl.float32)
        for i in range(first, last):
            acc += tl.load(WS + tl.load(ORDER + i) * d_qk + offs, mask=mask, other=0.0)
        dkv = DKV + r * d_qk + offs
        tl.store(dkv, tl.load(dkv, mask=mask, other=0.0) + acc, mask=mask)


# ----------------------------------------------------------------------------- launchers
def _capped(config: LaunchConfig, heads_per_group: int) -> dict:
    """A backward role's blocks as launched: the head block no wider than the group's heads rounded up."""
    return {**config.blocks, "BLOCK_H": min(config.blocks["BLOCK_H"], group_head_cap(heads_per_group))}


def fused_blocks(config: LaunchConfig, heads_per_group: int, block_dv: int) -> dict:
    """The fused kernel's blocks as launched: the head block capped like every role's, and the D chunks
    that fit (`d_tiles_that_fit`)."""
    blocks = _capped(config, heads_per_group)
    return {**blocks, "D_SPLIT": d_tiles_that_fit(blocks["D_SPLIT"], block_dv)}


# The deterministic passes hand P and dS from the dq pass to the dkv pass (topk * 2 * h_q 16-bit values
# per query) and each (query, slot)'s dkv row from the dkv pass to the sum pass (topk * h_kv * d_qk fp32
# values) through workspaces; queries are processed in chunks so that they stay under this many bytes.
WORKSPACE_BYTES = 512 * 2**20


class BackwardPasses(NamedTuple):
    """A variant's launchers of the two backward passes it may bring its own kernel for, the fused pass
    (`_fused_pass`'s arguments) and the deterministic backward's dq pass (`_dq_pass`'s), and how the
    head-block fused and dkv kernels stack Q and dO rows (`rows_by_select`: one load through a select
    between the two tensors' pointers; False: two masked loads, what AMD's compiler takes)."""

    fused: Callable
    dq: Callable
    rows_by_select: bool = True


def _backward(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, lse, dout, config: CallConfig,
              deterministic: bool, passes: BackwardPasses):
    """The backward on batched-layout tensors: the pre pass, then the fused pass (`passes.fused`: the
    head-block kernel's `_fused_pass` or a variant's own), or with `deterministic` the dq (`passes.dq`),
    dkv and sum passes (no atomics); returns (dq, dkv, dsink)."""
    b, s_q, h_q, d_qk = q.shape
    h_kv = kv.shape[2]
    heads_per_group = h_q // h_kv
    block_dv, block_dt = dim_blocks(d_qk, d_v)
    # The stacked [Q; dO] tiles load q and dout rows through one pointer tensor: same dtype, unit last stride.
    dout = dout.to(q.dtype)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    # Delta, the shift and the sink's per-query terms are laid out like lse (one stride pair for all).
    lse = lse.contiguous()
    delta, shift = torch.empty_like(lse), torch.empty_like(lse)
    dsink_rows = torch.empty_like(lse) if attn_sink is not None else None
    pre = _capped(config["bwd_pre"], heads_per_group)
    grid, head_blocks = _grid(s_q, h_q, h_kv, b, pre["BLOCK_H"])
    with nvtx_range("sparse_mla/bwd_pre_kernel"):
        _sparse_mla_bwd_pre_kernel[grid](
            attn_sink, out, dout, lse, delta, shift, dsink_rows, heads_per_group, head_blocks,
            *_strides(out, 3), *_strides(dout, 3), *_strides(lse, 2),
            D_V=d_v, BLOCK_DV=block_dv, HAS_SINK=attn_sink is not None, **pre, **config["bwd_pre"].knobs(),
        )
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)
    dims = {"D_V": d_v, "D_TAIL": d_qk - d_v, "BLOCK_DV": block_dv, "BLOCK_DT": block_dt,
            "HAS_TOPK_LEN": topk_length is not None}
    if deterministic:
        _deterministic_passes(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, dkv, config, dims,
                              passes.dq, passes.rows_by_select)
    else:
        with nvtx_range("sparse_mla/bwd_fused_kernel"):
            passes.fused(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, dkv, config["bwd_fused"],
                         {**dims, "ROWS_BY_SELECT": passes.rows_by_select})
    dsink = None if dsink_rows is None else dsink_rows.sum((0, 1))
    return dq, dkv.to(kv.dtype), dsink


def _fused_pass(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, dkv, config: LaunchConfig,
                dims: dict) -> None:
    """The head-block fused pass: dq written, every selected row's dkv added to the zeroed fp32 dkv.
    Delta and the shift are laid out like lse; `dims` holds the kernel's dimension constexprs and
    ROWS_BY_SELECT (`BackwardPasses.rows_by_select`)."""
    b, s_q, h_q, _ = q.shape
    h_kv = kv.shape[2]
    heads_per_group = h_q // h_kv
    blocks = fused_blocks(config, heads_per_group, dims["BLOCK_DV"])
    grid, head_blocks = _grid(s_q, h_q, h_kv, b, blocks["BLOCK_H"])
    _sparse_mla_bwd_fused_kernel[grid](
        q, kv, indices, topk_length, dout, delta, shift, dq, dkv,
        kv.shape[1], indices.shape[-1], heads_per_group, head_blocks, sm_scale,
        *_strides(q, 3), *_strides(kv, 3), *_strides(indices, 3), *_strides(topk_length, 2),
        *_strides(dout, 3), *_strides(delta, 2), *_strides(dq, 3), *_strides(dkv, 3),
        **dims, ROWS_I32=_rows_fit_int32(kv, dkv), **blocks, **config.knobs(),
    )


def _dq_pass(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, pds, config: LaunchConfig,
             dims: dict) -> None:
    """The head-block dq pass of the deterministic backward on a chunk of queries: dq written, and dS^T
    and P^T of every slot into the workspace pds [b, s_q, h_kv, topk, 2 * heads_per_group]."""
    b, s_q, h_q, _ = q.shape
    h_kv = kv.shape[2]
    heads_per_group = h_q // h_kv
    blocks = _capped(config, heads_per_group)
    grid, head_blocks = _grid(s_q, h_q, h_kv, b, blocks["BLOCK_H"])
    _sparse_mla_bwd_dq_kernel[grid](
        q, kv, indices, topk_length, dout, delta, shift, dq, pds,
        kv.shape[1], indices.shape[-1], heads_per_group, head_blocks, sm_scale,
        *_strides(q, 3), *_strides(kv, 3), *_strides(indices, 3), *_strides(topk_length, 2),
        *_strides(dout, 3), *_strides(delta, 2), *_strides(dq, 3), *_strides(pds, 4),
        **dims, ROWS_I32=_rows_fit_int32(kv), **blocks, **config.knobs(),
    )


def _deterministic_passes(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, dkv, config: CallConfig,
                          dims: dict, run_dq, rows_by_select: bool) -> None:
    """dq and the fp32 dkv without atomics, a chunk of queries at a time: the dq pass (`run_dq`: dq, and
    dS and P into a workspace), the dkv pass (each selected row's contribution into a second workspace)
    and the sum pass, which adds those rows into dkv in the order of a stable sort of the chunk's slots
    by the dkv row they select (no host sync: the sort and its segment bounds stay on the device)."""
    b, s_q, h_q, d_qk = q.shape
    s_kv, h_kv, topk = kv.shape[1], kv.shape[2], indices.shape[-1]
    heads_per_group = h_q // h_kv
    dkv_blocks = _capped(config["bwd_dkv"], heads_per_group)
    sum_blocks = config["bwd_sum"].blocks
    # Per query: the dS/P workspace, the dkv rows, and the sort's keys, order and sorted keys (int64).
    per_query = b * h_kv * topk * (2 * heads_per_group * q.element_size() + 4 * d_qk + 24)
    chunk = max(1, min(s_q, WORKSPACE_BYTES // per_query))
    pds = torch.empty((b, chunk, h_kv, topk, 2 * heads_per_group), device=q.device, dtype=q.dtype)
    ws = torch.empty(b * chunk * h_kv * topk * d_qk, device=q.device, dtype=torch.float32)
    # Slot (b, t, g, j) adds to dkv row (b * s_kv + idx) * h_kv + g; invalid slots get key `rows` and sort last.
    rows = b * s_kv * h_kv
    row_base = (torch.arange(b, device=q.device) * s_kv).view(b, 1, 1, 1)
    group = torch.arange(h_kv, device=q.device).view(1, 1, h_kv, 1)
    bounds = torch.arange(rows + 1, device=q.device)
    slot = torch.arange(topk, device=q.device, dtype=torch.int32)
    topk_tiles = cdiv(topk, dkv_blocks["BLOCK_TOPK"])
    for c0 in range(0, s_q, chunk):
        span = slice(c0, min(s_q, c0 + chunk))
        q_c, dout_c, idx_c = q[:, span], dout[:, span], indices[:, span]
        len_c = topk_length[:, span] if topk_length is not None else None
        n = q_c.shape[1]
        valid = (idx_c >= 0) & (idx_c < s_kv)
        if len_c is not None:
            valid &= slot < len_c[:, :, None, None]
        keys = torch.where(valid, (row_base + idx_c) * h_kv + group, rows)
        sorted_keys, order = torch.sort(keys.flatten(), stable=True)
        segments = torch.searchsorted(sorted_keys, bounds)
        ws_c = ws[: b * n * h_kv * topk * d_qk].view(b, n, h_kv, topk, d_qk)
        with nvtx_range("sparse_mla/bwd_dq_kernel"):
            run_dq(q_c, kv, idx_c, sm_scale, len_c, dout_c, delta[:, span], shift[:, span], dq[:, span], pds,
                   config["bwd_dq"], dims)
        with nvtx_range("sparse_mla/bwd_dkv_kernel"):
            _sparse_mla_bwd_dkv_kernel[(n, h_kv * topk_tiles, b)](
                q_c, idx_c, len_c, dout_c, pds, ws_c,
                s_kv, topk, heads_per_group, topk_tiles,
                *_strides(q_c, 3), *_strides(idx_c, 3), *_strides(len_c, 2), *_strides(dout, 3), *_strides(pds, 4),
                *_strides(ws_c, 4),
                **dims, ROWS_I32=topk * d_qk < 2**31, ROWS_BY_SELECT=rows_by_select, **dkv_blocks,
                **config["bwd_dkv"].knobs(),
            )
        with nvtx_range("sparse_mla/bwd_sum_kernel"):
            _sparse_mla_bwd_sum_kernel[(rows, cdiv(d_qk, sum_blocks["BLOCK_D"]))](
                ws_c, order, segments, dkv, d_qk, **sum_blocks, **config["bwd_sum"].knobs(),
            )


# The head-block kernels' backward passes (a variant with kernels of its own replaces some).
HEAD_BLOCK_PASSES = BackwardPasses(_fused_pass, _dq_pass)
