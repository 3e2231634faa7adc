"""Ops as torch.library custom ops (registry/library.py): registration from the contracts, fake shapes,
opcheck, torch.compile without graph breaks (forward and backward), the eager hot path, and on a GPU
Inductor and CUDA-graph capture and replay."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kreg import registry
from kreg.core.device import detect
from kreg.core.space import INTERPRETER_DTYPE
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.contract import TensorSpec
from kreg.ops.testing import GRAD_TOLERANCE, TOLERANCE, assert_close, gradient_error
from kreg.registry.dispatch import OpHandle
from kreg.registry.library import LIBRARY

from .conftest import HAS_GPU, gpu

KERNEL_OPS = sorted(name for name, variants in load_all().items() if variants)
DEVICE = "cuda" if HAS_GPU else "cpu"
DTYPE = torch.bfloat16 if HAS_GPU else INTERPRETER_DTYPE
VENDOR = detect().vendor if HAS_GPU else "nvidia"


@pytest.fixture(autouse=True)
def _fresh():
    registry.clear_caches()
    torch._dynamo.reset()
    yield
    registry.clear_caches()


def _cases(name: str) -> list[tuple[dict, dict]]:
    """(layout, extra keywords) of every tiny preset in every layout, and with return_lse where the op
    has it."""
    op = OPS[name]
    extras = [{}] + ([{"return_lse": True}] if "return_lse" in inspect.signature(op.validate).parameters else [])
    return [(layout, extra) for shape in op.presets["tiny"] for layout in op.layouts(shape) for extra in extras]


def _inputs(name: str, layout: dict, extra: dict, seed: int = 0) -> dict:
    return {**OPS[name].make_inputs(layout, device=DEVICE, dtype=DTYPE, seed=seed), **extra}


def _calls(name: str) -> list[dict]:
    return [_inputs(name, layout, extra, seed=n) for n, (layout, extra) in enumerate(_cases(name))]


def _smallest(calls: list[dict]) -> dict:
    """The call with the fewest tensor elements: what the interpreter runs fastest, for checks of the
    custom-op machinery rather than of the kernels (the conformance test runs every preset)."""
    return min(calls, key=lambda kw: sum(v.numel() for v in kw.values() if isinstance(v, torch.Tensor)))


def _tensors(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def test_every_op_with_kernels_is_a_custom_op():
    assert KERNEL_OPS, "no variants registered"
    for name in KERNEL_OPS:
        op = OPS[name]
        schema = getattr(torch.ops.kreg, name).default._schema
        assert [a.name for a in schema.arguments] == [*inspect.signature(op.validate).parameters, "vendor", "variant"]
        assert len(schema.returns) == len(op.outputs)
        assert hasattr(torch.ops.kreg, f"{name}_backward") == op.differentiable
    # Every contract declares its outputs, so an op whose kernels land later is registered as it is.
    assert sorted(LIBRARY) == sorted(OPS)


@pytest.mark.parametrize("name", sorted(OPS))
def test_fake_outputs_match_real_ones(name):
    """Under FakeTensorMode the custom op gives the real call's shapes, dtypes and strides (on the CPU
    the reference's; test_compile_fullgraph_matches_eager compares the kernels' outputs)."""
    custom = getattr(torch.ops.kreg, name).default
    for kw in _calls(name):
        real = _tensors(custom(**kw))
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_kw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
            fake = _tensors(custom(**fake_kw))
        assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]
        # The outputs a call returns are exactly those its spec names (the rest are empty stand-ins).
        specs = OPS[name].output_specs({**_defaults(name), **kw})
        present = [specs] if isinstance(specs, TensorSpec) else list(specs)
        assert all(t.numel() for t in real[: len(present)]) and not any(t.numel() for t in real[len(present):])


def _defaults(name: str) -> dict:
    return {p.name: p.default for p in inspect.signature(OPS[name].validate).parameters.values()}


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_opcheck(name):
    """torch.library.opcheck: schema, fake tensors, autograd registration and AOT dispatch, on the first
    smallest tiny call through the vendor's kernels."""
    kw = _smallest(_calls(name))
    op = OPS[name]
    if op.differentiable:
        kw = {k: v.detach().requires_grad_() if k in op.grad_inputs and isinstance(v, torch.Tensor) else v
              for k, v in kw.items()}
    torch.library.opcheck(getattr(torch.ops.kreg, name).default, (), {**kw, "vendor": VENDOR})


