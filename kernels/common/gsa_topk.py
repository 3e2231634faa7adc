"""GSA's fused top-k: each query's k best keys under the indexer scores, streamed, never the [b, t, t]
scores. The Triton kernel body both vendors share.

Design. k is up to 2048 (more works, only slower), far too many to keep sorted in registers, so a
program keeps a per-query candidate list in a global workspace and a threshold that only rises:

- One program owns BLOCK_Q queries of one batch row at a time and streams their causal key blocks
  through the indexer math (`kernels.common.gsa_indexer._gated_scores`: one dot for every index head,
  gating in registers). Scores become int32 keys with the same order, so selection is integer
  compares.
- Streaming pass: a key whose score beats its query's threshold `tau` is appended to the query's list
  (positions from a prefix sum over the block, so a block is one masked scatter; a block with no
  candidate stores nothing). The list holds CAP >= n + BLOCK_K entries, n the query's count
  min(k, i + 1, topk_length[i]).
- When a block would overflow some list, the lists are compacted (`_compact`): a threshold search over
  the int keys, each step counting per row the list entries >= its probe, finds a cut with between n
  and CAP - BLOCK_K entries at or above it; they stay, packed to the front, and tau rises to just
  below the cut. Everything dropped is <= tau and the list keeps at least n entries > tau, so the
  top n of (list + keys still to come) is the query's answer. Probes interpolate where the count
  would reach its aim inside that window (a step bisects instead when the last one did not halve the
  range), so a mid-stream compaction usually costs one or two counting passes over the list. When
  more than the window's worth of entries tie, the search closes on the tied key v: the entries > v
  and the first ties at v up to n stay, and tau becomes v.
- A mid-stream compaction leaves at most CAP - BLOCK_K entries, so the next block always fits, and
  aims a quarter into the window, freeing most of the list (CAP = 2 * max(k', BLOCK_K), k' = min(k,
  t)): on typical data few keys pass the threshold once a few thousand have streamed by, and a query
  needs a few compactions; scores that keep rising with position make it one compaction every few
  blocks, still exact.
- A last compaction with the window [n, n] leaves exactly n entries (ties broken by list order); their
  key ids go to the output, -1 after them.

Why not a histogram of the scores first and a second streaming pass that emits what beats its
threshold: the stream itself (a dot and two MUFU operations per index head and pair) is what costs, a
second pass doubles it, and a threshold from bins still needs an exact select inside the boundary bin.
The lists cost a few L2 reads per compaction instead.

Memory is O(programs * BLOCK_Q * CAP): the grid is persistent (WAVES programs per SM, each reusing one
workspace slot for query block after query block, heaviest blocks, the last ones, first), so the
workspace does not grow with t. Threads of a program exchange list entries through global memory:
barriers order the inserts, the compaction's reads and its in-place writes (an entry only moves to an
earlier slot, and each tile is read by every thread before any of them writes into it).

Reads top-down: the compaction, the kernel, its launcher, compile specs, the variant's
logic. Semantics: `registry.ops.gsa_topk.reference`; a tie may break either way.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.base import CompileSpec
from kernels.common.gsa_indexer import (
    LOG2E,
    _gated_scores,
    _load_index_keys,
    _load_index_queries,
    accumulator_reason,
    index_signature,
    index_tiles,
)
from registry.nvtx import nvtx_range
from tuning_db.records import CallConfig, LaunchConfig

KEY_MIN = tl.constexpr(-2147483648)
KEY_MAX = tl.constexpr(2147483647)


# ----------------------------------------------------------------------------- Triton kernels
@triton.jit
def _compact(KEYS_ROW, IDS_ROW, cnt, n, tau, bot, top, limit, target, TILE: tl.constexpr):
    """Cut every list longer than `limit` to between n and limit entries, its best, in place; returns
    the new (cnt, tau, bot). Other rows keep their lists.

    A threshold search on [bot, top] (every entry is in it; each step counts, per row, the entries >=
    its probe) keeps count(>= lo) = c_lo >= n > count(>= hi) = c_hi and stops once c_lo <= limit: then
    the entries >= lo stay. Each probe interpolates where the count would reach `target` (inside the
    window [n, limit]), unless the last probe did not halve the range: then it bisects, so the search
    ends within about 64 counts even on adversarial keys, and usually after a few. When the range
    closes on one key v (more than limit entries tie at v), the entries > v and the first n - c_hi
    entries equal to v stay."""
    need = cnt > limit
    span = tl.max(cnt)
    lo = bot.to(tl.int64)
    hi = top.to(tl.int64) + 1
    c_lo = cnt
    c_hi = tl.zeros_like(cnt)
    done = ~need
    bisect = done
    offs = tl.arange(0, TILE)
    while tl.max((~done).to(tl.int32)) > 0:
        width = hi - lo
        frac = (c_lo - target).to(tl.float32) + 0.5
        frac = frac / tl.maximum(c_lo - c_hi, 1).to(tl.float32)
        guess = lo + tl.minimum(tl.maximum((width.to(tl.float32) * frac).to(tl.int64), 1), width - 1)
        probe = tl.where(bisect, lo + (width >> 1), guess)
        found = tl.zeros_like(cnt)
        for c0 in range(0, span, TILE):
            slots = c0 + offs
            inside = slots[None, :] < cnt[:, None]
            keys = tl.load(KEYS_ROW + slots[None, :], mask=inside, other=0)
            found += tl.sum((inside & (keys >= probe[:, None])).to(tl.int32), 1)
        enough = found >= n
        lo = tl.where(~done & enough, probe, lo)
        c_lo = tl.where(~done & enough, found, c_lo)
        hi = tl.where(~done & ~enough, probe, hi)
        c_hi = tl.where(~done & ~enough, found, c_hi)
        bisect = 2 * (hi - lo) > width
        done = done | (c_lo <= limit) | (hi - lo <= 1)
    fits = c_lo <= limit
    v = lo.to(tl.int32)
    quota = tl.where(fits, cnt, n - c_hi)  # ties at v that stay
    written = tl.zeros_like(cnt)
    tied = tl.zeros_like(cnt)
    for c0 in range(0, span, TILE):
        slots = c0 + offs
        inside = (slots[None, :] < cnt[:, None]) & need[:, None]
        keys = tl.load(KEYS_ROW + slots[None, :], mask=inside, other=KEY_MIN)
        ids = tl.load(IDS_ROW + slots[None, :], mask=inside, other=0)
        equal = inside & (keys == v[:, None])
        tie_rank = tied[:, None] + tl.cumsum(equal.to(tl.int32), 1) - 1
        keep = (inside & (keys > v[:, None])) | (equal & (tie_rank < quota[:, None]))
        pos = written[:, None] + tl.cumsum(keep.to(tl.int32), 1) - 1
        # Entries only move to earlier slots, possibly into this tile: all of it is read first.
        tl.debug_barrier()
        tl.store(KEYS_ROW + pos, keys, mask=keep)
        tl.store(IDS_ROW + pos, ids, mask=keep)
        written += tl.sum(keep.to(tl.int32), 1)
        tied += tl.sum(equal.to(tl.int32), 1)
    tl.debug_barrier()
    # Kept: every entry >= v (fits), or > v plus some ties (then later keys equal to v are ties too).
    new_tau = tl.where(fits, v - 1, v)
    return tl.where(need, written, cnt), tl.where(need, new_tau, tau), tl.where(need, v, bot)


@triton.jit
def _gsa_topk_kernel(
    Q, K, W, BIAS, TOPK_LEN, OUT, KEYS, IDS,
    t, h_i, d_i, k, qk_scale2, q_blocks, total_blocks, cap,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt,
    stride_wb, stride_wt,
    stride_lb, stride_lt,
    stride_ob, stride_ot,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, H_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, HAS_TOPK_LEN: tl.constexpr,
):
    """One persistent program: query blocks program_id(0), + num_programs, ... (counted from the last
    block of the last batch row), each BLOCK_Q queries of one batch row: streams their causal keys,
    keeps each query's candidates in workspace slot program_id(0) (KEYS and IDS [programs, BLOCK_Q,
    cap]) and writes its n = min(k, i + 1, topk_length) best key ids, then -1 up to k."""
    pid = tl.program_id(0)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_k = tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, TILE)
    slot = pid.to(tl.int64) * BLOCK_Q * cap + offs_q.to(tl.int64)[:, None] * cap
    keys_row = KEYS + slot
    ids_row = IDS + slot
    for blk in range(pid, total_blocks, tl.num_programs(0)):
        last = total_blocks - 1 - blk
        b = (last // q_blocks).to(tl.int64)
        q0 = (last % q_blocks) * BLOCK_Q
        rows = q0 + offs_q
        row_ok = rows < t
        n = tl.minimum(rows + 1, k)
        if HAS_TOPK_LEN:
            length = tl.load(TOPK_LEN + b * stride_lb + rows.to(tl.int64) * stride_lt, mask=row_ok, other=0)
            n = tl.minimum(n, tl.maximum(length, 0))
        n = tl.where(row_ok, n, 0)
        # A query with nothing to select takes no candidate at all.
        tau = tl.where(n > 0, KEY_MIN, KEY_MAX).to(tl.int32)
        bot = tl.full([BLOCK_Q], KEY_MAX, tl.int32)
        top = tl.full([BLOCK_Q], KEY_MIN, tl.int32)
        cnt = tl.zeros([BLOCK_Q], tl.int32)
        # Mid-stream compactions keep between n and the most a list can hold before the next block,
        # aiming a quarter into that window: most of the list is freed, and a probe that misses the
        # aim by a little still lands inside.
        limit = cap - BLOCK_K
        target = n + (limit - n) // 4

        q, gate, bias2 = _load_index_queries(Q, W, BIAS, b, q0, t, h_i, d_i, stride_qb, stride_qt, stride_qh,
                                             stride_wb, stride_wt, BLOCK_Q, H_PAD, BLOCK_D)
        for k0 in range(0, tl.minimum(q0 + BLOCK_Q, t), BLOCK_K):
            keys = _load_index_keys(K, b, k0, t, d_i, stride_kb, stride_kt, BLOCK_K, BLOCK_D)
            scores = _gated_scores(q, gate, bias2, keys, qk_scale2, BLOCK_Q, H_PAD, BLOCK_K)
            # int32 keys that order like the floats (negative ones get their magnitude bits flipped).
            bits = scores.to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            cols = k0 + offs_k
            take = (cols[None, :] <= rows[:, None]) & (key > tau[:, None])
            new = tl.sum(take.to(tl.int32), 1)
            if tl.max(new) > 0:
                if tl.max(cnt + new) > cap:
                    tl.debug_barrier()  # every insert so far is visible to every thread
                    cnt, tau, bot = _compact(keys_row, ids_row, cnt, n, tau, bot, top, limit, target, TILE)
                    take = take & (key > tau[:, None])
                    new = tl.sum(take.to(tl.int32), 1)
                pos = cnt[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
                tl.store(keys_row + pos, key, mask=take)
                tl.store(ids_row + pos, tl.broadcast_to(cols[None, :], [BLOCK_Q, BLOCK_K]), mask=take)
                cnt += new
                bot = tl.minimum(bot, tl.min(tl.where(take, key, KEY_MAX), 1))
                top = tl.maximum(top, tl.max(tl.where(take, key, KEY_MIN), 1))

        tl.debug_barrier()
        cnt, tau, bot = _compact(keys_row, ids_row, cnt, n, tau, bot, top, n, n, TILE)
        out_row = OUT + b * stride_ob + rows.to(tl.int64)[:, None] * stride_ot
        for s0 in range(0, k, TILE):
            slots = s0 + offs_t
            ids = tl.load(ids_row + slots[None, :], mask=slots[None, :] < cnt[:, None], other=-1)
            tl.store(out_row + slots[None, :], ids, mask=row_ok[:, None] & (slots[None, :] < k))
        tl.debug_barrier()  # the next query block reuses the workspace


# ----------------------------------------------------------------------------- launcher
def list_capacity(k: int, t: int, block_k: int) -> int:
    """CAP: slots per query list, at least its largest count min(k, t) plus one key block (what a
    compaction must leave room for), doubled so that a compaction frees many blocks' worth."""
    return 2 * max(min(k, t), block_k)


