"""Dense attention forward (FlashAttention-2): the Triton kernel body both vendors share.

Reads top-down: the inner loop over key blocks, the kernel, the launcher, the autograd Function, the
public entry point (`flash_attention_forward`), the offline compile specs and the variant logic. The
vendor files (`kernels/nvidia/flash_attention.py`, `kernels/amd/flash_attention.py`) subclass that
logic with their config spaces and heuristics only; the semantics are
`registry.ops.flash_attention.reference` (docs/op-contracts.md).

Masking in stages: for one query block, the key range [lo, hi) that can hold an allowed key is split
into an unmasked middle [mid_lo, mid_hi), whose key blocks are fully allowed for every query row of the
block, and masked edges (the window's start, the causal diagonal and the partial last block), so the
mask arithmetic only runs where a block needs it. Key blocks outside [lo, hi) are never visited.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.base import CompileSpec
from kernels.common.tiles import dot_block
from tuning_db.records import CallConfig, LaunchConfig


# ----------------------------------------------------------------------------- Triton kernels
@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, start, end,
                    pos_m, seqlen_k, window, qk_scale,
                    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Fold key blocks [start, end) into the online-softmax state (acc, l_i, m_i) of one query block.

    `k_base`/`v_base` point at key 0 of this (batch, kv head). Scores are kept in log2 units
    (`qk_scale` = sm_scale * log2(e)), so exp2 replaces exp. MASKED applies the key-length, causal and
    window masks; the unmasked stage is only called on blocks where every key is allowed.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_offs = offs_n[:, None] * stride_kn + offs_d[None, :]
    v_offs = offs_n[:, None] * stride_vn + offs_d[None, :]
    # Scalar block pointers advance in 64-bit: start * stride can pass 2**31 on long sequences.
    k_blk = k_base + tl.cast(start, tl.int64) * stride_kn
    v_blk = v_base + tl.cast(start, tl.int64) * stride_vn
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            # other=0 also keeps garbage (inf/NaN) past the sequence out of the P @ V product.
            kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_blk + k_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_blk + v_offs, mask=kv_mask, other=0.0)
        elif HEAD_DIM < BLOCK_D:
            k = tl.load(k_blk + k_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_blk + v_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_blk + k_offs)
            v = tl.load(v_blk + v_offs)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            allowed = cols[None, :] < seqlen_k
            if IS_CAUSAL:
                allowed = allowed & (cols[None, :] <= pos_m[:, None])
            if HAS_WINDOW:
                allowed = allowed & (cols[None, :] > pos_m[:, None] - window)
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED:
            # A row with no allowed key so far keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        k_blk += BLOCK_N * stride_kn
        v_blk += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _flash_attention_fwd_kernel(
        Q, K, V, Out, Lse, cu_seqlens_q, cu_seqlens_k,
        qk_scale, seqlen_q_arg, seqlen_k_arg, window, group,
        stride_qb, stride_qm, stride_qh,
        stride_kb, stride_kn, stride_kh,
        stride_vb, stride_vn, stride_vh,
        stride_ob, stride_om, stride_oh,
        stride_lb, stride_lh,
        IS_VARLEN: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        RETURN_LSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M queries of one query head of one sequence (grid: query blocks, h_q, batch).

    Writes those rows of `Out` (and their natural-log lse when RETURN_LSE), in fp32 online softmax over
    the allowed keys only. Query i sits at p_i = seqlen_k - seqlen_q + i; causal allows keys j <= p_i,
    a window W keys p_i - W < j. A row with no allowed key gets out 0 and lse +inf. Head h reads kv
    head h // group. Varlen sequences start at cu_seqlens (batch strides are then unused) and a program
    past its sequence's end does no work.
    """
    start_m = tl.program_id(0)
    if IS_CAUSAL:
        # The last query blocks see the most keys: launch them first, so the short ones fill the tail.
        start_m = tl.num_programs(0) - 1 - start_m
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // group
    # Base pointers in int64: batch and head offsets can exceed 2**31 elements.
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + off_b)
        seqlen_q = tl.load(cu_seqlens_q + off_b + 1) - q_start
        k_start = tl.load(cu_seqlens_k + off_b)
        seqlen_k = tl.load(cu_seqlens_k + off_b + 1) - k_start
        q_base = Q + q_start.to(tl.int64) * stride_qm + off_h.to(tl.int64) * stride_qh
        o_base = Out + q_start.to(tl.int64) * stride_om + off_h.to(tl.int64) * stride_oh
        k_base = K + k_start.to(tl.int64) * stride_kn + off_hk.to(tl.int64) * stride_kh
        v_base = V + k_start.to(tl.int64) * stride_vn + off_hk.to(tl.int64) * stride_vh
        lse_base = Lse + off_h.to(tl.int64) * stride_lh + q_start
    else:
        seqlen_q = seqlen_q_arg
        seqlen_k = seqlen_k_arg
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        o_base = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
        lse_base = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh

    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    q_base += m0.to(tl.int64) * stride_qm
    o_base += m0.to(tl.int64) * stride_om
    tile_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_ptrs = q_base + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=tile_ok, other=0.0)

    # Positions of the block's first and last rows (rows past seqlen_q only widen the range).
    diag = seqlen_k - seqlen_q
    pos_m = diag + offs_m
    p_first = diag + m0
    p_last = p_first + BLOCK_M - 1
    # Keys that any row may see: [lo, hi). lo is rounded down to a block boundary so loads stay aligned.
    hi = seqlen_k
    if IS_CAUSAL:
        hi = tl.minimum(hi, tl.maximum(p_last + 1, 0))
    if IS_VARLEN:
        hi = tl.where(m0 < seqlen_q, hi, 0)  # a program past its sequence's end visits no key
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p_first - window + 1, 0) // BLOCK_N * BLOCK_N
    lo = tl.minimum(lo, hi)
    # Blocks every row may fully see: [mid_lo, mid_hi), both on block boundaries.
    mid_lo = lo
    if HAS_WINDOW:
        mid_lo = tl.maximum(p_last - window + 1, 0)
        mid_lo = tl.minimum((mid_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, hi)
    mid_hi = seqlen_k // BLOCK_N * BLOCK_N
    if IS_CAUSAL:
        mid_hi = tl.minimum(mid_hi, tl.maximum(p_first + 1, 0) // BLOCK_N * BLOCK_N)
    mid_hi = tl.maximum(tl.minimum(mid_hi, hi), mid_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Stage 1: the window's leading edge; stage 2: fully allowed blocks; stage 3: diagonal and tail.
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, mid_lo, pos_m,
                                    seqlen_k, window, qk_scale, True, IS_CAUSAL, HAS_WINDOW, HEAD_DIM,
                                    BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mid_lo, mid_hi,
                                    pos_m, seqlen_k, window, qk_scale, False, IS_CAUSAL, HAS_WINDOW, HEAD_DIM,
                                    BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, mid_hi, hi, pos_m,
                                    seqlen_k, window, qk_scale, True, IS_CAUSAL, HAS_WINDOW, HEAD_DIM,
                                    BLOCK_N, BLOCK_D)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]  # empty rows: acc is 0, so out is 0
    o_ptrs = o_base + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=tile_ok)
    if RETURN_LSE:
        # m_i and log2(l_i) are in log2 units; ln 2 turns them into a natural log.
        lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
        lse = tl.where(empty, float("inf"), lse)
        tl.store(lse_base + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------- launcher
_LOG2E = 1.4426950408889634


def _launch(args: dict, config: LaunchConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Allocate out (and lse) and run the kernel. The grid comes from shapes and max_seqlen_q only:
    no tensor value is read on the host, so this can be captured in a CUDA graph."""
    q, k, v = args["q"], args["k"], args["v"]
    varlen = args["cu_seqlens_q"] is not None
    block_m, block_n = config.blocks["BLOCK_M"], config.blocks["BLOCK_N"]
    d = q.shape[-1]
    h_q, h_kv = q.shape[-2], k.shape[-2]
    if varlen:
        # Rows outside every sequence (before cu_seqlens_q[0], after cu_seqlens_q[-1]) belong to no
        # program: they get out 0 and lse +inf from the fill (an in-kernel gap fill is a later
        # optimization). Lengths come from cu_seqlens inside the kernel; batch strides are unused.
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        batch = args["cu_seqlens_q"].shape[0] - 1
        max_q, seqlen_q, seqlen_k = args["max_seqlen_q"], 0, 0
        lse_shape = (h_q, q.shape[0])
        strides = [(0, t.stride(0), t.stride(1)) for t in (q, k, v, out)]
        cu_q, cu_k = args["cu_seqlens_q"], args["cu_seqlens_k"]
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        max_q = seqlen_q
        lse_shape = (batch, h_q, seqlen_q)
        strides = [(t.stride(0), t.stride(1), t.stride(2)) for t in (q, k, v, out)]
        cu_q = cu_k = q  # unused without IS_VARLEN
    lse = None
    lse_strides = (0, 0)
    if args["return_lse"]:
        lse = torch.full(lse_shape, math.inf, dtype=torch.float32, device=q.device) if varlen else \
            torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        # lse [b, h, s] or varlen [h, total]: (batch stride, head stride); varlen has no batch stride.
        lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    window = args["window"]
    grid = (triton.cdiv(max_q, block_m), h_q, batch)
    _flash_attention_fwd_kernel[grid](
        q, k, v, out, lse if lse is not None else out, cu_q, cu_k,
        float(args["sm_scale"]) * _LOG2E, seqlen_q, seqlen_k, window or 0, h_q // h_kv,
        *strides[0], *strides[1], *strides[2], *strides[3], *lse_strides,
        IS_VARLEN=varlen, IS_CAUSAL=bool(args["causal"]), HAS_WINDOW=window is not None,
        RETURN_LSE=lse is not None, HEAD_DIM=d, BLOCK_D=dot_block(d),
        BLOCK_M=block_m, BLOCK_N=block_n, **config.knobs())
    return out, lse


class _FlashAttentionFunction(torch.autograd.Function):
    """Forward through the Triton kernel; backward by recomputing the PyTorch reference under autograd.

    The recomputing backward is exact but runs the PyTorch reference (fp32, chunked over queries) again;
    a Triton backward kernel is a later issue. Only used when grad is enabled and q, k or v requires grad.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: dict, config: LaunchConfig):
        out, lse = _launch(args, config)
        ctx.save_for_backward(q, k, v)
        ctx.rest = {name: value for name, value in args.items() if name not in ("q", "k", "v")}
        return out if lse is None else (out, lse)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        from registry.ops.flash_attention import reference

        q, k, v = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), needs, strict=True)]
        with torch.enable_grad():
            result = reference(q=inputs[0], k=inputs[1], v=inputs[2], **ctx.rest)
        outputs = result if isinstance(result, tuple) else (result,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
        wanted = [t for t in inputs if t.requires_grad]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        by_input = dict(zip(map(id, wanted), found, strict=True))
        return (*(by_input.get(id(t)) for t in inputs), None, None)


def flash_attention_forward(args: dict, config: LaunchConfig):
    """Dense attention on the op contract's validated args with the forward's config: `out`, or
    `(out, lse)`.

    `config.blocks` holds BLOCK_M and BLOCK_N; its knobs go to the launch. Differentiable through
    `_FlashAttentionFunction` when grad is enabled and an input requires grad.
    """
    q, k, v = args["q"], args["k"], args["v"]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FlashAttentionFunction.apply(q, k, v, args, config)
    out, lse = _launch(args, config)
    return out if lse is None else (out, lse)


# ----------------------------------------------------------------------------- offline compiles
def flash_attention_compile_specs(key: dict, config: LaunchConfig, dtype: str = "fp16") -> list[CompileSpec]:
    """The kernels a call with this tuning key and forward config may launch, typed as the JIT would
    type them: padded and packed (varlen) inputs share a key, so both specializations are checked.

    `key["dtype"]` picks the element type when present (`dtype` otherwise). The specs compile with
    RETURN_LSE on (the heavier of the two); the GQA group's value lets the check specialize it.
    """
    elem = key.get("dtype", dtype)
    if elem not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"dtype: expected fp16, bf16 or fp32, got {elem!r}")
    ptr = f"*{elem}"
    group = int(key["h_q"]) // int(key["h_kv"])
    specs = []
    for varlen in (False, True):
        signature = {
            "Q": ptr, "K": ptr, "V": ptr, "Out": ptr, "Lse": "*fp32",
            "cu_seqlens_q": "*i32" if varlen else ptr, "cu_seqlens_k": "*i32" if varlen else ptr,
            "qk_scale": "fp32", "seqlen_q_arg": "i32", "seqlen_k_arg": "i32", "window": "i32", "group": "i32",
        }
        signature.update({name: "i32" for name in (
            "stride_qb", "stride_qm", "stride_qh", "stride_kb", "stride_kn", "stride_kh",
            "stride_vb", "stride_vn", "stride_vh", "stride_ob", "stride_om", "stride_oh",
            "stride_lb", "stride_lh")})
        constexprs = {
            "IS_VARLEN": varlen, "IS_CAUSAL": bool(key["causal"]), "HAS_WINDOW": key["window"] is not None,
            "RETURN_LSE": True, "HEAD_DIM": int(key["d"]), "BLOCK_D": dot_block(key["d"]),
            "BLOCK_M": config.blocks["BLOCK_M"], "BLOCK_N": config.blocks["BLOCK_N"],
        }
        specs.append(CompileSpec("fwd", _flash_attention_fwd_kernel, signature, constexprs, values={"group": group}))
    return specs


