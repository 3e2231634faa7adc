"""The attention family's forward as a warp-specialized Gluon kernel for Hopper (sm_90), FlashAttention-3's
schedule; flash_attention and sink_attention register it (kernels/nvidia/flash_attention.py,
kernels/nvidia/sink_attention.py). Their backward runs the tiled pre kernel, then the
warp-specialized dK/dV and dQ kernels of kernels/nvidia/attention_warpspec_bwd.py (`run_backward`).

Why a vendor file: the plain-Triton forward (kernels/common/attention/forward.py) stays near 0.8x torch SDPA at
d 128 on an H200 (benchmarks/NOTES.md): each of its warps loads, multiplies and exponentiates in turn,
and Triton 3.6's own warp specialization of that loop was wrong under masks. Gluon lets the kernel say
who does what, as sparse_mla's warp-specialized forward does:

- a producer warp issues TMA loads (4-D tensor descriptors over [b, s, h, d], so rows past a sequence
  come back as zeros): each consumer's query rows once, then K and V tiles into a ring of NUM_STAGES
  stages, K and V with their own `ready` and `free` mbarriers (K of the next tile streams in while V
  of the current one is still read);
- CONSUMERS (2 or 3) consumer warpgroups own BLOCK_M query rows each (a CTA covers CONSUMERS * BLOCK_M
  rows) and walk the same key tiles. Per tile a warpgroup issues S = Q K^T (wgmma, async) together
  with the previous tile's O += P V, waits for S only, and runs the online softmax (fp32, exp2) while
  P V still runs on the tensor cores (FA3's intra-warpgroup overlap; MMA_WAITS 1 waits for both
  products first, which frees P's registers for the softmax); P stays in registers as the A operand;
- the warpgroups take turns issuing their products, round robin (an mbarrier each: a warpgroup waits
  for its turn, issues, and hands the turn to the next), so one's softmax runs under the others'
  products (FA3's ping-pong). Three warpgroups are FA3's choice at d 64, where the exponentials cost
  as much as the products: two others' products to hide a softmax under, in 160 registers each
  instead of 240.

Causal calls visit only key tiles at or below the CTA's last diagonal; per warpgroup the tiles every
row fully sees run without mask arithmetic, the rest (diagonal, key tail) with it. Sinks scale the
output once at the end (out * sigmoid(lse - sink)), as the tiled kernel does; lse excludes the sink.

Not served here (the variants' `supports` declines them, so dispatch picks the tiled kernel): windows,
head dims other than 64 and 128, fp32, devices other than sm_90. Varlen calls and inputs a TMA
descriptor cannot address (a base not 16-byte aligned, a row or head stride not a multiple of 8
elements) share a tuning key with padded ones, so this forward hands them to the tiled kernel itself
(with the tiled variant's default forward config for the key). Gluon kernels do not run in the Triton
interpreter: CI compiles this one for sm_90 (tests/test_attention_warpspec.py) and the GPU tests
compare it with the reference in bf16. Semantics: `ops.flash_attention.reference`,
`ops.sink_attention.reference`.
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
from kreg.kernels.common.attention.backward import attention_backward
from kreg.kernels.common.attention.forward import attention_forward
from kreg.kernels.common.constants import LN2, LOG2E
from kreg.kernels.common.launch import kept_arguments, launch_signed, signature_key, triton_launch
from kreg.kernels.common.tiles import cdiv
from kreg.kernels.nvidia.attention_tma import (
    PRODUCER_REGS,
    descriptor_makers,
    key_tiles,
    padded_outputs,
    query_tile,
    release,
    tma_addressable_qkv,
)
from kreg.kernels.nvidia.attention_warpspec_bwd import (
    DKV_HEAD_DIM_DEFAULTS,
    DKV_SPACE,
    DQ_HEAD_DIM_DEFAULTS,
    DQ_SPACE,
    _attention_bwd_dkv_ws_kernel,
    _attention_bwd_dq_ws_kernel,
    dkv_shared_bytes,
    dq_shared_bytes,
    warpspec_backward,
)
from kreg.ops.variant import CallPlan

HEAD_DIMS = (64, 128)


# ----------------------------------------------------------------------------- Gluon kernel
@gluon.jit
def _load_stage(desc, ring, ready, free, i, off_b, off_hk, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Key tile i of one (sequence, kv head) from `desc` into its stage of `ring`, once the stage's
    previous tile is released; `ready` completes when the bytes have landed."""
    stage = i % NUM_STAGES
    # Barriers start in phase 0: the first pass over the ring finds every stage free.
    mbarrier.wait(free.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(stage), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [off_b, i * BLOCK_N, off_hk, 0], ready.index(stage), ring.index(stage))


