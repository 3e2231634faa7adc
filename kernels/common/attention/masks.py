"""The jitted helpers the forward and backward kernels of the attention family both call: a varlen
sequence's bounds, the order a varlen program takes its blocks in, the key range a query block visits
and the query range a key block is visited by, and the mask of the keys a row may see.

Masking in stages (Triton's fused-attention tutorial): the key range [lo, hi) of one query block that
holds any allowed key is cut into an unmasked middle [mid_lo, mid_hi), whose key blocks every row of
the block fully sees, and masked edges (the window's start, the causal diagonal, the partial last
block), so mask arithmetic runs only on blocks that need it; blocks outside [lo, hi) are never
visited, so a window costs s * W, not s^2. `_query_range` cuts the query range of a key block (the
dK/dV kernel's loop) the same way. The forward's loops over these ranges are in forward.py (KEY_LOOPS
picks three loops, one, or none for a short window).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
