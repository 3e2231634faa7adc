"""The attention family's dK/dV and dQ backward as warp-specialized Gluon kernels for Hopper (sm_90),
beside the warp-specialized forward (kernels/nvidia/attention_warpspec.py), whose variants launch them
after the tiled pre kernel (kernels/common/attention/backward.py).

Why: the tiled backward reaches ~220 TFLOP/s of matmul work at d 128 on an H200: its dK/dV kernel
holds 242-255 registers at 8 warps, one CTA per SM, and each warp loads, multiplies and exponentiates
in turn. FlashAttention-3's backward splits the work between a producer warp (TMA loads into an
mbarrier ring) and two consumer warpgroups (wgmma, P in registers); its dQ goes out through fp32
atomics, which this family avoids (gradients stay bitwise reproducible), so dQ keeps a kernel of its
own:

- `_attention_bwd_dkv_ws_kernel`: a CTA owns 2 * BLOCK_N keys of one kv head, BLOCK_N per consumer
  warpgroup (its K and V tiles loaded once); the producer streams Q and dO tiles of BLOCK_M query rows
  of every query head of the GQA group through a NUM_STAGES ring, with their rows' Lse2 and Delta. A
  warpgroup works transposed (keys as rows): S^T = K Q^T and dP^T = V dO^T - Delta (async; the
  exponentials of S^T run under the dP^T product), P^T = exp2(S^T * qk_scale - Lse2),
  dS^T = P^T (dP^T - Delta), dV += P^T dO and dK += dS^T Q with P^T and dS^T in registers as the A
  operands; the producer stores dK and dV by TMA at the end.
- `_attention_bwd_dq_ws_kernel`: the forward's program layout: a CTA owns 2 * BLOCK_M query rows of
  one query head, BLOCK_M per consumer warpgroup (its Q and dO tiles loaded once, its rows' Lse2 and
  Delta in registers); the producer streams K and V tiles of BLOCK_N keys of the kv head through a
  NUM_STAGES ring. Per tile: S = Q K^T and dP = dO V^T - Delta (async), P = exp2(S * qk_scale - Lse2),
  dS = P (dP - Delta), dQ += dS K with dS as the register A operand; each warpgroup stores its
  dQ * sm_scale by TMA through its Q buffer.

It reads Lse2 (the lse with the sink, in log2 units, +inf for a row with no key) and Delta from the
tiled pre kernel (`_attention_bwd_pre_kernel`, which also sums d sinks), so sinks cost nothing here.
Rows TMA reads past a sequence come back as zeros and its stores drop them: padding queries have
Lse2 = +inf (P = 0), padding keys only touch their own dK/dV rows, which are never written, and the
dQ kernel masks them (keys past s_k) in its last tile.
Served: sm_90, fp16/bf16, d 64 and 128, no window, padded (not varlen) inputs TMA can address; the
variants send every other call to the tiled backward (`run_backward` in attention_warpspec.py).
Gluon kernels do not run in the Triton interpreter: CI compiles this one for sm_90 and the GPU tests
compare gradients with the reference's autograd in bf16 (tests/test_attention_warpspec.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kreg.core.records import CallConfig, LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.common.attention.backward import backward_pre
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.launch import triton_launch
from kreg.kernels.common.tiles import cdiv
from kreg.kernels.nvidia.attention_tma import (
    PRODUCER_REGS,
    descriptor,
    key_tiles,
    query_tile,
    release,
    tma_addressable,
)


# ----------------------------------------------------------------------------- shared pieces
@gluon.jit
def _stage_result(acc, buf, done, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """`acc` (one warpgroup's [ROWS, HEAD_DIM] result) into the shared buffer `buf`, which no product
    reads any more, for the producer's TMA store; `done` completes when it is there."""
    buf.reshape([ROWS, HEAD_DIM]).store(acc.to(buf.dtype))
    fence_async_shared()
    release(done)


# ----------------------------------------------------------------------------- dK/dV
@gluon.jit
def _dkv_query_tiles(n0, seqlen_q, diag, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Query tiles [lo, hi) that may see a key at or after n0 (query i sits at diag + i)."""
    lo = 0
    if IS_CAUSAL:
        lo = gl.maximum(n0 - diag, 0) // BLOCK_M
    hi = gl.cdiv(seqlen_q, BLOCK_M)
    return gl.minimum(lo, hi), hi


@gluon.jit
def _dkv_producer(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                  delta_smem, kv_ready, ready, free, done, Lse2, Delta, seqlen_q, diag, stride_lb, stride_lh,
                  GROUP: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr):
    """Producer: each warpgroup's K and V tiles once, then per stage a Q and a dO tile (TMA) and
    their rows' Lse2 and Delta (loaded and stored to shared memory here: TMA cannot address rows of
    any length), for every query head of the group and every query tile that sees the CTA's keys, in
    the order the consumers read them. A stage's `ready` completes with the TMA bytes and this warp's
    second arrival, after its stores. Last, each warpgroup's dK and dV (staged in its K and V buffers)
    go out by TMA, which drops keys past the sequence: the consumers hold no coordinates through their
    loop (at d 128 their registers have none to spare)."""
    vec: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    n0 = gl.program_id(0) * (2 * BLOCK_N)
    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    for side in gl.static_range(2):
        mbarrier.expect(kv_ready.index(side), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, n0 + side * BLOCK_N, off_hk, 0], kv_ready.index(side),
                                        k_smem.index(side))
        tma.async_copy_global_to_shared(v_desc, [off_b, n0 + side * BLOCK_N, off_hk, 0], kv_ready.index(side),
                                        v_smem.index(side))
    lo, hi = _dkv_query_tiles(n0, seqlen_q, diag, IS_CAUSAL, BLOCK_M)
    n_tiles = hi - lo
    for j in range(GROUP * n_tiles):
        off_h = off_hk * GROUP + j // n_tiles
        row = (lo + j % n_tiles) * BLOCK_M
        rows = row + gl.arange(0, BLOCK_M, layout=vec)
        head = off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh  # Delta's strides are Lse2's
        stage = j % NUM_STAGES
        # Barriers start in phase 0: the first pass over the ring finds every stage free.
        mbarrier.wait(free.index(stage), ((j // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, row, off_h, 0], ready.index(stage), q_smem.index(stage))
        tma.async_copy_global_to_shared(do_desc, [off_b, row, off_h, 0], ready.index(stage), do_smem.index(stage))
        # Rows past the sequence: Lse2 = +inf, so their P is 0.
        lse_smem.index(stage).store(gl.load(Lse2 + head + rows, mask=rows < seqlen_q, other=float("inf")))
        delta_smem.index(stage).store(gl.load(Delta + head + rows, mask=rows < seqlen_q, other=0.0))
        release(ready.index(stage))
    for side in gl.static_range(2):
        mbarrier.wait(done.index(side), 0)
        tma.async_copy_shared_to_global(dk_desc, [off_b, n0 + side * BLOCK_N, off_hk, 0], k_smem.index(side))
        tma.async_copy_shared_to_global(dv_desc, [off_b, n0 + side * BLOCK_N, off_hk, 0], v_smem.index(side))
    tma.store_wait(0)


@gluon.jit
def _dkv_tile(j, pos0, dk, dv, k, v, q_smem, do_smem, lse_smem, delta_smem, ready, free, qk_scale,
              IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              NUM_STAGES: gl.constexpr):
    """Stage j's BLOCK_M query rows of one head into this warpgroup's dK (unscaled) and dV. pos0: the
    tile's first query position less the warpgroup's first key n0. Causal calls mask the tiles where
    a query precedes one of the keys (pos0 < BLOCK_N - 1): key n0 + a sees query b of the tile when
    a <= pos0 + b. Rows past s_q have Lse2 = +inf (P^T = 0)."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    stage = j % NUM_STAGES
    mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
    q = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
    do = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
    zeros = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    s_t = warpgroup_mma(k, q.permute((1, 0)), zeros, use_acc=False, is_async=True)
    # Per-query vectors come from shared memory when used (in the products' column layout each holds
    # 16 registers a thread). dP^T accumulates onto -Delta: the product gives dP^T - Delta, and no
    # Delta vector is live beside P^T and dP^T later.
    dp_t = warpgroup_mma(v, do.permute((1, 0)), zeros - delta_smem.index(stage).load(cols)[None, :], is_async=True)
    s_t = warpgroup_mma_wait(1, deps=(s_t,))
    p_t = gl.exp2(s_t * qk_scale - lse_smem.index(stage).load(cols)[None, :])
    if IS_CAUSAL and pos0 < BLOCK_N - 1:
        # Key n0 + a may see query row + b when a - pos0 <= b: the key side changes every tile
        # (2 values a thread), the query side is the thread's column indices, computed here (inside
        # this branch nothing hoists them out of the loop, where they would hold 16 registers).
        key_off = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout)) - pos0
        p_t = gl.where(key_off[:, None] <= gl.arange(0, BLOCK_M, layout=cols)[None, :], p_t, 0.0)
    dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
    # dS^T before either operand is converted: the accumulators, P^T and dP^T are what is live here.
    ds_t = p_t * dp_t
    p_op = gl.convert_layout(p_t.to(q.dtype), operand)
    dv = warpgroup_mma(p_op, do, dv, is_async=True)
    ds_op = gl.convert_layout(ds_t.to(q.dtype), operand)
    dk = warpgroup_mma(ds_op, q, dk, is_async=True)
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op))
    release(free.index(stage))
    return dk, dv


