"""Whether a tuned entry fits the code that would launch it: its op is registered, its variant is a
registered variant of that op and vendor, and each role's config lies inside that role's `ConfigSpace`.

`tuning.load` refuses a table with an entry that does not fit (nothing is imported); dispatch passes
over such an entry in the database or the shipped tables with a warning, so a damaged or hand-edited
row never reaches a kernel launch. The space rules:
- roles are the variant's roles and blocks the role's blocks (a missing role or block is fine: the
  variant's default fills it, `Variant.complete`);
- a block whose space values (every arch, the interpreter's shapes, the defaults) are all powers of two
  takes a power of two between the smallest and the largest of them; any other block one of them;
- a launch knob the space tunes takes one of its values on the device's arch, the arch's default or
  LaunchConfig's own default (the interpreter's configs carry that); a knob it does not tune stays
  within what any launch takes (num_warps up to 32, num_stages up to 8), and AMD's knobs stay unset.

The registry is imported when a check runs, not when this module is: the storage layer stays
importable first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuning_db.matching import DeviceIdentity
from tuning_db.records import LaunchConfig, TunedConfig

if TYPE_CHECKING:
    from pathlib import Path

    from tuning.space import ConfigSpace
    from tuning_db.table_files import TableFile

# Knobs a space does not tune still reach the launch: bounds any kernel launch keeps to.
_UNTUNED_LIMITS = {"num_warps": 32, "num_stages": 8}


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def launch_problem(space: ConfigSpace, config: LaunchConfig, device: DeviceIdentity) -> str | None:
    """What puts one role's config outside `space` on `device` (module docstring), None if nothing."""
    from tuning.space import KNOB_NAMES

    values = space.values(device)
    for name, size in config.blocks.items():
        if name not in space.blocks:
            return f"block {name} is not one of the kernel's blocks ({', '.join(space.blocks)})"
        known = {*values[name], *(shape[name] for shape in space.interpreter),
                 *(fields[name] for fields in space.defaults.values())}
        if all(_power_of_two(v) for v in known):
            if not _power_of_two(size) or not min(known) <= size <= max(known):
                return f"block {name}={size}: expected a power of two from {min(known)} to {max(known)}"
        elif size not in known:
            return f"block {name}={size}: expected one of {sorted(known)}"
    defaults = space.defaults.get(device.arch, space.defaults["*"])
    for knob in KNOB_NAMES:
        value = getattr(config, knob)
        if knob in values:
            allowed = {*values[knob], LaunchConfig.model_fields[knob].default}
            if knob in defaults:
                allowed.add(defaults[knob])
            if value not in allowed:
                shown = sorted(allowed, key=lambda v: (v is None, v or 0))
                return f"{knob}={value}: expected one of {shown} on {device.arch}"
        elif knob in _UNTUNED_LIMITS:
            if value > _UNTUNED_LIMITS[knob]:
                return f"{knob}={value}: expected at most {_UNTUNED_LIMITS[knob]}"
        elif value is not None and value != defaults.get(knob):
            return f"{knob}={value}: this kernel does not take {knob}"
    return None


def entry_problem(tuned: TunedConfig, device: DeviceIdentity) -> str | None:
    """Why `tuned` cannot launch on `device` (module docstring): an unknown op or variant, a role, block
    or knob outside the variant's space. None when it fits."""
    from registry.catalog import load_all
    from registry.ops import OPS

    if tuned.op not in OPS:
        return f"op {tuned.op!r} is not a registered op (known: {', '.join(OPS)})"
    vendor = tuned.variant_vendor
    pool = [v for v in load_all().get(tuned.op, []) if v.vendor == vendor]
    variant = next((v for v in pool if v.name == tuned.variant), None)
    if variant is None:
        known = ", ".join(v.name for v in pool) or "none"
        return f"variant {tuned.variant!r} is not a registered {vendor} variant of {tuned.op} (known: {known})"
    for role, config in tuned.config.items():
        if role not in variant.roles:
            return f"config role {role!r} is not a role of {variant.name} ({', '.join(variant.roles)})"
        problem = launch_problem(variant.spaces[role], config, device)
        if problem is not None:
            return f"config.{role}: {problem}"
    return None


def check_table(table: TableFile, path: str | Path) -> None:
    """Raise TableError (naming the file, the row and the problem) unless every entry of `table` fits its
    variant on the table's device."""
    from registry.ops import OPS
    from tuning_db.table_files import TableError

    if table.op not in OPS:
        raise TableError(f"{path}: op {table.op!r} is not a registered op (known: {', '.join(OPS)})")
    problems = []
    for i, tuned in enumerate(table.tuned()):
        problem = entry_problem(tuned, table.device)
        if problem is not None:
            problems.append(f"row {i} (configs[{i}]): {problem}")
    if problems:
        more = f"; and {len(problems) - 5} more rows" if len(problems) > 5 else ""
        raise TableError(f"{path}: invalid tuned table: {'; '.join(problems[:5])}{more}")
