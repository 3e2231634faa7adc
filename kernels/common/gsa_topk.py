"""GSA's fused top-k: each query's k best keys under the indexer scores, never the [b, t, t] scores.
The Triton kernel body both vendors share (version 2: a radix select that recomputes the scores).

Design. One program owns BLOCK_Q queries of one batch row at a time and streams their causal key blocks
through the indexer math (`kernels.common.gsa_indexer._gated_scores_by_key`: one dot for every index
head, gating in registers, the tile [keys, queries] so that its head sum stays in-thread) a few
times, keeping no scores, only counts:

- Keys. Every score s lies in [0, G], G the query's sum of gates sigmoid(w[h]). With C = G (1 +
  2^-18) (above G by more than the roundings of s), the bits u of the float s + C are an int32 in
  [bits(C), bits(C) + 2^23) (bits(2C) = bits(C) + 2^23) that never decreases as s grows (rounding is
  monotone; a positive float's bits order like its value), about linear in s and as fine as the
  floats near C: two scores closer than that tie. Selection works on u alone.
- Brackets. Each query keeps a bracket [lo, lo + 2^wbits) of u that holds its n-th best key (n =
  min(k, i + 1, topk_length)), the count `above` of its keys beyond the bracket (< n) and the count
  `inside` of keys in it (above + inside >= n). It starts as [bits(C), bits(C) + 2^23).
- Counting passes narrow the bracket 16-fold: every key in it adds one to its bin of 16 (two int32
  words of eight 4-bit counters per key position, summed over the key positions every FLUSH blocks,
  so a key costs about a dozen integer operations), and the bin holding the n-th best becomes the
  bracket. The first pass always runs (cheaper than a list select over all of a row's keys); more
  run only while some bracket holds more than CAP keys.
- The emit pass writes each query's keys beyond its bracket (fewer than n) and the keys in it (at
  most CAP) to its list in a global workspace, int64 entries u << 32 | key id; when the bracket is one
  value (ties) or holds exactly what is missing, only its first keys in stream order.
- The list select narrows the bracket the same way over the list (a few reads of <= CAP entries),
  until it is one value or holds exactly what is missing. The keys beyond the first bracket, those
  beyond the final one, then the final one's first missing keys fill slots 0..n-1; -1 the rest.
- Positions come from per-query prefix sums within a block (two counts packed in one int32 cumsum),
  so a program owning its queries needs no atomics for them. Counting and emitting are one loop (a
  branch on the pass), so every pass computes the same scores bit for bit, which the counts rely on.

Random scores need one counting pass: 16 bins over [0, G] leave up to ~15% of a row's keys in the
boundary bin at T 32768 and k 2048 (a few thousand), under CAP = 3 max(k', BLOCK_K) (k' = min(k, t));
so a row costs two streams of its keys and a list select. Scores crowded into a narrow range cost one
more stream per 16-fold.

Grid: WAVES persistent programs per SM, each with its own list slot (so the workspace, BLOCK_Q (k' +
CAP) entries per program, does not grow with t); query blocks are dealt heaviest first (the last
blocks of every batch row, then earlier ones) through an atomic counter, which balances the causal
triangle.

Reads top-down: the counting helpers, the placement helpers, the kernel, its launcher, compile specs,
the variant's logic. Semantics: `ops.gsa_topk.reference`; a tie may break either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kreg.core.nvtx import nvtx_range
from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.gsa_indexer import (
    _gated_scores_by_key,
    _load_index_keys,
    _load_index_queries_by_head,
    accumulator_reason,
    index_tiles,
)
from kreg.kernels.common.tiles import cdiv, next_pow2
from kreg.ops.variant import CallPlan

BINS = tl.constexpr(16)  # bins per counting step: two int32 words of eight 4-bit counters
LOG_BINS = tl.constexpr(4)
KEY_BITS = tl.constexpr(23)  # the first bracket of a query: [bits(C), bits(C) + 2^23)
TOP_BITS = tl.constexpr((1 << 23) - 1)  # its last value, as an offset from bits(C)
ABOVE_G = tl.constexpr(1.0 + 2.0**-18)  # C / G
# Steps (key blocks or list tiles) between two flushes of the 4-bit counters, at most 15: each counts
# at most one key per step; a flush sums them over <= 256 positions in 16-bit fields (15 * 256 < 2^16).
# Tests lower it to cover several flushes on short rows.
FLUSH_STEPS = 15


# ----------------------------------------------------------------------------- counting helpers
# Tiles are [keys, queries] (the score tile's orientation, `_gated_scores_by_key`); per-query state is
# a [queries] vector, and what the inner loops compare against is broadcast to a tile before them.
@triton.jit
def _tally(u, lo, width, shift, a0, a1):
    """Count each key u ([n, queries] int32; < 0 for none) that lies in its query's bracket [lo, lo +
    width) in one of BINS bins (bin (u - lo) >> shift): bin j adds one to the 4-bit field j % 8 of word
    a(j // 8) at the key's position (lo, width (uint32) and shift are tiles like u). Returns the words."""
    d = u - lo
    inside = d.to(tl.uint32, bitcast=True) < width
    bin = d >> shift
    one = tl.where(inside, 1 << ((bin & 7) * 4), 0)
    a0 += tl.where(bin < 8, one, 0)
    a1 += tl.where(bin < 8, 0, one)
    return a0, a1


@triton.jit
def _word_counts(a, j: tl.constexpr, offs, BLOCK_Q: tl.constexpr):
    """Word a(j) of `_tally` summed over the key positions: [queries, BINS] counts, zero outside bins
    8j..8j+7. Counters p and p + 4 are summed together, one in each 16-bit half."""
    out = tl.zeros([BLOCK_Q, BINS], tl.int32)
    for p in tl.static_range(4):
        pair = tl.sum((a >> (4 * p)) & 0x000F000F, 0)
        out += tl.where(offs[None, :] == 8 * j + p, (pair & 0xFFFF)[:, None], 0)
        out += tl.where(offs[None, :] == 8 * j + 4 + p, (pair >> 16)[:, None], 0)
    return out


@triton.jit
def _unpack(a0, a1, BLOCK_Q: tl.constexpr):
    """The [BLOCK_Q, BINS] int32 counts held by `_tally`'s two words."""
    offs = tl.arange(0, BINS)
    return _word_counts(a0, 0, offs, BLOCK_Q) + _word_counts(a1, 1, offs, BLOCK_Q)


@triton.jit
def _narrow(counts, lo, wbits, above, inside, n, active):
    """Queries in `active`: the bracket becomes the bin of `counts` ([queries, BINS], the keys in each
    bin of the bracket) that holds the query's n-th best key: the highest bin j with above + (keys in
    bins >= j) >= n. Returns the new (lo, wbits, above, inside); other queries keep theirs."""
    offs = tl.arange(0, BINS)
    suffix = tl.sum(counts, 1)[:, None] - tl.cumsum(counts, 1) + counts
    reach = above[:, None] + suffix >= n[:, None]
    j = tl.maximum(tl.max(tl.where(reach, offs[None, :], -1), 1), 0)
    here = offs[None, :] == j[:, None]
    in_j = tl.sum(tl.where(here, counts, 0), 1)
    past = tl.sum(tl.where(here, suffix, 0), 1) - in_j
    shift = tl.maximum(wbits - LOG_BINS, 0)
    return (tl.where(active, lo + (j << shift), lo), tl.where(active, shift, wbits),
            tl.where(active, above + past, above), tl.where(active, in_j, inside))


@triton.jit
def _bracket_tiles(lo, wbits, ROWS: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(lo, width as uint32, bin shift) of each query's bracket as [ROWS, BLOCK_Q] tiles."""
    width = (1 << wbits).to(tl.uint32, bitcast=True)
    return (tl.broadcast_to(lo[None, :], [ROWS, BLOCK_Q]), tl.broadcast_to(width[None, :], [ROWS, BLOCK_Q]),
            tl.broadcast_to(tl.maximum(wbits - LOG_BINS, 0)[None, :], [ROWS, BLOCK_Q]))


@triton.jit
def _list_counts(lists, rows, listed, lo, wbits,
                 BLOCK_Q: tl.constexpr, TILE: tl.constexpr, FLUSH: tl.constexpr):
    """`_tally` over each query's list (int64 entries u << 32 | key id at lists + rows, rows [1, queries]
    offsets, `listed` of them): [queries, BINS] counts."""
    offs = tl.arange(0, TILE)
    end = tl.max(listed)
    lo_t, width_t, shift_t = _bracket_tiles(lo, wbits, TILE, BLOCK_Q)
    counts = tl.zeros([BLOCK_Q, BINS], tl.int32)
    for c0 in range(0, end, FLUSH * TILE):
        a0 = tl.zeros([TILE, BLOCK_Q], tl.int32)
        a1 = tl.zeros([TILE, BLOCK_Q], tl.int32)
        for x0 in range(c0, tl.minimum(c0 + FLUSH * TILE, end), TILE):
            slots = x0 + offs
            entry = tl.load(lists + (rows + slots[:, None]), mask=slots[:, None] < listed[None, :], other=-1)
            a0, a1 = _tally((entry >> 32).to(tl.int32), lo_t, width_t, shift_t, a0, a1)
        counts += _unpack(a0, a1, BLOCK_Q)
    return counts


# ----------------------------------------------------------------------------- placement
@triton.jit
def _ranks(u, lo, width, run_a, run_i):
    """Keys u ([r, queries]; u < 0 for none) against their query's bracket [lo, lo + width) (tiles like
    u; width uint32): (beyond, inside, rank among the keys beyond it so far, rank among those in it so
    far, counts of both in u) with the ranks from run_a and run_i."""
    d = u - lo
    inside = d.to(tl.uint32, bitcast=True) < width
    beyond = (d >= 0) & ~inside
    # Both running counts in one prefix sum: a block holds fewer than 2^16 keys.
    packed = beyond.to(tl.int32) + (inside.to(tl.int32) << 16)
    prefix = tl.cumsum(packed, 0)
    total = tl.sum(packed, 0)
    return (beyond, inside, run_a[None, :] + (prefix & 0xFFFF) - 1, run_i[None, :] + (prefix >> 16) - 1,
            total & 0xFFFF, total >> 16)


@triton.jit
def _emit(u, ids, lo, width, run_a, run_i, keep, lists, rows, kk):
    """The emit pass on one key block: each key beyond its query's bracket goes to list entry run_a,
    run_a + 1, ... (< kk), the r-th key in it so far to entry kk + r if r < keep (a tile); entries are
    u << 32 | id at lists + rows (rows [1, queries] offsets). Returns (run_a, run_i) advanced."""
    beyond, inside, rank_a, rank_i, count_a, count_i = _ranks(u, lo, width, run_a, run_i)
    slot = tl.where(beyond, rank_a, kk + rank_i)
    fits = tl.where(beyond, rank_a < kk, inside & (rank_i < keep))
    tl.store(lists + (rows + slot), (u.to(tl.int64) << 32) | ids.to(tl.int64), mask=fits)
    return run_a + count_a, run_i + count_i


@triton.jit
def _settle(u, ids, lo, width, run_a, run_i, above, need, out, rows, n):
    """Bracket entries of the list to the output: each key beyond the (narrowed) bracket goes to output
    slot run_a, run_a + 1, ...; the r-th key in it to slot above + r if r < need (slots at out + rows, rows
    [1, queries] offsets). Returns (run_a, run_i) advanced."""
    beyond, inside, rank_a, rank_i, count_a, count_i = _ranks(u, lo, width, run_a, run_i)
    slot = tl.where(beyond, rank_a, above[None, :] + rank_i)
    chosen = beyond | (inside & (rank_i < need[None, :]))
    tl.store(out + (rows + slot), ids, mask=chosen & (slot < n[None, :]))
    return run_a + count_a, run_i + count_i


# ----------------------------------------------------------------------------- the kernel
@triton.jit
def _gsa_topk_radix_kernel(
    Q, K, W, BIAS, TOPK_LEN, OUT, LISTS, NEXT,
    t, h_i, d_i, k, qk_scale2, n_batch, q_blocks, cap,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt,
    stride_wb, stride_wt,
    stride_lb, stride_lt,
    stride_ob, stride_ot,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, H_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, FLUSH: tl.constexpr, HAS_TOPK_LEN: tl.constexpr,
):
    """One persistent program: query blocks program_id(0), then those the counter NEXT deals out (block
    index + num_programs; blocks ordered last query block of every batch row first), each BLOCK_Q
    queries of one batch row: counting passes and an emit pass over their causal keys, a select over
    the list slot program_id(0) (LISTS [programs, BLOCK_Q, min(k, t) + cap], int64 entries u << 32 |
    key id); writes each query's n = min(k, i + 1, topk_length) best key ids, then -1 up to k."""
    pid = tl.program_id(0)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_k = tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, TILE)
    kk = tl.minimum(k, t)  # list entries 0..kk-1 hold keys beyond the bracket (fewer than n <= kk)
    span = kk + cap  # then up to cap keys of the bracket
    lists = LISTS + pid.to(tl.int64) * BLOCK_Q * span
    list_rows = (offs_q * span)[None, :]
    total = n_batch * q_blocks
    block = pid
    while block < total:
        b = (block % n_batch).to(tl.int64)
        q0 = (q_blocks - 1 - block // n_batch) * BLOCK_Q
        rows = q0 + offs_q
        row_ok = rows < t
        last = tl.where(row_ok, rows, -1)  # the last key a query may pick (none past t)
        diagonal = q0 - BLOCK_K + 2  # key blocks from here on hold a key past some query
        n = tl.minimum(rows + 1, k)
        if HAS_TOPK_LEN:
            length = tl.load(TOPK_LEN + b * stride_lb + rows.to(tl.int64) * stride_lt, mask=row_ok, other=0)
            n = tl.minimum(n, tl.maximum(length, 0))
        n = tl.where(row_ok, n, 0)
        out = OUT + b * stride_ob + q0.to(tl.int64) * stride_ot
        out_rows = (offs_q * stride_ot)[None, :]
        q, gate, bias2 = _load_index_queries_by_head(Q, W, BIAS, b, q0, t, h_i, d_i, stride_qb, stride_qt,
                                                     stride_qh, stride_wb, stride_wt, BLOCK_Q, H_PAD, BLOCK_D)
        # C: s + C < 2C whatever the roundings in s (module docstring).
        offset = tl.sum(tl.reshape(gate, [H_PAD, BLOCK_Q]), 0) * ABOVE_G
        # NaN or inf gates bound no score: any finite C keeps every key's bits in the first bracket.
        offset = tl.where(tl.abs(offset) < float("inf"), offset, 1.0)
        floor = offset.to(tl.int32, bitcast=True)[None, :]
        kend = tl.where(tl.max(n) > 0, tl.minimum(q0 + BLOCK_Q, t), 0)

        lo = offset.to(tl.int32, bitcast=True)
        wbits = tl.full([BLOCK_Q], KEY_BITS, tl.int32)
        above = tl.zeros([BLOCK_Q], tl.int32)
        inside = tl.where(row_ok, rows + 1, 0)
        refine = (n > 0) & (n < inside)
        direct = refine
        keep = tl.zeros([BLOCK_Q], tl.int32)
        run_a = tl.zeros([BLOCK_Q], tl.int32)
        run_i = tl.zeros([BLOCK_Q], tl.int32)
        busy = 1
        while busy > 0:
            emit = tl.max(refine.to(tl.int32)) == 0
            need = n - above
            # The emit pass keeps all of a bracket's keys in the list, or only the first `need` when
            # the bracket is one value (ties) or holds exactly what is missing.
            direct = (need <= 0) | (need >= inside) | (wbits == 0)
            keep = tl.where(direct, tl.maximum(need, 0), cap)
            keep_t = tl.broadcast_to(keep[None, :], [BLOCK_K, BLOCK_Q])
            lo_t, width_t, shift_t = _bracket_tiles(lo, wbits, BLOCK_K, BLOCK_Q)
            run_a = tl.zeros([BLOCK_Q], tl.int32)
            run_i = tl.zeros([BLOCK_Q], tl.int32)
            counts = tl.zeros([BLOCK_Q, BINS], tl.int32)
            for c0 in range(0, kend, FLUSH * BLOCK_K):
                a0 = tl.zeros([BLOCK_K, BLOCK_Q], tl.int32)
                a1 = tl.zeros([BLOCK_K, BLOCK_Q], tl.int32)
                for k0 in range(c0, tl.minimum(c0 + FLUSH * BLOCK_K, kend), BLOCK_K):
                    keys = _load_index_keys(K, b, k0, t, d_i, stride_kb, stride_kt, BLOCK_K, BLOCK_D)
                    scores = _gated_scores_by_key(keys, q, gate, bias2, qk_scale2, BLOCK_Q, H_PAD, BLOCK_K)
                    u = (scores + offset[None, :]).to(tl.int32, bitcast=True)
                    # Scores of NaN or inf inputs stay in the first bracket (a NaN at one end, by its
                    # sign bit): every key a query may pick is counted once, so every slot up to n gets
                    # a key.
                    u = tl.minimum(tl.maximum(u, floor), floor + TOP_BITS)
                    if k0 >= diagonal:
                        u = tl.where(offs_k[:, None] <= (last - k0)[None, :], u, -1)
                    # One loop for both kinds of pass, so that every pass computes the same scores.
                    if emit:
                        ids = tl.broadcast_to((k0 + offs_k)[:, None], [BLOCK_K, BLOCK_Q])
                        run_a, run_i = _emit(u, ids, lo_t, width_t, run_a, run_i, keep_t, lists, list_rows, kk)
                    else:
                        a0, a1 = _tally(u, lo_t, width_t, shift_t, a0, a1)
                counts += _unpack(a0, a1, BLOCK_Q)
            if emit:
                busy = 0
            else:
                lo, wbits, above, inside = _narrow(counts, lo, wbits, above, inside, n, refine)
                need = n - above
                refine = (need > 0) & (need < inside) & (inside > cap) & (wbits > 0)

        # The list select: queries whose bracket went to the list narrow it over the list's entries.
        emitted = run_a  # = above: keys beyond the bracket, list entries 0..emitted-1
        listed = tl.minimum(run_i, keep)  # bracket keys, list entries kk..kk+listed-1
        tl.debug_barrier()  # every list entry is visible to every thread
        need = n - above
        refine = ~direct & (need < inside) & (wbits > 0)
        while tl.max(refine.to(tl.int32)) > 0:
            counts = _list_counts(lists + kk, list_rows, listed, lo, wbits, BLOCK_Q, TILE, FLUSH)
            lo, wbits, above, inside = _narrow(counts, lo, wbits, above, inside, n, refine)
            need = n - above
            refine = ~direct & (need < inside) & (wbits > 0)
        for s0 in range(0, tl.max(emitted), TILE):
            slots = (s0 + offs_t)[:, None]
            beyond = (slots < emitted[None, :]) & (slots < n[None, :])
            entry = tl.load(lists + (list_rows + slots), mask=beyond, other=-1)
            tl.store(out + (out_rows + slots), entry.to(tl.int32), mask=beyond)
        # The bracket's keys beyond its final (narrowed) range, then the first `need` in it.
        lo_t, width_t, shift_t = _bracket_tiles(lo, wbits, TILE, BLOCK_Q)
        run_a = emitted
        run_i = tl.zeros([BLOCK_Q], tl.int32)
        for x0 in range(0, tl.max(listed), TILE):
            slots = (x0 + offs_t)[:, None]
            entry = tl.load(lists + kk + (list_rows + slots), mask=slots < listed[None, :], other=-1)
            run_a, run_i = _settle((entry >> 32).to(tl.int32), entry.to(tl.int32), lo_t, width_t, run_a, run_i,
                                   above, need, out, out_rows, n)

        first = tl.min(tl.where(row_ok, n, k)) // TILE * TILE
        for s0 in range(first, k, TILE):
            slots = s0 + offs_t
            tail = row_ok[None, :] & (slots[:, None] >= n[None, :]) & (slots[:, None] < k)
            tl.store(out + (out_rows + slots[:, None]), tl.full([TILE, BLOCK_Q], -1, tl.int32), mask=tail)
        tl.debug_barrier()  # the next query block reuses the list slot
        block = tl.atomic_add(NEXT, 1) + tl.num_programs(0)


# ----------------------------------------------------------------------------- launcher
def list_capacity(k: int, t: int, block_k: int) -> int:
    """CAP: the most keys of a bracket a query's list holds, three times the most it selects (min(k, t))
    and at least three key blocks: after one counting pass random scores leave up to ~3 k' in the
    boundary bin at T 32768 (more would cost another counting pass)."""
    return 3 * max(min(k, t), block_k)


def gsa_topk_forward(args: dict, config: CallConfig, num_sms: int) -> torch.Tensor:
    """Launch the fused top-k on validated arguments (ops.gsa_topk's dict): indices [b, t, k] int32, in
    at most WAVES persistent programs per SM of the device (`num_sms`). The workspace (a list of CAP
    int64 entries per query of each program, and the block counter) is allocated here."""
    q, k_idx, w, bias, k = args["q_idx"], args["k_idx"], args["w"], args["bias"], args["k"]
    lengths = args["topk_length"]
    b, t, h_i, d_i = q.shape
    h_pad, block_d = index_tiles(h_i, d_i)
    role = config["fwd"]
    blocks = role.blocks
    block_q = blocks["BLOCK_Q"]
    q_blocks = cdiv(t, block_q)
    programs = min(b * q_blocks, blocks["WAVES"] * num_sms)
    cap = list_capacity(k, t, blocks["BLOCK_K"])
    # The kernel offsets a query block's output rows and lists in int32 (the contract's k <= 2**24
    # keeps both far below 2**31 at every BLOCK_Q of the spaces).
    if block_q * max(k, min(k, t) + cap) >= 2**31:
        raise ValueError(f"k: {k} is too large for gsa_topk_radix's int32 offsets (BLOCK_Q {block_q})")
    out = torch.empty((b, t, k), device=q.device, dtype=torch.int32)
    lists = torch.empty((programs, block_q, min(k, t) + cap), device=q.device, dtype=torch.int64)
    counter = torch.zeros(1, device=q.device, dtype=torch.int32)
    with nvtx_range("gsa/topk_kernel"):
        _gsa_topk_radix_kernel[(programs,)](
            q, k_idx, w, bias, lengths if lengths is not None else out, out, lists, counter,
            t, h_i, d_i, k, float(args["sm_scale"]) * LOG2E.value, b, q_blocks, cap,
            *q.stride()[:3], *k_idx.stride()[:2], *w.stride()[:2],
            *(lengths.stride() if lengths is not None else (0, 0)), *out.stride()[:2],
            BLOCK_Q=block_q, BLOCK_K=blocks["BLOCK_K"], H_PAD=h_pad, BLOCK_D=block_d, TILE=blocks["TILE"],
            FLUSH=FLUSH_STEPS, HAS_TOPK_LEN=lengths is not None, **role.knobs(),
        )
    return out


# ----------------------------------------------------------------------------- the variant
class GSATopkRadixBase:
    """The fused top-k variant's logic; each vendor file subclasses it with `Variant` and sets `spaces`
    ("fwd": blocks BLOCK_Q, queries per program; BLOCK_K, keys per streamed block; TILE, list entries
    per step of the list select and of the -1 fill; WAVES, persistent programs per SM) and ACC_REGS_LIMIT
    (fp32 score-tile registers per thread above which it spills)."""

    op = "gsa_topk"
    name = "gsa_topk_radix"
    kernels = {"fwd": _gsa_topk_radix_kernel}
    ACC_REGS_LIMIT = 128

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d_i"] <= 256 and key["h_i"] <= 64

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        if device.key == "cpu":
            return None
        rows = config.blocks["BLOCK_Q"] * next_pow2(key["h_i"])
        return accumulator_reason(rows, config.blocks["BLOCK_K"], config, device, self.ACC_REGS_LIMIT)

    def launch(self, args: dict, plan: CallPlan) -> torch.Tensor:
        return gsa_topk_forward(args, plan.config, plan.device.num_sms)

    def bind(self, plan: CallPlan):
        config, num_sms = plan.config, plan.device.num_sms
        return lambda args: gsa_topk_forward(args, config, num_sms)


# The interpreter's block shapes, both vendors (the default first): 16-key blocks keep CAP (3 max(k',
# 16)) small next to the test rows, so lists narrow over several steps and crowded scores take several
# counting passes.
INTERPRETER_TOPK = ({"BLOCK_Q": 16, "BLOCK_K": 16, "TILE": 16, "WAVES": 1},
                    {"BLOCK_Q": 16, "BLOCK_K": 32, "TILE": 32, "WAVES": 2})
