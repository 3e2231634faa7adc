"""The dispatch hot path's caches (registry/dispatch.py, kernels/common/launch.py): a raw key's launcher
serves every call of that key, whatever its strides, alignment and scalars, and bad input raises on
every call; a `LaunchCache` launches a recorded compiled kernel only for a launch Triton would
specialize alike (checked on CPU with a stand-in kernel), and on a GPU its launches give Triton's bits,
survive views, hooks and CUDA-graph capture."""

from __future__ import annotations

import gc
import inspect
import types
import weakref

import pytest
import torch
from triton import knobs

from kreg import registry
from kreg.core.space import INTERPRETER_DTYPE
from kreg.kernels.common import launch
from kreg.ops import OPS
from kreg.ops.testing import TOLERANCE, assert_close
from kreg.registry import dispatch

from .conftest import HAS_GPU, gpu

DEVICE = "cuda" if HAS_GPU else "cpu"
DTYPE = torch.bfloat16 if HAS_GPU else INTERPRETER_DTYPE
VENDOR = "nvidia" if not HAS_GPU or torch.version.hip is None else "amd"
DECODE = {"b": 3, "s_q": 1, "h_q": 4, "h_kv": 2, "d": 32, "n": 37, "block_size": None, "sinks": True, "window": None,
          "ragged": True}
FLASH = {"b": 1, "s_q": 19, "s_k": 19, "h_q": 4, "h_kv": 2, "d": 32, "causal": True, "window": None}
SHAPES = {"decode": DECODE, "flash_attention": FLASH}


@pytest.fixture(autouse=True)
def _fresh():
    registry.clear_caches()
    yield
    registry.clear_caches()


def _inputs(name: str, seed: int = 0, dtype: torch.dtype = DTYPE) -> dict:
    return OPS[name].make_inputs(SHAPES[name], device=DEVICE, dtype=dtype, seed=seed)


def _reference(name: str, kw: dict):
    op = OPS[name]
    return op.reference(**op.validate(**kw))


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a view whose address is one element past a 16-byte boundary."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


