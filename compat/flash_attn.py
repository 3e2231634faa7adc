"""FlashAttention 2.8's Python interface on kreg's ops.

    from kreg.compat.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

The three functions take the arguments of `flash_attn`'s (names, order, defaults), read its tensor
layouts and return what it returns:

- `flash_attn_func` and `flash_attn_varlen_func` (without `block_table`) run `flash_attention`, or
  `sink_attention` when the extra keyword `sinks` is given; both are differentiable.
- `flash_attn_varlen_func` with `block_table` (keys and values in pages) and `flash_attn_with_kvcache`
  run `decode`, which has no backward.

Masks. FlashAttention places query i of a sequence at `p = i + s_k - s_q` and keeps key j when
`p - left <= j <= p + right` (a negative bound is no bound; `causal=True` sets right to 0). kreg's
masks are no mask, causal, and causal with a window of W keys (`window_size=(W - 1, 0)`). Each call
maps its (causal, window_size) onto one of those, from shapes only: a bound that reaches past every
key of the longest sequence is no bound, and right = 0 is causal whatever `causal` says. A window that
stays one-sided after that (keys on the left cut off but none on the right, or a right bound inside
the sequence) has no kreg equivalent and raises.

What else raises (ValueError or TypeError naming the argument): dropout_p != 0, softcap > 0,
alibi_slopes, rotary_cos/rotary_sin, cache_batch_idx, cache_leftpad, k without v (or v without k),
k without cache_seqlens, new tokens past an int cache_seqlens' capacity; a call that appends is checked
whole before anything is written to the cache. No call reads a tensor's values on the host. Attention
probabilities: 2.8 returns them only with dropout (which kreg does
not have); without dropout it returns an empty tensor in their place, and so does this module.

`use_vendor("nvidia" | "amd")` points the module at one vendor's kernels (on CPU tensors, Triton's
interpreter), for tests; `use_vendor(None)` goes back to dispatch's choice.
"""

from __future__ import annotations

import math
import operator

import torch

from kreg import registry

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "use_vendor"]

# The op handles every call goes through (registry.get's handles live as long as the process):
# the default path pays a global lookup for them, nothing more. use_vendor rebinds them.
_flash = registry.get("flash_attention")
_sink = registry.get("sink_attention")
_decode = registry.get("decode")
_vendor: str | None = None

# decode holds all query rows of a kv head (new tokens x GQA group) in one tile: longer blocks of
# queries are cut into pieces of at most this many rows per kv head.
DECODE_ROWS = 128

_NO_WINDOW = (-1, -1)
_INF = float("inf")


def use_vendor(vendor: str | None) -> str | None:
    """Run this module's calls on `vendor`'s kernels ("nvidia" or "amd"; None: dispatch's choice, the
    default). Returns the previous setting, so a caller can put it back."""
    global _flash, _sink, _decode, _vendor
    handles = [registry.get(op, vendor=vendor) for op in ("flash_attention", "sink_attention", "decode")]
    previous, _vendor = _vendor, vendor
    _flash, _sink, _decode = handles
    return previous


# ----------------------------------------------------------------------------- argument mapping
def _refuse(dropout_p, softcap, alibi_slopes) -> None:
    """The training and bias options kreg has no form of."""
    if dropout_p:
        raise ValueError(f"dropout_p: kreg has no attention dropout; expected 0.0, got {dropout_p!r}")
    if softcap is not None and softcap > 0:
        raise ValueError(f"softcap: kreg has no logit softcapping; expected 0.0, got {softcap!r}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: kreg has no ALiBi bias; expected None")


def _size(name: str, x, dim: int) -> int:
    try:
        return x.shape[dim]
    except AttributeError:
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}") from None
    except IndexError:
        raise ValueError(f"{name}: expected at least {dim + 1} dimensions, got shape {list(x.shape)}") from None


def _int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def _mask(causal, window_size, s_q: int, s_k: int) -> tuple[bool, int | None]:
    """FlashAttention's (causal, window_size) as kreg's (causal, window), for queries of at most `s_q`
    rows over at most `s_k` keys per sequence (the bounds that make a window side reach every key)."""
    try:
        left, right = window_size
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}") from None
    # The first key a query at p <= s_k - 1 can reach is p - left: at left >= s_k - 1 that is never past key 0.
    if left < 0 or left >= s_k - 1:
        left = None
    if causal or right == 0:
        return True, None if left is None else left + 1
    # The lowest query sits at s_k - s_q; at right >= s_q - 1 every query reaches the last key.
    if right < 0 or right >= s_q - 1:
        if left is None:
            return False, None
        raise ValueError(
            f"window_size: {tuple(window_size)} without causal keeps keys after the query but cuts off keys "
            f"more than {left} before it; kreg's windows are causal: window_size=({left}, 0) or causal=True"
        )
    raise ValueError(
        f"window_size: a right bound of {right} keys after the query (of up to {s_q} queries) has no kreg "
        "equivalent; kreg's masks are none, causal, or causal with a left window (right = 0)"
    )


