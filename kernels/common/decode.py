"""Split-KV flash decoding: the Triton kernel bodies both vendors share.

A call is two kernels, two roles:

- `split` (`_decode_split_kernel`): one program per (sequence, KV_HEADS kv heads, split). Its tile's
  rows are, for each of its kv heads, every query head of the GQA group times every new token
  (`s_q * group` rows), so each K/V tile is read once for all of them; with several kv heads the
  tiles carry a leading head dimension, the products are batched over it, and each key position is
  one contiguous read of KV_HEADS * d elements. The keys a sequence can see, [lo, hi) with hi its length and lo
  the first query's window start, are cut into `num_splits` equal ranges of whole key tiles; a split
  that the length or the window leaves empty writes an empty partial (lse -inf) after reading one
  length. It writes each row's normalized partial output and its lse (natural log) to a workspace.
- `combine` (`_decode_combine_kernel`): one program per ROWS (sequence, token, head) rows. It merges
  the partials by their lse, applies the sink once (`L' = logaddexp(L, sink)`), and writes the
  output in the input dtype and the lse without the sink (+inf, and out 0, for a row with no key).

A call of one split (large batches) needs no merge: the split kernel applies the sink and writes the
outputs itself, and no combine is launched.

`num_splits` comes from shapes and the device only (never from cache_seqlens values, so no host sync
and CUDA-graph capture works): about WAVES programs per SM, rounded to fill the last wave of SMs as
well as it can, at most one split per key tile of the longest range a sequence could need (its
capacity, or the window plus s_q - 1). Paged caches gather
keys through the block table: one entry per key tile when a page holds whole tiles (block_size >=
BLOCK_N, fixed at compile time; a window's first tile is then aligned down to a page-aligned
multiple of BLOCK_N), else one per key; a block id outside [0, num_blocks) masks its keys, and table
entries past a sequence's length are never read. Semantics: `ops.decode.reference`
(docs/op-contracts.md).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kreg.core.records import LaunchConfig
from kreg.core.space import ConfigSpace, Keep
from kreg.core.workspace import keep_workspace
from kreg.kernels.common.constants import LN2, LOG2E
from kreg.kernels.common.launch import LaunchCache, launch_signed, signature_key, triton_launch
from kreg.kernels.common.tiles import cdiv, dot_block, next_pow2
from kreg.ops.variant import CallPlan

MAX_SPLITS = 256


# ----------------------------------------------------------------------------- Triton kernels
@triton.jit
def _per_head_rows(x, step, KV_HEADS: tl.constexpr):
    """Offsets `x [rows]` of the first kv head, as they are (one head) or as [KV_HEADS, rows] with kv
    head j's `j * step` added."""
    if KV_HEADS == 1:
        return x
    else:
        return (tl.arange(0, KV_HEADS) * step)[:, None] + x[None, :]


@triton.jit
def _per_head_tile(x, step, KV_HEADS: tl.constexpr):
    """Offsets `x [keys, d]` of the first kv head, as they are (one head) or as [KV_HEADS, keys, d]."""
    if KV_HEADS == 1:
        return x
    else:
        return (tl.arange(0, KV_HEADS) * step)[:, None, None] + x[None, :, :]


@triton.jit
def _dot_keys(a, b, TRANS_B: tl.constexpr):
    """a @ b (b transposed in its last two dims when TRANS_B) for 2-D tiles, or batched over the kv
    heads for 3-D ones: Triton gives a batched dot's warps to the batch dimension, so one head stays
    2-D and several heads want num_warps <= KV_HEADS."""
    if TRANS_B:
        if len(b.shape) == 2:
            b = tl.trans(b)
        else:
            b = tl.trans(b, 0, 2, 1)
    return tl.dot(a, b)


