"""NSA's forward (Native Sparse Attention): the Triton kernels of the compressed, selected and window
branches and their gated sum, which both vendors share, and the launcher that runs them
(`nsa_forward_parts`; the entry point with autograd, `nsa_forward`, is in variant.py).

A call launches four kernels, four roles of one tuned entry:

- `compress` (`_nsa_compress_kernel`): one program per (compressed block, kv head, sequence); the mean
  of the block's `block_size` keys and values, summed in fp32 and stored in q's dtype as
  k_cmp, v_cmp [b, t // block_size, h_kv, d]. q's dtype because they are the operands of the next
  kernel's tensor-core products (which take q's dtype anyway) and half the bytes of fp32; the rounding
  is one more half ulp on a mean of inputs that already carry one, far inside the op's budget.
- `cmp` (`_nsa_cmp_kernel`): the compressed branch, group-packed: one program per (tile of BLOCK_T
  consecutive tokens, kv head, sequence) whose M = BLOCK_T * BLOCK_G rows are those tokens times the
  G = h_q // h_kv query heads of the group (padded to BLOCK_G, a power of two), so each compressed K/V
  tile is loaded once for the whole group. Online softmax over the compressed blocks some row can see
  ((c + 1) * block_size - 1 <= i): the tiles every row sees run unmasked, only the tile at the
  boundary is masked. Writes o_cmp (and lse_cmp when asked).
  Selection (when no block_indices are given) is a second pass of the same program over the same
  tiles once the rows' lse is known: p = exp(s - lse) again, summed over the group's heads (a reshape
  of the rows to [BLOCK_T, BLOCK_G] and a sum) is each token's importance of each block; each token
  keeps its best `block_count` blocks in registers, the own block i // block_size in slot 0 (forced,
  never replaced), empty slots below every probability. Per tile, a token's candidates are its blocks
  below the own one (the own partial block has no compressed probability); the tile is merged by
  extracting its best candidate, row by row, as long as some row's best beats that row's weakest kept
  block, which it replaces. The extractions per tile are bounded by the most candidates any row has
  above its weakest (at most block_count - 1): every block early in the stream, a few per tile later
  (for importances in random order, about block_count * BLOCK_N / n candidates beat the weakest after
  n blocks). A round is a chain of dependent reductions, bound by their latency, so values and
  positions travel packed in int32 keys (the kernel says how): two reductions a round. Memory is
  O(t * block_count): the [t, n_cmp] importance never exists outside registers. Slots fill in order,
  so the written ids are the own block, the others in no particular order, then -1. Fused rather than
  a kernel of its own: the second pass reuses the program's Q tile and its rows' lse in registers.
- `swa` (`_attention_fwd_kernel` through `attention_forward`, kernels/common/attention/forward.py): the
  window branch is causal attention with a window of `window` keys including the query, the attention
  family's forward unchanged.
- `slc` (`_nsa_slc_kernel`): the selected branch, group-centric (NSA's kernel): one program per
  (token, kv head, sequence) whose rows are the G heads of the group (padded to 16, tl.dot's
  smallest M); it walks the token's block_count ids, loads each valid block's keys [blk * bs,
  blk * bs + bs) once for all its heads and folds them into an online softmax, causally (j <= i), in
  steps of BLOCK_N keys (several blocks a step when blocks are short, several steps a block when they
  are long). The ids are read once, before the loop, so that the K/V loads do not depend on a load
  inside it and pipeline. Ids outside 0 .. i // block_size read nothing (the block is clamped to 0
  for the address and every lane masked); duplicates are attended twice. Its
  epilogue is the gated sum: it reads o_cmp and o_swa (kept by the two kernels before it) and the
  three gates in their dtypes, and writes out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa in
  fp32 (stored in q's dtype); o_slc and lse_slc are stored only when the parts are asked for
  (`nsa_forward_parts`, for a backward). No separate combine kernel: at t 65536 with 64 heads of 128
  each branch output is 1 GiB, and not writing o_slc and reading it back saves two of them.

Bytes and time at the target (b 1, t 65536, h_q 64, h_kv 4, d 128, block 64, 16 blocks, window 512)
are in benchmarks/NOTES.md ("nsa"): the selected branch reads 16 blocks of 64 keys of K and V per
(token, kv head), 137 GB from L2 when selections do not repeat between neighbouring tokens (random
inputs), and is bound by that; the grid runs tokens fastest within a kv head so that the K/V of one
kv head (32 MiB) is what the L2 holds.

Offsets: batch, token and block bases are int64 (a [b, t, h, d] tensor can pass 2^31 elements);
offsets inside a tile stay int32, and so do the selected branch's key rows when the launcher proves
they fit (`rows_fit_int32`).

Reads top-down: kernels, then the launchers (`NSAForward`, the tile rules `cmp_tokens` and `slc_heads`,
`nsa_forward_parts`). Semantics: `ops.nsa.reference` (docs/op-contracts.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.attention.forward import attention_forward
from kreg.kernels.common.constants import LN2, LOG2E
from kreg.kernels.common.tiles import cdiv, dot_block, next_pow2, rows_fit_int32


# ----------------------------------------------------------------------------- Triton kernels
@triton.jit
def _nsa_compress_kernel(
        K, V, KC, VC,
        block_size, inv_block_size,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_cb, stride_cc, stride_ch,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: compressed block program_id(0) of kv head program_id(1) of sequence
    program_id(2). Sums the block's block_size keys and values BLOCK_N rows at a time in fp32 and stores
    their means to KC and VC (laid out alike) in KC's dtype."""
    c = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    first = c.to(tl.int64) * block_size
    k_blk = K + b * stride_kb + hk * stride_kh + first * stride_kt
    v_blk = V + b * stride_vb + hk * stride_vh + first * stride_vt
    k_sum = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    v_sum = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for j0 in range(0, block_size, BLOCK_N):
        mask = ((j0 + offs_n) < block_size)[:, None] & d_ok[None, :]
        k_sum += tl.load(k_blk + offs_n[:, None] * stride_kt + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        v_sum += tl.load(v_blk + offs_n[:, None] * stride_vt + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        k_blk += BLOCK_N * stride_kt
        v_blk += BLOCK_N * stride_vt
    out = b * stride_cb + c.to(tl.int64) * stride_cc + hk * stride_ch + offs_d
    tl.store(KC + out, (tl.sum(k_sum, 0) * inv_block_size).to(KC.dtype.element_ty), mask=d_ok)
    tl.store(VC + out, (tl.sum(v_sum, 0) * inv_block_size).to(VC.dtype.element_ty), mask=d_ok)


@triton.jit
def _cmp_tiles(acc, l_i, m_i, q, kc_base, vc_base, stride_cc, start, end, seen, qk_scale,
               MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Fold compressed blocks [start, end) into the rows' online-softmax state (log2 units). MASKED:
    block c is allowed for a row only where c < seen (the row's visible count); unmasked tiles are
    visible to every row."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tile = offs_n[:, None] * stride_cc + offs_d[None, :]
    d_ok = offs_d[None, :] < HEAD_DIM
    kc_blk = kc_base + tl.cast(start, tl.int64) * stride_cc
    vc_blk = vc_base + tl.cast(start, tl.int64) * stride_cc
    for c0 in range(start, end, BLOCK_N):
        cols = c0 + offs_n
        if MASKED:
            mask = (cols[:, None] < end) & d_ok
        else:
            mask = d_ok
        kc = tl.load(kc_blk + tile, mask=mask, other=0.0)
        vc = tl.load(vc_blk + tile, mask=mask, other=0.0)
        s = tl.dot(q, tl.trans(kc)) * qk_scale
        if MASKED:
            s = tl.where(cols[None, :] < seen[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row that sees no block keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc)
        m_i = m_new
        kc_blk += BLOCK_N * stride_cc
        vc_blk += BLOCK_N * stride_cc
    return acc, l_i, m_i


@triton.jit
def _nsa_cmp_kernel(
        Q, KC, VC, OCMP, LSE, IDX,
        t, group, block_size, block_count, qk_scale,
        stride_qb, stride_qt, stride_qh,
        stride_cb, stride_cc, stride_ch,
        stride_ob, stride_ot, stride_oh,
        stride_lb, stride_lh,
        stride_ib, stride_it, stride_ih,
        SELECT: tl.constexpr, STORE_LSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: BLOCK_T consecutive tokens of one kv head of one sequence (grid: token tiles, the
    last first; h_kv; batch), all `group` query heads of the kv head at once: row r is token
    r // BLOCK_G, head r % BLOCK_G of the group.

    Writes o_cmp (OCMP, 0 for a row that sees no compressed block) and, with STORE_LSE, its natural
    lse (LSE [b, h_q, t], +inf for such a row). With SELECT, a second pass over the same compressed
    tiles writes each token's block_count selected blocks to IDX [b, t, h_kv, block_count] (module
    docstring: own block first, -1 where fewer candidates exist)."""
    tile_id = tl.num_programs(0) - 1 - tl.program_id(0)  # the last tiles see the most blocks: first
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_G
    i0 = tile_id * BLOCK_T
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = i0 + offs_r // BLOCK_G
    member = offs_r % BLOCK_G
    row_ok = (tok < t) & (member < group)
    head = (hk * group + member).to(tl.int64)
    tile_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_ptrs = Q + b * stride_qb + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=tile_ok, other=0.0)

    # Query i sees blocks c < (i + 1) // block_size; every row of the tile sees those of its first token.
    last = tl.minimum(i0 + BLOCK_T, t) - 1
    hi = (last + 1) // block_size
    mid = (i0 + 1) // block_size // BLOCK_N * BLOCK_N
    seen = (tok + 1) // block_size
    kc_base = KC + b * stride_cb + hk.to(tl.int64) * stride_ch
    vc_base = VC + b * stride_cb + hk.to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _cmp_tiles(acc, l_i, m_i, q, kc_base, vc_base, stride_cc, 0, mid, seen, qk_scale,
                               False, HEAD_DIM, BLOCK_D, BLOCK_N)
    acc, l_i, m_i = _cmp_tiles(acc, l_i, m_i, q, kc_base, vc_base, stride_cc, mid, hi, seen, qk_scale,
                               True, HEAD_DIM, BLOCK_D, BLOCK_N)

    empty = l_i == 0.0
    out = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    o_ptrs = OCMP + b * stride_ob + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(OCMP.dtype.element_ty), mask=tile_ok)
    lse2 = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    if STORE_LSE:
        tl.store(LSE + b * stride_lb + head * stride_lh + tok, lse2 * LN2, mask=row_ok)

    if SELECT:
        offs_t = tl.arange(0, BLOCK_T)
        tok_t = i0 + offs_t
        own = tok_t // block_size
        slots = tl.arange(0, BLOCK_S)
        cols = tl.arange(0, BLOCK_N)
        # Importances travel as int32 keys: the bits of an fp32 sum of probabilities (>= 0, so its bits
        # order as the values do) with the low bits replaced by a position, so one max gives a row's best
        # candidate and its column, and one min its weakest kept slot and where it sits (a short chain
        # of reductions per round: the merge is latency-bound). Values closer than 2^-17 relative count
        # as ties (2^-16 and so on when block_count > BLOCK_N > 64).
        LOW: tl.constexpr = BLOCK_N if BLOCK_N >= BLOCK_S else BLOCK_S
        # Slot 0: the own block (the largest key: never the weakest); 1 .. block_count - 1: empty (a
        # value part of -LOW, below every candidate's); padding slots: the largest key, never written.
        keys = tl.where((slots == 0) | (slots >= block_count), 2147483647, slots - LOW)
        keys = tl.zeros([BLOCK_T, BLOCK_S], tl.int32) + keys[None, :]
        ids = tl.where(slots[None, :] == 0, own[:, None], -1)
        weakest = tl.min(keys, 1)
        # Token i's candidates are the blocks below its own one, all of them visible to it.
        hi_sel = tl.where(block_count > 1, last // block_size, 0)
        row_lse = tl.where(row_ok, lse2, float("inf"))[:, None]
        # This loop holds a loop, which Triton does not software-pipeline: the next tile's keys are
        # loaded by hand before this tile's merge, whose work hides their latency.
        kc_tile = cols[:, None] * stride_cc + offs_d[None, :]
        d_ok = offs_d[None, :] < HEAD_DIM
        kc_blk = kc_base
        kc = tl.load(kc_blk + kc_tile, mask=(cols[:, None] < hi_sel) & d_ok, other=0.0)
        for c0 in range(0, hi_sel, BLOCK_N):
            p = tl.math.exp2(tl.dot(q, tl.trans(kc)) * qk_scale - row_lse)
            kc_blk += BLOCK_N * stride_cc
            kc = tl.load(kc_blk + kc_tile, mask=((c0 + BLOCK_N + cols)[:, None] < hi_sel) & d_ok, other=0.0)
            importance = tl.sum(tl.reshape(p, [BLOCK_T, BLOCK_G, BLOCK_N]), 1)
            # NaN importance (a NaN query) never enters: only values >= 0 are candidates; -1 is none.
            is_cand = ((c0 + cols)[None, :] < own[:, None]) & (tok_t < t)[:, None] & (importance >= 0.0)
            cand = tl.where(is_cand, (importance.to(tl.int32, bitcast=True) & -LOW) | (LOW - 1 - cols[None, :]), -1)
            beats = tl.sum(((cand & -LOW) > (weakest & -LOW)[:, None]).to(tl.int32), 1)
            rounds = tl.max(tl.minimum(beats, block_count - 1), 0)
            for _ in range(rounds):
                best = tl.max(cand, 1)
                hit = (slots[None, :] == (weakest & (LOW - 1))[:, None]) & ((best & -LOW) > (weakest & -LOW))[:, None]
                keys = tl.where(hit, (best & -LOW)[:, None] | slots[None, :], keys)
                ids = tl.where(hit, (c0 + LOW - 1 - (best & (LOW - 1)))[:, None], ids)
                cand = tl.where(cand == best[:, None], -1, cand)
                weakest = tl.min(keys, 1)
        i_ptrs = IDX + b * stride_ib + tok_t.to(tl.int64)[:, None] * stride_it + hk * stride_ih + slots[None, :]
        tl.store(i_ptrs, ids, mask=(tok_t < t)[:, None] & (slots < block_count)[None, :])


@triton.jit
def _nsa_slc_kernel(
        Q, K, V, IDX, OCMP, OSWA, GCMP, GSLC, GSWA, OUT, OSLC, LSE,
        t, group, block_size, block_count, n_sub, qk_scale,
        stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_ib, stride_it, stride_ih,
        stride_ob, stride_ot, stride_oh,
        stride_gcb, stride_gct, stride_gsb, stride_gst, stride_gwb, stride_gwt,
        stride_lb, stride_lh,
        STORE_PARTS: tl.constexpr, ROWS_I32: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: token program_id(0) of kv head program_id(1) of sequence program_id(2), the `group`
    query heads of the kv head as rows (padded to BLOCK_H).

    Online softmax over the keys of the token's selected blocks (IDX [b, t, h_kv, block_count]; ids
    outside 0 .. i // block_size read nothing, duplicates are attended again), causal within the own
    block. A step covers BLOCK_N keys: BLOCK_N // BLOCK_B blocks of BLOCK_B lanes each (BLOCK_B =
    min(BLOCK_N, next_pow2(block_size))), or one piece of a block longer than BLOCK_N (n_sub pieces).
    Epilogue: out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa in fp32 from OCMP, OSWA and the
    gates, to OUT (OCMP, OSWA, OUT and OSLC share one layout); with STORE_PARTS also o_slc (OSLC, 0 for
    a token with no valid id) and its natural lse (LSE [b, h_q, t], +inf then). Key row offsets are
    int32 when the launcher proved they fit (ROWS_I32)."""
    i = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    i64 = i.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    head_ok = offs_h < group
    head = (hk * group + offs_h).to(tl.int64)
    d_ok = offs_d[None, :] < HEAD_DIM
    tile_ok = head_ok[:, None] & d_ok
    q = tl.load(Q + b * stride_qb + i64 * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=tile_ok,
                other=0.0)
    k_base = K + b * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b * stride_vb + hk.to(tl.int64) * stride_vh
    # The ids are read once, before the loop: a key address that depends on a load inside the loop
    # costs the pipeliner two of its stages (sm_90 compiles: one K/V buffer at num_stages 4).
    slots = tl.arange(0, BLOCK_S)
    ids = tl.load(IDX + b * stride_ib + i64 * stride_it + hk.to(tl.int64) * stride_ih + slots,
                  mask=slots < block_count, other=-1)
    own = i // block_size
    lane_slot = offs_n // BLOCK_B
    lane_key = offs_n % BLOCK_B
    PER_STEP: tl.constexpr = BLOCK_N // BLOCK_B

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for step in range(0, (block_count + PER_STEP - 1) // PER_STEP * n_sub):
        group_step = step // n_sub
        slot = group_step * PER_STEP + lane_slot
        within = (step - group_step * n_sub) * BLOCK_B + lane_key
        # Each lane's id (-1, invalid, for a slot past block_count; a negative id stays negative).
        blk = tl.max(tl.where(slot[:, None] == slots[None, :], ids[None, :], -1), 1)
        valid = (blk >= 0) & (blk <= own)
        # An invalid id reads nothing: block 0 stands in for the address and its lanes are masked.
        keys = tl.where(valid, blk, 0) * block_size + within
        allowed = valid & (within < block_size) & (keys <= i)
        if not ROWS_I32:
            keys = keys.to(tl.int64)
        mask = allowed[:, None] & d_ok
        k = tl.load(k_base + keys[:, None] * stride_kt + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :], mask=mask, other=0.0)
        s = tl.where(allowed[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    empty = l_i == 0.0
    o_slc = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    rows = b * stride_ob + i64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    o_cmp = tl.load(OCMP + rows, mask=tile_ok, other=0.0).to(tl.float32)
    o_swa = tl.load(OSWA + rows, mask=tile_ok, other=0.0).to(tl.float32)
    g_cmp = tl.load(GCMP + b * stride_gcb + i64 * stride_gct + head, mask=head_ok, other=0.0).to(tl.float32)
    g_slc = tl.load(GSLC + b * stride_gsb + i64 * stride_gst + head, mask=head_ok, other=0.0).to(tl.float32)
    g_swa = tl.load(GSWA + b * stride_gwb + i64 * stride_gwt + head, mask=head_ok, other=0.0).to(tl.float32)
    out = g_cmp[:, None] * o_cmp + g_slc[:, None] * o_slc + g_swa[:, None] * o_swa
    tl.store(OUT + rows, out.to(OUT.dtype.element_ty), mask=tile_ok)
    if STORE_PARTS:
        tl.store(OSLC + rows, o_slc.to(OSLC.dtype.element_ty), mask=tile_ok)
        lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
        tl.store(LSE + b * stride_lb + head * stride_lh + i, lse, mask=head_ok)


# ----------------------------------------------------------------------------- launchers
class NSAForward(NamedTuple):
    """The forward's result and its parts, for a backward: out [b, t, h_q, d] = g_cmp * o_cmp + g_slc *
    o_slc + g_swa * o_swa (q's dtype); each branch's ungated output [b, t, h_q, d] in q's dtype (0 for a
    row that attends to nothing) and its lse [b, h_q, t] fp32, natural log, +inf for such a row; the
    block ids the selected branch attended, int32 [b, t, h_kv, block_count] (the caller's if given,
    unchanged; else the kernel's selection: own block first, -1 fillers last)."""

    out: torch.Tensor
    o_cmp: torch.Tensor
    lse_cmp: torch.Tensor
    o_slc: torch.Tensor
    lse_slc: torch.Tensor
    o_swa: torch.Tensor
    lse_swa: torch.Tensor
    block_indices: torch.Tensor


def cmp_tokens(block_m: int, group: int) -> int:
    """Tokens per compressed-branch program: BLOCK_M rows of the group's heads (padded to a power of
    two), at least one token and at least 16 rows (tl.dot's smallest M)."""
    block_g = next_pow2(group)
    return max(block_m // block_g, cdiv(16, block_g), 1)


def slc_heads(group: int) -> int:
    """Rows of a selected-branch program: the group's heads padded to a power of two, at least 16."""
    return max(16, next_pow2(group))


def _compress(k: torch.Tensor, v: torch.Tensor, block_size: int, dtype: torch.dtype, config: LaunchConfig):
    """k_cmp, v_cmp [b, max(1, t // block_size), h_kv, d] in `dtype` (a first row that is never read
    when t < block_size: the compressed branch then visits no block)."""
    b, t, h_kv, d = k.shape
    n_cmp = t // block_size
    k_cmp = torch.empty((b, max(n_cmp, 1), h_kv, d), dtype=dtype, device=k.device)
    v_cmp = torch.empty_like(k_cmp)
    if n_cmp:
        _nsa_compress_kernel[(n_cmp, h_kv, b)](
            k, v, k_cmp, v_cmp, block_size, 1.0 / block_size,
            *k.stride()[:3], *v.stride()[:3], *k_cmp.stride()[:3],
            HEAD_DIM=d, BLOCK_D=dot_block(d), BLOCK_N=config.blocks["BLOCK_N"], **config.knobs())
    return k_cmp, v_cmp


def _window(args: dict, config: LaunchConfig, keep_lse: bool):
    """The window branch through the attention family's forward: (o_swa, lse_swa or None)."""
    window_args = {"q": args["q"], "k": args["k"], "v": args["v"], "sinks": None, "causal": True,
                   "window": args["window"], "sm_scale": args["sm_scale"], "return_lse": keep_lse,
                   "cu_seqlens_q": None, "cu_seqlens_k": None, "max_seqlen_q": None, "max_seqlen_k": None}
    return attention_forward(window_args, config, keep_lse=keep_lse)


def _run(args: dict, config: CallConfig, parts: bool) -> NSAForward:
    """Launch the four kernels; without `parts` the lse tensors and o_slc are not kept (None)."""
    q, k, v = args["q"], args["k"], args["v"]
    b, t, h_q, d = q.shape
    h_kv = k.shape[2]
    group = h_q // h_kv
    block_size, block_count = args["block_size"], args["block_count"]
    qk_scale = float(args["sm_scale"]) * LOG2E.value
    block_d = dot_block(d)
    k_cmp, v_cmp = _compress(k, v, block_size, q.dtype, config["compress"])

    blocks = args["block_indices"]
    select = blocks is None
    if select:
        blocks = torch.empty((b, t, h_kv, block_count), dtype=torch.int32, device=q.device)
    o_cmp = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse_cmp = torch.empty((b, h_q, t), dtype=torch.float32, device=q.device) if parts else None
    cmp = config["cmp"]
    block_t = cmp_tokens(cmp.blocks["BLOCK_M"], group)
    _nsa_cmp_kernel[(cdiv(t, block_t), h_kv, b)](
        q, k_cmp, v_cmp, o_cmp, lse_cmp if parts else o_cmp, blocks,
        t, group, block_size, block_count, qk_scale,
        *q.stride()[:3], *k_cmp.stride()[:3], *o_cmp.stride()[:3],
        *(lse_cmp.stride()[:2] if parts else (0, 0)), *blocks.stride()[:3],
        SELECT=select, STORE_LSE=parts, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_G=next_pow2(group), BLOCK_T=block_t,
        BLOCK_N=cmp.blocks["BLOCK_N"], BLOCK_S=next_pow2(block_count), **cmp.knobs())

    o_swa, lse_swa = _window(args, config["swa"], keep_lse=parts)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    o_slc = torch.empty(q.shape, dtype=q.dtype, device=q.device) if parts else None
    lse_slc = torch.empty((b, h_q, t), dtype=torch.float32, device=q.device) if parts else None
    slc = config["slc"]
    block_n = slc.blocks["BLOCK_N"]
    span = min(block_size, t)  # the keys a block can hold here
    block_b = min(block_n, next_pow2(span))
    gates = [args[name] for name in ("g_cmp", "g_slc", "g_swa")]
    # o_cmp, o_swa, out and o_slc share one layout (the attention family allocates o_swa like q).
    if o_swa.stride() != out.stride():
        o_swa = o_swa.contiguous()
    _nsa_slc_kernel[(t, h_kv, b)](
        q, k, v, blocks, o_cmp, o_swa, *gates, out, o_slc if parts else out, lse_slc if parts else out,
        t, group, block_size, block_count, cdiv(span, block_b), qk_scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *blocks.stride()[:3], *out.stride()[:3],
        *(s for g in gates for s in g.stride()[:2]), *(lse_slc.stride()[:2] if parts else (0, 0)),
        STORE_PARTS=parts, ROWS_I32=rows_fit_int32(k, v), HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=slc_heads(group),
        BLOCK_N=block_n, BLOCK_B=block_b, BLOCK_S=next_pow2(block_count), **slc.knobs())
    return NSAForward(out, o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa, blocks)


def nsa_forward_parts(args: dict, config: CallConfig) -> NSAForward:
    """nsa on validated arguments, keeping what a backward needs: every branch's ungated output and
    lse, and the block ids attended (`NSAForward`)."""
    return _run(args, config, parts=True)
