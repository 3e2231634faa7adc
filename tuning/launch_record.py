"""What a call launches, found by running it: the offline compile check's input, derived from the
launchers themselves so that it cannot drift from the kernels that ship.

`record_calls` runs a variant on "meta" tensors (shapes and strides, no data) with a `CallPlan` for
the target device, while `kernel[grid](...)` records its launch instead of running it (only in the
recording thread: launches of other threads go to the GPU as usual). It runs the forward, the backward
of a differentiable op, the calls the op's `specializations` name and the calls a role's
`role_arguments` make, in every layout of the shape. `specialize` then types each recorded launch for
the target exactly as Triton's JIT would at run time (its own binder: pointer alignment, int32 or
int64 range, integer values equal to 1 or divisible by 16, AMD's 32-bit pointer ranges), which is what
`triton.compile` takes.

Kernels must be compiled JIT functions: a process with TRITON_INTERPRET set cannot record them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from triton.runtime.jit import JITFunction, create_function_from_signature

from kreg.core.device import DeviceInfo
from kreg.core.records import CallConfig, is_backward_role
from kreg.ops import OPS
from kreg.ops.variant import CallPlan, Variant


@dataclass(frozen=True)
class KernelLaunch:
    """One recorded `kernel[grid](*args, **kwargs)` and the roles it belongs to (`record_calls`)."""

    kernel: JITFunction
    args: tuple
    kwargs: dict
    roles: frozenset[str]


@dataclass(frozen=True)
class CompileJob:
    """One kernel launch typed for one target as the JIT types it: what `triton.compile` takes, with the
    kernel named by module and name so that a worker process can import it."""

    roles: frozenset[str]
    module: str
    name: str
    gluon: bool
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[tuple[int, ...], Any], ...]
    attrs: tuple[tuple[tuple[int, ...], tuple], ...]
    options: tuple[tuple[str, Any], ...]

    def kernel(self) -> JITFunction:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)


# ----------------------------------------------------------------------------- recording
_local = threading.local()
_lock = threading.Lock()
_recorders = 0
_triton_run = JITFunction.run


def _run(self, *args, grid, warmup, **kwargs):
    launches = getattr(_local, "launches", None)
    if launches is None:
        return _triton_run(self, *args, grid=grid, warmup=warmup, **kwargs)
    launches.append((self, args, kwargs))
    return None


@contextmanager
def recorded_launches() -> Iterator[list[tuple[JITFunction, tuple, dict]]]:
    """Within the block, this thread's kernel launches are recorded as (kernel, args, kwargs), not run."""
    global _recorders
    with _lock:
        _recorders += 1
        JITFunction.run = _run
    _local.launches = launches = []
    try:
        yield launches
    finally:
        _local.launches = None
        with _lock:
            _recorders -= 1
            if not _recorders:
                JITFunction.run = _triton_run


def meta_calls(op_name: str, shape: Mapping[str, Any], dtype: torch.dtype) -> list[dict]:
    """Validated arguments on "meta" tensors for a preset-style shape, in every layout the contract
    accepts, each with the op's specializations: every call of the shape's tuning key that the
    compile check must see."""
    op = OPS[op_name]
    calls = []
    for layout in op.layouts(dict(shape)):
        args = op.validate(**op.make_inputs(layout, device=torch.device("meta"), dtype=dtype, seed=0))
        calls += op.specializations(args)
    return calls


def meta_like(op_name: str, args: Mapping[str, Any]) -> list[dict]:
    """A caller's validated arguments as "meta" tensors of the same shapes, strides and dtypes, with the
    op's specializations (tuning on first use checks the call it tunes)."""
    op = OPS[op_name]
    meta = {name: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
            if isinstance(v, torch.Tensor) else v for name, v in args.items()}
    return op.specializations(op.validate(**meta))


