"""GSA's sparse attention, head block: the gather kernels both vendors share and their launchers. Every
head of a query attends to the query's own top-k keys; these kernels read those keys' rows one slot
tile at a time. Both variants run them: the head-block variant (`gsa_sparse_attention_headblock`) for
its forward and backward, the dense variant (kernels.common.gsa_sparse_attention.dense) for the extra
occurrences of repeated keys and for its backward, which is this one.

The idea comes from sparse MLA's head-block kernel (kernels.common.sparse_mla), reversed for GSA's
shapes. There, one gathered latent row serves every head of a kv group. Here each head has K and V rows
of its own (h_kv = h_q = 16 in the default layer), yet all heads of a query share one index list and a
key's rows of all kv heads lie side by side ([h_kv, d] contiguous). A program therefore owns BLOCK_H
heads of one query and gathers, per slot, the rows of all of them together: a [BLOCK_TOPK, BLOCK_H, d]
tile read as contiguous runs of BLOCK_H * d elements (the GQA heads of a group read one row, from L1).
A head has one query row, so its scores are a matrix-vector product with nothing for tensor cores:
scores and the value sum are fp32 FMAs and reductions in registers, and the kernels are bound by the
bytes they gather, which neighbouring queries mostly find in L2.

Forward (`fwd`): an online softmax over the query's slots, BLOCK_TOPK at a time, in log2 units; it
writes out and the lse (log2 units; +inf for a row without a valid slot, whose out is 0) that the
backward reads.

Backward, two passes without atomics, so gradients are the same bits on every run:
- dq (`bwd_dq`, laid out as the forward): recomputes P per tile, dP = dO . V, dS = P (dP - Delta) with
  Delta = rowsum(dO * O), and accumulates dQ = sum dS K; it stores Delta for the next pass.
- dkv (`bwd_dkv`, key-major): the launcher sorts every valid (query, slot) by its key (a stable
  torch.sort, no host sync) into a list of queries per key (`key_lists`); a program owns BLOCK_H heads
  of one key and walks its list BLOCK_Q queries at a time, gathering their Q and dO rows, recomputing P
  and dS and summing dK = sum dS Q and dV = sum P dO in registers; it stores once per key and head
  (fp32; the heads of a GQA group are summed afterwards). A duplicated slot is listed twice, so it
  counts twice.

Reads top-down: the kernels, then their launchers. Semantics: `ops.gsa_sparse_attention.reference`
(docs/op-contracts.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kreg.core.nvtx import nvtx_range
from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.tiles import cdiv, dot_block, rows_fit_int32


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


# ----------------------------------------------------------------------------- launchers
def lengths_strides(topk_length: torch.Tensor | None) -> tuple[int, int]:
    """topk_length's two strides, (0, 0) without it (the kernels then read no lengths)."""
    return tuple(topk_length.stride()) if topk_length is not None else (0, 0)


def headblock_forward(q, k, v, indices, sm_scale, topk_length, config: LaunchConfig,
                      out_dtype: torch.dtype | None = None):
    """Run the forward kernel: (out in `out_dtype`, q's by default; lse in log2 units [b, t, h_q] fp32)."""
    b, t, h_q, d = q.shape
    out = torch.empty_like(q, dtype=out_dtype)
    lse = torch.empty((b, t, h_q), device=q.device, dtype=torch.float32)
    block_h = config.blocks["BLOCK_H"]
    with nvtx_range("gsa/sparse_attn_fwd_kernel"):
        _gsa_sparse_attn_fwd_kernel[(t, cdiv(h_q, block_h), b)](
            q, k, v, indices, topk_length, out, lse,
            t, h_q, indices.shape[2], h_q // k.shape[2], float(sm_scale) * LOG2E.value,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *indices.stride()[:2], *lengths_strides(topk_length),
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


def headblock_backward(q, k, v, indices, sm_scale, topk_length, out, lse, dout, dq_config: LaunchConfig,
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
        _gsa_sparse_attn_bwd_dq_kernel[(t, cdiv(h_q, block_h), b)](
            q, k, v, indices, topk_length, out, dout, lse, dq, delta,
            t, h_q, indices.shape[2], group, float(sm_scale),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *indices.stride()[:2], *lengths_strides(topk_length),
            *out.stride()[:3], *dout.stride()[:3], *lse.stride()[:2], *dq.stride()[:3],
            **dims, BLOCK_H=block_h, BLOCK_TOPK=dq_config.blocks["BLOCK_TOPK"],
            HAS_TOPK_LEN=topk_length is not None, **dq_config.knobs(),
        )
    with nvtx_range("gsa/sparse_attn_bwd_dkv_kernel"):
        offsets, queries = key_lists(indices, topk_length)
        dk_heads = torch.empty((b, t, h_q, d), device=q.device, dtype=torch.float32)
        dv_heads = torch.empty_like(dk_heads)
        block_h = dkv_config.blocks["BLOCK_H"]
        _gsa_sparse_attn_bwd_dkv_kernel[(t, cdiv(h_q, block_h), b)](
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
    return headblock_forward(q, k, v, indices, sm_scale, topk_length, config["fwd"])
