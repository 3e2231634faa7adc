"""Comparison helpers shared by tests, sweeps and benchmarks: relative error against a reference."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch


def _as_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Sequence):
        return [t for v in value for t in _as_tensors(v)]
    raise TypeError(f"expected a tensor or a sequence of tensors, got {type(value).__name__}")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64, over entries where `expected` is finite.

    Non-finite reference entries (the +inf lse of empty rows, -inf max_logits) must be matched exactly;
    a mismatch there, or any NaN in `actual`, counts as an infinite error.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a = actual.detach().to(device="cpu", dtype=torch.float64)
    e = expected.detach().to(device="cpu", dtype=torch.float64)
    if torch.isnan(a).any():
        return float("inf")
    finite = torch.isfinite(e)
    if not torch.equal(a[~finite], e[~finite]) or not torch.isfinite(a[finite]).all():
        return float("inf")
    diff = torch.linalg.vector_norm(a[finite] - e[finite]).item()
    norm = torch.linalg.vector_norm(e[finite]).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


def max_relative_error(actual, expected) -> float:
    """The largest `relative_error` over matching outputs (tensors or tuples of tensors)."""
    outs, refs = _as_tensors(actual), _as_tensors(expected)
    if len(outs) != len(refs):
        raise AssertionError(f"expected {len(refs)} outputs, got {len(outs)}")
    return max((relative_error(a, e) for a, e in zip(outs, refs, strict=True)), default=0.0)


def output_error(op, actual, expected, args: dict) -> float:
    """How far `actual` is from the reference's `expected` outputs for the call `args`: the op's own
    measure where it declares one (`Op.error`: gsa_topk compares selected score sets), else
    `max_relative_error`."""
    return max_relative_error(actual, expected) if op.error is None else op.error(actual, expected, args)


def finite_part_error(op, actual, expected, args: dict) -> float:
    """`output_error` for a call with NaN or inf inputs, which may reach outputs differently in a kernel
    and in the reference (which keys a tile reads, which a dense reference multiplies by zero): every
    element the reference has finite must be finite and close in `actual`; the others are free (both
    set to 0 before the op's measure). Integer outputs (selections) keep their contract unchanged."""
    outs, refs = _as_tensors(actual), _as_tensors(expected)
    if len(outs) != len(refs):
        raise AssertionError(f"expected {len(refs)} outputs, got {len(outs)}")
    kept_outs, kept_refs = [], []
    for a, e in zip(outs, refs, strict=True):
        if a.shape != e.shape:
            return float("inf")
        if e.is_floating_point():
            finite = torch.isfinite(e)
            a, e = torch.where(finite, a, 0).to(a.dtype), torch.where(finite, e, 0).to(e.dtype)
        kept_outs.append(a)
        kept_refs.append(e)
    if isinstance(actual, torch.Tensor):
        return output_error(op, kept_outs[0], kept_refs[0], args)
    return output_error(op, tuple(kept_outs), tuple(kept_refs), args)


def assert_close(actual, expected, rtol: float, what: str = "output") -> None:
    """Assert every output's relative error is at most `rtol` (see `relative_error`)."""
    outs, refs = _as_tensors(actual), _as_tensors(expected)
    if len(outs) != len(refs):
        raise AssertionError(f"{what}: expected {len(refs)} outputs, got {len(outs)}")
    for i, (a, e) in enumerate(zip(outs, refs, strict=True)):
        err = relative_error(a, e)
        if not err <= rtol:
            raise AssertionError(f"{what}[{i}]: relative error {err:.3g} > {rtol:.3g}")


# Relative-error budgets against an fp32/fp64 reference, by input dtype: a few units of the last
# place of each dtype's accumulated rounding over these shapes' reductions.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


# ----------------------------------------------------------------------------- gradients
def first_output(value) -> torch.Tensor:
    """The output a backward differentiates: the op's first (`out`)."""
    return value if isinstance(value, torch.Tensor) else value[0]


def _grad_names(op, args: dict) -> list[str]:
    """The `op.grad_inputs` the call passes as tensors."""
    return [name for name in op.grad_inputs if isinstance(args.get(name), torch.Tensor)]


def grad_leaves(op, args: dict) -> dict[str, torch.Tensor]:
    """Fresh leaf copies (requires_grad) of the arguments gradients flow to."""
    return {name: args[name].detach().clone().requires_grad_() for name in _grad_names(op, args)}


def cotangent(out: torch.Tensor, seed: int = 7) -> torch.Tensor:
    """A seeded random gradient for `out` (drawn on the CPU: the same values on every device)."""
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)


