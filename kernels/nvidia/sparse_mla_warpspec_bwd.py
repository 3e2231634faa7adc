"""sparse_mla's fused backward pass as a warp-specialized Gluon kernel for Hopper (sm_90), the backward
of the `sparse_mla_warpspec` variant (kernels/nvidia/sparse_mla.py), after the shared pre pass
(Delta, the shift of P, the sink's terms: kernels/common/sparse_mla/backward.py).

Why: the head-block kernel's fused pass (same math, plain Triton) reaches ~178 TFLOP/s on an H200 at
the V3.2 shape: one CTA of 8 warps per SM at 255 registers runs each top-k tile as a serial chain of
products, each waited on at once, with the gathers one tile ahead and the top-k index reloaded for
the atomics (benchmarks/NOTES.md). Here the work is split three ways:

- a producer partition gathers each BWD_TOPK-slot tile of selected latent rows into a ring of
  BWD_STAGES shared-memory stages with their row indices (kernels/nvidia/sparse_mla_gather.py);
- the score warpgroup (the default partition) holds Q, computes S = Q K^T and P = exp2(S * qk_scale -
  shift), hands P to the gradient warpgroup through shared memory;
- the gradient warpgroup holds dO, computes dP = dO V^T under the score product, then
  dS = P (dP - Delta) sm_scale and hands it back (from the 16-bit P it was handed, so dS carries P's
  rounding as well as its own: relative error 2.6e-3 against the Triton pass's 2.3e-3 at the V3.2
  shape).
Then both accumulate their half of dQ += dS K in registers (the score side also the rope tail's
columns), and each computes its half of the tile's dkv rows, transposed, 64 columns a product:
dKV_c^T = [Q; dO]_c^T [dS; P] (the key role through Q and the value role through dO summed in one
K = 128 product; the rope tail's columns, Q_tail^T dS, on the gradient side), adding one chunk's rows to
the fp32 dkv with relaxed atomics while the next chunk's product runs. Other queries, the group's other
head blocks and duplicate slots add to the same rows, as in the head-block kernel.

Shared memory at the V3.2 dims (d_v 512, tail 64): [Q; dO] 128 KB and Q's tail 8 KB stay resident, two
stages of 32 gathered rows 72 KB, [dS; P] 8 KB: 216 KB of Hopper's 227.

One program owns 64 heads (wgmma's M per warpgroup) of one kv group of one query, as the forward.
Gluon kernels do not run in the Triton interpreter: CI compiles this one for sm_90
(tests/test_shipped_and_default_configs.py) and the GPU tests compare its gradients with the
reference's autograd in bf16.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kreg.core.records import LaunchConfig
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.sparse_mla.gather import _grid, _strides
from kreg.kernels.nvidia.sparse_mla_gather import (
    COLS,
    PRODUCER_REGS,
    _allocate_ring,
    _gather_blocks,
    _program_coords,
    _query_slots,
    _rows_to_shared,
)

# Kernels can only read globals that are constexprs (Python code reads `.value`).
BLOCK_H = gl.constexpr(64)  # heads per program: wgmma's M for one warpgroup
BWD_TOPK = gl.constexpr(32)  # slots per tile: the N of S, dP and each dkv chunk's product
BWD_STAGES = gl.constexpr(2)  # what fits beside [Q; dO] (two stages: the gathers stay a tile ahead)
DKV_COLS = gl.constexpr(64)  # dkv columns per product (its M, one warpgroup's) and per round of atomics


@gluon.jit
def _add_dkv_rows(acc, dkv_base, rows, col0, stride_dks, LIMIT: gl.constexpr, layout: gl.constexpr):
    """Add acc ([DKV_COLS columns, slots], fp32) to columns col0 + c (c < LIMIT) of the dkv rows the
    slots select (rows: [slots], -1 for an invalid slot, which adds nothing)."""
    offs_c = gl.arange(0, DKV_COLS, layout=gl.SliceLayout(1, layout))
    ptrs = dkv_base + rows[None, :].to(gl.int64) * stride_dks + (col0 + offs_c)[:, None]
    gl.atomic_add(ptrs, acc, mask=(rows >= 0)[None, :] & (offs_c < LIMIT)[:, None], sem="relaxed")


@gluon.jit
def _to_workspace(tile_smem, row0, tile, n_slots, first_head, heads_per_group, stride_pt):
    """Copy a [heads, slots] 16-bit tile from shared memory into the workspace rows of its slots,
    transposed, 8 heads (16 bytes) a store: few addresses per thread (one per element, as from the
    products' register layout, spills at h_q 64). row0: slot 0's column of the tile's first head."""
    layout: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    values = tile_smem.load(layout)
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    slots = tile * BWD_TOPK + gl.arange(0, BWD_TOPK, layout=gl.SliceLayout(0, layout))
    mask = ((first_head + heads) < heads_per_group)[:, None] & (slots < n_slots)[None, :]
    gl.store(row0 + heads[:, None] + slots[None, :].to(gl.int64) * stride_pt, values, mask=mask)


@gluon.constexpr_function
def _dkv_chunks(side, d_v):
    """(first, count) of the DKV_COLS-column chunks of dkv's value part that side `side` computes: the
    score side takes the first half (rounded up: all of a single chunk), the gradient side the rest."""
    chunks = d_v // DKV_COLS.value
    first = (chunks + 1) // 2
    return (0, first) if side == 0 else (first, chunks - first)


@gluon.constexpr_function
def _dkv_jobs(side, d_v, d_tail):
    """This side's dkv products per tile: its chunks, and on the gradient side the rope tail's."""
    return _dkv_chunks(side, d_v)[1] + (1 if side == 1 and d_tail > 0 else 0)


@gluon.jit
def _dkv_product(zi, wi, qt, ds_smem, zero, j: gl.constexpr, SIDE: gl.constexpr, D_V: gl.constexpr):
    """Issue this side's dkv product j: a chunk's dKV_c^T = [Q; dO]_c^T [dS; P], or the tail's Q_tail^T dS."""
    first: gl.constexpr = _dkv_chunks(SIDE, D_V)[0]
    count: gl.constexpr = _dkv_chunks(SIDE, D_V)[1]
    if j < count:
        part = warpgroup_mma(zi.slice((first + j) * DKV_COLS, DKV_COLS, dim=1).permute((1, 0)), wi, zero,
                             use_acc=False, is_async=True)
    else:
        part = warpgroup_mma(qt.permute((1, 0)), ds_smem, zero, use_acc=False, is_async=True)
    return part


@gluon.jit
def _dkv_add(part, dkv_base, rows, stride_dks, j: gl.constexpr, SIDE: gl.constexpr, D_V: gl.constexpr,
             D_TAIL: gl.constexpr, layout: gl.constexpr):
    """Add this side's dkv product j (see _dkv_product) to its dkv columns."""
    first: gl.constexpr = _dkv_chunks(SIDE, D_V)[0]
    count: gl.constexpr = _dkv_chunks(SIDE, D_V)[1]
    if j < count:
        _add_dkv_rows(part, dkv_base, rows, (first + j) * DKV_COLS, stride_dks, DKV_COLS, layout)
    else:
        _add_dkv_rows(part, dkv_base, rows, D_V, stride_dks, D_TAIL, layout)


@gluon.jit
def _backward_side(common, SIDE: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
                   HAS_TOPK_LEN: gl.constexpr, DKV_ATOMICS: gl.constexpr):
    """Warpgroup SIDE (0: scores, 1: gradients) of one program. Bars: 0 both sides' rows loaded, 1 P
    written (score -> gradient side), 2 dS written (gradient -> score side), 3 [dS; P] read by both
    sides' products (free for the next tile). Without DKV_ATOMICS (the deterministic backward's dq
    pass) each side writes its dS^T or P^T to the workspace PDS instead of adding dkv rows."""
    (Q, DOUT, IDX, TOPK_LEN, DELTA, SHIFT, DQ, DKV, PDS, z, q_tail, k_main, k_tail, w, slot_rows, ready, free,
     bars, topk, heads_per_group, head_blocks, qk_scale, sm_scale,
     stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
     stride_dob, stride_dos, stride_doh, stride_mb, stride_ms, stride_dqb, stride_dqs, stride_dqh,
     stride_dkb, stride_dks, stride_dkh, stride_pb, stride_ps, stride_pg, stride_pt) = common
    HALF: gl.constexpr = D_V // 2
    # [64, BWD_TOPK] products: S, dP (rows: heads) and the dkv chunks (rows: columns of dkv).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BWD_TOPK, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
    tail_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, COLS, 16])
    slots_of: gl.constexpr = gl.SliceLayout(0, s_layout)
    heads_of: gl.constexpr = gl.SliceLayout(1, s_layout)
    t, g, hb, b = _program_coords(head_blocks)

    # This side's rows into shared memory: Q and its tail (score side) or dO (gradient side), rows
    # 0-63 and 64-127 of z; heads past the group read 0 (their P is 0: shift +inf) and are never stored.
    row_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_hl = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, row_load))
    heads_l = g * heads_per_group + offs_hl
    ok_l = offs_hl < heads_per_group
    if SIDE == 0:
        _rows_to_shared(z.index(0).slice(0, BLOCK_H, dim=0), q_tail.index(0), Q, b, t, heads_l, ok_l,
                        stride_qb, stride_qs, stride_qh, D_V, D_TAIL, row_load)
    else:
        _rows_to_shared(z.index(0).slice(BLOCK_H, BLOCK_H, dim=0), q_tail.index(0), DOUT, b, t, heads_l, ok_l,
                        stride_dob, stride_dos, stride_doh, D_V, 0, row_load)
    gl.thread_barrier()
    mbarrier.arrive(bars.index(0), count=1)

    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=heads_of)
    head_ok = offs_h < heads_per_group
    heads = g * heads_per_group + offs_h
    m_off = b * stride_mb + t.to(gl.int64) * stride_ms + heads
    if SIDE == 0:
        shift = gl.load(SHIFT + m_off, mask=head_ok, other=float("inf"))
    else:
        delta = gl.load(DELTA + m_off, mask=head_ok, other=0.0)
    n_slots, _ = _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb,
                              stride_ls, HAS_TOPK_LEN)
    dkv_base = DKV + b * stride_dkb + g.to(gl.int64) * stride_dkh
    # Workspace row of slot j: dS^T at columns [0, heads_per_group), P^T after (the dkv pass's layout).
    pds_row = PDS + b * stride_pb + t.to(gl.int64) * stride_ps + g.to(gl.int64) * stride_pg + hb * BLOCK_H
    zero = gl.zeros([BLOCK_H, BWD_TOPK], gl.float32, layout=s_layout)
    dq = gl.zeros([BLOCK_H, HALF], gl.float32, layout=dq_layout)
    if SIDE == 0 and D_TAIL > 0:
        dq_tail = gl.zeros([BLOCK_H, COLS], gl.float32, layout=tail_layout)
    mbarrier.wait(bars.index(0), 0)
    n_tiles = gl.cdiv(n_slots, BWD_TOPK)
    for i in range(n_tiles):
        # The resident buffers are one-element rings indexed by a loop-variant 0: their wgmma descriptors
        # are then computed where each product is issued; as loop invariants, the compiler keeps ~80 of
        # them live across the loop and spills them.
        pin = i // (n_tiles + 1)
        zi = z.index(pin)
        wi = w.index(pin)
        qt = q_tail.index(pin)
        ds_smem = wi.slice(0, BLOCK_H, dim=0)
        p_smem = wi.slice(BLOCK_H, BLOCK_H, dim=0)
        stage = i % BWD_STAGES
        phase = i & 1
        mbarrier.wait(ready.index(stage), (i // BWD_STAGES) & 1)
        # The rows arrived through cp.async (generic proxy); wgmma reads them through the async proxy.
        fence_async_shared()
        k = k_main.index(stage)
        rows = slot_rows.index(stage).load(slots_of)
        if SIDE == 0:
            s = warpgroup_mma(zi.slice(0, BLOCK_H, dim=0), k.permute((1, 0)), zero, use_acc=False, is_async=True)
            if D_TAIL > 0:
                s = warpgroup_mma(qt, k_tail.index(stage).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            p = gl.where((rows >= 0)[None, :], gl.exp2(s * qk_scale - shift[:, None]), 0.0)
            # Both sides' products of the previous tile are done with [dS; P].
            mbarrier.wait(bars.index(3), phase ^ 1)
            p_smem.store(p.to(w.dtype))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(bars.index(1), count=1)
            if not DKV_ATOMICS:
                _to_workspace(p_smem, pds_row + heads_per_group, i, n_slots, hb * BLOCK_H, heads_per_group,
                              stride_pt)
            mbarrier.wait(bars.index(2), phase)
        else:
            dp = warpgroup_mma(zi.slice(BLOCK_H, BLOCK_H, dim=0), k.permute((1, 0)), zero, use_acc=False,
                               is_async=True)
            dp = warpgroup_mma_wait(0, deps=(dp,))
            mbarrier.wait(bars.index(1), phase)
            p = p_smem.load(s_layout).to(gl.float32)
            ds_smem.store((p * (dp - delta[:, None]) * sm_scale).to(w.dtype))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(bars.index(2), count=1)
            if not DKV_ATOMICS:
                _to_workspace(ds_smem, pds_row, i, n_slots, hb * BLOCK_H, heads_per_group, stride_pt)
        dq = warpgroup_mma(ds_smem, k.slice(SIDE * HALF, HALF, dim=1), dq, is_async=True)
        if SIDE == 0 and D_TAIL > 0:
            dq_tail = warpgroup_mma(ds_smem, k_tail.index(stage), dq_tail, is_async=True)
        # This side's dkv products, each one's atomics under the next one's product.
        jobs: gl.constexpr = _dkv_jobs(SIDE, D_V, D_TAIL) if DKV_ATOMICS else 0
        if jobs > 0:
            part = _dkv_product(zi, wi, qt, ds_smem, zero, 0, SIDE, D_V)
            for j in gl.static_range(1, jobs):
                nxt = _dkv_product(zi, wi, qt, ds_smem, zero, j, SIDE, D_V)
                part = warpgroup_mma_wait(1, deps=(part,))
                _dkv_add(part, dkv_base, rows, stride_dks, j - 1, SIDE, D_V, D_TAIL, s_layout)
                part = nxt
            part = warpgroup_mma_wait(0, deps=(part,))
            _dkv_add(part, dkv_base, rows, stride_dks, jobs - 1, SIDE, D_V, D_TAIL, s_layout)
        if SIDE == 0 and D_TAIL > 0:
            dq, dq_tail = warpgroup_mma_wait(0, deps=(dq, dq_tail))
        else:
            dq = warpgroup_mma_wait(0, deps=(dq,))
        # Every product of this side is done with [dS; P] and with the stage.
        gl.thread_barrier()
        mbarrier.arrive(bars.index(3), count=1)
        mbarrier.arrive(free.index(stage), count=1)

    dq_row = DQ + b * stride_dqb + t.to(gl.int64) * stride_dqs
    dq_heads = gl.convert_layout(heads, gl.SliceLayout(1, dq_layout))[:, None].to(gl.int64) * stride_dqh
    dq_ok = gl.convert_layout(head_ok, gl.SliceLayout(1, dq_layout))[:, None]
    offs_d = SIDE * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, dq_layout))
    gl.store(dq_row + dq_heads + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=dq_ok)
    if SIDE == 0 and D_TAIL > 0:
        tail_heads = gl.convert_layout(heads, gl.SliceLayout(1, tail_layout))[:, None].to(gl.int64) * stride_dqh
        tail_ok = gl.convert_layout(head_ok, gl.SliceLayout(1, tail_layout))[:, None]
        offs_t = gl.arange(0, COLS, layout=gl.SliceLayout(0, tail_layout))
        gl.store(dq_row + tail_heads + D_V + offs_t[None, :], dq_tail.to(DQ.dtype.element_ty),
                 mask=tail_ok & (offs_t < D_TAIL)[None, :])


@gluon.jit
def _sparse_mla_bwd_ws_kernel(
    Q, KV, IDX, TOPK_LEN, DOUT, DELTA, SHIFT, DQ, DKV, PDS,
    s_kv, topk, heads_per_group, head_blocks, qk_scale, sm_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs, stride_kvh,
    stride_ib, stride_is, stride_ih,
    stride_lb, stride_ls,
    stride_dob, stride_dos, stride_doh,
    stride_mb, stride_ms,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    stride_pb, stride_ps, stride_pg, stride_pt,
    D_V: gl.constexpr, D_TAIL: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, DKV_ATOMICS: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, GRADIENT_REGS: gl.constexpr,
):
    """One program: 64 heads of one kv group of one query (of one batch row); grid as the head-block
    kernel's. DKV_ATOMICS: the fused pass (dq, and dkv added with atomics); without it, the
    deterministic backward's dq pass (dq, and dS^T and P^T into the workspace PDS [b, s_q, h_kv, topk,
    2 * heads_per_group] for its dkv pass). GRADIENT_REGS: registers per gradient-side thread (the
    score side, the default partition, gets what it and the producer leave)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, BWD_TOPK], dtype)
    z = gl.allocate_shared_memory(dtype, [1, 2 * BLOCK_H, D_V], swizzled)
    k_main = gl.allocate_shared_memory(dtype, [BWD_STAGES, BWD_TOPK, D_V], swizzled)
    if D_TAIL > 0:
        q_tail = gl.allocate_shared_memory(dtype, [1, BLOCK_H, COLS], swizzled)
        k_tail = gl.allocate_shared_memory(dtype, [BWD_STAGES, BWD_TOPK, COLS], swizzled)
    else:  # no rope tail: the names stay bound for the partitions' arguments, never used
        q_tail = z
        k_tail = k_main
    w = gl.allocate_shared_memory(dtype, [1, 2 * BLOCK_H, BWD_TOPK], w_layout)
    slot_rows, ready, free = _allocate_ring(BWD_STAGES, BWD_TOPK, PRODUCER_WARPS)
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=2)
    mbarrier.init(bars.index(1), count=1)
    mbarrier.init(bars.index(2), count=1)
    mbarrier.init(bars.index(3), count=2)
    common = (Q, DOUT, IDX, TOPK_LEN, DELTA, SHIFT, DQ, DKV, PDS, z, q_tail, k_main, k_tail, w, slot_rows, ready,
              free, bars, topk, heads_per_group, head_blocks, qk_scale, sm_scale,
              stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
              stride_dob, stride_dos, stride_doh, stride_mb, stride_ms, stride_dqb, stride_dqs, stride_dqh,
              stride_dkb, stride_dks, stride_dkh, stride_pb, stride_ps, stride_pg, stride_pt)
    gl.warp_specialize([
        (_backward_side, (common, 0, D_V, D_TAIL, HAS_TOPK_LEN, DKV_ATOMICS)),
        (_backward_side, (common, 1, D_V, D_TAIL, HAS_TOPK_LEN, DKV_ATOMICS)),
        (_gather_blocks, (KV, IDX, TOPK_LEN, k_main, k_tail, slot_rows, ready, free,
                          s_kv, topk, head_blocks,
                          stride_kvb, stride_kvs, stride_kvh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                          D_V, D_TAIL, HAS_TOPK_LEN, PRODUCER_WARPS)),
    ], [4, PRODUCER_WARPS], [GRADIENT_REGS, PRODUCER_REGS])


def fused_pass_ws(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, dkv, config: LaunchConfig,
                  dims: dict) -> None:
    """The fused pass of the warp-specialized variant (see kernels.common.sparse_mla.backward._fused_pass)."""
    _launch(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, dkv, None, config, dims)


def dq_pass_ws(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, pds, config: LaunchConfig,
               dims: dict) -> None:
    """The deterministic backward's dq pass of the warp-specialized variant (see
    kernels.common.sparse_mla.backward._dq_pass): the fused pass's kernel without its dkv atomics."""
    _launch(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, None, pds, config, dims)


