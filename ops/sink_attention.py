"""sink_attention: gpt-oss attention with per-head sinks, sliding windows, GQA and varlen packing."""

from __future__ import annotations

import torch

from kreg.ops.contract import Args, Op
from kreg.ops.dense_attention import (
    check_dense_args,
    check_sinks,
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
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
    return_lse: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    deterministic: bool = False,
) -> dict:
    """sink_attention(q, k, v, sinks=None, window=None, causal=True, sm_scale=None, return_lse=False,
    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False)
    -> out | (out, lse)

    gpt-oss attention: softmax attention where each head also has a sink, a raw logit (not multiplied
    by sm_scale, never masked, no value vector) that takes a share of the softmax:
    `out = out_nosink * sigmoid(lse - sinks[h])`, i.e. `softmax` over the keys and the sink with the
    sink's value 0. `sinks` is a contiguous fp32 `[h_q]` (HF calls it `s_aux`); None means plain attention.

    Layouts, masks and defaults as flash_attention, except `causal=True` by default:
    - batched: `q [b, s_q, h_q, d]`, `k, v [b, s_k, h_kv, d]`;
    - varlen: `q [total_q, h_q, d]`, `k, v [total_k, h_kv, d]`, `cu_seqlens_q`, `cu_seqlens_k` int32
      `[b + 1]` and REQUIRED `max_seqlen_q`, `max_seqlen_k` (no host read of cu_seqlens: kernels clamp
      each sequence into the packed rows, whatever the offsets hold);
    - query i sits at `p_i = s_k - s_q + i` (bottom-right, per sequence); causal allows `j <= p_i`;
      `window=W` (needs causal) allows `0 <= p_i - j <= W - 1`; `sm_scale` defaults to `d ** -0.5`;
    - one dtype (fp16, bf16, fp32) and device for q, k, v; last dimension contiguous; d in 1..256;
      `h_q % h_kv == 0`, query head h reads kv head `h // (h_q // h_kv)`.

    Returns `out` like q, or `(out, lse)` when `return_lse`: lse fp32 `[b, h_q, s_q]` (varlen
    `[h_q, total_q]`) over the keys only (the sink is never inside lse). A row with no allowed key
    returns out 0 and lse +inf whatever the sink (±inf included).

    Differentiable for q, k, v and sinks (through `out`; the returned lse is not differentiable). With
    `lse_tot = logaddexp(lse, sinks[h])`, `P = exp(z - lse_tot)` and `Delta = rowsum(dO * O)`, the
    backward is FlashAttention-2's and `d sinks[h] = -sum_{b,i} exp(sinks[h] - lse_tot) * Delta`.
    `deterministic=True` asks for a backward without atomics, bitwise identical from run to run (the
    kernels' backward never uses atomics: d sinks is a fixed-order sum of per-block partials).

    Raises ValueError/TypeError naming the argument for wrong ranks, shapes, dtypes (sinks must be
    fp32) or devices, a non-contiguous last dimension, h_q not divisible by h_kv, an empty batch, a
    window without causal or beyond int32, a non-bool flag, or varlen without
    max_seqlen_q/max_seqlen_k or with a max_seqlen larger than the packed rows.
    """
    scale, key = check_dense_args(
        q, k, v, causal, sm_scale, window, return_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        deterministic,
    )
    if sinks is not None:
        check_sinks(sinks, q.shape[-2], q)
    args = Args(
        q=q,
        k=k,
        v=v,
        sinks=sinks,
        window=window,
        causal=causal,
        sm_scale=scale,
        return_lse=return_lse,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        deterministic=deterministic,
    )
    args.key = (*key, sinks is None)
    return args


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
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
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, sinks=sinks,
    )


def tuning_key(args: dict) -> tuple:
    """flash_attention's key plus ("sinks", bool)."""
    return dense_tuning_key(args, sinks=args["sinks"] is not None)


def flops(args: dict) -> float:
    """`4 * b * h_q * pairs * d`, pairs counted in closed form from shapes, causal and window (the
    sink rescale is O(rows) and not counted). Varlen counts each sequence at its max_seqlen: an
    upper bound."""
    return dense_flops(args)


def bytes_moved(args: dict) -> float:
    """q, k, v and sinks read once; out (and lse) written once."""
    return dense_bytes(args, args["sinks"])


def make_inputs(shape: dict, *, device, dtype, seed: int) -> dict:
    """Random arguments for a preset shape: dict(q, k, v, causal, window, sinks) (sinks unless the
    shape says "sinks": False; + cu_seqlens for "varlen": True)."""
    return make_dense_inputs(shape, device=device, dtype=dtype, seed=seed, with_sinks=True)


def _shape(b, s, h_q, h_kv, d, causal=True, window=None, s_k=None, sinks=True):
    return {"b": b, "s_q": s, "s_k": s if s_k is None else s_k, "h_q": h_q, "h_kv": h_kv, "d": d,
            "causal": causal, "window": window, "sinks": sinks}


presets = {
    "tiny": [
        _shape(2, 37, 4, 2, 64),
        _shape(1, 45, 8, 1, 64, window=32),  # a window Hopper's window kernel takes (GQA 8, d 64)
        _shape(2, 11, 2, 2, 128, s_k=27),
    ],
    # The targets' shapes: gpt-oss full causal and window 128 (s 8192 and 32768); fwd+bwd at b 2, s 8192, h 16, d 128.
    "full": [
        _shape(1, 8192, 64, 8, 64),
        _shape(1, 8192, 64, 8, 64, window=128),
        _shape(1, 32768, 64, 8, 64, window=128),
        _shape(2, 8192, 16, 16, 128),
    ],
}

OP = Op(
    name="sink_attention",
    summary="gpt-oss attention with per-head sinks, sliding window, GQA and varlen packing",
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
    grad_inputs=("q", "k", "v", "sinks"),
)
