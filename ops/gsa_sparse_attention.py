"""gsa_sparse_attention: attention over a per-query key set shared by all heads (GSA's top-k keys)."""

from __future__ import annotations

import torch

from kreg.ops.contract import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    Op,
    TensorSpec,
    bucket_pow2,
    masked_softmax,
    query_chunk,
    random_indices,
    random_normal,
    require_float,
    require_int32,
    require_last_contiguous,
    require_nonempty,
    require_same_device,
    require_same_dtype,
    require_tensor,
    resolve_scale,
    spec_like,
)


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    topk_length: torch.Tensor | None = None,
) -> dict:
    """Sparse attention of Gated Sparse Attention: every head of a query attends to one key set.

    gsa_sparse_attention(q, k, v, indices, sm_scale=None, topk_length=None) -> out

    Layouts:
        q            [b, t, h_q, d]   bf16/fp16 (fp32: reference only)
        k, v         [b, t, h_kv, d]  same dtype as q; h_kv divides h_q (GQA: head h reads h // (h_q // h_kv))
        indices      [b, t, topk]     int32: query i's keys, shared by all its heads (gsa_topk's output)
        topk_length  [b, t] int32, optional: only the first topk_length[b, i] slots are valid
    Every tensor's last dimension must be contiguous; other strides are free.

    Math: z_j = sm_scale * q[b, i, h] . k[b, idx_j, g] over the valid slots j of indices[b, i];
    out[b, i, h] = sum_j softmax(z)_j v[b, idx_j, g]. sm_scale defaults to d ** -0.5. No causal flag:
    causality lives in the indices. A slot is invalid when its index lies outside [0, t) (-1, -7, t and
    2**31-1 alike) or its position is >= topk_length; invalid slots are masked, never read. Duplicates
    count with multiplicity. A query with no valid slot gets out = 0.

    Returns out [b, t, h_q, d] like q. Differentiable for q, k and v.

    Raises ValueError/TypeError naming the argument for wrong shapes, dtypes (indices and topk_length
    int32) or devices, a non-contiguous last dimension, h_q not divisible by h_kv, or an empty tensor.
    """
    # Each tensor attribute read costs ~0.1-0.4 us: fast compares first, the helpers only word errors.
    named = (("q", q), ("k", k), ("v", v), ("indices", indices))
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)
            and isinstance(indices, tensor)):
        for name, x in named:
            require_tensor(name, x)
    qs, ks = q.shape, k.shape
    if len(qs) != 4:
        raise ValueError(f"q: expected shape [b, t, h_q, d], got {list(qs)}")
    b, t, h_q, d = qs
    if len(ks) != 4 or ks[0] != b or ks[1] != t or ks[3] != d:
        raise ValueError(f"k: expected shape [b, t, h_kv, d] with b = {b}, t = {t}, d = {d}, got {list(ks)}")
    if v.shape != ks:
        raise ValueError(f"v: expected the shape of k {list(ks)}, got {list(v.shape)}")
    js = indices.shape
    if len(js) != 3 or js[0] != b or js[1] != t:
        raise ValueError(f"indices: expected shape [b, t, topk] with b = {b}, t = {t}, got {list(js)}")
    if 0 in qs or 0 in ks or 0 in js:
        for name, x in named:
            require_nonempty(name, x)
    dtype = q.dtype
    if dtype not in FLOAT_DTYPES:
        require_float("q", q)
    if k.dtype != dtype or v.dtype != dtype:
        require_same_dtype(named[:3])
    if indices.dtype != torch.int32:
        require_int32("indices", indices)
    h_kv = ks[2]
    if h_q % h_kv:
        raise ValueError(f"k: expected h_kv dividing q's h_q = {h_q} (GQA), got h_kv = {h_kv}")
    device = q.device
    if k.device != device or v.device != device or indices.device != device:
        require_same_device(named)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or indices.stride(-1) != 1:
        for name, x in named:
            require_last_contiguous(name, x)
    if topk_length is not None:
        if not isinstance(topk_length, tensor):
            require_tensor("topk_length", topk_length)
        if topk_length.dtype != torch.int32:
            require_int32("topk_length", topk_length)
        if topk_length.shape != (b, t):
            raise ValueError(f"topk_length: expected shape [b, t] = {[b, t]}, got {list(topk_length.shape)}")
        if topk_length.device != device:
            require_same_device([("q", q), ("topk_length", topk_length)])
        if topk_length.stride(-1) != 1:
            require_last_contiguous("topk_length", topk_length)
    sm_scale = d**-0.5 if sm_scale is None else resolve_scale("sm_scale", sm_scale, d)
    return {
        "q": q,
        "k": k,
        "v": v,
        "indices": indices,
        "sm_scale": sm_scale,
        "topk_length": topk_length,
    }


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch semantics of `gsa_sparse_attention` (see `validate`), in fp32, chunked over queries.

    Scores are computed densely per chunk and gathered at the indices; probabilities are scattered back
    (adding up duplicates) before the product with v, so K and V are never gathered per query.
    fp64 inputs (tests' gradcheck only) are computed and returned in fp64.
    """
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, t, h_q, d = q.shape
    h_kv, topk = k.shape[2], indices.shape[2]
    group = h_q // h_kv
    valid = (indices >= 0) & (indices < t)
    if topk_length is not None:
        valid = valid & (torch.arange(topk, device=q.device) < topk_length[..., None])
    # Invalid slots point at key 0 and are masked out of the softmax.
    idx = torch.where(valid, indices, 0).long()
    kf, vf = k.to(ct), v.to(ct)
    chunk = query_chunk(b * h_q * (3 * t + 3 * topk))
    outs = []
    for start in range(0, t, chunk):
        rows = slice(start, start + chunk)
        qc = q[:, rows].to(ct).unflatten(2, (h_kv, group))  # [b, c, g, r, d]
        z_all = torch.einsum("bcgrd,btgd->bcgrt", qc, kf) * sm_scale
        slot_idx = idx[:, rows, None, None, :].expand(*z_all.shape[:-1], topk)
        p, _ = masked_softmax(z_all.gather(-1, slot_idx), valid[:, rows, None, None, :])
        p_dense = torch.zeros_like(z_all).scatter_add(-1, slot_idx, p)
        outs.append(torch.einsum("bcgrt,btgd->bcgrd", p_dense, vf).flatten(2, 3))
    return torch.cat(outs, 1).to(q.dtype)


def tuning_key(args: dict) -> tuple:
    """(name, value) pairs that pick a config; the sequence length is bucketed."""
    q = args["q"]
    return (
        ("d", q.shape[3]),
        ("dtype", DTYPE_NAMES[q.dtype]),
        ("h_kv", args["k"].shape[2]),
        ("h_q", q.shape[2]),
        ("t", bucket_pow2(q.shape[1])),
        ("topk", args["indices"].shape[2]),
    )


def flops(args: dict) -> float:
    """Attention forward over every slot: 4 * b * h_q * (t * topk) * d."""
    b, t, h_q, d = args["q"].shape
    return 4.0 * b * h_q * t * args["indices"].shape[2] * d


def bytes_moved(args: dict) -> float:
    """The measure for this op (docs/performance.md): the gathered K and V rows (one per query, slot and kv head; L2
    reuse across queries is what lets a kernel beat the copy ceiling), plus q, indices and topk_length
    read once and out written once."""
    q, k = args["q"], args["k"]
    b, t, h_kv, d = k.shape
    gathered = 2 * b * t * args["indices"].shape[2] * h_kv * d * k.element_size()
    small = sum(x.numel() * x.element_size() for x in (args["indices"], args["topk_length"]) if x is not None)
    return float(gathered + small + 2 * q.numel() * q.element_size())


def make_inputs(shape: dict, *, device, dtype, seed: int) -> dict:
    """Random arguments for a preset shape (keys b, t, h_q, h_kv, d, k; flag topk_length).

    Query i picks from the causal keys [0, i], with duplicates and -1 fillers, like gsa_topk's output.
    On the meta device nothing is drawn (shapes only: t * k indices at the full presets take seconds).
    """
    gen = torch.Generator().manual_seed(seed)
    b, t, h_q, h_kv, d, topk = (shape[n] for n in ("b", "t", "h_q", "h_kv", "d", "k"))
    meta = torch.device(device).type == "meta"
    args = {
        "q": random_normal((b, t, h_q, d), device=device, dtype=dtype, generator=gen),
        "k": random_normal((b, t, h_kv, d), device=device, dtype=dtype, generator=gen),
        "v": random_normal((b, t, h_kv, d), device=device, dtype=dtype, generator=gen),
        "indices": torch.empty((b, t, topk), device=device, dtype=torch.int32) if meta
        else random_indices(torch.arange(1, t + 1), (b, t, topk), generator=gen).to(device),
    }
    if shape.get("topk_length"):
        lengths = torch.empty((b, t), dtype=torch.int32) if meta \
            else torch.randint(0, topk + 2, (b, t), generator=gen, dtype=torch.int32)
        args["topk_length"] = lengths.to(device)
    return args


def reduce_shape(shape: dict) -> dict:
    """Same heads, head dim and k; at most 2048 positions."""
    return {**shape, "t": min(shape["t"], 2048)}


# The interpreter runs one kernel program per query and head block, each at a cost of milliseconds:
# the tiny shapes keep few queries (still odd, with k past the causal keys).
presets = {
    "tiny": [
        {"b": 2, "t": 7, "h_q": 8, "h_kv": 2, "d": 16, "k": 9},
        {"b": 1, "t": 13, "h_q": 4, "h_kv": 4, "d": 32, "k": 7, "topk_length": True},
    ],
    "full": [{"b": 1, "t": t, "h_q": 16, "h_kv": 16, "d": 128, "k": 2048} for t in (4096, 8192, 32768)],
}


def output_specs(args: dict) -> TensorSpec:
    """out like q."""
    return spec_like(args["q"])



def specializations(args: dict) -> list[dict]:
    """The call as given, and with per-query top-k lengths (a kernel branch of their own)."""
    q = args["q"]
    lengths = torch.zeros(q.shape[:2], device=q.device, dtype=torch.int32)
    return [args, validate(**{**args, "topk_length": lengths})]


OP = Op(
    name="gsa_sparse_attention",
    summary="Gated Sparse Attention's sparse attention: each query's heads attend to its top-k keys",
    validate=validate,
    reference=reference,
    tuning_key=tuning_key,
    flops=flops,
    bytes_moved=bytes_moved,
    make_inputs=make_inputs,
    presets=presets,
    reduce_shape=reduce_shape,
    outputs=("out",),
    length_dims=("t",),
    grad_inputs=("q", "k", "v"),
    output_specs=output_specs,
    specializations=specializations,
)
