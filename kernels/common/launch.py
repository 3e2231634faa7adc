"""Launching a Triton kernel again without Triton's per-launch specialization, when it provably matches.

`kernel[grid](*args, **kwargs)` costs Triton 3.6 tens of microseconds of host time per launch on a GPU
host, most of it in `JITFunction.run` working out the specialization of every argument again (one
`native_specialize_impl` call each, then a string key over all of them). Dispatch keeps one launcher per
tuning key (registry/dispatch.py), so its launches repeat the same kernels with the same config.
`LaunchCache` keeps the compiled kernel of such a launch with what it specialized on, and launches it
directly when a later launch would specialize alike. What it compares is everything Triton 3.6
specializes on:

- the keyword arguments (constexprs and launch options) by type and value; the grid only by its
  number of dimensions (each positive): the launch takes the call's grid;
- the type of every positional argument, and each one after the last tensor (sizes, strides, flags)
  as Triton specializes it: equal values, or Triton's own class of each (`native_specialize_impl`:
  an int's type, whether it is 1 and whether 16 divides it), so that a KV cache one token longer
  or a new varlen batch takes the recorded kernel (a constexpr passed by position is compared by
  value: it is compiled in); floats always specialize as fp32, so their values are not compared;
- each tensor's dtype, and that every tensor is 16-byte aligned (a launch with a misaligned tensor is
  never recorded); None where the recorded launch had None;
- each TMA tensor descriptor's type as Triton mangles it (element type, block shape, shared layout:
  all Triton 3.6 specializes a host descriptor on). Triton's launcher encodes a tensor map on every
  launch; a recorded launch keeps the encoded maps of the descriptors it has seen by what they encode
  (base address, shape, strides, padding), so a call on tensors seen before encodes none;
- the current device (a compiled kernel is loaded per device).

Anything else takes Triton's own path: a launch that matches no record, a kernel that is not a compiled
JIT function (the interpreter), a launch with a scalar among its tensors, a Triton other than the 3.6
series (whose launch protocol this follows), a kernel with pre-run hooks, or any launch hook (profilers)
set. A launch through the cache is the one Triton would make: the same compiled kernel and launcher, on
the current stream (so CUDA-graph capture works). Not seen by it: a change of Triton's runtime knobs
(`debug`, instrumentation) or of a global a kernel reads after it was recorded; `registry.clear_caches()`
drops every cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import reduce
from operator import attrgetter, itemgetter, or_
from typing import Any

import torch
import triton
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.runtime.driver import driver
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

# The launch protocol below (CompiledKernel.run's arguments, the launch hooks) is Triton 3.6's; another
# version keeps Triton's own path.
SUPPORTED = triton.__version__.startswith("3.6.")
_dtype = attrgetter("dtype")
# Host-side TMA descriptors (Triton's and Gluon's): passed through to the compiled launcher, which
# encodes their tensor maps; a record keeps their mangled types, never the descriptors (or tensors).
_DESCRIPTORS = (TensorDescriptor, GluonDescriptor)
_data_ptr = torch.Tensor.data_ptr  # raises TypeError for anything but a tensor
# The current GPU, read without torch.cuda.current_device's lazy-init check (a record exists only after a
# launch, so the device is initialized): what Triton's driver reads, a Python call sooner.
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)
try:
    from triton.backends.nvidia.driver import _BASE_ARGS_FORMAT_LEN as _LAUNCH_ARGS_BEFORE_PARAMETERS
    from triton.backends.nvidia.driver import CudaLauncher as _CudaLauncher
    from triton.backends.nvidia.driver import make_tensordesc_arg as _tensor_map_args
except ImportError:  # a Triton without the NVIDIA backend: every launch goes through the launcher's call
    _CudaLauncher = _tensor_map_args = _LAUNCH_ARGS_BEFORE_PARAMETERS = None


def triton_launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> Any:
    """`kernel[grid](*args, **kwargs)`: the launch of a launcher that keeps no cache."""
    return kernel[grid](*args, **kwargs)


class _Record:
    """What one launch of a kernel specialized on, and the compiled kernel it ran. Holds no tensor."""

    __slots__ = ("grid_types", "kwargs", "kwarg_types", "arg_types", "split", "scalars", "exact", "exact_values",
                 "exact_classes", "constants", "constant_values", "tensors", "dtypes", "descriptors",
                 "descriptor_types", "descriptor_fields", "device", "compiled", "current_device", "current_stream",
                 "tail", "run")

    def matches(self, grid: tuple, args: tuple, kwargs: dict) -> bool:
        """Whether a launch specializes as the recorded one: the checks are maps and compares that run
        in C, types before values (an int compared with a tensor would compare elementwise). The grid
        only has to be as many positive ints: the launch takes the call's own."""
        if tuple(map(type, grid)) != self.grid_types or min(grid) < 1:
            return False
        if tuple(map(type, kwargs.values())) != self.kwarg_types or kwargs != self.kwargs:
            return False
        if tuple(map(type, args)) != self.arg_types:
            return False
        scalars = args[self.split:]
        # Floats specialize only as fp32: another value (a new sm_scale) still matches. Other values
        # match when Triton specializes them alike (a cache one key longer, new sizes and strides).
        if scalars != self.scalars:
            exact = self.exact(scalars)
            if exact != self.exact_values and (self.constants(scalars) != self.constant_values
                                               or not _same_classes(exact, self.exact_values, self.exact_classes)):
                return False
        if self.descriptor_types:
            descriptors = self.descriptors(args)
            # The fields the mangled type is made of, compared first (launchers pass the same cached
            # layout objects, which compare by identity); Triton's own mangling decides otherwise.
            if (tuple(map(_descriptor_fields, descriptors)) != self.descriptor_fields
                    and tuple(map(mangle_type, descriptors)) != self.descriptor_types):
                return False
        tensors = self.tensors(args)
        return tuple(map(_dtype, tensors)) == self.dtypes and _aligned(tensors)


