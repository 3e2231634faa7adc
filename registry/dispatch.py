"""From a call to a launch: pick the variant, find its tuned call config, cache the bound launcher.

Lookup order on a cache miss (docs/architecture.md): user database -> shipped tables -> nearest tuned
key for the same op and device -> the highest-priority supporting variant's heuristic default. After
the first call for a key, a call costs the op's validation, a read of the device, two dict lookups and
the tuning key's launcher, which keeps the compiled kernels of its launches (`Variant.bind_cached`).
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

from kreg.core.device import CPU, INTERPRETER_VENDOR, VENDORS, DeviceInfo, detect, interpreter_enabled
from kreg.core.records import CallConfig, TunedConfig, canonical_json
from kreg.ops import OPS
from kreg.ops.catalog import entry_problem, load_all
from kreg.ops.contract import Args, Op
from kreg.ops.variant import CallPlan
from kreg.registry.library import register_all, traced_call

if TYPE_CHECKING:
    from kreg.ops.variant import Variant

# True while torch.compile (or torch.export) traces a call: a module-level name, read once per call.
_is_compiling = torch.compiler.is_compiling


@dataclass(frozen=True)
class Choice:
    """What a key resolved to: the variant (None: the PyTorch reference), its plan (call config, key and
    device: what the variant launches with), where the config came from, and its launchers: `launcher`
    (`Variant.bind`) and `cached_launcher` (`Variant.bind_cached`: the one dispatch runs, shared by every
    raw key of the tuning key, so that a new raw key, such as a KV cache one token longer, launches
    through the compiled kernels its tuning key already recorded)."""

    variant: Variant | None
    plan: CallPlan | None
    source: str  # "database", "tables", "nearest-database", "nearest-tables", "default", "autotune", "reference"
    launcher: Callable[[dict], Any]
    cached_launcher: Callable[[dict], Any]

    @property
    def config(self) -> CallConfig | None:
        return None if self.plan is None else self.plan.config


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
    from kreg.tuning_db.store import TuningStore

    return TuningStore(url)


def user_store():
    """The user's tuning database (KREG_TUNING_DB or the default file), opened once per URL. Opening
    creates nothing: a database that does not exist yet reads as empty."""
    from kreg.tuning_db.environment import default_url

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
    that does not fit its variant (`ops.catalog.entry_problem`: unknown variant, config outside its
    space) is passed over with a warning, and the source's next candidate counts."""
    from kreg.tuning_db.environment import default_url
    from kreg.tuning_db.errors import redact, safe_url
    from kreg.tuning_db.table_files import shipped_tables

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


def _reference_choice(op: Op) -> Choice:
    def run(a: dict) -> Any:
        return op.reference(**a)

    return Choice(None, None, "reference", run, run)


def _bound(variant: Variant, config: CallConfig, source: str, dims: dict, device: DeviceInfo) -> Choice:
    plan = CallPlan(variant.complete(config, dims, device), dims, device)
    return Choice(variant, plan, source, variant.bind(plan), variant.bind_cached(plan))


def resolve(op: Op, vendor: str, variant: str | None, key: tuple, device: DeviceInfo, args: dict) -> Choice:
    """Pick (variant, call config) for one key. Runs once per key per process."""
    dims = dict(key)
    pool = candidates(op.name, vendor, variant, dims, device)
    if not pool:
        _warn_once(f"kreg: no {vendor} variant of {op.name} supports {canonical_json(dims)}; "
                   "running the PyTorch reference")
        return _reference_choice(op)
    by_name = {v.name: v for v in pool}
    key_json = canonical_json(dims)
    for source, lookup in tuned_lookups(op, device, key_json, dims):
        tuned: TunedConfig | None = lookup()
        if tuned is not None and tuned.variant in by_name and tuned.variant_vendor == vendor:
            return _bound(by_name[tuned.variant], tuned.config, source, dims, device)
    if os.environ.get("KREG_AUTOTUNE") == "1" and device.key != "cpu":
        from kreg.tuning.autotune import autotune_call
        from kreg.tuning_db.errors import TuningDatabaseError

        try:
            tuned = autotune_call(op, pool, device, args, user_store())
        except TuningDatabaseError as err:  # an unwritable or damaged store: tune nothing, run the default
            _warn_once(f"kreg: tuning on first use needs a writable tuning database; running defaults: {err}")
            tuned = None
        if tuned is not None:
            return _bound(by_name[tuned.variant], tuned.config, "autotune", dims, device)
    chosen = pool[0]
    return _bound(chosen, chosen.default_config(dims, device), "default", dims, device)


