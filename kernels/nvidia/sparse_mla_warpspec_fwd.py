"""sparse_mla's forward as a warp-specialized Gluon kernel for Hopper (sm_90), the forward of the
`sparse_mla_warpspec` variant (kernels/nvidia/sparse_mla.py): the kernel, its launcher and its shared
memory per program (what the variant prunes by). Its backward is in sparse_mla_warpspec_bwd.py, the
gathers both share in sparse_mla_gather.py.

Why: the plain-Triton head-block kernel plateaus near 265 TFLOP/s on an H200 at the V3.2 shape, its
warps waiting at CTA barriers around layout conversions and pipeline hand-offs (benchmarks/NOTES.md).
Gluon lets the kernel say how the work is split:

- two consumer warpgroups take the 64-slot blocks of the top-k list in pairs: warpgroup 0 (the
  leader) block 2j, warpgroup 1 (the follower) block 2j + 1, each its scores over all d_qk dims (one
  64 x 64 x d_qk product; Q stays in shared memory). The leader shifts by its own running maximum and
  starts its product at once; the follower starts from the leader's maximum, so its P is final; the
  leader then rescales its P and accumulator. Each hands its P to the other through shared memory (the
  leader's over its block's rope columns, dead once its scores are done), and each accumulates its
  half of d_v from both blocks (its own P from registers, the peer's from shared memory; V is the
  first d_v columns of the same rows). The skew lets one warpgroup's softmax run under the other's
  products, and the leader issues the next pair's scores under its last product (FlashMLA's sparse
  prefill schedule);
- a producer partition (PRODUCER_WARPS warps, few registers) gathers the blocks' latent rows with
  cp.async into two buffers (one block each; two 72 KB buffers fill Hopper's shared memory beside Q),
  with each slot's row index (-1 for an invalid index or a slot past topk_length, whose scores become
  -inf); invalid slots are zero-filled, never read. Each buffer has a ready and a free mbarrier per
  half (d_v's left half; the right half with the rope tail), because its halves are freed at
  different times: the leader's block's left half after the leader's own product, its right half
  after the follower's product with it, and the other way round for the follower's block. The
  producer refills halves in the order they are freed, so the next pair's rows arrive while the
  current pair's last products run.

One program owns 64 heads (wgmma's M per warpgroup) of one kv group of one query, as in the head-block
kernel with BLOCK_H 64. Semantics: `ops.sparse_mla.reference`.

It copies 16-byte chunks, so it needs kv rows aligned to 16 elements: the tuning key says whether
they are (`kv_aligned`), and the variant's `supports` leaves unaligned calls to the head-block kernel.

Gluon kernels do not run in the Triton interpreter: CI compiles this one for sm_90
(tests/test_shipped_and_default_configs.py) and the GPU tests compare it with the reference in bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kreg.core.records import LaunchConfig
from kreg.kernels.common.constants import LN2
from kreg.kernels.common.launch import triton_launch
from kreg.kernels.common.sparse_mla.forward import forward_launch
from kreg.kernels.nvidia.attention_tma import release
from kreg.kernels.nvidia.sparse_mla_gather import (
    COLS,
    PRODUCER_REGS,
    _block_slot_rows,
    _copy_columns,
    _program_coords,
    _query_slots,
    _rows_to_shared,
)

# Kernels can only read globals that are constexprs (Python code reads `.value`).
BLOCK_H = gl.constexpr(64)  # heads per program: wgmma's M for one warpgroup; both warpgroups share them
BLOCK_TOPK = gl.constexpr(64)  # slots per block: each warpgroup's scores are one 64 x 64 x d_qk product
# The running maximum before any valid slot: finite, so a row with nothing valid yet gets P = 0 and
# factors of 1 instead of NaN, with no test on the critical path. No score reaches it.
NO_MAX = gl.constexpr(-1.0e30)


# ----------------------------------------------------------------------------- Gluon kernel
@gluon.jit
def _landed(bar, phase):
    """Wait for a half block's rows; they arrived through cp.async (generic proxy) and wgmma reads them
    through the async proxy."""
    mbarrier.wait(bar, phase)
    fence_async_shared()


@gluon.jit
def _scores_half(q, q_tail, kv, kv_tail, s, RIGHT: gl.constexpr, USE_ACC: gl.constexpr, D_V: gl.constexpr,
                 D_TAIL: gl.constexpr):
    """Issue one half of a block's scores against Q, asynchronously: the left half is d_qk's columns
    [0, d_v / 2), the right half the other value columns and the rope tail."""
    HALF: gl.constexpr = D_V // 2
    s = warpgroup_mma(q.slice(RIGHT * HALF, HALF, dim=1), kv.slice(RIGHT * HALF, HALF, dim=1).permute((1, 0)), s,
                      use_acc=USE_ACC, is_async=True)
    if RIGHT and D_TAIL > 0:
        s = warpgroup_mma(q_tail, kv_tail.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _masked_scores(s, slot_rows, qk_scale):
    """Scores in log2 units, -inf at the slots the producer marked invalid."""
    rows = slot_rows.load(gl.SliceLayout(0, s.type.layout))
    return s * qk_scale + gl.where(rows >= 0, 0.0, float("-inf"))[None, :]


@gluon.jit
def _publish_and_step(s, m_i, m_new, l_i, acc, m_smem, published, o_rows: gl.constexpr):
    """Hand this side's new row maximum to the peer (m_smem, then one arrival on `published`) and take
    the online-softmax step: (P, the new row sums, the rescaled accumulator)."""
    m_smem.store(m_new)
    release(published)
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, l_i * alpha + gl.sum(p, 1), acc * gl.convert_layout(alpha, o_rows)[:, None]


@gluon.constexpr_function
def _p_operand_layout(d_v):
    """P's layout as the A operand of the P V product into a warpgroup's half of out (a [64, d_v / 2]
    wgmma accumulator, the operand's parent)."""
    out = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, d_v // 2, 16])
    return gl.DotOperandLayout(operand_index=0, parent=out, k_width=2)


@gluon.jit
def _lead_step(j, pin, s, acc, m_i, l_i, smem, ready, free, bars, qk_scale, NEXT: gl.constexpr,
               D_V: gl.constexpr, D_TAIL: gl.constexpr):
    """The leader's step j (its block 2j in buffer 0, whose scores `s` are done): shift by its own
    running maximum and start its product on the left half of d_v at once, then, with the pair's
    maximum from the follower, rescale, hand its P over and add the follower's P times the follower's
    block. With NEXT it issues the next step's scores under that last product (left half first, so the
    follower's block's left half is freed before it waits for its own block's right half)."""
    q_ring, qt_ring, kv_ring, kvt_ring, p_lead_ring, p_follow_ring, slot_rows, m_lead, m_pair_smem = smem
    HALF: gl.constexpr = D_V // 2
    p_operand: gl.constexpr = _p_operand_layout(D_V)
    o_rows: gl.constexpr = gl.SliceLayout(1, p_operand.parent)
    phase = j & 1
    kv = kv_ring.index(pin)
    s = _masked_scores(s, slot_rows.index(pin), qk_scale)
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p, l_i, acc = _publish_and_step(s, m_i, m_new, l_i, acc, m_lead, bars.index(1), o_rows)
    p_op = gl.convert_layout(p.to(kv.dtype), p_operand)
    acc = warpgroup_mma(p_op, kv.slice(0, HALF, dim=1), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    release(free.index(0))  # buffer 0's left half: both its readers (scores, this product) are done
    # The follower's maximum includes this one: it is the pair's, and rescales P and the accumulator.
    mbarrier.wait(bars.index(2), phase)
    m_pair = m_pair_smem.load(m_new.type.layout)
    beta = gl.exp2(m_new - m_pair)
    p_lead_ring.index(pin).store((p * beta[:, None]).to(kv.dtype))
    fence_async_shared()
    release(bars.index(3))
    mbarrier.wait(bars.index(4), phase)
    acc = acc * gl.convert_layout(beta, o_rows)[:, None]
    l_i = l_i * beta
    acc = warpgroup_mma(p_follow_ring.index(pin), kv_ring.index(pin + 1).slice(0, HALF, dim=1), acc, is_async=True)
    if NEXT:
        _landed(ready.index(0), phase ^ 1)
        s = _scores_half(q_ring.index(pin), qt_ring.index(pin), kv, kvt_ring.index(pin), s, 0, False, D_V, D_TAIL)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        release(free.index(2))  # buffer 1's left half
        _landed(ready.index(1), phase ^ 1)
        s = _scores_half(q_ring.index(pin), qt_ring.index(pin), kv, kvt_ring.index(pin), s, 1, True, D_V, D_TAIL)
        s = warpgroup_mma_wait(0, deps=(s,))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc,))
        release(free.index(2))
    return s, acc, m_pair, l_i


