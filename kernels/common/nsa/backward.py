"""NSA's backward (Native Sparse Attention: compressed, selected and window branches) as Triton kernels
that both vendors share, behind one launcher, `nsa_backward`.

The forward is `out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa` (ops.nsa). Branch x sees
the cotangent dO_x = g_x * dout, so with dg_x = rowsum(dout * o_x) (the gate's gradient, fp32 per
(b, t, h_q) row) its FlashAttention-2 Delta is rowsum(dO_x * o_x) = g_x * dg_x, and

    dS = P * (dO_x . v - Delta_x) = g_x * P * (dout . v - dg_x),    dV = P^T dO_x = (g_x * P)^T dout.

So the compressed and selected kernels read dout itself and fold the gate into P per row (P' = g_x P);
no gated copy of dout is written for them. Selection is not differentiable (block ids are discrete).

Roles (one LaunchConfig each in the call's CallConfig) and what one program of each computes:

- `bwd_gate` (`_nsa_bwd_gate_kernel`): BLOCK_M rows (token, head) of one batch entry: dg of the three
  gates (fp32) and dO_swa = g_swa * dout in q's dtype, which the window branch needs as a tensor.
- `bwd_swa_pre`, `bwd_swa_dkv`, `bwd_swa_dq`: the window branch is causal attention with a window, so
  it runs kernels/common/attention/backward.py's `attention_backward` on (o_swa, lse_swa, dO_swa),
  its roles `bwd_pre`, `bwd_dkv`, `bwd_dq` renamed. Its gradients come back in q's dtype (one
  rounding).
- `bwd_cmp_dq` (`_nsa_bwd_cmp_dq_kernel`): BLOCK_M consecutive (token, head) rows of one kv group (the
  group's heads packed as rows, as the forward does) against the compressed keys they see (block c
  is visible to token i iff (c + 1) * block_size - 1 <= i); writes dq_acc = dq_cmp + dq_swa in fp32.
- `bwd_cmp_dkv` (`_nsa_bwd_cmp_dkv_kernel`): BLOCK_N compressed keys of one kv head against the rows of
  BLOCK_T tokens (a split of the query range: the first compressed keys are seen by every token, so
  one program per key tile would leave most of the GPU idle); writes its partial dK_cmp/dV_cmp in
  fp32 to its own slot, summed later in a fixed order (no atomics).
- `bwd_slc_dq` (`_nsa_bwd_slc_dq_kernel`): one token and one kv head, the group's heads as rows
  (padded to a power of two, at least 16): walks the token's block_count slots (invalid ids masked,
  duplicates twice), BLOCK_N keys at a time, recomputes P from lse_slc and adds dS K; writes
  dq = dq_acc + dq_slc once, in q's dtype.
- `bwd_slc_dkv` (`_nsa_bwd_slc_dkv_kernel`): BLOCK_N keys of one selected block of one kv head, key
  major. The launcher sorts every valid (token, slot) pair by (batch, kv head, block) with one stable
  torch.sort on the device (`block_lists`; no host sync, a duplicate appears twice, tokens in
  ascending order); the program walks its block's list in steps of BLOCK_M rows (token, head of the
  group), gathers their Q and dout rows, recomputes P^T and dS^T and sums dK and dV in registers.
  Its epilogue adds the window's dK/dV and the compressed branch's dK_cmp/dV_cmp / block_size (tokens
  of complete blocks only; the partial sums over the query splits in a fixed order) and writes dk and
  dv once, in k's dtype. The grid is one program per (block, kv head, batch) from shapes alone; each
  reads its list bounds in the kernel, so the launch can be captured in a CUDA graph.

Compressed keys and values (the mean of each complete block) are recomputed in torch: an fp32 mean
rounded to q's dtype (what tl.dot takes), [b, t // block_size, h_kv, d], a read of K and V.

Accumulation: every gradient sums in fp32 and is converted once, except the window branch's, which
`attention_backward` returns in q's dtype. No kernel uses atomics: gradients are bitwise reproducible.
Kernels never read outside their tensors, whatever block_indices hold: an id outside
[0, token // block_size] is invalid and masked before any address is formed from it. Row offsets are
int64 (q-sized tensors reach 2^31 elements at b 4, t 64K, h_q 64, d 128).

Load balance of `bwd_slc_dkv`: a list holds every token that selected the block, so a block that all
tokens select (block 0 in trained models) gives one program t entries while the mean is
t * block_count / n_blocks. That program is bounded by t entries (~18 ms at the target below on one SM)
and starts first (low block ids come first in the grid); splitting long lists would need partial sums.

Predicted costs at the long-context target (H200, b 1, t 65536, h_q 64, h_kv 4, d 128, block 64, 16 blocks,
window 512, bf16; q-sized tensors are 1 GiB):
- bwd_gate: reads dout and three outputs, writes dO_swa: ~5.4 GB, ~1.4 ms.
- window (attention_backward): its pre reads 2 GB (~0.5 ms); dK/dV and dQ over 2.1e9 (query, key)
  pairs over all heads, 7 GEMMs of d 128 per pair (3.9 TFLOP), ~10 ms at ~400 TFLOP/s.
- bwd_cmp_dq: 2.1e9 pairs x 3 GEMMs (1.65 TFLOP) ~4-5 ms, plus dq_swa read and dq_acc write (3 GB).
- bwd_cmp_dkv: the same pairs x 4 GEMMs (2.2 TFLOP) ~5-6 ms; partial sums 64 MB.
- block_lists: a stable sort of 4.2M int32 keys, ~1 ms.
- bwd_slc_dq: 4.3e9 pairs x 3 GEMMs (3.3 TFLOP) with 16-row tiles (no wgmma); it reads 512 KB of K/V
  per (token, kv head): 137 GB from L2 (one kv head's K and V, 32 MB, fit in L2: the grid walks tokens
  fastest), ~15-20 ms, L2 bound.
- bwd_slc_dkv: 4.3e9 pairs x 4 GEMMs (4.4 TFLOP) at M = 64 keys, ~15 ms; gathers 34 GB of Q/dout
  rows from L2.
Total ~55-60 ms, against a ~90 ms budget for the backward at that shape.

Reads top-down: kernels, the lists, the launcher, the roles' kernels, interpreter configs.
Semantics: autograd of `ops.nsa.reference`.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kreg.core.records import CallConfig
from kreg.kernels.common.attention.backward import (
    _attention_bwd_dkv_kernel,
    _attention_bwd_dq_kernel,
    _attention_bwd_pre_kernel,
    attention_backward,
)
from kreg.kernels.common.attention.variant import INTERPRETER_TILES
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.tiles import cdiv, dot_block

# The window branch's roles, by the attention family's role names.
SWA_ROLES = {"bwd_swa_pre": "bwd_pre", "bwd_swa_dkv": "bwd_dkv", "bwd_swa_dq": "bwd_dq"}


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _nsa_bwd_gate_kernel(
        DOut, OCmp, OSlc, OSwa, GCmp, GSlc, GSwa, DG, DOSwa,
        t, h_q,
        stride_dob, stride_dot, stride_doh,
        stride_ocb, stride_oct, stride_och,
        stride_osb, stride_ost, stride_osh,
        stride_owb, stride_owt, stride_owh,
        stride_gcb, stride_gct,
        stride_gsb, stride_gst,
        stride_gwb, stride_gwt,
        stride_dgx, stride_dgb,
        stride_swb, stride_swt, stride_swh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program: BLOCK_M rows (token, head) of batch entry program_id(1), rows flattened token-major.

    Writes dg_x = rowsum(dout * o_x) for the three branches to DG [3, b, t * h_q] (fp32) and
    dO_swa = g_swa * dout to DOSwa in its element type. Gates have a unit head stride.
    """
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < t * h_q
    tile_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    token = (rows // h_q).to(tl.int64)
    head = (rows % h_q).to(tl.int64)
    do = tl.load(DOut + b * stride_dob + (token * stride_dot + head * stride_doh)[:, None] + offs_d[None, :],
                 mask=tile_ok, other=0.0).to(tl.float32)
    o = tl.load(OCmp + b * stride_ocb + (token * stride_oct + head * stride_och)[:, None] + offs_d[None, :],
                mask=tile_ok, other=0.0).to(tl.float32)
    tl.store(DG + b * stride_dgb + rows, tl.sum(do * o, 1), mask=row_ok)
    o = tl.load(OSlc + b * stride_osb + (token * stride_ost + head * stride_osh)[:, None] + offs_d[None, :],
                mask=tile_ok, other=0.0).to(tl.float32)
    tl.store(DG + stride_dgx + b * stride_dgb + rows, tl.sum(do * o, 1), mask=row_ok)
    o = tl.load(OSwa + b * stride_owb + (token * stride_owt + head * stride_owh)[:, None] + offs_d[None, :],
                mask=tile_ok, other=0.0).to(tl.float32)
    tl.store(DG + 2 * stride_dgx + b * stride_dgb + rows, tl.sum(do * o, 1), mask=row_ok)
    g = tl.load(GSwa + b * stride_gwb + token * stride_gwt + head, mask=row_ok, other=0.0).to(tl.float32)
    dst = DOSwa + b * stride_swb + (token * stride_swt + head * stride_swh)[:, None] + offs_d[None, :]
    tl.store(dst, (do * g[:, None]).to(DOSwa.dtype.element_ty), mask=tile_ok)


@triton.jit
def _nsa_bwd_cmp_dq_kernel(
        Q, KC, VC, DOut, Lse, G, DG, DQSwa, DQAcc,
        t, n_cmp, group, block_size, qk_scale, sm_scale,
        stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh,
        stride_dob, stride_dot, stride_doh,
        stride_lb, stride_lh, stride_lt,
        stride_gb, stride_gt,
        stride_db, stride_dt,
        stride_sb, stride_st, stride_sh,
        stride_ab, stride_at, stride_ah,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M rows of kv group program_id(1) of batch entry program_id(2); row r of the
    group is token r // group, query head kv_head * group + r % group (the last row blocks first: they
    see the most compressed keys).

    P = 2^(q . k_c * qk_scale - lse * log2(e)) over the visible compressed keys (c < (i + 1) //
    block_size), P' = g_cmp P, dS = P' (dout . v_c - dg_cmp), dQ = sm_scale * sum dS k_c. Writes
    DQAcc = dQ + DQSwa (fp32). G and DG have a unit head stride.
    """
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n_rows = t * group
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    tile_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    token = rows // group
    head = hk * group + rows % group
    tok64, head64 = token.to(tl.int64), head.to(tl.int64)
    q = tl.load(Q + b * stride_qb + (tok64 * stride_qt + head64 * stride_qh)[:, None] + offs_d[None, :],
                mask=tile_ok, other=0.0)
    do = tl.load(DOut + b * stride_dob + (tok64 * stride_dot + head64 * stride_doh)[:, None] + offs_d[None, :],
                 mask=tile_ok, other=0.0)
    lse2 = tl.load(Lse + b * stride_lb + head64 * stride_lh + tok64 * stride_lt, mask=row_ok,
                   other=float("inf")) * LOG2E
    g = tl.load(G + b * stride_gb + tok64 * stride_gt + head64, mask=row_ok, other=0.0).to(tl.float32)
    dg = tl.load(DG + b * stride_db + tok64 * stride_dt + head64, mask=row_ok, other=0.0)
    sees = (token + 1) // block_size  # compressed keys [0, sees) are visible to the row
    last_token = (tl.minimum(m0 + BLOCK_M, n_rows) - 1) // group
    hi = tl.minimum((last_token + 1) // block_size, n_cmp)
    kc_base = KC + b * stride_kb + hk.to(tl.int64) * stride_kh
    vc_base = VC + b * stride_vb + hk.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + offs_n
        kv_ok = (cols < hi)[:, None] & (offs_d[None, :] < HEAD_DIM)
        kc = tl.load(kc_base + cols.to(tl.int64)[:, None] * stride_kn + offs_d[None, :], mask=kv_ok, other=0.0)
        vc = tl.load(vc_base + cols.to(tl.int64)[:, None] * stride_vn + offs_d[None, :], mask=kv_ok, other=0.0)
        p = tl.math.exp2(tl.dot(q, tl.trans(kc)) * qk_scale - lse2[:, None])
        p = tl.where(cols[None, :] < sees[:, None], p, 0.0) * g[:, None]
        ds = p * (tl.dot(do, tl.trans(vc)) - dg[:, None])
        dq += tl.dot(ds.to(kc.dtype), kc)
    dq = dq * sm_scale + tl.load(DQSwa + b * stride_sb + (tok64 * stride_st + head64 * stride_sh)[:, None]
                                 + offs_d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    tl.store(DQAcc + b * stride_ab + (tok64 * stride_at + head64 * stride_ah)[:, None] + offs_d[None, :], dq,
             mask=tile_ok)


@triton.jit
def _nsa_bwd_cmp_dkv_kernel(
        Q, KC, VC, DOut, Lse, G, DG, DKPart, DVPart,
        t, n_cmp, h_kv, group, block_size, chunk, qk_scale, sm_scale,
        stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh,
        stride_dob, stride_dot, stride_doh,
        stride_lb, stride_lh, stride_lt,
        stride_gb, stride_gt,
        stride_db, stride_dt,
        stride_pc, stride_pb, stride_pn, stride_ph,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: compressed keys program_id(0) * BLOCK_N... of kv head program_id(2) % h_kv of batch
    entry program_id(2) // h_kv, against the rows (token, head of the group) of the tokens
    [program_id(1) * chunk, + chunk) that see any of them.

    Works transposed (keys as rows): P'^T = g_cmp 2^(k_c . q * qk_scale - lse * log2(e)) where
    visible, dV += P'^T dout, dS^T = P'^T (v_c . dout - dg_cmp), dK += sm_scale dS^T q. Writes this
    split's partial dK and dV (fp32; zeros when no row sees the keys) to slot program_id(1) of
    DKPart/DVPart [splits, b, n_cmp, h_kv, d].
    """
    split = tl.program_id(1)
    hk = (tl.program_id(2) % h_kv).to(tl.int64)
    b = (tl.program_id(2) // h_kv).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    kv_ok = (cols < n_cmp)[:, None] & (offs_d[None, :] < HEAD_DIM)
    cols64 = cols.to(tl.int64)[:, None]
    kc = tl.load(KC + b * stride_kb + hk * stride_kh + cols64 * stride_kn + offs_d[None, :], mask=kv_ok, other=0.0)
    vc = tl.load(VC + b * stride_vb + hk * stride_vh + cols64 * stride_vn + offs_d[None, :], mask=kv_ok, other=0.0)
    # The split's tokens that see compressed key n0 (the tile's first): i >= (n0 + 1) * block_size - 1.
    t0 = split * chunk
    t1 = tl.minimum(t0 + chunk, t)
    first = tl.maximum(t0, (n0 + 1) * block_size - 1)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for r0 in range(first * group, t1 * group, BLOCK_M):
        rows = r0 + offs_m
        row_ok = rows < t1 * group
        tile_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        token = rows // group
        tok64, head64 = token.to(tl.int64), (hk * group + rows % group).to(tl.int64)
        q = tl.load(Q + b * stride_qb + (tok64 * stride_qt + head64 * stride_qh)[:, None] + offs_d[None, :],
                    mask=tile_ok, other=0.0)
        do = tl.load(DOut + b * stride_dob + (tok64 * stride_dot + head64 * stride_doh)[:, None] + offs_d[None, :],
                     mask=tile_ok, other=0.0)
        lse2 = tl.load(Lse + b * stride_lb + head64 * stride_lh + tok64 * stride_lt, mask=row_ok,
                       other=float("inf")) * LOG2E
        g = tl.load(G + b * stride_gb + tok64 * stride_gt + head64, mask=row_ok, other=0.0).to(tl.float32)
        dg = tl.load(DG + b * stride_db + tok64 * stride_dt + head64, mask=row_ok, other=0.0)
        p_t = tl.math.exp2(tl.dot(kc, tl.trans(q)) * qk_scale - lse2[None, :])
        visible = row_ok[None, :] & (cols[:, None] < ((token + 1) // block_size)[None, :])
        p_t = tl.where(visible, p_t, 0.0) * g[None, :]
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = p_t * (tl.dot(vc, tl.trans(do)) - dg[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    part = split.to(tl.int64) * stride_pc + b * stride_pb + hk * stride_ph + cols64 * stride_pn + offs_d[None, :]
    tl.store(DKPart + part, dk * sm_scale, mask=kv_ok)
    tl.store(DVPart + part, dv, mask=kv_ok)


@triton.jit
def _nsa_bwd_slc_dq_kernel(
        Q, K, V, DOut, IDX, Lse, G, DG, DQAcc, DQ,
        group, block_size, block_count, n_sub, qk_scale, sm_scale,
        stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_dob, stride_dot, stride_doh,
        stride_ib, stride_it, stride_ih,
        stride_lb, stride_lh, stride_lt,
        stride_gb, stride_gt,
        stride_db, stride_dt,
        stride_ab, stride_at, stride_ah,
        stride_qgb, stride_qgt, stride_qgh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: token program_id(0) of kv head program_id(1) of batch entry program_id(2), the
    group's query heads as BLOCK_G rows (masked past `group`).

    Walks the token's block_count slots of IDX, BLOCK_N keys of a block at a time (n_sub tiles per block,
    cdiv(min(block_size, t), BLOCK_N) from the host, where it cannot wrap); a slot whose id is
    outside [0, i // block_size] is invalid (its keys masked, never addressed), a duplicate counts
    again, and keys j > i are masked (causal). P' = g_slc 2^(q . k * qk_scale - lse * log2(e)),
    dS = P' (dout . v - dg_slc), dQ += dS k. Writes DQ = sm_scale * dQ + DQAcc in DQ's element type.
    """
    i = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    row = i.to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    head_ok = offs_g < group
    tile_ok = head_ok[:, None] & d_ok[None, :]
    head64 = hk * group + offs_g
    q = tl.load(Q + b * stride_qb + row * stride_qt + head64[:, None] * stride_qh + offs_d[None, :], mask=tile_ok,
                other=0.0)
    do = tl.load(DOut + b * stride_dob + row * stride_dot + head64[:, None] * stride_doh + offs_d[None, :],
                 mask=tile_ok, other=0.0)
    lse2 = tl.load(Lse + b * stride_lb + head64 * stride_lh + row * stride_lt, mask=head_ok,
                   other=float("inf")) * LOG2E
    g = tl.load(G + b * stride_gb + row * stride_gt + head64, mask=head_ok, other=0.0).to(tl.float32)
    dg = tl.load(DG + b * stride_db + row * stride_dt + head64, mask=head_ok, other=0.0)
    own = i // block_size
    idx_row = IDX + b * stride_ib + row * stride_it + hk * stride_ih
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # One flat loop over (slot, key tile) pairs, so the loads pipeline across slots.
    for it in range(0, block_count * n_sub):
        blk = tl.load(idx_row + it // n_sub)
        valid = (blk >= 0) & (blk <= own)
        offs = (it % n_sub) * BLOCK_N + offs_n
        keys = tl.where(valid, blk, 0) * block_size + offs
        key_ok = valid & (offs < block_size) & (keys <= i)
        kv_ok = key_ok[:, None] & d_ok[None, :]
        keys64 = keys.to(tl.int64)[:, None]
        k = tl.load(k_base + keys64 * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + keys64 * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        p = tl.where(key_ok[None, :], p, 0.0) * g[:, None]
        ds = p * (tl.dot(do, tl.trans(v)) - dg[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    acc = tl.load(DQAcc + b * stride_ab + row * stride_at + head64[:, None] * stride_ah + offs_d[None, :],
                  mask=tile_ok, other=0.0)
    tl.store(DQ + b * stride_qgb + row * stride_qgt + head64[:, None] * stride_qgh + offs_d[None, :],
             (dq * sm_scale + acc).to(DQ.dtype.element_ty), mask=tile_ok)


@triton.jit
def _nsa_bwd_slc_dkv_kernel(
        Q, K, V, DOut, Lse, G, DG, Offsets, Tokens, DKSwa, DVSwa, DKPart, DVPart, DK, DV,
        t, n_blocks, n_cmp, n_splits, group, block_size, n_sub, qk_scale, sm_scale, cmp_scale,
        stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_dob, stride_dot, stride_doh,
        stride_lb, stride_lh, stride_lt,
        stride_gb, stride_gt,
        stride_db, stride_dt,
        stride_swb, stride_swt, stride_swh,
        stride_pc, stride_pb, stride_pn, stride_ph,
        stride_gkb, stride_gkt, stride_gkh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_N keys (tile program_id(0) % n_sub) of block program_id(0) // n_sub of kv head
    program_id(1) of batch entry program_id(2); n_sub = cdiv(min(block_size, t), BLOCK_N), from the host.

    Walks the block's list (Tokens[Offsets[l]:Offsets[l + 1]], l = (b * h_kv + kv head) * n_blocks +
    block: the tokens whose valid slots hold the block, once per slot) as rows (entry, head of the
    group), BLOCK_M rows at a time: gathers their q and dout rows, lse, g_slc and dg_slc; transposed,
    P'^T = g_slc 2^(k . q * qk_scale - lse * log2(e)) for keys j <= token, dV += P'^T dout,
    dS^T = P'^T (v . dout - dg_slc), dK += dS^T q. Writes, in DK/DV's element type,
    dK = sm_scale dK + DKSwa (+ cmp_scale * the sum over the splits of DKPart for a complete block),
    and dV likewise. DKSwa/DVSwa and DK/DV share strides.
    """
    blk = tl.program_id(0) // n_sub
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs = (tl.program_id(0) % n_sub) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    d_ok = offs_d < HEAD_DIM
    keys = blk * block_size + offs
    key_ok = (offs < block_size) & (keys < t)
    kv_ok = key_ok[:, None] & d_ok[None, :]
    keys64 = keys.to(tl.int64)[:, None]
    hk64 = hk.to(tl.int64)
    k = tl.load(K + b * stride_kb + hk64 * stride_kh + keys64 * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V + b * stride_vb + hk64 * stride_vh + keys64 * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
    lst = (tl.program_id(2) * tl.num_programs(1) + hk) * n_blocks + blk
    first = tl.load(Offsets + lst)
    last = tl.load(Offsets + lst + 1)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Rows counted from the list's start fit in int32 (a list holds at most t * block_count entries).
    n_rows = ((last - first) * group).to(tl.int32)
    for r0 in range(0, n_rows, BLOCK_M):
        rows = r0 + offs_m
        row_ok = rows < n_rows
        tile_ok = row_ok[:, None] & d_ok[None, :]
        # Listed tokens are in [0, t) by construction (positions of block_indices' rows).
        token = tl.load(Tokens + first + rows // group, mask=row_ok, other=0)
        tok64, head64 = token.to(tl.int64), hk64 * group + rows % group
        q = tl.load(Q + b * stride_qb + (tok64 * stride_qt + head64 * stride_qh)[:, None] + offs_d[None, :],
                    mask=tile_ok, other=0.0)
        do = tl.load(DOut + b * stride_dob + (tok64 * stride_dot + head64 * stride_doh)[:, None] + offs_d[None, :],
                     mask=tile_ok, other=0.0)
        lse2 = tl.load(Lse + b * stride_lb + head64 * stride_lh + tok64 * stride_lt, mask=row_ok,
                       other=float("inf")) * LOG2E
        g = tl.load(G + b * stride_gb + tok64 * stride_gt + head64, mask=row_ok, other=0.0).to(tl.float32)
        dg = tl.load(DG + b * stride_db + tok64 * stride_dt + head64, mask=row_ok, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        allowed = key_ok[:, None] & row_ok[None, :] & (keys[:, None] <= token[None, :])
        p_t = tl.where(allowed, p_t, 0.0) * g[None, :]
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - dg[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    # The compressed branch: a complete block's dK_cmp / block_size reaches each of its tokens.
    cmp_k = tl.zeros([BLOCK_D], dtype=tl.float32)
    cmp_v = tl.zeros([BLOCK_D], dtype=tl.float32)
    part = b * stride_pb + blk.to(tl.int64) * stride_pn + hk64 * stride_ph + offs_d
    part_ok = d_ok & (blk < n_cmp)
    for split in range(0, n_splits):
        cmp_k += tl.load(DKPart + split * stride_pc + part, mask=part_ok, other=0.0)
        cmp_v += tl.load(DVPart + split * stride_pc + part, mask=part_ok, other=0.0)
    grad = b * stride_gkb + hk64 * stride_gkh + keys64 * stride_gkt + offs_d[None, :]
    dk = dk * sm_scale + cmp_k[None, :] * cmp_scale
    dk += tl.load(DKSwa + grad, mask=kv_ok, other=0.0).to(tl.float32)
    dv = dv + cmp_v[None, :] * cmp_scale
    dv += tl.load(DVSwa + grad, mask=kv_ok, other=0.0).to(tl.float32)
    tl.store(DK + grad, dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + grad, dv.to(DV.dtype.element_ty), mask=kv_ok)


# ----------------------------------------------------------------------------- launcher
def block_lists(block_indices: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, kv head, block), the tokens whose valid slots hold the block, for `bwd_slc_dkv`:
    (offsets [b * h_kv * n_blocks + 1] int, tokens int32), list l = (b * h_kv + kv head) * n_blocks +
    block in tokens[offsets[l]:offsets[l + 1]], tokens ascending, once per slot (duplicates twice).
    An id is valid in [0, token // block_size]. One stable sort and a search on the device: no host
    sync."""
    b, t, h_kv, count = block_indices.shape
    n_lists = b * h_kv * cdiv(t, block_size)
    device = block_indices.device
    kind = torch.int32 if n_lists < 2**31 - 1 else torch.int64
    own = (torch.arange(t, device=device, dtype=torch.int32) // block_size)[None, :, None, None]
    valid = (block_indices >= 0) & (block_indices <= own)
    heads = torch.arange(b * h_kv, device=device, dtype=kind).view(b, 1, h_kv, 1) * cdiv(t, block_size)
    # Invalid slots sort after every list (key n_lists).
    keys = torch.where(valid, block_indices.to(kind) + heads, n_lists).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)
    tokens = (order // (h_kv * count) % t).to(torch.int32)
    offsets = torch.searchsorted(sorted_keys, torch.arange(n_lists + 1, device=device, dtype=kind))
    return offsets, tokens


def compressed_kv(k: torch.Tensor, v: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed keys and values: the fp32 mean of each complete block of block_size tokens, in the
    input dtype: [b, t, h_kv, d] -> [b, t // block_size, h_kv, d]."""
    n = k.shape[1] // block_size

    def pool(x: torch.Tensor) -> torch.Tensor:
        return x[:, : n * block_size].unflatten(1, (n, block_size)).mean(2, dtype=torch.float32).to(x.dtype)

    return pool(k), pool(v)


def _s3(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _swa_args(window: int, sm_scale: float) -> dict:
    """attention_backward's non-tensor arguments for the window branch: causal, padded, no sinks."""
    return {"cu_seqlens_q": None, "cu_seqlens_k": None, "max_seqlen_q": None, "max_seqlen_k": None,
            "causal": True, "window": window, "sm_scale": sm_scale}


@lru_cache(maxsize=64)
def swa_config(config: CallConfig) -> CallConfig:
    """The attention family's CallConfig (roles bwd_pre/bwd_dkv/bwd_dq) from the bwd_swa_* roles."""
    return CallConfig({name: config[role] for role, name in SWA_ROLES.items()})


def nsa_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_cmp: torch.Tensor, g_slc: torch.Tensor,
                 g_swa: torch.Tensor, dout: torch.Tensor, *, block_size: int, window: int, sm_scale: float,
                 block_indices: torch.Tensor, o_cmp: torch.Tensor, lse_cmp: torch.Tensor, o_slc: torch.Tensor,
                 lse_slc: torch.Tensor, o_swa: torch.Tensor, lse_swa: torch.Tensor, config: CallConfig,
                 ) -> tuple[torch.Tensor, ...]:
    """NSA's gradients (dq, dk, dv, dg_cmp, dg_slc, dg_swa), each in its input's dtype.

    Inputs as ops.nsa validates them; dout like q (any strides). Saved from the forward:
    block_indices int32 [b, t, h_kv, block_count] (the selection used, caller's ids included: invalid
    ones are masked, duplicates count), the ungated branch outputs o_x [b, t, h_q, d] in q's dtype (0 for
    a row with no key) and lse_x [b, h_q, t] fp32, natural log (+inf for such a row). `config` holds
    one LaunchConfig per role: bwd_gate, bwd_swa_pre, bwd_swa_dkv, bwd_swa_dq, bwd_cmp_dq, bwd_cmp_dkv
    (its BLOCK_T: tokens per split of the query range), bwd_slc_dq, bwd_slc_dkv. Grids come from
    shapes only (no host sync); no atomics, so the gradients are bitwise reproducible.
    """
    b, t, h_q, d = q.shape
    h_kv = k.shape[2]
    group = h_q // h_kv
    n_cmp, n_blocks = t // block_size, cdiv(t, block_size)
    f32 = {"device": q.device, "dtype": torch.float32}
    block_d = dot_block(d)
    qk_scale = float(sm_scale) * LOG2E.value
    dims = {"HEAD_DIM": d, "BLOCK_D": block_d}
    # Kernels read dout with a unit last stride; any other strides are passed on.
    dout = dout.to(q.dtype)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()

    # Gates: dg_x = rowsum(dout * o_x) for the three branches, and the window branch's cotangent.
    dg = torch.empty((3, b, t, h_q), **f32)
    do_swa = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    gate = config["bwd_gate"]
    _nsa_bwd_gate_kernel[(cdiv(t * h_q, gate.blocks["BLOCK_M"]), b)](
        dout, o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, dg, do_swa, t, h_q,
        *_s3(dout), *_s3(o_cmp), *_s3(o_slc), *_s3(o_swa),
        *g_cmp.stride()[:2], *g_slc.stride()[:2], *g_swa.stride()[:2], dg.stride(0), dg.stride(1), *_s3(do_swa),
        **dims, BLOCK_M=gate.blocks["BLOCK_M"], **gate.knobs())

    # Window: the attention family's backward. It indexes its Delta and Lse2 buffers (empty_like(lse),
    # dense) with lse's strides, so lse must be dense.
    lse_swa = lse_swa.contiguous()
    dq_swa, dk_swa, dv_swa, _ = attention_backward(q, k, v, None, o_swa, lse_swa, do_swa, _swa_args(window, sm_scale),
                                                   swa_config(config))

    # Compressed: dq_acc = dq_cmp + dq_swa in fp32; dK_cmp/dV_cmp as partial sums per query split.
    k_cmp, v_cmp = compressed_kv(k, v, block_size) if n_cmp else (k, v)  # k, v: unread placeholders
    dq_acc = torch.empty(q.shape, **f32)
    cmp_dq = config["bwd_cmp_dq"]
    common = (*_s3(q), *_s3(k_cmp), *_s3(v_cmp), *_s3(dout), *lse_cmp.stride(), *g_cmp.stride()[:2],
              dg.stride(1), dg.stride(2))
    _nsa_bwd_cmp_dq_kernel[(cdiv(t * group, cmp_dq.blocks["BLOCK_M"]), h_kv, b)](
        q, k_cmp, v_cmp, dout, lse_cmp, g_cmp, dg[0], dq_swa, dq_acc,
        t, n_cmp, group, block_size, qk_scale, float(sm_scale), *common, *_s3(dq_swa), *_s3(dq_acc),
        **dims, BLOCK_M=cmp_dq.blocks["BLOCK_M"], BLOCK_N=cmp_dq.blocks["BLOCK_N"], **cmp_dq.knobs())
    cmp_dkv = config["bwd_cmp_dkv"]
    chunk = cmp_dkv.blocks["BLOCK_T"]
    n_splits = cdiv(t, chunk) if n_cmp else 0
    parts = torch.empty((2, max(n_splits, 1), b, max(n_cmp, 1), h_kv, d), **f32)
    if n_cmp:
        _nsa_bwd_cmp_dkv_kernel[(cdiv(n_cmp, cmp_dkv.blocks["BLOCK_N"]), n_splits, b * h_kv)](
            q, k_cmp, v_cmp, dout, lse_cmp, g_cmp, dg[0], parts[0], parts[1],
            t, n_cmp, h_kv, group, block_size, chunk, qk_scale, float(sm_scale), *common, *parts.stride()[1:5],
            **dims, BLOCK_M=cmp_dkv.blocks["BLOCK_M"], BLOCK_N=cmp_dkv.blocks["BLOCK_N"], **cmp_dkv.knobs())

    # Selected: dq = dq_acc + dq_slc; dk/dv from the block lists, plus the window's and compressed ones.
    common = (*_s3(q), *_s3(k), *_s3(v), *_s3(dout))
    slc_common = (*lse_slc.stride(), *g_slc.stride()[:2], dg.stride(1), dg.stride(2))
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    slc_dq = config["bwd_slc_dq"]
    # Key tiles per block: a block holds at most t keys here (a block_size near 2**31 must not wrap).
    span = min(block_size, t)
    _nsa_bwd_slc_dq_kernel[(t, h_kv, b)](
        q, k, v, dout, block_indices, lse_slc, g_slc, dg[1], dq_acc, dq,
        group, block_size, block_indices.shape[3], cdiv(span, slc_dq.blocks["BLOCK_N"]), qk_scale, float(sm_scale),
        *common, *_s3(block_indices), *slc_common, *_s3(dq_acc), *_s3(dq),
        **dims, BLOCK_G=dot_block(group), BLOCK_N=slc_dq.blocks["BLOCK_N"], **slc_dq.knobs())
    offsets, tokens = block_lists(block_indices, block_size)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    slc_dkv = config["bwd_slc_dkv"]
    block_n = slc_dkv.blocks["BLOCK_N"]
    _nsa_bwd_slc_dkv_kernel[(n_blocks * cdiv(span, block_n), h_kv, b)](
        q, k, v, dout, lse_slc, g_slc, dg[1], offsets, tokens, dk_swa, dv_swa, parts[0], parts[1], dk, dv,
        t, n_blocks, n_cmp, n_splits, group, block_size, cdiv(span, block_n), qk_scale, float(sm_scale),
        1.0 / block_size,
        *common, *slc_common, *_s3(dk_swa), *parts.stride()[1:5], *_s3(dk),
        **dims, BLOCK_M=slc_dkv.blocks["BLOCK_M"], BLOCK_N=block_n, **slc_dkv.knobs())
    return dq, dk, dv, dg[0].to(g_cmp.dtype), dg[1].to(g_slc.dtype), dg[2].to(g_swa.dtype)


# ----------------------------------------------------------------------------- roles
ROLE_KERNELS = {"bwd_gate": _nsa_bwd_gate_kernel, "bwd_cmp_dq": _nsa_bwd_cmp_dq_kernel,
                "bwd_cmp_dkv": _nsa_bwd_cmp_dkv_kernel, "bwd_slc_dq": _nsa_bwd_slc_dq_kernel,
                "bwd_slc_dkv": _nsa_bwd_slc_dkv_kernel}
# Every role's kernel, the window's included: a variant's `kernels` (its source hash, its roles).
KERNELS = {**ROLE_KERNELS, "bwd_swa_pre": _attention_bwd_pre_kernel, "bwd_swa_dkv": _attention_bwd_dkv_kernel,
           "bwd_swa_dq": _attention_bwd_dq_kernel}
ROLES = tuple(KERNELS)


# ----------------------------------------------------------------------------- interpreter configs
# The interpreter's block shapes per role, the default first (both vendors): 16-row tiles keep the
# interpreted runs short; the second shapes take key tiles wider than small blocks and longer row
# steps. The window roles take the attention family's.
INTERPRETER: Mapping[str, tuple[dict[str, int], ...]] = {
    "bwd_gate": ({"BLOCK_M": 16}, {"BLOCK_M": 32}),
    "bwd_cmp_dq": ({"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 32, "BLOCK_N": 16}),
    "bwd_cmp_dkv": ({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_T": 16}, {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_T": 64}),
    "bwd_slc_dq": ({"BLOCK_N": 16}, {"BLOCK_N": 32}),
    "bwd_slc_dkv": ({"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 32, "BLOCK_N": 32}),
    **{role: INTERPRETER_TILES[name] for role, name in SWA_ROLES.items()},
}