def _aligned(tensors: tuple) -> bool:
    """Whether every tensor is 16-byte aligned, as every recorded one was: the OR of the addresses has
    its low bits clear."""
    return not reduce(or_, map(_data_ptr, tensors), 0) & 15


def _record(kernel: Any, compiled: Any, grid: tuple, args: tuple, kwargs: dict) -> _Record | None:
    """The record of a launch Triton just made, or None when later launches must take Triton's path."""
    if not SUPPORTED or getattr(kernel, "pre_run_hooks", True) or not all(
            hasattr(compiled, name) for name in ("function", "packed_metadata", "run")):
        return None
    if not 1 <= len(grid) <= 3 or not all(type(g) is int for g in grid):
        return None
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    descriptors = [i for i, a in enumerate(args) if isinstance(a, _DESCRIPTORS)]
    split = max(positions + descriptors) + 1 if positions or descriptors else 0
    if any(args[i] is not None for i in range(split) if i not in positions and i not in descriptors):
        return None  # a scalar among the tensors: it would not be compared
    if any(args[i].data_ptr() % 16 for i in positions):
        return None  # a misaligned pointer: rare enough to leave to Triton
    if any(isinstance(value, (torch.Tensor, *_DESCRIPTORS)) for value in kwargs.values()):
        return None  # a tensor or descriptor by keyword: only positional ones are compared
    names = kernel.arg_names[len(args):]
    if any(name not in kwargs for name in names):
        return None  # a parameter left to its default
    rec = _Record()
    rec.grid_types = tuple(map(type, grid))
    rec.kwargs, rec.kwarg_types = dict(kwargs), tuple(map(type, kwargs.values()))
    rec.arg_types, rec.split, rec.scalars = tuple(map(type, args)), split, args[split:]
    rec.exact = _picker([i for i, a in enumerate(rec.scalars) if type(a) is not float])
    rec.exact_values = rec.exact(rec.scalars)
    rec.exact_classes = tuple(map(_specialization, rec.exact_values))
    # A constexpr passed by position is compiled in by value: such a value is compared as it is.
    params = getattr(kernel, "params", ())
    rec.constants = _picker([i - split for i, p in enumerate(params[:len(args)])
                             if i >= split and p.is_constexpr])
    rec.constant_values = rec.constants(rec.scalars)
    rec.tensors = _picker(positions)
    rec.dtypes = tuple(args[i].dtype for i in positions)
    rec.descriptors = _picker(descriptors)
    rec.descriptor_types = tuple(mangle_type(args[i]) for i in descriptors)
    rec.descriptor_fields = tuple(_descriptor_fields(args[i]) for i in descriptors)
    rec.current_device = _cuda_get_device or driver.active.get_current_device
    rec.current_stream = driver.active.get_current_stream
    rec.device = rec.current_device()
    rec.compiled = compiled
    rec.tail = tuple(kwargs[name] for name in names)
    rec.run = _prepared_launch(compiled, len(grid), rec.tail)
    return rec


def _same_classes(values: tuple, recorded: tuple, classes: tuple) -> bool:
    """Whether `values` specialize as the recorded values did: only the values that changed are asked
    (a cache one key longer changes a few of a launch's two dozen scalars)."""
    return all(new == old or _specialization(new) == cls
               for new, old, cls in zip(values, recorded, classes, strict=True))


