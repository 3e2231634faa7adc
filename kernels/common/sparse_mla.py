"""Sparse MLA (DeepSeek-V3.2, FlashMLA's sparse prefill): the Triton kernel bodies both vendors share.

The idea that matters: every head of a kv group reads the same gathered latent row per selected index.
One program owns BLOCK_H heads of one query (of one group), gathers each BLOCK_TOPK tile of indexed
rows once and reuses it for all of them, both as keys (all d_qk dims: the d_v "value" part plus the
rope tail) and as values (the first d_v dims). Q is loaded once, outside the top-k loop. A program with
too few heads re-gathers the same rows many times; the config spaces therefore offer BLOCK_H up to 128.

The backward runs in two passes per chunk of queries: the dq pass (the forward's program layout)
recomputes P and dS tile by tile, accumulates dQ and hands dS and P to the dkv pass through a 16-bit
workspace; the dkv pass owns one top-k tile of one query and sums dS^T Q + P^T dO over all heads
before one fp32 atomic add per selected row.

Reads top-down: forward kernel, backward kernels, launchers, the autograd Function, compile specs.
Semantics: `registry.ops.sparse_mla.reference` (docs/op-contracts.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.base import CompileSpec
from kernels.common.tiles import cdiv, dot_block
from registry.ops.sparse_mla import SparseMLAOutput
from tuning_db.records import CallConfig, LaunchConfig

# Kernels can only read globals that are constexprs.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def dim_blocks(d_qk: int, d_v: int) -> tuple[int, int]:
    """(BLOCK_DV, BLOCK_DT): power-of-two tiles for the value part and the tail d_qk - d_v (0: none)."""
    tail = d_qk - d_v
    return dot_block(d_v), (dot_block(tail) if tail else 0)


def group_head_cap(heads_per_group: int) -> int:
    """The widest useful head tile: the group's heads rounded up to a power of two (at least 16, tl.dot's M)."""
    return dot_block(heads_per_group)


# ----------------------------------------------------------------------------- Triton kernels
@triton.jit
def _gather_rows(kv_row, offs_d, valid, D_LIMIT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load [BLOCK_TOPK, BLOCK_D] from gathered row pointers; invalid slots and pad columns read 0."""
    if D_LIMIT < BLOCK_D:
        mask = valid[:, None] & (offs_d[None, :] < D_LIMIT)
    else:
        mask = valid[:, None]
    return tl.load(kv_row[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _row_offsets(idx, valid, stride, ROWS_I32: tl.constexpr):
    """Element offsets of the gathered rows (row 0 stands in for invalid slots, which stay masked).
    int32 arithmetic when the launcher proved s_kv * stride fits: 64-bit offsets cost the registers
    that decide whether the wide head blocks spill on sm_90."""
    safe = tl.where(valid, idx, 0)
    if not ROWS_I32:
        safe = safe.to(tl.int64)
    return safe * stride


@triton.jit
def _sparse_mla_fwd_kernel(
    Q, KV, IDX, SINK, TOPK_LEN, OUT, MAX_LOGITS, LSE,
    s_kv, topk, heads_per_group, head_blocks, qk_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs, stride_kvh,
    stride_ib, stride_is, stride_ih,
    stride_lb, stride_ls,
    stride_ob, stride_os, stride_oh,
    stride_mb, stride_ms,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_TOPK: tl.constexpr, HAS_SINK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr,
    ROWS_I32: tl.constexpr, D_SPLIT: tl.constexpr,
):
    """One program: BLOCK_H heads of one kv group of one query (of one batch row).

    Online softmax over the query's top-k slots in tiles of BLOCK_TOPK, in log2 units (`qk_scale` is
    sm_scale * log2(e)). Writes out [BLOCK_H, d_v], max_logits and the natural-log lse; a row with no
    valid slot writes out 0, max_logits -inf and lse +inf.

    D_SPLIT (1 or 2) cuts the value part of d_qk into that many D tiles of BLOCK_DV / D_SPLIT columns
    (the rope tail is its own tile either way): each tile is its own dot for the scores and its own
    accumulator for out, so every operand a dot stages is that much smaller (what lets wider top-k
    tiles fit in gfx942's 64 KiB of LDS), for twice the dots.
    """
    t = tl.program_id(0)
    g = tl.program_id(1) // head_blocks
    hb = tl.program_id(1) % head_blocks
    b = tl.program_id(2).to(tl.int64)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = offs_h < heads_per_group
    heads = g * heads_per_group + offs_h
    BLOCK_DS: tl.constexpr = BLOCK_DV // D_SPLIT
    offs_dv = tl.arange(0, BLOCK_DS)
    offs_t = tl.arange(0, BLOCK_TOPK)

    q_row = Q + b * stride_qb + t.to(tl.int64) * stride_qs + heads[:, None].to(tl.int64) * stride_qh
    q_main = tl.load(q_row + offs_dv[None, :], mask=head_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    if D_SPLIT == 2:
        q_high = tl.load(q_row + BLOCK_DS + offs_dv[None, :],
                         mask=head_ok[:, None] & (offs_dv[None, :] < D_V - BLOCK_DS), other=0.0)
    if D_TAIL > 0:
        offs_dt = tl.arange(0, BLOCK_DT)
        q_tail = tl.load(q_row + D_V + offs_dt[None, :], mask=head_ok[:, None] & (offs_dt[None, :] < D_TAIL),
                         other=0.0)

    n_slots = topk
    if HAS_TOPK_LEN:
        n_slots = tl.minimum(tl.load(TOPK_LEN + b * stride_lb + t.to(tl.int64) * stride_ls), topk)
    idx_row = IDX + b * stride_ib + t.to(tl.int64) * stride_is + g.to(tl.int64) * stride_ih
    kv_base = KV + b * stride_kvb + g.to(tl.int64) * stride_kvh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DS], tl.float32)
    if D_SPLIT == 2:
        acc_high = tl.zeros([BLOCK_H, BLOCK_DS], tl.float32)
    for start in range(0, n_slots, BLOCK_TOPK):
        slots = start + offs_t
        idx = tl.load(idx_row + slots, mask=slots < n_slots, other=-1)
        # Any index outside [0, s_kv) is invalid; it is never dereferenced (row 0 stands in, masked).
        valid = (idx >= 0) & (idx < s_kv)
        kv_row = kv_base + _row_offsets(idx, valid, stride_kvs, ROWS_I32)
        kv_main = _gather_rows(kv_row, offs_dv, valid, D_V, BLOCK_DS)
        scores = tl.dot(q_main, tl.trans(kv_main))
        if D_SPLIT == 2:
            kv_high = _gather_rows(kv_row + BLOCK_DS, offs_dv, valid, D_V - BLOCK_DS, BLOCK_DS)
            scores += tl.dot(q_high, tl.trans(kv_high))
        if D_TAIL > 0:
            kv_tail = _gather_rows(kv_row + D_V, offs_dt, valid, D_TAIL, BLOCK_DT)
            scores += tl.dot(q_tail, tl.trans(kv_tail))
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # Rows with no valid slot so far keep m = -inf: shift by 0 so exp2 gives 0 instead of NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv_main.dtype), kv_main)
        if D_SPLIT == 2:
            acc_high = acc_high * alpha[:, None] + tl.dot(p.to(kv_high.dtype), kv_high)
        m_i = m_new

    empty = l_i == 0.0
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    scale = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    if HAS_SINK:
        sink = tl.load(SINK + heads, mask=head_ok, other=0.0)
        # sigmoid(lse - sink); empty rows are already scaled to 0 whatever the sink.
        scale = scale * tl.where(empty, 0.0, 1.0 / (1.0 + tl.exp(sink - tl.where(empty, 0.0, lse))))
    out = acc * scale[:, None]
    o_ptr = OUT + b * stride_ob + t.to(tl.int64) * stride_os + heads[:, None].to(tl.int64) * stride_oh
    tl.store(o_ptr + offs_dv[None, :], out.to(OUT.dtype.element_ty),
             mask=head_ok[:, None] & (offs_dv[None, :] < D_V))
    if D_SPLIT == 2:
        tl.store(o_ptr + BLOCK_DS + offs_dv[None, :], (acc_high * scale[:, None]).to(OUT.dtype.element_ty),
                 mask=head_ok[:, None] & (offs_dv[None, :] < D_V - BLOCK_DS))
    m_off = b * stride_mb + t.to(tl.int64) * stride_ms + heads
    tl.store(MAX_LOGITS + m_off, m_i * LN2, mask=head_ok)
    tl.store(LSE + m_off, lse, mask=head_ok)


@triton.jit
def _sparse_mla_bwd_dq_kernel(
    Q, KV, IDX, SINK, TOPK_LEN, OUT, DOUT, LSE, DQ, DSINK, PDS,
    s_kv, topk, heads_per_group, head_blocks, sm_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs, stride_kvh,
    stride_ib, stride_is, stride_ih,
    stride_lb, stride_ls,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_mb, stride_ms,
    stride_dqb, stride_dqs, stride_dqh,
    stride_pb, stride_ps, stride_pg, stride_pt,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_TOPK: tl.constexpr, HAS_SINK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr,
    ROWS_I32: tl.constexpr,
):
    """Backward, first pass. One program: dQ of BLOCK_H heads of one kv group of one query.

    Recomputes P = exp(z - lse_tot) per top-k tile (lse_tot includes the sink), with
    Delta = rowsum(dO * O), dP = dO V^T, dS = P (dP - Delta); dQ = sum over tiles of dS K stays in
    registers. Writes dS^T and P^T (16-bit, as the dots consume them) to the workspace PDS
    [b, s_q, h_kv, topk, 2 * heads_per_group] for the dkv pass: columns h for dS, heads_per_group + h
    for P, one row per top-k slot it visits (slots past topk_length are not written). Adds
    d sink[h] = -exp(sink - lse_tot) * Delta atomically (once per head and query).
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
    o_off = b * stride_ob + t.to(tl.int64) * stride_os + heads[:, None].to(tl.int64) * stride_oh
    o = tl.load(OUT + o_off + offs_dv[None, :], mask=dv_mask, other=0.0).to(tl.float32)
    do_off = b * stride_dob + t.to(tl.int64) * stride_dos + heads[:, None].to(tl.int64) * stride_doh
    do = tl.load(DOUT + do_off + offs_dv[None, :], mask=dv_mask, other=0.0)
    delta = tl.sum(o * do.to(tl.float32), 1)

    m_off = b * stride_mb + t.to(tl.int64) * stride_ms + heads
    lse = tl.load(LSE + m_off, mask=head_ok, other=float("inf"))
    empty = lse == float("inf")
    lse_tot = tl.where(empty, 0.0, lse)
    if HAS_SINK:
        sink = tl.load(SINK + heads, mask=head_ok, other=0.0)
        hi = tl.maximum(lse_tot, sink)
        lse_tot = hi + tl.log(tl.exp(lse_tot - hi) + tl.exp(sink - hi))
        dsink = -tl.exp(sink - lse_tot) * delta
        tl.atomic_add(DSINK + heads, tl.where(empty, 0.0, dsink), mask=head_ok)
    # In log2 units, like the forward; empty rows get a +inf shift so every P of theirs is 0.
    shift = tl.where(empty, float("inf"), lse_tot * LOG2E)
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
    Q, IDX, TOPK_LEN, DOUT, PDS, DKV,
    s_kv, topk, heads_per_group, topk_tiles,
    stride_qb, stride_qs, stride_qh,
    stride_ib, stride_is, stride_ih,
    stride_lb, stride_ls,
    stride_dob, stride_dos, stride_doh,
    stride_pb, stride_ps, stride_pg, stride_pt,
    stride_dkb, stride_dks, stride_dkh,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_TOPK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, ROWS_I32: tl.constexpr,
):
    """Backward, second pass. One program: the dKV contribution of one top-k tile of one query.

    A GEMM over the group's heads, in chunks of BLOCK_H, from the first pass's dS^T and P^T: every row
    of the tile gets dS^T Q (key role, all d_qk dims) plus P^T dO (value role, first d_v dims). Q's
    value dims and dO are stacked into one [2 * BLOCK_H, d_v] tile against [dS^T | P^T], so one dot
    does both (two accumulating dots in a row would get two layouts for the accumulator from Triton,
    and a conversion between them every step). Then one fp32 atomic add per selected row and query,
    since different queries select the same rows (so do duplicate slots of one query). Nothing is
    gathered: no kv read at all.
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
            qd_ptr = tl.where(is_do[:, None], do_base + rows_h[:, None] * stride_doh,
                              q_base + rows_h[:, None] * stride_qh)
            qd = tl.load(qd_ptr + offs_dv[None, :], mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
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

        dkv_row = DKV + b * stride_dkb + g.to(tl.int64) * stride_dkh
        dkv_row += _row_offsets(idx, valid, stride_dks, ROWS_I32)
        tl.atomic_add(dkv_row[:, None] + offs_dv[None, :], dkv_main,
                      mask=valid[:, None] & (offs_dv[None, :] < D_V), sem="relaxed")
        if D_TAIL > 0:
            tl.atomic_add(dkv_row[:, None] + D_V + offs_dt[None, :], dkv_tail,
                          mask=valid[:, None] & (offs_dt[None, :] < D_TAIL), sem="relaxed")


# ----------------------------------------------------------------------------- launchers
def _batched(x: torch.Tensor | None, batched: bool) -> torch.Tensor | None:
    return x if x is None or batched else x.unsqueeze(0)


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """The first n strides of a tensor (zeros for an absent one)."""
    return tuple(t.stride()[:n]) if t is not None else (0,) * n


def _grid(s_q: int, h_q: int, h_kv: int, b: int, block_h: int) -> tuple[tuple[int, int, int], int]:
    heads_per_group = h_q // h_kv
    head_blocks = cdiv(heads_per_group, block_h)
    return (s_q, h_kv * head_blocks, b), head_blocks


def _rows_fit_int32(kv: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether every gathered row offset (index * row stride, plus the row) of kv and of same-shaped
    tensors fits in int32, so the kernels can skip 64-bit address arithmetic."""
    s_kv, d_qk = kv.shape[1], kv.shape[-1]
    return all((s_kv - 1) * t.stride(1) + d_qk < 2**31 for t in (kv, *others))


def forward_launch(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, block_h: int):
    """What every sparse_mla forward kernel takes (they share their leading parameters): the outputs
    (out, max_logits, lse), the grid, the positional arguments and the shared constexprs."""
    b, s_q, h_q, d_qk = q.shape
    s_kv, h_kv = kv.shape[1], kv.shape[2]
    out = torch.empty((b, s_q, h_q, d_v), device=q.device, dtype=q.dtype)
    max_logits = torch.empty((b, s_q, h_q), device=q.device, dtype=torch.float32)
    lse = torch.empty_like(max_logits)
    grid, head_blocks = _grid(s_q, h_q, h_kv, b, block_h)
    args = (q, kv, indices, attn_sink, topk_length, out, max_logits, lse,
            s_kv, indices.shape[-1], h_q // h_kv, head_blocks, sm_scale * LOG2E.value,
            *_strides(q, 3), *_strides(kv, 3), *_strides(indices, 3), *_strides(topk_length, 2),
            *_strides(out, 3), *_strides(lse, 2))
    constexprs = {"D_V": d_v, "D_TAIL": d_qk - d_v, "HAS_SINK": attn_sink is not None,
                  "HAS_TOPK_LEN": topk_length is not None}
    return (out, max_logits, lse), grid, args, constexprs


def _forward(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, config: LaunchConfig):
    """Run the forward kernel on batched-layout tensors; returns (out, max_logits, lse)."""
    blocks = config.blocks
    block_dv, block_dt = dim_blocks(q.shape[-1], d_v)
    outputs, grid, args, constexprs = forward_launch(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                                     blocks["BLOCK_H"])
    _sparse_mla_fwd_kernel[grid](
        *args, **constexprs, BLOCK_DV=block_dv, BLOCK_DT=block_dt, BLOCK_H=blocks["BLOCK_H"],
        BLOCK_TOPK=blocks["BLOCK_TOPK"], ROWS_I32=_rows_fit_int32(kv), D_SPLIT=blocks["D_SPLIT"],
        **config.knobs(),
    )
    return outputs


# The dq pass hands P and dS to the dkv pass through a workspace of topk * 2 * h_q 16-bit values per
# query; queries are processed in chunks so that it stays under this many bytes.
WORKSPACE_BYTES = 512 * 2**20


def _backward(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, lse, dout,
              dq_config: LaunchConfig, dkv_config: LaunchConfig):
    """Run the two backward passes (dq, then dkv) on batched-layout tensors, a chunk of queries at a
    time; returns (dq, dkv, dsink)."""
    b, s_q, h_q, d_qk = q.shape
    s_kv, h_kv, topk = kv.shape[1], kv.shape[2], indices.shape[-1]
    heads_per_group = h_q // h_kv
    block_dv, block_dt = dim_blocks(d_qk, d_v)
    # The dkv pass loads q and dout rows through one pointer tensor: same dtype, unit last stride.
    dout = dout.to(q.dtype)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, device=kv.device, dtype=torch.float32)  # fp32 atomics target
    dsink = torch.zeros(h_q, device=q.device, dtype=torch.float32) if attn_sink is not None else None
    dims = {"D_V": d_v, "D_TAIL": d_qk - d_v, "BLOCK_DV": block_dv, "BLOCK_DT": block_dt,
            "HAS_TOPK_LEN": topk_length is not None, "ROWS_I32": _rows_fit_int32(kv, dkv)}
    per_query = b * h_kv * topk * 2 * heads_per_group * q.element_size()
    chunk = max(1, min(s_q, WORKSPACE_BYTES // per_query))
    pds = torch.empty((b, chunk, h_kv, topk, 2 * heads_per_group), device=q.device, dtype=q.dtype)
    cap = group_head_cap(heads_per_group)
    dq_blocks = {**dq_config.blocks, "BLOCK_H": min(dq_config.blocks["BLOCK_H"], cap)}
    dkv_blocks = {**dkv_config.blocks, "BLOCK_H": min(dkv_config.blocks["BLOCK_H"], cap)}
    topk_tiles = cdiv(topk, dkv_blocks["BLOCK_TOPK"])
    for c0 in range(0, s_q, chunk):
        rows = slice(c0, min(s_q, c0 + chunk))
        q_c, dout_c, idx_c = q[:, rows], dout[:, rows], indices[:, rows]
        len_c = topk_length[:, rows] if topk_length is not None else None
        n = q_c.shape[1]
        grid, head_blocks = _grid(n, h_q, h_kv, b, dq_blocks["BLOCK_H"])
        _sparse_mla_bwd_dq_kernel[grid](
            q_c, kv, idx_c, attn_sink, len_c, out[:, rows], dout_c, lse[:, rows], dq[:, rows], dsink, pds,
            s_kv, topk, heads_per_group, head_blocks, sm_scale,
            *_strides(q_c, 3), *_strides(kv, 3), *_strides(idx_c, 3), *_strides(len_c, 2),
            *_strides(out, 3), *_strides(dout, 3), *_strides(lse, 2), *_strides(dq, 3), *_strides(pds, 4),
            **dims, **dq_blocks, HAS_SINK=attn_sink is not None, **dq_config.knobs(),
        )
        _sparse_mla_bwd_dkv_kernel[(n, h_kv * topk_tiles, b)](
            q_c, idx_c, len_c, dout_c, pds, dkv,
            s_kv, topk, heads_per_group, topk_tiles,
            *_strides(q_c, 3), *_strides(idx_c, 3), *_strides(len_c, 2), *_strides(dout, 3), *_strides(pds, 4),
            *_strides(dkv, 3),
            **dims, **dkv_blocks, **dkv_config.knobs(),
        )
    return dq, dkv.to(kv.dtype), dsink


class _SparseMLAFunction(torch.autograd.Function):
    """Autograd for sparse MLA. The backward accumulates dkv (one add per query and selected row) and
    d attn_sink with fp32 atomic adds, so its summation order, and the last bits of dkv, vary between
    runs."""

    @staticmethod
    def forward(ctx, run_forward, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, config: CallConfig):
        out, max_logits, lse = run_forward(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, config["fwd"])
        ctx.save_for_backward(q, kv, indices, attn_sink, topk_length, out, lse)
        ctx.sm_scale, ctx.d_v, ctx.config = sm_scale, d_v, config
        ctx.mark_non_differentiable(max_logits, lse)
        return out, max_logits, lse

    @staticmethod
    def backward(ctx, dout, _dmax, _dlse):
        q, kv, indices, attn_sink, topk_length, out, lse = ctx.saved_tensors
        dq, dkv, dsink = _backward(q, kv, indices, ctx.sm_scale, ctx.d_v, attn_sink, topk_length, out, lse,
                                   dout, ctx.config["bwd_dq"], ctx.config["bwd_dkv"])
        return None, dq, dkv, None, None, None, dsink, None, None


def sparse_mla_forward(args: dict, config: CallConfig, run_forward=_forward) -> SparseMLAOutput:
    """Launch sparse MLA on validated arguments (registry.ops.sparse_mla's dict) with the "fwd" role's
    config; a backward, when autograd asks for one, runs its dq and dkv passes with the "bwd_dq" and
    "bwd_dkv" roles' configs. `run_forward` is the forward launcher (batched-layout tensors in,
    (out, max_logits, lse) out): this module's head-block kernel, or another variant's kernel that
    shares this backward."""
    q, kv, indices = args["q"], args["kv"], args["indices"]
    batched = q.dim() == 4
    qb, kvb, ib = _batched(q, batched), _batched(kv, batched), _batched(indices, batched)
    lengths = _batched(args["topk_length"], batched)
    sink = args["attn_sink"]
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad
                                              or (sink is not None and sink.requires_grad))
    if wants_grad:
        out, max_logits, lse = _SparseMLAFunction.apply(run_forward, qb, kvb, ib, args["sm_scale"], args["d_v"],
                                                        sink, lengths, config)
    else:
        out, max_logits, lse = run_forward(qb, kvb, ib, args["sm_scale"], args["d_v"], sink, lengths, config["fwd"])
    if not batched:
        out, max_logits, lse = out[0], max_logits[0], lse[0]
    return SparseMLAOutput(out, max_logits, lse)


# ----------------------------------------------------------------------------- offline compiles
def _compile_signature(names: list[str], pointers: dict[str, str], floats: tuple[str, ...]) -> dict[str, str]:
    """Type strings for a kernel's non-constexpr arguments: the given pointers, fp32 scalars, i32 otherwise."""
    return {n: pointers.get(n, "fp32" if n in floats else "i32") for n in names}


_ROLE_KERNELS = {"fwd": (_sparse_mla_fwd_kernel, ("qk_scale",)),
                 "bwd_dq": (_sparse_mla_bwd_dq_kernel, ("sm_scale",)),
                 "bwd_dkv": (_sparse_mla_bwd_dkv_kernel, ("sm_scale",))}


def sparse_mla_compile_specs(key: dict, config: CallConfig, roles: tuple[str, ...], dtype: str = "bf16"
                             ) -> list[CompileSpec]:
    """The head-block kernels of `roles` as a call with this key and config launches them (with sink
    and topk_length, the heaviest variants, and int32 row offsets), for offline compile checks."""
    block_dv, block_dt = dim_blocks(key["d_qk"], key["d_v"])
    elem = f"*{key.get('dtype', dtype)}"
    pointers = {n: elem for n in ("Q", "KV", "OUT", "DOUT", "DQ", "PDS")}
    pointers.update({n: "*fp32" for n in ("SINK", "MAX_LOGITS", "LSE", "DKV", "DSINK")})
    pointers.update({n: "*i32" for n in ("IDX", "TOPK_LEN")})
    heads_per_group = key["h_q"] // key["h_kv"]
    specs = []
    for role in roles:
        fn, floats = _ROLE_KERNELS[role]
        blocks = config[role].blocks
        block_h = min(blocks["BLOCK_H"], group_head_cap(heads_per_group))
        constexprs = {"D_V": key["d_v"], "D_TAIL": key["d_qk"] - key["d_v"], "BLOCK_DV": block_dv,
                      "BLOCK_DT": block_dt, "BLOCK_H": block_h, "BLOCK_TOPK": blocks["BLOCK_TOPK"],
                      "HAS_SINK": True, "HAS_TOPK_LEN": True, "ROWS_I32": True, "D_SPLIT": blocks.get("D_SPLIT")}
        constexprs = {n: v for n, v in constexprs.items() if n in fn.arg_names}
        names = [n for n in fn.arg_names if n not in constexprs]
        signature = _compile_signature(names, {n: t for n, t in pointers.items() if n in names}, floats)
        sizes = {"topk": key["topk"], "heads_per_group": heads_per_group,
                 "head_blocks": cdiv(heads_per_group, block_h),
                 "topk_tiles": cdiv(key["topk"], blocks["BLOCK_TOPK"])}
        specs.append(CompileSpec(role, fn, signature, constexprs,
                                 values={n: v for n, v in sizes.items() if n in names}))
    return specs


# ----------------------------------------------------------------------------- the variants
def heads_fit_group(config: LaunchConfig, key: dict) -> bool:
    """Keep: a head block (dkv's head chunk too) no wider than the group's heads rounded up to a power
    of two; a wider one would only compute masked rows."""
    return config.blocks["BLOCK_H"] <= group_head_cap(key["h_q"] // key["h_kv"])


class SparseMLALaunch:
    """`launch` and `bind` of every sparse_mla variant: its forward launcher (`run_forward`, see
    sparse_mla_forward) and this module's backward."""

    run_forward = staticmethod(_forward)

    def launch(self, args: dict, config: CallConfig) -> SparseMLAOutput:
        return sparse_mla_forward(args, config, self.run_forward)

    def bind(self, config: CallConfig):
        run_forward = self.run_forward
        return lambda args: sparse_mla_forward(args, config, run_forward)

    def backward(self, args: dict, config: CallConfig, outputs: tuple, grad: torch.Tensor) -> dict:
        """The dq and dkv passes on the forward's saved out and lse (what `_SparseMLAFunction` runs)."""
        batched = args["q"].dim() == 4
        q, kv, indices, lengths, out, lse, dout = (
            _batched(t, batched)
            for t in (args["q"], args["kv"], args["indices"], args["topk_length"], outputs[0], outputs[2], grad))
        dq, dkv, dsink = _backward(q, kv, indices, args["sm_scale"], args["d_v"], args["attn_sink"], lengths, out,
                                   lse, dout, config["bwd_dq"], config["bwd_dkv"])
        if not batched:
            dq, dkv = dq[0], dkv[0]
        return {"q": dq, "kv": dkv, "attn_sink": dsink}


class SparseMLAHeadBlockBase(SparseMLALaunch):
    """The head-block variant's logic; each vendor file subclasses it with `Variant` and sets its data:

    spaces: a ConfigSpace per role: "fwd" (blocks BLOCK_H, BLOCK_TOPK and D_SPLIT, the value part of
        d_qk in 1 or 2 D tiles), "bwd_dq" (BLOCK_H, BLOCK_TOPK) and "bwd_dkv" (BLOCK_H, its head chunk,
        and BLOCK_TOPK); each keeps `heads_fit_group`;
    ACC_REGS_LIMIT: the fp32 accumulator registers per thread (out's BLOCK_H * BLOCK_DV, dq's the same,
        dkv's BLOCK_TOPK * BLOCK_DV, over the threads) above which a config cannot avoid spilling on
        that vendor (AMD's unified VGPR/AGPR file is larger), further capped at half of each thread's
        share of the register file;
    Q_IN_SHARED: whether Q stays in shared memory for the whole loop (Hopper's wgmma reads its A
        operand from there) or only passes through it once on its way to registers (AMD).
    """

    op = "sparse_mla"
    name = "sparse_mla_headblock"
    kernels = {"fwd": _sparse_mla_fwd_kernel, "bwd_dq": _sparse_mla_bwd_dq_kernel,
               "bwd_dkv": _sparse_mla_bwd_dkv_kernel}
    ACC_REGS_LIMIT = 128
    Q_IN_SHARED = True

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d_qk"] <= 1024

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        """The space's default with its head block capped by the group's heads."""
        config = super().role_default(role, key, device)
        cap = group_head_cap(key["h_q"] // key["h_kv"])
        if config.blocks["BLOCK_H"] <= cap:
            return config
        return config.model_copy(update={"blocks": {**config.blocks, "BLOCK_H": cap}})

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        """Static pruning of what cannot fit; loose on purpose (the compile check is authoritative)."""
        if device.key == "cpu":
            return None
        block_dv, _ = dim_blocks(key["d_qk"], key["d_v"])
        blocks = config.blocks
        threads = config.num_warps * device.warp_size
        # The accumulator may take at most half of a thread's share of the register file.
        limit = min(self.ACC_REGS_LIMIT, device.registers_per_sm // threads // 2)
        rows = blocks["BLOCK_TOPK"] if role == "bwd_dkv" else blocks["BLOCK_H"]
        acc_regs = rows * block_dv // threads
        if acc_regs > limit:
            return f"accumulator needs {acc_regs} registers per thread (> {limit})"
        if role != "fwd":
            return None
        tiles = blocks["D_SPLIT"]
        if block_dv // tiles < 16:
            return f"D tiles of {block_dv // tiles} columns (< 16, tl.dot's K)"
        # The value part dominates the tiles: the gathered kv tile stays resident for the pipeline's
        # stages in flight; Q stays resident on NVIDIA and passes through once on AMD, where the
        # operands go through LDS one dot (one D tile) at a time.
        kv_tile = blocks["BLOCK_TOPK"] * block_dv * 2
        q_tile = blocks["BLOCK_H"] * block_dv * 2
        resident = kv_tile * max(1, config.num_stages - 1)
        smem = resident + q_tile if self.Q_IN_SHARED else max(resident, q_tile) // tiles
        if smem > device.shared_mem_bytes:
            return f"needs ~{smem} B of shared memory/LDS (> {device.shared_mem_bytes})"
        return None

    def compile_specs(self, key: dict, config: CallConfig, dtype: str = "bf16") -> list[CompileSpec]:
        return sparse_mla_compile_specs(key, config, self.roles, dtype)


# The interpreter's block shapes, shared by both vendors (their defaults first).
INTERPRETER_FWD = ({"BLOCK_H": 16, "BLOCK_TOPK": 16, "D_SPLIT": 1}, {"BLOCK_H": 16, "BLOCK_TOPK": 32, "D_SPLIT": 2})
INTERPRETER_DQ = ({"BLOCK_H": 32, "BLOCK_TOPK": 64}, {"BLOCK_H": 16, "BLOCK_TOPK": 32})
INTERPRETER_DKV = ({"BLOCK_H": 16, "BLOCK_TOPK": 64}, {"BLOCK_H": 16, "BLOCK_TOPK": 32})
