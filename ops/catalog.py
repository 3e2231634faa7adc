"""The catalog of registered variants: kernel files join it with `@register`; dispatch, sweeps and table
checks read it.

It sits below the kernels: kernel modules import `register` from here, and nothing below dispatch
imports a kernel module by name. `load_all` imports every module of each vendor's package
(`kernels/<vendor>/`, one per name in `core.device.VENDORS`) the first time variants are needed, as a
plugin registry would, so importing the registry, a contract or a single kernel module first is always
safe, and a new variant file registers by existing.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from kreg.core.device import VENDORS
from kreg.core.records import ROLE_PATTERN, TunedConfig

if TYPE_CHECKING:
    from kreg.core.device import DeviceIdentity
    from kreg.ops.variant import Variant

VARIANTS: dict[str, list[Variant]] = {}
_loaded = False


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
    """Import every module of every vendor package so their variants register; returns the catalog by op."""
    global _loaded
    if not _loaded:
        for vendor in VENDORS:
            package = importlib.import_module(f"kreg.kernels.{vendor}")
            for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
                importlib.import_module(info.name)
        _loaded = True
    return VARIANTS


def find(op: str, vendor: str, name: str) -> Variant | None:
    """The registered variant `name` of `op` for `vendor`, None when there is none."""
    return next((v for v in load_all().get(op, []) if v.vendor == vendor and v.name == name), None)


def entry_problem(tuned: TunedConfig, device: DeviceIdentity) -> str | None:
    """Why a stored entry cannot launch on `device`: an unknown op or variant, or a role, block or knob
    outside the variant's config space (`ConfigSpace.problem`). None when it fits. Dispatch passes over
    such an entry with a warning and `tuning.load` refuses a table holding one, so a damaged or
    hand-edited row never reaches a kernel launch."""
    from kreg.ops import OPS

    if tuned.op not in OPS:
        return f"op {tuned.op!r} is not a registered op (known: {', '.join(OPS)})"
    vendor = tuned.variant_vendor
    variant = find(tuned.op, vendor, tuned.variant)
    if variant is None:
        known = ", ".join(v.name for v in load_all().get(tuned.op, []) if v.vendor == vendor) or "none"
        return f"variant {tuned.variant!r} is not a registered {vendor} variant of {tuned.op} (known: {known})"
    for role, config in tuned.config.items():
        if role not in variant.roles:
            return f"config role {role!r} is not a role of {variant.name} ({', '.join(variant.roles)})"
        problem = variant.spaces[role].problem(config, device)
        if problem is not None:
            return f"config.{role}: {problem}"
    return None

