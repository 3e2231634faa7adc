"""The attention family's short-window forward (KEY_LOOPS 2 of kernels/common/attention/forward.py) as a Gluon
kernel for Hopper whose K/V tiles arrive by TMA: the tiled kernel's no-loop form, without its global
loads staged through registers.

Why: a window-128 CTA of the tiled kernel lives for three products and spends most of its time
waiting on its own loads (ncu on an H100, benchmarks/NOTES.md: long-scoreboard stalls, the
L1/TEX unit 76% busy moving 44 KB per CTA from LDG registers into shared memory). Here one thread
issues every copy of the CTA at its start (Q and the three K pieces on one mbarrier, the three V
pieces on another), the copies land in shared memory where the tensor cores read them, and the
registers that held K/V in flight are gone.

What a program does is `_attention_fwd_window`'s: TOKENS (<= 16) tokens of HEADS query heads of one
kv head (token-major rows), the causal window of 2 * HALF keys as its edge half (window test), the
half every row sees (no test) and the 16 keys past the block's first position (causal test); one
softmax, no rescaling. Near a sequence's start (the window's first key below 0) the three pieces
start at key 0 and take every mask, as the tiled kernel's clamped copy does. Rows and keys past a
sequence come back from TMA as zeros and rows past s_q are dropped by the TMA store, so the kernel
serves padded [b, s, h, d] calls only; `window_tma_served` says which (the caller runs the tiled
kernel otherwise). Semantics: `ops.sink_attention.reference`.
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

from kreg.core.records import LaunchConfig
from kreg.core.space import ConfigSpace
from kreg.kernels.common.attention.backward import attention_backward
from kreg.kernels.common.attention.forward import attention_forward
from kreg.kernels.common.attention.tile_rules import causal_window, window_reason
from kreg.kernels.common.constants import LN2, LOG2E
from kreg.kernels.common.launch import kept_arguments, launch_signed, signature_key, triton_launch
from kreg.kernels.common.tiles import cdiv
from kreg.kernels.nvidia.attention_tma import descriptor_makers, padded_outputs, tma_addressable_qkv
from kreg.ops.variant import CallPlan

FLOAT32_LOWEST = gl.constexpr(-3.4028234663852886e38)
TAIL = gl.constexpr(16)  # keys of the diagonal piece: the block's tokens fit one 16-key product


@gluon.jit
def _scores(q, k_smem, start, pos, window, WIDTH: gl.constexpr, TEST: gl.constexpr, ROWS: gl.constexpr,
            HEAD_DIM: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Raw Q K^T of keys [start, start + WIDTH) (issued async; waited for here), -inf where not
    allowed: TEST 1 the window's first key (key >= pos - W + 1), 2 the diagonal (key <= pos), 3 both
    and key >= 0 (near a sequence's start), 0 none."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                     instr_shape=[16, WIDTH, 16])
    k = k_smem.reshape([WIDTH, HEAD_DIM])
    s = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([ROWS, WIDTH], gl.float32, layout), use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    rel = gl.convert_layout(pos, gl.SliceLayout(1, layout)) - start  # each row's position from `start`
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    if TEST == 1:
        s = gl.where(cols[None, :] >= (rel - window + 1)[:, None], s, float("-inf"))
    elif TEST == 2:
        s = gl.where(cols[None, :] <= rel[:, None], s, float("-inf"))
    elif TEST == 3:
        # start >= 0 here, so 0 <= rel - col < W also keeps out keys below 0 and past the row.
        allowed = (rel[:, None] - cols[None, :]).to(gl.uint32, bitcast=True) < window.to(gl.uint32)
        s = gl.where(allowed, s, float("-inf"))
    return s


@gluon.jit
def _window_products(q, k_edge, k_mid, k_tail, v_edge, v_mid, v_tail, v_bar, lo, pos, window, qk_scale,
                     CLAMPED: gl.constexpr, HALF: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                     NUM_WARPS: gl.constexpr):
    """(acc, l, m) of the block over its three key pieces, from key `lo` (m in log2 units, scaled)."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    if CLAMPED:
        s_edge = _scores(q, k_edge, lo, pos, window, HALF, 3, ROWS, HEAD_DIM, NUM_WARPS)
        s_mid = _scores(q, k_mid, lo + HALF, pos, window, HALF, 3, ROWS, HEAD_DIM, NUM_WARPS)
        s_tail = _scores(q, k_tail, lo + 2 * HALF, pos, window, TAIL, 3, ROWS, HEAD_DIM, NUM_WARPS)
    else:
        s_edge = _scores(q, k_edge, lo, pos, window, HALF, 1, ROWS, HEAD_DIM, NUM_WARPS)
        s_mid = _scores(q, k_mid, lo + HALF, pos, window, HALF, 0, ROWS, HEAD_DIM, NUM_WARPS)
        s_tail = _scores(q, k_tail, lo + 2 * HALF, pos, window, TAIL, 2, ROWS, HEAD_DIM, NUM_WARPS)
    half_rows: gl.constexpr = gl.SliceLayout(1, s_edge.type.layout)
    tail_rows: gl.constexpr = gl.SliceLayout(1, s_tail.type.layout)
    # qk_scale > 0 (the launcher's condition): the maximum of raw scores, scaled once per row, and
    # each score's shift one FMA.
    row_max = gl.maximum(gl.max(gl.maximum(s_edge, s_mid), 1), gl.convert_layout(gl.max(s_tail, 1), half_rows))
    # The lowest finite float, not -inf, for a row with no allowed key: exp2 then gives 0, not NaN.
    m = gl.maximum(row_max * qk_scale, FLOAT32_LOWEST)
    m_tail = gl.convert_layout(m, tail_rows)
    mbarrier.wait(v_bar, 0)
    # Each piece's P goes to the tensor cores as soon as it exists: its fp32 scores die there.
    p = gl.exp2(s_edge * qk_scale - m[:, None])
    l_i = gl.sum(p, 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_operand), v_edge.reshape([HALF, HEAD_DIM]),
                        gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout), use_acc=False, is_async=True)
    p = gl.exp2(s_mid * qk_scale - m[:, None])
    l_i += gl.sum(p, 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_operand), v_mid.reshape([HALF, HEAD_DIM]), acc,
                        is_async=True)
    p = gl.exp2(s_tail * qk_scale - m_tail[:, None])
    l_i += gl.convert_layout(gl.sum(p, 1), half_rows)
    acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_operand), v_tail.reshape([TAIL, HEAD_DIM]), acc,
                        is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return acc, gl.convert_layout(l_i, rows), gl.convert_layout(m, rows)