def gradients(op, call, args: dict, dout: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(gradients of `call`'s first output for each of `grad_leaves`, the cotangent used)."""
    leaves = grad_leaves(op, args)
    out = first_output(call({**args, **leaves}))
    dout = cotangent(out) if dout is None else dout.to(out.dtype)
    return list(torch.autograd.grad(out, list(leaves.values()), dout)), dout


def reference_gradients(op, args: dict, dout: torch.Tensor) -> list[torch.Tensor]:
    """The reference's gradients in fp32 for the same leaves and cotangent."""
    leaves = {name: args[name].detach().float().requires_grad_() for name in _grad_names(op, args)}
    out = first_output(op.reference(**{**args, **leaves}))
    return list(torch.autograd.grad(out, list(leaves.values()), dout.float()))


def gradient_error(op, call, args: dict, dout: torch.Tensor | None = None,
                   expected: list[torch.Tensor] | None = None) -> float:
    """The largest relative error of `call`'s gradients against the reference's (fp32) autograd; pass
    the cotangent and the reference's gradients for it (`reference_gradients`) to reuse them."""
    got, dout = gradients(op, call, args, dout)
    if expected is None:
        expected = reference_gradients(op, args, dout)
    return max_relative_error([g.float() for g in got], expected)


def backward_call(op, call, args: dict):
    """A zero-argument function that runs the backward of one forward of `call` (built here, once, on
    fresh leaves with a seeded cotangent), for timing the backward alone."""
    leaves = grad_leaves(op, args)
    out = first_output(call({**args, **leaves}))
    dout, inputs = cotangent(out), list(leaves.values())
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


# The backward's budget, by input dtype: gradients sum over more terms than the forward.
GRAD_TOLERANCE = {dtype: 2 * tol for dtype, tol in TOLERANCE.items()}


# ----------------------------------------------------------------------------- hostile inputs
# Integer contents no contract can rule out without reading the values on the host: both int32 ends,
# -1 (the "no entry" marker), 0, small offsets around typical sizes and a large positive value.
HOSTILE_INTEGERS = (-(2**31), -(2**31) + 1, -2, -1, 0, 1, 2, 3, 15, 16, 17, 63, 64, 65, 4096, 2**31 - 2, 2**31 - 1)


def hostile_integers(t: torch.Tensor, generator: torch.Generator, fill: int | None = None) -> torch.Tensor:
    """A tensor like `t` (shape, dtype, device) whose entries are drawn from HOSTILE_INTEGERS, or all
    `fill`: index, length and offset contents a kernel must survive without reading outside its
    tensors."""
    if fill is not None:
        return torch.full_like(t, fill)
    pool = torch.tensor(HOSTILE_INTEGERS, dtype=torch.int64)
    picks = pool[torch.randint(len(pool), tuple(t.shape), generator=generator)]
    return picks.to(dtype=t.dtype, device=t.device)


def integer_parameters(op) -> list[str]:
    """The op's integer scalar parameters (windows, split counts, block sizes, k), read off its public
    signature: what hostile-input checks set to int32 ends and tensor sizes +-1."""
    params = inspect.signature(op.validate).parameters.values()
    return [p.name for p in params if str(p.annotation).replace(" ", "") in ("int", "int|None")]


def padded_view(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """`t`'s values in a view whose rows are `pad` elements longer than its last dimension."""
    wide = torch.empty((*t.shape[:-1], t.shape[-1] + pad), dtype=t.dtype, device=t.device)
    return wide[..., : t.shape[-1]].copy_(t)


def broadcast_view(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`t`'s first slice along `dim`, repeated through a stride-0 view of `t`'s shape."""
    return t.narrow(dim, 0, min(1, t.shape[dim])).expand(t.shape)
