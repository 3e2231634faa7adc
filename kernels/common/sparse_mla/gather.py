"""What sparse_mla's head-block kernels and their launchers share: the tiles of the head and d dims,
the gather of the kv rows a query's top-k indices select (jitted), and the launch arithmetic around
them (the grid, strides, whether row offsets fit int32).

The grid has one program per query, per kv group and block of its heads, per batch row; the Gluon
kernels for Hopper use the same one (kernels/nvidia/sparse_mla_gather.py holds their own gathers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kreg.kernels.common.tiles import cdiv, dot_block


def dim_blocks(d_qk: int, d_v: int) -> tuple[int, int]:
    """(BLOCK_DV, BLOCK_DT): power-of-two tiles for the value part and the tail d_qk - d_v (0: none)."""
    tail = d_qk - d_v
    return dot_block(d_v), (dot_block(tail) if tail else 0)


def d_tiles_that_fit(d_split: int, block_dv: int) -> int:
    """At most `d_split` D tiles of a BLOCK_DV value part: as many as leave each 16 columns (tl.dot's K),
    so a config tuned for wide heads runs on narrow ones."""
    return min(d_split, max(1, block_dv // 16))


def group_head_cap(heads_per_group: int) -> int:
    """The widest useful head tile: the group's heads rounded up to a power of two (at least 16, tl.dot's M)."""
    return dot_block(heads_per_group)


# ----------------------------------------------------------------------------- gathered rows (jitted)
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


# ----------------------------------------------------------------------------- launch arithmetic
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
