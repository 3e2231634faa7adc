"""Every op as a `torch.library` custom op in the `kreg` namespace, built from its contract.

Under torch.compile (and torch.export) `registry.get(op)(...)` becomes one call of the op's custom op,
so a compiled module sees one opaque node per call and never breaks its graph. For each op whose
contract declares `output_specs` (ops/contract.py), at import:

    kreg::<op>(<validate's parameters>, str? vendor=None, str? variant=None) -> (Tensor, ...)
        runs `registry.get(op, vendor=vendor, variant=variant)` on the arguments as an eager call does
        (validation, the cached launcher, the first call of a key resolves its config) and returns
        every output of `Op.outputs`, contiguous; an empty fp32 tensor stands for an output this call
        does not return (lse without return_lse). Its fake implementation makes the same tensors from
        `Op.output_specs`, so compilers know shapes and dtypes without running anything.
    kreg::<op>_backward(Tensor grad, Tensor[] outputs, <the same parameters>) -> Tensor[]
        for a differentiable op: the gradients of the first output for `Op.grad_inputs` (an empty
        tensor for an argument passed as None), from the chosen variant's backward kernels
        (`Variant.backward`) or else the reference's vjp. The forward's autograd formula calls it, so
        a compiled backward is one node too. Only the first output carries a gradient.

Why `custom_op` and not `triton_op` + `wrap_triton`: a call is not one fixed Triton program. Which
variant and launch config run is decided per tuning key at run time (a database or table read on the
first call, a dict lookup after), some variants launch Gluon kernels that Inductor cannot inline, and
in the Triton interpreter kernels are not JIT functions. An opaque op keeps that decision inside the
op at run time: no config is baked into a compiled graph and no lookup runs while tracing.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

from kreg.core.workspace import fresh_workspace
from kreg.ops import OPS
from kreg.ops.contract import Op, TensorSpec, empty_output

# Arguments every custom op takes after the op's own: which vendor's and which variant's kernels run
# (registry.get's keywords; None picks as registry.get does).
HANDLE_ARGS = ("vendor", "variant")
_SCHEMA_TYPES = {torch.Tensor: "Tensor", bool: "bool", int: "SymInt", float: "float", str: "str"}


class LibraryOp:
    """One op's custom ops and how to call them.

    params: validate's parameters, then HANDLE_ARGS; defaults: their defaults; tensors: the positions of
    tensor parameters; forward, backward: the custom ops (`torch.ops.kreg.<op>.default`, and
    `..._backward.default` or None).
    """

    def __init__(self, op: Op) -> None:
        self.op = op
        self.schema, params = _schema_params(op)
        self.params = tuple(p.name for p in params) + HANDLE_ARGS
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.defaults.update(dict.fromkeys(HANDLE_ARGS))
        self.tensors = tuple(i for i, item in enumerate(self.schema) if item.startswith("Tensor"))
        self.forward: Callable[..., Any] | None = None
        self.backward: Callable[..., Any] | None = None

    def bind(self, args: tuple, kwargs: dict, vendor: str | None, variant: str | None) -> dict:
        """A user's call (validate's parameters) by name with defaults filled in and the handle's vendor
        and variant added; TypeError as the call itself would raise."""
        own = self.params[: -len(HANDLE_ARGS)]
        if len(args) > len(own):
            raise TypeError(f"{self.op.name}: too many positional arguments ({len(args)})")
        bound = dict(self.defaults)
        bound.update(zip(own, args, strict=False))
        for name, value in kwargs.items():
            if name not in own or own.index(name) < len(args):
                raise TypeError(f"{self.op.name}: unexpected or repeated argument {name!r}")
            bound[name] = value
        missing = [name for name in own if name not in bound]
        if missing:
            raise TypeError(f"{self.op.name}: missing argument {missing[0]!r}")
        bound.update(vendor=vendor, variant=variant)
        return bound

    def named(self, args: tuple) -> dict:
        """Positional custom-op arguments (the dispatcher drops trailing defaults) by name."""
        named = dict(self.defaults)
        named.update(zip(self.params, args, strict=False))
        return named


LIBRARY: dict[str, LibraryOp] = {}


def traced_call(handle: Any, args: tuple, kwargs: dict) -> Any:
    """`handle(*args, **kwargs)` as a compiler traces it: one call of the op's custom op, its outputs
    put back into the structure the eager call returns (`Op.output_specs` says which)."""
    op = handle.op
    lib = LIBRARY.get(op.name)
    if lib is None:
        raise RuntimeError(f"{op.name}: its contract declares no output_specs, so it has no kreg custom op "
                           "and cannot run under torch.compile")
    bound = lib.bind(args, kwargs, handle.vendor, handle.variant)
    flat = lib.forward(*(bound[name] for name in lib.params))
    specs = op.output_specs(bound)
    if isinstance(specs, TensorSpec):
        return flat if isinstance(flat, torch.Tensor) else flat[0]
    present = flat[: len(specs)]
    return type(specs)(*present) if hasattr(specs, "_fields") else tuple(present)


# ----------------------------------------------------------------------------- registration
def _schema_type(op: Op, param: inspect.Parameter) -> str:
    annotation, optional = param.annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(annotation) if m is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        annotation = members[0] if len(members) == 1 else None
    base = _SCHEMA_TYPES.get(annotation)
    if base is None:
        raise TypeError(f"{op.name}: parameter {param.name!r} is annotated {param.annotation!r}; a custom op "
                        f"takes {', '.join(t.__name__ for t in _SCHEMA_TYPES)} or None")
    return base + ("?" if optional else "")


def _schema_default(value: Any) -> str:
    return "None" if value is None else repr(value)


def _schema_params(op: Op) -> tuple[list[str], list[inspect.Parameter]]:
    """The schema's argument list (validate's parameters, then HANDLE_ARGS) and validate's parameters."""
    params = list(inspect.signature(op.validate, eval_str=True).parameters.values())
    clash = [p.name for p in params if p.name in HANDLE_ARGS or p.name in ("grad", "outputs")]
    if clash:
        raise TypeError(f"{op.name}: parameter {clash[0]!r} is reserved for the custom op")
    text = []
    for p in params:
        item = f"{_schema_type(op, p)} {p.name}"
        if p.default is not inspect.Parameter.empty:
            item += f"={_schema_default(p.default)}"
        text.append(item)
    return text + [f"str? {name}=None" for name in HANDLE_ARGS], params


