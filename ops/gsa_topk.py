"""gsa_topk: each query's top-k keys under the Gated Sparse Attention indexer's scores."""

from __future__ import annotations

import torch

from kreg.ops import gsa_indexer
from kreg.ops.contract import (
    DTYPE_NAMES,
    INT32_MAX,
    Op,
    TensorSpec,
    bucket_pow2,
    require_int32,
    require_last_contiguous,
    require_positive_int,
    require_same_device,
    require_tensor,
)

MAX_K = 1 << 24


def validate(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    sm_scale: float | None = None,
    topk_length: torch.Tensor | None = None,
) -> dict:
    """Top-k key selection under the GSA indexer scores.

    gsa_topk(q_idx, k_idx, w, bias, k, sm_scale=None, topk_length=None) -> indices

    q_idx [b, t, h_i, d_i], k_idx [b, t, d_i], w [b, t, h_i], bias [h_i] and sm_scale are the indexer's
    (see gsa_indexer: scores[b, i, j] over the causal keys j <= i). k is a positive int up to 2**24
    with b * t * k < 2**31;
    topk_length [b, t] int32 (optional) caps each query's count.

    Returns indices [b, t, k] int32: query i's min(k, i + 1, topk_length[b, i]) highest-scoring keys,
    in no particular order, then -1 in the remaining slots (a negative topk_length selects nothing).
    Ties may break either way. Fused kernels never materialize the [b, t, t] scores.

    Raises ValueError/TypeError naming the argument as gsa_indexer does, for a k that is not a
    positive int or gives 2**31 output elements or more, and for a topk_length that is not int32
    [b, t] on q_idx's device.
    """
    args = gsa_indexer.validate(q_idx, k_idx, w, bias, sm_scale)
    if type(k) is not int or k <= 0:
        require_positive_int("k", k)
    b, t = q_idx.shape[:2]
    if k > MAX_K or b * t * k > INT32_MAX:  # the kernels' row and element offsets are int32
        raise ValueError(f"k: expected at most 2**24 and b * t * k <= 2**31 - 1 output elements (b={b}, "
                         f"t={t}), got k={k}")
    args["k"] = k
    args["topk_length"] = topk_length
    if topk_length is not None:
        require_tensor("topk_length", topk_length)
        if topk_length.dtype != torch.int32:
            require_int32("topk_length", topk_length)
        if topk_length.shape != q_idx.shape[:2]:
            raise ValueError(
                f"topk_length: expected shape [b, t] = {list(q_idx.shape[:2])}, got {list(topk_length.shape)}"
            )
        if topk_length.device != q_idx.device:
            require_same_device([("q_idx", q_idx), ("topk_length", topk_length)])
        if topk_length.stride(-1) != 1:
            require_last_contiguous("topk_length", topk_length)
    return args


def reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch semantics of `gsa_topk` (see `validate`), chunked over queries: indices [b, t, k].

    Within a row the selected keys come sorted by descending score.
    """
    b, t = q_idx.shape[:2]
    width = min(k, t)
    slots = torch.arange(width, device=q_idx.device)
    chunks = []
    for start, scores in gsa_indexer.score_chunks(q_idx, k_idx, w, bias, sm_scale):
        rows = torch.arange(start, start + scores.shape[1], device=q_idx.device)
        # Future keys score -inf, so the first i + 1 picks are the causal ones.
        count = torch.clamp(rows + 1, max=k).expand(b, -1)
        if topk_length is not None:
            count = torch.minimum(count, topk_length[:, rows])
        picks = scores.topk(width, dim=-1).indices
        chunks.append(torch.where(slots < count[..., None], picks, -1))
    indices = torch.cat(chunks, dim=1).to(torch.int32)
    if width < k:
        indices = torch.nn.functional.pad(indices, (0, k - width), value=-1)
    return indices


def selection_error(actual: torch.Tensor, expected: torch.Tensor, args: dict) -> float:
    """How far a selection is from the reference's, slot order and ties aside (the op's `Op.error`).

    Infinite when `actual` breaks the contract: another shape or dtype, a row with another count of
    valid slots than the reference's, valid slots not first, an index outside [0, i] other than the -1
    filler, or a key picked twice. Otherwise max |got - want| / max |want| over every row's selected
    scores sorted (the reference indexer's fp32 scores at the picked keys), so keys swapped between
    equal or nearly equal scores cost as little as the scores differ. Rows whose causal scores are not
    all finite (NaN or inf inputs) are held to the contract alone: such scores may change which keys win.
    """
    if actual.shape != expected.shape or actual.dtype != torch.int32:
        return float("inf")
    got, want = actual.detach().cpu().long(), expected.detach().cpu().long()
    b, t, k = got.shape
    valid = got != -1
    count = valid.sum(-1)
    rows = torch.arange(t)[None, :, None]
    if not torch.equal(count, (want != -1).sum(-1)) or not torch.equal(valid, torch.arange(k) < count[..., None]):
        return float("inf")
    if not ((got == -1) | ((got >= 0) & (got <= rows))).all():
        return float("inf")
    ordered = torch.where(valid, got, -1 - torch.arange(k)).sort(-1).values
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        return float("inf")
    names = ("q_idx", "k_idx", "w", "bias", "sm_scale")
    worst, scale = 0.0, 0.0
    for start, scores in gsa_indexer.score_chunks(*(args[n] for n in names)):
        scores = scores.cpu()
        rows_c = slice(start, start + scores.shape[1])
        causal = torch.arange(t)[None, :] <= torch.arange(start, start + scores.shape[1])[:, None]
        comparable = (torch.isfinite(scores) | ~causal).all(-1, keepdim=True)
        picked = [torch.where(x[:, rows_c] >= 0, scores.gather(-1, x[:, rows_c].clamp(min=0)), float("-inf"))
                  .sort(-1, descending=True).values for x in (got, want)]
        finite = torch.isfinite(picked[1]) & comparable
        if finite.any():
            worst = max(worst, (picked[0][finite] - picked[1][finite]).abs().max().item())
            scale = max(scale, picked[1][finite].abs().max().item())
    return worst / scale if scale > 0 else worst


def tuning_key(args: dict) -> tuple:
    """(name, value) pairs that pick a config; the sequence length is bucketed."""
    q = args["q_idx"]
    return (
        ("d_i", q.shape[3]),
        ("dtype", DTYPE_NAMES[q.dtype]),
        ("h_i", q.shape[2]),
        ("k", args["k"]),
        ("t", bucket_pow2(q.shape[1])),
    )


def flops(args: dict) -> float:
    """The indexer's scoring FLOPs (selection itself is comparisons, not counted)."""
    return gsa_indexer.flops(args)


def bytes_moved(args: dict) -> float:
    """Indexer inputs read once and the int32 [b, t, k] indices written once (no [b, t, t] scores)."""
    b, t = args["q_idx"].shape[:2]
    names = ("q_idx", "k_idx", "w", "bias", "topk_length")
    read = sum(args[n].numel() * args[n].element_size() for n in names if args[n] is not None)
    return float(read + b * t * args["k"] * 4)


def make_inputs(shape: dict, *, device, dtype, seed: int) -> dict:
    """Random arguments for a preset shape (the indexer's keys plus k, and flag topk_length)."""
    args = gsa_indexer.make_inputs(shape, device=device, dtype=dtype, seed=seed)
    args["k"] = shape["k"]
    if shape.get("topk_length"):
        gen = torch.Generator().manual_seed(seed + 1)
        lengths = torch.randint(0, shape["k"] + 2, (shape["b"], shape["t"]), generator=gen, dtype=torch.int32)
        args["topk_length"] = lengths.to(device)
    return args


def reduce_shape(shape: dict) -> dict:
    """Same heads, head dim and k; at most max(2048, 2k) positions, so that the later queries select
    among more keys than k (with t <= k every query takes all of its keys)."""
    return {**shape, "t": min(shape["t"], max(2048, 2 * shape["k"]))}


presets = {
    "tiny": [
        {"b": 2, "t": 37, "h_i": 4, "d_i": 16, "k": 8},
        {"b": 1, "t": 17, "h_i": 2, "d_i": 8, "k": 40, "topk_length": True},
    ],
    "full": [{**shape, "k": 2048} for shape in gsa_indexer.presets["full"]],
}


def output_specs(args: dict) -> TensorSpec:
    """indices int32 `[b, t, k]`."""
    b, t = args["q_idx"].shape[:2]
    return TensorSpec((b, t, args["k"]), torch.int32)



def specializations(args: dict) -> list[dict]:
    """The call as given, and with per-query top-k lengths (a kernel branch of their own)."""
    q = args["q_idx"]
    lengths = torch.zeros(q.shape[:2], device=q.device, dtype=torch.int32)
    return [args, validate(**{**args, "topk_length": lengths})]


OP = Op(
    name="gsa_topk",
    summary="Gated Sparse Attention top-k: each query's k best causal keys under the indexer scores",
    validate=validate,
    reference=reference,
    tuning_key=tuning_key,
    flops=flops,
    bytes_moved=bytes_moved,
    make_inputs=make_inputs,
    presets=presets,
    reduce_shape=reduce_shape,
    outputs=("indices",),
    length_dims=("t",),
    output_specs=output_specs,
    specializations=specializations,
    error=selection_error,
)
