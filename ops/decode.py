"""decode: attention of a few new tokens per sequence against a contiguous or paged KV cache."""

from __future__ import annotations

import torch

from kreg.ops.contract import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    Args,
    Op,
    TensorSpec,
    bucket_pow2,
    random_normal,
    require_float,
    require_int32,
    require_last_contiguous,
    require_positive_int,
    require_same_device,
    require_same_dtype,
    require_tensor,
    require_window,
    resolve_scale,
    spec_like,
)
from kreg.ops.dense_attention import (
    MAX_HEAD_DIM,
    allowed_pairs,
    check_sinks,
    dense_attention,
)


def validate(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
) -> dict:
    """decode(q, k_cache, v_cache, cache_seqlens, block_table=None, sinks=None, window=None,
    sm_scale=None, num_splits=None, return_lse=False) -> out | (out, lse)

    Split-KV flash decoding: the new tokens of each sequence attend to its KV cache.

    - `q [b, h_q, d]` (one new token per sequence) or `[b, s_q, h_q, d]` (a few speculative tokens).
    - `cache_seqlens [b]` int32: the cache length of each sequence, counting the new tokens. The
      queries are aligned bottom-right and causal: with `L = cache_seqlens[i]`, query t sits at
      `p_t = L - s_q + t` and sees key j iff `j <= p_t` (and `p_t - j <= window - 1` with a window,
      W keys including itself). Values are clamped to [0, cache capacity]; a sequence with length 0
      (or a query with `p_t < 0`) returns out 0 and lse +inf, whatever the sink.
    - Contiguous cache: `k_cache, v_cache [b, n_max, h_kv, d]`.
    - Paged cache: `k_cache, v_cache [num_blocks, block_size, h_kv, d]` with `block_table
      [b, max_blocks]` int32; position p of sequence i lives in block `block_table[i, p // block_size]`
      at offset `p % block_size`. `block_size` is any power of two >= 16. Entries past a sequence's
      `ceil(L / block_size)` blocks may hold anything (-1, huge values) and are never read; an entry
      inside them outside `[0, num_blocks)` is invalid and its keys are masked.
    - `sinks [h_q]` fp32, contiguous (optional): `out = out_nosink * sigmoid(lse - sinks[h])`, never in lse.
    - `sm_scale` defaults to `d ** -0.5`; d in 1..256; `h_q % h_kv == 0` (query head h reads kv head
      `h // (h_q // h_kv)`); q and the caches share one dtype (fp16, bf16, fp32) and device; any
      strides with a contiguous last dimension.
    - `num_splits`: None (picked from the device and shapes only, never from cache_seqlens values) or a
      positive int (fixed, for CUDA graphs). It changes no result beyond rounding.

    Returns `out` like q (q's dtype), or `(out, lse)` when `return_lse`: lse fp32 `[b, h_q]` (or
    `[b, h_q, s_q]` for 4-D q) over the keys only. Not differentiable.

    Raises ValueError/TypeError naming the argument for wrong ranks, shapes, dtypes or devices, a
    block_size that is not a power of two >= 16, h_q not divisible by h_kv, an empty batch, a bad
    window or num_splits.
    """
    # This runs on every call: each tensor attribute read costs ~0.06-0.15 us, so every one is read
    # once, compared plainly (get_device ints, is_contiguous) and the require_* helpers only word an
    # error after a compare failed.
    try:
        qs, cs, dtype, device = q.shape, k_cache.shape, q.dtype, q.get_device()
        vs, ls = v_cache.shape, cache_seqlens.shape
        same_device = (k_cache.get_device() == device and v_cache.get_device() == device
                       and cache_seqlens.get_device() == device)
        contiguous = (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
                      and cache_seqlens.is_contiguous())
        paged = block_table is not None
        if paged:
            ts = block_table.shape
            same_device = same_device and block_table.get_device() == device
            contiguous = contiguous and block_table.is_contiguous()
    except AttributeError:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
                        ("block_table", block_table)):
            if t is not None or name != "block_table":
                require_tensor(name, t)
        raise
    if len(qs) != 3 and len(qs) != 4:
        raise ValueError(f"q: expected shape [b, h_q, d] or [b, s_q, h_q, d], got {list(qs)}")
    if len(cs) != 4:
        layout = "[num_blocks, block_size, h_kv, d]" if paged else "[b, n_max, h_kv, d]"
        raise ValueError(f"k_cache: expected shape {layout}, got {list(cs)}")
    if vs != cs:
        raise ValueError(f"v_cache: expected the shape of k_cache {list(cs)}, got {list(vs)}")
    b, h_q, d, h_kv = qs[0], qs[-2], qs[-1], cs[2]
    if dtype not in FLOAT_DTYPES:
        require_float("q", q)
    if k_cache.dtype != dtype or v_cache.dtype != dtype:
        require_same_dtype([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)])
    # get_device() is -1 for every non-GPU device: there all must be CPU tensors, or compare fully (meta).
    if not same_device or (device < 0 and not (
            q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and cache_seqlens.is_cpu
            and (not paged or block_table.is_cpu))):
        _check_devices(q, k_cache, v_cache, cache_seqlens, block_table)
    if not contiguous:
        _check_strides(q, k_cache, v_cache, cache_seqlens, block_table)
    if cs[3] != d:
        raise ValueError(f"k_cache: expected head dim d = {d} like q, got shape {list(cs)}")
    if not 0 < d <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected head dim d in 1..{MAX_HEAD_DIM}, got shape {list(qs)}")
    if 0 in qs:
        raise ValueError(f"q: expected a non-empty batch, got shape {list(qs)}")
    if 0 in cs:
        raise ValueError(f"k_cache: expected a non-empty cache, got shape {list(cs)}")
    if h_q % h_kv:
        raise ValueError(f"k_cache: expected h_kv dividing h_q = {h_q} (GQA), got h_kv = {h_kv}")
    if cache_seqlens.dtype != torch.int32:
        require_int32("cache_seqlens", cache_seqlens)
    if len(ls) != 1 or ls[0] != b:
        raise ValueError(f"cache_seqlens: expected shape [b={b}], got {list(ls)}")
    if paged:
        if block_table.dtype != torch.int32:
            require_int32("block_table", block_table)
        if len(ts) != 2 or ts[0] != b or ts[1] == 0:
            raise ValueError(f"block_table: expected shape [b={b}, max_blocks >= 1], got {list(ts)}")
        block_size = cs[1]
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(
                f"block_size: expected a power of two >= 16 (k_cache dim 1), got {block_size} "
                f"in k_cache shape {list(cs)}"
            )
    elif cs[0] != b:
        raise ValueError(f"k_cache: expected shape [b={b}, n_max, h_kv, d], got {list(cs)}")
    if sinks is not None:
        try:
            ss = sinks.shape
            fine = (sinks.dtype == torch.float32 and len(ss) == 1 and ss[0] == h_q and sinks.get_device() == device
                    and (device >= 0 or sinks.is_cpu == q.is_cpu) and sinks.is_contiguous())
        except AttributeError:
            fine = False
        if not fine:
            check_sinks(sinks, h_q, q)
    if window is not None:
        require_window(window, True)
    if num_splits is not None:
        require_positive_int("num_splits", num_splits)
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    args = Args(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                sinks=sinks, window=window,
                sm_scale=d**-0.5 if sm_scale is None else resolve_scale("sm_scale", sm_scale, d),
                num_splits=num_splits, return_lse=return_lse)
    # Everything tuning_key reads, as validation read it: the hot path's cache key. The cache's length
    # enters as the bit length of n - 1, which decides its power-of-two bucket (bucket_pow2), so a cache
    # one key longer every step (a generation loop's) stays on one key instead of resolving a new one.
    args.key = (qs, cs[1] if paged else None, cs[2], ((ts[1] * cs[1] if paged else cs[1]) - 1).bit_length(), dtype,
                sinks is None, window)
    return args


