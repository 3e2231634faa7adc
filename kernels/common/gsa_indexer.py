"""GSA's gated lightning indexer: the Triton kernel body both vendors share, and the score math that the
fused top-k kernel (kernels.common.gsa_topk) streams through as well.

scores[b, i, j] = sum_h sigmoid(w[b, i, h]) * sigmoid(sm_scale * q_idx[b, i, h] . k_idx[b, j] + bias[h])

All index heads of a block of queries are one tile: row r of the Q tile is query r // H_PAD, index head
r % H_PAD (heads padded to a power of two, the pad rows gated by 0). One dot gives every head's logits
against a key block ([BLOCK_Q * H_PAD, BLOCK_K], enough rows for the tensor cores even with a few
queries), the gating is applied in registers, and the heads are summed by viewing the tile as
[BLOCK_Q, H_PAD, BLOCK_K]. Nothing per head ever reaches memory; the indexer writes its fp32 output once.

Reads top-down: the shared score helpers, the indexer kernel, its launcher, compile specs, the variant's
logic. Semantics: `ops.gsa_indexer.reference` (docs/op-contracts.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kreg.core.nvtx import nvtx_range
from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.constants import LOG2E
from kreg.kernels.common.tiles import cdiv, dot_block, next_pow2
from kreg.ops.variant import CallPlan

# Kernels can only read globals that are constexprs.


def index_tiles(h_i: int, d_i: int) -> tuple[int, int]:
    """(H_PAD, BLOCK_D): index heads padded to a power of two, and the head-dim tile (tl.dot's K >= 16)."""
    return next_pow2(int(h_i)), dot_block(d_i)


# ----------------------------------------------------------------------------- shared score helpers
@triton.jit
def _load_index_queries(Q, W, BIAS, b, q0, t, h_i, d_i,
                        stride_qb, stride_qt, stride_qh, stride_wb, stride_wt,
                        BLOCK_Q: tl.constexpr, H_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """The Q tile of queries [q0, q0 + BLOCK_Q) of batch row b (b as int64): rows r = query * H_PAD + head,
    [BLOCK_Q * H_PAD, BLOCK_D]; each row's gate sigmoid(w) (0 for pad rows and queries past t) and its
    bias in log2 units."""
    rows = tl.arange(0, BLOCK_Q * H_PAD)
    query = q0 + rows // H_PAD
    head = rows % H_PAD
    row_ok = (query < t) & (head < h_i)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptr = Q + b * stride_qb + query.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & (offs_d[None, :] < d_i), other=0.0)
    w = tl.load(W + b * stride_wb + query.to(tl.int64) * stride_wt + head, mask=row_ok, other=0.0).to(tl.float32)
    gate = tl.where(row_ok, 1.0 / (1.0 + tl.math.exp2(-w * LOG2E)), 0.0)
    bias2 = tl.load(BIAS + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    return q, gate, bias2


@triton.jit
def _load_index_keys(K, b, k0, t, d_i, stride_kb, stride_kt, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Index keys [k0, k0 + BLOCK_K) of batch row b, [BLOCK_K, BLOCK_D] (0 past t and past d_i)."""
    keys = k0 + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptr = K + b * stride_kb + keys.to(tl.int64)[:, None] * stride_kt + offs_d[None, :]
    return tl.load(k_ptr, mask=(keys[:, None] < t) & (offs_d[None, :] < d_i), other=0.0)


@triton.jit
def _gated_scores(q, gate, bias2, keys, qk_scale2,
                  BLOCK_Q: tl.constexpr, H_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """Scores [BLOCK_Q, BLOCK_K] in fp32 of a Q tile (`_load_index_queries`) against a key block: every
    head's logits in one dot, sigmoid(logit + bias) weighted by the head's gate, summed over the heads.
    `qk_scale2` is sm_scale * log2(e): sigmoid(x) = 1 / (1 + 2^(-x log2(e)))."""
    logits = tl.dot(q, tl.trans(keys))
    z = logits * qk_scale2 + bias2[:, None]
    gated = gate[:, None] / (1.0 + tl.math.exp2(-z))
    return tl.sum(tl.reshape(gated, [BLOCK_Q, H_PAD, BLOCK_K]), 1)


@triton.jit
def _load_index_queries_by_head(Q, W, BIAS, b, q0, t, h_i, d_i,
                                stride_qb, stride_qt, stride_qh, stride_wb, stride_wt,
                                BLOCK_Q: tl.constexpr, H_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """`_load_index_queries` with the rows head-major: row r = head * BLOCK_Q + query, for
    `_gated_scores_by_key`."""
    rows = tl.arange(0, H_PAD * BLOCK_Q)
    query = q0 + rows % BLOCK_Q
    head = rows // BLOCK_Q
    row_ok = (query < t) & (head < h_i)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptr = Q + b * stride_qb + query.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & (offs_d[None, :] < d_i), other=0.0)
    w = tl.load(W + b * stride_wb + query.to(tl.int64) * stride_wt + head, mask=row_ok, other=0.0).to(tl.float32)
    gate = tl.where(row_ok, 1.0 / (1.0 + tl.math.exp2(-w * LOG2E)), 0.0)
    bias2 = tl.load(BIAS + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    return q, gate, bias2


@triton.jit
def _gated_scores_by_key(keys, q, gate, bias2, qk_scale2,
                         BLOCK_Q: tl.constexpr, H_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_gated_scores` transposed: [BLOCK_K, BLOCK_Q] scores of a key block against a head-major Q tile
    (`_load_index_queries_by_head`). Keys are the dot's rows and (head, query) its columns, so on
    NVIDIA's MMA layouts every head of a query lands in the same thread's registers: the head sum is
    in-thread and leaves a tile that is not replicated across lanes (heads as rows put them on lanes,
    and all work after the sum would run once per head)."""
    logits = tl.dot(keys, tl.trans(q))
    # sigmoid(z) = r^2 with r = rsqrt(1 + 2^-z): two MUFU operations and no division (fp32 `/` is
    # div.full on NVIDIA, a range check around its reciprocal); -z in one FMA.
    r = tl.math.rsqrt(1.0 + tl.math.exp2(logits * -qk_scale2 - bias2[None, :]))
    gated = gate[None, :] * r * r
    return tl.sum(tl.reshape(gated, [BLOCK_K, H_PAD, BLOCK_Q]), 1)


# ----------------------------------------------------------------------------- the indexer kernel
@triton.jit
def _gsa_indexer_kernel(
    Q, K, W, BIAS, OUT,
    t, h_i, d_i, qk_scale2,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt,
    stride_wb, stride_wt,
    stride_ob, stride_ot,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, H_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: the [BLOCK_Q, BLOCK_K] tile of scores of queries program_id(0) * BLOCK_Q... against
    keys program_id(1) * BLOCK_K... of batch row program_id(2), written once in fp32.

    A tile entirely above the causal diagonal loads nothing and computes nothing: it stores -inf. The
    diagonal's tiles mask keys j > i to -inf after the gated sum."""
    q0 = tl.program_id(0) * BLOCK_Q
    k0 = tl.program_id(1) * BLOCK_K
    b = tl.program_id(2).to(tl.int64)
    rows = q0 + tl.arange(0, BLOCK_Q)
    cols = k0 + tl.arange(0, BLOCK_K)
    out_ptr = OUT + b * stride_ob + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    in_range = (rows[:, None] < t) & (cols[None, :] < t)
    if k0 >= q0 + BLOCK_Q:
        tl.store(out_ptr, tl.full([BLOCK_Q, BLOCK_K], float("-inf"), tl.float32), mask=in_range)
    else:
        q, gate, bias2 = _load_index_queries(Q, W, BIAS, b, q0, t, h_i, d_i, stride_qb, stride_qt, stride_qh,
                                             stride_wb, stride_wt, BLOCK_Q, H_PAD, BLOCK_D)
        keys = _load_index_keys(K, b, k0, t, d_i, stride_kb, stride_kt, BLOCK_K, BLOCK_D)
        scores = _gated_scores(q, gate, bias2, keys, qk_scale2, BLOCK_Q, H_PAD, BLOCK_K)
        scores = tl.where(cols[None, :] <= rows[:, None], scores, float("-inf"))
        tl.store(out_ptr, scores, mask=in_range)


# ----------------------------------------------------------------------------- launcher
def gsa_indexer_forward(args: dict, config: CallConfig) -> torch.Tensor:
    """Launch the indexer on validated arguments (ops.gsa_indexer's dict): scores [b, t, t] fp32."""
    q, k_idx, w, bias = args["q_idx"], args["k_idx"], args["w"], args["bias"]
    b, t, h_i, d_i = q.shape
    h_pad, block_d = index_tiles(h_i, d_i)
    blocks = config["fwd"].blocks
    out = torch.empty((b, t, t), device=q.device, dtype=torch.float32)
    grid = (cdiv(t, blocks["BLOCK_Q"]), cdiv(t, blocks["BLOCK_K"]), b)
    with nvtx_range("gsa/indexer_kernel"):
        _gsa_indexer_kernel[grid](
            q, k_idx, w, bias, out,
            t, h_i, d_i, float(args["sm_scale"]) * LOG2E.value,
            *q.stride()[:3], *k_idx.stride()[:2], *w.stride()[:2], *out.stride()[:2],
            BLOCK_Q=blocks["BLOCK_Q"], BLOCK_K=blocks["BLOCK_K"], H_PAD=h_pad, BLOCK_D=block_d,
            **config["fwd"].knobs(),
        )
    return out


# ----------------------------------------------------------------------------- the variant
def score_tile_fits(config: LaunchConfig, key: dict) -> bool:
    """Keep: a score tile of at most 32K fp32 values per program (BLOCK_Q * H_PAD rows by BLOCK_K keys,
    every head's logits live at once): more is spills on either vendor."""
    h_pad = next_pow2(key["h_i"])
    return config.blocks["BLOCK_Q"] * h_pad * config.blocks["BLOCK_K"] <= 32768


def accumulator_reason(rows: int, cols: int, config: LaunchConfig, device, limit: int) -> str | None:
    """Why a [rows, cols] fp32 tile cannot stay in registers (more than `limit` per thread), or None."""
    regs = rows * cols // (config.num_warps * device.warp_size)
    return f"score tile needs {regs} registers per thread (> {limit})" if regs > limit else None


class GSAIndexerTiledBase:
    """The indexer variant's logic; each vendor file subclasses it with `Variant` and sets `spaces`
    ("fwd": blocks BLOCK_Q, the queries per program, and BLOCK_K, the keys per program; keep
    `score_tile_fits`) and ACC_REGS_LIMIT (fp32 tile registers per thread above which it spills)."""

    op = "gsa_indexer"
    name = "gsa_indexer_tiled"
    kernels = {"fwd": _gsa_indexer_kernel}
    ACC_REGS_LIMIT = 128

    def supports(self, key: dict, device) -> bool:
        return key["dtype"] in ("fp16", "bf16") and key["d_i"] <= 256 and key["h_i"] <= 64

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device) -> str | None:
        if device.key == "cpu":
            return None
        rows = config.blocks["BLOCK_Q"] * next_pow2(key["h_i"])
        return accumulator_reason(rows, config.blocks["BLOCK_K"], config, device, self.ACC_REGS_LIMIT)

    def launch(self, args: dict, plan: CallPlan) -> torch.Tensor:
        return gsa_indexer_forward(args, plan.config)

    def bind(self, plan: CallPlan):
        config = plan.config
        return lambda args: gsa_indexer_forward(args, config)


# The interpreter's block shapes, both vendors (the default first): odd t leaves partial tiles.
INTERPRETER_INDEXER = ({"BLOCK_Q": 16, "BLOCK_K": 16}, {"BLOCK_Q": 16, "BLOCK_K": 32})
