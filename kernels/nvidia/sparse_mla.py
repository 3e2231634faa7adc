"""sparse_mla on NVIDIA Hopper: two variants.

`sparse_mla_headblock`: the shared head-block kernel (kernels.common.sparse_mla) with NVIDIA's config
space. Hopper's register file holds at most 128 fp32 accumulator values per thread next to the other
tiles, so BLOCK_H 128 with d_v 512 is pruned statically; 228 KB of shared memory allows deep pipelining
of the gathered K/V tiles.

`sparse_mla_warpspec`: a warp-specialized Gluon forward (below), the backward shared with the
head-block variant. Why: the plain-Triton head-block kernel plateaus near 265 TFLOP/s on an H200 at
the V3.2 shape, its warps waiting at CTA barriers around layout conversions and pipeline hand-offs
(benchmarks/NOTES.md). Gluon lets the kernel say how the work is split:

- a producer partition (PRODUCER_WARPS warps, few registers) gathers each BLOCK_TOPK-slot block of
  selected latent rows with cp.async into a ring of NUM_STAGES shared-memory stages, with each slot's
  row index (-1 for an invalid index or a slot past topk_length, whose scores become -inf), and signals
  an mbarrier per stage; invalid slots are zero-filled, never read (kernels/nvidia/sparse_mla_gather.py);
- two consumer warpgroups take the blocks in pairs: warpgroup 0 (the leader) block 2j, warpgroup 1
  (the follower) block 2j + 1, each its scores over all d_qk dims (Q stays in shared memory). The
  leader shifts by its own running maximum and starts its product at once; the follower starts from
  the leader's maximum, so its P is final; the leader then rescales its P and accumulator. Each writes
  its P to shared memory for the other, and each accumulates its half of d_v from both blocks (its own
  P from registers, the peer's from shared memory; V is the first d_v columns of the same rows). The
  skew lets one warpgroup's softmax run under the other's products (FlashMLA's schedule).

Four stages of 32 slots: a pair uses two while the producer fills the other two.

One program owns 64 heads (wgmma's M per warpgroup) of one kv group of one query, as in the head-block
kernel with BLOCK_H 64. Semantics: `registry.ops.sparse_mla.reference`.

It copies 16-byte chunks, so it needs kv rows aligned to 16 elements: the tuning key says whether
they are (`kv_aligned`), and `supports` leaves unaligned calls to the head-block kernel.

Gluon kernels do not run in the Triton interpreter: CI compiles this one for sm_90
(tests/test_shipped_and_default_configs.py) and the GPU tests compare it with the reference in bf16.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.base import CompileSpec, Variant
from kernels.common.sparse_mla import (
    BWD_PRE_SPACE,
    INTERPRETER_DKV,
    INTERPRETER_DQ,
    INTERPRETER_FUSED,
    INTERPRETER_FWD,
    INTERPRETER_SUM,
    SparseMLAHeadBlockBase,
    _compile_signature,
    forward_launch,
    heads_fit_group,
    sparse_mla_compile_specs,
)
from kernels.nvidia.sparse_mla_gather import (
    COLS,
    PRODUCER_REGS,
    _allocate_ring,
    _gather_blocks,
    _program_coords,
    _query_slots,
    _rows_to_shared,
)
from kernels.nvidia.sparse_mla_warpspec_bwd import _sparse_mla_bwd_ws_kernel, fused_pass_ws
from kernels.nvidia.sparse_mla_warpspec_bwd import compile_spec as bwd_compile_spec
from kernels.nvidia.sparse_mla_warpspec_bwd import shared_bytes as bwd_shared_bytes
from registry.catalog import register
from tuning.space import ConfigSpace
from tuning_db.records import CallConfig, LaunchConfig


@register
class SparseMLAHeadBlockNvidia(SparseMLAHeadBlockBase, Variant):
    vendor = "nvidia"
    spaces = {
        # The default: the fastest spill-free config measured on the H200 at the V3.2 shape
        # (benchmarks/NOTES.md): 64 heads per program, 64-slot tiles, 3 stages (255 registers with int32
        # row offsets).
        "fwd": ConfigSpace(
            blocks={"BLOCK_H": (16, 32, 64, 128), "BLOCK_TOPK": (16, 32, 64, 128), "D_SPLIT": (1, 2)},
            knobs={"num_warps": (4, 8, 16), "num_stages": (1, 2, 3, 4)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 64, "BLOCK_TOPK": 64, "D_SPLIT": 1, "num_warps": 8, "num_stages": 3}},
            interpreter=INTERPRETER_FWD,
        ),
        # The default backward: a small pre pass (Delta, shift, sink terms), then the fused pass. Its
        # default is the widest tile that compiles at every V3.2 preset key for sm_90 with no spill and
        # fits in shared memory: [Q; dO] of 64 heads (136 KB) and Q's tail stay resident beside the
        # pipelined 16-slot gathers (190 KB); it runs at 255 registers, and 2 stages spill 8 B at
        # h_q 64. 32-slot tiles spill at one stage and overflow shared memory at two (242 KB).
        "bwd_pre": BWD_PRE_SPACE,
        "bwd_fused": ConfigSpace(
            blocks={"BLOCK_H": (16, 32, 64), "BLOCK_TOPK": (16, 32), "D_SPLIT": (2, 4)},
            knobs={"num_warps": (4, 8), "num_stages": (1, 2, 3)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 64, "BLOCK_TOPK": 16, "D_SPLIT": 4, "num_warps": 8, "num_stages": 3}},
            interpreter=INTERPRETER_FUSED,
        ),
        # The deterministic backward's dq and dkv passes: the fastest spill-free pair measured on the
        # H200 at the V3.2 shape when they were the default backward (benchmarks/NOTES.md): dq with 32
        # heads per program (64 spill), dkv with 64-row tiles and 16-head chunks (32-head chunks at 3
        # stages need 240 KB of shared memory at run time).
        "bwd_dq": ConfigSpace(
            blocks={"BLOCK_H": (16, 32, 64), "BLOCK_TOPK": (32, 64)},
            knobs={"num_warps": (4, 8), "num_stages": (2, 3)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 32, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 2}},
            interpreter=INTERPRETER_DQ,
        ),
        "bwd_dkv": ConfigSpace(
            blocks={"BLOCK_H": (16, 32), "BLOCK_TOPK": (32, 64, 128)},
            knobs={"num_warps": (4, 8), "num_stages": (2, 3)},
            keep=heads_fit_group,
            defaults={"*": {"BLOCK_H": 16, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 3}},
            interpreter=INTERPRETER_DKV,
        ),
        # Adds the dkv pass's rows per kv row: bound by the rows' bytes and the latency of each load.
        "bwd_sum": ConfigSpace(
            blocks={"BLOCK_D": (64, 128, 256)},
            knobs={"num_warps": (1, 2, 4)},
            defaults={"*": {"BLOCK_D": 128, "num_warps": 1}},
            interpreter=INTERPRETER_SUM,
        ),
    }
    ACC_REGS_LIMIT = 128


# ----------------------------------------------------------------------------- warp-specialized forward
LN2 = gl.constexpr(0.6931471805599453)
# Kernels can only read globals that are constexprs (Python code reads `.value`).
BLOCK_H = gl.constexpr(64)  # heads per program: wgmma's M for one warpgroup; both warpgroups share them
BLOCK_TOPK = gl.constexpr(32)  # slots per block: each warpgroup's scores are one 64 x 32 x d_qk wgmma
NUM_STAGES = gl.constexpr(4)  # Q (72 KB at d_qk 576) + four 36 KB stages fill Hopper's 227 KB


# ----------------------------------------------------------------------------- Gluon kernel
@gluon.jit
def _publish_and_exponentiate(s, m_i, m_new, l_i, m_smem, published):
    """Hand this side's new row maximum to the peer (m_smem, then one arrival on `published`) and take
    the online-softmax step: (the shift, P, the factor for the old accumulator, the new row sums)."""
    m_smem.store(m_new)
    gl.thread_barrier()
    mbarrier.arrive(published, count=1)
    # Rows with no valid slot so far keep m = -inf: shift by 0 so exp2 gives 0 instead of NaN.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)
    return m_shift, p, alpha, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _attend_half(common, own, peer, SIDE: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
                 HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr):
    """Consumer warpgroup SIDE (0 leads, 1 follows): block 2j + SIDE of each pair j and out's columns
    [SIDE * d_v / 2, (SIDE + 1) * d_v / 2). Online softmax in log2 units (`qk_scale` is sm_scale *
    log2(e)); writes out, and (the leader) max_logits and the natural-log lse like the head-block kernel
    (a row with no valid slot: out 0, max_logits -inf, lse +inf). Bars: 0 Q loaded, 1 the leader's
    maximum, 2 the follower's (the pair's), 3 the leader's P, 4 the follower's, 5 + s side s's row sums.
    The producer's slot rows make the consumers independent of the index tensor (sparse_mla_gather.py)."""
    # The arguments both sides share, then (P, row maxima, row sums) of this side and of the peer's.
    (Q, IDX, SINK, TOPK_LEN, OUT, MAX_LOGITS, LSE, q_main, q_tail, k_main, k_tail, slot_rows, ready, free, bars,
     s_kv, topk, heads_per_group, head_blocks, qk_scale,
     stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
     stride_ob, stride_os, stride_oh, stride_mb, stride_ms) = common
    p_own, m_own_smem, l_own_smem = own
    p_peer, m_peer_smem, l_peer_smem = peer
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_TOPK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D_V // 2, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    t, g, hb, b = _program_coords(head_blocks)

    if SIDE == 0:
        # Q once, into shared memory with cp.async (through registers it would cost this warpgroup
        # the registers its loop needs); heads past the group read 0 and are never stored.
        q_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_load))
        _rows_to_shared(q_main, q_tail, Q, b, t, g * heads_per_group + offs_hq, offs_hq < heads_per_group,
                        stride_qb, stride_qs, stride_qh, D_V, D_TAIL, q_load)
        gl.thread_barrier()
        mbarrier.arrive(bars.index(0), count=1)
    else:
        mbarrier.wait(bars.index(0), 0)

    n_slots, _ = _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb,
                              stride_ls, HAS_TOPK_LEN)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_H, D_V // 2], gl.float32, layout=o_layout)
    s_init = gl.zeros([BLOCK_H, BLOCK_TOPK], gl.float32, layout=s_layout)
    for pair in range(gl.cdiv(n_slots, 2 * BLOCK_TOPK)):
        phase = pair & 1
        block = 2 * pair + SIDE
        stage = block % NUM_STAGES
        peer_stage = (block + 1 - 2 * SIDE) % NUM_STAGES
        mbarrier.wait(ready.index(stage), (block // NUM_STAGES) & 1)
        # The rows arrived through cp.async (generic proxy); wgmma reads them through the async proxy.
        fence_async_shared()
        s = warpgroup_mma(q_main, k_main.index(stage).permute((1, 0)), s_init, use_acc=False, is_async=True)
        if D_TAIL > 0:
            s = warpgroup_mma(q_tail, k_tail.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        rows = slot_rows.index(stage).load(gl.SliceLayout(0, s_layout))
        s = s * qk_scale + gl.where(rows >= 0, 0.0, float("-inf"))[None, :]
        own_v = k_main.index(stage).slice(SIDE * (D_V // 2), D_V // 2, dim=1)
        peer_v = k_main.index(peer_stage).slice(SIDE * (D_V // 2), D_V // 2, dim=1)
        if SIDE == 0:
            # Leader: shift by its own running maximum and start its product at once; the follower's
            # maximum (which includes this one) then rescales P for the follower and the accumulator.
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_shift, p, alpha, l_i = _publish_and_exponentiate(s, m_i, m_new, l_i, m_own_smem, bars.index(1))
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            p_op = gl.convert_layout(p.to(p_own.dtype), p_operand)
            acc = warpgroup_mma(p_op, own_v, acc, is_async=True)
            mbarrier.wait(bars.index(2), phase)
            m_pair = m_peer_smem.load(s_rows)
            # Rows still without a valid slot have p = 0, acc = 0, l = 0: any finite factor will do.
            beta = gl.where(m_new == float("-inf"), 1.0,
                            gl.exp2(m_shift - gl.where(m_pair == float("-inf"), 0.0, m_pair)))
            p_own.store((p * beta[:, None]).to(p_own.dtype))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(bars.index(3), count=1)
            l_i = l_i * beta
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            acc = acc * gl.convert_layout(beta, o_rows)[:, None]
            mbarrier.wait(bars.index(4), phase)
            acc = warpgroup_mma(p_peer, peer_v, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            m_i = m_pair
        else:
            # Follower: its maximum starts from the leader's, so it is the pair's and P is final.
            mbarrier.wait(bars.index(1), phase)
            m_new = gl.maximum(m_peer_smem.load(s_rows), gl.max(s, 1))
            m_shift, p, alpha, l_i = _publish_and_exponentiate(s, m_i, m_new, l_i, m_own_smem, bars.index(2))
            p16 = p.to(p_own.dtype)
            p_own.store(p16)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(bars.index(4), count=1)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            p_op = gl.convert_layout(p16, p_operand)
            acc = warpgroup_mma(p_op, own_v, acc, is_async=True)
            mbarrier.wait(bars.index(3), phase)
            acc = warpgroup_mma(p_peer, peer_v, acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            m_i = m_new
        # This side is done with both blocks of the pair (its own and its half of the peer's).
        gl.thread_barrier()
        mbarrier.arrive(free.index(stage), count=1)
        mbarrier.arrive(free.index(peer_stage), count=1)

    # The row sum is split between the sides; both finish with the pair's maximum.
    l_own_smem.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(bars.index(5 + SIDE), count=1)
    mbarrier.wait(bars.index(6 - SIDE), 0)
    l_i = gl.convert_layout(l_i + l_peer_smem.load(s_rows), o_rows)
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
        gl.store(MAX_LOGITS + m_off, m_i * LN2, mask=head_ok)
        gl.store(LSE + m_off, lse, mask=head_ok)
    offs_d = SIDE * (D_V // 2) + gl.arange(0, D_V // 2, layout=gl.SliceLayout(0, o_layout))
    o_row = OUT + b * stride_ob + t.to(gl.int64) * stride_os + heads[:, None].to(gl.int64) * stride_oh
    gl.store(o_row + offs_d[None, :], (acc * scale[:, None]).to(OUT.dtype.element_ty), mask=head_ok[:, None])


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
    kernel's. Shared memory: Q, the stages of gathered rows and their slot rows, each side's P, the
    swapped row maxima and sums, the barriers. FOLLOWER_REGS: registers per follower thread (the
    leader, the default partition, gets what the follower and the producer leave)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_TOPK], dtype)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_main = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], swizzled)
    k_main = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_TOPK, D_V], swizzled)
    if D_TAIL > 0:
        q_tail = gl.allocate_shared_memory(dtype, [BLOCK_H, COLS], swizzled)
        k_tail = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_TOPK, COLS], swizzled)
    else:  # no rope tail: the names stay bound for the partitions' arguments, never used
        q_tail = q_main
        k_tail = k_main
    p_side0 = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_TOPK], p_layout)
    p_side1 = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_TOPK], p_layout)
    m_side0 = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)
    m_side1 = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)
    l_side0 = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)
    l_side1 = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)
    slot_rows, ready, free = _allocate_ring(NUM_STAGES, BLOCK_TOPK, PRODUCER_WARPS)
    bars = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(7):
        mbarrier.init(bars.index(i), count=1)
    common = (Q, IDX, SINK, TOPK_LEN, OUT, MAX_LOGITS, LSE, q_main, q_tail, k_main, k_tail, slot_rows, ready, free,
              bars, s_kv, topk, heads_per_group, head_blocks, qk_scale,
              stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
              stride_ob, stride_os, stride_oh, stride_mb, stride_ms)
    side0 = (p_side0, m_side0, l_side0)
    side1 = (p_side1, m_side1, l_side1)
    gl.warp_specialize([
        (_attend_half, (common, side0, side1, 0, D_V, D_TAIL, HAS_SINK, HAS_TOPK_LEN)),
        (_attend_half, (common, side1, side0, 1, D_V, D_TAIL, HAS_SINK, HAS_TOPK_LEN)),
        (_gather_blocks, (KV, IDX, TOPK_LEN, k_main, k_tail, slot_rows, ready, free,
                          s_kv, topk, head_blocks,
                          stride_kvb, stride_kvs, stride_kvh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                          D_V, D_TAIL, HAS_TOPK_LEN, PRODUCER_WARPS, 2)),
    ], [4, PRODUCER_WARPS], [FOLLOWER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------- launcher
def _forward_ws(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, config: LaunchConfig):
    """Run the warp-specialized forward on batched-layout tensors; returns (out, max_logits, lse)."""
    outputs, grid, args, constexprs = forward_launch(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                                     BLOCK_H.value)
    _sparse_mla_fwd_ws_kernel[grid](*args, **constexprs, **config.blocks, num_warps=4)
    return outputs


# ----------------------------------------------------------------------------- the variant
def shared_bytes(d_v: int, d_tail: int) -> int:
    """Shared memory of one program: Q, the stages of gathered rows and their slot rows, each side's P
    (16-bit), the row maxima and sums, the barriers."""
    heads, row, slots, stages = BLOCK_H.value, d_v + (COLS.value if d_tail else 0), BLOCK_TOPK.value, NUM_STAGES.value
    return (2 * (heads * row + stages * slots * row + 2 * heads * slots) + 4 * (stages * slots + 4 * heads)
            + 8 * (2 * stages + 7))


@register
class SparseMLAWarpSpecializedHopper(SparseMLAHeadBlockNvidia):
    """Hopper only (wgmma, setmaxnreg); d_v a power of two in [64, 512] (each warpgroup's half of an
    accumulator, the forward's out and the backward's dQ, is one wgmma of N = d_v / 2 <= 256), a rope
    tail of at most 64 dims in 8-dim steps (whole 16-byte copies), kv rows aligned to 16 elements.
    Higher priority than the head-block kernel: it is the default where it runs. Its fused backward
    pass is its own (kernels/nvidia/sparse_mla_warpspec_bwd.py); the pre pass and the deterministic
    passes are the head-block variant's (same kernels, same spaces).

    The tiles are fixed (forward: BLOCK_TOPK 32, NUM_STAGES 4, what fits beside Q; backward: 32 slots,
    two stages, what fits beside [Q; dO]); the spaces are the producer's warps and the registers of the
    second warpgroup (the default partition gets the rest), the splits that compile without spills on
    sm_90 (fewer registers spill in that warpgroup, more in the default one)."""

    name = "sparse_mla_warpspec"
    priority = 10
    runs_in_interpreter = False
    run_forward = staticmethod(_forward_ws)
    run_fused = staticmethod(fused_pass_ws)
    kernels = {**SparseMLAHeadBlockNvidia.kernels, "fwd": _sparse_mla_fwd_ws_kernel,
               "bwd_fused": _sparse_mla_bwd_ws_kernel}
    spaces = {
        **SparseMLAHeadBlockNvidia.spaces,
        # The default: the fastest of the space on the H200 at the V3.2 shape (benchmarks/NOTES.md).
        "fwd": ConfigSpace(
            blocks={"PRODUCER_WARPS": (2, 4), "FOLLOWER_REGS": (200, 208)},
            knobs={"num_warps": (4,)},
            defaults={"*": {"PRODUCER_WARPS": 4, "FOLLOWER_REGS": 208, "num_warps": 4}},
        ),
        # The default: the winner at most of the 11 V3.2 keys swept on the H100 (benchmarks/NOTES.md);
        # every config is within ~1.5% of the best at the s_q 4096 keys. 224 registers spill at d_v 512.
        "bwd_fused": ConfigSpace(
            blocks={"PRODUCER_WARPS": (2, 4), "GRADIENT_REGS": (208, 216, 224)},
            knobs={"num_warps": (4,)},
            defaults={"*": {"PRODUCER_WARPS": 2, "GRADIENT_REGS": 208, "num_warps": 4}},
        ),
    }

    def supports(self, key: dict, device) -> bool:
        d_v, tail = key["d_v"], key["d_qk"] - key["d_v"]
        return (device.arch == "sm_90" and key["dtype"] in ("fp16", "bf16") and key["kv_aligned"]
                and 64 <= d_v <= 512 and d_v & (d_v - 1) == 0 and 0 <= tail <= COLS.value and tail % 8 == 0)

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        if role in ("fwd", "bwd_fused"):  # no head block to cap: the tile is fixed
            return self.spaces[role].default(device)
        return super().role_default(role, key, device)

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        if role not in ("fwd", "bwd_fused"):
            return super().prune_reason(role, config, key, device)
        need = (shared_bytes if role == "fwd" else bwd_shared_bytes)(key["d_v"], key["d_qk"] - key["d_v"])
        if need > device.shared_mem_bytes:
            return f"needs {need} B of shared memory (> {device.shared_mem_bytes})"
        return None

    def compile_specs(self, key: dict, config: CallConfig, dtype: str = "bf16") -> list[CompileSpec]:
        """This forward (with sink and topk_length) and fused backward pass, and the head-block
        variant's other backward kernels."""
        fn = _sparse_mla_fwd_ws_kernel
        constexprs = {"D_V": key["d_v"], "D_TAIL": key["d_qk"] - key["d_v"], "HAS_SINK": True, "HAS_TOPK_LEN": True,
                      **config["fwd"].blocks}
        names = [n for n in fn.arg_names if n not in constexprs]
        elem = f"*{key.get('dtype', dtype)}"
        pointers = {"Q": elem, "KV": elem, "OUT": elem, "IDX": "*i32", "TOPK_LEN": "*i32", "SINK": "*fp32",
                    "MAX_LOGITS": "*fp32", "LSE": "*fp32"}
        heads_per_group = key["h_q"] // key["h_kv"]
        values = {"topk": key["topk"], "heads_per_group": heads_per_group,
                  "head_blocks": triton.cdiv(heads_per_group, BLOCK_H.value)}
        forward = CompileSpec("fwd", fn, _compile_signature(names, pointers, ("qk_scale",)), constexprs,
                              {"num_warps": 4}, values)
        others = tuple(r for r in self.roles if r not in ("fwd", "bwd_fused"))
        return [forward, bwd_compile_spec(key, config["bwd_fused"], dtype),
                *sparse_mla_compile_specs(key, config, others, dtype)]
