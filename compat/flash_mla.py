"""FlashMLA's sparse prefill on kreg's `sparse_mla`.

    from kreg.compat.flash_mla import flash_mla_sparse_fwd

`sparse_mla` already takes FlashMLA's arguments and returns its triple, so this is the call with
FlashMLA's signature (`sm_scale` required, `d_v=512`). kreg also takes fp16, d_v other than 512, a
batched layout (`q [b, s_q, h_q, d_qk]`, indices local to each batch row) and gradients (q, kv and
attn_sink). The `indexer_topk` argument of FlashMLA's development branch is not part of this
signature (a call with it is a TypeError naming it).

`use_vendor("nvidia" | "amd")` points the module at one vendor's kernels (on CPU tensors, Triton's
interpreter), for tests; `use_vendor(None)` goes back to dispatch's choice.
"""

from __future__ import annotations

from kreg import registry

__all__ = ["flash_mla_sparse_fwd", "use_vendor"]

_sparse_mla = registry.get("sparse_mla")
_vendor: str | None = None


def use_vendor(vendor: str | None) -> str | None:
    """Run this module's calls on `vendor`'s kernels ("nvidia" or "amd"; None: dispatch's choice, the
    default). Returns the previous setting."""
    global _sparse_mla, _vendor
    handle = registry.get("sparse_mla", vendor=vendor)
    previous, _vendor = _vendor, vendor
    _sparse_mla = handle
    return previous


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """Sparse MLA prefill: `q [s_q, h_q, d_qk]`, `kv [s_kv, h_kv, d_qk]` (keys; values are its first
    d_v columns), `indices [s_q, h_kv, topk]` int32 (outside [0, s_kv), such as -1: an unused slot),
    `attn_sink [h_q]` fp32 and `topk_length [s_q]` int32 optional.

    Returns `(out [s_q, h_q, d_v], max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32)` (kreg's
    SparseMLAOutput, a tuple). The contract in full: `registry.describe("sparse_mla")`."""
    return _sparse_mla(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
