"""Dense attention math shared by flash_attention, sink_attention and decode.

One reference for all three ops, so they cannot drift apart (docs/op-contracts.md's shared rules):
- logits `z_j = sm_scale * q . k_j`, softmax over the allowed keys, computed in fp32 (fp64 when the
  inputs are fp64, for gradcheck only);
- GQA: query head h reads kv head `h // (h_q // h_kv)`;
- bottom-right alignment: query i sits at `p_i = s_k - s_q + i`; causal allows key j iff `j <= p_i`;
  a sliding window W allows key j iff `0 <= p_i - j <= W - 1` (so a window implies causal);
- sinks: `out = out_nosink * sigmoid(lse - sink[h])`; the returned lse never includes the sink;
- a row with no allowed key returns out 0 and lse +inf whatever the sink, with finite zero gradients.

Besides the math, this module holds the argument checks, tuning key, cost model and input maker that
flash_attention and sink_attention share (they differ only by `sinks` and the default of `causal`).
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch

from kreg.ops.contract import (
    DTYPE_NAMES,
    FLOAT_DTYPES,
    TensorSpec,
    bucket_pow2,
    query_chunk,
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

MAX_HEAD_DIM = 256



# ----------------------------------------------------------------------------- reference math
def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sm_scale: float,
    causal: bool,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched masked attention: `q [b, s_q, h_q, d]`, `k, v [b, s_k, h_kv, d]` (s_k may be 0).

    `key_valid [b, s_k]` (bool, optional) masks keys out on top of causal/window (decode uses it for
    invalid block-table entries). Returns `out [b, s_q, h_q, d]` in q's dtype and `lse [b, h_q, s_q]`
    in the compute dtype (fp32, or fp64 for fp64 inputs), +inf for rows with no allowed key.
    Differentiable for q, k, v and sinks; memory is bounded by chunking over queries.
    """
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    group = h_q // h_kv
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    causal = causal or window is not None
    # Heads split as (kv head, group member) so GQA needs no copy of K and V per query head.
    qf = q.to(ct).permute(0, 2, 1, 3).reshape(b, h_kv, group, s_q, d)
    kf = k.to(ct).permute(0, 2, 1, 3)
    vf = v.to(ct).permute(0, 2, 1, 3)
    sink = None if sinks is None else sinks.to(ct).reshape(1, h_kv, group, 1)
    rows = query_chunk(2 * b * h_q * s_k)  # scores and probabilities
    outs, lses = [], []
    for i0 in range(0, s_q, rows):
        qc = qf[:, :, :, i0 : i0 + rows]
        o, lse = _attend_chunk(qc, kf, vf, s_k - s_q + i0, sm_scale, causal, window, sink, key_valid)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, dim=3).reshape(b, h_q, s_q, d).permute(0, 2, 1, 3).to(q.dtype).contiguous()
    return out, torch.cat(lses, dim=3).reshape(b, h_q, s_q)