def _specialization(value: Any) -> tuple:
    """How Triton specializes a scalar parameter: its own answer (type, and for an int whether it is 1,
    which becomes a constant, and whether 16 divides it)."""
    return native_specialize_impl(BaseBackend, value, False, True, True)


def _prepared_launch(compiled: Any, dims: int, tail: tuple, makers: tuple | None = None):
    """`run(stream, grid, args)`: the compiled kernel's launch over a grid of `dims` dimensions on `args`
    (then the recorded `tail` of parameters Triton passes after them), with no hook set. Triton's
    launcher gets None for the metadata and both hooks and skips them. A CUDA launcher that needs no
    scratch memory is called below its Python wrapper, whose only work is allocating that scratch (a few
    microseconds a launch).

    With `makers` ((position, make descriptor from tensor) pairs, `LaunchCache.signed`), `args` hold
    tensors where the kernel takes descriptors: None when this launcher cannot encode their tensor maps
    from tensors (the caller then makes the descriptors)."""
    launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    if (_CudaLauncher is not None and type(launcher) is _CudaLauncher and not launcher.global_scratch_size
            and not launcher.profile_scratch_size):
        cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        direct = _with_kept_tensor_maps(launcher.launch, makers)
        if direct is None:
            return None
        if dims == 1:
            return lambda stream, grid, args: direct(grid[0], 1, 1, stream, function, cooperative, pdl, None, None,
                                                     metadata, None, None, None, *args, *tail)
        if dims == 2:
            return lambda stream, grid, args: direct(grid[0], grid[1], 1, stream, function, cooperative, pdl, None,
                                                     None, metadata, None, None, None, *args, *tail)
        return lambda stream, grid, args: direct(*grid, stream, function, cooperative, pdl, None, None, metadata,
                                                 None, None, None, *args, *tail)
    if makers is not None:
        return None
    pad = (1, 1)[: 3 - dims]
    return lambda stream, grid, args: launcher(*grid, *pad, stream, function, metadata, None, None, None, *args,
                                               *tail)


# Encoded tensor maps kept per descriptor parameter of a record; past it they are forgotten at once
# (addresses that never repeat).
MAX_TENSOR_MAPS = 64


def _with_kept_tensor_maps(launch: Any, makers: tuple | None = None) -> Any:
    """The C launch of a kernel with TMA descriptor parameters, which Triton 3.6 wraps in a function
    (`wrap_handle_tensordesc`'s `inner`) that encodes each descriptor's tensor map on every launch,
    replaced by one that encodes a map once per (base address, shape, strides, padding) and then passes
    the kept one: the same arguments, without the encoding. The encoding depends on nothing else but the
    compiled kernel's descriptor metadata (swizzle, element type, block size), which is the record's.
    Any other launch, or a wrapper not shaped as 3.6's, is returned as it is.

    With `makers` ((position, make descriptor from tensor) pairs for exactly the descriptor parameters),
    the launch takes tensors there and keeps each map by the tensor's address, shape and strides (a
    maker is fixed per record, so they decide the descriptor); None when that cannot be done."""
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if _tensor_map_args is None or code is None or code.co_name != "inner" or not closure:
        return launch if makers is None else None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure), strict=True))
    raw, indices, metas = (cells.get(name) for name in ("launcher", "tensordesc_indices", "tensordesc_meta"))
    if raw is None or not indices or metas is None or len(metas) != len(indices) or None in metas:
        return launch if makers is None else None  # no metadata: Triton passes the descriptor's tensor itself
    make = dict(makers) if makers is not None else None
    if make is not None and set(make) != set(indices):
        return None
    # Last position first, so that splicing a map's arguments in leaves the earlier positions in place.
    encoders = [(_LAUNCH_ARGS_BEFORE_PARAMETERS + i, _tensor_map_encoder(meta, make and make[i]))
                for i, meta in sorted(zip(indices, metas, strict=True))][::-1]

    def launch_with_kept_maps(*args: Any) -> Any:
        args = list(args)
        for position, encode in encoders:
            args[position:position + 1] = encode(args[position])
        return raw(*args)

    return launch_with_kept_maps


