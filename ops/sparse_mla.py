"""sparse_mla: DeepSeek-V3.2 sparse MLA attention, FlashMLA's `flash_mla_sparse_fwd` contract.

Its reference uses `masked_softmax` and its inputs `random_indices`, shared with the other sparse ops
in `ops/contract.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kreg.ops.contract import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    Args,
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
    require_positive_int,
    require_same_device,
    require_same_dtype,
    require_tensor,
    resolve_scale,
)

_LAYOUTS = {
    False: {
        "q": "[s_q, h_q, d_qk]",
        "kv": "[s_kv, h_kv, d_qk]",
        "indices": "[s_q, h_kv, topk]",
        "topk_length": "[s_q]",
    },
    True: {
        "q": "[b, s_q, h_q, d_qk]",
        "kv": "[b, s_kv, h_kv, d_qk]",
        "indices": "[b, s_q, h_kv, topk]",
        "topk_length": "[b, s_q]",
    },
}


class SparseMLAOutput(NamedTuple):
    """What `sparse_mla` returns: `out` in the input dtype, `max_logits` and `lse` in fp32."""

    out: torch.Tensor
    max_logits: torch.Tensor
    lse: torch.Tensor


def validate(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    deterministic: bool = False,
) -> dict:
    """Sparse MLA forward (DeepSeek-V3.2), FlashMLA-compatible.

    sparse_mla(q, kv, indices, sm_scale=None, d_v=512, attn_sink=None, topk_length=None,
               deterministic=False) -> SparseMLAOutput(out, max_logits, lse)

    Layouts (unbatched, or batched with a leading b and indices local to each batch row):
        q            [s_q, h_q, d_qk]     or [b, s_q, h_q, d_qk]      bf16/fp16 (fp32: reference only)
        kv           [s_kv, h_kv, d_qk]   or [b, s_kv, h_kv, d_qk]    same dtype as q
        indices      [s_q, h_kv, topk]    or [b, s_q, h_kv, topk]     int32
        attn_sink    [h_q] fp32, optional: raw logits (not scaled by sm_scale)
        topk_length  [s_q] or [b, s_q] int32, optional: only the first topk_length slots are valid
    Every tensor's last dimension must be contiguous; other strides are free.

    Math: query head h reads kv group g = h // (h_q // h_kv). For each valid slot j of
    indices[t, g], z_j = sm_scale * q[t, h] . kv[idx_j, g, :] (all d_qk dims) and the value is
    kv[idx_j, g, :d_v]. out = sum_j softmax(z)_j V_j, lse = ln sum_j exp(z_j), max_logits = max_j z_j.
    With a sink: out = out * sigmoid(lse - attn_sink[h]); lse and max_logits never include the sink.
    sm_scale defaults to d_qk ** -0.5 (DeepSeek-V3.2 passes its own); d_v <= d_qk.

    Indices: there is no causal flag, causality lives in the indices. A slot is invalid when its index
    lies outside [0, s_kv) (-1, -7, s_kv and 2**31-1 alike) or its position is >= topk_length; invalid
    slots are masked, never read. Duplicates count with multiplicity. A row with no valid slot returns
    out = 0, lse = +inf and max_logits = -inf, whatever the sink. A NaN logit makes its row's out and lse
    NaN; max_logits is the largest logit that is not NaN (a GPU max instruction's IEEE maxNum).

    Returns SparseMLAOutput(out [.., s_q, h_q, d_v] like q, max_logits [.., s_q, h_q] fp32,
    lse [.., s_q, h_q] fp32).

    Differentiable for q, kv (through its key and its value role) and attn_sink; max_logits carries no
    gradient. Kernel backwards may accumulate dkv with atomics (a summation order, and so last bits of
    dkv, that vary between runs); `deterministic=True` (a keyword after FlashMLA's arguments, so its
    call form is unchanged), or torch.use_deterministic_algorithms(True), asks for a backward without
    atomics whose gradients are bitwise identical from run to run, at a measured cost
    (benchmarks/sparse_mla.py).

    Raises ValueError/TypeError naming the argument for wrong ranks, shapes, dtypes (indices and
    topk_length int32, attn_sink fp32) or devices, a non-contiguous last dimension, h_q not divisible
    by h_kv, d_v > d_qk, an empty tensor, or a non-bool deterministic.
    """
    # Each tensor attribute read costs ~0.1-0.4 us: fast compares first, the helpers only word errors.
    main = (("q", q), ("kv", kv), ("indices", indices))
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(kv, tensor) and isinstance(indices, tensor)):
        for name, x in main:
            require_tensor(name, x)
    qs, ks, js = q.shape, kv.shape, indices.shape
    rank = len(qs)
    if rank != 3 and rank != 4:
        raise ValueError(f"q: expected shape [s_q, h_q, d_qk] or [b, s_q, h_q, d_qk], got {list(qs)}")
    batched = rank == 4
    layout = _LAYOUTS[batched]
    s_q, h_q, d_qk = qs[-3], qs[-2], qs[-1]
    if len(ks) != rank or ks[-1] != d_qk or (batched and ks[0] != qs[0]):
        want = f"b = {qs[0]}, " if batched else ""
        raise ValueError(f"kv: expected shape {layout['kv']} with {want}d_qk = {d_qk}, got {list(ks)}")
    h_kv = ks[-2]
    if len(js) != rank or js[-3] != s_q or js[-2] != h_kv or (batched and js[0] != qs[0]):
        want = f"b = {qs[0]}, " if batched else ""
        raise ValueError(
            f"indices: expected shape {layout['indices']} with {want}s_q = {s_q}, h_kv = {h_kv}, "
            f"got {list(js)}"
        )
    if 0 in qs or 0 in ks or 0 in js:
        for name, x in main:
            require_nonempty(name, x)
    dtype = q.dtype
    if dtype not in FLOAT_DTYPES:
        require_float("q", q)
    if kv.dtype != dtype:
        require_same_dtype([("q", q), ("kv", kv)])
    if indices.dtype != torch.int32:
        require_int32("indices", indices)
    if h_q % h_kv:
        raise ValueError(f"kv: expected h_kv dividing q's h_q = {h_q} (GQA), got h_kv = {h_kv}")
    if type(d_v) is not int or d_v <= 0:
        require_positive_int("d_v", d_v)
    if d_v > d_qk:
        raise ValueError(f"d_v: expected at most d_qk = {d_qk}, got {d_v}")
    sm_scale = d_qk**-0.5 if sm_scale is None else resolve_scale("sm_scale", sm_scale, d_qk)
    # get_device() is -1 for every non-GPU device: there all must be CPU tensors, or compare fully (meta).
    device = q.get_device()
    if kv.get_device() != device or indices.get_device() != device or (
            device < 0 and not (q.is_cpu and kv.is_cpu and indices.is_cpu)):
        require_same_device(main)
    # is_contiguous() is a cheap C call; only strided views pay for reading their strides.
    kv_contiguous = kv.is_contiguous()
    if not (q.is_contiguous() and kv_contiguous and indices.is_contiguous()) and (
            q.stride(-1) != 1 or kv.stride(-1) != 1 or indices.stride(-1) != 1):
        for name, x in main:
            require_last_contiguous(name, x)
    if attn_sink is not None:
        if not isinstance(attn_sink, tensor):
            require_tensor("attn_sink", attn_sink)
        if attn_sink.dtype != torch.float32:
            require_float("attn_sink", attn_sink, (torch.float32,))
        if attn_sink.shape != (h_q,):
            raise ValueError(f"attn_sink: expected shape [h_q] = [{h_q}], got {list(attn_sink.shape)}")
        if attn_sink.get_device() != device or (device < 0 and attn_sink.is_cpu != q.is_cpu):
            require_same_device([("q", q), ("attn_sink", attn_sink)])
        if attn_sink.stride(-1) != 1:
            require_last_contiguous("attn_sink", attn_sink)
    if topk_length is not None:
        if not isinstance(topk_length, tensor):
            require_tensor("topk_length", topk_length)
        if topk_length.dtype != torch.int32:
            require_int32("topk_length", topk_length)
        if topk_length.shape != qs[:-2]:
            raise ValueError(
                f"topk_length: expected shape {layout['topk_length']} = {list(qs[:-2])}, "
                f"got {list(topk_length.shape)}"
            )
        if topk_length.get_device() != device or (device < 0 and topk_length.is_cpu != q.is_cpu):
            require_same_device([("q", q), ("topk_length", topk_length)])
        if topk_length.stride(-1) != 1:
            require_last_contiguous("topk_length", topk_length)
    if deterministic is not True and deterministic is not False:
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    args = Args(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink,
                topk_length=topk_length, deterministic=deterministic)
    # A contiguous kv's strides are multiples of d_qk: 16-element multiples when d_qk is.
    aligned = kv.data_ptr() % 16 == 0 and (d_qk % 16 == 0 if kv_contiguous else kv_rows_aligned(kv))
    args.key = (qs, ks, js, dtype, d_v, aligned)
    return args


def reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    deterministic: bool = False,
) -> SparseMLAOutput:
    """The PyTorch semantics of `sparse_mla` (see `validate`), in fp32, chunked over queries
    (`deterministic` changes nothing here).

    fp64 inputs (tests' gradcheck only) are computed and returned in fp64.
    """
    batched = q.dim() == 4
    if not batched:
        q, kv, indices = q[None], kv[None], indices[None]
        topk_length = None if topk_length is None else topk_length[None]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, s_q, h_q, d_qk = q.shape
    s_kv, h_kv = kv.shape[1], kv.shape[2]
    topk = indices.shape[-1]
    group = h_q // h_kv
    valid = (indices >= 0) & (indices < s_kv)
    if topk_length is not None:
        valid = valid & (torch.arange(topk, device=q.device) < topk_length[:, :, None, None])
    # Invalid slots gather row 0, then zeros (below), and are masked out of the softmax.
    idx = torch.where(valid, indices, 0).long()
    kvf = kv.to(ct)
    sink = None if attn_sink is None else attn_sink.to(ct).view(h_kv, group)
    batch_ids = torch.arange(b, device=q.device).view(b, 1, 1, 1)
    group_ids = torch.arange(h_kv, device=q.device).view(1, 1, h_kv, 1)
    chunk = query_chunk(b * h_kv * topk * (2 * d_qk + 3 * group))
    outs, maxes, lses = [], [], []
    for start in range(0, s_q, chunk):
        rows = slice(start, start + chunk)
        qc = q[:, rows].to(ct).unflatten(2, (h_kv, group))  # [b, c, g, r, d_qk]
        # Invalid slots stand in zeros (not row 0), so a NaN in row 0 reaches only queries that select it.
        kc = kvf[batch_ids, idx[:, rows], group_ids]  # [b, c, g, topk, d_qk]
        kc = torch.where(valid[:, rows, :, :, None], kc, 0.0)
        z = torch.einsum("bcgrd,bcgtd->bcgrt", qc, kc) * sm_scale
        p, lse = masked_softmax(z, valid[:, rows, :, None, :])
        o = torch.einsum("bcgrt,bcgtd->bcgrd", p, kc[..., :d_v])
        if sink is not None:
            # Empty rows have o = 0; a finite stand-in for their lse keeps sinks of +-inf NaN-free.
            o = o * torch.sigmoid(torch.where(torch.isfinite(lse), lse, 0.0) - sink)[..., None]
        outs.append(o.flatten(2, 3))
        # max_logits skips NaN logits, as the kernels' max does (IEEE maxNum); out and lse are NaN there.
        z = z.detach()
        z = torch.where(valid[:, rows, :, None, :] & ~torch.isnan(z), z, float("-inf"))
        maxes.append(z.amax(-1).flatten(2, 3))
        lses.append(torch.where(lse == float("-inf"), float("inf"), lse).flatten(2, 3))
    out = torch.cat(outs, 1).to(q.dtype)
    max_logits, lse = torch.cat(maxes, 1), torch.cat(lses, 1)
    if not batched:
        out, max_logits, lse = out[0], max_logits[0], lse[0]
    return SparseMLAOutput(out, max_logits, lse)


def output_specs(args: dict) -> SparseMLAOutput:
    """out `[.., s_q, h_q, d_v]` in q's dtype, max_logits and lse `[.., s_q, h_q]` fp32."""
    q = args["q"]
    rows = tuple(q.shape[:-1])
    stats = TensorSpec(rows, torch.float32)
    return SparseMLAOutput(TensorSpec((*rows, args["d_v"]), q.dtype), stats, stats)


def _query_rows(q: torch.Tensor) -> int:
    """Query rows of one call: s_q, or b * s_q when batched."""
    return q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]


def kv_rows_aligned(kv: torch.Tensor) -> bool:
    """Whether kv starts on 16 bytes and every stride but the last is a multiple of 16 elements, so
    its gathered rows can be copied in 16-byte chunks (what the warp-specialized Hopper kernel needs)."""
    return kv.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in kv.stride()[:-1])