def _attend_chunk(qc, k, v, p0, sm_scale, causal, window, sink, key_valid):
    """One query chunk `qc [b, h_kv, g, c, d]` whose first row sits at position p0."""
    b, h_kv, group, c, d = qc.shape
    s_k = k.shape[2]
    # Only keys some row of the chunk may see: the causal end and the window start bound the range.
    lo = max(0, p0 - window + 1) if window is not None else 0
    hi = min(s_k, p0 + c) if causal else s_k
    if hi <= lo:
        out = qc.new_zeros((b, h_kv, group, c, d))
        return out, qc.new_full((b, h_kv, group, c), math.inf)
    pos = torch.arange(p0, p0 + c, device=qc.device)[:, None]
    key = torch.arange(lo, hi, device=qc.device)[None, :]
    allowed = torch.ones((c, hi - lo), dtype=torch.bool, device=qc.device)
    if causal:
        allowed = allowed & (key <= pos)
    if window is not None:
        allowed = allowed & (pos - key <= window - 1)
    if key_valid is not None:
        allowed = allowed & key_valid[:, lo:hi].reshape(-1, 1, 1, 1, hi - lo)
    z = torch.einsum("bkgcd,bksd->bkgcs", qc, k[:, :, lo:hi]) * sm_scale
    z = torch.where(allowed, z, -math.inf)
    # The shift is a constant for autograd (softmax and lse are exact for any shift); empty rows
    # shift by 0 so that exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
    m = z.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.exp(z - m)
    total = e.sum(dim=-1, keepdim=True)
    has_key = total != 0  # NaN logits give a NaN total: a NaN row, not an empty one
    total = torch.where(has_key, total, 1.0)
    out = torch.einsum("bkgcs,bksd->bkgcd", e / total, v[:, :, lo:hi])
    lse = (torch.log(total) + m).squeeze(-1)  # 0 on empty rows: keeps the sink factor finite
    if sink is not None:
        out = out * torch.sigmoid(lse - sink).unsqueeze(-1)
    return out, torch.where(has_key.squeeze(-1), lse, math.inf)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    sm_scale: float,
    causal: bool,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: `q [total_q, h_q, d]`, `k, v [total_k, h_kv, d]`, sequence i owning rows
    `cu_seqlens[i]:cu_seqlens[i + 1]`, each aligned bottom-right on its own lengths.

    Reads the offsets on the host (a reference may) and checks them: non-decreasing, within the
    packed tensors and no sequence longer than its max_seqlen, else ValueError. Rows outside every
    sequence get out 0 and lse +inf. Returns `out [total_q, h_q, d]` and `lse [h_q, total_q]`.
    """
    starts_q = _checked_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q)
    starts_k = _checked_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k)
    outs, lses = [_gap(q, 0, starts_q[0])], [_gap_lse(q, 0, starts_q[0])]
    for i in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[i], starts_q[i + 1], starts_k[i], starts_k[i + 1]
        if q1 == q0:
            continue
        out, lse = dense_attention(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
            sm_scale=sm_scale, causal=causal, window=window, sinks=sinks,
        )
        outs.append(out[0])
        lses.append(lse[0])
    outs.append(_gap(q, starts_q[-1], q.shape[0]))
    lses.append(_gap_lse(q, starts_q[-1], q.shape[0]))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def _checked_offsets(name, cu, total, max_name, max_len):
    offsets = cu.tolist()
    if offsets[0] < 0 or offsets[-1] > total or any(b < a for a, b in pairwise(offsets)):
        raise ValueError(f"{name}: expected non-decreasing offsets within [0, {total}], got {offsets}")
    longest = max(b - a for a, b in pairwise(offsets))
    if longest > max_len:
        raise ValueError(f"{max_name}: a sequence in {name} has {longest} tokens, more than {max_len}")
    return offsets


def _gap(q, start, end):
    return q.new_zeros((end - start, *q.shape[1:]))


def _gap_lse(q, start, end):
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.full((q.shape[1], end - start), math.inf, dtype=ct, device=q.device)


def allowed_pairs(s_q: int, s_k: int, causal: bool, window: int | None) -> int:
    """Allowed (query, key) pairs of one sequence, in closed form (bottom-right alignment).

    Row i sees `min(max(p_i + 1, 0), W)` keys with `p_i + 1 = s_k - s_q + 1 + i`, so the sum runs
    over x = s_k - s_q + 1 .. s_k of `min(max(x, 0), W)`.
    """
    if not causal and window is None:
        return s_q * s_k

    def prefix(n: int) -> int:  # sum of min(x, W) for x = 1..n
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window

    return prefix(s_k) - prefix(max(s_k - s_q, 0))


# ----------------------------------------------------------------------------- shared contract parts
def check_dense_args(
    q, k, v, causal, sm_scale, window, return_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    deterministic=False,
) -> tuple[float, tuple]:
    """The argument checks flash_attention and sink_attention share; returns the resolved sm_scale
    and the raw dispatch key (`Args.key`): everything `dense_tuning_key` reads, unprocessed
    (`deterministic` picks no config: it is not in the key).

    Shape reads and dtype/device compares only: no tensor values are read (no host sync).
    """
    # Each tensor attribute read costs ~0.15-0.3 us and this runs on every call: read each one once,
    # compare plainly, and let the require_* helpers word the error only after a compare failed.
    try:
        qs, ks, vs = q.shape, k.shape, v.shape
        dtype, k_dtype, v_dtype = q.dtype, k.dtype, v.dtype
        device, k_device, v_device = q.get_device(), k.get_device(), v.get_device()
        contiguous = q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        empty = not (q.numel() and k.numel())
    except AttributeError:
        for name, t in (("q", q), ("k", k), ("v", v)):
            require_tensor(name, t)
        raise
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    elif len(qs) != 4:
        raise ValueError(
            f"q: expected shape [b, s_q, h_q, d] (or [total_q, h_q, d] with cu_seqlens_q), got {list(qs)}"
        )
    elif len(ks) != 4 or ks[0] != qs[0]:
        raise ValueError(f"k: expected shape [b={qs[0]}, s_k, h_kv, d], got {list(ks)}")
    if vs != ks:
        raise ValueError(f"v: expected the shape of k {list(ks)}, got {list(vs)}")
    if dtype not in FLOAT_DTYPES:
        require_float("q", q)
    if k_dtype != dtype or v_dtype != dtype:
        require_same_dtype([("q", q), ("k", k), ("v", v)])
    # get_device() is a GPU index, or -1 for every non-GPU device (CPU, meta): compare those fully.
    if k_device != device or v_device != device or (device < 0 and not q.device == k.device == v.device):
        require_same_device([("q", q), ("k", k), ("v", v)])
    # Only strided views pay for reading their strides.
    if not contiguous and (q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1):
        for name, t in (("q", q), ("k", k), ("v", v)):
            require_last_contiguous(name, t)
    d, h_q, h_kv = qs[-1], qs[-2], ks[-2]
    if ks[-1] != d:
        raise ValueError(f"k: expected head dim d = {d} like q, got shape {list(ks)}")
    if not 0 < d <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected head dim d in 1..{MAX_HEAD_DIM}, got shape {list(qs)}")
    if empty:
        name, shape = ("q", qs) if 0 in qs else ("k", ks)
        raise ValueError(f"{name}: expected a non-empty batch, got shape {list(shape)}")
    if h_q % h_kv:
        raise ValueError(f"k: expected h_kv dividing h_q = {h_q} (GQA), got h_kv = {h_kv}")
    if causal is not True and causal is not False:
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if deterministic is not True and deterministic is not False:
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    if window is not None:
        require_window(window, causal)
    key = (qs, ks, dtype, causal, window, cu_seqlens_q is None, max_seqlen_q, max_seqlen_k)
    if sm_scale is None:
        return d**-0.5, key
    return resolve_scale("sm_scale", sm_scale, d), key


def _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            raise ValueError(f"{name}: expected an int32 tensor [b + 1] with the other cu_seqlens, got None")
        require_tensor(name, cu)
        require_int32(name, cu)
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name}: expected shape [b + 1] with b >= 1, got {list(cu.shape)}")
        require_last_contiguous(name, cu)
        if cu.device != q.device:
            require_same_device([("q", q), (name, cu)])
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(
            f"cu_seqlens_k: expected shape [{cu_seqlens_q.shape[0]}] like cu_seqlens_q, "
            f"got {list(cu_seqlens_k.shape)}"
        )
    # The kernels size their grid from these: reading cu_seqlens on the host would be a sync.
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None:
            raise ValueError(f"{name}: required with cu_seqlens (the longest sequence), got None")
        require_positive_int(name, value)
    if q.dim() != 3:
        raise ValueError(f"q: expected shape [total_q, h_q, d] with cu_seqlens_q, got {list(q.shape)}")
    if k.dim() != 3:
        raise ValueError(f"k: expected shape [total_k, h_kv, d] with cu_seqlens_k, got {list(k.shape)}")
    # No sequence is longer than the packed rows (empty tensors are reported by the caller).
    for name, value, rows in (("max_seqlen_q", max_seqlen_q, q.shape[0]), ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        if rows and value > rows:
            raise ValueError(f"{name}: expected at most the {rows} packed rows, got {value}")


def check_sinks(sinks, h_q: int, q: torch.Tensor) -> None:
    """sinks: None or a contiguous fp32 `[h_q]` tensor on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        require_tensor("sinks", sinks)
    if sinks.dtype != torch.float32:
        require_float("sinks", sinks, (torch.float32,))
    if sinks.shape != (h_q,):
        raise ValueError(f"sinks: expected shape [h_q={h_q}], got {list(sinks.shape)}")
    if sinks.device != q.device:
        require_same_device([("q", q), ("sinks", sinks)])
    if sinks.stride(-1) != 1:  # kernels read sinks[h] at SINKS + h
        require_last_contiguous("sinks", sinks)


