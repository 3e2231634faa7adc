"""The catalog of registered variants: kernel files join it with `@register`, dispatch and sweeps read it.

It sits between the contracts and the kernels: kernel modules import `register` from here, and the
registry never imports a kernel module at import time. `load_all` discovers the vendor packages
(`kernels.nvidia`, `kernels.amd`) by name the first time variants are needed, as a plugin registry
would, so importing the registry, a contract or a single kernel module first is always safe.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tuning_db.records import ROLE_PATTERN

if TYPE_CHECKING:
    from kernels.base import Variant

VENDOR_PACKAGES = ("kernels.nvidia", "kernels.amd")
VARIANTS: dict[str, list[Variant]] = {}


def register(cls: type[Variant]) -> type[Variant]:
    """Class decorator: check the variant's roles, instantiate it and list it under its op."""
    roles = list(cls.kernels)
    if not roles or any(not ROLE_PATTERN.fullmatch(role) for role in roles):
        raise ValueError(f"variant {cls.name!r}: kernels must map lower-case role names to kernels, got {roles}")
    if set(cls.spaces) != set(roles):
        raise ValueError(f"variant {cls.name!r}: spaces must name the roles {roles}, got {list(cls.spaces)}")
    variants = VARIANTS.setdefault(cls.op, [])
    if any(v.name == cls.name and v.vendor == cls.vendor for v in variants):
        raise ValueError(f"variant {cls.name!r} ({cls.vendor}) is registered twice for op {cls.op!r}")
    variants.append(cls())
    variants.sort(key=lambda v: -v.priority)
    return cls


def load_all() -> dict[str, list[Variant]]:
    """Import every vendor package so their variants register; returns the catalog by op."""
    for package in VENDOR_PACKAGES:
        importlib.import_module(package)
    return VARIANTS

