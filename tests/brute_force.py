"""Independent float64 Python loops that the references are tested against (shared by test files)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def brute_masked_attention(q, k, v, *, scale, allowed: Callable[[int, int, int], bool], sinks=None):
    """Loop over batch, head, query and key; key j joins query i of batch b when allowed(b, i, j).

    q [b, s_q, h_q, d], k/v [b, s_k, h_kv, d] (GQA: head h reads kv head h // (h_q // h_kv)). The sink
    joins the softmax as one more logit with a zero value. Returns out [b, s_q, h_q, d] and
    lse [b, h_q, s_q] (+inf when no key), both float64.
    """
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    Q, K, V = q.double().tolist(), k.double().tolist(), v.double().tolist()
    S = None if sinks is None else sinks.double().tolist()
    out = torch.zeros(b, s_q, h_q, d, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for bi in range(b):
        for h in range(h_q):
            g = h // (h_q // h_kv)
            for i in range(s_q):
                logits = {j: scale * sum(a * c for a, c in zip(Q[bi][i][h], K[bi][j][g], strict=True))
                          for j in range(s_k) if allowed(bi, i, j)}
                if not logits:
                    continue
                top = max(logits.values())
                row_lse = top + math.log(sum(math.exp(z - top) for z in logits.values()))
                total = row_lse
                if S is not None and S[h] == math.inf:
                    total = math.inf
                elif S is not None and S[h] != -math.inf:
                    hi = max(row_lse, S[h])
                    total = hi + math.log(math.exp(row_lse - hi) + math.exp(S[h] - hi))
                for c in range(d):
                    out[bi, i, h, c] = sum(math.exp(z - total) * V[bi][j][g][c] for j, z in logits.items())
                lse[bi, h, i] = row_lse
    return out, lse