@gluon.jit
def _follow_step(j, pin, s, acc, m_i, l_i, smem, ready, free, bars, qk_scale, D_V: gl.constexpr,
                 D_TAIL: gl.constexpr):
    """The follower's step j (its block 2j + 1 in buffer 1): its scores, right half first (the half
    it freed itself, refilled first), then the left; its maximum starts from the leader's, so it is the
    pair's and its P is final; its product on the right half of d_v, then the leader's P times the
    leader's block; each buffer half is freed as soon as its last product is done."""
    q_ring, qt_ring, kv_ring, kvt_ring, p_lead_ring, p_follow_ring, slot_rows, m_lead, m_pair_smem = smem
    HALF: gl.constexpr = D_V // 2
    p_operand: gl.constexpr = _p_operand_layout(D_V)
    o_rows: gl.constexpr = gl.SliceLayout(1, p_operand.parent)
    phase = j & 1
    kv = kv_ring.index(pin + 1)
    _landed(ready.index(3), phase)
    s = _scores_half(q_ring.index(pin), qt_ring.index(pin), kv, kvt_ring.index(pin + 1), s, 1, False, D_V, D_TAIL)
    _landed(ready.index(2), phase)
    s = _scores_half(q_ring.index(pin), qt_ring.index(pin), kv, kvt_ring.index(pin + 1), s, 0, True, D_V, D_TAIL)
    s = warpgroup_mma_wait(0, deps=(s,))
    s = _masked_scores(s, slot_rows.index(pin + 1), qk_scale)
    mbarrier.wait(bars.index(1), phase)
    m_new = gl.maximum(m_lead.load(m_i.type.layout), gl.max(s, 1))
    p, l_i, acc = _publish_and_step(s, m_i, m_new, l_i, acc, m_pair_smem, bars.index(2), o_rows)
    p16 = p.to(kv.dtype)
    p_op = gl.convert_layout(p16, p_operand)
    acc = warpgroup_mma(p_op, kv.slice(HALF, HALF, dim=1), acc, is_async=True)
    p_follow_ring.index(pin).store(p16)
    mbarrier.wait(bars.index(3), phase)
    acc = warpgroup_mma(p_lead_ring.index(pin), kv_ring.index(pin).slice(HALF, HALF, dim=1), acc, is_async=True)
    fence_async_shared()
    release(bars.index(4))
    p_op = warpgroup_mma_wait(1, deps=(p_op,))
    release(free.index(3))  # buffer 1's right half
    acc = warpgroup_mma_wait(0, deps=(acc,))
    release(free.index(1))  # buffer 0's right half (with the leader's P in its rope columns)
    return s, acc, m_new, l_i


