"""What the two warp-specialized sparse_mla kernels for Hopper share: the program's grid coordinates,
its query's slot count and index row, and the cp.async of a program's rows of Q (or dO) into shared
memory; and the backward's producer partition, which gathers the selected latent rows into a ring of
shared-memory stages. The forward is in kernels/nvidia/sparse_mla_warpspec_fwd.py (its producer fills
two buffers half by half, its own), the backward in kernels/nvidia/sparse_mla_warpspec_bwd.py.

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
    kernels.common.sparse_mla.gather._grid."""
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
def _block_slot_rows(idx_row, n_slots, s_kv, block, offs_t, BLOCK_TOPK: gl.constexpr):
    """Top-k block `block`'s row indices (BLOCK_TOPK slots), -1 where the slot is past n_slots or its
    index outside [0, s_kv)."""
    slots = block * BLOCK_TOPK + offs_t
    idx = gl.load(idx_row + slots, mask=slots < n_slots, other=-1)
    return gl.where((idx >= 0) & (idx < s_kv), idx, -1)


@gluon.jit
def _copy_columns(main, tail, row_ptrs, ok, FIRST: gl.constexpr, LAST: gl.constexpr, WITH_TAIL: gl.constexpr,
                  D_V: gl.constexpr, D_TAIL: gl.constexpr, CHUNK: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async of columns [FIRST, LAST) of the rows `row_ptrs` ([rows, 1]) points at into the same
    columns of `main`, CHUNK at a time (8 contiguous 16-bit values, one 16-byte copy, a thread), and
    WITH_TAIL columns [D_V, D_V + D_TAIL) into `tail`; rows where `ok` is false are zero-filled, never
    read."""
    offs_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LAYOUT))
    for c in gl.static_range(FIRST // CHUNK, LAST // CHUNK):
        async_copy.async_copy_global_to_shared(main.slice(c * CHUNK, CHUNK, dim=1),
                                               row_ptrs + (c * CHUNK + offs_c)[None, :], mask=ok[:, None])
    if WITH_TAIL and D_TAIL > 0:
        offs_t = gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
        async_copy.async_copy_global_to_shared(tail, row_ptrs + (D_V + offs_t)[None, :],
                                               mask=ok[:, None] & (offs_t < D_TAIL)[None, :])


@gluon.jit
def _gather_blocks(KV, IDX, TOPK_LEN, k_main, k_tail, slot_rows, ready, free,
                   s_kv, topk, head_blocks,
                   stride_kvb, stride_kvs, stride_kvh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                   D_V: gl.constexpr, D_TAIL: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """The backward's producer: top-k block i (k_main's second dim of slots) into stage i % (k_main's
    first dim), with its slots' row indices. A stage's `ready` completes when every producer thread's
    copies have landed (no-increment arrivals) and the rows are written (one arrival)."""
    NUM_STAGES: gl.constexpr = k_main.shape[0]
    BLOCK_TOPK: gl.constexpr = k_main.shape[1]
    # 8 contiguous 16-bit values (one 16-byte cp.async) per thread, 8 threads per 64-column row chunk.
    chunk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    t, g, _, b = _program_coords(head_blocks)
    n_slots, idx_row = _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb,
                                    stride_ls, HAS_TOPK_LEN)
    kv_base = KV + b * stride_kvb + g.to(gl.int64) * stride_kvh
    offs_t = gl.arange(0, BLOCK_TOPK, layout=gl.SliceLayout(1, chunk))
    for i in range(gl.cdiv(n_slots, BLOCK_TOPK)):
        stage = i % NUM_STAGES
        # Barriers start in phase 0, so the first pass over the ring finds every stage free.
        mbarrier.wait(free.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
        rows = _block_slot_rows(idx_row, n_slots, s_kv, i, offs_t, BLOCK_TOPK)
        # An invalid slot's copy is masked (zero-filled); row 0 stands in for its address.
        valid = rows >= 0
        row_ptrs = kv_base + gl.where(valid, rows, 0).to(gl.int64)[:, None] * stride_kvs
        _copy_columns(k_main.index(stage), k_tail.index(stage), row_ptrs, valid, 0, D_V, True, D_V, D_TAIL, COLS,
                      chunk)
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)
        slot_rows.index(stage).store(rows)
        gl.thread_barrier()
        mbarrier.arrive(ready.index(stage), count=1)


@gluon.jit
def _rows_to_shared(main, tail, PTR, b, t, heads, ok, stride_b, stride_s, stride_h,
                    D_V: gl.constexpr, D_TAIL: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async of rows `heads` of query t of batch row b of PTR (the first D_V columns into `main`, the
    next D_TAIL into `tail`; rows where `ok` is false read 0), then wait for them and fence them for
    wgmma. heads and ok: [rows] in SliceLayout(1, LAYOUT)."""
    row_ptrs = PTR + b * stride_b + t.to(gl.int64) * stride_s + heads[:, None].to(gl.int64) * stride_h
    _copy_columns(main, tail, row_ptrs, ok, 0, D_V, True, D_V, D_TAIL, COLS, LAYOUT)
    async_copy.commit_group()
    async_copy.wait_group(0)
    # The rows arrived through cp.async (generic proxy); wgmma reads them through the async proxy.
    fence_async_shared()
