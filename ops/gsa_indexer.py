"""gsa_indexer: the Gated Sparse Attention indexer's causal query-key scores.

Owns the score computation `gsa_topk` selects from (`score_chunks`) and the argument checks both ops
share (`validate` here is called by `gsa_topk.validate`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kreg.ops.contract import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    Op,
    TensorSpec,
    bucket_pow2,
    query_chunk,
    random_normal,
    require_float,
    require_last_contiguous,
    require_nonempty,
    require_same_device,
    require_same_dtype,
    require_tensor,
    resolve_scale,
)


def validate(
    q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, sm_scale: float | None = None
) -> dict:
    """Gated Sparse Attention indexer scores.

    gsa_indexer(q_idx, k_idx, w, bias, sm_scale=None) -> scores

    Layouts:
        q_idx  [b, t, h_i, d_i]  bf16/fp16/fp32 index queries (h_i index heads)
        k_idx  [b, t, d_i]       same dtype as q_idx: one index key head shared by all index heads
        w      [b, t, h_i]       float: per-query, per-head gate logits
        bias   [h_i]             float: per-head score bias
    Every tensor's last dimension must be contiguous; other strides are free.

    Math: scores[b, i, j] = sum_h sigmoid(w[b, i, h]) * sigmoid(sm_scale * q_idx[b, i, h] . k_idx[b, j]
    + bias[h]) for j <= i and -inf for j > i (causal). sm_scale defaults to d_i ** -0.5.

    Returns scores [b, t, t] fp32. Not differentiable (top-k selection consumes it).

    Raises ValueError/TypeError naming the argument for wrong shapes, dtypes or devices, a
    non-contiguous last dimension, or an empty q_idx.
    """
    # Each tensor attribute read costs ~0.1-0.4 us: fast compares first, the helpers only word errors.
    named = (("q_idx", q_idx), ("k_idx", k_idx), ("w", w), ("bias", bias))
    tensor = torch.Tensor
    if not (isinstance(q_idx, tensor) and isinstance(k_idx, tensor) and isinstance(w, tensor)
            and isinstance(bias, tensor)):
        for name, x in named:
            require_tensor(name, x)
    qs = q_idx.shape
    if len(qs) != 4:
        raise ValueError(f"q_idx: expected shape [b, t, h_i, d_i], got {list(qs)}")
    b, t, h_i, d_i = qs
    if 0 in qs:
        require_nonempty("q_idx", q_idx)
    if k_idx.shape != (b, t, d_i):
        raise ValueError(f"k_idx: expected shape [b, t, d_i] = {[b, t, d_i]}, got {list(k_idx.shape)}")
    if w.shape != (b, t, h_i):
        raise ValueError(f"w: expected shape [b, t, h_i] = {[b, t, h_i]}, got {list(w.shape)}")
    if bias.shape != (h_i,):
        raise ValueError(f"bias: expected shape [h_i] = [{h_i}], got {list(bias.shape)}")
    dtype = q_idx.dtype
    if dtype not in FLOAT_DTYPES:
        require_float("q_idx", q_idx)
    if k_idx.dtype != dtype:
        require_same_dtype([("q_idx", q_idx), ("k_idx", k_idx)])
    if w.dtype not in FLOAT_DTYPES:
        require_float("w", w)
    if bias.dtype not in FLOAT_DTYPES:
        require_float("bias", bias)
    device = q_idx.device
    if k_idx.device != device or w.device != device or bias.device != device:
        require_same_device(named)
    if q_idx.stride(-1) != 1 or k_idx.stride(-1) != 1 or w.stride(-1) != 1 or bias.stride(-1) != 1:
        for name, x in named:
            require_last_contiguous(name, x)
    sm_scale = d_i**-0.5 if sm_scale is None else resolve_scale("sm_scale", sm_scale, d_i)
    return {"q_idx": q_idx, "k_idx": k_idx, "w": w, "bias": bias, "sm_scale": sm_scale}


def score_chunks(
    q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, sm_scale: float
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (start, scores[:, start:start + c, :]) over query chunks, in fp32 (fp64 for fp64 inputs).

    Each chunk holds the causal indexer scores of `c` queries against all t keys (-inf for j > i),
    sized so one chunk's per-head logits stay within a fixed element budget.
    """
    ct = torch.float64 if q_idx.dtype == torch.float64 else torch.float32
    b, t, h_i, _ = q_idx.shape
    keys = k_idx.to(ct)
    bias = bias.to(ct)[:, None]
    cols = torch.arange(t, device=q_idx.device)
    chunk = query_chunk(2 * b * h_i * t)
    for start in range(0, t, chunk):
        rows = slice(start, start + chunk)
        logits = torch.einsum("bchd,btd->bcht", q_idx[:, rows].to(ct), keys) * sm_scale + bias
        scores = (torch.sigmoid(w[:, rows].to(ct))[..., None] * torch.sigmoid(logits)).sum(2)
        future = cols > cols[rows, None]
        yield start, torch.where(future, float("-inf"), scores)


