"""kreg's public API: `registry.get(op)(...)` runs the fastest correct kernel for this device.

    import registry
    out, max_logits, lse = registry.get("sparse_mla")(q, kv, indices)
    registry.ops()                 # the logical ops
    registry.describe("decode")    # contract and variants per vendor
"""

from __future__ import annotations

import inspect

from kernels.base import Variant, load_all
from registry.dispatch import clear_caches, get
from registry.ops import OPS

__all__ = ["get", "ops", "variants", "describe", "clear_caches"]


def ops() -> list[str]:
    """The logical ops, in the order ARCHITECTURE.md lists them."""
    return list(OPS)


def variants(op: str, vendor: str | None = None) -> list[Variant]:
    """The registered Triton variants of `op` (optionally of one vendor), highest priority first."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    return [v for v in load_all().get(op, []) if vendor is None or v.vendor == vendor]


def describe(op: str) -> str:
    """Print and return the contract of `op` and its variants per vendor."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    contract = OPS[op]
    lines = [f"{op}{inspect.signature(contract.validate)}", f"  {contract.summary}", ""]
    lines += [inspect.cleandoc(contract.validate.__doc__ or ""), "", "Variants:"]
    for vendor in ("nvidia", "amd"):
        found = variants(op, vendor)
        names = ", ".join(f"{v.name} (priority {v.priority}, source {v.source_hash})" for v in found)
        lines.append(f"  {vendor}: {names or 'none yet (the PyTorch reference runs)'}")
    text = "\n".join(lines)
    print(text)
    return text