# Raw keys whose launchers a handle keeps per device; past it the oldest is dropped (varlen calls make a
# new raw key for every new set of lengths).
MAX_RAW_KEYS = 1024


class OpHandle:
    """`registry.get(op)`: validates a call, dispatches it, and caches the launcher per key.

    The hot path after a key's first call: the op's validation, one read of the device, two dict
    lookups (the device, then the raw key validation returns as `Args.key`: shapes, dtype and flags as
    read), the launcher stored for the raw key: the variant's `bind_cached` of its tuning key, whose
    launches skip Triton's per-launch specialization when they provably match an earlier launch of the
    tuning key (kernels/common/launch.py). The canonical tuning key is computed only on a miss; new raw
    keys that map to a known tuning key (another sequence length in its bucket, the other layout) reuse
    its resolution and its launcher. Validation runs on every call: a call signature that would let it
    be skipped costs as much to read as the validation (benchmarks/NOTES.md, "Dispatch v4"). Under
    torch.compile the call becomes the op's `kreg::<op>` custom op instead (registry/library.py), which
    runs this same eager path at run time.
    """

    def __init__(self, op: Op, vendor: str | None, variant: str | None) -> None:
        if vendor is not None and vendor not in VENDORS:
            raise ValueError(f"vendor: expected one of {', '.join(map(repr, VENDORS))} or None, got {vendor!r}")
        self.op = op
        self.vendor = vendor
        self.variant = variant
        self._validate = op.validate
        self._device_arg = next(iter(inspect.signature(op.validate).parameters))
        # torch.device -> {raw key: its launcher (bind_cached)}; torch.device -> (vendor, or "" for the
        # reference; DeviceInfo).
        self._launchers: dict[torch.device, dict[Any, Callable[[dict], Any]]] = {}
        self._targets: dict[torch.device, tuple[str, DeviceInfo]] = {}
        self._by_tuning_key: dict[tuple[str, tuple], Choice] = {}
        self._lock = threading.Lock()
        self._reference_choice = _reference_choice(op)
        self.__doc__ = op.validate.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return traced_call(self, args, kwargs)
        a = self._validate(*args, **kwargs)
        try:
            launch = self._launchers[a[self._device_arg].device][a.key]
        except (KeyError, AttributeError):  # a new key or device, or a plain-dict validation
            launch = self._launcher(a)
        return launch(a)

    def eager(self, kwargs: dict) -> Any:
        """The call with keyword arguments, run eagerly whatever traces it (the custom op's body)."""
        a = self._validate(**kwargs)
        try:
            launch = self._launchers[a[self._device_arg].device][a.key]
        except (KeyError, AttributeError):
            launch = self._launcher(a)
        return launch(a)

    def launcher(self, *args: Any, **kwargs: Any) -> Callable[[dict], Any]:
        """The launcher a call with these arguments runs after validation (its raw key's, made as a
        call would make it), without launching anything: `handle.launcher(...)(validated args)`."""
        return self._launcher(self._validate(*args, **kwargs))

    def _launcher(self, a: dict) -> Callable[[dict], Any]:
        """The raw key's launcher, its tuning key's `cached_launcher`, found on the raw key's first call
        and kept (the reference's too, when no kernel variant serves the key, so that such calls also
        skip the tuning key after their first)."""
        choice = self._choose(a)
        raw = a.key if a.__class__ is Args else self.op.tuning_key(a)
        launchers = self._launchers.setdefault(a[self._device_arg].device, {})
        launch = launchers.get(raw)
        if launch is None:
            if len(launchers) >= MAX_RAW_KEYS:  # shapes that change on every call: drop the oldest
                launchers.pop(next(iter(launchers), None), None)
            # setdefault: of two threads storing a raw key's launcher, both keep the one stored first.
            launch = launchers.setdefault(raw, choice.cached_launcher)
        return launch

    def _target(self, dev: torch.device) -> tuple[str, DeviceInfo]:
        """(vendor, or "" when the PyTorch reference runs; DeviceInfo) for a device, checked once."""
        found = self._targets.get(dev)
        if found is not None:
            return found
        if dev.type == "cpu":
            if self.vendor is None and self.variant is None:
                found = ("", CPU)  # plain CPU call: the reference
            elif not interpreter_enabled():
                raise RuntimeError(
                    f"{self.op.name}: a Triton variant on CPU tensors needs the interpreter; "
                    "set TRITON_INTERPRET=1 before importing kreg, or pass CUDA/ROCm tensors")
            else:
                found = (self.vendor or INTERPRETER_VENDOR, CPU)
        else:
            info = detect(dev)
            if self.vendor is not None and self.vendor != info.vendor:
                raise ValueError(f"vendor: {self.vendor!r} variants cannot run on {info.name} ({info.vendor})")
            found = (info.vendor, info)
        self._targets[dev] = found
        return found

    def _choose(self, a: dict) -> Choice:
        """The choice for validated arguments, resolved on the first call of its tuning key and cached
        (the reference's for a plain CPU call)."""
        dev = a[self._device_arg].device
        vendor, info = self._target(dev)
        if not vendor:
            return self._reference_choice
        with self._lock:
            key = self.op.tuning_key(a)
            choice = self._by_tuning_key.get((info.key, key))
            if choice is None:
                choice = resolve(self.op, vendor, self.variant, key, info, a)
                self._by_tuning_key[(info.key, key)] = choice
        return choice

    def choice(self, *args: Any, **kwargs: Any) -> Choice:
        """What a call with these arguments runs (variant, call config, where the config came from),
        resolved and cached as a call would, without launching anything."""
        return self._choose(self._validate(*args, **kwargs))

    def gradients(self, a: dict, outputs: tuple, grad: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """Gradients of the first output (cotangent `grad`) for the op's grad_inputs, given validated
        arguments and the forward's outputs: the chosen variant's backward kernels when it has them
        (`Variant.backward`), else the reference's (recomputed through torch.func.vjp). What the
        custom op's backward runs (registry/library.py)."""
        choice = self._choose(a)
        if choice.variant is not None:
            found = choice.variant.backward(a, choice.plan, outputs, grad)
            if found is not None:
                return found
        return reference_vjp(self.op, a, grad)

    def clear_cache(self) -> None:
        self._launchers.clear()
        self._targets.clear()
        self._by_tuning_key.clear()


def reference_vjp(op: Op, a: dict, grad: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The reference's gradients of its first output for the tensors among `op.grad_inputs`, through
    torch.func.vjp (which works where autograd recording is off, as inside a custom op)."""
    names = [name for name in op.grad_inputs if isinstance(a.get(name), torch.Tensor)]

    def first_output(*tensors: torch.Tensor) -> torch.Tensor:
        result = op.reference(**{**a, **dict(zip(names, tensors, strict=True))})
        return result if isinstance(result, torch.Tensor) else result[0]

    out, vjp = torch.func.vjp(first_output, *(a[name] for name in names))
    return dict(zip(names, vjp(grad.to(out.dtype)), strict=True))


_handles: dict[tuple[str, str | None, str | None], OpHandle] = {}
# The same handles without vendor or variant, by op name alone: `registry.get(op)` in a hot loop.
_plain_handles: dict[str, OpHandle] = {}


def get(op: str, *, vendor: str | None = None, variant: str | None = None) -> OpHandle:
    """The callable for `op`: `registry.get("sparse_mla")(q, kv, idx)`."""
    if vendor is None and variant is None:
        handle = _plain_handles.get(op)
        if handle is not None:
            return handle
    handle = _handles.get((op, vendor, variant))
    if handle is None:
        handle = _handles[(op, vendor, variant)] = OpHandle(_op(op), vendor, variant)
        if vendor is None and variant is None:
            _plain_handles[op] = handle
    return handle


def _create_handles() -> None:
    # Created at import: a handle created inside torch.compile's trace would break the graph (its
    # constructor is not traceable), so every (op, vendor) handle exists before any trace.
    for name in OPS:
        for vendor in (None, *VENDORS):
            get(name, vendor=vendor)


_create_handles()
register_all(get)


def clear_caches() -> None:
    """Forget every resolved key (after a sweep or a table import in this process)."""
    for handle in _handles.values():
        handle.clear_cache()
    _user_store.cache_clear()
    from kreg.tuning_db.table_files import shipped_tables

    shipped_tables.cache_clear()