def _strided(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a view with the same shape and a contiguous last dim but other strides."""
    wide = torch.zeros((*t.shape[:-1], t.shape[-1] + 8), dtype=t.dtype, device=t.device)
    view = wide[..., : t.shape[-1]]
    view.copy_(t)
    assert view.stride() != t.stride()
    return view


def _launch_cache(handle) -> launch.LaunchCache:
    """The LaunchCache of the handle's only raw-key launcher."""
    (launchers,) = handle._launchers.values()
    (launcher,) = launchers.values()
    return inspect.getclosurevars(launcher).nonlocals["launches"]


# ----------------------------------------------------------------------------- dispatch (any device)
BAD_DECODE = {
    "cache_seqlens int64": (lambda kw: {**kw, "cache_seqlens": kw["cache_seqlens"].long()}, TypeError, "cache_seqlens"),
    "q last dim strided": (lambda kw: {**kw, "q": kw["q"].transpose(1, 2).contiguous().transpose(1, 2)},
                           ValueError, "contiguous"),
    "k_cache on meta": (lambda kw: {**kw, "k_cache": kw["k_cache"].to("meta")}, ValueError, "k_cache"),
    "v_cache fp32": (lambda kw: {**kw, "v_cache": kw["v_cache"].float()}, TypeError, "v_cache"),
    "window 0": (lambda kw: {**kw, "window": 0}, ValueError, "window"),
    "num_splits True": (lambda kw: {**kw, "num_splits": True}, ValueError, "num_splits"),
}


@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_bad_input_raises_on_every_call_after_good_calls_of_its_raw_key(case):
    make, error, match = BAD_DECODE[case]
    handle = registry.get("decode", vendor=VENDOR)
    kw = _inputs("decode")
    for _ in range(2):
        handle(**kw)
    bad = make(kw)
    for _ in range(2):
        with pytest.raises(error, match=match):
            handle(**bad)
    assert_close(handle(**kw), _reference("decode", kw), TOLERANCE[DTYPE], what="a good call after bad ones")


@pytest.mark.parametrize("name", list(SHAPES))
def test_views_of_one_raw_key_and_other_dtypes_match_the_reference(name):
    """Strided and misaligned views share the raw key of contiguous inputs (validation reads no strides
    but the last and no address), so their calls reuse its launcher: each must still be right. fp32 is
    another raw key, where the reference runs (neither op has an fp32 kernel)."""
    handle = registry.get(name, vendor=VENDOR)
    kw = _inputs(name)
    k = "k" if name == "flash_attention" else "k_cache"
    calls = [kw, kw, {**kw, "q": _strided(kw["q"])}, {**kw, "q": _misaligned(kw["q"])}, {**kw, k: _misaligned(kw[k])},
             kw]
    for n, call in enumerate(calls):
        assert_close(handle(**call), _reference(name, call), TOLERANCE[DTYPE], what=f"{name} call {n}")
    assert sum(len(launchers) for launchers in handle._launchers.values()) == 1
    wide = _inputs(name, seed=1, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="reference"):
        assert_close(handle(**wide), _reference(name, wide), TOLERANCE[torch.float32], what=f"{name} fp32")


def test_raw_key_launchers_are_capped_per_device(monkeypatch):
    monkeypatch.setattr(dispatch, "MAX_RAW_KEYS", 2)
    handle = registry.get("decode", vendor=VENDOR)
    made = []
    for b in (5, 6, 7):  # three raw keys (q's shape) of one tuning key (the batch's bucket, 8)
        kw = OPS["decode"].make_inputs({**DECODE, "b": b}, device=DEVICE, dtype=DTYPE, seed=0)
        made.append(handle.launcher(**kw))
    (launchers,) = handle._launchers.values()
    assert [key[0][0] for key in launchers] == [6, 7]  # the oldest raw key dropped
    assert len(set(made)) == 1  # one tuning key: one launcher, which every raw key runs


# ----------------------------------------------------------------------------- LaunchCache (a stand-in kernel)
class _Compiled:
    """Stands for a compiled kernel: records the launches made through it directly."""

    function = "function"
    packed_metadata = (4, 1, 0)

    def __init__(self) -> None:
        self.direct: list[tuple] = []

    def run(self, *args) -> None:
        self.direct.append(args)


class _Kernel:
    """Stands for a JIT kernel: `kernel[grid](...)` is Triton's path (recorded), returning its compiled
    kernel."""

    arg_names = ["X", "Y", "n", "scale", "stride", "BLOCK", "FLAG"]
    pre_run_hooks: list = []

    def __init__(self) -> None:
        self.compiled = _Compiled()
        self.through_triton: list[tuple] = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.through_triton.append((grid, args, kwargs))
            return self.compiled

        return run


@pytest.fixture
def fake_device(monkeypatch):
    """The current device of Triton's driver, as a settable one-element list (device 0 at first)."""
    current = [0]
    active = types.SimpleNamespace(get_current_device=lambda: current[0], get_current_stream=lambda d: 100 + d)
    monkeypatch.setattr(launch, "driver", types.SimpleNamespace(active=active))
    monkeypatch.setattr(launch, "_cuda_get_device", None)  # read through the driver above
    return current


def _tensors(dtype=torch.float16):
    return torch.randn(64, dtype=dtype), torch.randn(32, dtype=dtype)


def _launch(cache, kernel, x, y, grid=(4, 2), n=64, scale=0.5, stride=16, BLOCK=32, FLAG=True):  # noqa: N803
    return cache(kernel, grid, x, y, n, scale, stride, BLOCK=BLOCK, FLAG=FLAG, num_warps=4)


def test_the_second_launch_records_and_the_third_launches_the_compiled_kernel(fake_device):
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for _ in range(3):
        assert _launch(cache, kernel, x, y) is kernel.compiled
    assert len(kernel.through_triton) == 2
    # What Triton's launch passes: grid, stream, function, metadata, no hooks, then every parameter.
    assert kernel.compiled.direct == [(4, 2, 1, 100, "function", (4, 1, 0), None, None, None, x, y, 64, 0.5, 16, 32,
                                       True)]


def _cuda_launcher(global_scratch: int = 0):
    """A Triton CudaLauncher (made without compiling a launcher module) whose C launch records its
    arguments."""
    from triton.backends.nvidia.driver import CudaLauncher

    made = object.__new__(CudaLauncher)
    made.calls = []
    made.launch = lambda *args: made.calls.append(args)
    made.num_ctas, made.launch_cooperative_grid, made.launch_pdl = 1, False, True
    made.global_scratch_size, made.global_scratch_align = global_scratch, 128
    made.profile_scratch_size, made.profile_scratch_align = 0, 1
    return made


@pytest.mark.parametrize("global_scratch", [0, 256])
def test_a_cuda_launch_below_the_launchers_call_passes_what_its_call_would(fake_device, monkeypatch, global_scratch):
    """Without scratch memory the recorded launch calls the CUDA launcher's C launch itself: with the
    arguments Triton's own `CudaLauncher.__call__` passes it (run here on the same launch). A launcher
    that needs scratch memory is called as Triton calls it."""
    from triton.runtime import _allocation

    monkeypatch.setattr(_allocation, "_allocator", types.SimpleNamespace(get=lambda: lambda size, align, stream: "s"))
    cache, kernel = launch.LaunchCache(), _Kernel()
    kernel.compiled.run = launcher = _cuda_launcher(global_scratch)
    x, y = _tensors()
    for _ in range(3):
        _launch(cache, kernel, x, y)
    assert len(kernel.through_triton) == 2 and len(launcher.calls) == 1
    type(launcher).__call__(launcher, 4, 2, 1, 100, "function", (4, 1, 0), None, None, None, x, y, 64, 0.5, 16, 32,
                            True)
    direct, tritons = launcher.calls
    assert direct == tritons and direct[7] == ("s" if global_scratch else None)


CHANGES = {
    "grid dimensions": lambda x, y: {"grid": (4, 2, 1)},
    "an empty grid": lambda x, y: {"grid": (0, 2)},
    "constexpr value": lambda x, y: {"BLOCK": 64},
    "constexpr type (1 for True)": lambda x, y: {"FLAG": 1},
    "int value": lambda x, y: {"n": 65},
    "int equal to 1": lambda x, y: {"n": 1},
    "one int alike, the next not": lambda x, y: {"n": 80, "stride": 17},
    "int as float": lambda x, y: {"stride": 16.0},
    "tensor dtype": lambda x, y: {"x": x.float()},
    "misaligned tensor": lambda x, y: {"x": _misaligned(x)},
    "None for a tensor": lambda x, y: {"y": None},
    "tensor for an int": lambda x, y: {"n": torch.ones(())},
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_launch_that_specializes_otherwise_goes_through_triton(change, fake_device):
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for _ in range(2):
        _launch(cache, kernel, x, y)
    changed = {"x": x, "y": y, **CHANGES[change](x, y)}
    _launch(cache, kernel, **changed)
    assert len(kernel.through_triton) == 3 and not kernel.compiled.direct
    _launch(cache, kernel, x, y)  # the recorded launch is still served
    assert len(kernel.compiled.direct) == 1


def test_ints_that_specialize_alike_and_another_grid_launch_the_record_with_their_values(fake_device):
    """A launch of new sizes (a cache one key longer, another grid) takes the recorded compiled kernel
    when Triton would specialize every int alike: 64 and 80 are both multiples of 16 in int32."""
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for _ in range(2):
        _launch(cache, kernel, x, y)
    _launch(cache, kernel, x, y, grid=(5, 3), n=80, stride=2**31 + 16)  # stride: int64 now
    _launch(cache, kernel, x, y, grid=(5, 3), n=80, stride=32)
    assert len(kernel.through_triton) == 3
    assert kernel.compiled.direct == [(5, 3, 1, 100, "function", (4, 1, 0), None, None, None, x, y, 80, 0.5, 32, 32,
                                       True)]


def test_a_constexpr_passed_by_position_is_compared_by_value(fake_device):
    """Triton compiles a constexpr's value in: 16 and 32 specialize alike as ints, not as constexprs."""
    cache, kernel = launch.LaunchCache(), _Kernel()
    kernel.params = [types.SimpleNamespace(is_constexpr=name in ("stride", "BLOCK", "FLAG"))
                     for name in kernel.arg_names]
    x, y = _tensors()
    for _ in range(2):
        _launch(cache, kernel, x, y)
    _launch(cache, kernel, x, y, stride=32)
    assert len(kernel.through_triton) == 3 and not kernel.compiled.direct
    _launch(cache, kernel, x, y, n=80)  # an int parameter: its class decides
    assert len(kernel.compiled.direct) == 1


def _on_another_device_then_under_a_hook(fake_device, launch_once) -> None:
    """One launch with device 1 current, then one on device 0 with a launch hook set."""
    fake_device[0] = 1
    launch_once()
    fake_device[0] = 0
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch_once()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)


def test_another_current_device_or_a_launch_hook_goes_through_triton(fake_device):
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for _ in range(2):
        _launch(cache, kernel, x, y)
    _on_another_device_then_under_a_hook(fake_device, lambda: _launch(cache, kernel, x, y))
    assert len(kernel.through_triton) == 4 and not kernel.compiled.direct


def test_a_new_float_value_needs_no_new_record(fake_device):
    """Triton specializes floats only as fp32: a new sm_scale launches the recorded kernel."""
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for scale in (0.5, 0.5, 0.25, 2.0):
        _launch(cache, kernel, x, y, scale=scale)
    assert len(kernel.through_triton) == 2
    assert [args[12] for args in kernel.compiled.direct] == [0.25, 2.0]


def test_misaligned_launches_are_never_recorded(fake_device):
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    x = _misaligned(x)
    for _ in range(4):
        _launch(cache, kernel, x, y)
    assert len(kernel.through_triton) == 4 and not kernel.compiled.direct


def test_alternating_specializations_are_both_kept(fake_device):
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for _ in range(5):
        _launch(cache, kernel, x, y, FLAG=True)
        _launch(cache, kernel, x, y, FLAG=False)
    assert len(kernel.through_triton) == 3 and len(kernel.compiled.direct) == 7


def test_launches_that_change_every_time_stop_recording(fake_device, monkeypatch):
    records = []
    real = launch._record
    monkeypatch.setattr(launch, "_record", lambda *a: records.append(1) or real(*a))
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for block in range(100, 150):  # a new constexpr each time
        _launch(cache, kernel, x, y, BLOCK=block)
    assert len(records) == launch.MAX_MISSES
    (site,) = cache._sites.values()
    assert len(site.records) == launch.MAX_RECORDS
    assert len(kernel.through_triton) == 50 and not kernel.compiled.direct


def _signed(cache, kernel, x, y, signature="sig", **changes):
    return cache.signed(signature, kernel, (4, 2), (x, y, changes.get("n", 64), 0.5, 16),
                        {"BLOCK": 32, "FLAG": True, "num_warps": 4})


def test_signed_launches_take_their_record_without_comparing(fake_device, monkeypatch):
    """A signature's launches, once one of them made a record, take it with only the tensors' alignment
    checked (not the comparison of `matches`), with the call's own tensors and scalars; a misaligned
    tensor, another current device and a launch hook still go through Triton."""
    compared = []
    real = launch._Record.matches
    monkeypatch.setattr(launch._Record, "matches", lambda self, *a: compared.append(1) or real(self, *a))
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for _ in range(2):
        _signed(cache, kernel, x, y)
    assert len(kernel.through_triton) == 2 and not compared  # the second launch made the record
    other_x, other_y = _tensors()
    _signed(cache, kernel, other_x, other_y, n=80)
    assert not compared and kernel.compiled.direct == [(4, 2, 1, 100, "function", (4, 1, 0), None, None, None, other_x,
                                                        other_y, 80, 0.5, 16, 32, True)]
    _signed(cache, kernel, _misaligned(x), y)
    _on_another_device_then_under_a_hook(fake_device, lambda: _signed(cache, kernel, x, y))
    assert len(kernel.through_triton) == 5 and len(kernel.compiled.direct) == 1


def test_a_signature_takes_the_record_an_unsigned_launch_made_and_signatures_are_capped(fake_device):
    """A signed launch that matches a record made by plain launches takes it (and keeps it for its
    signature); past MAX_SIGNATURES signatures the cache forgets them all, not the records."""
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for _ in range(2):
        _launch(cache, kernel, x, y)
    for i in range(launch.MAX_SIGNATURES + 1):
        _signed(cache, kernel, x, y, signature=("sig", i))
    assert len(kernel.through_triton) == 2 and len(kernel.compiled.direct) == launch.MAX_SIGNATURES + 1
    assert list(cache._signed) == [("sig", launch.MAX_SIGNATURES)]


def test_launch_signed_signs_a_launch_cache_only_and_packs_nothing(fake_device):
    """`launch_signed` takes the cache's signed path only with a LaunchCache and a signature; a launch
    function, or no signature, gets the plain call. On a hit the keyword dict is not read."""
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    kwargs = {"BLOCK": 32, "FLAG": True, "num_warps": 4}
    launch.launch_signed(launch.triton_launch, "sig", kernel, (4, 2), (x, y, 64, 0.5, 16), kwargs)
    assert kernel.through_triton == [((4, 2), (x, y, 64, 0.5, 16), kwargs)]
    launch.launch_signed(cache, None, kernel, (4, 2), (x, y, 64, 0.5, 16), kwargs)
    assert not cache._signed and len(kernel.through_triton) == 2
    for _ in range(2):
        launch.launch_signed(cache, "sig", kernel, (4, 2), (x, y, 64, 0.5, 16), kwargs)
    launch.launch_signed(cache, "sig", kernel, (4, 2), (x, y, 64, 0.5, 16), {})  # a hit reads no kwargs
    assert list(cache._signed) == ["sig"] and len(kernel.through_triton) == 3 and len(kernel.compiled.direct) == 2


def test_records_hold_no_tensor(fake_device):
    cache, kernel = launch.LaunchCache(), _Kernel()
    x, y = _tensors()
    for _ in range(3):
        _launch(cache, kernel, x, y)
    kernel.through_triton.clear()
    kernel.compiled.direct.clear()
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None


def _descriptor(rows: int = 16, dtype=torch.float16):
    """A Gluon host TMA descriptor over a fresh [2, 64, 4, 64] tensor, blocks of `rows` rows of one head."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t = torch.zeros(2, 64, 4, 64, dtype=dtype)
    elem = gl.float16 if dtype == torch.float16 else gl.bfloat16
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, 1, 64], elem)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, 64], layout)


def test_descriptor_launches_are_recorded_by_their_mangled_type(fake_device):
    """TMA descriptors (the Gluon kernels' arguments) take the recorded launch when Triton would mangle
    them alike, whatever tensor they describe; another block shape or element type goes through
    Triton; the record keeps neither a descriptor nor its tensor."""
    cache, kernel = launch.LaunchCache(), _Kernel()
    desc, y = _descriptor(), torch.randn(32, dtype=torch.float16)
    for _ in range(3):
        _launch(cache, kernel, desc, y)
    assert len(kernel.through_triton) == 2 and kernel.compiled.direct[0][9] is desc
    other = _descriptor()
    _launch(cache, kernel, other, y)
    assert len(kernel.compiled.direct) == 2 and kernel.compiled.direct[1][9] is other
    for changed in (_descriptor(rows=32), _descriptor(dtype=torch.bfloat16)):
        _launch(cache, kernel, changed, y)
    assert len(kernel.through_triton) == 4 and len(kernel.compiled.direct) == 2
    kernel.through_triton.clear()
    kernel.compiled.direct.clear()
    alive, alive_tensor = weakref.ref(other), weakref.ref(other.base)
    del desc, other, changed
    gc.collect()
    assert alive() is None and alive_tensor() is None


def test_descriptor_launches_keep_their_tensor_maps_and_pass_what_triton_would(fake_device, monkeypatch):
    """A recorded launch of a kernel with descriptor parameters calls the C launch below Triton's
    descriptor wrapper (`wrap_handle_tensordesc`) with the arguments the wrapper itself would pass, and
    encodes a tensor map once per base address, shape and strides: again for another tensor or
    another view, never for a descriptor seen before."""
    from triton.backends.nvidia import driver as nvidia_driver

    encoded = []

    def encode(desc, meta):  # stands for the tensor-map encoding (a CUDA driver call)
        encoded.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", encode)  # what Triton's wrapper calls
    monkeypatch.setattr(launch, "_tensor_map_args", encode)
    signature = {"X": "tensordesc<fp16[1, 16, 1, 64]>", "Y": "*fp16", "n": "i32", "scale": "fp32",
                 "stride": "i32", "BLOCK": "constexpr", "FLAG": "constexpr"}
    cache, kernel = launch.LaunchCache(), _Kernel()
    kernel.compiled.run = launcher = _cuda_launcher()
    raw_calls = []
    launcher.launch = nvidia_driver.wrap_handle_tensordesc(lambda *args: raw_calls.append(args), signature,
                                                           [{"swizzle": 3}])
    desc, y = _descriptor(), torch.randn(32, dtype=torch.float16)
    for _ in range(4):
        _launch(cache, kernel, desc, y)
    assert len(kernel.through_triton) == 2 and len(raw_calls) == 2
    same_tensor_again = _descriptor()
    same_tensor_again.base = desc.base
    _launch(cache, kernel, same_tensor_again, y)
    # One encoding for the three direct launches over one tensor, by two descriptor objects.
    assert encoded == [desc.base.data_ptr()] and len(raw_calls) == 3 and raw_calls[0] == raw_calls[1] == raw_calls[2]
    launcher.launch(*raw_calls[0][:13], desc, y, 64, 0.5, 16, 32, True)  # Triton's own wrapper, same launch
    assert raw_calls[-1] == raw_calls[0] and raw_calls[0][13:17] == (("map", desc.base.data_ptr(), 3), 2, 64, 4)
    encoded.clear()
    other = _descriptor()
    _launch(cache, kernel, other, y)
    _launch(cache, kernel, other, y)
    assert encoded == [other.base.data_ptr()] and raw_calls[-1][13] == ("map", other.base.data_ptr(), 3)


def _make_descriptor(t: torch.Tensor, rows: int = 16):
    """What a launcher's descriptor maker does: a Gluon descriptor over a [b, s, h, 64] tensor."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    made = object.__new__(TensorDescriptor)  # as kreg's makers do: without the dataclass's checks
    made.__dict__.update(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=[1, rows, 1, 64],
                         layout=gl.NVMMASharedLayout.get_default_for([1, rows, 1, 64], gl.float16), padding="zero")
    return made


def _descriptor_kernel(monkeypatch):
    """A stand-in kernel whose first parameter is a descriptor, compiled to a CudaLauncher behind
    Triton's own descriptor wrapper; returns (kernel, C-launch calls, tensors encoded)."""
    from triton.backends.nvidia import driver as nvidia_driver

    encoded = []

    def encode(desc, meta):  # stands for the tensor-map encoding (a CUDA driver call)
        encoded.append((desc.base.data_ptr(), tuple(desc.strides)))
        return [("map", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", encode)
    monkeypatch.setattr(launch, "_tensor_map_args", encode)
    signature = {"X": "tensordesc<fp16[1, 16, 1, 64]>", "Y": "*fp16", "n": "i32", "scale": "fp32",
                 "stride": "i32", "BLOCK": "constexpr", "FLAG": "constexpr"}
    kernel = _Kernel()
    kernel.compiled.run = launcher = _cuda_launcher()
    raw_calls = []
    launcher.launch = nvidia_driver.wrap_handle_tensordesc(lambda *args: raw_calls.append(args), signature,
                                                           [{"swizzle": 3}])
    return kernel, raw_calls, encoded


def test_descriptors_passed_as_tensors_are_made_only_off_the_signed_path(fake_device, monkeypatch):
    """With makers, the first launches of a signature get the descriptors made from the tensors (what
    Triton's path needs); later ones pass the tensors and the C launch gets what Triton's wrapper would
    pass for the made descriptor, with each tensor map encoded once per address and strides; a
    misaligned tensor leaves the signed path."""
    kernel, raw_calls, encoded = _descriptor_kernel(monkeypatch)
    cache, made = launch.LaunchCache(), []

    def make(t):
        made.append(t)
        return _make_descriptor(t)

    x, y = torch.zeros(2, 64, 4, 64, dtype=torch.float16), torch.randn(32, dtype=torch.float16)
    kwargs = {"BLOCK": 32, "FLAG": True}
    for _ in range(4):
        launch.launch_signed(cache, "sig", kernel, (4, 2), (x, y, 64, 0.5, 16), kwargs, ((0, make),))
    assert len(kernel.through_triton) == 2 and all(call[1][0].base is x for call in kernel.through_triton)
    assert len(made) == 3 and len(raw_calls) == 2  # the third launch made one to encode its map
    expected = list(raw_calls[0][:13])
    launcher = kernel.compiled.run
    launcher.launch(*expected, _make_descriptor(x), y, 64, 0.5, 16, 32, True)  # Triton's wrapper
    assert raw_calls[-1] == raw_calls[0] == raw_calls[1]
    other = torch.zeros(2, 64, 4, 64, dtype=torch.float16)
    view = torch.zeros(2, 4, 64, 64, dtype=torch.float16).transpose(1, 2)  # another strides, same shape
    encoded.clear()
    for t in (other, other, view):
        launch.launch_signed(cache, "sig", kernel, (4, 2), (t, y, 64, 0.5, 16), kwargs, ((0, make),))
    assert encoded == [(other.data_ptr(), tuple(other.stride())), (view.data_ptr(), tuple(view.stride()))]
    assert raw_calls[-1][13] == ("map", view.data_ptr(), 3) and len(kernel.through_triton) == 2
    # A misaligned tensor leaves the signed path for the records' comparison (which, as Triton, does not
    # specialize a descriptor on its base address).
    compared = []
    real = launch._Record.matches
    monkeypatch.setattr(launch._Record, "matches", lambda self, *a: compared.append(1) or real(self, *a))
    launch.launch_signed(cache, "sig", kernel, (4, 2), (other, y, 64, 0.5, 16), kwargs, ((0, make),))
    assert not compared
    launch.launch_signed(cache, "sig", kernel, (4, 2), (_misaligned(x), y, 64, 0.5, 16), kwargs, ((0, make),))
    assert compared and made[-1].data_ptr() % 16


def test_descriptors_passed_as_tensors_are_made_for_a_launcher_that_keeps_no_maps(fake_device, monkeypatch):
    """A launcher the kept maps cannot serve (here one needing scratch memory, called as Triton calls
    it) gets the descriptors made on every launch, signed or not."""
    from triton.runtime import _allocation

    monkeypatch.setattr(_allocation, "_allocator", types.SimpleNamespace(get=lambda: lambda size, align, stream: "s"))
    cache, kernel = launch.LaunchCache(), _Kernel()
    kernel.compiled.run = launcher = _cuda_launcher(global_scratch=256)
    x, y = torch.zeros(2, 64, 4, 64, dtype=torch.float16), torch.randn(32, dtype=torch.float16)
    for _ in range(3):
        launch.launch_signed(cache, "sig", kernel, (4, 2), (x, y, 64, 0.5, 16), {"BLOCK": 32, "FLAG": True},
                             ((0, _make_descriptor),))
    assert len(kernel.through_triton) == 2 and len(launcher.calls) == 1
    passed = launcher.calls[0][13]
    assert type(passed).__name__ == "TensorDescriptor" and passed.base is x and launcher.calls[0][14] is y


def test_interpreted_kernels_always_go_through_triton():
    """In the interpreter a launch returns no compiled kernel: nothing is ever recorded."""
    if HAS_GPU:
        pytest.skip("the interpreter runs only without a GPU")
    handle = registry.get("decode", vendor=VENDOR)
    kw = _inputs("decode")
    for _ in range(3):
        handle(**kw)
    cache = _launch_cache(handle)
    assert cache._sites and not any(site.records for site in cache._sites.values())


# ----------------------------------------------------------------------------- GPU: real compiled kernels
@pytest.fixture
def triton_runs(monkeypatch):
    """Counts launches that go through Triton's JITFunction.run (as opposed to a LaunchCache's)."""
    from triton.runtime.jit import JITFunction

    calls = []
    real = JITFunction.run

    def counting(self, *args, **kwargs):
        calls.append(self.fn.__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counting)
    return calls


def _direct(name: str, kw: dict):
    """The call launched by the chosen variant through Triton's own launch."""
    choice = registry.get(name).choice(**kw)
    return choice.variant.launch(OPS[name].validate(**kw), choice.plan)


@gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_cached_launches_give_tritons_bits(name, triton_runs):
    handle = registry.get(name)
    kw = _inputs(name)
    for _ in range(2):
        handle(**kw)
    for seed in (1, 2, 3):
        fresh = _inputs(name, seed=seed)
        triton_runs.clear()
        out = handle(**fresh)
        assert not triton_runs, f"{name}: launched through Triton: {triton_runs}"
        expected = _direct(name, fresh)
        assert torch.equal(out, expected), f"{name}: cached launch differs from Triton's (seed {seed})"
        assert_close(out, _reference(name, fresh), TOLERANCE[DTYPE], what=f"{name} seed {seed}")


# The Hopper Gluon forwards a LaunchCache launches by signature, at shapes they serve (sm_90 only):
# (op, variant, shape), two sequence lengths each.
SIGNED_FORWARDS = {
    "warp-specialized": ("flash_attention", "flash_attention_warpspec",
                         {"b": 1, "s_q": 77, "s_k": 77, "h_q": 4, "h_kv": 2, "d": 64, "causal": True, "window": None}),
    "window TMA": ("sink_attention", "sink_attention_window_tma",
                   {"b": 1, "s_q": 150, "s_k": 150, "h_q": 8, "h_kv": 2, "d": 64, "causal": True, "window": 64,
                    "sinks": True}),
}


@gpu
@pytest.mark.parametrize("which", list(SIGNED_FORWARDS))
def test_signed_forwards_give_tritons_bits_for_each_signature(which, triton_runs):
    """Two lengths, with and without lse (four signatures), called in turn: every cached launch gives
    the bits of Triton's own launch of the same variant, and the reference's values."""
    name, variant, shape = SIGNED_FORWARDS[which]
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forwards run on sm_90")
    op, handle = OPS[name], registry.get(name, variant=variant)
    shapes = (shape, {**shape, "s_q": 33, "s_k": 33})

    def inputs(s, seed, return_lse):
        return {**op.make_inputs(s, device=DEVICE, dtype=DTYPE, seed=seed), "return_lse": return_lse}

    for _ in range(2):
        for s in shapes:
            for return_lse in (False, True):
                handle(**inputs(s, 0, return_lse))
    for seed in (1, 2):
        for s in shapes:
            for return_lse in (False, True):
                kw = inputs(s, seed, return_lse)
                triton_runs.clear()
                got = handle(**kw)
                assert not triton_runs, f"{which}: launched through Triton: {triton_runs}"
                choice = handle.choice(**kw)
                assert choice.variant.name == variant
                expected = choice.variant.launch(op.validate(**kw), choice.plan)
                got, expected = (got, expected) if return_lse else ((got,), (expected,))
                for a, b in zip(got, expected, strict=True):
                    assert torch.equal(a, b), f"{which} {s} lse={return_lse}: differs from Triton's launch"
                reference = op.reference(**op.validate(**kw))
                reference = reference if return_lse else (reference,)
                for a, b in zip(got, reference, strict=True):
                    assert_close(a, b, TOLERANCE[DTYPE], what=f"{which} {s} seed {seed}")


@gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_views_after_cached_launches_take_tritons_path_and_are_right(name, triton_runs):
    handle = registry.get(name)
    kw = _inputs(name)
    for _ in range(3):
        handle(**kw)
    triton_runs.clear()
    for make in (_misaligned, _strided):
        call = {**kw, "q": make(kw["q"])}
        assert_close(handle(**call), _reference(name, call), TOLERANCE[DTYPE], what=f"{name} {make.__name__} q")
    assert triton_runs, f"{name}: a view with other strides or alignment reused a recorded launch"
    out = handle(**kw)
    assert torch.equal(out, _direct(name, kw))


@gpu
@pytest.mark.parametrize("window", [None, 64])
def test_cached_backward_launches_give_tritons_gradients(window, triton_runs):
    """Under autograd the attention family's forward and backward kernels launch through the raw key's
    cache too: after two steps a third runs no kernel through Triton, and its gradients are the bits of
    the same call with every kernel launched by Triton (and match the reference's). window 64 with GQA 4
    reaches sink_attention's TMA window variant on Hopper (descriptors recorded by type)."""
    from kreg.ops.testing import GRAD_TOLERANCE, gradients, max_relative_error, reference_gradients

    op = OPS["sink_attention"]
    shape = {"b": 1, "s_q": 300, "s_k": 300, "h_q": 8, "h_kv": 2, "d": 64, "causal": True, "window": window}
    args = op.validate(**op.make_inputs(shape, device=DEVICE, dtype=DTYPE, seed=4))
    handle = registry.get("sink_attention")
    for _ in range(2):
        gradients(op, lambda a: handle(**a), args)
    triton_runs.clear()
    got, dout = gradients(op, lambda a: handle(**a), args)
    assert not triton_runs, f"launched through Triton: {triton_runs}"
    choice = handle.choice(**args)
    direct, _ = gradients(op, lambda a: choice.variant.launch(a, choice.plan), args, dout)
    assert all(torch.equal(x, y) for x, y in zip(got, direct, strict=True))
    err = max_relative_error([g.float() for g in got], reference_gradients(op, args, dout))
    assert err <= GRAD_TOLERANCE[DTYPE], f"relative error {err:.3g}"


@gpu
def test_a_growing_cache_launches_the_recorded_kernels(triton_runs):
    """Decoding into a cache one token longer each step is a new raw key every step, of one tuning key:
    after two steps have recorded the split and combine kernels, steps whose sizes Triton specializes
    alike (no length a multiple of 16) launch them directly, with their own sizes and grids, and give the
    bits of Triton's own launches (and match the reference)."""
    handle = registry.get("decode")
    for n in (301, 302):
        handle(**OPS["decode"].make_inputs({**DECODE, "n": n}, device=DEVICE, dtype=DTYPE, seed=n))
    for n in (303, 305, 306, 307):
        kw = OPS["decode"].make_inputs({**DECODE, "n": n}, device=DEVICE, dtype=DTYPE, seed=n)
        triton_runs.clear()
        out = handle(**kw)
        assert not triton_runs, f"n {n}: launched through Triton: {triton_runs}"
        assert torch.equal(out, _direct("decode", kw)), f"n {n}: differs from Triton's launch"
        assert_close(out, _reference("decode", kw), TOLERANCE[DTYPE], what=f"decode n {n}")


@gpu
def test_a_new_sm_scale_reuses_the_recorded_launches(triton_runs):
    handle = registry.get("decode")
    kw = _inputs("decode")
    for _ in range(2):
        handle(**kw, sm_scale=0.1)
    triton_runs.clear()
    call = {**kw, "sm_scale": 0.2}
    assert_close(handle(**call), _reference("decode", call), TOLERANCE[DTYPE], what="decode sm_scale 0.2")
    assert not triton_runs


@gpu
def test_launch_hooks_see_every_launch():
    handle = registry.get("decode")
    # Two kernels (a single split writes its outputs itself); splits are capped at the key tiles, so
    # the cache holds several of any tile size.
    kw = {**OPS["decode"].make_inputs({**DECODE, "n": 300}, device=DEVICE, dtype=DTYPE, seed=0), "num_splits": 2}
    for _ in range(3):
        handle(**kw)
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        handle(**kw)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 2, seen  # the split and the combine kernel


@gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_cuda_graph_capture_of_cached_launches(name, triton_runs):
    """Capture after the launches are recorded: the captured launches are the cache's (no Triton run
    during capture), and replays follow new values in the captured tensors."""
    handle = registry.get(name)
    kw = _inputs(name)
    for _ in range(3):
        handle(**kw)
    torch.cuda.synchronize()
    triton_runs.clear()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        handle(**kw)
        with torch.cuda.graph(graph, stream=stream):
            captured = handle(**kw)
    torch.cuda.current_stream().wait_stream(stream)
    assert not triton_runs, f"{name}: launched through Triton while capturing: {triton_runs}"
    gen = torch.Generator().manual_seed(99)
    for value in kw.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.copy_(torch.randn(value.shape, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, handle(**kw))