@gluon.jit
def _dkv_consumer(common, SIDE: gl.constexpr, GROUP: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Consumer warpgroup SIDE: keys [n0 + SIDE * BLOCK_N, + BLOCK_N) of one (sequence, kv head), over
    every stage the producer fills (for the second warpgroup the CTA's first query tile may see none
    of its keys: the mask zeroes its P^T, cheaper than a separate path's registers). Leaves dK *
    sm_scale and dV in its K and V buffers for the producer's TMA stores, which drop keys past the
    sequence (a warpgroup past it computes rows that are never written)."""
    (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_ready, ready, free, done,
     qk_scale, sm_scale, seqlen_q, diag) = common
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    n_cta = gl.program_id(0) * (2 * BLOCK_N)
    shift = diag - (n_cta + SIDE * BLOCK_N)
    lo, hi = _dkv_query_tiles(n_cta, seqlen_q, diag, IS_CAUSAL, BLOCK_M)

    k_buf = k_smem.index(SIDE)
    v_buf = v_smem.index(SIDE)
    k = k_buf.reshape([BLOCK_N, HEAD_DIM])
    v = v_buf.reshape([BLOCK_N, HEAD_DIM])
    mbarrier.wait(kv_ready.index(SIDE), 0)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    j = 0  # the stage counter, as the producer's
    for _ in range(GROUP):
        for t in range(lo, hi):
            dk, dv = _dkv_tile(j, t * BLOCK_M + shift, dk, dv, k, v, q_smem, do_smem, lse_smem, delta_smem, ready,
                               free, qk_scale, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES)
            j += 1
    _stage_result(dk * sm_scale, k_buf, done.index(SIDE), BLOCK_N, HEAD_DIM)
    _stage_result(dv, v_buf, done.index(SIDE), BLOCK_N, HEAD_DIM)


@gluon.jit
def _attention_bwd_dkv_ws_kernel(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse2, Delta,
        qk_scale, sm_scale, seqlen_q, diag, stride_lb, stride_lh,
        GROUP: gl.constexpr, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """One program: dK and dV of 2 * BLOCK_N keys of one kv head of one sequence (grid: key tiles,
    h_kv, batch), summed over the GROUP query heads that read it (kv head hk serves query heads
    hk * GROUP ..) and every query tile that may see the keys; two consumer warpgroups of BLOCK_N keys
    and a producer warp. Descriptors cover q, dO ([b, s_q, h_q, d], blocks of BLOCK_M rows), k, v, dK,
    dV ([b, s_k, h_kv, d], blocks of BLOCK_N rows). Lse2 and Delta: the pre kernel's, [b, h_q, s_q]
    with strides (stride_lb, stride_lh, 1). Shared memory: both warpgroups' K and V (reused for dK and
    dV), NUM_STAGES stages of Q and of dO, the barriers. CONSUMER_REGS: registers per thread of the
    second warpgroup (setmaxnreg; the first gets what it and the producer leave)."""
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
    vectors: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], vectors)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], vectors)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for side in gl.static_range(2):
        mbarrier.init(kv_ready.index(side), count=1)
        mbarrier.init(done.index(side), count=2)  # dK and dV staged
    for stage in gl.static_range(NUM_STAGES):
        # The producer's expect (which arrives) and its arrival after storing Lse2 and Delta.
        mbarrier.init(ready.index(stage), count=2)
        mbarrier.init(free.index(stage), count=2)
    common = (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_ready, ready, free, done,
              qk_scale, sm_scale, seqlen_q, diag)
    gl.warp_specialize([
        (_dkv_consumer, (common, 0, GROUP, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)),
        (_dkv_consumer, (common, 1, GROUP, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)),
        (_dkv_producer, (q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                         lse_smem, delta_smem, kv_ready, ready, free, done, Lse2, Delta, seqlen_q, diag, stride_lb,
                         stride_lh, GROUP, IS_CAUSAL, BLOCK_M, BLOCK_N, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------- dQ
@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, ready, free,
                 seqlen_q, seqlen_k, GROUP: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Producer: each warpgroup's Q and dO tiles once, then per stage a K and a V tile of the kv head
    (TMA; keys past the sequence come back as zeros), for every key tile the CTA's rows may see."""
    m0 = query_tile(IS_CAUSAL) * (2 * BLOCK_M)
    off_h = gl.program_id(1)
    off_b = gl.program_id(2)
    off_hk = off_h // GROUP
    for side in gl.static_range(2):
        mbarrier.expect(q_ready.index(side), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, m0 + side * BLOCK_M, off_h, 0], q_ready.index(side),
                                        q_smem.index(side))
        tma.async_copy_global_to_shared(do_desc, [off_b, m0 + side * BLOCK_M, off_h, 0], q_ready.index(side),
                                        do_smem.index(side))
    for i in range(key_tiles(m0, 2 * BLOCK_M, seqlen_q, seqlen_k, IS_CAUSAL, BLOCK_N)):
        stage = i % NUM_STAGES
        # Barriers start in phase 0: the first pass over the ring finds every stage free.
        mbarrier.wait(free.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [off_b, i * BLOCK_N, off_hk, 0], ready.index(stage),
                                        k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [off_b, i * BLOCK_N, off_hk, 0], ready.index(stage),
                                        v_smem.index(stage))


