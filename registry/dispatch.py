"""From a call to a launch: pick the variant, find its tuned call config, cache the bound launcher.

Lookup order on a cache miss (docs/architecture.md): user database -> shipped tables -> nearest tuned
key for the same op and device -> the highest-priority supporting variant's heuristic default. After
the first call for a key, a call costs the op's validation, its raw key and one dict lookup.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from registry.catalog import load_all
from registry.device import CPU, DeviceInfo, detect, interpreter_enabled
from registry.ops import OPS
from registry.ops._contract import Args, Op
from tuning_db.records import CallConfig, TunedConfig, canonical_json

if TYPE_CHECKING:
    from kernels.base import Variant


@dataclass(frozen=True)
class Choice:
    """What a key resolved to: the variant (None: the PyTorch reference), its call config, and where
    the config came from."""

    variant: Variant | None
    config: CallConfig | None
    source: str  # "database", "tables", "nearest-database", "nearest-tables", "default", "autotune", "reference"
    launcher: Callable[[dict], Any]


def _op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {name!r}") from None


def candidates(op: str, vendor: str, variant: str | None, key: dict, device: DeviceInfo) -> list[Variant]:
    """The vendor's variants of `op` that support `key`, highest priority first (or the one named)."""
    pool = [v for v in load_all().get(op, []) if v.vendor == vendor]
    if variant is not None:
        named = [v for v in pool if v.name == variant]
        if not named:
            known = ", ".join(v.name for v in pool) or "none"
            raise ValueError(f"variant: expected one of {known} for {op} on {vendor}, got {variant!r}")
        pool = named
    return [v for v in pool if v.supports(key, device)]


@functools.lru_cache(maxsize=8)
def _user_store(url: str):
    from tuning_db.store import TuningStore

    return TuningStore(url)


@functools.lru_cache(maxsize=1)
def shipped_tables():
    """The shipped tuned tables (`tuning_db/tables/`), read once per process."""
    from tuning_db.table_files import ShippedTables

    return ShippedTables()


def user_store():
    """The user's tuning database (KREG_TUNING_DB or the default file), opened once per URL. Opening
    creates nothing: a database that does not exist yet reads as empty."""
    from tuning_db.store import default_url

    return _user_store(default_url())


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def tuned_lookups(op: Op, device: DeviceInfo, key_json: str, dims: dict):
    """(source, lookup) pairs in docs/architecture.md's order; each lookup returns a TunedConfig or None.

    No failure of a source reaches the call: a database or table that cannot be read (a bad URL, a
    damaged file, anything it raises) warns once and gives None, so the next source answers; an entry
    that does not fit its variant (`tuning_db.checks`: unknown variant, config outside its space) is
    passed over with a warning, and the source's next candidate counts."""
    from tuning_db.checks import entry_problem
    from tuning_db.store import default_url, redact, safe_url

    def database() -> tuple[str, str]:
        return "tuning database", safe_url(default_url())

    def tables() -> tuple[str, str]:
        return "shipped tuned tables", str(shipped_tables().folder)

    def guarded(source, fallback: str, lookup):
        def accept(tuned: TunedConfig) -> bool:
            problem = entry_problem(tuned, device)
            if problem is not None:
                _warn_once(f"kreg: {' '.join(source())}: the entry of {tuned.op} for {tuned.tuning_key} on "
                           f"{tuned.device_key} ({tuned.variant}) is ignored: {problem}")
            return problem is None

        def run() -> TunedConfig | None:
            try:
                return lookup(accept)
            except Exception as err:  # any failure of a source falls back to the next (see above)
                label, where = source()
                text = redact(str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}",
                              default_url())
                _warn_once(f"kreg: {label} unusable, falling back to {fallback}: {where}: {text}")
                return None

        return run

    yield "database", guarded(database, "shipped tables and defaults",
                              lambda accept: user_store().best(op.name, device, key_json, accept))
    yield "tables", guarded(tables, "the nearest tuned key and defaults",
                            lambda accept: shipped_tables().best(op.name, device, key_json, accept))
    yield "nearest-database", guarded(
        database, "shipped tables and defaults",
        lambda accept: user_store().nearest(op.name, device, dims, op.length_dims, accept))
    yield "nearest-tables", guarded(
        tables, "defaults",
        lambda accept: shipped_tables().nearest(op.name, device, dims, op.length_dims, accept))


def _bound(variant: Variant, config: CallConfig, source: str, dims: dict, device: DeviceInfo) -> Choice:
    config = variant.complete(config, dims, device)
    return Choice(variant, config, source, variant.bind(config))


