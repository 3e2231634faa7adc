"""NSA's selected branch, key-block-centric: the variant `nsa_block_centric` (both vendors, one body).

`nsa_group_centric` (kernels/common/nsa.py) runs one program per (token, kv head) and gathers the K and V
of each of the token's selected blocks for it alone: 32 KiB per (token, kv head, block) at d 128 and
blocks of 64, however many other tokens chose the same block. Here the selection is inverted, so that
a loaded block serves every token that chose it. Everything else (compress, cmp with the selection,
the window branch, the backward) is the group-centric variant's, unchanged; this module brings the
selected branch as a `SelectedBranch` and two kernel roles:

- lists (torch on the device, no host sync): `kernels.common.nsa_backward.block_entries` sorts the
  valid slots of the block ids [b, t, h_kv, block_count] by (batch, kv head, block) with one stable
  sort, so each (batch, kv head, block) has a list of flat slot positions in token order; an id outside
  0 .. token // block_size is left out, a duplicate is listed once per slot. `chunk_worklist` cuts
  every list into chunks of TOKENS entries (each chunk its list and its entries' positions, so that a
  program reads them without a search) and orders the chunks by (batch, kv head, first token): the
  programs running at one time then gather the Q rows of nearby tokens (each token's are read once
  per selected block, from L2 after the first) and the K/V of one kv head, as the group-centric grid
  does. Its length is a bound from shapes (entries / TOKENS + lists); the count of real chunks stays
  on the device.
- `slc_block` (`_nsa_slc_block_kernel`): WAVES persistent programs per SM walk the chunks. A chunk's
  rows are its TOKENS entries times the group's heads (BLOCK_M rows, as the cmp kernel packs them);
  the block's keys are loaded once for all of them, BLOCK_N at a time; S = Q K^T is masked causally
  per row (key <= the row's token); an online softmax gives per (entry, head) the normalized partial o
  in q's dtype and its lse (log2 units, fp32), stored at the entry's flat slot position: workspaces
  [b * t * h_kv * block_count, group, d] and [..., group]. Slots that are not listed are never
  written. One flat loop over (chunk, key step) with the next step's chunk read a step ahead, so that
  Triton pipelines the next chunk's Q, K and V under this one's products (num_stages 3 on sm_90).
- `slc_combine` (`_nsa_slc_combine_kernel`): one program per (BLOCK_M rows of tokens x heads, kv head,
  sequence): reads each token's ids again, merges the partials of its valid slots by their lse
  (duplicates count once per slot, as attending the block twice does) and writes the gated sum
  out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa, and o_slc and lse_slc (natural log, +inf and
  o_slc 0 for a token with no valid id) when the parts are kept: the same tensors the group-centric
  kernel leaves, so the backward roles run unchanged.

Costs at the target (b 1, t 65536, h_q 64, h_kv 4, d 128, block 64, 16 blocks; benchmarks/NOTES.md,
"nsa selected branch, key-block-centric"): K/V 17 GB and Q 17 GB mostly from L2, partials 17 GB written
and read back (the cost of this design), 2.2 TFLOP at M 128; the partials workspace is block_count
q-sized tensors (16 GiB there).

Reads top-down: kernels, launchers, offline compile specs, the variant's logic. Semantics:
`registry.ops.nsa.reference` (docs/op-contracts.md).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.base import CompileSpec
from kernels.common.attention import LN2, LOG2E
from kernels.common.nsa import (
    Branches,
    NSAGroupCentricBase,
    cmp_tokens,
    shared_compile_specs,
    typed_spec,
)
from kernels.common.nsa_backward import KERNELS as BACKWARD_KERNELS
from kernels.common.nsa_backward import block_entries
from kernels.common.tiles import cdiv, dot_block, next_pow2
from tuning.space import ConfigSpace
from tuning_db.records import CallConfig


# ----------------------------------------------------------------------------- Triton kernels
@triton.jit
def _nsa_slc_block_kernel(
        Q, K, V, WorkList, ChunkPos, NumWork, OPART, LPART,
        t, h_kv, n_blocks, group, block_size, block_count, n_sub, qk_scale,
        stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr):
    """A persistent program: chunks program_id(0), + num_programs(0), ... below NumWork[0] of the
    worklist (WorkList: the chunk's list l = (batch * h_kv + kv head) * n_blocks + block; ChunkPos
    [chunks, BLOCK_T]: its entries' flat slot positions ((batch * t + token) * h_kv + kv head) *
    block_count + slot, -1 past the list's end). Row r of a chunk is entry r // BLOCK_G, head
    r % BLOCK_G of the group.

    Attends a chunk's rows to its block's keys [block * block_size, + block_size), key j allowed for a
    row iff j <= its token, in n_sub steps of BLOCK_N keys, and writes per row the normalized partial o
    to OPART [positions, group, HEAD_DIM] (its element type) and its lse in log2 units to LPART
    [positions, group] (fp32), at the entry's position. One flat loop over (chunk, step) pairs, so that
    Triton pipelines the next chunk's loads under this one's products. Listed blocks are valid for
    their tokens (block <= token // block_size): every listed row sees the block's first key."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    mine = tl.maximum(tl.load(NumWork).to(tl.int32) - pid + programs - 1, 0) // programs
    BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_G
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    member = offs_r % BLOCK_G
    d_ok = offs_d[None, :] < HEAD_DIM

    # The chunk's list and entries are read one iteration ahead (carried in registers), so that the
    # K/V and Q addresses of an iteration do not wait on a load of the same iteration and Triton can
    # pipeline those tiles across chunks.
    lst = tl.load(WorkList + pid, mask=mine > 0, other=0)
    pos = tl.load(ChunkPos + pid.to(tl.int64) * BLOCK_T + offs_r // BLOCK_G, mask=mine > 0, other=-1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for it in range(0, mine * n_sub):
        step = it % n_sub
        blk = lst % n_blocks
        bh = lst // n_blocks
        hk = (bh % h_kv).to(tl.int64)
        b = (bh // h_kv).to(tl.int64)
        row_ok = (pos >= 0) & (member < group)
        tok = tl.where(pos >= 0, pos // block_count // h_kv % t, 0).to(tl.int64)
        row = pos.to(tl.int64) * group + member
        head = hk * group + member
        q = tl.load(Q + b * stride_qb + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok, other=0.0)
        offs = step * BLOCK_N + offs_n
        keys = blk.to(tl.int64) * block_size + offs
        key_ok = (offs < block_size) & (keys < t)
        mask = key_ok[:, None] & d_ok
        k = tl.load(K + b * stride_kb + hk * stride_kh + keys[:, None] * stride_kt + offs_d[None, :], mask=mask,
                    other=0.0)
        v = tl.load(V + b * stride_vb + hk * stride_vh + keys[:, None] * stride_vt + offs_d[None, :], mask=mask,
                    other=0.0)
        # A chunk's first step starts a new online softmax.
        fresh = step == 0
        m_i = tl.where(fresh, float("-inf"), m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        acc = tl.where(fresh, 0.0, acc)
        allowed = key_ok[None, :] & (keys[None, :] <= tok[:, None])
        s = tl.where(allowed, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A padding row may see no key: shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        # The chunk's last step stores its rows.
        done = row_ok & (step == n_sub - 1)
        seen = l_i > 0.0
        o = acc * tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)[:, None]
        tl.store(OPART + row[:, None] * HEAD_DIM + offs_d[None, :], o.to(OPART.dtype.element_ty),
                 mask=done[:, None] & d_ok)
        tl.store(LPART + row, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), mask=done)
        # The next iteration's chunk (the same one until its last step).
        w = pid + ((it + 1) // n_sub) * programs
        more = it + 1 < mine * n_sub
        lst = tl.load(WorkList + w, mask=more, other=0)
        pos = tl.load(ChunkPos + w.to(tl.int64) * BLOCK_T + offs_r // BLOCK_G, mask=more, other=-1)


@triton.jit
def _merge_partial(m_i, l_i, acc, lse, o):
    """Fold one partial (o [rows, d], its lse in log2 units, -inf for a slot not taken) into the rows'
    running merge: (max lse, sum of 2^(lse - max), weighted sum of o)."""
    m_new = tl.maximum(m_i, lse)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    weight = tl.math.exp2(lse - m_shift)  # 0 for a slot not taken (lse -inf); NaN stays NaN
    alpha = tl.math.exp2(m_i - m_shift)
    return m_new, l_i * alpha + weight, acc * alpha[:, None] + weight[:, None] * o.to(tl.float32)


@triton.jit
def _nsa_slc_combine_kernel(
        IDX, OPART, LPART, OCMP, OSWA, GCMP, GSLC, GSWA, OUT, OSLC, LSE,
        t, h_kv, group, block_size, block_count,
        stride_ib, stride_it, stride_ih,
        stride_ob, stride_ot, stride_oh,
        stride_gcb, stride_gct, stride_gsb, stride_gst, stride_gwb, stride_gwt,
        stride_lb, stride_lh,
        STORE_PARTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: BLOCK_T consecutive tokens (tile program_id(0)) of kv head program_id(1) of sequence
    program_id(2), all `group` query heads: row r is token r // BLOCK_G, head r % BLOCK_G of the group.

    Merges each row's partials (OPART / LPART as `_nsa_slc_block_kernel` wrote them) over the token's
    valid slots of IDX [b, t, h_kv, block_count] (ids in 0 .. token // block_size; a duplicate slot is
    its own partial), by their lse: o_slc = sum_s 2^(lse_s - lse) o_s. Writes out = g_cmp * o_cmp +
    g_slc * o_slc + g_swa * o_swa in fp32 to OUT (OCMP, OSWA, OUT and OSLC share one layout); with
    STORE_PARTS also o_slc (0 for a token with no valid id) and its natural lse (+inf then) to OSLC and
    LSE [b, h_q, t]."""
    i0 = tl.program_id(0) * BLOCK_T
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_G
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = (i0 + offs_r // BLOCK_G).to(tl.int64)
    member = offs_r % BLOCK_G
    row_ok = (tok < t) & (member < group)
    d_ok = offs_d[None, :] < HEAD_DIM
    tile_ok = row_ok[:, None] & d_ok
    head = hk * group + member
    slot0 = ((b * t + tok) * h_kv + hk) * block_count  # the token's first slot position
    # Which slots are valid, read before the loop, so that nothing an iteration loads waits on another
    # of its loads; two slots a step keep twice the partials in flight (the loop is not pipelined).
    slots = tl.arange(0, BLOCK_S)
    ids = tl.load(IDX + b * stride_ib + (tok * stride_it + hk * stride_ih)[:, None] + slots[None, :],
                  mask=row_ok[:, None] & (slots < block_count)[None, :], other=-1)
    valid_slots = ((ids >= 0) & (ids <= (tok // block_size)[:, None])).to(tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(0, block_count, 2):
        # Slot s + 1 may be past block_count: its column of valid_slots is 0 (or absent) then.
        valid_a = tl.max(tl.where(slots[None, :] == s, valid_slots, 0), 1) > 0
        valid_b = tl.max(tl.where(slots[None, :] == s + 1, valid_slots, 0), 1) > 0
        row_a = (slot0 + s) * group + member
        row_b = row_a + group
        lse_a = tl.load(LPART + row_a, mask=valid_a, other=float("-inf"))
        lse_b = tl.load(LPART + row_b, mask=valid_b, other=float("-inf"))
        o_a = tl.load(OPART + row_a[:, None] * HEAD_DIM + offs_d[None, :], mask=valid_a[:, None] & d_ok, other=0.0)
        o_b = tl.load(OPART + row_b[:, None] * HEAD_DIM + offs_d[None, :], mask=valid_b[:, None] & d_ok, other=0.0)
        m_i, l_i, acc = _merge_partial(m_i, l_i, acc, lse_a, o_a)
        m_i, l_i, acc = _merge_partial(m_i, l_i, acc, lse_b, o_b)

    empty = l_i == 0.0
    o_slc = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    rows = b * stride_ob + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
    o_cmp = tl.load(OCMP + rows, mask=tile_ok, other=0.0).to(tl.float32)
    o_swa = tl.load(OSWA + rows, mask=tile_ok, other=0.0).to(tl.float32)
    g_cmp = tl.load(GCMP + b * stride_gcb + tok * stride_gct + head, mask=row_ok, other=0.0).to(tl.float32)
    g_slc = tl.load(GSLC + b * stride_gsb + tok * stride_gst + head, mask=row_ok, other=0.0).to(tl.float32)
    g_swa = tl.load(GSWA + b * stride_gwb + tok * stride_gwt + head, mask=row_ok, other=0.0).to(tl.float32)
    out = g_cmp[:, None] * o_cmp + g_slc[:, None] * o_slc + g_swa[:, None] * o_swa
    tl.store(OUT + rows, out.to(OUT.dtype.element_ty), mask=tile_ok)
    if STORE_PARTS:
        tl.store(OSLC + rows, o_slc.to(OSLC.dtype.element_ty), mask=tile_ok)
        lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
        tl.store(LSE + b * stride_lb + head * stride_lh + tok, lse, mask=row_ok)


# ----------------------------------------------------------------------------- launchers
@functools.cache
def _sm_count(device: torch.device) -> int:
    from registry.device import detect

    return detect(device).num_sms


def chunk_worklist(offsets: torch.Tensor, positions: torch.Tensor, tokens: int, t: int, n_blocks: int,
                   per_token: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunks of `block_entries`' lists, `tokens` entries each (a list's last may hold fewer), in
    (batch, kv head, first token) order: (list int32 [chunks], entry positions [chunks, tokens] (-1 past
    the list's end; int32 where positions fit, else int64), number of chunks int64 [1]). `chunks` is a
    bound from shapes, positions.numel() // tokens + lists (no host sync); rows past the number of
    chunks are padding (list n_lists, positions -1). per_token: slot positions per token (h_kv *
    block_count)."""
    n_lists = offsets.numel() - 1
    total = positions.numel()
    device = offsets.device
    chunks = (offsets[1:] - offsets[:-1] + tokens - 1) // tokens
    ends = torch.cumsum(chunks, 0)
    work = torch.arange(total // tokens + n_lists, device=device, dtype=ends.dtype)
    lst = torch.searchsorted(ends, work, right=True)  # the list whose chunks hold `work`
    live = lst < n_lists
    safe = torch.where(live, lst, 0)
    start = offsets[safe] + (work - ends[safe] + chunks[safe]) * tokens
    entry = start[:, None] + torch.arange(tokens, device=device)
    listed = live[:, None] & (entry < offsets[safe + 1][:, None])
    chunk_pos = torch.where(listed, positions[torch.where(listed, entry, 0)], -1)
    # Order: the list's (batch, kv head), then the chunk's first token; padding last.
    key = torch.where(live, safe // n_blocks * t + chunk_pos[:, 0] // per_token % t, n_lists * t)
    order = torch.argsort(key)
    kind = torch.int32 if total < 2**31 else torch.int64
    return lst[order].to(torch.int32), chunk_pos[order].to(kind), ends[-1:]


def block_centric_selected(args: dict, config: CallConfig, branches: Branches, parts: bool):
    """The selected branch of `nsa_block_centric` (a `kernels.common.nsa.SelectedBranch`): lists,
    worklist, slc_block, slc_combine (module docstring); (out, o_slc, lse_slc), the last two None
    unless `parts`."""
    q, k, v = args["q"], args["k"], args["v"]
    b, t, h_q, d = q.shape
    h_kv = k.shape[2]
    group = h_q // h_kv
    block_size, block_count = args["block_size"], args["block_count"]
    n_blocks = cdiv(t, block_size)
    blocks = branches.block_indices
    offsets, positions = block_entries(blocks, block_size)
    block_cfg, combine_cfg = config["slc_block"], config["slc_combine"]
    block_g, block_d = next_pow2(group), dot_block(d)
    tokens = cmp_tokens(block_cfg.blocks["BLOCK_M"], group)
    work_list, chunk_pos, n_work = chunk_worklist(offsets, positions, tokens, t, n_blocks, h_kv * block_count)
    o_part = torch.empty((positions.numel(), group, d), dtype=q.dtype, device=q.device)
    lse_part = torch.empty((positions.numel(), group), dtype=torch.float32, device=q.device)
    block_n = block_cfg.blocks["BLOCK_N"]
    programs = min(work_list.numel(), block_cfg.blocks["WAVES"] * _sm_count(q.device))
    _nsa_slc_block_kernel[(programs,)](
        q, k, v, work_list, chunk_pos, n_work, o_part, lse_part,
        t, h_kv, n_blocks, group, block_size, block_count, cdiv(block_size, block_n),
        float(args["sm_scale"]) * LOG2E.value,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_T=tokens, BLOCK_N=block_n, **block_cfg.knobs())

    o_cmp, o_swa = branches.o_cmp, branches.o_swa
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    o_slc = torch.empty(q.shape, dtype=q.dtype, device=q.device) if parts else None
    lse_slc = torch.empty((b, h_q, t), dtype=torch.float32, device=q.device) if parts else None
    gates = [args[name] for name in ("g_cmp", "g_slc", "g_swa")]
    combine_t = cmp_tokens(combine_cfg.blocks["BLOCK_M"], group)
    _nsa_slc_combine_kernel[(cdiv(t, combine_t), h_kv, b)](
        blocks, o_part, lse_part, o_cmp, o_swa, *gates, out, o_slc if parts else out, lse_slc if parts else out,
        t, h_kv, group, block_size, block_count,
        *blocks.stride()[:3], *out.stride()[:3], *(s for g in gates for s in g.stride()[:2]),
        *(lse_slc.stride()[:2] if parts else (0, 0)),
        STORE_PARTS=parts, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_T=combine_t,
        BLOCK_S=next_pow2(block_count), **combine_cfg.knobs())
    return out, o_slc, lse_slc


# ----------------------------------------------------------------------------- offline compiles
_POINTERS = {"WorkList": "*i32", "ChunkPos": "*i32", "NumWork": "*i64", "LPART": "*fp32", "IDX": "*i32",
             "LSE": "*fp32"}


def block_centric_compile_specs(key: dict, config: CallConfig, dtype: str = "fp16") -> list[CompileSpec]:
    """Every kernel a call of `nsa_block_centric` with this key and call config launches: the shared
    ones (`shared_compile_specs`) and slc_block and slc_combine, typed as the JIT types them, with the
    parts stored."""
    d, group = int(key["d"]), int(key["h_q"]) // int(key["h_kv"])
    h_kv, block_size = int(key["h_kv"]), int(key["block_size"])
    shapes = {"HEAD_DIM": d, "BLOCK_D": dot_block(d), "BLOCK_G": next_pow2(group)}
    values = {"h_kv": h_kv, "group": group, "block_size": block_size, "block_count": int(key["block_count"])}
    if "t" in key:
        t = int(key["t"])
        values.update({"t": t, "n_blocks": cdiv(t, block_size)})
    block, combine = config["slc_block"].blocks, config["slc_combine"].blocks
    values["n_sub"] = cdiv(block_size, block["BLOCK_N"])
    return [
        *shared_compile_specs(key, config, dtype),
        typed_spec("slc_block", _nsa_slc_block_kernel,
                   {**shapes, "BLOCK_T": cmp_tokens(block["BLOCK_M"], group), "BLOCK_N": block["BLOCK_N"]},
                   key, dtype, values, _POINTERS),
        typed_spec("slc_combine", _nsa_slc_combine_kernel,
                   {**shapes, "STORE_PARTS": True, "BLOCK_T": cmp_tokens(combine["BLOCK_M"], group),
                    "BLOCK_S": next_pow2(int(key["block_count"]))},
                   key, dtype, values, _POINTERS),
    ]


# ----------------------------------------------------------------------------- the variant
# The interpreter's tiles of the two roles, the default first (a second token count per chunk, a key
# step wider than small blocks, more persistent programs).
BLOCK_CENTRIC_TILES = {
    "slc_block": ({"BLOCK_M": 32, "BLOCK_N": 16, "WAVES": 1}, {"BLOCK_M": 16, "BLOCK_N": 32, "WAVES": 2}),
    "slc_combine": ({"BLOCK_M": 32}, {"BLOCK_M": 16}),
}


def shared_spaces(group_centric: dict[str, ConfigSpace]) -> dict[str, ConfigSpace]:
    """The group-centric variant's spaces of the roles both variants launch (all but its slc), each
    with only its default interpreter tile: the group-centric variant's conformance runs already
    try the others on the same kernels, and each tile is another interpreted call."""
    return {role: replace(space, interpreter=space.interpreter[:1])
            for role, space in group_centric.items() if role != "slc"}


class NSABlockCentricBase(NSAGroupCentricBase):
    """The block-centric variant's logic: the group-centric one's (kernels/common/nsa.py) with
    `block_centric_selected` for its selected branch, roles slc_block (BLOCK_M rows = tokens x the
    group's heads per chunk, BLOCK_N keys per step of the block) and slc_combine (BLOCK_M rows = tokens
    x heads per program) in place of slc. Each vendor file subclasses it with that vendor's
    group-centric variant, `shared_spaces` of its spaces plus the two roles', and shared_bytes for them.
    Registered below the group-centric variant until measured on a GPU."""

    name = "nsa_block_centric"
    priority = -1
    selected_branch = staticmethod(block_centric_selected)
    kernels = {"compress": NSAGroupCentricBase.kernels["compress"], "cmp": NSAGroupCentricBase.kernels["cmp"],
               "swa": NSAGroupCentricBase.kernels["swa"], "slc_block": _nsa_slc_block_kernel,
               "slc_combine": _nsa_slc_combine_kernel, **BACKWARD_KERNELS}
    STEP_ROLES = ("slc_block", "compress")

    def tile_spans(self, role: str, key: dict) -> dict[str, int]:
        if role == "slc_block":
            return {"BLOCK_N": next_pow2(key["block_size"])}
        return super().tile_spans(role, key)

    def compile_specs(self, key: dict, config: CallConfig, dtype: str = "fp16") -> list[CompileSpec]:
        return block_centric_compile_specs(key, config, dtype)