@gluon.jit
def _dq_tile(i, dq, q, do, lse2, delta, pos, k_smem, v_smem, ready, free, seqlen_k, qk_scale,
             MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Key tile i into this warpgroup's dQ (unscaled): S = Q K^T and dP = dO V^T - Delta (async, the
    exponentials under the dP product), P = exp2(S * qk_scale - Lse2), dS = P (dP - Delta),
    dQ += dS K with dS in registers. MASKED zeroes P at keys past s_k and, causal, after a row's
    position `pos`. Rows past s_q have Lse2 = +inf (P = 0)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    stage = i % NUM_STAGES
    mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
    k = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    v = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    zeros = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q, k.permute((1, 0)), zeros, use_acc=False, is_async=True)
    # dP accumulates onto -Delta: no Delta-shaped tile is live beside P and dP later.
    dp = warpgroup_mma(do, v.permute((1, 0)), zeros - delta[:, None], is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    p = gl.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        cols = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        allowed = cols[None, :] < seqlen_k
        if IS_CAUSAL:
            allowed = allowed & (cols[None, :] <= pos[:, None])
        p = gl.where(allowed, p, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp,))
    ds_op = gl.convert_layout((p * dp).to(q.dtype), operand)
    dq = warpgroup_mma(ds_op, k, dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
    release(free.index(stage))
    return dq


@gluon.jit
def _dq_consumer(common, SIDE: gl.constexpr, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Consumer warpgroup SIDE: dQ of query rows [m0 + SIDE * BLOCK_M, + BLOCK_M) of one (sequence,
    query head) over every key tile the CTA visits (the first warpgroup's last tiles may be all
    masked); writes dQ * sm_scale through its Q buffer and a TMA store, which drops rows past s_q.
    Tiles [0, n_full) hold only keys every row of the warpgroup sees: no mask arithmetic there."""
    (dq_desc, q_smem, do_smem, k_smem, v_smem, q_ready, ready, free, Lse2, Delta, qk_scale, sm_scale,
     seqlen_q, seqlen_k, stride_lb, stride_lh) = common
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_cta = query_tile(IS_CAUSAL) * (2 * BLOCK_M)
    m0 = m_cta + SIDE * BLOCK_M
    off_h = gl.program_id(1)
    off_b = gl.program_id(2)
    diag = seqlen_k - seqlen_q
    n_tiles = key_tiles(m_cta, 2 * BLOCK_M, seqlen_q, seqlen_k, IS_CAUSAL, BLOCK_N)
    full_end = seqlen_k
    if IS_CAUSAL:
        full_end = gl.minimum(full_end, gl.maximum(diag + m0 + 1, 0))
    n_full = gl.minimum(full_end // BLOCK_N, n_tiles)
    # Per-row vectors in the products' row layout: 2 values a thread each, loaded once.
    rows = m0 + gl.arange(0, BLOCK_M, layout=s_rows)
    pos = diag + rows
    head = off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh  # Delta's strides are Lse2's
    lse2 = gl.load(Lse2 + head + rows, mask=rows < seqlen_q, other=float("inf"))
    delta = gl.load(Delta + head + rows, mask=rows < seqlen_q, other=0.0)

    q_buf = q_smem.index(SIDE)
    q = q_buf.reshape([BLOCK_M, HEAD_DIM])
    do = do_smem.index(SIDE).reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_ready.index(SIDE), 0)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    for i in range(0, n_full):
        dq = _dq_tile(i, dq, q, do, lse2, delta, pos, k_smem, v_smem, ready, free, seqlen_k, qk_scale,
                      False, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES)
    for i in range(n_full, n_tiles):
        dq = _dq_tile(i, dq, q, do, lse2, delta, pos, k_smem, v_smem, ready, free, seqlen_k, qk_scale,
                      True, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES)
    # Q is dead (its last product was waited for): its buffer stages dQ for one TMA store.
    q.store((dq * sm_scale).to(q.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dq_desc, [off_b, m0, off_h, 0], q_buf)
    tma.store_wait(0)


@gluon.jit
def _attention_bwd_dq_ws_kernel(
        q_desc, k_desc, v_desc, do_desc, dq_desc, Lse2, Delta,
        qk_scale, sm_scale, seqlen_q, seqlen_k, stride_lb, stride_lh,
        GROUP: gl.constexpr, IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """One program: dQ of 2 * BLOCK_M query rows of one query head of one sequence (the forward's grid:
    query tiles, causal ones last-first, h_q, batch), two consumer warpgroups of BLOCK_M rows and a
    producer warp streaming key tiles of kv head h // GROUP. Descriptors cover q, dO, dQ
    ([b, s_q, h_q, d], blocks of BLOCK_M rows), k, v ([b, s_k, h_kv, d], blocks of BLOCK_N rows).
    Lse2 and Delta: the pre kernel's, [b, h_q, s_q] with strides (stride_lb, stride_lh, 1). Shared
    memory: both warpgroups' Q (reused for dQ) and dO, NUM_STAGES stages of K and of V, the barriers.
    CONSUMER_REGS: registers per thread of the second warpgroup (as the forward's)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_M, 1, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for side in gl.static_range(2):
        mbarrier.init(q_ready.index(side), count=1)
    for stage in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(free.index(stage), count=2)  # both warpgroups done with the stage's K and V
    common = (dq_desc, q_smem, do_smem, k_smem, v_smem, q_ready, ready, free, Lse2, Delta, qk_scale, sm_scale,
              seqlen_q, seqlen_k, stride_lb, stride_lh)
    gl.warp_specialize([
        (_dq_consumer, (common, 0, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)),
        (_dq_consumer, (common, 1, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, ready, free,
                        seqlen_q, seqlen_k, GROUP, IS_CAUSAL, BLOCK_M, BLOCK_N, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------- launchers
def warpspec_dkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse2: torch.Tensor,
                 delta: torch.Tensor, sm_scale: float, causal: bool, config: LaunchConfig,
                 launch: Callable[..., Any] = triton_launch) -> tuple[torch.Tensor, torch.Tensor]:
    """dK and dV of padded [b, s, h, d] inputs that TMA can address (dout included), from the pre
    kernel's Lse2 and Delta ([b, h_q, s_q], rows contiguous), launched through `launch`. No tensor
    value is read on the host."""
    batch, s_q, h_q, _ = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    rows, keys = config.blocks["BLOCK_M"], config.blocks["BLOCK_N"]
    launch(
        _attention_bwd_dkv_ws_kernel, (cdiv(s_k, 2 * keys), h_kv, batch),
        descriptor(q, rows), descriptor(k, keys), descriptor(v, keys), descriptor(dout, rows),
        descriptor(dk, keys), descriptor(dv, keys), lse2, delta,
        sm_scale * LOG2E.value, sm_scale, s_q, s_k - s_q, lse2.stride(0), lse2.stride(1),
        GROUP=h_q // h_kv, IS_CAUSAL=causal, HEAD_DIM=q.shape[-1], **config.blocks, num_warps=4)
    return dk, dv


def warpspec_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse2: torch.Tensor,
                delta: torch.Tensor, sm_scale: float, causal: bool, config: LaunchConfig,
                launch: Callable[..., Any] = triton_launch) -> torch.Tensor:
    """dQ of padded [b, s, h, d] inputs that TMA can address (dout included), from the pre kernel's
    Lse2 and Delta ([b, h_q, s_q], rows contiguous), launched through `launch`. No tensor value is read
    on the host."""
    batch, s_q, h_q, _ = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rows, keys = config.blocks["BLOCK_M"], config.blocks["BLOCK_N"]
    launch(
        _attention_bwd_dq_ws_kernel, (cdiv(s_q, 2 * rows), h_q, batch),
        descriptor(q, rows), descriptor(k, keys), descriptor(v, keys), descriptor(dout, rows),
        descriptor(dq, rows), lse2, delta, sm_scale * LOG2E.value, sm_scale, s_q, s_k, lse2.stride(0), lse2.stride(1),
        GROUP=h_q // h_kv, IS_CAUSAL=causal, HEAD_DIM=q.shape[-1], **config.blocks, num_warps=4)
    return dq


def warpspec_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                      out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, args: Mapping, config: CallConfig,
                      launch: Callable[..., Any] = triton_launch
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward of a padded call whose q, k and v TMA can address: the tiled pre kernel (Delta,
    Lse2, d sinks), this file's dK/dV and dQ kernels, all through `launch`. Returns (dq, dk, dv, dsinks)."""
    dout, lse, delta, lse2, dsinks = backward_pre(q, sinks, out, lse, dout, args, config["bwd_pre"], launch)
    if not tma_addressable(dout):  # an expanded or oddly strided incoming gradient
        dout = dout.contiguous()
    sm_scale, causal = float(args["sm_scale"]), bool(args["causal"])
    dk, dv = warpspec_dkv(q, k, v, dout, lse2, delta, sm_scale, causal, config["bwd_dkv"], launch)
    dq = warpspec_dq(q, k, v, dout, lse2, delta, sm_scale, causal, config["bwd_dq"], launch)
    return dq, dk, dv, dsinks


# ----------------------------------------------------------------------------- config space
def dkv_shared_bytes(config: LaunchConfig, head_dim: int, elem: int = 2) -> int:
    """Shared memory of one dK/dV program: both warpgroups' K and V tiles, NUM_STAGES stages of Q, dO,
    Lse2 and Delta, the barriers (sm_90 compiles allocate this plus ~100 B of alignment and the
    layout conversions' scratch)."""
    blocks = config.blocks
    rows, stages = blocks["BLOCK_M"], blocks["NUM_STAGES"]
    return (elem * head_dim * (4 * blocks["BLOCK_N"] + 2 * stages * rows) + 8 * rows * stages
            + 8 * (4 + 2 * stages))


def fits_dkv_consumers(config: LaunchConfig, key: Mapping) -> bool:
    """Keep: 64-row query tiles only at d 64 (at d 128 the dK and dV accumulators, S^T and dP^T of
    64 queries leave a consumer no register to spare: causal sm_90 compiles spill 8 B), and at most
    128 query rows in the ring."""
    blocks = config.blocks
    if blocks["BLOCK_M"] > 32 and key["d"] > 64:
        return False
    return blocks["NUM_STAGES"] * blocks["BLOCK_M"] <= 128


# BLOCK_M: query rows per streamed tile; BLOCK_N: keys per consumer warpgroup (wgmma's M: one
# warpgroup's 64 rows); NUM_STAGES: the Q/dO ring; CONSUMER_REGS: as the forward's.
DKV_SPACE = ConfigSpace(
    blocks={"BLOCK_M": (32, 64), "BLOCK_N": (64,), "NUM_STAGES": (2, 3, 4), "CONSUMER_REGS": (232, 240)},
    knobs={"num_warps": (4,)},
    keep=fits_dkv_consumers,
    defaults={"*": {"BLOCK_M": 32, "BLOCK_N": 64, "NUM_STAGES": 4, "CONSUMER_REGS": 240, "num_warps": 4}},
)
# Per head dim, the fields that change the space's default: d 64 streams 64-row tiles, two stages.
DKV_HEAD_DIM_DEFAULTS = ((64, {"BLOCK_M": 64, "NUM_STAGES": 2}), (128, {}))


# ----------------------------------------------------------------------------- offline compiles


# ----------------------------------------------------------------------------- dQ config space
def dq_shared_bytes(config: LaunchConfig, head_dim: int, elem: int = 2) -> int:
    """Shared memory of one dQ program: both warpgroups' Q and dO tiles, NUM_STAGES stages of K and V,
    the barriers."""
    blocks = config.blocks
    stages = blocks["NUM_STAGES"]
    return elem * head_dim * (4 * blocks["BLOCK_M"] + 2 * stages * blocks["BLOCK_N"]) + 8 * (2 + 2 * stages)


def fits_dq_consumers(config: LaunchConfig, key: Mapping) -> bool:
    """Keep: 128-key tiles at d 128 only with 240 consumer registers (dQ, S and dP of 64 rows: causal
    sm_90 compiles spill 16 B at 232), and at most 256 keys in the ring (two 128-key stages at d 128
    already take 192 KB with Q and dO)."""
    blocks = config.blocks
    if blocks["BLOCK_N"] > 64 and key["d"] > 64 and blocks["CONSUMER_REGS"] < 240:
        return False
    return blocks["NUM_STAGES"] * blocks["BLOCK_N"] <= 256


# BLOCK_M: query rows per consumer warpgroup (a CTA has two; wgmma's M); BLOCK_N: keys per streamed
# tile; NUM_STAGES: the K/V ring; CONSUMER_REGS: as the forward's.
DQ_SPACE = ConfigSpace(
    blocks={"BLOCK_M": (64,), "BLOCK_N": (64, 128), "NUM_STAGES": (2, 3, 4), "CONSUMER_REGS": (232, 240)},
    knobs={"num_warps": (4,)},
    keep=fits_dq_consumers,
    defaults={"*": {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 2, "CONSUMER_REGS": 240, "num_warps": 4}},
)
# Per head dim, the fields that change the space's default (none: 64 x 128 with two stages at both).
DQ_HEAD_DIM_DEFAULTS = ((128, {}),)


