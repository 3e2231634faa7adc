"""Property tests: for every op with kernels and each vendor's variants, over drawn shapes, dtypes,
strides, scalars and contents, a call through the registry either matches the op's reference or raises
a clear ValueError/TypeError, and never crashes or reads outside its tensors (the interpreter aborts
or returns garbage where a kernel does). Values only a device sync could check (decreasing
cu_seqlens) are outside the contract: there the kernel must only survive.

Shapes start from the op's tiny presets with their sizes redrawn (odd sizes, 1, a little larger). Then,
each as drawn: one floating input changes dtype (fp16 and fp32: the interpreter's bf16 dot is
unusable); one tensor input of any kind (1-D parameters and integer inputs included) becomes a view
with other strides (a stride-2 last dimension, padded rows, a broadcast dimension of stride 0, outer
dimensions in another order); one integer scalar argument (windows, split counts, block sizes, k,
max_seqlen) takes a value at an int32 end, past int64, near 0 or at a tensor size +-1; one floating
input gets a NaN, +inf or -inf; integer inputs (indices, lengths, offsets, block tables) get hostile
contents. With non-finite inputs, the elements the reference has finite must match
(`ops.testing.finite_part_error`; selections keep their contract).

CI runs a derandomized profile of EXAMPLES (25) examples per op and vendor; `KREG_PROPERTY_EXAMPLES=500`
(say) is the longer one, and `KREG_PROPERTY_RANDOM=1` draws new examples instead of the fixed ones.
"""

from __future__ import annotations

import os

import pytest
import torch

from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.testing import (
    GRAD_TOLERANCE,
    TOLERANCE,
    broadcast_view,
    finite_part_error,
    gradient_error,
    hostile_integers,
    integer_parameters,
    output_error,
    padded_view,
)
from kreg.registry import dispatch

# A dev dependency (installed by `make test`); GPU machines without network may lack its wheel, and
# there the property test is skipped anyway (below).
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

from .conftest import HAS_GPU  # noqa: E402

OPS_WITH_KERNELS = sorted({v.op for variants in load_all().values() for v in variants if v.runs_in_interpreter})
EXAMPLES = int(os.environ.get("KREG_PROPERTY_EXAMPLES", "25"))
DERANDOMIZE = os.environ.get("KREG_PROPERTY_RANDOM", "") != "1"
# Integer scalars at both int32 ends, past them, past int64, and near zero; sizes +-1 are added per call.
EDGE_INTEGERS = (-(2**31), -1, 0, 1, 2, 2**31 - 1, 2**31, 2**32 + 1, 2**63)


def _redraw_shape(data, shape: dict) -> dict:
    """The preset's integer sizes redrawn: kept, 1, or one more (odd sizes; larger ones cost the
    interpreter more than they find)."""
    out = dict(shape)
    for name, value in shape.items():
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            out[name] = data.draw(st.sampled_from((value, value, 1, value + 1)), label=name)
    return out


