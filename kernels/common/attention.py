"""Dense attention (FlashAttention-2) with sinks, sliding windows, GQA and varlen packing: the Triton
kernel family that flash_attention and sink_attention share, forward and backward, on both vendors.

A call launches up to four kernels, four roles of one tuned entry:

- `fwd` (`_attention_fwd_kernel`): one program per (query block, query head, sequence); online
  softmax over the keys the block may see, the sink applied once at the end
  (`out = out_nosink * sigmoid(lse - sink)`); writes out and the lse without the sink.
- `bwd_pre` (`_attention_bwd_pre_kernel`): one program per (row block, query head, sequence); reads
  dO and O once, writes `Delta = rowsum(dO * O)` and the row's total lse (the sink included, in log2
  units, for the two kernels below), and each program's partial sum of
  `d sink = -sigmoid(sink - lse) * Delta` (fixed-order sums, no atomics).
- `bwd_dkv` (`_attention_bwd_dkv_kernel`): one program per (key block, kv head, sequence); loops over
  the GQA group's query heads and the query blocks that may see its keys, so the group's sum happens
  in registers and K/V are never expanded; writes dK and dV once.
- `bwd_dq` (`_attention_bwd_dq_kernel`): the forward's program layout; recomputes P and dS over the
  same key range and writes dQ.

No kernel uses atomics, so gradients are bitwise reproducible (`deterministic=True` changes nothing
here). Sinks, windows, causal masks and varlen are constexpr switches of every kernel.

Masking in stages (Triton's fused-attention tutorial): for one query block the key range [lo, hi) that
holds any allowed key is cut into an unmasked middle [mid_lo, mid_hi), whose key blocks every row of
the block fully sees, and masked edges (the window's start, the causal diagonal, the partial last
block), so mask arithmetic runs only where a block needs it (in three loops, or in one loop that
branches per block around the mask: KEY_LOOPS; a short window may skip the loop altogether, see
`_attention_fwd_window`); key blocks outside [lo, hi) are never visited, so a window's cost grows with
s * W, not s^2. The dK/dV kernel cuts the query range of a key block the same way.

Varlen memory safety: sequence bounds read from cu_seqlens are clamped into the packed tensors inside
the kernels (a sequence past the end, a decreasing or negative offset touches only rows that exist),
and programs stride over query (key) blocks, so a max_seqlen smaller than a real sequence still
covers every row. No value is read on the host.

Reads top-down: helpers, forward kernels, backward kernels, launchers, the autograd Function, the
entry point (`attention_call`), offline compile specs, the variant logic. Semantics:
`ops.flash_attention.reference` and `ops.sink_attention.reference`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.constants import LN2, LOG2E
from kreg.kernels.common.launch import LaunchCache, triton_launch
from kreg.kernels.common.tiles import cdiv, dot_block
from kreg.ops.variant import CallPlan

# Kernels can only read globals that are constexprs.
FLOAT32_LOWEST = tl.constexpr(-3.4028234663852886e38)


# ----------------------------------------------------------------------------- shared helpers
@triton.jit
def _sequence(cu_seqlens, off_b, rows):
    """(first row, length) of sequence `off_b`, clamped into the `rows` rows of the packed tensor."""
    start = tl.load(cu_seqlens + off_b)
    end = tl.load(cu_seqlens + off_b + 1)
    start = tl.minimum(tl.maximum(start, 0), rows)
    end = tl.minimum(tl.maximum(end, start), rows)
    return start, end - start


@triton.jit
def _block_order(i, n_blocks, IS_CAUSAL: tl.constexpr):
    """The query block the i-th program of a varlen sequence takes: causal ones take the longest (last)
    blocks first, so the short ones fill the tail."""
    if IS_CAUSAL:
        return n_blocks - 1 - i
    return i


@triton.jit
def _key_range(m0, seqlen_q, seqlen_k, window,
               IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, mid_lo, mid_hi, hi): the keys query rows [m0, m0 + BLOCK_M) may see are [lo, hi); key
    blocks in [mid_lo, mid_hi) are fully allowed for every valid row. lo, mid_lo and mid_hi sit on
    BLOCK_N boundaries. Every division below is of a non-negative value (Triton's `//` truncates)."""
    diag = seqlen_k - seqlen_q
    p_first = diag + m0
    p_last = diag + tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    hi = seqlen_k
    if IS_CAUSAL:
        hi = tl.minimum(hi, tl.maximum(p_last + 1, 0))
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p_first - window + 1, 0) // BLOCK_N * BLOCK_N
    lo = tl.minimum(lo, hi)
    mid_lo = lo
    if HAS_WINDOW:
        mid_lo = tl.maximum(p_last - window + 1, 0)
        mid_lo = tl.minimum((mid_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, hi)
    mid_hi = seqlen_k // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        mid_hi = tl.minimum(mid_hi, tl.maximum(p_first + 1, 0) // BLOCK_N * BLOCK_N)
    mid_hi = tl.maximum(tl.minimum(mid_hi, hi), mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _query_range(n0, seqlen_q, seqlen_k, window,
                 IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, mid_lo, mid_hi, hi): the query rows that may see a key of block [n0, n0 + BLOCK_N) are
    [lo, hi); query blocks in [mid_lo, mid_hi) (BLOCK_M steps from lo) see every key of the block. A
    partial key block (past seqlen_k) has no unmasked middle."""
    diag = seqlen_k - seqlen_q
    n_last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo = 0
    if IS_CAUSAL:
        lo = tl.maximum(n0 - diag, 0)  # p_i >= n0
    hi = seqlen_q
    if HAS_WINDOW:
        hi = tl.minimum(hi, tl.maximum(n_last + window - diag, 0))  # p_i - n_last <= W - 1
    lo = tl.minimum(lo, hi)
    full_lo = lo
    if IS_CAUSAL:
        full_lo = tl.maximum(n0 + BLOCK_N - 1 - diag, 0)  # p_i >= the block's last key
    full_hi = seqlen_q
    if HAS_WINDOW:
        full_hi = tl.minimum(full_hi, tl.maximum(n0 + window - diag, 0))  # p_i - n0 <= W - 1
    mid_lo = tl.minimum(lo + (tl.maximum(full_lo - lo, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, hi)
    mid_hi = mid_lo + tl.maximum(full_hi - mid_lo, 0) // BLOCK_M * BLOCK_M
    mid_hi = tl.where(n0 + BLOCK_N <= seqlen_k, mid_hi, mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _allowed_keys(pos, cols, seqlen_k, window, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[rows, keys] mask of the keys `cols` that rows at positions `pos` may see (masked key blocks of
    the forward and dQ loops, rows along dim 0). Causal: a valid row sits before seqlen_k, so its causal
    test also keeps out keys past the sequence (rows past seqlen_q are never stored, and keys past it
    are loaded as 0), and a window is one unsigned compare of the distance (0 <= pos - key < window):
    the masks were ~6 ALU instructions per score, and the window forward is issue-bound."""
    if IS_CAUSAL:
        if HAS_WINDOW:
            allowed = (pos[:, None] - cols[None, :]).to(tl.uint32, bitcast=True) < tl.cast(window, tl.uint32)
        else:
            allowed = cols[None, :] <= pos[:, None]
    else:
        allowed = cols[None, :] < seqlen_k
        if HAS_WINDOW:
            allowed = allowed & (pos[:, None] - cols[None, :] < window)
    return allowed


# ----------------------------------------------------------------------------- forward
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


# ----------------------------------------------------------------------------- backward
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
def _strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of q/k/v-like tensors; packed (varlen) tensors have no batch dim."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of lse-like tensors: [b, h, s], or [h, total] for varlen (rows contiguous)."""
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _geometry(args: Mapping) -> tuple[bool, int, int, int, int, int]:
    """(varlen, batch, rows_q, rows_k, span_q, span_k): rows per batch entry (padded) or the packed
    totals, and the lengths the grid covers (max_seqlen for varlen; programs stride past them)."""
    q, k = args["q"], args["k"]
    if args["cu_seqlens_q"] is not None:
        return (True, args["cu_seqlens_q"].shape[0] - 1, q.shape[0], k.shape[0],
                args["max_seqlen_q"], args["max_seqlen_k"])
    return False, q.shape[0], q.shape[1], k.shape[1], q.shape[1], k.shape[1]


def _masks(args: Mapping, rows_k: int) -> dict:
    """The mask constexprs and the window argument. A window of at least rows_k keys allows what
    causal allows, so it is capped there: positions stay far from int32 overflow."""
    window = args["window"]
    return {"window": min(window, rows_k) if window is not None else 0,
            "IS_CAUSAL": bool(args["causal"]), "HAS_WINDOW": window is not None}


def tile_blocks(blocks: Mapping[str, int]) -> dict[str, int]:
    """A config's tile sizes: its blocks without the forward's HEADS (query heads per program) and
    KEY_LOOPS (how its key blocks are looped over)."""
    return {name: size for name, size in blocks.items() if name not in ("HEADS", "KEY_LOOPS")}


def key_loops(config: LaunchConfig) -> int:
    """The forward's KEY_LOOPS: 3 (masked edges and an unmasked middle) unless the config says 1 (one
    loop, the score mask applied on its edge blocks only) or 2 (no loop: a short window's two halves
    and its diagonal as three products, see `window_reason`); configs of spaces without the block
    (older tables, other ops' window roles) take 3."""
    return config.blocks.get("KEY_LOOPS", 3)


def window_reason(window: int | None, tokens: int) -> str | None:
    """Why KEY_LOOPS 2 (no loop: a causal window's two halves and its diagonal in three products) cannot
    run a window of `window` keys over blocks of `tokens` tokens (None when it can): the window must be
    a power of two from 32 to 128 (its halves are products of their own; 256 would hold 136 scores a
    thread) and the block's tokens at most 16 (its diagonal is one 16-key product)."""
    if window not in (32, 64, 128):
        return f"KEY_LOOPS=2 needs a window of 32, 64 or 128 keys, got {window}"
    if tokens > 16:
        return f"KEY_LOOPS=2 needs at most 16 tokens per block (BLOCK_M // HEADS), got {tokens}"
    return None


def causal_window(args: Mapping, rows_k: int) -> int | None:
    """The causal window a call's forward runs, capped at its `rows_k` keys (as `_masks` caps it); None
    without a window or without causal masking. What `forward_loops` and the short-window kernels judge."""
    if args["window"] is None or not args["causal"]:
        return None
    return min(args["window"], rows_k)


def forward_loops(config: LaunchConfig, window: int | None, tokens: int) -> tuple[int, int]:
    """(KEY_LOOPS, WINDOW_HALF) the forward runs a config with, for a causal window of `window` keys (None
    without one) over blocks of `tokens` tokens: KEY_LOOPS 2 where `window_reason` allows it (a config
    carried over from another key, or a window capped at the sequence's length, runs as one loop),
    WINDOW_HALF 0 unless it is 2. The launcher and the offline compile specs both ask here."""
    loops = key_loops(config)
    if loops != 2:
        return loops, 0
    if window_reason(window, tokens) is not None:
        return 1, 0
    return 2, window // 2


def one_loop_only_for_windows(config: LaunchConfig, key: Mapping) -> bool:
    """Keep: KEY_LOOPS 1 only for windowed keys, 2 where `window_reason` allows it; without a window the
    middle blocks of a long causal or full row are unmasked, which the three-loop form exploits."""
    loops = key_loops(config)
    if loops == 2:
        # No loop: neither the key tile nor a pipeline's depth plays a part, so one value of each stays.
        tokens = config.blocks["BLOCK_M"] // config.blocks.get("HEADS", 1)
        return window_reason(key.get("window"), tokens) is None and config.blocks["BLOCK_N"] == 32 and \
            config.num_stages <= 2
    return loops == 3 or key.get("window") is not None


def packing_reason(blocks: Mapping[str, int], key: Mapping) -> str | None:
    """Why a forward config's HEADS (query heads of one kv head packed along the rows) cannot run at
    this key (None when it can): it must divide the GQA group and BLOCK_M."""
    if "HEADS" not in blocks:
        return None
    heads, group = blocks["HEADS"], key["h_q"] // key["h_kv"]
    if group % heads or blocks["BLOCK_M"] % heads:
        return f"HEADS={heads} must divide the GQA group {group} and BLOCK_M {blocks['BLOCK_M']}"
    return None


def packed_heads(config: LaunchConfig, group: int) -> int:
    """Query heads per forward program: the config's HEADS block where it divides the GQA group and
    BLOCK_M (a config carried over from another key may not), else 1."""
    heads = config.blocks.get("HEADS", 1)
    return heads if group % heads == 0 and config.blocks["BLOCK_M"] % heads == 0 else 1


def attention_forward(args: Mapping, config: LaunchConfig, keep_lse: bool, launch: Callable[..., Any] = triton_launch
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Allocate out (and lse, when returned or kept for a backward) and run the forward kernel (through
    `launch`: Triton's own launch, or a dispatch plan's `LaunchCache`). The grid comes from shapes and
    max_seqlen_q only: no tensor value is read on the host, so this can be captured in a CUDA graph."""
    q, k, v = args["q"], args["k"], args["v"]
    sinks = args.get("sinks")
    varlen, batch, rows_q, rows_k, span_q, _ = _geometry(args)
    h_q, h_kv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    # Varlen rows outside every sequence belong to no program: they keep out 0 and lse +inf from here.
    out = (torch.zeros if varlen else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    lse = None
    if keep_lse or args["return_lse"]:
        shape = (h_q, rows_q) if varlen else (batch, h_q, rows_q)
        lse = torch.full(shape, float("inf"), dtype=torch.float32, device=q.device) if varlen else \
            torch.empty(shape, dtype=torch.float32, device=q.device)
    masks = _masks(args, rows_k)
    window = masks.pop("window")
    cu_q, cu_k = (args["cu_seqlens_q"], args["cu_seqlens_k"]) if varlen else (q, q)  # q: unused placeholder
    block_m, block_n = config.blocks["BLOCK_M"], config.blocks["BLOCK_N"]
    heads = packed_heads(config, h_q // h_kv)
    loops, half = forward_loops(config, causal_window(args, rows_k), block_m // heads)
    launch(
        _attention_fwd_kernel, (cdiv(span_q, block_m // heads), h_q // heads, batch),
        q, k, v, sinks, out, lse if lse is not None else out, cu_q, cu_k,
        float(args["sm_scale"]) * LOG2E.value, rows_q, rows_k, window,
        *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(out, varlen),
        *(_lse_strides(lse, varlen) if lse is not None else (0, 0)),
        GROUP=h_q // h_kv, IS_VARLEN=varlen, HAS_SINKS=sinks is not None, RETURN_LSE=lse is not None, HEAD_DIM=d,
        BLOCK_D=dot_block(d), BLOCK_M=block_m, BLOCK_N=block_n, HEADS=heads, KEY_LOOPS=loops,
        WINDOW_HALF=half, POSITIVE_SCALE=args["sm_scale"] > 0, **masks, **config.knobs())
    return out, lse


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


class _AttentionFunction(torch.autograd.Function):
    """Autograd for the family: the forward kernel (`forward`: `attention_forward` or another variant's
    forward launcher with its signature) keeps lse for the backward (`backward`: `attention_backward`
    or another variant's backward launcher with its signature). The returned lse is not
    differentiable (as in FlashAttention); gradients flow from `out` to q, k, v and sinks. No atomics
    anywhere, so gradients are bitwise reproducible."""

    @staticmethod
    def forward(ctx, forward, backward, q, k, v, sinks, args: Mapping, config: CallConfig, launch):
        out, lse = forward(args, config["fwd"], keep_lse=True, launch=launch)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.rest = {name: value for name, value in args.items() if name not in ("q", "k", "v", "sinks")}
        ctx.config = config
        ctx.backward = backward
        ctx.launch = launch
        ctx.mark_non_differentiable(lse)
        return (out, lse) if args["return_lse"] else out

    @staticmethod
    def backward(ctx, dout, *_lse_grad):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dq, dk, dv, dsinks = ctx.backward(q, k, v, sinks, out, lse, dout, ctx.rest, ctx.config, ctx.launch)
        return None, None, dq, dk, dv, dsinks, None, None, None


def attention_call(args: Mapping, config: CallConfig, launch: Callable[..., Any] = triton_launch,
                   forward: Callable[..., tuple] = attention_forward,
                   backward: Callable[..., tuple] = attention_backward):
    """flash_attention or sink_attention on the op contract's validated args (sink_attention's carry
    `sinks`): `out`, or `(out, lse)` with `return_lse`.

    The forward runs with the "fwd" role's config; when grad is enabled and an input requires grad it
    runs under `_AttentionFunction`, whose backward launches the "bwd_pre", "bwd_dkv" and "bwd_dq"
    roles' configs. `deterministic` needs nothing: no kernel here uses atomics. `launch` runs every
    kernel of the call, forward and backward (a dispatch plan's `LaunchCache`, or Triton's launch);
    `forward` is the forward launcher (`attention_forward`'s signature) and `backward` the backward
    launcher (`attention_backward`'s): this module's kernels, or another variant's.
    """
    q, k, v = args["q"], args["k"], args["v"]
    sinks = args.get("sinks")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        return _AttentionFunction.apply(forward, backward, q, k, v, sinks, args, config, launch)
    out, lse = forward(args, config["fwd"], keep_lse=False, launch=launch)
    return (out, lse) if args["return_lse"] else out


# ----------------------------------------------------------------------------- the variants
# The interpreter's tiles per role, its default first. Every extra tile is another interpreted run of
# each tiny preset in the conformance test (a backward one, a backward too), so the backward roles
# have one each; tests/test_attention_kernel.py runs the other tile shapes.
INTERPRETER_TILES = {
    "fwd": ({"BLOCK_M": 32, "BLOCK_N": 32, "HEADS": 1, "KEY_LOOPS": 3},
            {"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 2, "KEY_LOOPS": 1}),
    "bwd_pre": ({"BLOCK_M": 32},),
    "bwd_dkv": ({"BLOCK_M": 16, "BLOCK_N": 32},),
    "bwd_dq": ({"BLOCK_M": 32, "BLOCK_N": 16},),
}
# Which block a role's sequence-length dim bounds, and which block streams through the pipeline (the
# one to narrow when shared memory runs short).
_BLOCK_DIMS = {"BLOCK_M": "s_q", "BLOCK_N": "s_k"}
_STREAMED = {"fwd": "BLOCK_N", "bwd_dkv": "BLOCK_M", "bwd_dq": "BLOCK_N"}


class AttentionTiledBase:
    """The tiled family's variant logic; each (vendor, op) file subclasses it with `Variant` and sets:

    op, name: flash_attention's "flash_attention_tiled", sink_attention's "sink_attention_flash";
    spaces: a ConfigSpace per role: "fwd", "bwd_dkv" and "bwd_dq" (blocks BLOCK_M, BLOCK_N), "bwd_pre"
        (BLOCK_M), each with the vendor's knobs, keep rule and d 128 default;
    HEAD_DIM_DEFAULTS: per role, (largest head dim, fields) rows: the first row whose head dim fits
        changes those fields of the space's default;
    shared_bytes(role, config, block_d, elem): shared memory/LDS estimate, calibrated on real compiles.
    fp32 inputs are not supported (`supports` is False): dispatch sends them to the reference.
    """

    kernels = {"fwd": _attention_fwd_kernel, "bwd_pre": _attention_bwd_pre_kernel,
               "bwd_dkv": _attention_bwd_dkv_kernel, "bwd_dq": _attention_bwd_dq_kernel}
    HEAD_DIM_DEFAULTS: Mapping[str, tuple[tuple[int, dict], ...]] = {}

    def shared_bytes(self, role: str, config: LaunchConfig, block_d: int, elem: int) -> int:
        raise NotImplementedError

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d"] <= 256

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        blocks = config.blocks
        expected = set(self.spaces[role].blocks)
        if set(blocks) != expected:
            return f"blocks must be {sorted(expected)}, got {sorted(blocks)}"
        tiles = tile_blocks(blocks)
        if role != "bwd_pre" and min(tiles.values()) < 16:
            return f"tl.dot needs tiles of at least 16, got {blocks}"
        reason = packing_reason(blocks, key)
        if reason is not None:
            return reason
        # A tile longer than the (bucketed) sequence only computes masked rows or keys, unless no
        # smaller tile exists to take its place.
        smallest = self._smallest_blocks(role, device)
        for block, size in tiles.items():
            dim = _BLOCK_DIMS[block]
            if size > key[dim] and size > smallest[block]:
                return f"{block}={size} is longer than the {dim} bucket {key[dim]}"
        if device.key == "cpu":
            return None
        elem = 4 if key["dtype"] == "fp32" else 2
        need = self.shared_bytes(role, config, dot_block(key["d"]), elem)
        if need > device.shared_mem_bytes:
            return f"needs ~{need} B of shared memory/LDS (> {device.shared_mem_bytes} B)"
        return None

    def _smallest_blocks(self, role: str, device) -> dict[str, int]:
        return {name: min(values) for name, values in self.spaces[role].block_values(device).items()}

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        space = self.spaces[role]
        if device.key == "cpu":
            return space.default(device)
        base = space.default(device)
        fields = {**base.blocks, **base.knobs()}
        rows = self.HEAD_DIM_DEFAULTS.get(role, ())
        fields.update(next((row for d_max, row in rows if key["d"] <= d_max), {}))
        smallest = self._smallest_blocks(role, device)
        # Short sequences: no tile longer than its bucket (down to the space's smallest tile; a default
        # below that one stays).
        blocks = {name: min(fields.pop(name), max(smallest[name], key[_BLOCK_DIMS[name]])) if name in _BLOCK_DIMS
                  else fields.pop(name) for name in space.blocks}
        config = LaunchConfig(blocks=blocks, **fields)
        if space.keep is not None and not space.keep(config, key):
            config = config.model_copy(update={"num_warps": 4})
        # A device with less shared memory than the table assumes: fewer stages, then a narrower
        # streamed tile.
        streamed = _STREAMED.get(role)
        while self.prune_reason(role, config, key, device) is not None:
            if config.num_stages > 1:
                config = config.model_copy(update={"num_stages": config.num_stages - 1})
            elif streamed is not None and config.blocks[streamed] > 16:
                blocks = {**config.blocks, streamed: config.blocks[streamed] // 2}
                config = config.model_copy(update={"blocks": LaunchConfig(blocks=blocks).blocks})
            else:
                break
        return config

    def launchers(self, plan: CallPlan) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
        """The forward launcher (args, fwd config, keep_lse, launch) -> (out, lse or None) and the backward
        launcher (q, k, v, sinks, out, lse, dout, args, call config, launch) -> (dq, dk, dv, dsinks or
        None) of calls under `plan`: this module's kernels; a variant with other kernels replaces them."""
        return attention_forward, attention_backward

    def launch(self, args: dict, plan: CallPlan):
        forward, backward = self.launchers(plan)
        return attention_call(args, plan.config, forward=forward, backward=backward)

    def bind(self, plan: CallPlan):
        (forward, backward), config = self.launchers(plan), plan.config
        return lambda args: attention_call(args, config, forward=forward, backward=backward)

    def bind_cached(self, plan: CallPlan):
        (forward, backward), config, launches = self.launchers(plan), plan.config, LaunchCache()
        return lambda args: attention_call(args, config, launches, forward, backward)

    def backward(self, args: dict, plan: CallPlan, outputs: tuple, grad: torch.Tensor) -> dict:
        """The backward kernels on the forward's saved out and lse (registry/library.py's custom op);
        a call that returned no lse runs the forward again to keep it."""
        forward, backward = self.launchers(plan)
        out, lse = outputs[0], outputs[1]
        if not lse.numel():
            out, lse = forward(args, plan.config["fwd"], keep_lse=True)
        sinks = args.get("sinks")
        dq, dk, dv, dsinks = backward(args["q"], args["k"], args["v"], sinks, out, lse, grad, args, plan.config)
        return {"q": dq, "k": dk, "v": dv, "sinks": dsinks}