def _tensor_map_encoder(meta: dict, make: Callable[[torch.Tensor], Any] | None = None):
    """`encode(descriptor)`: the arguments Triton's launcher passes for one descriptor parameter (its
    encoded tensor map, shape and strides), kept by what they encode; holds no tensor. With `make`,
    `encode(tensor)`, the descriptor `make(tensor)`'s, kept by the tensor's address, shape and strides."""
    kept: dict[tuple, list] = {}

    if make is not None:
        def encode_tensor(t: torch.Tensor) -> list:
            key = (_data_ptr(t), t.shape, t.stride())
            found = kept.get(key)
            if found is None:
                if len(kept) >= MAX_TENSOR_MAPS:
                    kept.clear()
                found = kept[key] = _tensor_map_args(make(t), meta)
            return found

        return encode_tensor

    def encode(desc: Any) -> list:
        key = (_data_ptr(desc.base), *desc.shape, *desc.strides, desc.padding)
        found = kept.get(key)
        if found is None:
            if len(kept) >= MAX_TENSOR_MAPS:
                kept.clear()
            found = kept[key] = _tensor_map_args(desc, meta)
        return found

    return encode


def _descriptor_fields(desc: Any) -> tuple:
    """What Triton 3.6 mangles a host descriptor's type from (its class, element type, block shape and
    Gluon's shared layout), and its padding, which the mangling leaves out (comparing it only costs a
    match)."""
    return (desc.__class__, desc.base.dtype, *desc.block_shape, getattr(desc, "layout", None), desc.padding)


def _picker(positions: list[int]):
    """A function of a tuple returning its items at `positions`, as a tuple (itemgetter's, in C)."""
    if len(positions) > 1:
        return itemgetter(*positions)
    if positions:
        one = itemgetter(positions[0])
        return lambda items: (one(items),)
    return lambda items: ()


def _hooks_set() -> bool:
    """Whether a launch hook (a profiler's) is set: Triton 3.6 keeps them in HookChains; anything else
    set there counts as a hook."""
    runtime = knobs.runtime
    return bool(getattr(runtime.launch_enter_hook, "calls", True) or getattr(runtime.launch_exit_hook, "calls", True))


# Specializations kept per kernel (a flag outside the raw key, such as return_lse, on and off).
MAX_RECORDS = 4
# Launches through Triton with no hit between, past which a kernel stops recording: its launches differ
# every time (each record costs about as much host time as Triton's own specialization).
MAX_MISSES = 16


class _Site:
    """One kernel's records in a cache, newest first, and how many of its launches went through Triton
    after its first. Sites are found by the kernel's id (a JIT function hashes in Python); the site
    holds the kernel, so that id stays its own."""

    __slots__ = ("kernel", "records", "misses")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.records: tuple[_Record, ...] = ()
        self.misses = 0


# Signatures a cache keeps the record of (`LaunchCache.signed`); past it they are all forgotten at once.
MAX_SIGNATURES = 64