def _restrided(data, t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a view with other strides, as drawn."""
    kinds = ["last", "padded"] + (["broadcast", "reordered"] if t.dim() >= 2 else ["broadcast"])
    kind = data.draw(st.sampled_from(kinds), label="stride kind")
    if kind == "last":  # stride 2 in the last dimension
        wide = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
        return wide[..., ::2].copy_(t)
    if kind == "padded":  # rows longer than the last dimension
        return padded_view(t)
    if kind == "broadcast":  # one dimension of stride 0: its first slice, repeated
        return broadcast_view(t, data.draw(st.integers(0, t.dim() - 1), label="broadcast dim"))
    # Outer dimensions laid out in another order (the last one stays contiguous).
    a, b = data.draw(st.sampled_from([(i, j) for i in range(t.dim() - 1) for j in range(i + 1, t.dim() - 1)] or
                                     [(0, 0)]), label="swapped dims")
    return t.transpose(a, b).contiguous().transpose(a, b)


def _mutate(data, op, kwargs: dict) -> tuple[dict, bool]:
    """The drawn changes (module docstring); returns the arguments and whether a float input holds a
    non-finite value."""
    out = dict(kwargs)
    tensors = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
    floats = [k for k in tensors if out[k].is_floating_point()]
    ints = [k for k in tensors if not out[k].is_floating_point()]
    if floats and data.draw(st.booleans(), label="change a dtype"):
        name = data.draw(st.sampled_from(floats), label="retyped")
        dtype = data.draw(st.sampled_from((torch.float32, torch.float16, torch.int32)), label="dtype")
        out[name] = out[name].to(dtype)
    non_finite = False
    floats = [k for k in tensors if out[k].is_floating_point() and out[k].numel()]
    if floats and data.draw(st.booleans(), label="non-finite value"):
        name = data.draw(st.sampled_from(floats), label="poisoned")
        poisoned = out[name].clone()
        index = tuple(data.draw(st.integers(0, n - 1), label=f"{name} index") for n in poisoned.shape)
        poisoned[index] = data.draw(st.sampled_from((float("nan"), float("inf"), float("-inf"))), label="value")
        out[name], non_finite = poisoned, True
    for name in ints:
        if data.draw(st.booleans(), label=f"hostile {name}"):
            seed = data.draw(st.integers(0, 2**31 - 1), label=f"{name} seed")
            out[name] = hostile_integers(out[name], torch.Generator().manual_seed(seed))
    if tensors and data.draw(st.booleans(), label="strided view"):
        name = data.draw(st.sampled_from(tensors), label="strided")
        if out[name].numel():
            out[name] = _restrided(data, out[name])
    scalars = integer_parameters(op)
    if scalars and data.draw(st.booleans(), label="edge integer"):
        name = data.draw(st.sampled_from(scalars), label="integer argument")
        sizes = {s + d for k in tensors for s in out[k].shape for d in (-1, 0, 1)}
        out[name] = data.draw(st.sampled_from(sorted(set(EDGE_INTEGERS) | sizes)), label=name)
    return out, non_finite


def _call_or_error(fn, kwargs):
    try:
        return fn(**kwargs), None
    except (ValueError, TypeError) as err:
        return None, err


@pytest.mark.skipif(HAS_GPU, reason="the interpreter's properties; GPU memory safety is scripts/memcheck.sh")
@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
@pytest.mark.parametrize("op_name", OPS_WITH_KERNELS)
def test_result_matches_the_reference_or_the_call_is_rejected(op_name, vendor):
    op = OPS[op_name]

    # No shrinking: on the interpreter it can take many minutes; the first failing example is reported.
    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
                         phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate),
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(data=st.data())
    def check(data):
        preset = data.draw(st.sampled_from([layout for shape in op.presets["tiny"] for layout in op.layouts(shape)]),
                           label="preset")
        shape = _redraw_shape(data, preset)
        try:
            kwargs = op.make_inputs(shape, device="cpu", dtype=torch.float16, seed=0)
        except Exception:  # noqa: BLE001 - the generator, not the op, cannot build this shape
            hypothesis.reject()
        kwargs, non_finite = _mutate(data, op, kwargs)
        _, rejected = _call_or_error(op.validate, kwargs)
        got, error = _call_or_error(dispatch.get(op_name, vendor=vendor), kwargs)
        if rejected is not None:
            assert error is not None and type(error) is type(rejected), f"validation said {rejected!r}, call {error!r}"
            assert str(error), "an error must say what was wrong"
            return
        assert error is None, f"validated arguments were rejected by the call: {error!r}"
        validated = op.validate(**kwargs)
        try:
            expected = op.reference(**validated)
        except (ValueError, IndexError, RuntimeError):
            # Hostile values the contract cannot check without a device sync (cu_seqlens past the
            # packed rows or decreasing): the reference, which may read them on the host, refuses;
            # the kernel must still have stayed inside its tensors, which it did to get here.
            return
        dtype = min((v.dtype for v in kwargs.values() if isinstance(v, torch.Tensor) and v.is_floating_point()),
                    key=lambda d: torch.finfo(d).bits)
        measure = finite_part_error if non_finite else output_error
        err = measure(op, got, expected, validated)
        assert err <= TOLERANCE[dtype], f"relative error {err:.3g} at {shape}"

    check()


@pytest.mark.skipif(HAS_GPU, reason="the interpreter's properties; GPU memory safety is scripts/memcheck.sh")
@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
@pytest.mark.parametrize("op_name", OPS_WITH_KERNELS)
def test_integer_arguments_at_the_int32_ends(op_name, vendor):
    """Every integer scalar argument at and past both int32 ends (and 0, -1): a clear error, or the
    reference's result: a window or block of 2**31 - 1 keys is every key, and neither the forward's nor
    (differentiable ops) the backward's bound or grid arithmetic may wrap."""
    op = OPS[op_name]
    for layout in op.layouts(op.presets["tiny"][0]):
        base = op.make_inputs(layout, device="cpu", dtype=torch.float16, seed=1)
        for name in integer_parameters(op):
            for value in (-(2**31), -1, 0, 2**31 - 1, 2**31, 2**63):
                kwargs = {**base, name: value}
                _, rejected = _call_or_error(op.validate, kwargs)
                got, error = _call_or_error(dispatch.get(op_name, vendor=vendor), kwargs)
                where = f"{name}={value} at {layout}"
                if rejected is not None:
                    assert type(error) is type(rejected) and name in str(error), f"{where}: {error!r}"
                    continue
                assert error is None, f"{where}: validated, then the call raised {error!r}"
                validated = op.validate(**kwargs)
                err = output_error(op, got, op.reference(**validated), validated)
                assert err <= TOLERANCE[torch.float16], f"{where}: relative error {err:.3g}"
                if op.differentiable and value == 2**31 - 1:  # the accepted value arithmetic could wrap on
                    err = gradient_error(op, lambda a: dispatch.get(op_name, vendor=vendor)(**a), validated)
                    assert err <= GRAD_TOLERANCE[torch.float16], f"{where}: gradient relative error {err:.3g}"