@functools.cache
def _sm_count(device: torch.device) -> int:
    from registry.device import detect

    return detect(device).num_sms


def gsa_topk_forward(args: dict, config: CallConfig) -> torch.Tensor:
    """Launch the fused top-k on validated arguments (registry.ops.gsa_topk's dict): indices [b, t, k] int32.
    The workspace (two int32 lists of CAP entries per query of each program) is allocated here."""
    q, k_idx, w, bias, k = args["q_idx"], args["k_idx"], args["w"], args["bias"], args["k"]
    lengths = args["topk_length"]
    b, t, h_i, d_i = q.shape
    h_pad, block_d = index_tiles(h_i, d_i)
    role = config["fwd"]
    blocks = role.blocks
    block_q = blocks["BLOCK_Q"]
    q_blocks = triton.cdiv(t, block_q)
    total = b * q_blocks
    programs = min(total, blocks["WAVES"] * _sm_count(q.device))
    cap = list_capacity(k, t, blocks["BLOCK_K"])
    out = torch.empty((b, t, k), device=q.device, dtype=torch.int32)
    keys = torch.empty((programs, block_q, cap), device=q.device, dtype=torch.int32)
    ids = torch.empty_like(keys)
    with nvtx_range("gsa/topk_kernel"):
        _gsa_topk_kernel[(programs,)](
            q, k_idx, w, bias, lengths if lengths is not None else out, out, keys, ids,
            t, h_i, d_i, k, float(args["sm_scale"]) * LOG2E.value, q_blocks, total, cap,
            *q.stride()[:3], *k_idx.stride()[:2], *w.stride()[:2],
            *(lengths.stride() if lengths is not None else (0, 0)), *out.stride()[:2],
            BLOCK_Q=block_q, BLOCK_K=blocks["BLOCK_K"], H_PAD=h_pad, BLOCK_D=block_d, TILE=blocks["TILE"],
            HAS_TOPK_LEN=lengths is not None, **role.knobs(),
        )
    return out