# ----------------------------------------------------------------------------- the variant
# The interpreter's tiles, its default first: a few distinct small tiles keep CPU tests and sweeps fast.
INTERPRETER_TILES = tuple({"BLOCK_M": m, "BLOCK_N": n} for m, n in ((32, 32), (16, 16), (16, 32), (32, 16)))


class FlashAttentionTiledBase:
    """The tiled variant's logic; each vendor file subclasses it with `Variant` and sets its data:

    spaces: {"fwd": ConfigSpace} with blocks BLOCK_M and BLOCK_N, the vendor's knobs and keep rule,
        and the default for d 128;
    HEAD_DIM_DEFAULTS: (largest head dim, fields) rows: the first row whose head dim fits changes
        those fields of the space's default;
    shared_bytes(config, block_d, elem): shared memory/LDS estimate, calibrated on real compiles.
    fp32 inputs are not supported (`supports` is False): dispatch sends them to the reference. The
    backward recomputes through the reference (no backward kernel yet, so no backward role).
    """

    op = "flash_attention"
    name = "flash_attention_tiled"
    priority = 0
    kernels = {"fwd": _flash_attention_fwd_kernel}
    HEAD_DIM_DEFAULTS: tuple[tuple[int, dict], ...] = ()

    @staticmethod
    def shared_bytes(config: LaunchConfig, block_d: int, elem: int) -> int:
        raise NotImplementedError

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d"] <= 256

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        blocks = config.blocks
        if set(blocks) != {"BLOCK_M", "BLOCK_N"}:
            return f"blocks must be BLOCK_M and BLOCK_N, got {sorted(blocks)}"
        if min(blocks.values()) < 16:
            return f"tl.dot needs tiles of at least 16, got {blocks}"
        # A tile longer than the (bucketed) sequence only computes masked rows or keys, unless no
        # smaller tile exists to take its place.
        smallest = self._smallest_blocks(device)
        for block, dim in (("BLOCK_M", "s_q"), ("BLOCK_N", "s_k")):
            if blocks[block] > key[dim] and blocks[block] > smallest[block]:
                return f"{block}={blocks[block]} is longer than the {dim} bucket {key[dim]}"
        if device.key == "cpu":
            return None
        elem = 4 if key["dtype"] == "fp32" else 2
        need = self.shared_bytes(config, dot_block(key["d"]), elem)
        if need > device.shared_mem_bytes:
            return f"needs ~{need} B of shared memory/LDS (> {device.shared_mem_bytes} B)"
        return None

    def _smallest_blocks(self, device) -> dict[str, int]:
        return {name: min(values) for name, values in self.spaces["fwd"].block_values(device).items()}

    def role_default(self, role: str, key: dict, device) -> LaunchConfig:
        space = self.spaces["fwd"]
        if device.key == "cpu":
            return space.default(device)
        base = space.default(device)
        fields = {**base.blocks, **base.knobs()}
        fields.update(next((row for d_max, row in self.HEAD_DIM_DEFAULTS if key["d"] <= d_max), {}))
        smallest = self._smallest_blocks(device)
        # Short sequences: no tile longer than its bucket (down to the space's smallest tile).
        block_m = max(smallest["BLOCK_M"], min(fields.pop("BLOCK_M"), key["s_q"]))
        block_n = max(smallest["BLOCK_N"], min(fields.pop("BLOCK_N"), key["s_k"]))
        config = LaunchConfig(blocks={"BLOCK_M": block_m, "BLOCK_N": block_n}, **fields)
        if space.keep is not None and not space.keep(config, key):
            config = config.model_copy(update={"num_warps": 4})
        # A device with less shared memory than the table assumes: fewer stages, then narrower key tiles.
        while self.prune_reason(role, config, key, device) is not None:
            if config.num_stages > 1:
                config = config.model_copy(update={"num_stages": config.num_stages - 1})
            elif block_n > 16:
                block_n //= 2
                config = config.model_copy(update={"blocks": {"BLOCK_M": block_m, "BLOCK_N": block_n}})
            else:
                break
        return config

    def launch(self, args: dict, config: CallConfig):
        return flash_attention_forward(args, config["fwd"])

    def bind(self, config: CallConfig):
        forward = config["fwd"]
        return lambda args: flash_attention_forward(args, forward)

    def compile_specs(self, key: dict, config: CallConfig, dtype: str = "fp16") -> list[CompileSpec]:
        return flash_attention_compile_specs(key, config["fwd"], dtype)