def run_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float | None,
    window: int | None,
    return_lse: bool,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    sinks: torch.Tensor | None,
):
    """The flash_attention / sink_attention reference on validated arguments: `out` or `(out, lse)`."""
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    common = dict(sm_scale=sm_scale, causal=causal, window=window, sinks=sinks)
    if cu_seqlens_q is not None:
        out, lse = varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **common
        )
    else:
        out, lse = dense_attention(q, k, v, **common)
    return (out, lse) if return_lse else out


def dense_tuning_key(args: dict, sinks: bool | None = None) -> tuple:
    """flash_attention's key; with `sinks` given (a bool), sink_attention's (one more pair). Packed
    varlen calls key by their max_seqlen and share the padded layout's key: a tuned config serves
    both (the sweep's compile check compiles both)."""
    q, k = args["q"], args["k"]
    varlen = args["cu_seqlens_q"] is not None
    s_q = args["max_seqlen_q"] if varlen else q.shape[1]
    s_k = args["max_seqlen_k"] if varlen else k.shape[1]
    head = (
        ("causal", args["causal"]),
        ("d", q.shape[-1]),
        ("dtype", DTYPE_NAMES[q.dtype]),
        ("h_kv", k.shape[-2]),
        ("h_q", q.shape[-2]),
        ("s_k", bucket_pow2(s_k)),
        ("s_q", bucket_pow2(s_q)),
    )
    tail = (("window", args["window"]),)
    return head + tail if sinks is None else head + (("sinks", sinks),) + tail


