"""kreg's public API: `registry.get(op)(...)` runs the fastest correct kernel for this device.

    from kreg import registry
    out, max_logits, lse = registry.get("sparse_mla")(q, kv, indices)
    registry.ops()                 # the logical ops
    registry.describe("decode")    # contract and variants per vendor
"""

import inspect

from kreg.core.device import VENDORS
from kreg.ops import OPS as _OPS
from kreg.ops.catalog import load_all as _load_all
from kreg.registry.dispatch import clear_caches, get

__all__ = ["get", "ops", "variants", "describe", "clear_caches"]


def ops() -> list[str]:
    """The logical ops, in name order."""
    return list(_OPS)


def variants(op: str, vendor: str | None = None) -> list:
    """The registered Triton variants of `op` (optionally of one vendor), highest priority first."""
    if op not in _OPS:
        raise ValueError(f"op: expected one of {', '.join(_OPS)}, got {op!r}")
    return [v for v in _load_all().get(op, []) if vendor is None or v.vendor == vendor]


def describe(op: str) -> str:
    """Print and return the contract of `op` and its variants per vendor."""
    if op not in _OPS:
        raise ValueError(f"op: expected one of {', '.join(_OPS)}, got {op!r}")
    contract = _OPS[op]
    lines = [f"{op}{inspect.signature(contract.validate)}", f"  {contract.summary}", ""]
    lines += [inspect.cleandoc(contract.validate.__doc__ or ""), "", "Variants:"]
    for vendor in VENDORS:
        found = variants(op, vendor)
        names = ", ".join(f"{v.name} (priority {v.priority}, roles {'/'.join(v.roles)}, source {v.source_hash})"
                          for v in found)
        lines.append(f"  {vendor}: {names or 'none yet (the PyTorch reference runs)'}")
    text = "\n".join(lines)
    print(text)
    return text

from kreg._checkout import alias as _alias  # noqa: E402

_alias(__name__)  # `import registry` in a checkout is `kreg.registry`
