"""What the two warp-specialized sparse_mla kernels for Hopper share: the program's grid coordinates,
its query's slot count and index row, and the cp.async of a program's rows of Q (or dO) into shared
memory; and the backward's producer partition, which gathers the selected latent rows into a ring of
shared-memory stages. The forward is in kernels/nvidia/sparse_mla.py (its producer fills two buffers
half by half, its own), the backward in kernels/nvidia/sparse_mla_warpspec_bwd.py.

Both producers write each slot's row index beside the rows (-1 for an invalid index or a slot past
topk_length): the consumers mask their scores and address their dkv atomics with it, never reading
the index tensor themselves (with per-thread index loads in a consumer, LLVM hoists their addresses
above the partitions' register hand-off and ptxas spills them).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier

# Kernels can only read globals that are constexprs (Python code reads `.value`).
COLS = gl.constexpr(64)  # columns per copy chunk and width of the rope-tail tiles (128 bytes: one swizzle row)
PRODUCER_REGS = gl.constexpr(56)  # registers per producer thread


@gluon.jit
def _program_coords(head_blocks):
    """(query t, kv group g, head block hb, batch row b as int64) of this program, in the grid of
    kernels.common.sparse_mla._grid."""
    return (gl.program_id(0), gl.program_id(1) // head_blocks, gl.program_id(1) % head_blocks,
            gl.program_id(2).to(gl.int64))


@gluon.jit
def _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                 HAS_TOPK_LEN: gl.constexpr):
    """(slots to visit, the index row) of query t of kv group g of batch row b (b as int64)."""
    n_slots = topk
    if HAS_TOPK_LEN:
        n_slots = gl.minimum(gl.load(TOPK_LEN + b * stride_lb + t.to(gl.int64) * stride_ls), topk)
    return n_slots, IDX + b * stride_ib + t.to(gl.int64) * stride_is + g.to(gl.int64) * stride_ih


@gluon.jit
def _allocate_ring(NUM_STAGES: gl.constexpr, BLOCK_TOPK: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """The producer's ring bookkeeping, initialized: each stage's slot rows, its `ready` barrier (every
    producer thread's copies plus one arrival for the rows) and its `free` barrier (one arrival from
    each of the two consumer warpgroups)."""
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    slot_rows = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_TOPK], vec)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=PRODUCER_WARPS * 32 + 1)
        mbarrier.init(free.index(s), count=2)
    return slot_rows, ready, free


@gluon.jit
def _gather_blocks(KV, IDX, TOPK_LEN, k_main, k_tail, slot_rows, ready, free,
                   s_kv, topk, head_blocks,
                   stride_kvb, stride_kvs, stride_kvh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                   D_V: gl.constexpr, D_TAIL: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                   STEP: gl.constexpr):
    """Producer: top-k block i (k_main's second dim of slots) into stage i % (k_main's first dim), with
    its slots' row indices, in whole steps of STEP blocks (the consumers take STEP at a time; a last
    partial step is padded with all-invalid blocks). A stage's `ready` completes when every producer
    thread's copies have landed (no-increment arrivals) and the rows are written (one arrival)."""
    NUM_STAGES: gl.constexpr = k_main.shape[0]
    BLOCK_TOPK: gl.constexpr = k_main.shape[1]
    # 8 contiguous 16-bit values (one 16-byte cp.async) per thread, 8 threads per 64-column row chunk.
    chunk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    t, g, _, b = _program_coords(head_blocks)
    n_slots, idx_row = _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb,
                                    stride_ls, HAS_TOPK_LEN)
    kv_base = KV + b * stride_kvb + g.to(gl.int64) * stride_kvh
    offs_t = gl.arange(0, BLOCK_TOPK, layout=gl.SliceLayout(1, chunk))
    offs_c = gl.arange(0, COLS, layout=gl.SliceLayout(0, chunk))
    for i in range(gl.cdiv(n_slots, STEP * BLOCK_TOPK) * STEP):
        stage = i % NUM_STAGES
        # Barriers start in phase 0, so the first pass over the ring finds every stage free.
        mbarrier.wait(free.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
        slots = i * BLOCK_TOPK + offs_t
        idx = gl.load(idx_row + slots, mask=slots < n_slots, other=-1)
        # Any index outside [0, s_kv) is invalid: its copy is masked (zero-filled), row 0 stands in.
        valid = (idx >= 0) & (idx < s_kv)
        rows = kv_base + gl.where(valid, idx, 0).to(gl.int64) * stride_kvs
        dest = k_main.index(stage)
        for c in gl.static_range(D_V // COLS):
            async_copy.async_copy_global_to_shared(dest.slice(c * COLS, COLS, dim=1),
                                                   rows[:, None] + (c * COLS + offs_c)[None, :], mask=valid[:, None])
        if D_TAIL > 0:
            async_copy.async_copy_global_to_shared(k_tail.index(stage), rows[:, None] + (D_V + offs_c)[None, :],
                                                   mask=valid[:, None] & (offs_c < D_TAIL)[None, :])
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)
        slot_rows.index(stage).store(gl.where(valid, idx, -1))
        gl.thread_barrier()
        mbarrier.arrive(ready.index(stage), count=1)


@gluon.jit
def _rows_to_shared(main, tail, PTR, b, t, heads, ok, stride_b, stride_s, stride_h,
                    D_V: gl.constexpr, D_TAIL: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async of rows `heads` of query t of batch row b of PTR (the first D_V columns into `main`, the
    next D_TAIL into `tail`; rows where `ok` is false read 0), then wait for them and fence them for
    wgmma. heads and ok: [rows] in SliceLayout(1, LAYOUT)."""
    offs_c = gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
    row = PTR + b * stride_b + t.to(gl.int64) * stride_s + heads[:, None].to(gl.int64) * stride_h
    for c in gl.static_range(D_V // COLS):
        async_copy.async_copy_global_to_shared(main.slice(c * COLS, COLS, dim=1), row + (c * COLS + offs_c)[None, :],
                                               mask=ok[:, None])
    if D_TAIL > 0:
        async_copy.async_copy_global_to_shared(tail, row + (D_V + offs_c)[None, :],
                                               mask=ok[:, None] & (offs_c < D_TAIL)[None, :])
    async_copy.commit_group()
    async_copy.wait_group(0)
    # The rows arrived through cp.async (generic proxy); wgmma reads them through the async proxy.
    fence_async_shared()
