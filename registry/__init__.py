"""kreg's public API: `registry.get(op)(...)` runs the fastest correct kernel for this device.

    import registry
    out, max_logits, lse = registry.get("sparse_mla")(q, kv, indices)
    registry.ops()                 # the logical ops
    registry.describe("decode")    # contract and variants per vendor
"""

from __future__ import annotations

import inspect
from typing import Any

# Load the contracts package first: importing a submodule binds it as an attribute of this package,
# which would otherwise replace the `ops()` function defined below.
from registry.ops import OPS as _OPS

__all__ = ["get", "ops", "variants", "describe", "clear_caches"]


def __getattr__(name: str) -> Any:
    # `get` and `clear_caches` live in registry.dispatch, which imports the kernels; importing it lazily
    # lets kernel modules import registry.device and registry.ops without a cycle. After the first
    # access the name is a plain module global, so `registry.get` costs nothing extra.
    if name in ("get", "clear_caches"):
        from registry import dispatch

        value = globals()[name] = getattr(dispatch, name)
        return value
    raise AttributeError(f"module 'registry' has no attribute {name!r}")


def ops() -> list[str]:
    """The logical ops, in the order ARCHITECTURE.md lists them."""
    return list(_OPS)


def variants(op: str, vendor: str | None = None) -> list:
    """The registered Triton variants of `op` (optionally of one vendor), highest priority first."""
    from kernels.base import load_all

    if op not in _OPS:
        raise ValueError(f"op: expected one of {', '.join(_OPS)}, got {op!r}")
    return [v for v in load_all().get(op, []) if vendor is None or v.vendor == vendor]


def describe(op: str) -> str:
    """Print and return the contract of `op` and its variants per vendor."""
    if op not in _OPS:
        raise ValueError(f"op: expected one of {', '.join(_OPS)}, got {op!r}")
    contract = _OPS[op]
    lines = [f"{op}{inspect.signature(contract.validate)}", f"  {contract.summary}", ""]
    lines += [inspect.cleandoc(contract.validate.__doc__ or ""), "", "Variants:"]
    for vendor in ("nvidia", "amd"):
        found = variants(op, vendor)
        names = ", ".join(f"{v.name} (priority {v.priority}, source {v.source_hash})" for v in found)
        lines.append(f"  {vendor}: {names or 'none yet (the PyTorch reference runs)'}")
    text = "\n".join(lines)
    print(text)
    return text