@triton.jit
def _decode_split_kernel(
    Q, K, V, SEQLENS, TABLE, O_PART, LSE_PART, SINK,
    qk_scale, window, capacity, num_blocks, s_q, group, h_kv, split_len,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_tb,
    stride_ob, stride_os, stride_oh, stride_op,
    stride_lb, stride_ls, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_HEADS: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    FINAL: tl.constexpr, HAS_SINK: tl.constexpr, RETURN_LSE: tl.constexpr, PDL: tl.constexpr,
):
    """One program: split `program_id(1)` of the keys of one sequence for KV_HEADS consecutive kv
    heads (`h_kv % KV_HEADS == 0`), each with all its `s_q * group` query rows (row r of kv head j:
    token r // group, query head j * group + r % group).

    With one kv head the tiles are 2-D ([rows or keys, d]); with several they carry a leading
    [KV_HEADS] dimension and both products are batched over it, so each key position's KV_HEADS * d
    contiguous elements are read by one program in one step. Online softmax in log2 units (`qk_scale`
    = sm_scale * log2(e)); writes the partial output (normalized by its own row sum) and the partial
    lse in natural log, -inf for an empty partial. A paged cache whose pages hold whole key tiles
    (PAGE >= BLOCK_N, tiles starting at multiples of BLOCK_N) reads one table entry per tile; with
    smaller pages, one per key.

    FINAL (one split: nothing to merge) writes the call's own outputs instead, as the combine would:
    O_PART and LSE_PART are then `out` and `lse` (split stride 0), the sink applied (HAS_SINK), the lse
    stored only with RETURN_LSE. With PDL the combine's launch is allowed at once: its programs wait
    for this whole grid's writes (`gdc_wait`), so they only take the SM slots the split leaves."""
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0) // (h_kv // KV_HEADS)
    kv0 = (tl.program_id(0) % (h_kv // KV_HEADS)) * KV_HEADS
    split = tl.program_id(1)

    length = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), capacity)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(length - s_q - window + 1, 0)
        if PAGED:
            if PAGE >= BLOCK_N:
                lo = lo // BLOCK_N * BLOCK_N  # tiles stay inside pages; the window mask drops the extra keys
    start = lo + split * split_len
    end = tl.minimum(start + split_len, length)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token = offs_m // group
    head = kv0 * group + offs_m % group  # the query heads of the first kv head's rows
    row_ok = offs_m < s_q * group
    pos = length - s_q + token  # each row's absolute position (bottom-right aligned)
    d_ok = offs_d < HEAD_DIM
    q_rows = _per_head_rows(token * stride_qs + head * stride_qh, group * stride_qh, KV_HEADS)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + tl.expand_dims(q_rows, -1) + offs_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full(q_rows.shape, float("-inf"), tl.float32)
    l_i = tl.zeros(q_rows.shape, tl.float32)
    acc = tl.zeros(q.shape, tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + offs_n
        key_ok = keys < end
        if PAGED:
            if PAGE >= BLOCK_N:
                # The tile lies in one page: one table entry (below the length, so inside the table).
                block = tl.load(TABLE + b.to(tl.int64) * stride_tb + n0 // PAGE)
                block_ok = (block >= 0) & (block < num_blocks)
                key_ok = key_ok & block_ok
                block = tl.where(block_ok, block, 0).to(tl.int64)
                in_page = (n0 % PAGE + offs_n).to(tl.int64)
                k_row = block * stride_kb + in_page * stride_kn
                v_row = block * stride_vb + in_page * stride_vn
            else:
                # Only entries of positions below the length are read; an invalid block id masks its keys.
                block = tl.load(TABLE + b.to(tl.int64) * stride_tb + keys // PAGE, mask=key_ok, other=-1)
                key_ok = key_ok & (block >= 0) & (block < num_blocks)
                block = tl.where(key_ok, block, 0).to(tl.int64)
                k_row = block * stride_kb + (keys % PAGE) * stride_kn
                v_row = block * stride_vb + (keys % PAGE) * stride_vn
        else:
            k_row = b.to(tl.int64) * stride_kb + keys.to(tl.int64) * stride_kn
            v_row = b.to(tl.int64) * stride_vb + keys.to(tl.int64) * stride_vn
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv0 * stride_kh + _per_head_tile(k_row[:, None] + offs_d[None, :], stride_kh, KV_HEADS),
                    mask=kv_mask, other=0.0)
        v = tl.load(V + kv0 * stride_vh + _per_head_tile(v_row[:, None] + offs_d[None, :], stride_vh, KV_HEADS),
                    mask=kv_mask, other=0.0)
        s = _dot_keys(q, k, True) * qk_scale
        allowed = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (keys[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, -1))
        # Rows with no allowed key so far keep m = -inf: shift by 0 so exp2 gives 0 instead of NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - tl.expand_dims(shift, -1))
        alpha = tl.math.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, -1)
        acc = acc * tl.expand_dims(alpha, -1) + _dot_keys(p.to(v.dtype), v, False)
        m_i = m_new

    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    out = acc / tl.expand_dims(tl.where(empty, 1.0, l_i), -1)
    if FINAL:
        if HAS_SINK:
            sink = tl.load(SINK + _per_head_rows(head, group, KV_HEADS), mask=row_ok, other=0.0)
            out = out * tl.expand_dims(_sink_scale(lse, empty, sink), -1)
        lse = tl.where(empty, float("inf"), lse)
    o_rows = _per_head_rows(token * stride_os + head * stride_oh, group * stride_oh, KV_HEADS)
    tl.store(O_PART + b.to(tl.int64) * stride_ob + split * stride_op + tl.expand_dims(o_rows, -1) + offs_d,
             out.to(O_PART.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE or not FINAL:
        lse_rows = _per_head_rows(token * stride_ls + head * stride_lh, group * stride_lh, KV_HEADS)
        tl.store(LSE_PART + b.to(tl.int64) * stride_lb + split + lse_rows, lse, mask=row_ok)


@triton.jit
def _sink_scale(lse, empty, sink):
    """exp(L - logaddexp(L, sink)), the factor a sink leaves on outputs normalized over their keys
    (lse L in natural log); 0 for an empty row (its output is 0 whatever the sink) and for a sink of
    +inf."""
    finite = tl.where(empty, sink, lse)
    hi = tl.maximum(finite, sink)
    hi_safe = tl.where((hi == float("inf")) | (hi == float("-inf")), 0.0, hi)
    total = tl.math.exp2((finite - hi_safe) * LOG2E) + tl.math.exp2((sink - hi_safe) * LOG2E)
    scale = tl.math.exp2((finite - hi_safe) * LOG2E) / total
    return tl.where(empty | (hi == float("inf")), 0.0, scale)


@triton.jit
def _decode_combine_kernel(
    O_PART, LSE_PART, SINK, OUT, LSE,
    rows, s_q, h_q, num_splits,
    stride_ob, stride_os, stride_oh, stride_op,
    stride_lb, stride_ls, stride_lh,
    stride_outb, stride_outs, stride_outh,
    stride_rb, stride_rh, stride_rs,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    CHUNK: tl.constexpr, HAS_SINK: tl.constexpr, RETURN_LSE: tl.constexpr, PDL: tl.constexpr,
):
    """One program: ROWS (sequence, token, head) rows. L = logsumexp of the partial lse over the
    splits, L' = logaddexp(L, sink[h]) (or L), out = sum_s exp(lse_s - L') * o_s; the returned lse is L,
    +inf with out 0 where every split was empty (whatever the sink).

    The splits are merged online, CHUNK at a time (a running max of the lse rescales the sums, as in
    flash attention), so each chunk's lse and partial outputs are two independent loads: with CHUNK
    at least num_splits the whole merge waits on memory once. With PDL (Hopper's programmatic
    dependent launch) it is launched once every split program has started, and waits here for the
    split grid's writes."""
    if PDL:
        gdc_wait()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows
    b = (r // (s_q * h_q)).to(tl.int64)
    token = (r // h_q) % s_q
    head = r % h_q
    lse_row = LSE_PART + b * stride_lb + token * stride_ls + head * stride_lh
    o_row = O_PART + b * stride_ob + token * stride_os + head * stride_oh
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, CHUNK)
    d_ok = offs_d < HEAD_DIM
    m = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        split = s0 + offs_c
        split_ok = row_ok[:, None] & (split[None, :] < num_splits)
        lse_c = tl.load(lse_row[:, None] + split[None, :], mask=split_ok, other=float("-inf"))
        o = tl.load(o_row[:, None, None] + split[None, :, None] * stride_op + offs_d[None, None, :],
                    mask=split_ok[:, :, None] & d_ok[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_c, 1))
        # Rows with no non-empty split so far keep m = -inf: shift by 0 so the weights are 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.math.exp2((m - shift) * LOG2E)
        weight = tl.math.exp2((lse_c - shift[:, None]) * LOG2E)
        total = total * rescale + tl.sum(weight, 1)
        acc = acc * rescale[:, None] + tl.sum(weight[:, :, None] * o, 1)
        m = m_new
    empty = total == 0.0
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
    # acc holds sum_s exp(lse_s - m) * o_s: dividing by total normalizes it over every split's keys.
    scale = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    if HAS_SINK:
        scale *= _sink_scale(lse, empty, tl.load(SINK + head, mask=row_ok, other=0.0))
    acc = acc * scale[:, None]
    out_ptr = OUT + b[:, None] * stride_outb + token[:, None] * stride_outs + head[:, None] * stride_outh \
        + offs_d[None, :]
    tl.store(out_ptr, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        tl.store(LSE + b * stride_rb + head * stride_rh + token * stride_rs, tl.where(empty, float("inf"), lse),
                 mask=row_ok)


# ----------------------------------------------------------------------------- launchers
def rows_block(s_q: int, group: int) -> int:
    """BLOCK_M: the split kernel's rows per kv head, every token of every head of a GQA group."""
    return dot_block(s_q * group)


def heads_per_program(h_kv: int, kv_heads: int) -> int:
    """The kv heads one split program takes: the config's KV_HEADS (a power of two) cut down to the
    largest power of two dividing h_kv, so every program has only real heads."""
    return math.gcd(h_kv, kv_heads)


def key_range(capacity: int, s_q: int, window: int | None, align: int = 1) -> int:
    """The most keys one sequence's split programs walk: its capacity, or the window plus s_q - 1,
    plus align - 1 when the first key is rounded down to a multiple of `align`."""
    return capacity if window is None else min(capacity, window + s_q - 1 + align - 1)


def choose_splits(programs: int, reach: int, num_sms: int, block_n: int, waves: int) -> int:
    """The split count for `programs` (sequence, kv heads) pairs: about `waves` split programs per SM,
    rounded down or up to whichever fills its last wave of SMs better (ties: fewer splits). Equal-length
    programs finish together, so a partly filled last wave costs a whole one: 192 programs on 132 SMs
    take as long as 264. Never more splits than key tiles in the `reach` keys a sequence may need, at
    most MAX_SPLITS. Shapes and the device only: no cache_seqlens value is read."""
    return _splits_under(programs, max(1, min(cdiv(reach, block_n), MAX_SPLITS)), num_sms, waves)


@functools.cache  # on a new signature's host path: a growing cache changes the cap every block_n keys at most
def _splits_under(programs: int, cap: int, num_sms: int, waves: int) -> int:
    """`choose_splits` for a cap on the splits (the key tiles, at most MAX_SPLITS)."""
    wanted = waves * num_sms / programs

    def filled(splits: int) -> float:
        total = programs * splits
        return total / (cdiv(total, num_sms) * num_sms)

    options = {min(cap, max(1, math.floor(wanted))), min(cap, max(1, math.ceil(wanted)))}
    return max(sorted(options), key=filled)


@dataclass(frozen=True)
class DecodeLaunch:
    """What a call plan fixes for every launch: both roles' tiles and launch knobs, the device's SM count
    and whether the combine may start as a programmatic dependent of the split (NVIDIA Hopper and later:
    its launch then overlaps the split grid's tail), read out of the plan once (`DecodeSplitKVBase.bind`)
    instead of on every call; and the launch geometry of each call signature seen (`geometries`)."""

    block_n: int
    waves: int
    kv_heads: int
    rows: int
    chunk: int
    split_knobs: dict
    combine_knobs: dict
    num_sms: int
    pdl: bool
    # Call signature (shapes, strides, flags) -> _Geometry, so that a repeated call skips working it out;
    # and the same signature less the cache's capacity, with its split count and length -> the geometry
    # first made for it, so that a cache one key longer (every step of a growing cache) only replaces the
    # capacity in a known geometry.
    geometries: dict = field(default_factory=dict, compare=False, repr=False)
    by_splitting: dict = field(default_factory=dict, compare=False, repr=False)
    # The split partials' buffers of the last call per stream and thread (`_partials`).
    partials: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, plan: CallPlan) -> DecodeLaunch:
        split, combine, device = plan.config["split"], plan.config["combine"], plan.device
        pdl = device.vendor == "nvidia" and device.arch.startswith("sm_") and int(device.arch[3:]) >= 90
        return cls(split.blocks["BLOCK_N"], split.blocks["WAVES"], split.blocks["KV_HEADS"], combine.blocks["ROWS"],
                   combine.blocks["CHUNK"], split.knobs(), combine.knobs(), device.num_sms, pdl)


# Call signatures a plan keeps geometries for; past it they are dropped (a growing cache is a new shape
# every step).
MAX_GEOMETRIES = 256


class _Geometry(NamedTuple):
    """A call's launches less their tensors and sm_scale: output and workspace shapes, both kernels' grids,
    their scalar arguments after sm_scale (sizes, strides) and keyword arguments (constexprs, knobs), and
    the key each launch is signed with (`launch.signature_key`: a geometry with other scalars draws its
    own). A function of the call signature alone: every tensor it allocates is contiguous."""

    out_shape: tuple
    lse_shape: tuple | None
    part_shapes: tuple | None  # (partial outputs, partial lse); None: one split writes the outputs itself
    split_grid: tuple
    split_scalars: tuple
    split_kwargs: dict
    split_key: int
    combine_grid: tuple
    combine_scalars: tuple
    combine_kwargs: dict
    combine_key: int


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _splitting(plan: DecodeLaunch, q_shape, k_shape, table, window, num_splits) -> tuple[int, int | None, int, int]:
    """(capacity, the window capped at it, split count, keys per split) of one call signature: all of a
    geometry that the cache's capacity changes, but the capacity itself."""
    b, s_q = q_shape[0], 1 if len(q_shape) == 3 else q_shape[1]
    h_kv = k_shape[2]
    paged = table is not None
    page = k_shape[1] if paged else 1
    capacity = table[0][1] * page if paged else k_shape[1]
    # A window of at least the capacity masks nothing more than the capacity does: capped there, the
    # kernel's window arithmetic (length - s_q - window, pos - window) stays far inside int32.
    window = None if window is None else min(window, capacity)
    block_n = plan.block_n
    programs = b * (h_kv // heads_per_program(h_kv, plan.kv_heads))
    # Pages holding whole tiles: the kernel aligns a window's first tile down to a multiple of block_n.
    reach = key_range(capacity, s_q, window, block_n if paged and page >= block_n else 1)
    if num_splits is None:
        splits = choose_splits(programs, reach, plan.num_sms, block_n, plan.waves)
    else:  # splits past the key tiles would be empty (no result changes), and the grid's y is limited
        splits = min(num_splits, max(1, cdiv(reach, block_n)), MAX_SPLITS)
    return capacity, window, splits, cdiv(cdiv(reach, splits), block_n) * block_n


def _new_signature_geometry(plan: DecodeLaunch, signature: tuple) -> _Geometry:
    """The geometry of a call signature not seen before, kept in the plan: a known one with this capacity
    when the signature differs from one seen only in the cache's capacity and splits alike (its capacity
    is the split kernel's second scalar), else worked out (`_geometry`)."""
    q_shape, q_stride, k_shape, k_stride, v_stride, table, window, num_splits, return_lse, has_sinks = signature
    capacity, *splitting = _splitting(plan, q_shape, k_shape, table, window, num_splits)
    # A contiguous cache's capacity is its dim 1; a paged cache's dim 1 is its page size, which stays.
    pages = k_shape if table is not None else (k_shape[0], *k_shape[2:])
    less_capacity = (q_shape, q_stride, pages, k_stride, v_stride, table, num_splits, return_lse, has_sinks,
                     *splitting)
    geometries, by_splitting = plan.geometries, plan.by_splitting
    if len(geometries) >= MAX_GEOMETRIES:
        geometries.clear()
    known = by_splitting.get(less_capacity)
    if known is None:
        if len(by_splitting) >= MAX_GEOMETRIES:
            by_splitting.clear()
        geo = by_splitting[less_capacity] = _geometry(plan, *signature)
    else:
        # Only the split kernel's capacity changes; a new int may specialize otherwise, so a new key.
        scalars = known.split_scalars
        geo = known._replace(split_scalars=(scalars[0], capacity, *scalars[2:]), split_key=signature_key())
    geometries[signature] = geo
    return geo


def _geometry(plan: DecodeLaunch, q_shape, q_stride, k_shape, k_stride, v_stride, table, window, num_splits,
              return_lse: bool, has_sinks: bool) -> _Geometry:
    """The launch geometry of one call signature (`table`: the block table's (shape, row stride) or None)."""
    one_token = len(q_shape) == 3
    if one_token:
        (b, h_q, d), (sqb, sqh, _) = q_shape, q_stride
        s_q, q_strides = 1, (sqb, 0, sqh)
    else:
        (b, s_q, h_q, d), q_strides = q_shape, q_stride[:3]
    h_kv = k_shape[2]
    group = h_q // h_kv
    paged = table is not None
    page = k_shape[1] if paged else 1
    capacity, window, splits, split_len = _splitting(plan, q_shape, k_shape, table, window, num_splits)
    block_n = plan.block_n
    kv_heads = heads_per_program(h_kv, plan.kv_heads)
    programs = b * (h_kv // kv_heads)
    block_d = dot_block(d)
    pdl = plan.pdl
    out_shape = tuple(q_shape)
    lse_shape = ((b, h_q) if one_token else (b, h_q, s_q)) if return_lse else None
    so, sl = _contiguous_strides(out_shape), (_contiguous_strides(lse_shape) if return_lse else (0, 0, 0))
    out_strides = (so[0], 0, so[1]) if one_token else so[:3]
    lse_strides = (sl[0], sl[1], 0) if one_token else sl
    final = splits == 1
    if final:
        # Nothing to merge: the split program writes out and lse (laid out [b, h, s]) itself.
        part_shapes = None
        o_strides, lse_part_strides = (*out_strides, 0), (lse_strides[0], lse_strides[2], lse_strides[1])
    else:
        part_shapes = ((b, s_q, h_q, splits, d), (b, s_q, h_q, splits))
        o_strides = _contiguous_strides(part_shapes[0])[:4]
        lse_part_strides = _contiguous_strides(part_shapes[1])[:3]
    split_scalars = (window or 0, capacity, k_shape[0], s_q, group, h_kv, split_len, *q_strides, *k_stride[:3],
                     *v_stride[:3], table[1] if paged else 0, *o_strides, *lse_part_strides)
    split_kwargs = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=rows_block(s_q, group), BLOCK_N=block_n,
                        KV_HEADS=kv_heads, PAGED=paged, PAGE=page, HAS_WINDOW=window is not None, FINAL=final,
                        HAS_SINK=has_sinks, RETURN_LSE=return_lse, PDL=pdl and not final, **plan.split_knobs)
    rows, per_program = b * s_q * h_q, plan.rows
    combine_scalars = (rows, s_q, h_q, splits, *o_strides, *lse_part_strides, *out_strides, *lse_strides)
    combine_kwargs = dict(HEAD_DIM=d, BLOCK_D=block_d, ROWS=per_program, CHUNK=min(plan.chunk, next_pow2(splits)),
                          HAS_SINK=has_sinks, RETURN_LSE=return_lse, PDL=pdl,
                          **({"launch_pdl": True} if pdl else {}), **plan.combine_knobs)
    return _Geometry(out_shape, lse_shape, part_shapes, (programs, splits), split_scalars, split_kwargs,
                     signature_key(), (cdiv(rows, per_program),), combine_scalars, combine_kwargs, signature_key())


# (stream, thread) pairs a plan keeps partials' buffers for; past it they are dropped (each pair holds
# one call's partials, a few MB at most at serving shapes).
MAX_PARTIALS = 16
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _partials(plan: DecodeLaunch, shapes: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 buffers the split kernel writes its partial outputs and lse into and the combine reads
    them from. Two allocations a call were a fifth of a decode step's host time, so the last call's
    buffers of these shapes are taken again when the call runs on the same stream from the same thread:
    the stream orders this call's split after the last call's combine, and one thread's launches are
    never interleaved with another's between the two. A call where buffers may not be kept
    (`core.workspace.keep_workspace`: during a CUDA-graph capture, or a compiled graph's custom-op call)
    gets buffers of its own."""
    if not keep_workspace(device) or (device.type == "cuda" and _current_raw_stream is None):
        return (torch.empty(shapes[0], device=device, dtype=torch.float32),
                torch.empty(shapes[1], device=device, dtype=torch.float32))
    # On a GPU the device too: every device's default stream is the null stream, and a plan serves every
    # GPU of its kind.
    key = ((device, threading.get_ident()) if device.type != "cuda"
           else (device.index, _current_raw_stream(device.index), threading.get_ident()))
    kept = plan.partials.get(key)
    if kept is not None and kept[0] == shapes:
        return kept[1], kept[2]
    if len(plan.partials) >= MAX_PARTIALS:
        plan.partials.clear()
    o_part = torch.empty(shapes[0], device=device, dtype=torch.float32)
    lse_part = torch.empty(shapes[1], device=device, dtype=torch.float32)
    plan.partials[key] = (shapes, o_part, lse_part)
    return o_part, lse_part


def decode_forward(args: dict, plan: DecodeLaunch, launch: Callable[..., Any] = triton_launch):
    """Run the split and combine kernels on the decode contract's validated args: `out`, or
    `(out, lse)` with `return_lse`. Outputs are allocated here, the split partials come from
    `_partials` (a CUDA graph captures both with the launches). A 3-D q (one token) is passed with
    a token stride of 0 and its outputs are allocated 3-D: no view is made, each would cost a
    microsecond of host time. `launch` runs each kernel: Triton's own launch, or a dispatch plan's
    `LaunchCache`. The launch geometry comes from the plan's geometries when this call signature was
    seen before."""
    q, k_cache, v_cache, table = args["q"], args["k_cache"], args["v_cache"], args["block_table"]
    sinks, return_lse, seqlens = args["sinks"], args["return_lse"], args["cache_seqlens"]
    paged = table is not None
    signature = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
                 (table.shape, table.stride(0)) if paged else None, args["window"], args["num_splits"], return_lse,
                 sinks is not None)
    geo = plan.geometries.get(signature)
    if geo is None:
        geo = _new_signature_geometry(plan, signature)
    device = q.device
    out = torch.empty(geo.out_shape, device=device, dtype=q.dtype)
    lse = None if geo.lse_shape is None else torch.empty(geo.lse_shape, device=device, dtype=torch.float32)
    if geo.part_shapes is None:
        o_part, lse_part = out, (lse if lse is not None else out)
    else:
        o_part, lse_part = _partials(plan, geo.part_shapes, device)
    # A LaunchCache launches both kernels by the geometry's keys: with the plan's tuning key (its dtype)
    # the call signature fixes every argument's type and every scalar and constexpr the geometry holds.
    launch_signed(launch, geo.split_key, _decode_split_kernel, geo.split_grid,
                  (q, k_cache, v_cache, seqlens, table if paged else seqlens, o_part, lse_part,
                   sinks if sinks is not None else lse_part, float(args["sm_scale"]) * LOG2E.value, *geo.split_scalars),
                  geo.split_kwargs)
    if geo.part_shapes is not None:
        launch_signed(launch, geo.combine_key, _decode_combine_kernel, geo.combine_grid,
                      (o_part, lse_part, sinks if sinks is not None else lse_part, out,
                       lse if lse is not None else lse_part, *geo.combine_scalars), geo.combine_kwargs)
    return (out, lse) if lse is not None else out


# ----------------------------------------------------------------------------- the variant
# The interpreter's block shapes of the split kernel, both vendors (the default first): with pages of 16
# the first reads one table entry per tile and the second one per key; the second takes two kv heads.
INTERPRETER_SPLIT = ({"BLOCK_N": 16, "WAVES": 2, "KV_HEADS": 1}, {"BLOCK_N": 32, "WAVES": 1, "KV_HEADS": 2})


def key_rows_between(low: int, high: int) -> Keep:
    """A `keep` predicate for the split space: KV_HEADS divides the key's h_kv (a larger value would be
    cut down to a config already in the space); a step's key rows, KV_HEADS * BLOCK_N, are in
    [low, high] (fewer leave the loads short, more only add registers and shared memory); and with
    several kv heads, num_warps <= KV_HEADS (a batched dot's warps go to the heads: more warps would
    repeat the same products)."""

    def key_rows(config: LaunchConfig, key: Mapping) -> bool:
        heads, block_n = config.blocks["KV_HEADS"], config.blocks["BLOCK_N"]
        return (key["h_kv"] % heads == 0 and low <= heads * block_n <= high
                and (heads == 1 or config.num_warps <= heads))

    key_rows.__name__ = f"key_rows_between_{low}_{high}"
    return key_rows


def combine_tile_fits(config: LaunchConfig, key: Mapping) -> bool:
    """A `keep` predicate for the combine space: a chunk's partial outputs, ROWS * CHUNK * d fp32
    values, are at most 128 per thread of 32-lane warps (a larger tile only spills)."""
    return config.blocks["ROWS"] * config.blocks["CHUNK"] * dot_block(key["d"]) <= 128 * 32 * config.num_warps


# The combine kernel is a few hundred bytes per row on either vendor: one space for both. CHUNK is cut to
# the call's split count (rounded up to a power of two), so a wide CHUNK merges few splits in one load.
COMBINE_SPACE = ConfigSpace(
    blocks={"ROWS": (1, 2, 4), "CHUNK": (4, 8, 16, 32, 64)},
    knobs={"num_warps": (1, 2, 4)},
    keep=combine_tile_fits,
    defaults={"*": {"ROWS": 1, "CHUNK": 32, "num_warps": 2}},
    interpreter=({"ROWS": 2, "CHUNK": 4}, {"ROWS": 1, "CHUNK": 8}),
)


class DecodeSplitKVBase:
    """The split-KV variant's logic; each vendor file subclasses it with `Variant` and sets `spaces`:
    "split" (blocks BLOCK_N, the key tile, WAVES, the split programs per SM that num_splits aims for,
    and KV_HEADS, the kv heads per program) and "combine" (COMBINE_SPACE: blocks ROWS, the rows per
    program, and CHUNK, the splits per load)."""

    op = "decode"
    name = "decode_splitkv"
    kernels = {"split": _decode_split_kernel, "combine": _decode_combine_kernel}

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16")

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        if role != "split" or device.key == "cpu":
            return None
        # K and V tiles of every kv head in flight per stage, next to Q; 16-bit elements.
        block_d = dot_block(key["d"])
        rows = rows_block(key["s_q"], key["h_q"] // key["h_kv"])
        heads = heads_per_program(key["h_kv"], config.blocks["KV_HEADS"])
        need = 2 * block_d * heads * (rows + 2 * config.blocks["BLOCK_N"] * max(1, config.num_stages - 1))
        if need > device.shared_mem_bytes:
            return f"needs ~{need} B of shared memory/LDS (> {device.shared_mem_bytes})"
        return None

    def launch(self, args: dict, plan: CallPlan):
        return decode_forward(args, DecodeLaunch.of(plan))

    def bind(self, plan: CallPlan):
        fixed = DecodeLaunch.of(plan)
        return lambda args: decode_forward(args, fixed)

    def bind_cached(self, plan: CallPlan):
        fixed, launches = DecodeLaunch.of(plan), LaunchCache()
        return lambda args: decode_forward(args, fixed, launches)