def dense_output_specs(args: dict):
    """`out` like q, and with return_lse an fp32 lse `[b, h_q, s_q]` (varlen: `[h_q, total_q]`)."""
    q = args["q"]
    out = spec_like(q)
    if not args["return_lse"]:
        return out
    lse = (q.shape[1], q.shape[0]) if args["cu_seqlens_q"] is not None else (q.shape[0], q.shape[2], q.shape[1])
    return out, TensorSpec(lse, torch.float32)


def dense_layouts(shape: dict) -> list[dict]:
    """A dense preset shape padded ([b, s, h, d]) and packed (varlen, max_seqlen = s)."""
    return [{**shape, "varlen": False}, {**shape, "varlen": True}]


def dense_flops(args: dict) -> float:
    """`4 * b * h_q * pairs * d` from shapes and flags; varlen counts every sequence as
    (max_seqlen_q, max_seqlen_k), an upper bound (no cu_seqlens read)."""
    q, k = args["q"], args["k"]
    if args["cu_seqlens_q"] is not None:
        b, s_q, s_k = args["cu_seqlens_q"].shape[0] - 1, args["max_seqlen_q"], args["max_seqlen_k"]
    else:
        b, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
    pairs = allowed_pairs(s_q, s_k, args["causal"], args["window"])
    return 4.0 * b * q.shape[-2] * pairs * q.shape[-1]


def dense_bytes(args: dict, sinks: torch.Tensor | None = None) -> float:
    """q, k, v (and sinks) read once; out (and lse) written once."""
    q = args["q"]
    total = (2 * q.numel() + args["k"].numel() + args["v"].numel()) * q.element_size()
    if args["return_lse"]:
        total += 4 * q.numel() // q.shape[-1]
    if sinks is not None:
        total += 4 * sinks.numel()
    return float(total)


def make_dense_inputs(shape: dict, *, device, dtype, seed: int, with_sinks: bool) -> dict:
    """Random q, k, v (and sinks) for a preset shape dict.

    Keys: b, s_q, s_k, h_q, h_kv, d, causal, window (optional), sinks (optional, default True when
    the op has sinks), varlen (optional: pack b sequences of random lengths up to s_q / s_k, the
    first one full length, and pass max_seqlen_q = s_q, max_seqlen_k = s_k).
    """
    gen = torch.Generator().manual_seed(seed)
    b, s_q, s_k, h_q, h_kv, d = (shape[n] for n in ("b", "s_q", "s_k", "h_q", "h_kv", "d"))
    args: dict = {}
    if shape.get("varlen", False):
        lens_q = torch.randint(1, s_q + 1, (b,), generator=gen)
        lens_q[0] = s_q
        lens_k = (lens_q + (s_k - s_q)).clamp(1, s_k)
        zero = torch.zeros(1, dtype=torch.int64)
        cu_q = torch.cat([zero, lens_q.cumsum(0)]).to(device=device, dtype=torch.int32)
        cu_k = torch.cat([zero, lens_k.cumsum(0)]).to(device=device, dtype=torch.int32)
        q_shape, kv_shape = (int(lens_q.sum()), h_q, d), (int(lens_k.sum()), h_kv, d)
        args.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=s_q, max_seqlen_k=s_k)
    else:
        q_shape, kv_shape = (b, s_q, h_q, d), (b, s_k, h_kv, d)
    q = random_normal(q_shape, device=device, dtype=dtype, generator=gen)
    k = random_normal(kv_shape, device=device, dtype=dtype, generator=gen)
    v = random_normal(kv_shape, device=device, dtype=dtype, generator=gen)
    args.update(q=q, k=k, v=v, causal=shape["causal"], window=shape.get("window"))
    if with_sinks and shape.get("sinks", True):
        # Centered near a typical row's lse, so the sink takes a real share of the softmax.
        sinks = random_normal((h_q,), device="cpu", dtype=torch.float32, generator=gen, scale=2.0)
        args["sinks"] = (sinks + math.log(s_k)).to(device)
    return args


def reduce_dense_shape(shape: dict, cap: int = 2048) -> dict:
    """Scale s_q and s_k down together so the longer is at most `cap` (their order is kept)."""
    longest = max(shape["s_q"], shape["s_k"])
    if longest <= cap:
        return dict(shape)
    return {
        **shape,
        "s_q": max(1, shape["s_q"] * cap // longest),
        "s_k": max(1, shape["s_k"] * cap // longest),
    }