def resolve(op: Op, vendor: str, variant: str | None, key: tuple, device: DeviceInfo, args: dict) -> Choice:
    """Pick (variant, call config) for one key. Runs once per key per process."""
    dims = dict(key)
    pool = candidates(op.name, vendor, variant, dims, device)
    if not pool:
        _warn_once(f"kreg: no {vendor} variant of {op.name} supports {canonical_json(dims)}; "
                   "running the PyTorch reference")
        return Choice(None, None, "reference", lambda a: op.reference(**a))
    by_name = {v.name: v for v in pool}
    key_json = canonical_json(dims)
    for source, lookup in tuned_lookups(op, device, key_json, dims):
        tuned: TunedConfig | None = lookup()
        if tuned is not None and tuned.variant in by_name and tuned.variant_vendor == vendor:
            return _bound(by_name[tuned.variant], tuned.config, source, dims, device)
    if os.environ.get("KREG_AUTOTUNE") == "1" and device.key != "cpu":
        from tuning.autotune import autotune_call

        tuned = autotune_call(op, pool, device, args, user_store())
        if tuned is not None:
            return _bound(by_name[tuned.variant], tuned.config, "autotune", dims, device)
    chosen = pool[0]
    return _bound(chosen, chosen.default_config(dims, device), "default", dims, device)


class OpHandle:
    """`registry.get(op)`: validates a call, dispatches it, and caches the launcher per key.

    Two caches per device: by the raw key an op's validation returns (`Args.key`: shapes, dtype and
    flags as read), so a repeated call costs one dict lookup; and by the canonical tuning key, so new
    raw keys that map to a known tuning key (another sequence length in its bucket, the other layout)
    reuse its resolution.
    """

    def __init__(self, op: Op, vendor: str | None, variant: str | None) -> None:
        if vendor not in (None, "nvidia", "amd"):
            raise ValueError(f"vendor: expected 'nvidia', 'amd' or None, got {vendor!r}")
        self.op = op
        self.vendor = vendor
        self.variant = variant
        self._validate = op.validate
        self._device_arg = next(iter(inspect.signature(op.validate).parameters))
        # torch.device -> (vendor or "" for the reference, DeviceInfo, {raw key: Choice})
        self._devices: dict[torch.device, tuple[str, DeviceInfo, dict]] = {}
        self._by_tuning_key: dict[tuple[str, tuple], Choice] = {}
        self._lock = threading.Lock()
        self.__doc__ = op.validate.__doc__

    def _device(self, dev: torch.device) -> tuple[str, DeviceInfo, dict]:
        if dev.type == "cpu":
            if self.vendor is None and self.variant is None:
                return "", CPU, {}  # plain CPU call: the reference
            if not interpreter_enabled():
                raise RuntimeError(
                    f"{self.op.name}: a Triton variant on CPU tensors needs the interpreter; "
                    "set TRITON_INTERPRET=1 before importing kreg, or pass CUDA/ROCm tensors")
            return self.vendor or "nvidia", CPU, {}
        info = detect(dev)
        if self.vendor is not None and self.vendor != info.vendor:
            raise ValueError(f"vendor: {self.vendor!r} variants cannot run on {info.name} ({info.vendor})")
        return info.vendor, info, {}

    def _resolve(self, vendor: str, info: DeviceInfo, choices: dict, raw, a: dict) -> Choice:
        with self._lock:
            key = self.op.tuning_key(a)
            choice = self._by_tuning_key.get((info.key, key))
            if choice is None:
                choice = resolve(self.op, vendor, self.variant, key, info, a)
                self._by_tuning_key[(info.key, key)] = choice
            choices[raw] = choice
            return choice

    def _choose(self, a: dict) -> Choice | None:
        """The cached choice for validated arguments (None: the reference runs)."""
        dev = a[self._device_arg].device
        found = self._devices.get(dev)
        if found is None:
            found = self._devices[dev] = self._device(dev)
        vendor, info, choices = found
        if not vendor:
            return None
        raw = a.key if a.__class__ is Args else self.op.tuning_key(a)
        choice = choices.get(raw)
        if choice is None:
            choice = self._resolve(vendor, info, choices, raw, a)
        return choice

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        a = self._validate(*args, **kwargs)
        choice = self._choose(a)
        return self.op.reference(**a) if choice is None else choice.launcher(a)

    def choice(self, *args: Any, **kwargs: Any) -> Choice:
        """What a call with these arguments runs (variant, call config, where the config came from),
        resolved and cached as a call would, without launching anything."""
        a = self._validate(*args, **kwargs)
        choice = self._choose(a)
        return Choice(None, None, "reference", lambda x: self.op.reference(**x)) if choice is None else choice

    def clear_cache(self) -> None:
        self._devices.clear()
        self._by_tuning_key.clear()


_handles: dict[tuple[str, str | None, str | None], OpHandle] = {}


def get(op: str, *, vendor: str | None = None, variant: str | None = None) -> OpHandle:
    """The callable for `op`: `registry.get("sparse_mla")(q, kv, idx)`."""
    handle = _handles.get((op, vendor, variant))
    if handle is None:
        handle = _handles[(op, vendor, variant)] = OpHandle(_op(op), vendor, variant)
    return handle


def clear_caches() -> None:
    """Forget every resolved key (after a sweep or a table import in this process)."""
    for handle in _handles.values():
        handle.clear_cache()
    _user_store.cache_clear()
    shipped_tables.cache_clear()
