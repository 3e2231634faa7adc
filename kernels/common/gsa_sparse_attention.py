"""GSA's sparse attention: every head of a query attends to the query's own top-k keys. The Triton kernel
bodies both vendors share, for two variants with one backward: the head block
(`gsa_sparse_attention_headblock`), which gathers each slot's rows, and the dense masked tiles
(`gsa_sparse_attention_dense`), for key sets that are a large fraction of the sequence.

Head block. The idea from sparse MLA's head-block kernel (kernels.common.sparse_mla), turned around for
GSA's shapes: there one gathered latent row serves all heads of a kv group; here every head has its own
K and V rows (h_kv = h_q = 16 in the default layer), but all heads of a query share one index list, and
a key's rows of all kv heads sit next to each other ([h_kv, d] contiguous). So one program owns BLOCK_H
heads of one query and gathers, per slot, the rows of all of them at once: a [BLOCK_TOPK, BLOCK_H, d]
tile read as contiguous runs of BLOCK_H * d elements (GQA heads of one group read the same row, from
L1). With one query row per head there is no matrix to feed tensor cores (a head's scores are a
matrix-vector product), so scores and the value sum are fp32 FMAs and reductions in registers; the
kernel is bound by the gathered bytes, which neighbouring queries mostly find in L2.

Forward: online softmax over the query's slots in tiles of BLOCK_TOPK, log2 units; writes out and the
lse (log2 units, +inf for a row with no valid slot, whose out is 0) that the backward reuses.

Dense masked tiles. Gathering reads 4 * t * k * h * d bytes (68.7 GB at GSA's t 4096, k 2048, 16
heads of 128: most of a query's keys are read once per query that selects them); attending over every
key tile of a query block with tensor cores costs about 2 * t^2 * h * d FLOPs instead, whichever keys
the rows select. Three forward kernels:
- `build` (one program per query): marks the query's valid keys in a bitmap [b, t, cdiv(t, 32)] with
  atomic ORs; a slot whose bit was already set is an extra occurrence of its key, listed in `extras`
  [b, t, topk] (its count in `dups`); also the query's smallest and largest valid key.
- `fwd_extras`: the head-block forward over the extras, topk_length = dups (a query without repeats
  loops zero times), its out in fp32: the online-softmax state of the repeats.
- `fwd` (BLOCK_M queries of one head per program): starts from that state, then a FlashAttention
  forward over the key tiles between the block's smallest and largest key, scores masked to the bits
  each row has set, so every selected key counts once there and its repeats once each from the extras.
  It writes out and the lse in the head-block forward's format, and the same backward follows.

Backward, two passes, no atomics (so gradients are bitwise reproducible):
- dq (`bwd_dq`, the forward's program layout): recomputes P per tile, dP = dO . V, dS = P (dP - Delta)
  with Delta = rowsum(dO * O), accumulates dQ = sum dS K; writes Delta for the second pass.
- dkv (`bwd_dkv`): key-major. The launcher sorts every valid (query, slot) by its key (a stable
  torch.sort, no host sync) into per-key lists of queries; one program owns BLOCK_H heads of one key
  and walks its list BLOCK_Q queries at a time, gathering their Q and dO rows, recomputing P and dS,
  and summing dK = sum dS Q and dV = sum P dO in registers; one store per key and head (fp32, the GQA
  group's heads summed after). Duplicate slots appear twice in a list, so they count twice.

Reads top-down: kernels, launchers, the autograd Function, compile specs, the variant's logic.
Semantics: `ops.gsa_sparse_attention.reference` (docs/op-contracts.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import triton
import triton.language as tl

from kreg.core.nvtx import nvtx_range
from kreg.core.records import CallConfig, LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.tiles import cdiv, dot_block, rows_fit_int32
from kreg.ops.variant import CallPlan


# ----------------------------------------------------------------------------- Triton kernels
@triton.jit
def _gather_columns(h0, h_q, group, stride_ah, stride_bh, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr, ROWS_I32: tl.constexpr):
    """Column offsets of one gathered row of heads h0... in two tensors (strides stride_ah, stride_bh
    between heads) and their mask, flattened head-major to [BLOCK_H * BLOCK_D]: column c is dim
    c % BLOCK_D of query head h0 + c // BLOCK_D, which reads its kv head (h // group). int32 when the
    launcher proved every row offset fits (ROWS_I32), like the row offsets they are added to.

    Gathered tiles are loaded as [slots, BLOCK_H * BLOCK_D] (runs of BLOCK_D contiguous elements, so
    the threads spread over heads and dims and each keeps its slots in registers: the sums over slots
    stay in a thread) and viewed as [slots, BLOCK_H, BLOCK_D]."""
    cols = tl.arange(0, BLOCK_H * BLOCK_D)
    head = h0 + cols // BLOCK_D
    dim = cols % BLOCK_D
    kv_head = head // group
    if not ROWS_I32:
        kv_head = kv_head.to(tl.int64)
    return kv_head * stride_ah + dim, kv_head * stride_bh + dim, (head < h_q) & (dim < HEAD_DIM)


@triton.jit
def _gsa_sparse_attn_fwd_kernel(
    Q, K, V, IDX, TOPK_LEN, OUT, LSE,
    t, h_q, topk, group, qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ib, stride_it,
    stride_lb, stride_lt,
    stride_ob, stride_ot, stride_oh,
    stride_sb, stride_st,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, ROWS_I32: tl.constexpr,
):
    """One program: heads program_id(1) * BLOCK_H... of query program_id(0) of batch row program_id(2).

    Online softmax over the query's valid slots (index in [0, t), slot below topk_length) in tiles of
    BLOCK_TOPK, in log2 units (`qk_scale` = sm_scale * log2(e)); each tile gathers the K rows of every
    head at once and then their V rows. Writes out [BLOCK_H, d] (0 for a row with no valid slot) and
    lse in log2 units (+inf for such a row)."""
    i = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    heads = h0 + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    hd_ok = (heads < h_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    offs_t = tl.arange(0, BLOCK_TOPK)
    k_cols, v_cols, col_ok = _gather_columns(h0, h_q, group, stride_kh, stride_vh, HEAD_DIM, BLOCK_H, BLOCK_D, ROWS_I32)

    q_ptr = Q + b * stride_qb + i.to(tl.int64) * stride_qt + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=hd_ok, other=0.0).to(tl.float32) * qk_scale
    n_slots = topk
    if HAS_TOPK_LEN:
        n_slots = tl.minimum(tl.load(TOPK_LEN + b * stride_lb + i.to(tl.int64) * stride_lt), topk)
    idx_row = IDX + b * stride_ib + i.to(tl.int64) * stride_it
    k_base = K + b * stride_kb
    v_base = V + b * stride_vb

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(0, n_slots, BLOCK_TOPK):
        slots = start + offs_t
        idx = tl.load(idx_row + slots, mask=slots < n_slots, other=-1)
        # Any index outside [0, t) is invalid; it is never dereferenced (row 0 stands in, masked).
        valid = (idx >= 0) & (idx < t)
        rows = tl.where(valid, idx, 0)
        if not ROWS_I32:
            rows = rows.to(tl.int64)
        mask = valid[:, None] & col_ok[None, :]
        k = tl.load(k_base + (rows * stride_kt)[:, None] + k_cols[None, :], mask=mask, other=0.0)
        k = tl.reshape(k.to(tl.float32), [BLOCK_TOPK, BLOCK_H, BLOCK_D])
        scores = tl.where(valid[:, None], tl.sum(k * q[None, :, :], 2), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        # Heads with no valid slot so far keep m = -inf: shift by 0 so exp2 gives 0 instead of NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_shift[None, :])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(v_base + (rows * stride_vt)[:, None] + v_cols[None, :], mask=mask, other=0.0)
        v = tl.reshape(v.to(tl.float32), [BLOCK_TOPK, BLOCK_H, BLOCK_D])
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, 0)
        m_i = m_new

    empty = l_i == 0.0
    out = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    o_ptr = OUT + b * stride_ob + i.to(tl.int64) * stride_ot + heads[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=hd_ok)
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + b * stride_sb + i.to(tl.int64) * stride_st + heads, lse, mask=heads < h_q)


@triton.jit
def _gsa_sparse_attn_bwd_dq_kernel(
    Q, K, V, IDX, TOPK_LEN, OUT, DOUT, LSE, DQ, DELTA,
    t, h_q, topk, group, sm_scale,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ib, stride_it,
    stride_lb, stride_lt,
    stride_ob, stride_ot, stride_oh,
    stride_dob, stride_dot, stride_doh,
    stride_sb, stride_st,
    stride_dqb, stride_dqt, stride_dqh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    HAS_TOPK_LEN: tl.constexpr, ROWS_I32: tl.constexpr,
):
    """Backward, first pass. One program: dQ of heads program_id(1) * BLOCK_H... of query program_id(0)
    of batch row program_id(2), the forward's layout.

    Delta = rowsum(dO * O) (stored to DELTA [b, t, h_q] for the dkv pass); per tile P = 2^(z - lse) in
    log2 units (0 for a row with no valid slot, whose lse is +inf), dP = dO . V, dS = P (dP - Delta),
    dQ += dS K; dQ is scaled by sm_scale once at the end."""
    i = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    heads = h0 + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    hd_ok = (heads < h_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    offs_t = tl.arange(0, BLOCK_TOPK)
    k_cols, v_cols, col_ok = _gather_columns(h0, h_q, group, stride_kh, stride_vh, HEAD_DIM, BLOCK_H, BLOCK_D, ROWS_I32)
    row = i.to(tl.int64)
    head_rows = heads[:, None].to(tl.int64)

    q_ptr = Q + b * stride_qb + row * stride_qt + head_rows * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=hd_ok, other=0.0).to(tl.float32) * (sm_scale * LOG2E)
    o = tl.load(OUT + b * stride_ob + row * stride_ot + head_rows * stride_oh + offs_d[None, :], mask=hd_ok,
                other=0.0).to(tl.float32)
    do = tl.load(DOUT + b * stride_dob + row * stride_dot + head_rows * stride_doh + offs_d[None, :], mask=hd_ok,
                 other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    s_off = b * stride_sb + row * stride_st + heads
    tl.store(DELTA + s_off, delta, mask=heads < h_q)
    lse = tl.load(LSE + s_off, mask=heads < h_q, other=float("inf"))

    n_slots = topk
    if HAS_TOPK_LEN:
        n_slots = tl.minimum(tl.load(TOPK_LEN + b * stride_lb + row * stride_lt), topk)
    idx_row = IDX + b * stride_ib + row * stride_it
    k_base = K + b * stride_kb
    v_base = V + b * stride_vb
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(0, n_slots, BLOCK_TOPK):
        slots = start + offs_t
        idx = tl.load(idx_row + slots, mask=slots < n_slots, other=-1)
        valid = (idx >= 0) & (idx < t)
        rows = tl.where(valid, idx, 0)
        if not ROWS_I32:
            rows = rows.to(tl.int64)
        mask = valid[:, None] & col_ok[None, :]
        k = tl.load(k_base + (rows * stride_kt)[:, None] + k_cols[None, :], mask=mask, other=0.0)
        k = tl.reshape(k.to(tl.float32), [BLOCK_TOPK, BLOCK_H, BLOCK_D])
        p = tl.math.exp2(tl.sum(k * q[None, :, :], 2) - lse[None, :])
        p = tl.where(valid[:, None], p, 0.0)
        v = tl.load(v_base + (rows * stride_vt)[:, None] + v_cols[None, :], mask=mask, other=0.0)
        v = tl.reshape(v.to(tl.float32), [BLOCK_TOPK, BLOCK_H, BLOCK_D])
        ds = p * (tl.sum(v * do[None, :, :], 2) - delta[None, :])
        dq += tl.sum(ds[:, :, None] * k, 0)

    dq_ptr = DQ + b * stride_dqb + row * stride_dqt + head_rows * stride_dqh + offs_d[None, :]
    tl.store(dq_ptr, (dq * sm_scale).to(DQ.dtype.element_ty), mask=hd_ok)


@triton.jit
def _gsa_sparse_attn_bwd_dkv_kernel(
    Q, K, V, DOUT, LSE, DELTA, OFFSETS, QUERIES, DK, DV,
    t, h_q, group, sm_scale,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_sb, stride_st,
    stride_gb, stride_gt, stride_gh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
    ROWS_I32: tl.constexpr,
):
    """Backward, second pass. One program: the dK and dV of key program_id(0) of batch row
    program_id(2) for query heads program_id(1) * BLOCK_H... (each head against its kv head's rows).

    Walks the key's list (QUERIES[OFFSETS[r]:OFFSETS[r + 1]], r = b * t + key: the queries whose valid
    slots hold the key, once per slot) BLOCK_Q at a time: gathers their Q and dO rows, lse and Delta,
    recomputes P and dS = P (dP - Delta), and sums dK = sm_scale * sum dS Q and dV = sum P dO; stores
    both once, fp32, per query head into DK and DV [b, t, h_q, d] (a GQA group's heads are summed by
    the launcher)."""
    j = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    heads = h0 + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    head_ok = heads < h_q
    kv_heads = heads // group
    offs_d = tl.arange(0, BLOCK_D)
    hd_ok = head_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    offs_q = tl.arange(0, BLOCK_Q)
    # Query rows are gathered for the query heads themselves (group 1 in the column helper).
    q_cols, do_cols, col_ok = _gather_columns(h0, h_q, 1, stride_qh, stride_doh, HEAD_DIM, BLOCK_H, BLOCK_D, ROWS_I32)

    k_ptr = K + b * stride_kb + j.to(tl.int64) * stride_kt + kv_heads[:, None].to(tl.int64) * stride_kh
    k = tl.load(k_ptr + offs_d[None, :], mask=hd_ok, other=0.0).to(tl.float32) * (sm_scale * LOG2E)
    v_ptr = V + b * stride_vb + j.to(tl.int64) * stride_vt + kv_heads[:, None].to(tl.int64) * stride_vh
    v = tl.load(v_ptr + offs_d[None, :], mask=hd_ok, other=0.0).to(tl.float32)

    r = b * t + j
    first = tl.load(OFFSETS + r)
    last = tl.load(OFFSETS + r + 1)
    dk = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for e0 in range(first, last, BLOCK_Q):
        entries = e0 + offs_q
        listed = entries < last
        # Lists hold batch-local query positions, in [0, t) by construction.
        i = tl.load(QUERIES + entries, mask=listed, other=0)
        if not ROWS_I32:
            i = i.to(tl.int64)
        mask = listed[:, None] & col_ok[None, :]
        q = tl.load(Q + b * stride_qb + (i * stride_qt)[:, None] + q_cols[None, :], mask=mask, other=0.0)
        q = tl.reshape(q.to(tl.float32), [BLOCK_Q, BLOCK_H, BLOCK_D])
        do = tl.load(DOUT + b * stride_dob + (i * stride_dot)[:, None] + do_cols[None, :], mask=mask, other=0.0)
        do = tl.reshape(do.to(tl.float32), [BLOCK_Q, BLOCK_H, BLOCK_D])
        s_off = b * stride_sb + i.to(tl.int64)[:, None] * stride_st + heads[None, :]
        s_mask = listed[:, None] & head_ok[None, :]
        lse = tl.load(LSE + s_off, mask=s_mask, other=float("inf"))
        delta = tl.load(DELTA + s_off, mask=s_mask, other=0.0)
        p = tl.math.exp2(tl.sum(q * k[None, :, :], 2) - lse)
        p = tl.where(s_mask, p, 0.0)
        ds = p * (tl.sum(do * v[None, :, :], 2) - delta)
        dk += tl.sum(ds[:, :, None] * q, 0)
        dv += tl.sum(p[:, :, None] * do, 0)

    g_off = b * stride_gb + j.to(tl.int64) * stride_gt + heads[:, None].to(tl.int64) * stride_gh + offs_d[None, :]
    tl.store(DK + g_off, dk * sm_scale, mask=hd_ok)
    tl.store(DV + g_off, dv, mask=hd_ok)


# The dense variant's kernels (the `_backward` passes above serve both variants).
@triton.jit
def _gsa_dense_build_kernel(
    IDX, TOPK_LEN, BITS, EXTRAS, DUPS, KEY_LO, KEY_HI,
    t, topk,
    stride_ib, stride_it,
    stride_lb, stride_lt,
    stride_bb, stride_bt,
    stride_eb, stride_et,
    stride_rb, stride_rt,
    BLOCK_SLOTS: tl.constexpr, HAS_TOPK_LEN: tl.constexpr,
):
    """One program: the key set of query program_id(0) of batch row program_id(1).

    For every valid slot (index in [0, t), slot below topk_length), BLOCK_SLOTS slots at a time, sets bit
    key % 32 of word key // 32 of the query's row of BITS (zeroed by the launcher) with an atomic OR. A
    slot whose bit was already set, by an earlier slot or another lane of the same tile, is an extra
    occurrence of its key: those keys are compacted to the front of the query's row of EXTRAS and
    counted into DUPS. Also writes the smallest valid key (t when there is none) to KEY_LO and the
    largest plus one (0 when there is none) to KEY_HI. Which of two equal slots counts as the extra one
    may change from run to run; the sets written do not."""
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    n_slots = topk
    if HAS_TOPK_LEN:
        n_slots = tl.minimum(tl.load(TOPK_LEN + b * stride_lb + i * stride_lt), topk)
    idx_row = IDX + b * stride_ib + i * stride_it
    bits_row = BITS + b * stride_bb + i * stride_bt
    extras_row = EXTRAS + b * stride_eb + i * stride_et
    offs = tl.arange(0, BLOCK_SLOTS)
    count = tl.zeros([], tl.int32)
    lo = tl.zeros([], tl.int32) + t
    hi = tl.zeros([], tl.int32)
    for start in range(0, n_slots, BLOCK_SLOTS):
        slots = start + offs
        idx = tl.load(idx_row + slots, mask=slots < n_slots, other=-1)
        valid = (idx >= 0) & (idx < t)
        key = tl.where(valid, idx, 0)
        bit = tl.full([BLOCK_SLOTS], 1, tl.int32) << (key & 31)
        # Only this program writes its row, so relaxed atomics suffice: each lane gets the word as the
        # lanes before it left it, and a tile's atomics have returned before the next tile's start (the
        # count below waits for all of them).
        old = tl.atomic_or(bits_row + (key >> 5), bit, mask=valid, sem="relaxed")
        extra = valid & ((old & bit) != 0)
        extra_i32 = extra.to(tl.int32)
        tl.store(extras_row + count + tl.cumsum(extra_i32, 0) - 1, key, mask=extra)
        count += tl.sum(extra_i32, 0)
        lo = tl.minimum(lo, tl.min(tl.where(valid, key, t), 0))
        hi = tl.maximum(hi, tl.max(tl.where(valid, key + 1, 0), 0))
    row = b * stride_rb + i * stride_rt
    tl.store(DUPS + row, count)
    tl.store(KEY_LO + row, lo)
    tl.store(KEY_HI + row, hi)


@triton.jit
def _gsa_dense_fwd_kernel(
    Q, K, V, BITS, KEY_LO, KEY_HI, OUT2, LSE2, OUT, LSE,
    t, group, qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bb, stride_bt,
    stride_rb, stride_rt,
    stride_xb, stride_xt, stride_xh,
    stride_ob, stride_ot, stride_oh,
    stride_sb, stride_st,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M queries of query head program_id(1) of batch row program_id(2), against every
    key their rows of BITS hold once (grid: query blocks, h_q, batch; the last block first).

    The online softmax (log2 units, `qk_scale` = sm_scale * log2(e)) starts from the extra occurrences'
    state: a row whose extras pass found keys (finite LSE2) starts at m = LSE2, l = 1, acc = OUT2 (fp32),
    the exact state of those slots; the others start empty. Then, over the key tiles of BLOCK_N from the
    block's smallest KEY_LO to its largest KEY_HI: S = Q K^T on tensor cores, masked to the keys each
    row selects, and acc += P V. No tile is skipped: a conditional in the loop stops Triton 3.6 from
    pipelining the tile loads (benchmarks/NOTES.md). Writes out (0 for a row with no valid slot) and lse
    in log2 units (+inf for such a row), as the head-block forward does, so that its backward passes
    take them. Head h reads kv head h // group."""
    # Causal top-k indices give the last query blocks the most key tiles: they start first.
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    kv_h = h // group
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < t
    d_ok = offs_d < HEAD_DIM
    rows = offs_m.to(tl.int64)
    tile_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=tile_ok,
                other=0.0)

    s_off = b * stride_sb + rows * stride_st + h
    lse2 = tl.load(LSE2 + s_off, mask=row_ok, other=float("inf"))
    # != +inf, not < +inf: a NaN lse2 (a NaN query) must reach out.
    extra = lse2 != float("inf")
    m_i = tl.where(extra, lse2, float("-inf"))
    l_i = tl.where(extra, 1.0, 0.0)
    acc = tl.load(OUT2 + b * stride_xb + rows[:, None] * stride_xt + h * stride_xh + offs_d[None, :],
                  mask=tile_ok & extra[:, None], other=0.0)

    r_off = b * stride_rb + rows * stride_rt
    lo = tl.min(tl.load(KEY_LO + r_off, mask=row_ok, other=t), 0) // BLOCK_N * BLOCK_N
    hi = tl.max(tl.load(KEY_HI + r_off, mask=row_ok, other=0), 0)
    bits_rows = BITS + b * stride_bb + rows * stride_bt
    k_offs = offs_n[:, None] * stride_kt + offs_d[None, :]
    v_offs = offs_n[:, None] * stride_vt + offs_d[None, :]
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < t
        # The rows' bitmap words of this tile, one [BLOCK_M] load per 32 keys (lo is a multiple of
        # BLOCK_N, so a tile of up to 32 keys lies in one word), spread over the tile's columns.
        words = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        for g in tl.static_range(max(BLOCK_N // 32, 1)):
            word = tl.load(bits_rows + (n0 >> 5) + g, mask=row_ok & (n0 + 32 * g < t), other=0)
            words = tl.where((offs_n // 32 == g)[None, :], word[:, None], words)
        chosen = ((words >> (cols & 31)[None, :]) & 1) != 0
        kv_mask = col_ok[:, None] & d_ok[None, :]
        # Scalar offsets of the tile in 64-bit: n0 * stride passes 2**31 on long sequences.
        k = tl.load(k_base + tl.cast(n0, tl.int64) * stride_kt + k_offs, mask=kv_mask, other=0.0)
        s = tl.where(chosen, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no selected key so far keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + tl.cast(n0, tl.int64) * stride_vt + v_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    empty = l_i == 0.0
    out = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    tl.store(OUT + b * stride_ob + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=tile_ok)
    tl.store(LSE + s_off, tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i))), mask=row_ok)


# ----------------------------------------------------------------------------- launchers


def _lengths_strides(topk_length: torch.Tensor | None) -> tuple[int, int]:
    return tuple(topk_length.stride()) if topk_length is not None else (0, 0)


def _forward(q, k, v, indices, sm_scale, topk_length, config: LaunchConfig, out_dtype: torch.dtype | None = None):
    """Run the forward kernel: (out in `out_dtype`, q's by default; lse in log2 units [b, t, h_q] fp32)."""
    b, t, h_q, d = q.shape
    out = torch.empty_like(q, dtype=out_dtype)
    lse = torch.empty((b, t, h_q), device=q.device, dtype=torch.float32)
    block_h = config.blocks["BLOCK_H"]
    with nvtx_range("gsa/sparse_attn_fwd_kernel"):
        _gsa_sparse_attn_fwd_kernel[(t, triton.cdiv(h_q, block_h), b)](
            q, k, v, indices, topk_length, out, lse,
            t, h_q, indices.shape[2], h_q // k.shape[2], float(sm_scale) * LOG2E.value,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *indices.stride()[:2], *_lengths_strides(topk_length),
            *out.stride()[:3], *lse.stride()[:2],
            HEAD_DIM=d, BLOCK_D=dot_block(d), BLOCK_H=block_h, BLOCK_TOPK=config.blocks["BLOCK_TOPK"],
            HAS_TOPK_LEN=topk_length is not None, ROWS_I32=rows_fit_int32(k, v), **config.knobs(),
        )
    return out, lse


def key_lists(indices: torch.Tensor, topk_length: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key, the queries whose valid slots hold it, for the dkv pass: (offsets [b * t + 1] int64,
    queries int32) with key r = b * t + j listed in queries[offsets[r]:offsets[r + 1]] (batch-local
    query positions, once per slot, in query order). Sorting and searching on the device: no host
    sync."""
    b, t, topk = indices.shape
    valid = (indices >= 0) & (indices < t)
    if topk_length is not None:
        valid &= torch.arange(topk, device=indices.device) < topk_length[..., None]
    rows = torch.arange(b, device=indices.device, dtype=torch.int32)[:, None, None] * t
    # Invalid slots sort after every key (key b * t) and fall outside every list.
    keys = torch.where(valid, indices + rows, b * t).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)
    queries = (order // topk % t).to(torch.int32)
    offsets = torch.searchsorted(sorted_keys, torch.arange(b * t + 1, device=indices.device, dtype=torch.int32))
    return offsets, queries


def _backward(q, k, v, indices, sm_scale, topk_length, out, lse, dout, dq_config: LaunchConfig,
              dkv_config: LaunchConfig):
    """Run the dq pass, then the dkv pass over the key lists: (dq, dk, dv)."""
    b, t, h_q, d = q.shape
    h_kv = k.shape[2]
    group = h_q // h_kv
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dq = torch.empty_like(q)
    delta = torch.empty_like(lse)
    rows_i32 = rows_fit_int32(q, k, v, dout)
    dims = {"HEAD_DIM": d, "BLOCK_D": dot_block(d), "ROWS_I32": rows_i32}
    block_h = dq_config.blocks["BLOCK_H"]
    with nvtx_range("gsa/sparse_attn_bwd_dq_kernel"):
        _gsa_sparse_attn_bwd_dq_kernel[(t, triton.cdiv(h_q, block_h), b)](
            q, k, v, indices, topk_length, out, dout, lse, dq, delta,
            t, h_q, indices.shape[2], group, float(sm_scale),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *indices.stride()[:2], *_lengths_strides(topk_length),
            *out.stride()[:3], *dout.stride()[:3], *lse.stride()[:2], *dq.stride()[:3],
            **dims, BLOCK_H=block_h, BLOCK_TOPK=dq_config.blocks["BLOCK_TOPK"],
            HAS_TOPK_LEN=topk_length is not None, **dq_config.knobs(),
        )
    with nvtx_range("gsa/sparse_attn_bwd_dkv_kernel"):
        offsets, queries = key_lists(indices, topk_length)
        dk_heads = torch.empty((b, t, h_q, d), device=q.device, dtype=torch.float32)
        dv_heads = torch.empty_like(dk_heads)
        block_h = dkv_config.blocks["BLOCK_H"]
        _gsa_sparse_attn_bwd_dkv_kernel[(t, triton.cdiv(h_q, block_h), b)](
            q, k, v, dout, lse, delta, offsets, queries, dk_heads, dv_heads,
            t, h_q, group, float(sm_scale),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *lse.stride()[:2],
            *dk_heads.stride()[:3],
            **dims, BLOCK_H=block_h, BLOCK_Q=dkv_config.blocks["BLOCK_Q"], **dkv_config.knobs(),
        )
    # Each kv head's gradient is the sum over its group's query heads.
    dk = dk_heads.view(b, t, h_kv, group, d).sum(3).to(k.dtype)
    dv = dv_heads.view(b, t, h_kv, group, d).sum(3).to(v.dtype)
    return dq, dk, dv


def headblock_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                     topk_length: torch.Tensor | None, config: CallConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The head-block variant's forward: its "fwd" kernel, (out, lse in log2 units)."""
    return _forward(q, k, v, indices, sm_scale, topk_length, config["fwd"])


def dense_key_sets(indices: torch.Tensor, topk_length: torch.Tensor | None, config: LaunchConfig
                   ) -> tuple[torch.Tensor, ...]:
    """Run the build kernel: (bits [b, t, cdiv(t, 32)], extras [b, t, topk], dups, key_lo, key_hi [b, t]),
    all int32: bit j % 32 of word j // 32 of a query's row of bits says it selects key j; its first
    dups extras are the keys it selects again (once per extra occurrence); key_lo and key_hi bound its
    valid keys (t and 0 when it has none)."""
    b, t, topk = indices.shape
    bits = torch.zeros((b, t, cdiv(t, 32)), device=indices.device, dtype=torch.int32)
    extras = torch.empty((b, t, topk), device=indices.device, dtype=torch.int32)
    dups, key_lo, key_hi = torch.empty((3, b, t), device=indices.device, dtype=torch.int32).unbind(0)
    with nvtx_range("gsa/sparse_attn_dense_build_kernel"):
        _gsa_dense_build_kernel[(t, b)](
            indices, topk_length, bits, extras, dups, key_lo, key_hi,
            t, topk, *indices.stride()[:2], *_lengths_strides(topk_length), *bits.stride()[:2],
            *extras.stride()[:2], *dups.stride(),
            BLOCK_SLOTS=config.blocks["BLOCK_SLOTS"], HAS_TOPK_LEN=topk_length is not None, **config.knobs(),
        )
    return bits, extras, dups, key_lo, key_hi


def dense_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                 topk_length: torch.Tensor | None, config: CallConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense variant's forward, (out, lse in log2 units) as the head-block forward gives them: the
    "build" kernel (`dense_key_sets`), the head-block forward over the extra occurrences ("fwd_extras",
    its out kept in fp32: duplicates may carry most of a row's weight), the dense pass ("fwd").

    Workspace: the bitmap (t / 8 bytes per query: with t <= 64 k, at most twice the indices), the
    extras (the size of the indices), the extras' fp32 out and lse, three int32 per query."""
    b, t, h_q, d = q.shape
    bits, extras, dups, key_lo, key_hi = dense_key_sets(indices, topk_length, config["build"])
    # Rows without extras loop zero times (topk_length = their count): out2 0, lse2 +inf.
    out2, lse2 = _forward(q, k, v, extras, sm_scale, dups, config["fwd_extras"], out_dtype=torch.float32)
    out = torch.empty_like(q)
    lse = torch.empty_like(lse2)  # lse and lse2 share their strides in the kernel
    dense = config["fwd"]
    block_m = dense.blocks["BLOCK_M"]
    with nvtx_range("gsa/sparse_attn_dense_fwd_kernel"):
        _gsa_dense_fwd_kernel[(cdiv(t, block_m), h_q, b)](
            q, k, v, bits, key_lo, key_hi, out2, lse2, out, lse,
            t, h_q // k.shape[2], float(sm_scale) * LOG2E.value,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *bits.stride()[:2], *key_lo.stride(),
            *out2.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
            HEAD_DIM=d, BLOCK_D=dot_block(d), BLOCK_M=block_m, BLOCK_N=dense.blocks["BLOCK_N"], **dense.knobs(),
        )
    return out, lse


class _GSASparseAttentionFunction(torch.autograd.Function):
    """Autograd for GSA's sparse attention, either variant's forward (`passes`: `headblock_passes` or
    `dense_passes`) and the shared backward. The backward uses no atomics: its gradients are the same
    bits from run to run."""

    @staticmethod
    def forward(ctx, q, k, v, indices, sm_scale, topk_length, config: CallConfig, passes):
        out, lse = passes(q, k, v, indices, sm_scale, topk_length, config)
        ctx.save_for_backward(q, k, v, indices, topk_length, out, lse)
        ctx.sm_scale, ctx.config = sm_scale, config
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, indices, topk_length, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, indices, ctx.sm_scale, topk_length, out, lse, dout.to(q.dtype),
                               ctx.config["bwd_dq"], ctx.config["bwd_dkv"])
        return dq, dk, dv, None, None, None, None, None


# A variant's forward: (q, k, v, indices, sm_scale, topk_length, call config) -> (out, lse in log2 units).
Passes = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def gsa_sparse_attention_forward(args: dict, config: CallConfig, passes: Passes = headblock_passes) -> torch.Tensor:
    """Launch GSA's sparse attention on validated arguments (ops.gsa_sparse_attention's dict)
    with a variant's forward `passes` and its forward roles' configs; a backward, when autograd asks for
    one, runs the dq and dkv passes with the "bwd_dq" and "bwd_dkv" roles' configs."""
    q, k, v, indices, sm_scale, lengths = (args[n] for n in ("q", "k", "v", "indices", "sm_scale", "topk_length"))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _GSASparseAttentionFunction.apply(q, k, v, indices, sm_scale, lengths, config, passes)
    return passes(q, k, v, indices, sm_scale, lengths, config)[0]


def gsa_sparse_attention_backward(args: dict, config: CallConfig, grad: torch.Tensor,
                                  passes: Passes = headblock_passes) -> dict:
    """The gradients of q, k and v for the custom op's backward (registry/library.py): the op returns no
    lse, so the forward `passes` run again to get it, then the dq and dkv passes."""
    q, k, v, indices, sm_scale, lengths = (args[n] for n in ("q", "k", "v", "indices", "sm_scale", "topk_length"))
    out, lse = passes(q, k, v, indices, sm_scale, lengths, config)
    dq, dk, dv = _backward(q, k, v, indices, sm_scale, lengths, out, lse, grad.to(q.dtype), config["bwd_dq"],
                           config["bwd_dkv"])
    return {"q": dq, "k": dk, "v": dv}


# ----------------------------------------------------------------------------- the variant
def heads_fit(config: LaunchConfig, key: dict) -> bool:
    """Keep: a head block no wider than the query heads rounded up to a power of two (a wider one only
    gathers masked rows)."""
    return config.blocks["BLOCK_H"] <= triton.next_power_of_2(key["h_q"])


class GSASparseAttentionHeadBlockBase:
    """The head-block variant's logic; each vendor file subclasses it with `Variant` and sets `spaces`
    ("fwd" and "bwd_dq": BLOCK_H heads by BLOCK_TOPK slots per gathered tile; "bwd_dkv": BLOCK_H heads
    by BLOCK_Q listed queries; each keeps `heads_fit`) and TILE_REGS_LIMIT (fp32 values per thread of
    one gathered tile above which a config spills)."""

    op = "gsa_sparse_attention"
    name = "gsa_sparse_attention_headblock"
    kernels = {"fwd": _gsa_sparse_attn_fwd_kernel, "bwd_dq": _gsa_sparse_attn_bwd_dq_kernel,
               "bwd_dkv": _gsa_sparse_attn_bwd_dkv_kernel}
    TILE_REGS_LIMIT = 128
    passes = staticmethod(headblock_passes)  # the forward's kernels (`Passes`)

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d"] <= 256

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        """Static pruning of what cannot stay in registers; loose (the compile check is authoritative)."""
        if device.key == "cpu":
            return None
        blocks = config.blocks
        rows = blocks["BLOCK_Q"] if role == "bwd_dkv" else blocks["BLOCK_TOPK"]
        per_thread = rows * blocks["BLOCK_H"] * dot_block(key["d"]) // (config.num_warps * device.warp_size)
        if per_thread > self.TILE_REGS_LIMIT:
            return f"a gathered tile holds {per_thread} fp32 values per thread (> {self.TILE_REGS_LIMIT})"
        return None

    def launch(self, args: dict, plan: CallPlan) -> torch.Tensor:
        return gsa_sparse_attention_forward(args, plan.config, self.passes)

    def bind(self, plan: CallPlan):
        config, passes = plan.config, self.passes
        return lambda args: gsa_sparse_attention_forward(args, config, passes)

    def backward(self, args: dict, plan: CallPlan, outputs: tuple, grad: torch.Tensor) -> dict:
        """The dq and dkv passes for the custom op's backward (registry/library.py); the op returns no
        lse, so the forward runs again to keep it."""
        return gsa_sparse_attention_backward(args, plan.config, grad, self.passes)


# Where the dense variant serves a key: its bucketed length (at least the call's) at most this many
# times k (dense tiles cost ~2 t^2 h d tensor-core FLOPs against the gathers' 4 t k h d bytes: break-even
# near t = 130 k, benchmarks/NOTES.md; half of that, to be safe), and a bitmap of at most this many
# bytes per batch row (the tuning key holds no batch size).
DENSE_T_PER_TOPK = 64
BITMAP_MAX_BYTES = 1 << 30


class GSASparseAttentionDenseBase(GSASparseAttentionHeadBlockBase):
    """The dense variant's logic (module docstring); each vendor file subclasses it with `Variant` and
    sets `spaces`: "build" (BLOCK_SLOTS slots per tile), "fwd" (BLOCK_M queries by BLOCK_N keys), and
    "fwd_extras", "bwd_dq", "bwd_dkv" (the head-block kernels, their spaces and TILE_REGS_LIMIT as the
    head-block variant's). Its priority is above the head block's, so untuned calls on the keys it
    serves take it; a tuned entry naming the head block still runs the head block."""

    name = "gsa_sparse_attention_dense"
    priority = 5
    kernels = {"build": _gsa_dense_build_kernel, "fwd_extras": _gsa_sparse_attn_fwd_kernel,
               "fwd": _gsa_dense_fwd_kernel, "bwd_dq": _gsa_sparse_attn_bwd_dq_kernel,
               "bwd_dkv": _gsa_sparse_attn_bwd_dkv_kernel}
    passes = staticmethod(dense_passes)
    # Fields of the dense kernel's default that change for head dims above 128 (vendor data).
    WIDE_HEAD_FWD: dict[str, int] = {}

    def supports(self, key: dict, device) -> bool:
        t = key["t"]
        return (super().supports(key, device) and t <= DENSE_T_PER_TOPK * key["topk"]
                and t * cdiv(t, 32) * 4 <= BITMAP_MAX_BYTES)

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        """The gather roles' pruning; the build and dense kernels are left to the compile check."""
        if role in ("build", "fwd"):
            return None
        return super().prune_reason(role, config, key, device)

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        config = super().role_default(role, key, device)
        if role != "fwd" or key["d"] <= 128 or device.key == "cpu":
            return config
        return self.spaces[role].make({**config.blocks, **config.knobs(), **self.WIDE_HEAD_FWD})


# The interpreter's block shapes, both vendors (the default first): head blocks narrower and wider than
# the tiny presets' heads, slot tiles that leave partial tiles.
INTERPRETER_FWD = ({"BLOCK_H": 8, "BLOCK_TOPK": 8}, {"BLOCK_H": 4, "BLOCK_TOPK": 16})
INTERPRETER_DKV = ({"BLOCK_H": 8, "BLOCK_Q": 8}, {"BLOCK_H": 4, "BLOCK_Q": 4})
# The dense variant's: its own kernels' tiles (the default first; 16 is tl.dot's smallest), and the
# head-block kernels' defaults only (the head-block variant runs their other shapes).
INTERPRETER_BUILD = ({"BLOCK_SLOTS": 8}, {"BLOCK_SLOTS": 32})
INTERPRETER_DENSE = ({"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 32, "BLOCK_N": 32})
# The build kernel's space, both vendors: it uses no matrix instructions or vendor knobs. One program per
# query; the atomics' latency is hidden by programs in flight, not by stages.
BUILD_SPACE = ConfigSpace(
    blocks={"BLOCK_SLOTS": (128, 256, 512, 1024)}, knobs={"num_warps": (1, 2, 4, 8), "num_stages": (1,)},
    defaults={"*": {"BLOCK_SLOTS": 256, "num_warps": 4, "num_stages": 1}},
    interpreter=INTERPRETER_BUILD,
)


def dense_spaces(headblock: dict[str, ConfigSpace], fwd: ConfigSpace) -> dict[str, ConfigSpace]:
    """The dense variant's spaces for a vendor: its own `fwd` space, the shared build space, and the
    head-block kernels' spaces for the extras pass and the backward (interpreter runs keep only their
    default tiles: the head-block variant covers the other shapes)."""
    return {
        "build": BUILD_SPACE,
        "fwd_extras": replace(headblock["fwd"], interpreter=INTERPRETER_FWD[:1]),
        "fwd": fwd,
        "bwd_dq": replace(headblock["bwd_dq"], interpreter=INTERPRETER_FWD[:1]),
        "bwd_dkv": replace(headblock["bwd_dkv"], interpreter=INTERPRETER_DKV[:1]),
    }
