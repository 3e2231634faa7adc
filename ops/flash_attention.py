"""flash_attention: dense softmax attention with GQA, causal masks, sliding windows and varlen packing."""

from __future__ import annotations

import torch

from kreg.ops.contract import Args, Op
from kreg.ops.dense_attention import (
    check_dense_args,
    dense_bytes,
    dense_flops,
    dense_layouts,
    dense_output_specs,
    dense_tuning_key,
    make_dense_inputs,
    reduce_dense_shape,
    run_dense,
)


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    deterministic: bool = False,
) -> dict:
    """flash_attention(q, k, v, causal=False, sm_scale=None, window=None, return_lse=False,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False)
    -> out | (out, lse)

    Dense attention `out_i = sum_j softmax_j(z_ij) v_j` with `z_ij = sm_scale * q_i . k_j`.

    Layouts:
    - batched: `q [b, s_q, h_q, d]`, `k, v [b, s_k, h_kv, d]`;
    - varlen (packed): `q [total_q, h_q, d]`, `k, v [total_k, h_kv, d]` with `cu_seqlens_q`,
      `cu_seqlens_k` int32 `[b + 1]` (sequence i owns rows `cu[i]:cu[i + 1]`), and `max_seqlen_q`,
      `max_seqlen_k` REQUIRED (the longest sequence of each, as FlashAttention's varlen API takes them:
      reading cu_seqlens on the host would be a device sync). Rows outside every sequence are
      left to the implementation (the reference and the kernels return 0 and lse +inf there).
      Offsets are not checked on the host: kernels clamp each sequence into the packed rows, so
      offsets past the end, negative or decreasing never make them touch memory outside the
      tensors (the results for such offsets are unspecified); a max_seqlen shorter than a sequence
      only costs speed, never rows.
    q, k, v share one dtype (fp16, bf16 or fp32) and device; any strides, but the last dimension
    must be contiguous. `d` in 1..256; GQA needs `h_q % h_kv == 0` and query head h reads kv head
    `h // (h_q // h_kv)`.

    Masks (each sequence aligned bottom-right on its own lengths): query i sits at `p_i = s_k - s_q + i`;
    `causal=True` allows key j iff `j <= p_i`; `window=W` (needs causal=True) allows key j iff
    `0 <= p_i - j <= W - 1` (W keys including the query itself, FlashAttention `window_size=(W-1, 0)`).
    `sm_scale` defaults to `d ** -0.5`.

    Returns `out` like q (q's dtype), or `(out, lse)` when `return_lse`: lse fp32 natural-log
    `[b, h_q, s_q]` (varlen: `[h_q, total_q]`). A row with no allowed key (causal with s_q > s_k)
    returns out 0 and lse +inf. Differentiable for q, k and v (through `out`; the returned lse is not
    differentiable, as in FlashAttention). `deterministic=True` asks for a backward without atomics,
    bitwise identical from run to run; the kernels' backward never uses atomics, so it costs nothing.

    Raises ValueError/TypeError naming the argument for wrong ranks, shapes, dtypes or devices, a
    non-contiguous last dimension, h_q not divisible by h_kv, an empty batch, a window without
    causal or beyond int32, a non-bool flag, or varlen without max_seqlen_q/max_seqlen_k or with a
    max_seqlen larger than the packed rows.
    """
    scale, key = check_dense_args(
        q, k, v, causal, sm_scale, window, return_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        deterministic,
    )
    args = Args(
        q=q,
        k=k,
        v=v,
        causal=causal,
        sm_scale=scale,
        window=window,
        return_lse=return_lse,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        deterministic=deterministic,
    )
    args.key = key
    return args


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    deterministic: bool = False,
):
    """The semantics in PyTorch (fp32 math, chunked over queries); takes `validate`'s dict
    (`deterministic` changes nothing here)."""
    return run_dense(
        q, k, v, causal=causal, sm_scale=sm_scale, window=window, return_lse=return_lse,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, sinks=None,
    )


def tuning_key(args: dict) -> tuple:
    """(causal, d, dtype, h_kv, h_q, s_k bucket, s_q bucket, varlen, window); varlen buckets max_seqlen."""
    return dense_tuning_key(args)


def flops(args: dict) -> float:
    """`4 * b * h_q * pairs * d`, pairs counted in closed form from shapes, causal and window.
    Varlen counts each sequence at (max_seqlen_q, max_seqlen_k): an upper bound."""
    return dense_flops(args)


def bytes_moved(args: dict) -> float:
    """q, k, v read once and out (and lse) written once."""
    return dense_bytes(args)


def make_inputs(shape: dict, *, device, dtype, seed: int) -> dict:
    """Random arguments for a preset shape: dict(q, k, v, causal, window) (+ cu_seqlens for varlen)."""
    return make_dense_inputs(shape, device=device, dtype=dtype, seed=seed, with_sinks=False)


def _shape(b, s, h, d, causal, s_k=None, h_kv=None, window=None):
    return {"b": b, "s_q": s, "s_k": s if s_k is None else s_k, "h_q": h, "h_kv": h if h_kv is None else h_kv,
            "d": d, "causal": causal, "window": window}


presets = {
    "tiny": [
        _shape(1, 37, 4, 64, True, h_kv=2),
        _shape(1, 19, 2, 128, False),
        _shape(2, 13, 4, 64, True, s_k=29, h_kv=1),
    ],
    # The targets' shapes: b 2, s 8192, h 16, d 128 causal; b 4, h 8 and 32, s 1024..8192, d 64, causal and not.
    "full": [_shape(2, 8192, 16, 128, True)]
    + [
        _shape(4, s, h, 64, causal)
        for h in (8, 32)
        for s in (1024, 2048, 4096, 8192)
        for causal in (True, False)
    ],
}

OP = Op(
    name="flash_attention",
    summary="dense attention with GQA, causal/sliding-window masks and varlen packing",
    validate=validate,
    reference=reference,
    tuning_key=tuning_key,
    flops=flops,
    bytes_moved=bytes_moved,
    make_inputs=make_inputs,
    presets=presets,
    reduce_shape=reduce_dense_shape,
    outputs=("out", "lse"),
    length_dims=("s_k", "s_q"),
    layouts=dense_layouts,
    output_specs=dense_output_specs,
    grad_inputs=("q", "k", "v"),
)