def tuning_key(args: dict) -> tuple:
    """(name, value) pairs that pick a config; `s_q` is the bucketed number of query rows (b * s_q),
    so the batched and unbatched layouts of the same rows share a key."""
    q, kv, indices = args["q"], args["kv"], args["indices"]
    return (
        ("d_qk", q.shape[-1]),
        ("d_v", args["d_v"]),
        ("dtype", DTYPE_NAMES[q.dtype]),
        ("h_kv", kv.shape[-2]),
        ("h_q", q.shape[-2]),
        ("kv_aligned", kv_rows_aligned(kv)),
        ("s_q", bucket_pow2(_query_rows(q))),
        ("topk", indices.shape[-1]),
    )


def flops(args: dict) -> float:
    """The forward count (docs/performance.md): 2 * rows * h_q * topk * (d_qk + d_v) (QK^T and PV over every slot)."""
    q = args["q"]
    return 2.0 * _query_rows(q) * q.shape[-2] * args["indices"].shape[-1] * (q.shape[-1] + args["d_v"])


def bytes_moved(args: dict) -> float:
    """Inputs read once, out/max_logits/lse written once."""
    q = args["q"]
    read = sum(
        t.numel() * t.element_size()
        for t in (q, args["kv"], args["indices"], args["attn_sink"], args["topk_length"])
        if t is not None
    )
    rows = _query_rows(q) * q.shape[-2]
    return float(read + rows * (args["d_v"] * q.element_size() + 2 * 4))