@gluon.jit
def _attend_half(common, smem, SIDE: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
                 HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr):
    """Consumer warpgroup SIDE (0 leads, 1 follows): block 2j + SIDE of each pair j and out's columns
    [SIDE * d_v / 2, (SIDE + 1) * d_v / 2). Online softmax in log2 units (`qk_scale` is sm_scale *
    log2(e)); writes out, and (the leader) max_logits and the natural-log lse like the head-block kernel
    (a row with no valid slot: out 0, max_logits -inf, lse +inf). Bars: 0 Q loaded, 1 the leader's
    maximum, 2 the follower's (the pair's), 3 the leader's P, 4 the follower's, 5 + s side s's row sums.
    The producer's slot rows make the consumers independent of the index tensor (sparse_mla_gather.py)."""
    (Q, IDX, SINK, TOPK_LEN, OUT, MAX_LOGITS, LSE, ready, free, bars, l_sums,
     s_kv, topk, heads_per_group, head_blocks, qk_scale,
     stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
     stride_ob, stride_os, stride_oh, stride_mb, stride_ms) = common
    q_ring, qt_ring = smem[0], smem[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_TOPK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D_V // 2, 16])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    t, g, hb, b = _program_coords(head_blocks)

    if SIDE == 0:
        # Q once, into shared memory with cp.async (through registers it would cost this warpgroup
        # the registers its loop needs); heads past the group read 0 and are never stored.
        q_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_load))
        _rows_to_shared(q_ring.index(0), qt_ring.index(0), Q, b, t, g * heads_per_group + offs_hq,
                        offs_hq < heads_per_group, stride_qb, stride_qs, stride_qh, D_V, D_TAIL, q_load)
        release(bars.index(0))
    else:
        mbarrier.wait(bars.index(0), 0)

    n_slots, _ = _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb,
                              stride_ls, HAS_TOPK_LEN)
    n_steps = gl.cdiv(n_slots, 2 * BLOCK_TOPK)
    m_i = gl.full([BLOCK_H], NO_MAX, gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_H, D_V // 2], gl.float32, layout=o_layout)
    s = gl.zeros([BLOCK_H, BLOCK_TOPK], gl.float32, layout=s_layout)
    # Buffers are indexed by `pin`, a loop-variant 0: their wgmma descriptors are then computed where
    # each product is issued; as loop invariants, the compiler keeps them all live and spills them.
    if SIDE == 0:
        # The first block's scores; each later block's are issued at the end of the step before.
        if n_steps > 0:
            _landed(ready.index(0), 0)
            s = _scores_half(q_ring.index(0), qt_ring.index(0), smem[2].index(0), smem[3].index(0), s, 0, False,
                             D_V, D_TAIL)
            _landed(ready.index(1), 0)
            s = _scores_half(q_ring.index(0), qt_ring.index(0), smem[2].index(0), smem[3].index(0), s, 1, True,
                             D_V, D_TAIL)
            s = warpgroup_mma_wait(0, deps=(s,))
        # The last step issues no next scores: peeled, so no in-flight product crosses a branch.
        for j in range(n_steps - 1):
            s, acc, m_i, l_i = _lead_step(j, j // n_steps, s, acc, m_i, l_i, smem, ready, free, bars, qk_scale, True,
                                          D_V, D_TAIL)
        if n_steps > 0:
            s, acc, m_i, l_i = _lead_step(n_steps - 1, 0, s, acc, m_i, l_i, smem, ready, free, bars, qk_scale, False,
                                          D_V, D_TAIL)
    else:
        for j in range(n_steps):
            s, acc, m_i, l_i = _follow_step(j, j // n_steps, s, acc, m_i, l_i, smem, ready, free, bars, qk_scale,
                                            D_V, D_TAIL)

    # The row sum is split between the sides; both finish with the pair's maximum.
    l_sums.index(SIDE).store(l_i)
    release(bars.index(5 + SIDE))
    mbarrier.wait(bars.index(6 - SIDE), 0)
    l_i = gl.convert_layout(l_i + l_sums.index(1 - SIDE).load(s_rows), o_rows)
    m_i = gl.convert_layout(m_i, o_rows)
    empty = l_i == 0.0
    lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)
    scale = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=o_rows)
    head_ok = offs_h < heads_per_group
    heads = g * heads_per_group + offs_h
    if HAS_SINK:
        sink = gl.load(SINK + heads, mask=head_ok, other=0.0)
        # sigmoid(lse - sink); empty rows are already scaled to 0 whatever the sink.
        scale = scale * gl.where(empty, 0.0, 1.0 / (1.0 + gl.exp(sink - gl.where(empty, 0.0, lse))))
    if SIDE == 0:
        m_off = b * stride_mb + t.to(gl.int64) * stride_ms + heads
        gl.store(MAX_LOGITS + m_off, gl.where(empty, float("-inf"), m_i * LN2), mask=head_ok)
        gl.store(LSE + m_off, lse, mask=head_ok)
    offs_d = SIDE * (D_V // 2) + gl.arange(0, D_V // 2, layout=gl.SliceLayout(0, o_layout))
    o_row = OUT + b * stride_ob + t.to(gl.int64) * stride_os + heads[:, None].to(gl.int64) * stride_oh
    gl.store(o_row + offs_d[None, :], (acc * scale[:, None]).to(OUT.dtype.element_ty), mask=head_ok[:, None])


@gluon.jit
def _refill(kv, kv_tail, kv_base, stride_kvs, rows, slot_rows, ready, free, free_phase, RIGHT: gl.constexpr,
            WITH_ROWS: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr, CHUNK: gl.constexpr,
            LAYOUT: gl.constexpr):
    """Once `free` completes its phase, cp.async of one half of a block's rows (see _scores_half) into
    buffer `kv` (and `kv_tail`), and WITH_ROWS the slot rows; invalid rows (-1) are zero-filled, never
    read. `ready` completes when every thread's copies have landed and the rows are written."""
    HALF: gl.constexpr = D_V // 2
    mbarrier.wait(free, free_phase)
    valid = rows >= 0
    row_ptrs = kv_base + gl.where(valid, rows, 0).to(gl.int64)[:, None] * stride_kvs
    _copy_columns(kv, kv_tail, row_ptrs, valid, RIGHT * HALF, (RIGHT + 1) * HALF, RIGHT, D_V, D_TAIL, CHUNK, LAYOUT)
    async_copy.mbarrier_arrive(ready, increment_count=False)
    if WITH_ROWS:
        slot_rows.store(rows)
        gl.thread_barrier()
    mbarrier.arrive(ready, count=1)


@gluon.jit
def _gather_halves(KV, IDX, TOPK_LEN, kv_ring, kvt_ring, slot_rows, ready, free, s_kv, topk, head_blocks,
                   stride_kvb, stride_kvs, stride_kvh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                   D_V: gl.constexpr, D_TAIL: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """Producer: blocks 2j and 2j + 1 of step j into buffers 0 and 1, half by half in the order the
    consumers free them: buffer 0's left half (the leader's own product), buffer 1's right half (the
    follower's), buffer 0's right half (the follower's product with the leader's P), buffer 1's left
    half (the leader's with the follower's P). Each block's slot rows go with its first half."""
    CHUNK: gl.constexpr = COLS if D_V // 2 >= COLS else D_V // 2
    # 8 contiguous 16-bit values (one 16-byte cp.async) per thread, CHUNK // 8 threads per row chunk.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (CHUNK // 8), CHUNK // 8], [PRODUCER_WARPS, 1], [1, 0])
    t, g, _, b = _program_coords(head_blocks)
    n_slots, idx_row = _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb,
                                    stride_ls, HAS_TOPK_LEN)
    kv_base = KV + b * stride_kvb + g.to(gl.int64) * stride_kvh
    offs_t = gl.arange(0, BLOCK_TOPK, layout=gl.SliceLayout(1, layout))
    for j in range(gl.cdiv(n_slots, 2 * BLOCK_TOPK)):
        # Barriers start in phase 0, so the first step finds every half free.
        phase = (j & 1) ^ 1
        rows0 = _block_slot_rows(idx_row, n_slots, s_kv, 2 * j, offs_t, BLOCK_TOPK)
        rows1 = _block_slot_rows(idx_row, n_slots, s_kv, 2 * j + 1, offs_t, BLOCK_TOPK)
        _refill(kv_ring.index(0), kvt_ring.index(0), kv_base, stride_kvs, rows0, slot_rows.index(0), ready.index(0),
                free.index(0), phase, 0, True, D_V, D_TAIL, CHUNK, layout)
        _refill(kv_ring.index(1), kvt_ring.index(1), kv_base, stride_kvs, rows1, slot_rows.index(1), ready.index(3),
                free.index(3), phase, 1, True, D_V, D_TAIL, CHUNK, layout)
        _refill(kv_ring.index(0), kvt_ring.index(0), kv_base, stride_kvs, rows0, slot_rows.index(0), ready.index(1),
                free.index(1), phase, 1, False, D_V, D_TAIL, CHUNK, layout)
        _refill(kv_ring.index(1), kvt_ring.index(1), kv_base, stride_kvs, rows1, slot_rows.index(1), ready.index(2),
                free.index(2), phase, 0, False, D_V, D_TAIL, CHUNK, layout)


@gluon.jit
def _sparse_mla_fwd_ws_kernel(
    Q, KV, IDX, SINK, TOPK_LEN, OUT, MAX_LOGITS, LSE,
    s_kv, topk, heads_per_group, head_blocks, qk_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs, stride_kvh,
    stride_ib, stride_is, stride_ih,
    stride_lb, stride_ls,
    stride_ob, stride_os, stride_oh,
    stride_mb, stride_ms,
    D_V: gl.constexpr, D_TAIL: gl.constexpr, HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, FOLLOWER_REGS: gl.constexpr,
):
    """One program: 64 heads of one kv group of one query (of one batch row); grid as the head-block
    kernel's. Shared memory: Q, two buffers of gathered rows (one block each) with their slot rows, the
    follower's P (the leader's goes into its block's rope columns, dead once its scores are done), the
    swapped row maxima and sums, the barriers. FOLLOWER_REGS: registers per follower thread (the
    leader, the default partition, gets what the follower and the producer leave)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_ring = gl.allocate_shared_memory(dtype, [1, BLOCK_H, D_V], swizzled)
    kv_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_TOPK, D_V], swizzled)
    if D_TAIL > 0:
        qt_ring = gl.allocate_shared_memory(dtype, [1, BLOCK_H, COLS], swizzled)
        kvt_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_TOPK, COLS], swizzled)
        # The leader's P: buffer 0's rope columns (same shape and layout), dead once its scores are done.
        p_lead_ring = kvt_ring
    else:  # no rope tail: the names stay bound for the partitions' arguments, never used
        qt_ring = q_ring
        kvt_ring = kv_ring
        p_lead_ring = gl.allocate_shared_memory(dtype, [1, BLOCK_H, BLOCK_TOPK], swizzled)
    p_follow_ring = gl.allocate_shared_memory(dtype, [1, BLOCK_H, BLOCK_TOPK], swizzled)
    m_lead = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)
    m_pair = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)
    l_sums = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec)
    slot_rows = gl.allocate_shared_memory(gl.int32, [2, BLOCK_TOPK], vec)
    # Per buffer half (2 * buffer + half; half 0 is d_v's left half, 1 the rest): `ready` completes when
    # every producer thread's copies have landed plus one arrival, `free` on one consumer arrival.
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32 + 1)
        mbarrier.init(free.index(i), count=1)
    bars = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(7):
        mbarrier.init(bars.index(i), count=1)
    common = (Q, IDX, SINK, TOPK_LEN, OUT, MAX_LOGITS, LSE, ready, free, bars, l_sums,
              s_kv, topk, heads_per_group, head_blocks, qk_scale,
              stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
              stride_ob, stride_os, stride_oh, stride_mb, stride_ms)
    smem = (q_ring, qt_ring, kv_ring, kvt_ring, p_lead_ring, p_follow_ring, slot_rows, m_lead, m_pair)
    gl.warp_specialize([
        (_attend_half, (common, smem, 0, D_V, D_TAIL, HAS_SINK, HAS_TOPK_LEN)),
        (_attend_half, (common, smem, 1, D_V, D_TAIL, HAS_SINK, HAS_TOPK_LEN)),
        (_gather_halves, (KV, IDX, TOPK_LEN, kv_ring, kvt_ring, slot_rows, ready, free, s_kv, topk, head_blocks,
                          stride_kvb, stride_kvs, stride_kvh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                          D_V, D_TAIL, HAS_TOPK_LEN, PRODUCER_WARPS)),
    ], [4, PRODUCER_WARPS], [FOLLOWER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------- launcher
def _forward_ws(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, config: LaunchConfig,
                launch: Callable[..., Any] = triton_launch):
    """Run the warp-specialized forward on batched-layout tensors; returns (out, max_logits, lse)."""
    outputs, grid, args, constexprs = forward_launch(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                                     BLOCK_H.value)
    launch(_sparse_mla_fwd_ws_kernel, grid, *args, **constexprs, **config.blocks, num_warps=4)
    return outputs


# ----------------------------------------------------------------------------- shared memory
def shared_bytes(d_v: int, d_tail: int) -> int:
    """Shared memory of one program: Q, the two buffers of gathered rows and their slot rows, the
    follower's P (and the leader's without a rope tail to hold it), the row maxima and sums, the
    barriers."""
    heads, row, slots = BLOCK_H.value, d_v + (COLS.value if d_tail else 0), BLOCK_TOPK.value
    p_buffers = 1 if d_tail else 2
    return 2 * (heads * row + 2 * slots * row + p_buffers * heads * slots) + 4 * (2 * slots + 4 * heads) + 8 * 15