# How a custom op finds the handle that runs a call: dispatch's `get`, given to `register_all` (this
# module sits below dispatch and does not import it).
HandleFor = Callable[..., Any]


def _flat(value: Any) -> list:
    return [value] if isinstance(value, (torch.Tensor, TensorSpec)) else list(value)


def _returned(op: Op, tensors: tuple[torch.Tensor, ...]):
    """What a custom op returns: its one tensor, or the tuple of every output."""
    return tensors[0] if len(op.outputs) == 1 else tensors


def register(op: Op, handle_for: HandleFor) -> LibraryOp:
    """Define `kreg::<op>` (and `kreg::<op>_backward` with autograd for a differentiable op); its calls
    run on `handle_for(op name, vendor=, variant=)`."""
    lib = LibraryOp(op)
    returns = "Tensor" if len(op.outputs) == 1 else "(" + ", ".join(["Tensor"] * len(op.outputs)) + ")"

    def forward_impl(*args):
        named = lib.named(args)
        # A compiled graph's call keeps no workspace between calls (core/workspace.py says why).
        with fresh_workspace():
            result = handle_for(op.name, vendor=named.pop("vendor"), variant=named.pop("variant")).eager(named)
        return _returned(op, tuple(t.contiguous() for t in op.all_outputs(result, args[0].device)))

    def forward_fake(*args):
        specs = op.output_specs(lib.named(args))
        device = args[0].device
        made = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in _flat(specs)]
        return _returned(op, op.all_outputs(made, device))

    custom = torch.library.custom_op(f"kreg::{op.name}", forward_impl, mutates_args=(),
                                     schema=f"({', '.join(lib.schema)}) -> {returns}")
    custom.register_fake(forward_fake)
    lib.forward = getattr(torch.ops.kreg, op.name).default
    if op.differentiable:
        _register_backward(lib, handle_for)
        custom.register_autograd(_backward_formula(lib), setup_context=_setup_context(lib))
    LIBRARY[op.name] = lib
    return lib


def _register_backward(lib: LibraryOp, handle_for: HandleFor) -> None:
    op = lib.op

    def backward_impl(grad, outputs, *args):
        named = lib.named(args)
        handle = handle_for(op.name, vendor=named.pop("vendor"), variant=named.pop("variant"))
        with fresh_workspace():
            grads = handle.gradients(handle._validate(**named), tuple(outputs), grad)
        device = args[0].device
        return [empty_output(device) if grads.get(name) is None else grads[name].contiguous()
                for name in op.grad_inputs]

    def backward_fake(grad, outputs, *args):
        named = lib.named(args)
        device = args[0].device
        return [torch.empty(named[name].shape, dtype=named[name].dtype, device=device)
                if isinstance(named[name], torch.Tensor) else empty_output(device) for name in op.grad_inputs]

    custom = torch.library.custom_op(f"kreg::{op.name}_backward", backward_impl, mutates_args=(),
                                     schema=f"(Tensor grad, Tensor[] outputs, {', '.join(lib.schema)}) -> Tensor[]")
    custom.register_fake(backward_fake)
    lib.backward = getattr(torch.ops.kreg, f"{op.name}_backward").default


def _setup_context(lib: LibraryOp):
    def setup_context(ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.mark_non_differentiable(*outputs[1:])  # only the first output carries a gradient
        ctx.save_for_backward(*(inputs[i] for i in lib.tensors), *outputs)
        ctx.values = [None if i in lib.tensors else value for i, value in enumerate(inputs)]

    return setup_context


def _backward_formula(lib: LibraryOp):
    positions = {name: lib.params.index(name) for name in lib.op.grad_inputs}

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        values = list(ctx.values)
        for i, t in zip(lib.tensors, saved, strict=False):
            values[i] = t
        found = lib.backward(grads[0], list(saved[len(lib.tensors):]), *values)
        result: list[torch.Tensor | None] = [None] * len(values)
        for name, g in zip(lib.op.grad_inputs, found, strict=True):
            i = positions[name]
            if values[i] is not None and ctx.needs_input_grad[i]:
                result[i] = g
        return tuple(result)

    return backward


def register_all(handle_for: HandleFor) -> None:
    """Define the custom ops of every op whose contract declares `output_specs` (dispatch does, once, at
    its import)."""
    for op in OPS.values():
        if op.output_specs is not None and op.name not in LIBRARY:
            register(op, handle_for)