def _as_fp32(sinks):
    """Sinks as the fp32 kreg's ops take (a model's sinks parameter may be bf16); a non-tensor is left
    for the op to refuse, naming it."""
    if isinstance(sinks, torch.Tensor) and sinks.dtype != torch.float32:
        return sinks.float()
    return sinks


def _no_probs(q: torch.Tensor) -> torch.Tensor:
    # What 2.8 returns for the probabilities when it computed none (every call without dropout).
    return torch.empty((0,), dtype=q.dtype, device=q.device)


# ----------------------------------------------------------------------------- dense
def _dense(q, k, v, causal, window, scale, want: bool, deterministic, sinks, **varlen):
    """flash_attention, or sink_attention with sinks, returning what 2.8 returns (with `want`, the
    probabilities' empty tensor after out and lse)."""
    if sinks is None:
        res = _flash(q, k, v, causal=causal, sm_scale=scale, window=window, return_lse=want,
                     deterministic=deterministic, **varlen)
    else:
        res = _sink(q, k, v, sinks=_as_fp32(sinks), window=window, causal=causal, sm_scale=scale, return_lse=want,
                    deterministic=deterministic, **varlen)
    return (*res, _no_probs(q)) if want else res


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    sinks=None,
):
    """Attention of `q [b, s_q, h_q, d]` over `k, v [b, s_k, h_kv, d]` (GQA: `h_q % h_kv == 0`).

    Returns `out [b, s_q, h_q, d]`, or with `return_attn_probs` the triple `(out, softmax_lse
    [b, h_q, s_q] fp32, empty tensor)`. `sinks [h_q]` (kreg's extension: one logit per query head with
    no value, gpt-oss's) runs `sink_attention`. Differentiable for q, k, v (and sinks)."""
    _refuse(dropout_p, softcap, alibi_slopes)
    window = None
    if window_size != _NO_WINDOW:
        causal, window = _mask(causal, window_size, _size("q", q, 1), _size("k", k, 1))
    return _dense(q, k, v, causal, window, softmax_scale, bool(return_attn_probs), deterministic, sinks)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    sinks=None,
):
    """Packed sequences: `q [total_q, h_q, d]`, `k, v [total_k, h_kv, d]`, sequence i owning rows
    `cu_seqlens_q[i]:cu_seqlens_q[i + 1]` of q and `cu_seqlens_k[i]:cu_seqlens_k[i + 1]` of k and v
    (int32 `[b + 1]`); `max_seqlen_q`, `max_seqlen_k` the longest of each.

    With `block_table [b, max_blocks]` int32, k and v are pages `[num_blocks, page_block_size, h_kv, d]`
    (a power of two >= 16 tokens each): sequence i's key t lives in page `block_table[i, t // page]`;
    `cu_seqlens_k` still gives the key counts. That form runs `decode` and has no backward.

    Returns `out [total_q, h_q, d]`, or with `return_attn_probs` `(out, softmax_lse [h_q, total_q] fp32,
    empty tensor)`. Rows of q outside every sequence come back as 0 (lse +inf)."""
    _refuse(dropout_p, softcap, alibi_slopes)
    window = None
    if window_size != _NO_WINDOW:
        causal, window = _mask(causal, window_size, _int("max_seqlen_q", max_seqlen_q),
                               _int("max_seqlen_k", max_seqlen_k))
    want = bool(return_attn_probs)
    if block_table is None:
        return _dense(q, k, v, causal, window, softmax_scale, want, deterministic, sinks, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    res = _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, bool(causal), window,
                        _as_fp32(sinks), softmax_scale, want)
    return (*res, _no_probs(q)) if want else res