# ----------------------------------------------------------------------------- offline compiles
def gsa_topk_compile_specs(key: dict, config: CallConfig, dtype: str = "bf16") -> list[CompileSpec]:
    """The top-k kernel as a call with this key and config launches it (with topk_length, the heavier
    specialization), for offline compile checks."""
    h_pad, block_d = index_tiles(key["h_i"], key["d_i"])
    blocks = config["fwd"].blocks
    constexprs = {"BLOCK_Q": blocks["BLOCK_Q"], "BLOCK_K": blocks["BLOCK_K"], "H_PAD": h_pad, "BLOCK_D": block_d,
                  "TILE": blocks["TILE"], "HAS_TOPK_LEN": True}
    elem = f"*{key.get('dtype', dtype)}"
    pointers = {n: "*i32" for n in ("TOPK_LEN", "OUT", "KEYS", "IDS")}
    signature = index_signature(_gsa_topk_kernel, constexprs, elem, pointers, ("qk_scale2",))
    cap = list_capacity(key["k"], key["t"], blocks["BLOCK_K"])
    # t masks query rows and bounds loops, never a run the compiler vectorizes along, so the preset
    # lengths share one compile.
    return [CompileSpec("fwd", _gsa_topk_kernel, signature, constexprs,
                        values={"h_i": key["h_i"], "d_i": key["d_i"], "k": key["k"], "cap": cap})]