class LaunchCache:
    """The kernels of one tuning key's launches: `cache(kernel, grid, *args, **kwargs)` launches as
    `kernel[grid](*args, **kwargs)` does, skipping Triton's specialization when the launch matches one
    recorded for the kernel (the module docstring says what is compared). A kernel's first launch in a
    cache records nothing (a key called once costs nothing more); later launches through Triton record
    theirs, up to MAX_RECORDS per kernel, until MAX_MISSES of them come with no hit between.

    `cache.signed(signature, kernel, grid, args, kwargs)` is the same launch for a caller that can name,
    in one hashable `signature`, everything the comparison looks at but the tensors' addresses, the
    floats' values and the grid's values: its launches skip the comparison."""

    __slots__ = ("_sites", "_signed")

    def __init__(self) -> None:
        self._sites: dict[Any, _Site] = {}
        # signature -> (its record, the picker of the call's tensor arguments, the launch of the call's args)
        self._signed: dict[Any, tuple[_Record, Callable, Callable]] = {}

    def __call__(self, kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> Any:
        return self._launch(kernel, grid, args, kwargs)[0]

    def signed(self, signature: Any, kernel: Any, grid: tuple, args: tuple, kwargs: dict, makers: tuple = ()) -> Any:
        """`self(kernel, grid, *args, **kwargs)`, where launches of one `signature` are promised to be of
        one kernel and to specialize alike: the same keyword arguments, argument types, tensor dtypes,
        descriptor types, constexprs and ints of the same Triton class (a signature of the shapes
        and flags the arguments are made from fixes all of these). Once such a launch took or made a
        record, later ones of its signature take that record with only their tensors' alignment, the
        current device and the launch hooks checked. A signature that breaks the promise launches a
        kernel specialized for another launch: callers name every input the arguments depend on.

        The argument tuple and keyword dict are taken as they are (a caller that keeps them per
        signature packs nothing; on a hit `kwargs` is not read). `makers` pairs each TMA descriptor
        parameter passed as the tensor it covers with the function that makes its descriptor from that
        tensor, the same for every launch of the signature: a hit makes no descriptor, its tensor maps
        are encoded from the tensors (once per address, shape and strides)."""
        found = self._signed.get(signature)
        if found is not None:
            rec, tensors, run = found
            if _aligned(tensors(args)):
                device = rec.current_device()
                if device == rec.device and not _hooks_set():
                    run(rec.current_stream(device), grid, args)
                    return rec.compiled
        compiled, rec = self._launch(kernel, grid, _with_descriptors(args, makers) if makers else args, kwargs)
        if rec is not None:
            if len(self._signed) >= MAX_SIGNATURES:
                self._signed.clear()
            if makers:
                positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
                self._signed[signature] = (rec, _picker(positions), _tensor_launch(rec, makers))
            else:
                self._signed[signature] = (rec, rec.tensors, rec.run)
        return compiled

    def _launch(self, kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> tuple[Any, _Record | None]:
        """The launch: through the record it matches, or Triton's. Returns the compiled kernel and the
        record launched or just made (None when there is none)."""
        site = self._sites.get(id(kernel))
        if site is not None:
            for rec in site.records:
                if rec.matches(grid, args, kwargs):
                    device = rec.current_device()
                    if device != rec.device:
                        continue  # another device's record
                    if _hooks_set():
                        break
                    # No hook is set: Triton would pass its empty hook chains, which do nothing.
                    rec.run(rec.current_stream(device), grid, args)
                    if site.misses:
                        site.misses = 0  # misses since the last hit are what stops recording
                    return rec.compiled, rec
        compiled = kernel[grid](*args, **kwargs)
        rec = None
        if site is None:
            self._sites[id(kernel)] = _Site(kernel)
        elif site.misses < MAX_MISSES:
            site.misses += 1
            rec = None if _hooks_set() else _record(kernel, compiled, grid, args, kwargs)
            if rec is not None:
                site.records = (rec, *site.records[: MAX_RECORDS - 1])
        return compiled, rec


def _with_descriptors(args: tuple, makers: tuple) -> list:
    """`args` with the tensor at each maker's position replaced by its descriptor."""
    args = list(args)
    for position, make in makers:
        args[position] = make(args[position])
    return args


def _tensor_launch(rec: _Record, makers: tuple) -> Callable:
    """`run(stream, grid, args)` of a record made with descriptors, for args holding the descriptors'
    tensors: the tensor maps encoded from the tensors where the launcher allows it, else the
    descriptors made for the record's own launch."""
    direct = _prepared_launch(rec.compiled, len(rec.grid_types), rec.tail, makers)
    if direct is not None:
        return direct
    run = rec.run
    return lambda stream, grid, args: run(stream, grid, _with_descriptors(args, makers))


# Keys drawn by callers that keep a launch's arguments per call signature (`signature_key`).
_signature_keys = itertools.count()


def signature_key() -> int:
    """A key for `LaunchCache.signed` no other launch has, for a caller that keeps one launch's
    arguments per call signature: hashing it costs nothing, and arguments made again (after the
    caller dropped them) draw a new one, so they never take another launch's record."""
    return next(_signature_keys)


# Call signatures a launcher keeps its launch arguments for (`kept_arguments`); past it they are all dropped.
MAX_PREPARED = 64


def kept_arguments(prepared: dict | None, signature: Any, make: Callable[..., tuple], *inputs: Any) -> tuple:
    """A launch's arguments (grid, scalars, keyword arguments, ..., and a `signature_key()` last) for one
    call signature: those `prepared` (a dict a plan keeps) holds for it, else `make(*inputs)`, kept there.
    Without a dict they are made every time."""
    fixed = prepared.get(signature) if prepared is not None else None
    if fixed is None:
        fixed = make(*inputs)
        if prepared is not None:
            if len(prepared) >= MAX_PREPARED:
                prepared.clear()
            prepared[signature] = fixed
    return fixed


def launch_signed(launch: Any, signature: Any, kernel: Any, grid: tuple, args: tuple, kwargs: dict,
                  makers: tuple = ()) -> Any:
    """`LaunchCache.signed` when `launch` is a LaunchCache and `signature` is not None; otherwise
    `launch(kernel, grid, *args, **kwargs)` (Triton's own launch, or an unsigned cached one), with the
    descriptors of `makers`' positions made first."""
    if signature is not None and isinstance(launch, LaunchCache):
        return launch.signed(signature, kernel, grid, args, kwargs, makers)
    return launch(kernel, grid, *(_with_descriptors(args, makers) if makers else args), **kwargs)
