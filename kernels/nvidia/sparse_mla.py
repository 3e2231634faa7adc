"""sparse_mla on NVIDIA Hopper: two variants.

`sparse_mla_headblock`: the shared head-block kernel (kernels.common.sparse_mla) with NVIDIA's config
space. Hopper's register file holds at most 128 fp32 accumulator values per thread next to the other
tiles, so BLOCK_H 128 with d_v 512 is pruned statically; 228 KB of shared memory allows deep pipelining
of the gathered K/V tiles.

`sparse_mla_warpspec`: a warp-specialized Gluon forward (below), the backward shared with the
head-block variant. Why: the plain-Triton head-block kernel plateaus near 265 TFLOP/s on an H200 at
the V3.2 shape, its warps waiting at CTA barriers around layout conversions and pipeline hand-offs
(benchmarks/NOTES.md). Gluon lets the kernel say how the work is split:

- a producer partition (PRODUCER_WARPS warps, few registers) gathers each BLOCK_TOPK tile of selected
  latent rows with cp.async into a ring of NUM_STAGES shared-memory stages and signals an mbarrier per
  stage; invalid slots are zero-filled, never read;
- the default partition, two consumer warpgroups, keeps Q (64 heads, all d_qk dims) in shared memory
  for the whole program. Per tile, warpgroup w computes the scores of the tile's w-th half of slots
  (wgmma 64 x BLOCK_TOPK/2 x d_qk), the two combine row maxima, write their halves of P to shared memory,
  and each accumulates its half of d_v (wgmma 64 x d_v/2 x BLOCK_TOPK; V is the first d_v columns of
  the same gathered rows). Row sums stay per slot column until the end, so a tile needs one cross-
  warpgroup reduction (the maximum), not two.

One program owns 64 heads (wgmma's M per warpgroup) of one kv group of one query, as in the head-block
kernel with BLOCK_H 64. Semantics: `registry.ops.sparse_mla.reference`.

Gluon kernels do not run in the Triton interpreter: CI compiles this one for sm_90
(tests/test_shipped_and_default_configs.py) and the GPU tests compare it with the reference in bf16.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.base import CompileSpec, Variant, register
from kernels.common.sparse_mla import (
    LOG2E,
    SparseMLAHeadBlockBase,
    SparseMLALaunch,
    _compile_signature,
    _forward,
    _grid,
    _strides,
    group_head_cap,
    sparse_mla_compile_specs,
)
from registry.device import detect
from tuning_db.records import LaunchConfig


@register
class SparseMLAHeadBlockNvidia(SparseMLAHeadBlockBase, Variant):
    vendor = "nvidia"
    SPACE = {
        "BLOCK_H": (16, 32, 64, 128),
        "BLOCK_TOPK": (16, 32, 64, 128),
        "D_SPLIT": (1, 2),
        "num_warps": (4, 8, 16),
        "num_stages": (1, 2, 3, 4),
    }
    ACC_REGS_LIMIT = 128
    # The backward's two passes, the fastest spill-free pair measured on the H200 at the V3.2 shape
    # (benchmarks/NOTES.md): dq with 32 heads per program (64 spill), dkv with 64-row tiles and
    # 16-head chunks (32-head chunks at 3 stages need 240 KB of shared memory at run time).
    BACKWARD = {"dq": {"BLOCK_H": 32, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 2},
                "dkv": {"BLOCK_H": 16, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 3}}
    # The fastest spill-free config measured on the H200 at the V3.2 shape (benchmarks/NOTES.md): 64
    # heads per program, 64-slot tiles, 3 stages (255 registers with int32 row offsets).
    DEFAULTS = {"*": {"BLOCK_H": 64, "BLOCK_TOPK": 64, "num_warps": 8, "num_stages": 3}}


_HEAD_BLOCK = SparseMLAHeadBlockNvidia()  # the warp-specialized variant's backward and fallback


# ----------------------------------------------------------------------------- warp-specialized forward
LN2 = gl.constexpr(0.6931471805599453)
# Kernels can only read globals that are constexprs (Python code reads `.value`).
BLOCK_H = gl.constexpr(64)  # heads per program: wgmma's M for one warpgroup; both warpgroups share them
COLS = gl.constexpr(64)  # columns per copy chunk and width of the rope-tail tiles (128 bytes: one swizzle row)
PRODUCER_REGS = gl.constexpr(56)  # registers per producer thread; the consumers get the rest of the file


# ----------------------------------------------------------------------------- Gluon kernel
@gluon.jit
def _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                 HAS_TOPK_LEN: gl.constexpr):
    """(slots to visit, the index row) of query t of kv group g of batch row b (b as int64)."""
    n_slots = topk
    if HAS_TOPK_LEN:
        n_slots = gl.minimum(gl.load(TOPK_LEN + b * stride_lb + t.to(gl.int64) * stride_ls), topk)
    return n_slots, IDX + b * stride_ib + t.to(gl.int64) * stride_is + g.to(gl.int64) * stride_ih


@gluon.jit
def _gather_partition(KV, IDX, TOPK_LEN, k_main, k_tail, ready, free,
                      s_kv, topk, heads_per_group, head_blocks,
                      stride_kvb, stride_kvs, stride_kvh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                      D_V: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_TOPK: gl.constexpr,
                      NUM_STAGES: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """Producer: copy each tile's gathered rows into the next free stage; the stage's `ready` barrier
    completes when every producer thread's copies have landed (one no-increment arrive per thread)."""
    # 8 contiguous 16-bit values (one 16-byte cp.async) per thread, 8 threads per 64-column row chunk.
    chunk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    t = gl.program_id(0)
    g = gl.program_id(1) // head_blocks
    b = gl.program_id(2).to(gl.int64)
    n_slots, idx_row = _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb,
                                    stride_ls, HAS_TOPK_LEN)
    kv_base = KV + b * stride_kvb + g.to(gl.int64) * stride_kvh
    offs_t = gl.arange(0, BLOCK_TOPK, layout=gl.SliceLayout(1, chunk))
    offs_c = gl.arange(0, COLS, layout=gl.SliceLayout(0, chunk))
    for it in range(gl.cdiv(n_slots, BLOCK_TOPK)):
        stage = it % NUM_STAGES
        # Barriers start in phase 0, so the first pass over the ring finds every stage free.
        mbarrier.wait(free.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
        slots = it * BLOCK_TOPK + offs_t
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


@gluon.jit
def _attend_partition(Q, IDX, SINK, TOPK_LEN, OUT, MAX_LOGITS, LSE, q_main, q_tail, k_main, k_tail, p_smem,
                      ready, free, s_kv, topk, heads_per_group, head_blocks, qk_scale,
                      stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                      stride_ob, stride_os, stride_oh, stride_mb, stride_ms,
                      D_V: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_TOPK: gl.constexpr, NUM_STAGES: gl.constexpr,
                      HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr):
    """Consumers (8 warps): online softmax over the gathered tiles, in log2 units (`qk_scale` is
    sm_scale * log2(e)); writes out, max_logits and the natural-log lse like the head-block kernel (a
    row with no valid slot: out 0, max_logits -inf, lse +inf)."""
    # Warps [4, 2]: warpgroup 0 owns the left half of the scores' slots and of out's columns.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_TOPK // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D_V // 2, 16])
    q_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    t = gl.program_id(0)
    g = gl.program_id(1) // head_blocks
    hb = gl.program_id(1) % head_blocks
    b = gl.program_id(2).to(gl.int64)

    # Q once, into shared memory (heads past the group read 0 and are never stored).
    offs_hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_load))
    offs_cq = gl.arange(0, COLS, layout=gl.SliceLayout(0, q_load))
    q_ok = (offs_hq < heads_per_group)[:, None]
    q_row = (Q + b * stride_qb + t.to(gl.int64) * stride_qs
             + (g * heads_per_group + offs_hq)[:, None].to(gl.int64) * stride_qh)
    for c in gl.static_range(D_V // COLS):
        q_main.slice(c * COLS, COLS, dim=1).store(gl.load(q_row + (c * COLS + offs_cq)[None, :], mask=q_ok, other=0.0))
    if D_TAIL > 0:
        q_tail.store(gl.load(q_row + (D_V + offs_cq)[None, :], mask=q_ok & (offs_cq < D_TAIL)[None, :], other=0.0))
    fence_async_shared()
    gl.thread_barrier()

    n_slots, idx_row = _query_slots(IDX, TOPK_LEN, topk, t, g, b, stride_ib, stride_is, stride_ih, stride_lb,
                                    stride_ls, HAS_TOPK_LEN)
    offs_t = gl.arange(0, BLOCK_TOPK, layout=gl.SliceLayout(0, s_layout))

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=s_rows)
    l_cols = gl.zeros([BLOCK_H, BLOCK_TOPK], gl.float32, layout=s_layout)  # row sums, per slot column
    acc = gl.zeros([BLOCK_H, D_V], gl.float32, layout=o_layout)
    s_init = gl.zeros([BLOCK_H, BLOCK_TOPK], gl.float32, layout=s_layout)
    for it in range(gl.cdiv(n_slots, BLOCK_TOPK)):
        stage = it % NUM_STAGES
        slots = it * BLOCK_TOPK + offs_t
        idx = gl.load(idx_row + slots, mask=slots < n_slots, other=-1)
        valid = (idx >= 0) & (idx < s_kv)
        mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
        # The rows arrived through cp.async (generic proxy); wgmma reads them through the async proxy.
        fence_async_shared()
        keys = k_main.index(stage)
        s = warpgroup_mma(q_main, keys.permute((1, 0)), s_init, use_acc=False, is_async=True)
        if D_TAIL > 0:
            s = warpgroup_mma(q_tail, k_tail.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # Rows with no valid slot so far keep m = -inf: shift by 0 so exp2 gives 0 instead of NaN.
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_shift[:, None])
        alpha = gl.exp2(m_i - m_shift)
        l_cols = l_cols * alpha[:, None] + p
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()  # both halves of P are written before either warpgroup reads all of it
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        acc = warpgroup_mma(p_smem, keys, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.thread_barrier()  # both warpgroups are done with the stage (and with P) before it is freed
        mbarrier.arrive(free.index(stage), count=1)
        m_i = m_new

    l_i = gl.sum(l_cols, 1)
    empty = l_i == 0.0
    lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)
    scale = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=s_rows)
    head_ok = offs_h < heads_per_group
    heads = g * heads_per_group + offs_h
    if HAS_SINK:
        sink = gl.load(SINK + heads, mask=head_ok, other=0.0)
        # sigmoid(lse - sink); empty rows are already scaled to 0 whatever the sink.
        scale = scale * gl.where(empty, 0.0, 1.0 / (1.0 + gl.exp(sink - gl.where(empty, 0.0, lse))))
    m_off = b * stride_mb + t.to(gl.int64) * stride_ms + heads
    gl.store(MAX_LOGITS + m_off, m_i * LN2, mask=head_ok)
    gl.store(LSE + m_off, lse, mask=head_ok)
    out = (acc * gl.convert_layout(scale, o_rows)[:, None]).to(OUT.dtype.element_ty)
    offs_ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=o_rows)
    offs_d = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
    o_row = (OUT + b * stride_ob + t.to(gl.int64) * stride_os
             + (g * heads_per_group + offs_ho)[:, None].to(gl.int64) * stride_oh)
    gl.store(o_row + offs_d[None, :], out, mask=(offs_ho < heads_per_group)[:, None])


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
    D_V: gl.constexpr, D_TAIL: gl.constexpr, BLOCK_TOPK: gl.constexpr, NUM_STAGES: gl.constexpr,
    HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
):
    """One program: 64 heads of one kv group of one query (of one batch row); grid as the head-block
    kernel's. Shared memory: Q, NUM_STAGES gathered tiles, P, the stage barriers."""
    dtype: gl.constexpr = Q.dtype.element_ty
    swizzled: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_main = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], swizzled)
    k_main = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_TOPK, D_V], swizzled)
    if D_TAIL > 0:
        q_tail = gl.allocate_shared_memory(dtype, [BLOCK_H, COLS], swizzled)
        k_tail = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_TOPK, COLS], swizzled)
    else:  # no rope tail: the names stay bound for the partitions' arguments, never used
        q_tail = q_main
        k_tail = k_main
    # P's rows are BLOCK_TOPK 16-bit values: 64 bytes at 32 slots, too short for the 128-byte swizzle.
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_TOPK],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_TOPK], dtype))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32)
        mbarrier.init(free.index(i), count=1)
    gl.warp_specialize([
        (_attend_partition, (Q, IDX, SINK, TOPK_LEN, OUT, MAX_LOGITS, LSE, q_main, q_tail, k_main, k_tail, p_smem,
                             ready, free, s_kv, topk, heads_per_group, head_blocks, qk_scale,
                             stride_qb, stride_qs, stride_qh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                             stride_ob, stride_os, stride_oh, stride_mb, stride_ms,
                             D_V, D_TAIL, BLOCK_TOPK, NUM_STAGES, HAS_SINK, HAS_TOPK_LEN)),
        (_gather_partition, (KV, IDX, TOPK_LEN, k_main, k_tail, ready, free,
                             s_kv, topk, heads_per_group, head_blocks,
                             stride_kvb, stride_kvs, stride_kvh, stride_ib, stride_is, stride_ih, stride_lb, stride_ls,
                             D_V, D_TAIL, BLOCK_TOPK, NUM_STAGES, HAS_TOPK_LEN, PRODUCER_WARPS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


# ----------------------------------------------------------------------------- launcher
def _copies_aligned(kv: torch.Tensor) -> bool:
    """Whether kv's base and row strides are multiples of 16 elements (of 16 bytes for the base), which
    the JIT then assumes, so the gathers compile to 16-byte copies (cp.async cannot do 2-byte ones)."""
    return kv.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in kv.stride()[:3])


def _forward_ws(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, config: LaunchConfig):
    """Run the warp-specialized forward on batched-layout tensors; returns (out, max_logits, lse).
    A kv whose rows are not 16-element aligned runs the head-block kernel instead."""
    b, s_q, h_q, d_qk = q.shape
    s_kv, h_kv = kv.shape[1], kv.shape[2]
    if not _copies_aligned(kv):  # the head-block kernel with its default for this group
        fallback = _HEAD_BLOCK.default_config({"h_q": h_q, "h_kv": h_kv}, detect(q.device))
        return _forward(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, fallback)
    out = torch.empty((b, s_q, h_q, d_v), device=q.device, dtype=q.dtype)
    max_logits = torch.empty((b, s_q, h_q), device=q.device, dtype=torch.float32)
    lse = torch.empty_like(max_logits)
    grid, head_blocks = _grid(s_q, h_q, h_kv, b, BLOCK_H.value)
    blocks = config.blocks
    _sparse_mla_fwd_ws_kernel[grid](
        q, kv, indices, attn_sink, topk_length, out, max_logits, lse,
        s_kv, indices.shape[-1], h_q // h_kv, head_blocks, sm_scale * LOG2E.value,
        *_strides(q, 3), *_strides(kv, 3), *_strides(indices, 3), *_strides(topk_length, 2),
        *_strides(out, 3), *_strides(lse, 2),
        D_V=d_v, D_TAIL=d_qk - d_v, BLOCK_TOPK=blocks["BLOCK_TOPK"], NUM_STAGES=config.num_stages,
        HAS_SINK=attn_sink is not None, HAS_TOPK_LEN=topk_length is not None,
        PRODUCER_WARPS=blocks["PRODUCER_WARPS"], num_warps=8,
    )
    return out, max_logits, lse


# ----------------------------------------------------------------------------- the variant
def shared_bytes(d_v: int, d_tail: int, block_topk: int, num_stages: int) -> int:
    """Shared memory of one program: Q, the stages of gathered rows, P (16-bit), barriers."""
    heads, row = BLOCK_H.value, d_v + (COLS.value if d_tail else 0)
    return 2 * (heads * row + num_stages * block_topk * row + heads * block_topk) + 16 * num_stages


@register
class SparseMLAWarpSpecializedHopper(SparseMLALaunch, Variant):
    """Hopper only (wgmma, setmaxnreg); d_v a power of two in [64, 512] (each warpgroup's half of the
    accumulator is one wgmma of N = d_v / 2 <= 256) and a rope tail of at most 64 dims in 8-dim steps
    (whole 16-byte copies). Higher priority than the head-block kernel: it is the default where it runs."""

    op = "sparse_mla"
    vendor = "nvidia"
    name = "sparse_mla_warpspec"
    priority = 10
    source_modules = ("kernels.nvidia.sparse_mla", "kernels.common.sparse_mla")
    run_forward = staticmethod(_forward_ws)
    SPACE = {"BLOCK_TOPK": (32, 64), "num_stages": (2, 3, 4), "PRODUCER_WARPS": (2, 4)}
    # 64-slot tiles with 2 stages won every key of the H200 and H100 sweeps; 2 and 4 producer warps are
    # within 1% of each other (benchmarks/NOTES.md).
    DEFAULT = {"BLOCK_TOPK": 64, "PRODUCER_WARPS": 2, "num_stages": 2}

    @staticmethod
    def _config(key: dict, block_topk: int, producer_warps: int, num_stages: int) -> LaunchConfig:
        """BLOCK_H records the heads a program serves (64 rows of wgmma, of which the group fills
        min(64, its heads)); the backward's dq pass takes it as the cap of its own head block."""
        block_h = min(BLOCK_H.value, group_head_cap(key["h_q"] // key["h_kv"]))
        return LaunchConfig(blocks={"BLOCK_H": block_h, "BLOCK_TOPK": block_topk, "PRODUCER_WARPS": producer_warps},
                            num_warps=8, num_stages=num_stages)

    def supports(self, key: dict, device) -> bool:
        d_v, tail = key["d_v"], key["d_qk"] - key["d_v"]
        return (device.arch == "sm_90" and key["dtype"] in ("fp16", "bf16")
                and 64 <= d_v <= 512 and d_v & (d_v - 1) == 0 and 0 <= tail <= COLS.value and tail % 8 == 0)

    def space(self, key: dict, device) -> list[LaunchConfig]:
        return [self._config(key, t, w, s) for t in self.SPACE["BLOCK_TOPK"] for s in self.SPACE["num_stages"]
                for w in self.SPACE["PRODUCER_WARPS"]]

    def prune_reason(self, config: LaunchConfig, key: dict, device) -> str | None:
        need = shared_bytes(key["d_v"], key["d_qk"] - key["d_v"], config.blocks["BLOCK_TOPK"], config.num_stages)
        if need > device.shared_mem_bytes:
            return f"needs {need} B of shared memory (> {device.shared_mem_bytes})"
        return None

    def default_config(self, key: dict, device) -> LaunchConfig:
        return self._config(key, self.DEFAULT["BLOCK_TOPK"], self.DEFAULT["PRODUCER_WARPS"], self.DEFAULT["num_stages"])

    def backward_configs(self, config: LaunchConfig) -> tuple[LaunchConfig, LaunchConfig]:
        """The head-block variant's backward passes."""
        return _HEAD_BLOCK.backward_configs(config)

    def compile_specs(self, key: dict, config: LaunchConfig, dtype: str = "bf16") -> list[CompileSpec]:
        """This forward (with sink and topk_length) and the head-block backward's two passes."""
        fn = _sparse_mla_fwd_ws_kernel
        constexprs = {"D_V": key["d_v"], "D_TAIL": key["d_qk"] - key["d_v"],
                      "BLOCK_TOPK": config.blocks["BLOCK_TOPK"], "NUM_STAGES": config.num_stages,
                      "HAS_SINK": True, "HAS_TOPK_LEN": True, "PRODUCER_WARPS": config.blocks["PRODUCER_WARPS"]}
        names = [n for n in fn.arg_names if n not in constexprs]
        elem = f"*{key.get('dtype', dtype)}"
        pointers = {"Q": elem, "KV": elem, "OUT": elem, "IDX": "*i32", "TOPK_LEN": "*i32", "SINK": "*fp32",
                    "MAX_LOGITS": "*fp32", "LSE": "*fp32"}
        heads_per_group = key["h_q"] // key["h_kv"]
        values = {"topk": key["topk"], "heads_per_group": heads_per_group,
                  "head_blocks": triton.cdiv(heads_per_group, BLOCK_H.value)}
        forward = CompileSpec(fn, _compile_signature(names, pointers, ("qk_scale",)), constexprs, {}, values)
        backward = sparse_mla_compile_specs(key, config, self.backward_configs(config), dtype)[1:]
        return [forward, *backward]