@gluon.jit
def _attention_fwd_window_tma_kernel(
        q_desc, k_desc, v_desc, kt_desc, vt_desc, o_desc, Sinks, Lse,
        qk_scale, seqlen_q, seqlen_k, window, stride_lb, stride_lh,
        GROUP: gl.constexpr, HAS_SINKS: gl.constexpr, RETURN_LSE: gl.constexpr, HEAD_DIM: gl.constexpr,
        TOKENS: gl.constexpr, HEADS: gl.constexpr, HALF: gl.constexpr, NUM_WARPS: gl.constexpr):
    """One program: TOKENS query tokens of HEADS consecutive query heads of one kv head (grid: token
    blocks, h_q // HEADS, batch), rows token-major. Descriptors over [b, s, h, d]: q and out with
    [1, TOKENS, HEADS, d] blocks, k and v with [1, HALF, 1, d], kt and vt (the diagonal piece) with
    [1, 16, 1, d]. Writes out (and the natural-log lse without the sink, when RETURN_LSE); a row
    with no allowed key gets out 0 and lse +inf."""
    ROWS: gl.constexpr = TOKENS * HEADS
    dtype: gl.constexpr = q_desc.dtype
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    m0 = gl.program_id(0) * TOKENS
    off_h = gl.program_id(1) * HEADS
    off_b = gl.program_id(2)
    off_hk = off_h // GROUP
    p_first = seqlen_k - seqlen_q + m0  # the block's first query position
    start = p_first - window + 1
    lo = gl.maximum(start, 0)

    q_smem = gl.allocate_shared_memory(dtype, [1, TOKENS, HEADS, HEAD_DIM], q_desc.layout)
    k_edge = gl.allocate_shared_memory(dtype, [1, HALF, 1, HEAD_DIM], k_desc.layout)
    k_mid = gl.allocate_shared_memory(dtype, [1, HALF, 1, HEAD_DIM], k_desc.layout)
    k_tail = gl.allocate_shared_memory(dtype, [1, TAIL, 1, HEAD_DIM], kt_desc.layout)
    v_edge = gl.allocate_shared_memory(dtype, [1, HALF, 1, HEAD_DIM], v_desc.layout)
    v_mid = gl.allocate_shared_memory(dtype, [1, HALF, 1, HEAD_DIM], v_desc.layout)
    v_tail = gl.allocate_shared_memory(dtype, [1, TAIL, 1, HEAD_DIM], vt_desc.layout)
    qk_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qk_bar, count=1)
    mbarrier.init(v_bar, count=1)
    fence_async_shared()
    # Every copy at once: Q and K on one barrier (the scores need both), V on its own (it is read
    # after the softmax, so its bytes land under the score products).
    mbarrier.expect(qk_bar, q_desc.block_type.nbytes + 2 * k_desc.block_type.nbytes + kt_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_b, m0, off_h, 0], qk_bar, q_smem)
    tma.async_copy_global_to_shared(k_desc, [off_b, lo, off_hk, 0], qk_bar, k_edge)
    tma.async_copy_global_to_shared(k_desc, [off_b, lo + HALF, off_hk, 0], qk_bar, k_mid)
    tma.async_copy_global_to_shared(kt_desc, [off_b, lo + 2 * HALF, off_hk, 0], qk_bar, k_tail)
    mbarrier.expect(v_bar, 2 * v_desc.block_type.nbytes + vt_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [off_b, lo, off_hk, 0], v_bar, v_edge)
    tma.async_copy_global_to_shared(v_desc, [off_b, lo + HALF, off_hk, 0], v_bar, v_mid)
    tma.async_copy_global_to_shared(vt_desc, [off_b, lo + 2 * HALF, off_hk, 0], v_bar, v_tail)

    r = gl.arange(0, ROWS, layout=rows_layout)
    pos = p_first + r // HEADS  # each row's query position
    q = q_smem.reshape([ROWS, HEAD_DIM])
    mbarrier.wait(qk_bar, 0)
    if start < 0:
        acc, l_i, m_i = _window_products(q, k_edge, k_mid, k_tail, v_edge, v_mid, v_tail, v_bar, lo, pos, window,
                                         qk_scale, True, HALF, ROWS, HEAD_DIM, NUM_WARPS)
    else:
        acc, l_i, m_i = _window_products(q, k_edge, k_mid, k_tail, v_edge, v_mid, v_tail, v_bar, lo, pos, window,
                                         qk_scale, False, HALF, ROWS, HEAD_DIM, NUM_WARPS)
    mbarrier.invalidate(qk_bar)
    mbarrier.invalidate(v_bar)

    empty = l_i == 0.0
    denominator = gl.where(empty, 1.0, l_i)
    if HAS_SINKS:
        sink = gl.load(Sinks + off_h + r % HEADS) * LOG2E
        # out_nosink * sigmoid(lse - sink) without a logarithm, as the tiled kernel's epilogue.
        denominator += gl.exp2(sink - gl.where(empty, 0.0, m_i))
    out = acc * gl.where(empty, 0.0, 1.0 / denominator)[:, None]
    # Q is dead (the score products were waited for): its buffer stages the tile for one TMA store,
    # which drops rows past the sequence.
    q.store(out.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(o_desc, [off_b, m0, off_h, 0], q_smem)
    if RETURN_LSE:
        tok = m0 + r // HEADS
        lse = (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2
        lse_ptr = Lse + off_b.to(gl.int64) * stride_lb + (off_h + r % HEADS).to(gl.int64) * stride_lh + tok
        gl.store(lse_ptr, gl.where(empty, float("inf"), lse), mask=tok < seqlen_q)
    tma.store_wait(0)


# ----------------------------------------------------------------------------- launcher
def window_tma_served(args: Mapping, config: LaunchConfig) -> bool:
    """Whether this kernel takes a call: padded (not varlen) inputs TMA can address, a positive scale,
    and a causal window the no-loop form covers at the config's tokens per block (`window_reason`).
    The dtype, head dim and GQA group are the tuning key's (`AttentionWindowTmaHopper.supports`)."""
    return (args["cu_seqlens_q"] is None and float(args["sm_scale"]) > 0
            and window_reason(causal_window(args, args["k"].shape[1]), config.blocks["TOKENS"]) is None
            and tma_addressable_qkv(args["q"], args["k"], args["v"]))


def tiled_equivalent(config: LaunchConfig) -> LaunchConfig:
    """The tiled forward's config of the same form (no loop, the same rows and head packing), which
    runs the calls this kernel does not take."""
    blocks = config.blocks
    return LaunchConfig(blocks={"BLOCK_M": blocks["TOKENS"] * blocks["HEADS"], "BLOCK_N": 32, "HEADS": blocks["HEADS"],
                                "KEY_LOOPS": 2}, num_warps=config.num_warps, num_stages=2)


def window_tma_forward(args: Mapping, config: LaunchConfig, keep_lse: bool, launch: Callable[..., Any] = triton_launch,
                       prepared: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Allocate out (and lse, when returned or kept for a backward) and run this kernel on a call
    `window_tma_served` accepts. No tensor value is read on the host. With `prepared` (a dict a plan
    keeps, given with the config it always gets), the launch's grid, scalars and constexprs are kept
    per call signature (the shapes, dtypes, window and flags they are made from), and a `LaunchCache`
    launches by that signature."""
    q, k, v = args["q"], args["k"], args["v"]
    sinks = args.get("sinks")
    out, lse = padded_outputs(q, keep_lse, args["return_lse"])
    signature = (q.shape, k.shape, q.dtype, None if sinks is None else sinks.dtype, lse is None,
                 causal_window(args, k.shape[1]))
    grid, scalars, constexprs, makers, key = kept_arguments(prepared, signature, _window_launch, config, *signature)
    # The six descriptor parameters go as tensors (k and v twice, with two block shapes): the launch
    # makes the descriptors (on a signature seen before it encodes their tensor maps without them).
    launch_signed(launch, key if prepared is not None else None, _attention_fwd_window_tma_kernel, grid,
                  (q, k, v, k, v, out, sinks, out if lse is None else lse, float(args["sm_scale"]) * LOG2E.value,
                   *scalars), constexprs, makers)
    return out, lse


def _window_launch(config: LaunchConfig, q_shape: tuple, k_shape: tuple, dtype: torch.dtype, sinks_dtype,
                   no_lse: bool, window: int) -> tuple[tuple, tuple, dict, tuple, int]:
    """(grid, scalars after sm_scale, keyword arguments, descriptor makers, signature key) of one call
    signature's launch."""
    batch, s_q, h_q, d = q_shape
    s_k, h_kv = k_shape[1], k_shape[2]
    tokens, heads, half = config.blocks["TOKENS"], config.blocks["HEADS"], window // 2
    lse_strides = (0, 0) if no_lse else (h_q * s_q, s_q)  # lse is allocated contiguous [b, h, s]
    constexprs = dict(GROUP=h_q // h_kv, HAS_SINKS=sinks_dtype is not None, RETURN_LSE=not no_lse, HEAD_DIM=d,
                      TOKENS=tokens, HEADS=heads, HALF=half, NUM_WARPS=config.num_warps, num_warps=config.num_warps,
                      maxnreg=config.blocks["MAX_REGS"])
    makers = descriptor_makers((tokens, heads), (half, 1), (half, 1), (TAIL.value, 1), (TAIL.value, 1), (tokens, heads))
    return ((cdiv(s_q, tokens), h_q // heads, batch), (s_q, s_k, window, *lse_strides), constexprs, makers,
            signature_key())


# ----------------------------------------------------------------------------- the variants
HEAD_DIMS = (64, 128)


def window_tiles(config: LaunchConfig, key: Mapping) -> bool:
    """Keep: 16 rows a warp (a warpgroup's wgmma takes 64), HEADS dividing the GQA group."""
    blocks = config.blocks
    return blocks["TOKENS"] * blocks["HEADS"] == 16 * config.num_warps and \
        (key["h_q"] // key["h_kv"]) % blocks["HEADS"] == 0


# TOKENS: query tokens per program (<= 16: the diagonal piece is one 16-key product); HEADS: query
# heads of one kv head packed along the rows (token-major); MAX_REGS: ptxas's register cap per thread
# (`maxnreg`; 96 fits five 4-warp CTAs of d 64 per SM, the shared memory's limit too, where ptxas
# alone takes ~101-104; d 128 needs more than 128 without spilling).
WINDOW_SPACE = ConfigSpace(
    blocks={"TOKENS": (8, 16), "HEADS": (4, 8, 16), "MAX_REGS": (96, 128, 168)},
    knobs={"num_warps": (4, 8)},
    keep=window_tiles,
    defaults={"*": {"TOKENS": 8, "HEADS": 8, "MAX_REGS": 96, "num_warps": 4}},
)


def shared_bytes(config: LaunchConfig, key: Mapping, elem: int = 2) -> int:
    """Shared memory of one program: Q (reused for out), K and V of 2 * HALF + 16 keys each, two barriers."""
    rows = config.blocks["TOKENS"] * config.blocks["HEADS"]
    return elem * key["d"] * (rows + 2 * (min(key["window"], key["s_k"]) + TAIL.value)) + 16


class AttentionWindowTmaHopper:
    """This kernel's variant logic, mixed in before a tiled NVIDIA variant: sink_attention registers
    one (kernels/nvidia/sink_attention.py) setting `name` and `tiled` (that tiled variant's class); its
    users are gpt-oss's window-128 layers, so flash_attention keeps the tiled kernel. Roles, kernels
    and spaces are the tiled variant's but for the forward (this kernel, WINDOW_SPACE); calls it does
    not take (varlen, inputs TMA cannot address, a window capped below 32 keys) run the tiled forward
    with `tiled_equivalent`.

    Hopper only; causal windows of 32, 64 or 128 keys, head dims 64 and 128, fp16/bf16, a GQA group
    of at least 4 (a block is at most 16 tokens and a warpgroup's 64 rows). Priority above the tiled
    variant: the default where it runs and no tuned entry names another."""

    priority = 10
    runs_in_interpreter = False
    tiled: type

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.kernels = {**cls.tiled.kernels, "fwd": _attention_fwd_window_tma_kernel}
        cls.spaces = {**cls.tiled.spaces, "fwd": WINDOW_SPACE}

    def supports(self, key: dict, device) -> bool:
        group = key["h_q"] // key["h_kv"]
        return (device.arch == "sm_90" and key["dtype"] in ("fp16", "bf16") and key["d"] in HEAD_DIMS
                and key["causal"] and key["window"] in (32, 64, 128) and group % 4 == 0)

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        if role != "fwd":
            return super().role_default(role, key, device)
        heads = 8 if (key["h_q"] // key["h_kv"]) % 8 == 0 else 4
        return WINDOW_SPACE.make({"TOKENS": 64 // heads, "HEADS": heads, "MAX_REGS": 96 if key["d"] <= 64 else 168,
                                  "num_warps": 4})

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        if role != "fwd":
            return super().prune_reason(role, config, key, device)
        if set(config.blocks) != set(WINDOW_SPACE.blocks):
            return f"blocks must be {sorted(WINDOW_SPACE.blocks)}, got {sorted(config.blocks)}"
        if not window_tiles(config, key):
            return f"TOKENS * HEADS must be 16 * num_warps and HEADS divide the GQA group, got {config}"
        need = shared_bytes(config, key)
        if need > device.shared_mem_bytes:
            return f"needs ~{need} B of shared memory (> {device.shared_mem_bytes} B)"
        return None

    def launchers(self, plan: CallPlan) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
        """This forward, or for the calls it hands over the tiled forward in the same no-loop form; the
        tiled backward."""
        own, prepared = plan.config["fwd"], {}

        def forward(args: Mapping, config: LaunchConfig, keep_lse: bool,
                    launch: Callable[..., Any] = triton_launch) -> tuple[torch.Tensor, torch.Tensor | None]:
            if window_tma_served(args, config):
                return window_tma_forward(args, config, keep_lse, launch, prepared if config is own else None)
            return attention_forward(args, tiled_equivalent(config), keep_lse, launch)

        return forward, attention_backward


