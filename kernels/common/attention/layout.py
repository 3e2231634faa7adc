"""Host-side arguments of the attention family's launchers, forward and backward alike: a tensor's
strides in the (batch, row, head) order the kernels take, an lse's, a call's rows and the lengths its
grid covers (padded or varlen), and the mask constexprs with the window argument.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of q/k/v-like tensors; packed (varlen) tensors have no batch dim."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of lse-like tensors: [b, h, s], or [h, total] for varlen (rows contiguous)."""
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _geometry(args: Mapping) -> tuple[bool, int, int, int, int, int]:
    """(varlen, batch, rows_q, rows_k, span_q, span_k): rows per batch entry (padded) or the packed
    totals, and the lengths the grid covers (max_seqlen for varlen; programs stride past them)."""
    q, k = args["q"], args["k"]
    if args["cu_seqlens_q"] is not None:
        return (True, args["cu_seqlens_q"].shape[0] - 1, q.shape[0], k.shape[0],
                args["max_seqlen_q"], args["max_seqlen_k"])
    return False, q.shape[0], q.shape[1], k.shape[1], q.shape[1], k.shape[1]


def _masks(args: Mapping, rows_k: int) -> dict:
    """The mask constexprs and the window argument. A window of at least rows_k keys allows what
    causal allows, so it is capped there: positions stay far from int32 overflow."""
    window = args["window"]
    return {"window": min(window, rows_k) if window is not None else 0,
            "IS_CAUSAL": bool(args["causal"]), "HAS_WINDOW": window is not None}