class _Block(torch.nn.Module):
    """A module around one registry call, with work before and after it in the same graph."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, kw: dict):
        first = next(iter(kw))
        result = registry.get(self.name, vendor=VENDOR)(**{**kw, first: kw[first] * 1})
        if isinstance(result, torch.Tensor):
            return result
        shifted = [t + 0 for t in result]
        return type(result)(*shifted) if hasattr(result, "_fields") else tuple(shifted)


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_compile_fullgraph_matches_eager(name):
    """torch.compile(fullgraph=True) of a module calling registry.get(op)(...): no graph break, the
    eager call's structure (tensor, tuple, NamedTuple) and values; gradients through the custom op's
    backward match the reference's."""
    op = OPS[name]
    block = _Block(name)
    calls = _calls(name)
    # Every output structure and layout, not every shape; the backward (slow in the interpreter) once,
    # on the smallest call.
    smallest = _smallest(calls)
    calls = [smallest] + [kw for kw in (calls[::3] if len(calls) > 4 else calls[:2]) if kw is not smallest]
    for n, kw in enumerate(calls):
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        got = compiled(kw)  # before any eager call: the trace finds the handle and no resolved key
        eager = block(kw)
        assert type(got) is type(eager)
        assert_close(got, eager, 1e-6, what=f"{name} compiled")
        if op.differentiable and n == 0:
            err = gradient_error(op, compiled, op.validate(**kw))
            assert err <= GRAD_TOLERANCE[DTYPE], f"{name}: compiled gradients off by {err:.3g}"


def test_torch_export_keeps_one_custom_op_node():
    """torch.export (non-strict) records the call as one kreg op, and the exported program runs it."""
    kw = _calls("sparse_mla")[0]
    args = (kw["q"], kw["kv"], kw["indices"])

    class Out(torch.nn.Module):
        def forward(self, q, kv, indices):
            return registry.get("sparse_mla", vendor=VENDOR)(q, kv, indices, d_v=kw["d_v"]).out * 2

    program = torch.export.export(Out(), args)
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert torch.ops.kreg.sparse_mla.default in targets
    assert_close(program.module()(*args), Out()(*args), 1e-6)


def test_bad_arguments_raise_under_compile_too():
    kw = _calls("decode")[0]
    compiled = torch.compile(_Block("decode"), fullgraph=True, backend="aot_eager")
    with pytest.raises(TypeError, match="cache_seqlens"):
        compiled({**kw, "cache_seqlens": kw["cache_seqlens"].long()})


def test_hot_path_resolves_each_raw_key_once():
    """After a key's first call, a call validates and looks its launcher up: no tuning key, no
    resolution; a new raw key in the same tuning key reuses the resolution."""
    op = OPS["decode"]
    keys = []
    counting = dataclasses.replace(op, tuning_key=lambda a: keys.append(1) or op.tuning_key(a))
    handle = OpHandle(counting, VENDOR, None)
    kw = _calls("decode")[0]
    expected = op.reference(**op.validate(**kw))
    for _ in range(3):
        assert_close(handle(**kw), expected, TOLERANCE[DTYPE])
    assert len(keys) == 1
    with pytest.raises(TypeError, match="cache_seqlens"):  # validation still runs on every call
        handle(**{**kw, "cache_seqlens": kw["cache_seqlens"].long()})