def reference(
    q_idx: torch.Tensor, k_idx: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """The PyTorch semantics of `gsa_indexer` (see `validate`): scores [b, t, t] fp32."""
    return torch.cat([s for _, s in score_chunks(q_idx, k_idx, w, bias, sm_scale)], dim=1)


def tuning_key(args: dict) -> tuple:
    """(name, value) pairs that pick a config; the sequence length is bucketed."""
    q = args["q_idx"]
    return (
        ("d_i", q.shape[3]),
        ("dtype", DTYPE_NAMES[q.dtype]),
        ("h_i", q.shape[2]),
        ("t", bucket_pow2(q.shape[1])),
    )


def flops(args: dict) -> float:
    """2 * b * h_i * pairs * d_i over the causal pairs (the dot products; the gating is negligible)."""
    b, t, h_i, d_i = args["q_idx"].shape
    return 2.0 * b * h_i * (t * (t + 1) // 2) * d_i


def bytes_moved(args: dict) -> float:
    """Inputs read once, the fp32 [b, t, t] scores written once."""
    b, t = args["q_idx"].shape[:2]
    read = sum(args[n].numel() * args[n].element_size() for n in ("q_idx", "k_idx", "w", "bias"))
    return float(read + b * t * t * 4)


def make_inputs(shape: dict, *, device, dtype, seed: int) -> dict:
    """Random arguments for a preset shape (keys b, t, h_i, d_i)."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h_i, d_i = shape["b"], shape["t"], shape["h_i"], shape["d_i"]
    return {
        "q_idx": random_normal((b, t, h_i, d_i), device=device, dtype=dtype, generator=gen),
        "k_idx": random_normal((b, t, d_i), device=device, dtype=dtype, generator=gen),
        "w": random_normal((b, t, h_i), device=device, dtype=dtype, generator=gen),
        "bias": random_normal((h_i,), device=device, dtype=dtype, generator=gen, scale=0.5),
    }


def reduce_shape(shape: dict) -> dict:
    """Same heads and head dim; at most 2048 positions."""
    return {**shape, "t": min(shape["t"], 2048)}


_INDEX_HEADS = {"b": 1, "h_i": 4, "d_i": 64}
presets = {
    "tiny": [
        {"b": 2, "t": 37, "h_i": 4, "d_i": 16},
        {"b": 1, "t": 17, "h_i": 2, "d_i": 8},
    ],
    "full": [{"t": t, **_INDEX_HEADS} for t in (4096, 8192, 32768)],
}


def output_specs(args: dict) -> TensorSpec:
    """scores fp32 `[b, t, t]`."""
    b, t = args["q_idx"].shape[:2]
    return TensorSpec((b, t, t), torch.float32)


OP = Op(
    name="gsa_indexer",
    summary="Gated Sparse Attention indexer: gated sigmoid scores of every causal query-key pair",
    validate=validate,
    reference=reference,
    tuning_key=tuning_key,
    flops=flops,
    bytes_moved=bytes_moved,
    make_inputs=make_inputs,
    presets=presets,
    reduce_shape=reduce_shape,
    outputs=("scores",),
    length_dims=("t",),
    output_specs=output_specs,
)