def _named_tensors(q, k_cache, v_cache, cache_seqlens, block_table) -> list[tuple[str, torch.Tensor]]:
    pairs = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)]
    return pairs + ([("block_table", block_table)] if block_table is not None else [])


def _check_devices(*tensors: torch.Tensor | None) -> None:
    pairs = _named_tensors(*tensors)
    for pair in pairs[1:]:
        require_same_device([pairs[0], pair])


def _check_strides(*tensors: torch.Tensor | None) -> None:
    for name, t in _named_tensors(*tensors):
        require_last_contiguous(name, t)


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
):
    """The semantics in PyTorch, one sequence at a time (fp32 math); `num_splits` is ignored.

    Reads cache_seqlens on the host (a reference may); gathers only the blocks a sequence uses.
    """
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    h_kv, d = k_cache.shape[2], k_cache.shape[3]
    if block_table is None:
        capacity = k_cache.shape[1]
    else:
        num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
        capacity = block_table.shape[1] * block_size
    outs, lses = [], []
    for i, length in enumerate(cache_seqlens.tolist()):
        n = min(max(length, 0), capacity)
        key_valid = None
        if block_table is None:
            keys, values = k_cache[i, :n], v_cache[i, :n]
        else:
            used = -(-n // block_size)
            ids = block_table[i, :used].long()  # never the entries past the sequence's blocks
            valid = (ids >= 0) & (ids < num_blocks)
            ids = torch.where(valid, ids, 0)
            keys = k_cache[ids].reshape(used * block_size, h_kv, d)[:n]
            values = v_cache[ids].reshape(used * block_size, h_kv, d)[:n]
            key_valid = valid.repeat_interleave(block_size)[None, :n]
        out, lse = dense_attention(
            q4[i : i + 1], keys[None], values[None],
            sm_scale=sm_scale, causal=True, window=window, sinks=sinks, key_valid=key_valid,
        )
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    if q.dim() == 3:
        out, lse = out.squeeze(1), lse.squeeze(-1)
    return (out, lse) if return_lse else out


def _cache_len(args: dict) -> int:
    """Keys a sequence can hold: n_max (contiguous) or max_blocks * block_size (paged)."""
    k_cache, table = args["k_cache"], args["block_table"]
    return k_cache.shape[1] if table is None else table.shape[1] * k_cache.shape[1]


def tuning_key(args: dict) -> tuple:
    """(b bucket, block_size, d, dtype, h_kv, h_q, n bucket, paged, s_q, sinks, window). The batch
    decides how many split programs fill the GPU, so it is a (bucketed) length dim too; a 3-D q and a
    4-D q with one token share a key."""
    q, k_cache = args["q"], args["k_cache"]
    paged = args["block_table"] is not None
    return (
        ("b", bucket_pow2(q.shape[0], lo=1)),
        ("block_size", k_cache.shape[1] if paged else None),
        ("d", q.shape[-1]),
        ("dtype", DTYPE_NAMES[q.dtype]),
        ("h_kv", k_cache.shape[2]),
        ("h_q", q.shape[-2]),
        ("n", bucket_pow2(_cache_len(args))),
        ("paged", paged),
        ("s_q", 1 if q.dim() == 3 else q.shape[1]),
        ("sinks", args["sinks"] is not None),
        ("window", args["window"]),
    )


def output_specs(args: dict):
    """`out` like q, and with return_lse an fp32 lse `[b, h_q]` (`[b, h_q, s_q]` for a 4-D q)."""
    q = args["q"]
    out = spec_like(q)
    if not args["return_lse"]:
        return out
    s = q.shape
    return out, TensorSpec((s[0], s[1]) if q.dim() == 3 else (s[0], s[2], s[1]), torch.float32)


def _keys_read(args: dict) -> int:
    n = _cache_len(args)
    s_q = 1 if args["q"].dim() == 3 else args["q"].shape[1]
    window = args["window"]
    return n if window is None else min(n, window + s_q - 1)


def flops(args: dict) -> float:
    """`4 * b * h_q * pairs * d` with every sequence at the cache capacity (n_max or
    max_blocks * block_size): an upper bound, since cache_seqlens are not read."""
    q = args["q"]
    s_q = 1 if q.dim() == 3 else q.shape[1]
    pairs = allowed_pairs(s_q, _cache_len(args), True, args["window"])
    return 4.0 * q.shape[0] * q.shape[-2] * pairs * q.shape[-1]


def bytes_moved(args: dict) -> float:
    """K and V bytes read: `2 * b * h_kv * d * keys * elem`, keys = the cache capacity (or the window
    plus s_q - 1 when smaller) for every sequence: an upper bound, since cache_seqlens are not read."""
    k_cache = args["k_cache"]
    b = args["q"].shape[0]
    return float(2 * b * k_cache.shape[2] * k_cache.shape[3] * _keys_read(args) * k_cache.element_size())


def make_inputs(shape: dict, *, device, dtype, seed: int) -> dict:
    """Random arguments for a preset shape.

    Keys: b, s_q (1 gives 3-D q unless q4d), h_q, h_kv, d, n (cache length), block_size (None: contiguous),
    sinks (bool), window, ragged (optional: lengths random in [s_q, n] with the first at n; otherwise
    every sequence at n). Paged caches get a shuffled block table over a pool with spare blocks, and
    -1 in the entries past each sequence's blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    b, s_q, h_q, h_kv, d, n = (shape[k] for k in ("b", "s_q", "h_q", "h_kv", "d", "n"))
    block_size = shape.get("block_size")
    if shape.get("ragged", False):
        lens = torch.randint(min(s_q, n), n + 1, (b,), generator=gen)
        lens[0] = n
    else:
        lens = torch.full((b,), n)
    q_shape = (b, h_q, d) if s_q == 1 and not shape.get("q4d") else (b, s_q, h_q, d)
    q = random_normal(q_shape, device=device, dtype=dtype, generator=gen)
    args = dict(q=q, cache_seqlens=lens.to(device=device, dtype=torch.int32), window=shape.get("window"))
    if block_size is None:
        cache_shape = (b, n, h_kv, d)
    else:
        max_blocks = -(-n // block_size)
        num_blocks = b * max_blocks + 3
        table = torch.randperm(num_blocks, generator=gen)[: b * max_blocks].reshape(b, max_blocks)
        used = (lens + block_size - 1) // block_size
        table = torch.where(torch.arange(max_blocks)[None, :] < used[:, None], table, -1)
        args["block_table"] = table.to(device=device, dtype=torch.int32)
        cache_shape = (num_blocks, block_size, h_kv, d)
    args["k_cache"] = random_normal(cache_shape, device=device, dtype=dtype, generator=gen)
    args["v_cache"] = random_normal(cache_shape, device=device, dtype=dtype, generator=gen)
    if shape.get("sinks", False):
        sinks = random_normal((h_q,), device="cpu", dtype=torch.float32, generator=gen, scale=2.0)
        args["sinks"] = (sinks + torch.log(torch.tensor(float(n)))).to(device)
    return args


def layouts(shape: dict) -> list[dict]:
    """One new token as a 3-D q and as a 4-D q with s_q 1 (speculative shapes have only the 4-D one)."""
    return [dict(shape), {**shape, "q4d": True}] if shape["s_q"] == 1 else [dict(shape)]


def reduce_shape(shape: dict, cap: int = 4096) -> dict:
    """The same heads, block size and flags with the cache length capped at `cap`."""
    return {**shape, "n": min(shape["n"], cap)}


def _shape(b, h_q, h_kv, d, n, block_size=None, s_q=1, sinks=True, window=None, ragged=False):
    return {"b": b, "s_q": s_q, "h_q": h_q, "h_kv": h_kv, "d": d, "n": n, "block_size": block_size,
            "sinks": sinks, "window": window, "ragged": ragged}


# The targets: (b 8, h 64/8, d 64, n 32768), (b 1, same heads, n 131072), (b 32, h 32/8, d 128, n 8192),
# each contiguous and paged with blocks of 16 and 64, sinks on; and the gpt-oss window-128 layers.
_TARGETS = [
    _shape(b, h_q, h_kv, d, n, block_size=bs)
    for b, h_q, h_kv, d, n in ((8, 64, 8, 64, 32768), (1, 64, 8, 64, 131072), (32, 32, 8, 128, 8192))
    for bs in (None, 16, 64)
] + [_shape(8, 64, 8, 64, 32768, block_size=bs, window=128) for bs in (None, 16, 64)]
# What a serving batch looks like between those: batch 1..128 and caches 2K..128K (each key a bucket; at
# most 2M cached tokens, so every shape fits an 80 GB card next to its copies), d 64 (h 64/8) and 128
# (h 32/8), contiguous (and paged 16 at d 64); and 4 speculative tokens.
_SERVING_GRID = [
    _shape(b, h_q, 8, d, n, block_size=bs)
    for h_q, d, bs in ((64, 64, None), (64, 64, 16), (32, 128, None))
    for b in (1, 8, 32, 128)
    for n in (2048, 16384, 131072)
    if b * n <= 1 << 21 and (b, n, d) != (1, 131072, 64)  # that one is a target
] + [_shape(8, 64, 8, 64, 32768, s_q=4)]

presets = {
    "tiny": [
        _shape(3, 4, 2, 64, 37, ragged=True),
        _shape(3, 8, 1, 64, 70, block_size=16, ragged=True),
        _shape(2, 4, 4, 128, 50, block_size=32, s_q=3, sinks=False, window=16, ragged=True),
    ],
    # The targets' shapes (docs/performance.md), then the serving grid the tables cover (below).
    "targets": _TARGETS,
    "full": _TARGETS + _SERVING_GRID,
}


def specializations(args: dict) -> list[dict]:
    """The call as given, with lse returned, and as one split (the split kernel then writes the outputs
    and applies the sink itself; the device's split count decides which a call takes)."""
    return [args, validate(**{**args, "return_lse": True}), validate(**{**args, "return_lse": True, "num_splits": 1})]


OP = Op(
    name="decode",
    summary="split-KV flash decoding over a contiguous or paged KV cache, with sinks and sliding window",
    validate=validate,
    reference=reference,
    tuning_key=tuning_key,
    flops=flops,
    bytes_moved=bytes_moved,
    make_inputs=make_inputs,
    presets=presets,
    reduce_shape=reduce_shape,
    outputs=("out", "lse"),
    length_dims=("b", "n"),
    layouts=layouts,
    output_specs=output_specs,
    specializations=specializations,
)