def record_calls(variant: Variant, calls: list[dict], config: CallConfig, device: DeviceInfo) -> list[KernelLaunch]:
    """Every kernel launch that `calls` (validated meta arguments of one tuning key) make with `config`
    on `device`: forward, backward where the variant has one, and each role's `role_arguments` calls.
    A launch belongs to the roles whose kernel it is; a kernel the variant hands some calls to (a tiled
    fallback, whose config may follow the role's) belongs to every role of the phase that launched it."""
    op = OPS[variant.op]
    roles_of: dict[int, set[str]] = {}
    for role, kernel in variant.kernels.items():
        roles_of.setdefault(id(kernel), set()).add(role)
    phases = {False: frozenset(r for r in variant.roles if not is_backward_role(r)),
              True: frozenset(r for r in variant.roles if is_backward_role(r))}
    extra_sets = [dict(extra) for extra in {tuple(sorted(a.items())) for a in variant.role_arguments.values()}]
    out = []
    for args in calls:
        plan = CallPlan(config, dict(op.tuning_key(args)), device)
        for extra in [{}, *extra_sets]:
            call = op.validate(**{**args, **extra}) if extra else args
            with recorded_launches() as forward:
                result = variant.launch(call, plan)
            with recorded_launches() as backward:
                if op.differentiable and phases[True]:
                    outputs = op.all_outputs(result, torch.device("meta"))
                    variant.backward(call, plan, outputs, torch.empty_like(outputs[0]))
            for in_backward, launches in ((False, forward), (True, backward)):
                out += [KernelLaunch(kernel, args_, kwargs, frozenset(roles_of.get(id(kernel), phases[in_backward])))
                        for kernel, args_, kwargs in launches]
    return out


def _identity(value: Any) -> Any:
    """What Triton can specialize a launch argument on, in hashable form: a tensor's dtype, shape,
    strides, offset and storage size (alignment and 32-bit pointer ranges follow from them), a
    descriptor's tensor, shape, strides, block shape and layout, any other value itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), tuple(value.stride()), value.storage_offset(),
                value.untyped_storage().nbytes())
    if hasattr(value, "block_shape") and hasattr(value, "base"):
        return ("descriptor", _identity(value.base), tuple(value.shape), tuple(value.strides),
                tuple(value.block_shape), repr(getattr(value, "layout", None)))
    if isinstance(value, list | tuple):
        return tuple(_identity(v) for v in value)
    return (type(value), value)


def distinct(launches: list[KernelLaunch]) -> list[KernelLaunch]:
    """The launches that differ in anything Triton specializes on (a call's chunk loop repeats the same
    launch many times), in order."""
    seen, out = set(), []
    for launch in launches:
        identity = (id(launch.kernel), launch.roles, _identity(launch.args),
                    tuple(sorted((k, _identity(v)) for k, v in launch.kwargs.items())))
        if identity not in seen:
            seen.add(identity)
            out.append(launch)
    return out


# ----------------------------------------------------------------------------- typing for a target
_backends: dict[tuple, Any] = {}


def _backend(device: DeviceInfo):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    found = _backends.get(device.target)
    if found is None:
        found = _backends[device.target] = make_backend(GPUTarget(*device.target))
    return found


def _frozen(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _binder(kernel: JITFunction, device: DeviceInfo):
    """The kernel's argument binder for the target's backend, as `JITFunction.create_binder` makes it."""
    found = _binders.get((kernel, device.target))
    if found is None:
        found = _binders[(kernel, device.target)] = create_function_from_signature(
            kernel.signature, kernel.params, _backend(device))
    return found


_binders: dict[tuple, Any] = {}


def specialize(launch: KernelLaunch, device: DeviceInfo) -> CompileJob:
    """The launch typed for `device` as Triton's JIT types it at run time (`JITFunction.run`'s binder
    and argument packing, for the target's backend)."""
    from triton import knobs

    kernel, backend, binder = launch.kernel, _backend(device), _binder(launch.kernel, device)
    kwargs = {**launch.kwargs, "debug": launch.kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return CompileJob(
        roles=launch.roles, module=kernel.fn.__module__, name=kernel.fn.__name__, gluon=kernel.is_gluon(),
        signature=tuple(signature.items()), constexprs=tuple(constexprs.items()),
        attrs=tuple((path, _frozen(value)) for path, value in attrs.items()),
        options=tuple(sorted((k, _frozen(v)) for k, v in options.__dict__.items())))
