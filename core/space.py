"""Config spaces: how every variant declares the launch configs of each kernel role, and the rules of
the Triton interpreter that spaces, sweeps and tests share.

A `ConfigSpace` is data: the values of each block (tile constexpr) and each launch knob, per-arch
overrides of those values, a named `keep` predicate that drops configs which never make sense, the
heuristic default per arch, and the few block shapes the interpreter tries. A variant holds one space
per kernel role (`Variant.spaces`); nothing else builds configs.

`ConfigSpace.problem` says whether a stored config lies inside a space, so that a damaged or
hand-edited entry in a database or table never reaches a launch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kreg.core.records import LaunchConfig

if TYPE_CHECKING:
    from kreg.core.device import DeviceIdentity, DeviceInfo

KNOB_NAMES = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack")

# ----------------------------------------------------------------------------- the interpreter
# The Triton interpreter (TRITON_INTERPRET=1) runs kernels on the CPU, under the device key "cpu". It
# ignores every launch knob, so a space offers it block shapes only; and its tl.dot on bf16 operands
# returns garbage, so everything that runs kernels there (tests, CPU sweeps) uses fp16.
INTERPRETER_DTYPE = torch.float16


def is_interpreter(device: DeviceInfo) -> bool:
    """Whether configs for `device` run in the Triton interpreter (the "cpu" device)."""
    return device.key == "cpu"


# Knobs a space does not tune still reach the launch: bounds any kernel launch keeps to.
_UNTUNED_LIMITS = {"num_warps": 32, "num_stages": 8}


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# ----------------------------------------------------------------------------- spaces
Keep = Callable[[LaunchConfig, Mapping], bool]


@dataclass(frozen=True)
class ConfigSpace:
    """One kernel role's configs on one vendor.

    blocks: the tile constexprs and the values each may take, in the order configs enumerate them;
    knobs: LaunchConfig's launch knobs (KNOB_NAMES) and their values; one not named keeps its default;
    arch: per-arch overrides of block or knob values, e.g. {"gfx950": {"kpack": (1,)}};
    keep: a named predicate (config, tuning key) -> bool; configs it rejects are not in the space
        (static pruning of what may not fit a device is the variant's `prune_reason`, not this; the
        interpreter's shapes are not judged by it);
    defaults: the heuristic config per arch ("*" for any other): a value for every block and any knobs;
    interpreter: the block shapes the interpreter tries, its default first (none for a kernel the
        interpreter cannot run, such as a Gluon one).
    """

    blocks: Mapping[str, tuple[int, ...]]
    knobs: Mapping[str, tuple] = field(default_factory=dict)
    arch: Mapping[str, Mapping[str, tuple]] = field(default_factory=dict)
    keep: Keep | None = None
    defaults: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    interpreter: tuple[Mapping[str, int], ...] = ()

    def __post_init__(self) -> None:
        unknown = [n for n in self.knobs if n not in KNOB_NAMES]
        if unknown:
            raise ValueError(f"knobs: expected names among {KNOB_NAMES}, got {unknown}")
        for arch, values in self.arch.items():
            stray = [n for n in values if n not in self.blocks and n not in self.knobs]
            if stray:
                raise ValueError(f"arch[{arch!r}]: overrides {stray} name no block or knob of this space")
        for arch, fields in self.defaults.items():
            missing = [n for n in self.blocks if n not in fields]
            if missing:
                raise ValueError(f"defaults[{arch!r}]: no value for the blocks {missing}")
        if "*" not in self.defaults:
            raise ValueError('defaults: expected an entry for "*" (any arch)')
        for shape in self.interpreter:
            if set(shape) != set(self.blocks):
                raise ValueError(f"interpreter: expected the blocks {list(self.blocks)}, got {dict(shape)}")

    def values(self, device: DeviceInfo) -> dict[str, tuple]:
        """Every block and knob with its values on `device` (arch overrides applied)."""
        return {**self.blocks, **self.knobs, **self.arch.get(device.arch, {})}

    def block_values(self, device: DeviceInfo) -> dict[str, tuple[int, ...]]:
        """The values each block takes on `device` (in the interpreter: those of its block shapes)."""
        if is_interpreter(device):
            return {n: tuple(sorted({shape[n] for shape in self.interpreter})) for n in self.blocks}
        values = self.values(device)
        return {n: tuple(values[n]) for n in self.blocks}

    def make(self, fields: Mapping[str, int]) -> LaunchConfig:
        """A config from block and knob values by name."""
        blocks = {n: v for n, v in fields.items() if n in self.blocks}
        return LaunchConfig(blocks=blocks, **{n: v for n, v in fields.items() if n in KNOB_NAMES})

    def _kept(self, config: LaunchConfig, key: Mapping) -> bool:
        return self.keep is None or self.keep(config, key)

    def configs(self, key: Mapping, device: DeviceInfo) -> list[LaunchConfig]:
        """The space for one tuning key on one device, in declaration order, without duplicates. The
        interpreter's block shapes are taken as they are: `keep` judges hardware, which it has none of."""
        if is_interpreter(device):
            return [LaunchConfig(blocks=dict(shape)) for shape in self.interpreter]
        values = self.values(device)
        names = list(values)
        candidates = [self.make(dict(zip(names, combo, strict=True)))
                      for combo in itertools.product(*(values[n] for n in names))]
        out, seen = [], set()
        for config in candidates:
            if config not in seen and self._kept(config, key):
                seen.add(config)
                out.append(config)
        return out

    def default(self, device: DeviceInfo) -> LaunchConfig:
        """The heuristic default on `device` before any key-dependent adjustment (the variant's)."""
        if is_interpreter(device):
            if not self.interpreter:
                raise ValueError("this space has no configs for the Triton interpreter")
            return LaunchConfig(blocks=dict(self.interpreter[0]))
        return self.make(self.defaults.get(device.arch, self.defaults["*"]))

    def complete(self, config: LaunchConfig, default: LaunchConfig) -> LaunchConfig:
        """`config` with exactly this space's blocks: a block it lacks takes `default`'s value, a block
        the space no longer has is dropped. A tuned config of an older version of a kernel (stale, still
        used) launches this way."""
        if set(config.blocks) == set(self.blocks):
            return config
        blocks = {n: config.blocks.get(n, default.blocks[n]) for n in self.blocks}
        return config.model_copy(update={"blocks": LaunchConfig(blocks=blocks).blocks})

    def problem(self, config: LaunchConfig, device: DeviceIdentity) -> str | None:
        """What puts a stored config of this role outside the space on `device`, None if nothing. A
        block or role it lacks is fine (`complete` fills it). A block whose values (every arch, the
        interpreter's shapes, the defaults) are all powers of two takes a power of two between the
        smallest and the largest of them, any other block one of them; a knob the space tunes takes
        one of its values on the device's arch, the arch's default or LaunchConfig's own default (the
        interpreter's configs carry that); a knob it does not tune stays within what any launch takes
        (num_warps up to 32, num_stages up to 8), and AMD's knobs stay unset."""
        values = self.values(device)
        for name, size in config.blocks.items():
            if name not in self.blocks:
                return f"block {name} is not one of the kernel's blocks ({', '.join(self.blocks)})"
            known = {*values[name], *(shape[name] for shape in self.interpreter),
                     *(fields[name] for fields in self.defaults.values())}
            if all(_power_of_two(v) for v in known):
                if not _power_of_two(size) or not min(known) <= size <= max(known):
                    return f"block {name}={size}: expected a power of two from {min(known)} to {max(known)}"
            elif size not in known:
                return f"block {name}={size}: expected one of {sorted(known)}"
        defaults = self.defaults.get(device.arch, self.defaults["*"])
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