def _launch(q, kv, indices, sm_scale, topk_length, dout, delta, shift, dq, dkv, pds, config: LaunchConfig,
            dims: dict) -> None:
    """The kernel with dkv atomics (dkv given) or with the dS/P workspace (pds given)."""
    b, s_q, h_q, _ = q.shape
    h_kv = kv.shape[2]
    grid, head_blocks = _grid(s_q, h_q, h_kv, b, BLOCK_H.value)
    atomics = pds is None
    # The pointer a pass never touches (DKV_ATOMICS decides) gets the other one's tensor.
    if atomics:
        pds = dkv
    else:
        dkv = pds
    _sparse_mla_bwd_ws_kernel[grid](
        q, kv, indices, topk_length, dout, delta, shift, dq, dkv, pds,
        kv.shape[1], indices.shape[-1], h_q // h_kv, head_blocks, sm_scale * LOG2E.value, sm_scale,
        *_strides(q, 3), *_strides(kv, 3), *_strides(indices, 3), *_strides(topk_length, 2),
        *_strides(dout, 3), *_strides(delta, 2), *_strides(dq, 3),
        *(_strides(dkv, 3) if atomics else (0, 0, 0)), *(_strides(pds, 4) if not atomics else (0, 0, 0, 0)),
        D_V=dims["D_V"], D_TAIL=dims["D_TAIL"], HAS_TOPK_LEN=dims["HAS_TOPK_LEN"], DKV_ATOMICS=atomics,
        **config.blocks, num_warps=4,
    )


def shared_bytes(d_v: int, d_tail: int) -> int:
    """Shared memory of one program: [Q; dO] and Q's tail, the stages of gathered rows and their slot
    rows, [dS; P], the barriers."""
    heads, slots, stages = BLOCK_H.value, BWD_TOPK.value, BWD_STAGES.value
    tail = COLS.value if d_tail else 0
    return (2 * (2 * heads * d_v + heads * tail + stages * slots * (d_v + tail) + 2 * heads * slots)
            + 4 * stages * slots + 8 * (2 * stages + 4))