@gluon.jit
def _load_tiles(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free, v_free,
                seqlen_q, seqlen_k,
                GROUP: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """Producer: each warpgroup's BLOCK_M query rows, then K and V tiles in the order the consumers
    read them (K of tile i before V of tile i - 1)."""
    m0 = query_tile(IS_CAUSAL) * (CONSUMERS * BLOCK_M)
    off_h = gl.program_id(1)
    off_b = gl.program_id(2)
    off_hk = off_h // GROUP
    for side in gl.static_range(CONSUMERS):
        mbarrier.expect(q_ready.index(side), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, m0 + side * BLOCK_M, off_h, 0], q_ready.index(side),
                                        q_smem.index(side))
    n_tiles = key_tiles(m0, CONSUMERS * BLOCK_M, seqlen_q, seqlen_k, IS_CAUSAL, BLOCK_N)
    for i in range(n_tiles + 1):
        if i < n_tiles:
            _load_stage(k_desc, k_smem, k_ready, k_free, i, off_b, off_hk, BLOCK_N, NUM_STAGES)
        if i > 0:
            _load_stage(v_desc, v_smem, v_ready, v_free, i - 1, off_b, off_hk, BLOCK_N, NUM_STAGES)


@gluon.jit
def _softmax_step(s, m_i, l_i, cols, pos, seqlen_k, qk_scale, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Online softmax over one tile of raw scores `s` in log2 units: (P, the factor for the old
    accumulator, row sums, row maxima). MASKED applies the key-length and causal masks; rows that saw
    no allowed key yet keep m = -inf and shift by 0, so exp2 gives 0, not NaN."""
    s = s * qk_scale
    if MASKED:
        allowed = cols[None, :] < seqlen_k
        if IS_CAUSAL:
            allowed = allowed & (cols[None, :] <= pos[:, None])
        s = gl.where(allowed, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_shift = m_new
    if MASKED:
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)
    return p, alpha, l_i * alpha + gl.sum(p, 1), m_new


@gluon.jit
def _attend_tile(i, acc, p, alpha, m_i, l_i, q, k_smem, v_smem, k_ready, v_ready, k_free, v_free, my_turn,
                 peer_turn, pos, seqlen_k, qk_scale,
                 MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, MMA_WAITS: gl.constexpr):
    """Key tile i >= 1: issue S_i = Q K_i^T and O += P_{i-1} V_{i-1} in this warpgroup's turn, take the
    softmax step of S_i and release both stages. MMA_WAITS 2: wait for S alone and run the softmax
    while the P V product runs (FA3's intra-warpgroup overlap); 1: wait for both products first."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    k_stage = i % NUM_STAGES
    v_stage = (i - 1) % NUM_STAGES
    mbarrier.wait(my_turn, i & 1)
    mbarrier.wait(k_ready.index(k_stage), (i // NUM_STAGES) & 1)
    k = k_smem.index(k_stage).reshape([BLOCK_N, HEAD_DIM])
    s = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                      is_async=True)
    # The accumulator is idle here (the last P V was waited for): rescale it under the S product.
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    mbarrier.wait(v_ready.index(v_stage), ((i - 1) // NUM_STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(v_stage).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    mbarrier.arrive(peer_turn, count=1)
    if MMA_WAITS == 2:
        s = warpgroup_mma_wait(1, deps=(s,))
        release(k_free.index(k_stage))
        cols = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p_new, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, cols, pos, seqlen_k, qk_scale, MASKED, IS_CAUSAL)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        release(v_free.index(v_stage))
    else:
        # Both products first: P's registers are free for the softmax (the other warpgroups' products
        # run under it instead).
        s, acc, p = warpgroup_mma_wait(0, deps=(s, acc, p))
        gl.thread_barrier()
        mbarrier.arrive(k_free.index(k_stage), count=1)
        mbarrier.arrive(v_free.index(v_stage), count=1)
        cols = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p_new, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, cols, pos, seqlen_k, qk_scale, MASKED, IS_CAUSAL)
    p = gl.convert_layout(p_new.to(q.dtype), p_operand)
    return acc, p, alpha, m_i, l_i


@gluon.jit
def _attend(common, SIDE: gl.constexpr, GROUP: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_SINKS: gl.constexpr,
            RETURN_LSE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr, MMA_WAITS: gl.constexpr):
    """Consumer warpgroup SIDE of CONSUMERS: query rows [m0 + SIDE * BLOCK_M, + BLOCK_M) of one
    (sequence, query head) over every key tile the CTA visits; writes their out (through its Q buffer
    and a TMA store, which drops rows past the sequence) and, with RETURN_LSE, their natural-log lse. A
    row with no allowed key gets out 0 and lse +inf. It issues its products in its turn and hands the
    turn to warpgroup SIDE + 1 (the last to warpgroup 0)."""
    (o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free, v_free, turns, Sinks, Lse,
     qk_scale, seqlen_q, seqlen_k, stride_lb, stride_lh) = common
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    m_cta = query_tile(IS_CAUSAL) * (CONSUMERS * BLOCK_M)
    m0 = m_cta + SIDE * BLOCK_M
    off_h = gl.program_id(1)
    off_b = gl.program_id(2)
    my_turn = turns[SIDE]
    peer_turn = turns[(SIDE + 1) % CONSUMERS]
    diag = seqlen_k - seqlen_q
    n_tiles = key_tiles(m_cta, CONSUMERS * BLOCK_M, seqlen_q, seqlen_k, IS_CAUSAL, BLOCK_N)
    # Tiles [0, n_full) hold only keys every row of this warpgroup sees: no mask arithmetic there.
    full_end = seqlen_k
    if IS_CAUSAL:
        full_end = gl.minimum(full_end, gl.maximum(diag + m0 + 1, 0))
    n_full = gl.minimum(full_end // BLOCK_N, n_tiles)
    pos = diag + m0 + gl.arange(0, BLOCK_M, layout=s_rows)

    q_buf = q_smem.index(SIDE)
    q = q_buf.reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_ready.index(SIDE), 0)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    alpha = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    p = gl.zeros([BLOCK_M, BLOCK_N], q.dtype, layout=p_operand)
    if n_tiles > 0:
        # Tile 0: its scores alone (the masked step: it may hold the diagonal).
        mbarrier.wait(my_turn, 0)
        mbarrier.wait(k_ready.index(0), 0)
        k = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        mbarrier.arrive(peer_turn, count=1)
        s = warpgroup_mma_wait(0, deps=(s,))
        release(k_free.index(0))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p_new, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, cols, pos, seqlen_k, qk_scale, True, IS_CAUSAL)
        p = gl.convert_layout(p_new.to(q.dtype), p_operand)
    for i in range(1, n_full):
        acc, p, alpha, m_i, l_i = _attend_tile(i, acc, p, alpha, m_i, l_i, q, k_smem, v_smem, k_ready, v_ready,
                                               k_free, v_free, my_turn, peer_turn, pos, seqlen_k, qk_scale,
                                               False, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, MMA_WAITS)
    for i in range(gl.maximum(n_full, 1), n_tiles):
        acc, p, alpha, m_i, l_i = _attend_tile(i, acc, p, alpha, m_i, l_i, q, k_smem, v_smem, k_ready, v_ready,
                                               k_free, v_free, my_turn, peer_turn, pos, seqlen_k, qk_scale,
                                               True, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, MMA_WAITS)
    if n_tiles > 0:
        # The last tile's P V, in this warpgroup's turn like every product.
        last = n_tiles - 1
        mbarrier.wait(my_turn, n_tiles & 1)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        mbarrier.wait(v_ready.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last % NUM_STAGES).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        mbarrier.arrive(peer_turn, count=1)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        release(v_free.index(last % NUM_STAGES))

    l_o = gl.convert_layout(l_i, o_rows)
    empty = l_o == 0.0
    lse2 = gl.convert_layout(m_i, o_rows) + gl.log2(gl.where(empty, 1.0, l_o))  # log2 units
    scale = 1.0 / gl.where(empty, 1.0, l_o)
    if HAS_SINKS:
        sink = gl.load(Sinks + off_h) * LOG2E
        # sigmoid(lse - sink): the sink's share of the softmax taken out, in log2 units.
        scale = scale / (1.0 + gl.exp2(sink - gl.where(empty, 0.0, lse2)))
    out = acc * gl.where(empty, 0.0, scale)[:, None]
    # Q is dead (its last product was waited for): its buffer stages the tile for one TMA store.
    q.store(out.to(q.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(o_desc, [off_b, m0, off_h, 0], q_buf)
    if RETURN_LSE:
        rows = m0 + gl.arange(0, BLOCK_M, layout=o_rows)
        lse_row = Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
        gl.store(lse_row + rows, gl.where(empty, float("inf"), lse2 * LN2), mask=rows < seqlen_q)
    tma.store_wait(0)


@gluon.jit
def _attention_fwd_ws_kernel(
        q_desc, k_desc, v_desc, o_desc, Sinks, Lse,
        qk_scale, seqlen_q, seqlen_k, stride_lb, stride_lh,
        GROUP: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_SINKS: gl.constexpr, RETURN_LSE: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, MMA_WAITS: gl.constexpr):
    """One program: CONSUMERS * BLOCK_M query rows of one query head of one sequence (grid: query tiles,
    h_q, batch), CONSUMERS (2 or 3) consumer warpgroups of BLOCK_M rows and a producer warp. Query head
    h reads kv head h // GROUP. The descriptors cover q, k, v and out as [b, s, h, d] with blocks
    [1, rows, 1, d]. Shared memory: every warpgroup's Q tile (reused for out), NUM_STAGES stages of K
    and of V, the barriers. CONSUMER_REGS: registers per thread of each consumer warpgroup but the
    first (the default partition, which gets what the others and the producer leave of the CTA's)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, BLOCK_M, 1, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    # Each warpgroup's turn to issue products, a barrier of its own (a warpgroup waits on its own and
    # arrives on the next one's; in one allocation the compiler would order them with a CTA barrier).
    if CONSUMERS == 2:
        turns = (gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()),
                 gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()))
    else:
        turns = (gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()),
                 gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()),
                 gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()))
    for side in gl.static_range(CONSUMERS):
        mbarrier.init(turns[side], count=1)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for side in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(side), count=1)
    for stage in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(stage), count=1)
        mbarrier.init(v_ready.index(stage), count=1)
        mbarrier.init(k_free.index(stage), count=CONSUMERS)
        mbarrier.init(v_free.index(stage), count=CONSUMERS)
    # Warpgroup 0 takes the first turn.
    mbarrier.arrive(turns[0], count=1)
    common = (o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free, v_free, turns, Sinks, Lse,
              qk_scale, seqlen_q, seqlen_k, stride_lb, stride_lh)
    # The partitions are a list the compiler reads as written: one call per count of consumers.
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_attend, (common, 0, GROUP, IS_CAUSAL, HAS_SINKS, RETURN_LSE, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                       CONSUMERS, MMA_WAITS)),
            (_attend, (common, 1, GROUP, IS_CAUSAL, HAS_SINKS, RETURN_LSE, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                       CONSUMERS, MMA_WAITS)),
            (_load_tiles, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free,
                           v_free, seqlen_q, seqlen_k, GROUP, IS_CAUSAL, BLOCK_M, BLOCK_N, NUM_STAGES, CONSUMERS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_attend, (common, 0, GROUP, IS_CAUSAL, HAS_SINKS, RETURN_LSE, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                       CONSUMERS, MMA_WAITS)),
            (_attend, (common, 1, GROUP, IS_CAUSAL, HAS_SINKS, RETURN_LSE, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                       CONSUMERS, MMA_WAITS)),
            (_attend, (common, 2, GROUP, IS_CAUSAL, HAS_SINKS, RETURN_LSE, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                       CONSUMERS, MMA_WAITS)),
            (_load_tiles, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_free,
                           v_free, seqlen_q, seqlen_k, GROUP, IS_CAUSAL, BLOCK_M, BLOCK_N, NUM_STAGES, CONSUMERS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------- launcher
def warpspec_forward(args: Mapping, config: LaunchConfig, keep_lse: bool, launch: Callable[..., Any] = triton_launch,
                     prepared: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Allocate out (and lse, when returned or kept for a backward) and run the warp-specialized forward
    on padded [b, s, h, d] inputs that `tma_addressable` accepts. No tensor value is read on the host.
    With `prepared` (a dict a plan keeps, given with the config it always gets), the launch's grid,
    scalars and constexprs are kept per call signature (the shapes, dtypes and flags they are made
    from), and a `LaunchCache` launches by that signature."""
    q, k, v = args["q"], args["k"], args["v"]
    sinks = args.get("sinks")
    out, lse = padded_outputs(q, keep_lse, args["return_lse"])
    signature = (q.shape, k.shape, q.dtype, None if sinks is None else sinks.dtype, lse is None, args["causal"])
    grid, scalars, constexprs, makers, key = kept_arguments(prepared, signature, _forward_launch, config, *signature)
    # q, k, v and out go as tensors: the launch makes their descriptors (on a signature seen before it
    # encodes their tensor maps without making any).
    launch_signed(launch, key if prepared is not None else None, _attention_fwd_ws_kernel, grid,
                  (q, k, v, out, sinks, out if lse is None else lse, float(args["sm_scale"]) * LOG2E.value, *scalars),
                  constexprs, makers)
    return out, lse


def _forward_launch(config: LaunchConfig, q_shape: tuple, k_shape: tuple, dtype: torch.dtype, sinks_dtype,
                    no_lse: bool, causal: bool) -> tuple[tuple, tuple, dict, tuple, int]:
    """(grid, scalars after sm_scale, keyword arguments, descriptor makers, signature key) of one call
    signature's launch."""
    batch, s_q, h_q, d = q_shape
    s_k, h_kv = k_shape[1], k_shape[2]
    # lse is allocated contiguous [b, h, s]: its strides follow from the shape.
    lse_strides = (0, 0) if no_lse else (h_q * s_q, s_q)
    constexprs = dict(GROUP=h_q // h_kv, IS_CAUSAL=bool(causal), HAS_SINKS=sinks_dtype is not None,
                      RETURN_LSE=not no_lse, HEAD_DIM=d, **config.blocks, num_warps=4)
    rows, keys = config.blocks["BLOCK_M"], config.blocks["BLOCK_N"]
    grid = (cdiv(s_q, config.blocks["CONSUMERS"] * rows), h_q, batch)
    makers = descriptor_makers((rows, 1), (keys, 1), (keys, 1), (rows, 1))
    return grid, (s_q, s_k, *lse_strides), constexprs, makers, signature_key()


# ----------------------------------------------------------------------------- the variants
def shared_bytes(config: LaunchConfig, head_dim: int, elem: int = 2) -> int:
    """Shared memory of one program: every warpgroup's Q tile, NUM_STAGES stages of K and of V, the
    barriers (matches sm_90 compiles up to the alignment of the barriers)."""
    blocks = config.blocks
    consumers = blocks["CONSUMERS"]
    tiles = consumers * blocks["BLOCK_M"] + 2 * blocks["NUM_STAGES"] * blocks["BLOCK_N"]
    return elem * head_dim * tiles + 8 * (2 * consumers + 4 * blocks["NUM_STAGES"])


def fits_consumers(config: LaunchConfig, key: Mapping) -> bool:
    """Keep what fits a consumer's registers without spills on sm_90 and at most 384 keys in the ring
    (deeper rings hold more than the loads need to stay ahead).

    Two consumers (232 or 240 registers each, what the producer's 24 leave of 504 a thread; MMA_WAITS 2,
    the schedule measured since version 4): 128 rows per warpgroup only with 64-key tiles at d 64 (the
    scores, P and the output accumulator of 128 rows spill otherwise: 144-272 B at d 128). Three
    (160 registers, the first 168, of 512): 64 rows per warpgroup; 128-key tiles only at d 64 with
    MMA_WAITS 1 (S, P and O held at once through the softmax spill 96 B there; at d 128 128-key tiles
    spill 152-216 B either way)."""
    blocks = config.blocks
    if blocks["CONSUMERS"] == 2:
        if blocks["CONSUMER_REGS"] not in (232, 240) or blocks["MMA_WAITS"] != 2:
            return False
        if blocks["BLOCK_M"] == 128 and (blocks["BLOCK_N"] != 64 or key["d"] > 64):
            return False
    else:
        if blocks["CONSUMER_REGS"] != 160 or blocks["BLOCK_M"] != 64:
            return False
        if blocks["BLOCK_N"] == 128 and (key["d"] > 64 or blocks["MMA_WAITS"] == 2):
            return False
    return blocks["NUM_STAGES"] * blocks["BLOCK_N"] <= 384


# BLOCK_M: query rows per consumer warpgroup; NUM_STAGES: K/V ring depth; CONSUMERS: consumer
# warpgroups (a CTA covers CONSUMERS * BLOCK_M rows); CONSUMER_REGS: registers of each consumer but the
# first (setmaxnreg; the first gets what the others and the producer leave); MMA_WAITS: see
# `_attend_tile`. A tuned entry from before CONSUMERS and MMA_WAITS existed completes with the defaults'
# 2 and 2, the kernel it was measured with. 16 configs at d 128, 24 at d 64 (`fits_consumers`).
FORWARD_SPACE = ConfigSpace(
    blocks={"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "NUM_STAGES": (2, 3, 4), "CONSUMERS": (2, 3),
            "CONSUMER_REGS": (160, 232, 240), "MMA_WAITS": (2, 1)},
    knobs={"num_warps": (4,)},
    keep=fits_consumers,
    defaults={"*": {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 2, "CONSUMERS": 2, "CONSUMER_REGS": 240,
                    "MMA_WAITS": 2, "num_warps": 4}},
)
# Per head dim, the fields that change the space's default (the first row whose head dim fits): d 128
# has room for two 128-key stages beside Q (164 KB), d 64 for three (115 KB).
FORWARD_HEAD_DIM_DEFAULTS = ((64, {"NUM_STAGES": 3}), (128, {}))


def _served(args: Mapping, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the warp-specialized kernels take a call: padded (not varlen) and q, k and v addressable
    by TMA (varlen calls and other strides share a tuning key with the calls they serve)."""
    return args["cu_seqlens_q"] is None and tma_addressable_qkv(q, k, v)


# The roles with kernels of their own here: (HEAD_DIM_DEFAULTS rows, shared-memory estimate).
_OWN_ROLES = {"fwd": (FORWARD_HEAD_DIM_DEFAULTS, shared_bytes), "bwd_dkv": (DKV_HEAD_DIM_DEFAULTS, dkv_shared_bytes),
              "bwd_dq": (DQ_HEAD_DIM_DEFAULTS, dq_shared_bytes)}


class AttentionWarpSpecHopper:
    """The warp-specialized kernels' variant logic, mixed in before a tiled NVIDIA variant; each op
    file registers one, setting `name` and `tiled` (that tiled variant's class). Its roles and kernels
    are the tiled variant's but for the forward's (this kernel, FORWARD_SPACE), dK/dV's and dQ's
    (kernels/nvidia/attention_warpspec_bwd.py, DKV_SPACE, DQ_SPACE); "bwd_pre" is the tiled kernel
    with the tiled space. The calls these kernels hand over run the tiled kernels with the tiled
    variant's default configs for those roles.

    Hopper only (wgmma, TMA, setmaxnreg); head dims 64 and 128, fp16/bf16, no window. Higher priority
    than the tiled variant: the default where it runs and no tuned entry names another."""

    priority = 10
    runs_in_interpreter = False
    tiled: type

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.kernels = {**cls.tiled.kernels, "fwd": _attention_fwd_ws_kernel, "bwd_dkv": _attention_bwd_dkv_ws_kernel,
                       "bwd_dq": _attention_bwd_dq_ws_kernel}
        cls.spaces = {**cls.tiled.spaces, "fwd": FORWARD_SPACE, "bwd_dkv": DKV_SPACE, "bwd_dq": DQ_SPACE}

    def supports(self, key: dict, device) -> bool:
        return (device.arch == "sm_90" and key["dtype"] in ("fp16", "bf16") and key["d"] in HEAD_DIMS
                and key["window"] is None)

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        if role not in _OWN_ROLES:
            return super().role_default(role, key, device)
        base = self.spaces[role].default(device)
        fields = {**base.blocks, **base.knobs()}
        fields.update(next((row for d_max, row in _OWN_ROLES[role][0] if key["d"] <= d_max), {}))
        config = self.spaces[role].make(fields)
        # A device with less shared memory than an H100/H200: fewer stages.
        while self.prune_reason(role, config, key, device) is not None and config.blocks["NUM_STAGES"] > 2:
            config = config.model_copy(update={"blocks": {**config.blocks,
                                                          "NUM_STAGES": config.blocks["NUM_STAGES"] - 1}})
        return config

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        if role not in _OWN_ROLES:
            return super().prune_reason(role, config, key, device)
        expected = set(self.spaces[role].blocks)
        if set(config.blocks) != expected:
            return f"blocks must be {sorted(expected)}, got {sorted(config.blocks)}"
        need = _OWN_ROLES[role][1](config, key["d"])
        if need > device.shared_mem_bytes:
            return f"needs ~{need} B of shared memory (> {device.shared_mem_bytes} B)"
        return None

    def launchers(self, plan: CallPlan) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
        """This forward, and the tiled pre kernel followed by the warp-specialized dK/dV and dQ kernels;
        varlen calls and inputs TMA cannot address go to the tiled kernels with the tiled variant's
        default configs for the plan's key and device."""
        tiled, own, prepared = self.fallback(plan), plan.config["fwd"], {}

        def forward(args: Mapping, config: LaunchConfig, keep_lse: bool,
                    launch: Callable[..., Any] = triton_launch) -> tuple[torch.Tensor, torch.Tensor | None]:
            if _served(args, args["q"], args["k"], args["v"]):
                return warpspec_forward(args, config, keep_lse, launch, prepared if config is own else None)
            return attention_forward(args, tiled["fwd"], keep_lse, launch)

        def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                     out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, args: Mapping, config: CallConfig,
                     launch: Callable[..., Any] = triton_launch
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
            if _served(args, q, k, v):
                return warpspec_backward(q, k, v, sinks, out, lse, dout, args, config, launch)
            handed = config.replace("bwd_dkv", tiled["bwd_dkv"]).replace("bwd_dq", tiled["bwd_dq"])
            return attention_backward(q, k, v, sinks, out, lse, dout, args, handed, launch)

        return forward, backward

    def fallback(self, plan: CallPlan) -> CallConfig:
        """The tiled variant's default call config for the plan's key and device: what the calls this
        kernel hands over run (made once per key and device)."""
        cache = self.__dict__.setdefault("_fallbacks", {})
        where = (plan.device.key, tuple(sorted(plan.key.items())))
        found = cache.get(where)
        if found is None:
            found = cache[where] = self.tiled().default_config(dict(plan.key), plan.device)
        return found
