"""nsa: Native Sparse Attention, three gated branches (compressed blocks, selected blocks, window)."""

from __future__ import annotations

import torch

from kreg.ops.contract import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    INT32_MAX,
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
    spec_like,
)
from kreg.ops.testing import TOLERANCE, relative_error


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cmp: torch.Tensor,
    g_slc: torch.Tensor,
    g_swa: torch.Tensor,
    block_size: int = 64,
    block_count: int = 16,
    window: int = 512,
    sm_scale: float | None = None,
    block_indices: torch.Tensor | None = None,
) -> dict:
    """Native Sparse Attention forward: out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa.

    nsa(q, k, v, g_cmp, g_slc, g_swa, block_size=64, block_count=16, window=512, sm_scale=None,
        block_indices=None) -> out

    Layouts:
        q                    [b, t, h_q, d]   bf16/fp16 (fp32: reference only)
        k, v                 [b, t, h_kv, d]  same dtype as q; h_kv divides h_q (GQA: head h reads
                                              kv group g = h // (h_q // h_kv))
        g_cmp, g_slc, g_swa  [b, t, h_q]      float gates, already in [0, 1]
        block_indices        [b, t, h_kv, block_count] int32, optional: skips the selection
    block_size, block_count and window are positive int32 values (a block_count past the sequence's
    ceil(t / block_size) blocks selects them all). Every tensor's last dimension must be contiguous.
    Logits are sm_scale * q . k with sm_scale defaulting to d ** -0.5, in every branch.

    Compressed branch: keys and values mean-pooled over the non-overlapping blocks of block_size
    tokens; block c is visible to query i iff (c + 1) * block_size - 1 <= i (a partial last block
    never is). o_cmp is softmax attention over the visible blocks, 0 when none is.

    Selected branch: query i's candidates are the blocks 0 .. i // block_size. Their importance is
    the compressed branch's softmax probability summed over the query heads of kv group g, with the
    query's own block forced to the top (it counts toward block_count). The top block_count candidates
    (-1 where fewer exist; ties, and near ties within half precision's rounding, may break either way:
    `output_error` leaves such rows out) are attended token by token, causally
    (j <= i), by every head of the group. Passed block_indices replace the selection: ids outside the
    candidates (negative, or past i // block_size) are invalid and masked, duplicates count with
    multiplicity, and a query with no valid id gets o_slc = 0.

    Window branch: softmax attention over the keys [max(0, i - window + 1), i].

    Returns out [b, t, h_q, d] like q. Differentiable in q, k, v and the three gates; the selection
    (block ids) is not, so no gradient flows through which blocks were chosen.

    Raises ValueError/TypeError naming the argument for wrong shapes, dtypes (block_indices int32) or
    devices, a non-contiguous last dimension, h_q not divisible by h_kv, a block_size, block_count or
    window that is not a positive int32 value, or an empty tensor.
    """
    # Each tensor attribute read costs ~0.1-0.4 us: fast compares first, the helpers only word errors.
    named = (("q", q), ("k", k), ("v", v), ("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa))
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)
            and isinstance(g_cmp, tensor) and isinstance(g_slc, tensor) and isinstance(g_swa, tensor)):
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
    if 0 in qs or 0 in ks:
        for name, x in named[:2]:
            require_nonempty(name, x)
    for name, gate in named[3:]:
        if gate.shape != qs[:3]:
            raise ValueError(f"{name}: expected shape [b, t, h_q] = {list(qs[:3])}, got {list(gate.shape)}")
    dtype = q.dtype
    if dtype not in FLOAT_DTYPES:
        require_float("q", q)
    if k.dtype != dtype or v.dtype != dtype:
        require_same_dtype(named[:3])
    if g_cmp.dtype not in FLOAT_DTYPES or g_slc.dtype not in FLOAT_DTYPES or g_swa.dtype not in FLOAT_DTYPES:
        for name, gate in named[3:]:
            require_float(name, gate)
    h_kv = ks[2]
    if h_q % h_kv:
        raise ValueError(f"k: expected h_kv dividing q's h_q = {h_q} (GQA), got h_kv = {h_kv}")
    for name, value in (("block_size", block_size), ("block_count", block_count), ("window", window)):
        if type(value) is not int or value <= 0:
            require_positive_int(name, value)
        if value > INT32_MAX:  # kernels take them as int32
            raise ValueError(f"{name}: expected a positive int up to 2**31 - 1 (int32), got {value}")
    device = q.device
    if (k.device != device or v.device != device or g_cmp.device != device or g_slc.device != device
            or g_swa.device != device):
        require_same_device(named)
    for name, x in named:
        if x.stride(-1) != 1:
            require_last_contiguous(name, x)
    if block_indices is not None:
        if not isinstance(block_indices, tensor):
            require_tensor("block_indices", block_indices)
        if block_indices.dtype != torch.int32:
            require_int32("block_indices", block_indices)
        if block_indices.shape != (b, t, h_kv, block_count):
            raise ValueError(
                f"block_indices: expected shape [b, t, h_kv, block_count] = {[b, t, h_kv, block_count]}, "
                f"got {list(block_indices.shape)}"
            )
        if block_indices.device != device:
            require_same_device([("q", q), ("block_indices", block_indices)])
        if block_indices.stride(-1) != 1:
            require_last_contiguous("block_indices", block_indices)
    else:
        # No query has more candidate blocks than the sequence has blocks: more selects nothing more
        # (and would size the selection's buffers).
        block_count = min(block_count, -(-t // block_size))
    sm_scale = d**-0.5 if sm_scale is None else resolve_scale("sm_scale", sm_scale, d)
    return {
        "q": q,
        "k": k,
        "v": v,
        "g_cmp": g_cmp,
        "g_slc": g_slc,
        "g_swa": g_swa,
        "block_size": block_size,
        "block_count": block_count,
        "window": window,
        "sm_scale": sm_scale,
        "block_indices": block_indices,
    }


def _compressed(k: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean of each complete block of block_size tokens: [b, t, h, d] -> [b, t // block_size, h, d]."""
    b, t, h, d = k.shape
    n = t // block_size
    return k[:, : n * block_size].reshape(b, n, block_size, h, d).mean(2)


def _chunks(q, h_kv, ct):
    """Yield (rows, q chunk [b, c, g, r, d] in ct), sized so a chunk's dense logits fit the budget."""
    b, t, h_q, _ = q.shape
    chunk = query_chunk(4 * b * h_q * t)
    for start in range(0, t, chunk):
        rows = torch.arange(start, min(start + chunk, t), device=q.device)
        yield rows, q[:, start : start + chunk].to(ct).unflatten(2, (h_kv, h_q // h_kv))


def _compressed_probs(qc, k_cmp, rows, block_size, sm_scale):
    """Softmax over the visible compressed blocks for a query chunk: [b, c, g, r, t // block_size]."""
    blocks = torch.arange(k_cmp.shape[1], device=qc.device)
    visible = (blocks + 1) * block_size - 1 <= rows[:, None]  # [c, n_cmp]
    z = torch.einsum("bcgrd,bngd->bcgrn", qc, k_cmp) * sm_scale
    return masked_softmax(z, visible[None, :, None, None, :])[0]


def _importance(p_cmp, rows, block_size, n_blocks):
    """Each candidate block's importance for a query chunk: p_cmp [b, c, g, r, n_cmp] -> [b, c, g,
    n_blocks], the compressed probabilities summed over the group's heads, +inf at the own block and
    -inf past it."""
    importance = p_cmp.sum(3)
    # The partial last block is a candidate for its own queries but has no compressed probability.
    importance = torch.nn.functional.pad(importance, (0, n_blocks - importance.shape[-1]))
    own = (rows // block_size)[:, None, None]  # [c, 1, 1] against [b, c, g, n_blocks]
    blocks = torch.arange(n_blocks, device=p_cmp.device)
    importance = torch.where(blocks == own, float("inf"), importance)
    return torch.where(blocks > own, float("-inf"), importance)


def _select(p_cmp, rows, block_size, block_count, n_blocks):
    """Top block_count candidate blocks of a query chunk from its compressed probabilities.

    p_cmp [b, c, g, r, n_cmp] -> int32 [b, c, g, block_count]: the own block first, then the others by
    summed probability (descending), -1 where fewer candidates exist.
    """
    importance = _importance(p_cmp, rows, block_size, n_blocks)
    own = (rows // block_size)[:, None, None]
    width = min(block_count, n_blocks)
    picks = importance.topk(width, dim=-1).indices
    count = torch.clamp(own + 1, max=block_count)  # how many candidates exist
    picks = torch.where(torch.arange(width, device=p_cmp.device) < count, picks, -1)
    return torch.nn.functional.pad(picks, (0, block_count - width), value=-1).to(torch.int32)


def select_blocks(q: torch.Tensor, k: torch.Tensor, block_size: int, block_count: int, sm_scale: float) -> torch.Tensor:
    """The selection `nsa` makes when no block_indices are passed: int32 [b, t, h_kv, block_count].

    Per query and kv group: the own block, then the remaining candidates by compressed softmax
    probability summed over the group's query heads (descending), then -1.
    """
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    t, h_kv = q.shape[1], k.shape[2]
    k_cmp = _compressed(k.to(ct), block_size)
    chunks = []
    for rows, qc in _chunks(q, h_kv, ct):
        p_cmp = _compressed_probs(qc, k_cmp, rows, block_size, sm_scale)
        chunks.append(_select(p_cmp, rows, block_size, block_count, -(-t // block_size)))
    return torch.cat(chunks, 1)


def ambiguous_selections(q: torch.Tensor, k: torch.Tensor, block_size: int, block_count: int, sm_scale: float,
                          gap: float) -> torch.Tensor:
    """Where the selection may go either way: bool [b, t, h_kv], True where the last selected block's
    importance exceeds the best unselected one's by at most `gap` times its value (a tie within the
    rounding of half-precision inputs, which any implementation may break either way), and where some
    candidate's importance is NaN."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    t, h_kv = q.shape[1], k.shape[2]
    n_blocks = -(-t // block_size)
    if block_count < 2 or n_blocks <= block_count:
        return torch.zeros((q.shape[0], t, h_kv), dtype=torch.bool, device=q.device)
    k_cmp = _compressed(k.to(ct), block_size)
    chunks = []
    for rows, qc in _chunks(q, h_kv, ct):
        importance = _importance(_compressed_probs(qc, k_cmp, rows, block_size, sm_scale), rows, block_size,
                                 n_blocks)
        top = importance.topk(block_count + 1, dim=-1).values
        last, first_out = top[..., -2], top[..., -1]
        # A NaN importance (NaN or inf inputs) orders nothing: any selection is as right as another.
        chunks.append(torch.isnan(importance).any(-1)
                      | (torch.isfinite(last) & torch.isfinite(first_out) & (last - first_out <= gap * last)))
    return torch.cat(chunks, 1)


def output_error(actual: torch.Tensor, expected: torch.Tensor, args: dict) -> float:
    """How far `out` is from the reference's (the op's `Op.error`): the relative error over every
    (query, head) whose kv group's selection is unambiguous (`ambiguous_selections` with a gap of the
    input dtype's relative-error budget); with block_indices given, over every row. A near tie between
    the last selected block and the next swaps a whole block of that row's selected branch, an error
    no budget on the other rows should absorb."""
    if actual.shape != expected.shape:
        return float("inf")
    if args["block_indices"] is not None:
        return relative_error(actual, expected)
    q, k = args["q"], args["k"]
    gap = TOLERANCE.get(q.dtype, TOLERANCE[torch.float32])
    unclear = ambiguous_selections(q, k, args["block_size"], args["block_count"], args["sm_scale"], gap)
    keep = ~unclear.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return relative_error(actual[keep], expected[keep])


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cmp: torch.Tensor,
    g_slc: torch.Tensor,
    g_swa: torch.Tensor,
    block_size: int,
    block_count: int,
    window: int,
    sm_scale: float,
    block_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch semantics of `nsa` (see `validate`), in fp32, chunked over queries.

    The selected and window branches are dense attention over all t keys under their own masks; the
    selected branch turns the chosen blocks into per-token multiplicities (duplicates add up) and
    weighs exp(z) by them.
    """
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, t, h_q, _ = q.shape
    h_kv = k.shape[2]
    n_blocks = -(-t // block_size)
    kf, vf = k.to(ct), v.to(ct)
    k_cmp, v_cmp = _compressed(kf, block_size), _compressed(vf, block_size)
    token_block = torch.arange(t, device=q.device) // block_size
    cols = torch.arange(t, device=q.device)
    outs = []
    for rows, qc in _chunks(q, h_kv, ct):
        p_cmp = _compressed_probs(qc, k_cmp, rows, block_size, sm_scale)
        o_cmp = torch.einsum("bcgrn,bngd->bcgrd", p_cmp, v_cmp)
        if block_indices is None:
            blocks = _select(p_cmp, rows, block_size, block_count, n_blocks)
        else:
            blocks = block_indices[:, rows]
        chosen = (blocks >= 0) & (blocks <= (rows // block_size)[None, :, None, None])
        # How often each block was chosen; invalid ids add weight 0 to block 0.
        counts = torch.zeros(b, len(rows), h_kv, n_blocks, dtype=ct, device=q.device)
        counts = counts.scatter_add(-1, torch.where(chosen, blocks, 0).long(), chosen.to(ct))
        causal = cols <= rows[:, None]  # [c, t]
        mult = (counts[..., token_block] * causal[None, :, None, :])[:, :, :, None, :]  # [b, c, g, 1, t]
        z = torch.einsum("bcgrd,btgd->bcgrt", qc, kf) * sm_scale
        p_slc = masked_softmax(z + torch.log(torch.where(mult > 0, mult, 1.0)), mult > 0)[0]
        in_window = causal & (cols > rows[:, None] - window)
        p_swa = masked_softmax(z, in_window[None, :, None, None, :])[0]
        o_slc = torch.einsum("bcgrt,btgd->bcgrd", p_slc, vf)
        o_swa = torch.einsum("bcgrt,btgd->bcgrd", p_swa, vf)
        g = [x[:, rows].to(ct).unflatten(2, (h_kv, h_q // h_kv))[..., None] for x in (g_cmp, g_slc, g_swa)]
        outs.append((g[0] * o_cmp + g[1] * o_slc + g[2] * o_swa).flatten(2, 3))
    return torch.cat(outs, 1).to(q.dtype)


def _pairs(t: int, block_size: int, block_count: int, window: int) -> int:
    """Query-key pairs of one (batch, head) summed over the three branches, from the shape alone."""
    # Compressed: query i sees (i + 1) // block_size blocks.
    n, r = divmod(t, block_size)
    cmp = block_size * n * (n - 1) // 2 + n * (r + 1)
    # Selected: all i + 1 causal tokens while i < block_count * block_size, then the partial own block
    # plus block_count - 1 full blocks.
    span = block_count * block_size
    head = min(t, span)
    slc = head * (head + 1) // 2
    if t > span:
        m = t - span
        full, rest = divmod(m, block_size)
        slc += m * ((block_count - 1) * block_size + 1)
        slc += full * block_size * (block_size - 1) // 2 + rest * (rest - 1) // 2
    # Window: min(i + 1, window) keys.
    w = min(window, t)
    swa = w * (w + 1) // 2 + (t - w) * w
    return cmp + slc + swa


def tuning_key(args: dict) -> tuple:
    """(name, value) pairs that pick a config; the sequence length is bucketed."""
    q = args["q"]
    return (
        ("block_count", args["block_count"]),
        ("block_indices", args["block_indices"] is not None),
        ("block_size", args["block_size"]),
        ("d", q.shape[3]),
        ("dtype", DTYPE_NAMES[q.dtype]),
        ("h_kv", args["k"].shape[2]),
        ("h_q", q.shape[2]),
        ("t", bucket_pow2(q.shape[1])),
        ("window", args["window"]),
    )


def flops(args: dict) -> float:
    """Attention forward 4 * b * h_q * pairs * d, pairs summed over the three branches."""
    b, t, h_q, d = args["q"].shape
    return 4.0 * b * h_q * _pairs(t, args["block_size"], args["block_count"], args["window"]) * d


def bytes_moved(args: dict) -> float:
    """Inputs read once, out written once."""
    names = ("q", "k", "v", "g_cmp", "g_slc", "g_swa", "block_indices")
    read = sum(args[n].numel() * args[n].element_size() for n in names if args[n] is not None)
    return float(read + args["q"].numel() * args["q"].element_size())


def make_inputs(shape: dict, *, device, dtype, seed: int) -> dict:
    """Random arguments for a preset shape (keys b, t, h_q, h_kv, d, block_size, block_count, window;
    flag block_indices: random candidate blocks with duplicates and -1 fillers)."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h_q, h_kv, d = (shape[n] for n in ("b", "t", "h_q", "h_kv", "d"))
    args = {
        "q": random_normal((b, t, h_q, d), device=device, dtype=dtype, generator=gen),
        "k": random_normal((b, t, h_kv, d), device=device, dtype=dtype, generator=gen),
        "v": random_normal((b, t, h_kv, d), device=device, dtype=dtype, generator=gen),
        "block_size": shape["block_size"],
        "block_count": shape["block_count"],
        "window": shape["window"],
    }
    for name in ("g_cmp", "g_slc", "g_swa"):
        logits = random_normal((b, t, h_q), device="cpu", dtype=torch.float32, generator=gen)
        args[name] = torch.sigmoid(logits).to(device=device, dtype=dtype)
    if shape.get("block_indices"):
        candidates = (torch.arange(t) // shape["block_size"] + 1)[:, None]
        blocks = random_indices(candidates, (b, t, h_kv, shape["block_count"]), generator=gen)
        args["block_indices"] = blocks.to(device)
    return args


def reduce_shape(shape: dict) -> dict:
    """Same heads, head dim, block size, block count and window; at most 2048 positions."""
    return {**shape, "t": min(shape["t"], 2048)}


presets = {
    "tiny": [
        # The selected branch runs one program per (token, kv head): few tokens keep the interpreter fast.
        {"b": 2, "t": 13, "h_q": 8, "h_kv": 2, "d": 16, "block_size": 4, "block_count": 3, "window": 6},
        {"b": 1, "t": 20, "h_q": 4, "h_kv": 1, "d": 32, "block_size": 4, "block_count": 4, "window": 6,
         "block_indices": True},
    ],
    # The long-context target (t 65536), and t 8192 where it must not be slower than dense attention.
    "full": [
        {"b": 1, "t": 65536, "h_q": 64, "h_kv": 4, "d": 128,
         "block_size": 64, "block_count": 16, "window": 512},
        {"b": 1, "t": 8192, "h_q": 64, "h_kv": 4, "d": 128,
         "block_size": 64, "block_count": 16, "window": 512},
    ],
}


def output_specs(args: dict) -> TensorSpec:
    """out like q."""
    return spec_like(args["q"])


OP = Op(
    name="nsa",
    summary="Native Sparse Attention: gated compressed-block, selected-block and sliding-window attention",
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
    output_specs=output_specs,
    error=output_error,
    grad_inputs=("q", "k", "v", "g_cmp", "g_slc", "g_swa"),
)