def make_inputs(shape: dict, *, device, dtype, seed: int) -> dict:
    """Random arguments for a preset shape (keys s_q, s_kv, h_q, h_kv, d_qk, d_v, topk; optional b
    for the batched layout, and flags sink / topk_length).

    Query t picks from the keys up to its bottom-right-aligned position, [0, s_kv - s_q + t] (at least
    key 0), with duplicates and -1 fillers.
    """
    gen = torch.Generator().manual_seed(seed)
    lead = (shape["b"],) if "b" in shape else ()
    s_q, s_kv, h_q, h_kv, topk = shape["s_q"], shape["s_kv"], shape["h_q"], shape["h_kv"], shape["topk"]
    q = random_normal((*lead, s_q, h_q, shape["d_qk"]), device=device, dtype=dtype, generator=gen)
    kv = random_normal((*lead, s_kv, h_kv, shape["d_qk"]), device=device, dtype=dtype, generator=gen)
    limits = (torch.arange(s_q) + s_kv - s_q + 1).clamp(1, s_kv)[:, None]
    if torch.device(device).type == "meta":  # shapes only: nothing to draw
        indices = torch.empty((*lead, s_q, h_kv, topk), device="meta", dtype=torch.int32)
    else:
        indices = random_indices(limits, (*lead, s_q, h_kv, topk), generator=gen).to(device)
    args = {"q": q, "kv": kv, "indices": indices, "d_v": shape["d_v"]}
    if shape.get("sink"):
        args["attn_sink"] = random_normal((h_q,), device=device, dtype=torch.float32, generator=gen)
    if shape.get("topk_length"):
        lengths = torch.randint(0, topk + 1, (*lead, s_q), generator=gen, dtype=torch.int32)
        args["topk_length"] = lengths.to(device)
    return args


