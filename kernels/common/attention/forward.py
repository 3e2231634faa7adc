"""The attention family's forward: the Triton kernel of the `fwd` role and its launcher.

`_attention_fwd_kernel` gives a program BLOCK_M rows of one sequence: BLOCK_M queries of one head, or,
with HEADS > 1, BLOCK_M // HEADS queries of HEADS query heads of one kv head, so each K/V tile serves
the GQA group's heads at once. Its block body folds key blocks into an fp32 online softmax in log2
units over the key range masks.py gives, in one of three forms (KEY_LOOPS): three loops (masked
leading edge, unmasked middle, masked diagonal and tail), one loop that applies the score mask on its
edge blocks only, or, for a causal window of 32, 64 or 128 keys over at most 16 tokens, no loop at all
(`_attention_fwd_window`: the window's two halves and its diagonal as three products). The sink joins
the softmax's denominator at the end; a row with no allowed key gets out 0 and lse +inf.

`attention_forward` allocates out (and lse when it is returned or kept for a backward) and launches
the kernel with the config's tiles (tile_rules.py says what HEADS and KEY_LOOPS run) through a launch
function: Triton's own or a dispatch plan's `LaunchCache`. The NSA window branch and the Hopper Gluon
variants call it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from kreg.core.records import LaunchConfig
from kreg.kernels.common.attention.layout import _geometry, _lse_strides, _masks, _strides
from kreg.kernels.common.attention.masks import _allowed_keys, _block_order, _key_range, _sequence
from kreg.kernels.common.attention.tile_rules import causal_window, forward_loops, packed_heads
from kreg.kernels.common.constants import LN2, LOG2E
from kreg.kernels.common.launch import kept_arguments, launch_signed, signature_key, triton_launch
from kreg.kernels.common.tiles import cdiv, dot_block

# Kernels can only read globals that are constexprs.
FLOAT32_LOWEST = tl.constexpr(-3.4028234663852886e38)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start, end, full_lo, full_hi,
                         pos_m, seqlen_k, window, qk_scale,
                         MASKED: tl.constexpr, EDGES_ONLY: tl.constexpr, IS_CAUSAL: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, POSITIVE_SCALE: tl.constexpr):
    """Fold key blocks [start, end) into the online-softmax state (acc, l_i, m_i) of one query block.

    `k_base`/`v_base` point at key 0 of this (sequence, kv head). Scores are kept in log2 units
    (`qk_scale` = sm_scale * log2(e); POSITIVE_SCALE says it is > 0), so exp2 replaces exp. MASKED
    applies the key-length, causal and window masks; the unmasked stage is only called on blocks where
    every key is allowed. EDGES_ONLY (with MASKED): the key blocks in [full_lo, full_hi), which every
    row fully sees, skip the score mask (one uniform branch per block; the loads stay masked).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :]
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :]
    # Scalar block pointers advance in 64-bit: start * stride can pass 2**31 on long sequences.
    k_blk = k_base + tl.cast(start, tl.int64) * stride_kn
    v_blk = v_base + tl.cast(start, tl.int64) * stride_vn
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            # other=0 also keeps garbage (inf/NaN) past the sequence out of the P @ V product.
            kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_blk + k_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_blk + v_offs, mask=kv_mask, other=0.0)
        elif HEAD_DIM < BLOCK_D:
            k = tl.load(k_blk + k_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_blk + v_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_blk + k_offs)
            v = tl.load(v_blk + v_offs)
        # A positive scale is applied to the row maximum and then once per score, fused with the shift
        # into one FMA (a separate multiply per score is ~1 of ~12 instructions per score); the maximum
        # of scores scaled by a negative or zero scale is not the scaled maximum, so those scale first.
        qk = tl.dot(q, tl.trans(k))
        if not POSITIVE_SCALE:
            qk = qk * qk_scale
        if MASKED:
            # Positions relative to the block: in the causal diagonal loop (128 x 64 tiles) LLVM had
            # packed the mask of absolute positions into bit fields, 442 SASS instructions per tile to 362.
            if EDGES_ONLY:
                # The mask is ~3.5 of ~16 instructions per score in a window tile, and most of a
                # window's blocks need none.
                if (start_n < full_lo) | (start_n >= full_hi):
                    qk = tl.where(_allowed_keys(pos_m - start_n, offs_n, seqlen_k - start_n, window, IS_CAUSAL,
                                                HAS_WINDOW), qk, float("-inf"))
            else:
                qk = tl.where(_allowed_keys(pos_m - start_n, offs_n, seqlen_k - start_n, window, IS_CAUSAL,
                                            HAS_WINDOW), qk, float("-inf"))
        row_max = tl.max(qk, 1)
        if POSITIVE_SCALE:
            row_max = row_max * qk_scale
        # m starts at the lowest finite float (see the caller), so a row with no allowed key so far
        # shifts its -inf scores by a finite m: exp2 gives 0, not NaN, with no select per row and block.
        m_new = tl.maximum(m_i, row_max)
        if POSITIVE_SCALE:
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        else:
            p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        k_blk += BLOCK_N * stride_kn
        v_blk += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _window_rows(base, stride_n, start, seqlen_k, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [start, start + WIDTH) (start >= 0) of one head's K or V; rows past seqlen_k come back as
    zeros. Cached in L2 only: the blocks that share these rows run on other SMs (L1 hit rate 0.2%
    under ncu), and skipping L1 took 1-2% off the window-128 forward on an H100."""
    rows = tl.arange(0, WIDTH)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (start + rows < seqlen_k)[:, None] & (offs_d[None, :] < HEAD_DIM)
    return tl.load(base + tl.cast(start, tl.int64) * stride_n + rows[:, None] * stride_n + offs_d[None, :], mask=ok,
                   other=0.0, cache_modifier=".cg")


@triton.jit
def _window_scores(q, k, start, pos_m, seqlen_k, window, qk_scale, WIDTH: tl.constexpr, EDGE: tl.constexpr,
                   FULL_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   POSITIVE_SCALE: tl.constexpr):
    """Q K^T of the keys [start, start + WIDTH), -inf where not allowed: every mask with FULL_MASK,
    else the one test EDGE names (1: the window's first key, key >= pos - W + 1; 2: the diagonal,
    key <= pos; 0: none), one compare per score against a per-row bound."""
    qk = tl.dot(q, tl.trans(k))
    if not POSITIVE_SCALE:
        qk = qk * qk_scale
    cols = tl.arange(0, WIDTH)
    if FULL_MASK:
        qk = tl.where(_allowed_keys(pos_m - start, cols, seqlen_k - start, window, IS_CAUSAL, HAS_WINDOW), qk,
                      float("-inf"))
    elif EDGE == 1:
        qk = tl.where(cols[None, :] >= (pos_m - start - window + 1)[:, None], qk, float("-inf"))
    elif EDGE == 2:
        qk = tl.where(cols[None, :] <= (pos_m - start)[:, None], qk, float("-inf"))
    return qk


@triton.jit
def _attention_fwd_window(q, k_base, v_base, stride_kn, stride_vn, p_first, pos_m, seqlen_k, window, qk_scale,
                          HALF: tl.constexpr, CLAMPED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                          HAS_WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          POSITIVE_SCALE: tl.constexpr):
    """KEY_LOOPS 2: a causal window of exactly 2 * HALF keys over a block of at most 16 tokens whose first
    row sits at p_first, in three products and no loop: (acc, l, m) with no online rescaling.

    From the window's first key: HALF keys at the window's edge (only the window test applies there),
    HALF keys every row sees whole, and 16 keys past p_first (only the causal test applies): W + 16
    keys for the block's W + TOKENS - 1, where aligned key blocks of 32 visit 160 at W 128 and 8
    tokens in five loop iterations, each paying for its rescale, loads and barriers. CLAMPED (the
    caller's test: the window's first key, p_first - W + 1, would be negative, near a sequence's
    start): the three start at key 0 and every product takes every mask."""
    TAIL: tl.constexpr = 16
    lo = tl.maximum(p_first - window + 1, 0)
    k_edge = _window_rows(k_base, stride_kn, lo, seqlen_k, HALF, HEAD_DIM, BLOCK_D)
    k_mid = _window_rows(k_base, stride_kn, lo + HALF, seqlen_k, HALF, HEAD_DIM, BLOCK_D)
    k_tail = _window_rows(k_base, stride_kn, lo + 2 * HALF, seqlen_k, TAIL, HEAD_DIM, BLOCK_D)
    v_edge = _window_rows(v_base, stride_vn, lo, seqlen_k, HALF, HEAD_DIM, BLOCK_D)
    v_mid = _window_rows(v_base, stride_vn, lo + HALF, seqlen_k, HALF, HEAD_DIM, BLOCK_D)
    v_tail = _window_rows(v_base, stride_vn, lo + 2 * HALF, seqlen_k, TAIL, HEAD_DIM, BLOCK_D)
    s_edge = _window_scores(q, k_edge, lo, pos_m, seqlen_k, window, qk_scale, HALF, 1, CLAMPED, IS_CAUSAL, HAS_WINDOW,
                            POSITIVE_SCALE)
    s_mid = _window_scores(q, k_mid, lo + HALF, pos_m, seqlen_k, window, qk_scale, HALF, 0, CLAMPED, IS_CAUSAL,
                           HAS_WINDOW, POSITIVE_SCALE)
    s_tail = _window_scores(q, k_tail, lo + 2 * HALF, pos_m, seqlen_k, window, qk_scale, TAIL, 2, CLAMPED, IS_CAUSAL,
                            HAS_WINDOW, POSITIVE_SCALE)
    # The two halves share a shape: one cross-thread reduction for both (each costs shuffles).
    row_max = tl.maximum(tl.max(tl.maximum(s_edge, s_mid), 1), tl.max(s_tail, 1))
    if POSITIVE_SCALE:
        row_max = row_max * qk_scale
        shift = qk_scale
    else:
        shift = 1.0
    # The lowest finite float, not -inf, for a row with no allowed key: exp2 then gives 0, not NaN.
    m = tl.maximum(row_max, FLOAT32_LOWEST)
    p_edge = tl.math.exp2(s_edge * shift - m[:, None])
    p_mid = tl.math.exp2(s_mid * shift - m[:, None])
    p_tail = tl.math.exp2(s_tail * shift - m[:, None])
    l_i = tl.sum(p_edge + p_mid, 1) + tl.sum(p_tail, 1)
    acc = tl.dot(p_edge.to(v_edge.dtype), v_edge)
    acc = tl.dot(p_mid.to(v_mid.dtype), v_mid, acc)
    acc = tl.dot(p_tail.to(v_tail.dtype), v_tail, acc)
    return acc, l_i, m


def _attention_fwd_block_body(q_base, k_base, v_base, o_base, lse_base, start_m, seqlen_q, seqlen_k, window,
                              qk_scale, sink_base, stride_qm, stride_qh, stride_kn, stride_vn, stride_om, stride_oh,
                              stride_lh,
                              IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                              RETURN_LSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
                              KEY_LOOPS: tl.constexpr, WINDOW_HALF: tl.constexpr, POSITIVE_SCALE: tl.constexpr):
    """Query block `start_m` of one (sequence, HEADS query heads of one kv head): out rows (and lse)
    from its key blocks, in three loops (KEY_LOOPS 3: masked leading edge, unmasked middle, masked
    diagonal and tail), in one loop (KEY_LOOPS 1: a short window spans a few key blocks, and each
    loop pays its own pipeline prologue: one loop of five blocks may beat three of one to three) that
    branches per block around the score mask, which only its edge blocks apply, or without a loop
    (KEY_LOOPS 2, a window of 2 * WINDOW_HALF keys: `_attention_fwd_window`).
    Row r is token start_m * (BLOCK_M // HEADS) + r // HEADS of head r % HEADS (counted from the
    bases' head), so with HEADS > 1 each K/V tile serves the GQA group's heads at once and the block
    spans BLOCK_M // HEADS tokens: a window's key range overhangs a block's rows by less. With
    HEADS = 1 the head terms fold away. `sink_base` points at the first head's sink (read when
    HAS_SINKS; a varlen caller calls this block out of line, which takes scalars and pointers only, so
    the sinks are loaded here)."""
    TOKENS: tl.constexpr = BLOCK_M // HEADS
    m0 = start_m * TOKENS
    rows = tl.arange(0, BLOCK_M)
    offs_m = m0 + rows // HEADS  # each row's query position
    head_r = rows % HEADS
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    tile_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_rows = (rows // HEADS) * stride_qm + head_r * stride_qh
    q = tl.load(q_base + m0.to(tl.int64) * stride_qm + q_rows[:, None] + offs_d[None, :], mask=tile_ok, other=0.0)
    pos_m = seqlen_k - seqlen_q + offs_m
    lo, mid_lo, mid_hi, hi = _key_range(m0, seqlen_q, seqlen_k, window, IS_CAUSAL, HAS_WINDOW, TOKENS, BLOCK_N)

    # Not -inf: any finite score is >= this m, so the first real maximum replaces it (alpha = 0 then)
    # and a later block's scores are never shifted by a made-up maximum; until then alpha is 1 on an
    # empty row (l = 0, acc = 0).
    m_i = tl.full([BLOCK_M], FLOAT32_LOWEST, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if KEY_LOOPS == 2:
        p_first = seqlen_k - seqlen_q + m0
        # Two copies with their masks fixed at compile time: a run-time mask switch per product cost
        # 14 registers (110 against 96 on sm_90, 4 CTAs per SM instead of 5).
        if p_first - window + 1 < 0:
            acc, l_i, m_i = _attention_fwd_window(q, k_base, v_base, stride_kn, stride_vn, p_first, pos_m, seqlen_k,
                                                  window, qk_scale, WINDOW_HALF, True, IS_CAUSAL, HAS_WINDOW,
                                                  HEAD_DIM, BLOCK_D, POSITIVE_SCALE)
        else:
            acc, l_i, m_i = _attention_fwd_window(q, k_base, v_base, stride_kn, stride_vn, p_first, pos_m, seqlen_k,
                                                  window, qk_scale, WINDOW_HALF, False, IS_CAUSAL, HAS_WINDOW,
                                                  HEAD_DIM, BLOCK_D, POSITIVE_SCALE)
    elif KEY_LOOPS == 1:
        acc, l_i, m_i = _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, hi,
                                             mid_lo, mid_hi, pos_m, seqlen_k, window, qk_scale, True, True,
                                             IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_N, BLOCK_D, POSITIVE_SCALE)
    else:
        # Stage 1: the window's leading edge; stage 2: fully allowed blocks; stage 3: diagonal and tail.
        acc, l_i, m_i = _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, mid_lo,
                                             mid_lo, mid_hi, pos_m, seqlen_k, window, qk_scale, True, False,
                                             IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_N, BLOCK_D, POSITIVE_SCALE)
        acc, l_i, m_i = _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mid_lo,
                                             mid_hi, mid_lo, mid_hi, pos_m, seqlen_k, window, qk_scale, False, False,
                                             IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_N, BLOCK_D, POSITIVE_SCALE)
        acc, l_i, m_i = _attention_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mid_hi, hi,
                                             mid_lo, mid_hi, pos_m, seqlen_k, window, qk_scale, True, False,
                                             IS_CAUSAL, HAS_WINDOW, HEAD_DIM, BLOCK_N, BLOCK_D, POSITIVE_SCALE)

    empty = l_i == 0.0
    denominator = tl.where(empty, 1.0, l_i)
    if HAS_SINKS:
        if HEADS == 1:
            sink = tl.load(sink_base) * LOG2E
        else:
            sink = tl.load(sink_base + head_r) * LOG2E  # each row's head
        # The sink joins the softmax's denominator at the row's shift m: out_nosink * sigmoid(lse - sink)
        # without a logarithm (exact for sinks of +-inf: the term is inf or 0). A window CTA is short, so
        # its epilogue counts: this took two log2 and a division per row out of it when lse is not kept.
        denominator += tl.math.exp2(sink - tl.where(empty, 0.0, m_i))
    out = acc * tl.where(empty, 0.0, 1.0 / denominator)[:, None]  # a row with no key: 0 whatever the sink
    o_rows = (rows // HEADS) * stride_om + head_r * stride_oh
    tl.store(o_base + m0.to(tl.int64) * stride_om + o_rows[:, None] + offs_d[None, :], out.to(o_base.dtype.element_ty),
             mask=tile_ok)
    if RETURN_LSE:
        lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2
        tl.store(lse_base + head_r * stride_lh + offs_m, tl.where(empty, float("inf"), lse), mask=row_ok)


_attention_fwd_block = triton.jit(_attention_fwd_block_body)
# The same block as a called function, for varlen programs, which loop over blocks (a max_seqlen_q
# shorter than a sequence still covers it): inlined inside that loop the block holds ~60 more registers
# live on sm_90; called, about what the padded kernel holds.
_attention_fwd_block_called = triton.jit(noinline=True)(_attention_fwd_block_body)


@triton.jit
def _attention_fwd_kernel(
        Q, K, V, Sinks, Out, Lse, cu_seqlens_q, cu_seqlens_k,
        qk_scale, rows_q, rows_k, window,
        stride_qb, stride_qm, stride_qh,
        stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh,
        stride_ob, stride_om, stride_oh,
        stride_lb, stride_lh,
        GROUP: tl.constexpr, IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr, KEY_LOOPS: tl.constexpr,
        WINDOW_HALF: tl.constexpr, POSITIVE_SCALE: tl.constexpr):
    """One program: BLOCK_M rows of one sequence (grid: query blocks, h_q // HEADS, batch): BLOCK_M
    queries of one query head (HEADS = 1), or BLOCK_M // HEADS queries of HEADS consecutive query
    heads of one kv head (HEADS divides GROUP; the rows are token-major, heads minor).

    Writes those rows of `Out` (and their natural-log lse, without the sink, when RETURN_LSE), in fp32
    online softmax over the allowed keys only. Query i sits at p_i = seqlen_k - seqlen_q + i; causal
    allows keys j <= p_i, a window W keys with p_i - j < W. A row with no allowed key gets out 0 and lse
    +inf. Head h reads kv head h // GROUP. GROUP is a compile-time constant: as a run-time integer it
    cost ptxas ~37 more registers per thread at 8 warps (162 against 125 for d 64, 128 x 64 tiles), one
    program per SM instead of two, and GQA calls ran 20% slower than the same work without GQA.
    `rows_q`/`rows_k` are the rows per batch entry (padded) or
    the packed totals (varlen): varlen sequences start at cu_seqlens clamped into them (batch strides
    unused), and a program strides over the sequence's query blocks, whatever the grid's size.
    """
    off_h = tl.program_id(1) * HEADS  # the program's first query head
    off_b = tl.program_id(2)
    off_hk = off_h // GROUP
    sink_base = Q  # unread without sinks
    if HAS_SINKS:
        sink_base = Sinks + off_h
    # Base pointers in int64: batch, head and row offsets can exceed 2**31 elements.
    if IS_VARLEN:
        q_start, seqlen_q = _sequence(cu_seqlens_q, off_b, rows_q)
        k_start, seqlen_k = _sequence(cu_seqlens_k, off_b, rows_k)
        q_base = Q + q_start.to(tl.int64) * stride_qm + off_h.to(tl.int64) * stride_qh
        o_base = Out + q_start.to(tl.int64) * stride_om + off_h.to(tl.int64) * stride_oh
        k_base = K + k_start.to(tl.int64) * stride_kn + off_hk.to(tl.int64) * stride_kh
        v_base = V + k_start.to(tl.int64) * stride_vn + off_hk.to(tl.int64) * stride_vh
        lse_base = Lse + off_h.to(tl.int64) * stride_lh + q_start
        n_blocks = (seqlen_q + BLOCK_M // HEADS - 1) // (BLOCK_M // HEADS)
        for i in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            _attention_fwd_block_called(q_base, k_base, v_base, o_base, lse_base, _block_order(i, n_blocks, IS_CAUSAL),
                                        seqlen_q, seqlen_k, window, qk_scale, sink_base, stride_qm, stride_qh,
                                        stride_kn, stride_vn, stride_om, stride_oh, stride_lh, IS_CAUSAL, HAS_WINDOW,
                                        HAS_SINKS, RETURN_LSE, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HEADS,
                                        KEY_LOOPS, WINDOW_HALF, POSITIVE_SCALE)
    else:
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        o_base = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
        lse_base = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
        start_m = tl.program_id(0)
        if IS_CAUSAL:
            # The last query blocks see the most keys: launch them first, so the short ones fill the tail.
            start_m = tl.num_programs(0) - 1 - start_m
        _attention_fwd_block(q_base, k_base, v_base, o_base, lse_base, start_m, rows_q, rows_k, window,
                             qk_scale, sink_base, stride_qm, stride_qh, stride_kn, stride_vn, stride_om, stride_oh,
                             stride_lh, IS_CAUSAL, HAS_WINDOW, HAS_SINKS, RETURN_LSE, HEAD_DIM, BLOCK_D, BLOCK_M,
                             BLOCK_N, HEADS, KEY_LOOPS, WINDOW_HALF, POSITIVE_SCALE)


# ----------------------------------------------------------------------------- launcher
def attention_forward(args: Mapping, config: LaunchConfig, keep_lse: bool, launch: Callable[..., Any] = triton_launch,
                      prepared: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Allocate out (and lse, when returned or kept for a backward) and run the forward kernel (through
    `launch`: Triton's own launch, or a dispatch plan's `LaunchCache`). The grid comes from shapes and
    max_seqlen_q only: no tensor value is read on the host, so this can be captured in a CUDA graph.
    With `prepared` (a dict a plan keeps, given with the config it always gets), the launch's grid,
    scalars and constexprs are kept per call signature (the shapes, strides and flags they are made
    from) and a `LaunchCache` launches by that signature."""
    q, k, v = args["q"], args["k"], args["v"]
    sinks, cu_q = args.get("sinks"), args["cu_seqlens_q"]
    varlen = cu_q is not None
    # Varlen rows outside every sequence belong to no program: they keep out 0 and lse +inf from here.
    out = (torch.zeros if varlen else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    lse = None
    if keep_lse or args["return_lse"]:
        shape = (q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        lse = torch.full(shape, float("inf"), dtype=torch.float32, device=q.device) if varlen else \
            torch.empty(shape, dtype=torch.float32, device=q.device)
    signature = forward_signature(args, lse is None) if prepared is not None else None
    grid, scalars, constexprs, key = kept_arguments(prepared, signature, _forward_launch, args, config, out, lse)
    cu_k = args["cu_seqlens_k"] if varlen else q  # q: an unused placeholder
    launch_signed(launch, key if prepared is not None else None, _attention_fwd_kernel, grid,
                  (q, k, v, sinks, out, out if lse is None else lse, cu_q if varlen else q, cu_k,
                   float(args["sm_scale"]) * LOG2E.value, *scalars), constexprs)
    return out, lse


def forward_signature(args: Mapping, no_lse: bool) -> tuple:
    """Everything a forward launch's grid, scalars and constexprs are made from (the plan fixes the
    config and the dtype): shapes, strides, the varlen batch and maxima, and the flags."""
    q, k, cu_q = args["q"], args["k"], args["cu_seqlens_q"]
    return (q.shape, q.stride(), k.shape, k.stride(), args["v"].stride(), None if cu_q is None else cu_q.shape,
            args["max_seqlen_q"], args["max_seqlen_k"], args.get("sinks") is None, no_lse, args["causal"],
            args["window"], args["sm_scale"] > 0)


def _forward_launch(args: Mapping, config: LaunchConfig, out: torch.Tensor, lse: torch.Tensor | None
                    ) -> tuple[tuple, tuple, dict, int]:
    """(grid, scalars after sm_scale, keyword arguments, signature key) of one call's launch: functions
    of its shapes, strides and flags only (out and lse are fresh, so theirs follow from the shapes)."""
    q, k, v = args["q"], args["k"], args["v"]
    varlen, batch, rows_q, rows_k, span_q, _ = _geometry(args)
    h_q, h_kv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    masks = _masks(args, rows_k)
    window = masks.pop("window")
    block_m, block_n = config.blocks["BLOCK_M"], config.blocks["BLOCK_N"]
    heads = packed_heads(config, h_q // h_kv)
    loops, half = forward_loops(config, causal_window(args, rows_k), block_m // heads)
    scalars = (rows_q, rows_k, window, *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen),
               *_strides(out, varlen), *(_lse_strides(lse, varlen) if lse is not None else (0, 0)))
    constexprs = dict(GROUP=h_q // h_kv, IS_VARLEN=varlen, HAS_SINKS=args.get("sinks") is not None,
                      RETURN_LSE=lse is not None, HEAD_DIM=d, BLOCK_D=dot_block(d), BLOCK_M=block_m, BLOCK_N=block_n,
                      HEADS=heads, KEY_LOOPS=loops, WINDOW_HALF=half, POSITIVE_SCALE=args["sm_scale"] > 0, **masks,
                      **config.knobs())
    return (cdiv(span_q, block_m // heads), h_q // heads, batch), scalars, constexprs, signature_key()