# ----------------------------------------------------------------------------- caches (decode)
def _attend(q, s: int, group: int, k_cache, v_cache, lengths, block_table, causal: bool, window, sinks, scale,
            want: bool, num_splits):
    """`q [b, s, h_q, d]` (h_q = group * h_kv), the last s positions of sequences with `lengths [b]` keys in
    the cache, as decode calls: one when the block's rows fit a tile (DECODE_ROWS per kv head), else one
    per piece of queries, each with the key count its last query sees. Returns out `[b, s, h_q, d]` (and
    lse `[b, h_q, s]` when `want`)."""
    step = max(1, DECODE_ROWS // max(1, group))
    if s <= step:
        return _attend_block(q, k_cache, v_cache, lengths, block_table, causal, window, sinks, scale, want,
                             num_splits)
    outs, lses = [], []
    for start in range(0, s, step):
        end = min(s, start + step)
        # Causal: the piece's last query sees the keys up to its own position, s - end before the last.
        n = lengths - (s - end) if causal and end < s else lengths
        res = _attend_block(q[:, start:end], k_cache, v_cache, n, block_table, causal, window, sinks, scale, want,
                            num_splits)
        outs.append(res[0] if want else res)
        if want:
            lses.append(res[1])
    out = torch.cat(outs, dim=1)
    return (out, torch.cat(lses, dim=2)) if want else out


def _attend_block(q, k_cache, v_cache, lengths, block_table, causal: bool, window, sinks, scale, want: bool,
                  num_splits):
    s = q.shape[1]
    if causal or s == 1:  # a single query sits at the last key: causal and not are the same
        return _decode(q, k_cache, v_cache, lengths, block_table=block_table, sinks=sinks, window=window,
                       sm_scale=scale, num_splits=num_splits, return_lse=want)
    # Without a mask every query sees all keys, which decode expresses for one token per sequence: the
    # queries become heads (head h, token t -> h * s + t keeps each GQA group on its kv head).
    b, _, h_q, d = q.shape
    folded = q.transpose(1, 2).reshape(b, h_q * s, d)
    res = _decode(folded, k_cache, v_cache, lengths, block_table=block_table,
                  sinks=None if sinks is None else sinks.repeat_interleave(s), window=None, sm_scale=scale,
                  num_splits=num_splits, return_lse=want)
    out = (res[0] if want else res).view(b, h_q, s, d).transpose(1, 2).contiguous()
    return (out, res[1].view(b, h_q, s)) if want else out


def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, causal: bool, window, sinks,
                  scale, want: bool):
    """flash_attn_varlen_func over pages, as one decode call without reading any offset on the host.

    Each sequence's queries are cut, from its last one back, into segments of c tokens; a segment is a
    batch entry of decode (its first segment padded in front with zero queries whose results are
    dropped), reading its sequence's block table row with the key count its last query sees. The
    segment count is bounded from shapes: sum ceil(len_i / c) <= min(total_q, ceil(total_q / c) + b).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected shape [total_q, h_q, d], got {_shape(q)}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected pages [num_blocks, page_block_size, h_kv, d] with block_table, "
                             f"got {_shape(t)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            raise TypeError(f"{name}: expected an int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 1 or t.shape[0] < 2:
            raise ValueError(f"{name}: expected shape [b + 1] with b >= 1, got {list(t.shape)}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {list(cu_seqlens_q.shape)}, "
                         f"got {list(cu_seqlens_k.shape)}")
    b = cu_seqlens_q.shape[0] - 1
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table: expected shape [b={b}, max_blocks], got {_shape(block_table)}")
    max_q = _int("max_seqlen_q", max_seqlen_q)
    total, h_q, d = q.shape
    h_kv = k.shape[2]
    group = max(1, h_q // h_kv if h_kv else 1)
    c = max(1, min(max_q, DECODE_ROWS // group))
    segs = min(total, -(-total // c) + b)
    dev = q.device

    q_len = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    per_seq = (q_len.clamp(min=0) + (c - 1)) // c
    first = per_seq.cumsum(0) - per_seq
    row = torch.arange(total, device=dev, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens_q[1:], row, right=True).clamp_(max=b - 1)
    back = q_len[seq] - 1 - (row - cu_seqlens_q[seq])  # queries after this one in its sequence
    valid = (row < cu_seqlens_q[b]) & (row >= cu_seqlens_q[seq]) & (back >= 0)
    back = back.clamp(min=0).long()
    hop = back // c  # segments between this row's and its sequence's last
    seg = first[seq] + per_seq[seq] - 1 - hop
    valid &= seg < segs
    slot = torch.where(valid, seg * c + (c - 1 - back % c), segs * c)  # segs * c: a spare row for the rest
    padded = q.new_zeros((segs * c + 1, h_q, d)).index_copy_(0, slot, q)
    seg = torch.where(valid, seg, segs)
    # Every row of a segment writes the same values into its segment's entry.
    owner = torch.zeros(segs + 1, dtype=torch.long, device=dev).index_put_((seg,), seq)
    k_len = (cu_seqlens_k[1:] - cu_seqlens_k[:-1])[seq]
    keys = (k_len - hop * c if causal else k_len).to(torch.int32)
    lengths = torch.zeros(segs + 1, dtype=torch.int32, device=dev).index_put_((seg,), keys)
    res = _attend(padded[:-1].view(segs, c, h_q, d), c, group, k, v, lengths[:-1],
                  block_table.index_select(0, owner[:-1]), causal, window, sinks, scale, want, None)
    pick = slot.clamp(max=max(segs * c - 1, 0))
    out = (res[0] if want else res).reshape(segs * c, h_q, d).index_select(0, pick)
    out = torch.where(valid[:, None, None], out, 0)
    if not want:
        return out
    lse = res[1].transpose(1, 2).reshape(segs * c, h_q).index_select(0, pick)
    return out, torch.where(valid[:, None], lse, _INF).t().contiguous()


def _shape(x) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    sinks=None,
):
    """Attention of `q [b, s_q, h_q, d]` (new tokens) against a KV cache, contiguous
    `[b, n_max, h_kv, d]` or in pages `[num_blocks, page_block_size, h_kv, d]` with `block_table
    [b, max_blocks]` int32 (page_block_size a power of two >= 16).

    `cache_seqlens` (int, or int32 `[b]`; None: the whole cache) counts the keys already cached. With
    `k, v [b, s_new, h_kv, d]` the new keys and values are first written into the cache, in place, at
    positions `cache_seqlens .. cache_seqlens + s_new - 1` of each sequence, then attended to. The
    queries are the last s_q positions of each sequence's keys. `num_splits` 0 lets decode choose.

    Returns `out [b, s_q, h_q, d]`, or with `return_softmax_lse` `(out, softmax_lse [b, h_q, s_q] fp32)`.
    Not differentiable. Writes past a sequence's capacity (an overfull cache) are clamped into it."""
    if (rotary_cos is not None or rotary_sin is not None or cache_batch_idx is not None
            or cache_leftpad is not None or alibi_slopes is not None or (softcap is not None and softcap > 0)):
        _refuse_kvcache(rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, softcap, alibi_slopes)
    # Each shape is read once (a read costs ~0.2 us): this runs on every decode step.
    try:
        qs, cs = q.shape, k_cache.shape
    except AttributeError:
        qs = cs = ()
    if len(qs) != 4:
        raise ValueError(f"q: expected shape [b, s_q, h_q, d], got {_shape(q)}")
    if len(cs) != 4:
        layout = "[num_blocks, page_block_size, h_kv, d]" if block_table is not None else "[b, n_max, h_kv, d]"
        raise ValueError(f"k_cache: expected shape {layout}, got {_shape(k_cache)}")
    b, s_q, h_q, _ = qs
    capacity = cs[1] if block_table is None else _size("block_table", block_table, 1) * cs[1]
    window = None
    if window_size != _NO_WINDOW:
        causal, window = _mask(causal, window_size, s_q, capacity)
    splits = 0 if num_splits == 0 else _int("num_splits", num_splits)
    if sinks is not None:
        sinks = _as_fp32(sinks)
    new = 0
    if k is not None or v is not None:
        new = _append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, capacity, sinks, softmax_scale)
    if cache_seqlens is None:
        lengths = torch.full((b,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = torch.full((b,), cache_seqlens + new, dtype=torch.int32, device=q.device)
    else:
        lengths = cache_seqlens + new if new else cache_seqlens
    return _attend(q, s_q, h_q // cs[2] if cs[2] else 1, k_cache, v_cache, lengths, block_table, bool(causal), window,
                   sinks, softmax_scale, bool(return_softmax_lse), splits if splits > 0 else None)


def _refuse_kvcache(rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, softcap, alibi_slopes) -> None:
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if value is not None:
            raise ValueError(f"{name}: kreg applies no rotary embedding; rotate q and k before the call and "
                             "pass None")
    if cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: kreg reads cache row i for batch entry i; expected None")
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad: kreg's caches start at position 0; expected None")
    _refuse(0.0, softcap, alibi_slopes)


def _append(q, k_cache, v_cache, k, v, cache_seqlens, block_table, capacity: int, sinks, softmax_scale) -> int:
    """Write k and v into the caches at each sequence's `cache_seqlens`, after checking what decode
    would refuse (so that a refused call leaves the cache as it was). Returns the number of new tokens."""
    if k is None or v is None:
        missing, given = ("k", "v") if k is None else ("v", "k")
        raise ValueError(f"{missing}: {given} was given without it; pass both new keys and values or neither")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: new k and v are written at the cache lengths; pass them (int or [b])")
    b, h_q, d = q.shape[0], q.shape[2], q.shape[3]
    h_kv, d_cache = k_cache.shape[2], k_cache.shape[3]
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        if t.dim() != 4 or t.shape[0] != b or t.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"{name}: expected shape [b={b}, s_new, h_kv={h_kv}, d={d_cache}], got {list(t.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {list(k.shape)}, got {list(v.shape)}")
    if not isinstance(v_cache, torch.Tensor) or v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected the shape of k_cache {list(k_cache.shape)}, got {_shape(v_cache)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {t.device}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {list(t.stride())}")
    if d != d_cache or not 0 < d <= 256:
        raise ValueError(f"k_cache: expected head dim d = {d} like q (at most 256), got shape {list(k_cache.shape)}")
    if h_q % h_kv:
        raise ValueError(f"k_cache: expected h_kv dividing h_q = {h_q} (GQA), got h_kv = {h_kv}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (h_q,) or sinks.device != q.device):
        raise ValueError(f"sinks: expected a tensor [h_q={h_q}] on q's device, got {_shape(sinks)}")
    if softmax_scale is not None:
        try:
            finite = math.isfinite(softmax_scale)
        except TypeError:
            finite = False
        if not finite:
            raise ValueError(f"softmax_scale: expected a finite number or None, got {softmax_scale!r}")
    paged = block_table is not None
    if paged:
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(f"block_table: expected an int32 tensor [b={b}, max_blocks], got {block_table.dtype} "
                             f"{list(block_table.shape)}")
        page = k_cache.shape[1]
        if page < 16 or page & (page - 1):
            raise ValueError(f"block_size: expected a power of two >= 16 (k_cache dim 1), got {page}")
    elif k_cache.shape[0] != b:
        raise ValueError(f"k_cache: expected shape [b={b}, n_max, h_kv, d], got {list(k_cache.shape)}")
    s_new = k.shape[1]
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - s_new:
            raise ValueError(f"cache_seqlens: {s_new} new tokens from position {cache_seqlens} do not fit a cache of "
                             f"{capacity}")
        if s_new and not paged:
            k_cache[:, cache_seqlens:cache_seqlens + s_new] = k
            v_cache[:, cache_seqlens:cache_seqlens + s_new] = v
            return s_new
        pos = (_steps(s_new, q.device) + cache_seqlens).expand(b, s_new)
    else:
        if not isinstance(cache_seqlens, torch.Tensor):
            raise TypeError(f"cache_seqlens: expected an int or an int32 tensor, got {type(cache_seqlens).__name__}")
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens: expected int32, got {cache_seqlens.dtype}")
        if cache_seqlens.shape != (b,):
            raise ValueError(f"cache_seqlens: expected shape [b={b}], got {list(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens: expected q's device {q.device}, got {cache_seqlens.device}")
        if s_new == 0:
            return 0
        # Positions past the capacity (an overfull cache, whose results are unspecified) stay inside it.
        pos = (cache_seqlens[:, None] + _steps(s_new, q.device)).clamp_(0, capacity - 1)
    if s_new == 0:
        return 0
    if paged:
        page = k_cache.shape[1]
        pos = pos.long()
        blocks = block_table.gather(1, pos // page).long().clamp_(0, k_cache.shape[0] - 1)
        where = (blocks, pos % page)
    else:
        where = (_steps(b, q.device)[:, None], pos)
    k_cache.index_put_(where, k)
    v_cache.index_put_(where, v)
    return s_new


_STEPS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _steps(n: int, device: torch.device) -> torch.Tensor:
    """`arange(n)` as int32 on `device`, made once per (n, device) (read only, never written)."""
    found = _STEPS.get((n, device))
    if found is None:
        found = _STEPS[(n, device)] = torch.arange(n, dtype=torch.int32, device=device)
    return found