def layouts(shape: dict) -> list[dict]:
    """The shape in both layouts the contract accepts: unbatched and batched with one batch row (a
    shape with b > 1 has no unbatched spelling)."""
    if shape.get("b", 1) != 1:
        return [dict(shape)]
    flat = {k: v for k, v in shape.items() if k != "b"}
    return [flat, {**flat, "b": 1}]


def reduce_shape(shape: dict) -> dict:
    """Same heads, head dims and topk; at most 512 queries (the keys stay: they are small)."""
    return {**shape, "s_q": min(shape["s_q"], 512)}


_FULL = {"h_kv": 1, "d_qk": 576, "d_v": 512, "topk": 2048}
presets = {
    "tiny": [
        {"s_q": 5, "s_kv": 37, "h_q": 16, "h_kv": 1, "d_qk": 96, "d_v": 64, "topk": 40},
        {"b": 2, "s_q": 17, "s_kv": 13, "h_q": 8, "h_kv": 2, "d_qk": 48, "d_v": 32, "topk": 16,
         "sink": True, "topk_length": True},
    ],
    # The V3.2 prefill shapes first (benchmarks/sparse_mla.py times them), then one step along each
    # other axis of the tuning key: few queries (decode-like), shorter top-k, 16 heads.
    "full": [
        {"s_q": 4096, "s_kv": 8192, "h_q": 128, **_FULL},
        {"s_q": 8192, "s_kv": 8192, "h_q": 128, **_FULL},
        {"s_q": 8192, "s_kv": 16384, "h_q": 128, **_FULL},
        {"s_q": 16384, "s_kv": 16384, "h_q": 128, **_FULL},
        {"s_q": 8192, "s_kv": 8192, "h_q": 64, **_FULL},
        {"s_q": 16384, "s_kv": 16384, "h_q": 64, **_FULL},
        {"s_q": 1, "s_kv": 8192, "h_q": 128, **_FULL},
        {"s_q": 64, "s_kv": 8192, "h_q": 128, **_FULL},
        {"s_q": 512, "s_kv": 8192, "h_q": 128, **_FULL},
        {"s_q": 4096, "s_kv": 8192, "h_q": 128, **{**_FULL, "topk": 512}},
        {"s_q": 4096, "s_kv": 8192, "h_q": 128, **{**_FULL, "topk": 1024}},
        {"s_q": 4096, "s_kv": 8192, "h_q": 16, **_FULL},
    ],
}


def specializations(args: dict) -> list[dict]:
    """The call as given, and with a sink and per-query top-k lengths (each turns a kernel branch on)."""
    q = args["q"]
    rows = q.shape[:-2]  # [s_q] or [b, s_q]
    extra = {"attn_sink": torch.zeros(q.shape[-2], device=q.device, dtype=torch.float32),
             "topk_length": torch.zeros(rows, device=q.device, dtype=torch.int32)}
    return [args, validate(**{**args, **extra})]


OP = Op(
    name="sparse_mla",
    summary="DeepSeek-V3.2 sparse MLA: attention over per-query top-k gathered latent KV (FlashMLA API)",
    validate=validate,
    reference=reference,
    tuning_key=tuning_key,
    flops=flops,
    bytes_moved=bytes_moved,
    make_inputs=make_inputs,
    presets=presets,
    reduce_shape=reduce_shape,
    outputs=("out", "max_logits", "lse"),
    length_dims=("s_q",),
    layouts=layouts,
    grad_inputs=("q", "kv", "attn_sink"),
    output_specs=output_specs,
    specializations=specializations,
)
