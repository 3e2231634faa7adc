"""sparse_mla's head-block forward: the Triton kernel both vendors' `sparse_mla_headblock` variants
launch, `forward_launch` (the outputs, grid and arguments every sparse_mla forward kernel takes, the
Gluon one for Hopper too) and `_forward`, the head-block kernel's launcher.

The idea that matters: every head of a kv group reads the same gathered latent row per selected index.
One program owns BLOCK_H heads of one query (of one group), gathers each BLOCK_TOPK tile of indexed
rows once and reuses it for all of them, both as keys (all d_qk dims: the d_v "value" part plus the
rope tail) and as values (the first d_v dims). Q is loaded once, outside the top-k loop. A program with
too few heads re-gathers the same rows many times; the config spaces therefore offer BLOCK_H up to 128.

Semantics: `ops.sparse_mla.reference` (docs/op-contracts.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from kreg.core.records import LaunchConfig
from kreg.kernels.common.constants import LN2, LOG2E
from kreg.kernels.common.launch import triton_launch
from kreg.kernels.common.sparse_mla.gather import (
    _gather_rows,
    _grid,
    _row_offsets,
    _rows_fit_int32,
    _strides,
    dim_blocks,
)

# Kernels can only read globals that are constexprs.


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


# ----------------------------------------------------------------------------- launchers
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


def _forward(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, config: LaunchConfig,
             launch: Callable[..., Any] = triton_launch):
    """Run the forward kernel on batched-layout tensors; returns (out, max_logits, lse). `launch` runs
    the kernel: Triton's own launch, or a dispatch plan's `LaunchCache`."""
    blocks = config.blocks
    block_dv, block_dt = dim_blocks(q.shape[-1], d_v)
    outputs, grid, args, constexprs = forward_launch(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                                     blocks["BLOCK_H"])
    launch(
        _sparse_mla_fwd_kernel, grid, *args, **constexprs, BLOCK_DV=block_dv, BLOCK_DT=block_dt,
        BLOCK_H=blocks["BLOCK_H"], BLOCK_TOPK=blocks["BLOCK_TOPK"], ROWS_I32=_rows_fit_int32(kv),
        D_SPLIT=blocks["D_SPLIT"], **config.knobs(),
    )
    return outputs