def test_a_growing_decode_cache_stays_on_one_raw_key():
    """Views of one cache one key longer each call (a generation loop's) share the raw key while the
    length stays in its tuning bucket: no new resolution per step, and each step is right; the next
    bucket is a new key."""
    op = OPS["decode"]
    keys = []
    counting = dataclasses.replace(op, tuning_key=lambda a: keys.append(1) or op.tuning_key(a))
    handle = OpHandle(counting, VENDOR, None)
    gen = torch.Generator().manual_seed(5)
    cache_k, cache_v = (torch.randn(2, 80, 2, 32, generator=gen).to(DEVICE, DTYPE) for _ in range(2))
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE, DTYPE)
    for n in (33, 34, 47, 64, 65):
        kw = {"q": q, "k_cache": cache_k[:, :n], "v_cache": cache_v[:, :n],
              "cache_seqlens": torch.tensor([n, n - 9], dtype=torch.int32, device=DEVICE)}
        assert_close(handle(**kw), op.reference(**kw), TOLERANCE[DTYPE], what=f"n {n}")
    assert len(keys) == 2  # the bucket of 64, then of 128


# ----------------------------------------------------------------------------- GPU
@gpu
@pytest.mark.parametrize("name", KERNEL_OPS)
def test_compile_inductor_fullgraph_matches_eager(name):
    block = _Block(name)
    for kw in _calls(name):
        torch._dynamo.reset()  # one compile per shape, under the recompile limit
        compiled = torch.compile(block, fullgraph=True)
        assert_close(compiled(kw), block(kw), 1e-6, what=f"{name} under inductor")


@gpu
@pytest.mark.parametrize("name", KERNEL_OPS)
def test_cuda_graph_capture_and_replay(name, monkeypatch):
    """A call captured after one eager call replays with new input values and matches eager on them;
    nothing is resolved while capturing (the config lookup happened before)."""
    from kreg.registry import dispatch

    handle = registry.get(name)
    for n, (layout, extra) in enumerate(_cases(name)):
        kw = _inputs(name, layout, extra, seed=n)
        handle(**kw)  # resolves the key and compiles the kernels
        torch.cuda.synchronize()
        monkeypatch.setattr(dispatch, "resolve", lambda *a, **k: pytest.fail("resolved during capture"))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            handle(**kw)  # warm-up on the capture stream
            with torch.cuda.graph(graph, stream=stream):
                captured = handle(**kw)
        torch.cuda.current_stream().wait_stream(stream)
        monkeypatch.undo()
        # New values in the captured tensors (same shapes: a new seed would draw other varlen lengths).
        gen = torch.Generator().manual_seed(1000 + n)
        for value in kw.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value.copy_(torch.randn(value.shape, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(captured, handle(**kw), 1e-6, what=f"{name} replayed")


def _decode_plans(handle) -> list:
    """The DecodeLaunch plans of a decode handle's cached launchers."""
    from kreg.kernels.common.decode import DecodeLaunch

    return [cell.cell_contents for per_device in handle._launchers.values() for launch in per_device.values()
            for cell in (launch.__closure__ or ()) if isinstance(cell.cell_contents, DecodeLaunch)]


def test_a_compiled_graphs_decode_keeps_no_split_partials():
    """An eager decode call keeps its split partials' buffers for the next call; the same call from a
    compiled graph (the custom op's body) keeps none, since under CUDA-graph trees a buffer it kept would
    be a tensor of the graph's pool that the graph does not own."""
    gen = torch.Generator().manual_seed(3)
    kw = {"q": torch.randn(2, 4, 32, generator=gen).to(DEVICE, DTYPE),
          "k_cache": torch.randn(2, 256, 2, 32, generator=gen).to(DEVICE, DTYPE),
          "v_cache": torch.randn(2, 256, 2, 32, generator=gen).to(DEVICE, DTYPE),
          "cache_seqlens": torch.tensor([200, 37], dtype=torch.int32, device=DEVICE), "num_splits": 3}
    handle = registry.get("decode", vendor=VENDOR)
    compiled = torch.compile(_Block("decode"), fullgraph=True, backend="aot_eager")
    from_graph = compiled(kw)
    (plan,) = _decode_plans(handle)
    assert not plan.partials
    eager = handle(**kw)
    assert len(plan.partials) == 1
    assert_close(from_graph, eager, 1e-6)
    assert_close(eager, OPS["decode"].reference(**kw), TOLERANCE[DTYPE])
