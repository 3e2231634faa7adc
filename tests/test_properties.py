"""Property tests: for every op with kernels and each vendor's variants, over drawn shapes, dtypes,
strides and index contents, a call through the registry either matches the op's reference or raises
a clear ValueError/TypeError, and never crashes or reads outside its tensors (the interpreter aborts
or returns garbage where a kernel does). Values only a device sync could check (decreasing
cu_seqlens) are outside the contract: there the kernel must only survive.

Shapes start from the op's tiny presets with their sizes redrawn (odd sizes, 1, a little larger);
floating inputs may change dtype (fp16 and fp32: the interpreter's bf16 dot is unusable) or become
strided views; integer inputs (indices, lengths, offsets, block tables) may be overwritten with
hostile values. A bounded number of examples keeps CI fast; `KREG_PROPERTY_EXAMPLES` raises it.
"""

from __future__ import annotations

import os

import pytest
import torch

from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.testing import TOLERANCE, hostile_integers, output_error
from kreg.registry import dispatch

# A dev dependency (installed by `make test`); GPU machines without network may lack its wheel, and
# there the property test is skipped anyway (below).
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

from .conftest import HAS_GPU  # noqa: E402

OPS_WITH_KERNELS = sorted({v.op for variants in load_all().values() for v in variants if v.runs_in_interpreter})
EXAMPLES = int(os.environ.get("KREG_PROPERTY_EXAMPLES", "8"))


def _redraw_shape(data, shape: dict) -> dict:
    """The preset's integer sizes redrawn: kept, 1, or one more (odd sizes; larger ones cost the
    interpreter more than they find)."""
    out = dict(shape)
    for name, value in shape.items():
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            out[name] = data.draw(st.sampled_from((value, value, 1, value + 1)), label=name)
    return out


def _mutate(data, kwargs: dict) -> dict:
    """At most one dtype change, one strided view and hostile integer contents, as drawn."""
    out = dict(kwargs)
    floats = [k for k, v in out.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    ints = [k for k, v in out.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()]
    if floats and data.draw(st.booleans(), label="change a dtype"):
        name = data.draw(st.sampled_from(floats), label="retyped")
        dtype = data.draw(st.sampled_from((torch.float32, torch.float16, torch.int32)), label="dtype")
        out[name] = out[name].to(dtype)
    if floats and data.draw(st.booleans(), label="strided view"):
        name = data.draw(st.sampled_from(floats), label="strided")
        t = out[name]
        wide = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
        axis = data.draw(st.sampled_from(("last", "inner")), label="stride kind")
        out[name] = wide[..., ::2].copy_(t) if axis == "last" else wide[..., : t.shape[-1]].copy_(t)
    for name in ints:
        if data.draw(st.booleans(), label=f"hostile {name}"):
            seed = data.draw(st.integers(0, 2**31 - 1), label=f"{name} seed")
            out[name] = hostile_integers(out[name], torch.Generator().manual_seed(seed))
    return out


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

    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
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
        kwargs = _mutate(data, kwargs)
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
        err = output_error(op, got, expected, validated)
        assert err <= TOLERANCE[dtype], f"relative error {err:.3g} at {shape}"

    check()