# ----------------------------------------------------------------------------- the variant
# Workspace entries per thread in one step of a compaction (BLOCK_Q * TILE over the threads).
LIST_TILE_LIMIT = 16


class GSATopkStreamingBase:
    """The fused top-k variant's logic; each vendor file subclasses it with `Variant` and sets `spaces`
    ("fwd": blocks BLOCK_Q, queries per program; BLOCK_K, keys per streamed block; TILE, list entries per
    step of a compaction and of the output; WAVES, persistent programs per SM) and ACC_REGS_LIMIT (fp32
    score-tile registers per thread above which it spills)."""

    op = "gsa_topk"
    name = "gsa_topk_streaming"
    kernels = {"fwd": _gsa_topk_kernel}
    ACC_REGS_LIMIT = 128

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d_i"] <= 256 and key["h_i"] <= 64

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        if device.key == "cpu":
            return None
        blocks = config.blocks
        rows = blocks["BLOCK_Q"] * triton.next_power_of_2(key["h_i"])
        per_thread = blocks["BLOCK_Q"] * blocks["TILE"] // (config.num_warps * device.warp_size)
        if per_thread > LIST_TILE_LIMIT:
            # A compaction step holds six such tiles (keys, ids, ties, two prefix sums, the mask) and
            # the store's pointers: wider ones spill on sm_90.
            return f"list tile of {per_thread} entries per thread (> {LIST_TILE_LIMIT})"
        return accumulator_reason(rows, blocks["BLOCK_K"], config, device, self.ACC_REGS_LIMIT)

    def launch(self, args: dict, config: CallConfig) -> torch.Tensor:
        return gsa_topk_forward(args, config)

    def bind(self, config: CallConfig):
        return lambda args: gsa_topk_forward(args, config)

    def compile_specs(self, key: dict, config: CallConfig, dtype: str = "bf16") -> list[CompileSpec]:
        return gsa_topk_compile_specs(key, config, dtype)


# The interpreter's block shapes, both vendors (the default first): a 16-key block with small lists
# compacts often on the tiny presets; 16-entry tiles make a compaction span several tiles.
INTERPRETER_TOPK = ({"BLOCK_Q": 16, "BLOCK_K": 16, "TILE": 16, "WAVES": 1},
                    {"BLOCK_Q": 16, "BLOCK_K": 32, "TILE": 32, "WAVES": 2})
