"""GSA's sparse attention, dense masked tiles: the kernels both vendors share for the dense variant
(`gsa_sparse_attention_dense`) and the forward passes that launch them, for key sets that cover a large
fraction of the sequence.

Why: gathering reads 4 * t * k * h * d bytes (68.7 GB at GSA's t 4096, k 2048 and 16 heads of 128; a
key is read once by every query that selects it), whereas attending with tensor cores over every key
tile a block of queries spans costs about 2 * t^2 * h * d FLOPs, whichever keys its rows select. The
forward is three kernels:
- `build` (one program per query) sets the query's valid keys in a bitmap [b, t, cdiv(t, 32)] with
  atomic ORs; a slot whose bit is already set holds another occurrence of its key, which goes to
  `extras` [b, t, topk] (counted in `dups`); it also records the query's smallest and largest valid
  key.
- `fwd_extras` is the head-block forward (kernels.common.gsa_sparse_attention.headblock) over the
  extras with topk_length = dups (a query without repeats runs zero iterations), its out in fp32: the
  online-softmax state of the repeated slots.
- `fwd` (BLOCK_M queries of one head per program) starts from that state and runs a FlashAttention
  forward over the key tiles from the block's smallest to its largest key, its scores masked to the
  bits each row holds: every selected key counts once there and each repeat once more from the extras.
  It writes out and the lse as the head-block forward does, so the head-block backward
  (`headblock_backward`) serves this variant too.

Reads top-down: the build and dense kernels, then the launchers. Semantics:
`ops.gsa_sparse_attention.reference` (docs/op-contracts.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kreg.core.nvtx import nvtx_range
from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.gsa_sparse_attention.headblock import headblock_forward, lengths_strides
from kreg.kernels.common.tiles import cdiv, dot_block


# ----------------------------------------------------------------------------- Triton kernels
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
            t, topk, *indices.stride()[:2], *lengths_strides(topk_length), *bits.stride()[:2],
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
    out2, lse2 = headblock_forward(q, k, v, extras, sm_scale, dups, config["fwd_extras"], out_dtype=torch.float32)
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
