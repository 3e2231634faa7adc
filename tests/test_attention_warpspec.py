"""The Hopper Gluon kernels of the attention family (kernels/nvidia/attention_warpspec.py and
attention_warpspec_bwd.py: flash_attention_warpspec, sink_attention_warpspec): where they run, their
config spaces, the backward's roles (Gluon dK/dV and dQ after the tiled pre kernel), their offline
sm_90 compiles, and the calls they hand to the tiled kernels (varlen, inputs TMA cannot address),
which run here in the interpreter. On an sm_90 GPU: the forward against the reference in bf16 (odd
lengths, s_q != s_k, GQA 1/4/8, sinks of +-30, causal and not, d 64 and 128, lse), every config of
its space (two and three consumer warpgroups; the three-consumer ones also on edge cases), gradients
of q, k, v and sinks against the reference's autograd over the same cases and
every dK/dV and dQ config, dispatch by name and the fallbacks. Default configs at the ops' preset keys are
compiled in test_shipped_and_default_configs.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kreg.core.device import CPU, detect, preset
from kreg.core.records import CallConfig, LaunchConfig
from kreg.core.space import INTERPRETER_DTYPE
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.contract import random_normal
from kreg.ops.testing import GRAD_TOLERANCE, TOLERANCE, assert_close, gradients, max_relative_error, reference_gradients
from kreg.registry.dispatch import candidates

from .conftest import HAS_GPU, run_compile_check

F, S = "flash_attention", "sink_attention"
# (this variant, the tiled one) per op.
NAMES = {F: ("flash_attention_warpspec", "flash_attention_tiled"),
         S: ("sink_attention_warpspec", "sink_attention_flash")}


def _named(op: str, name: str):
    return next(v for v in load_all()[op] if v.name == name and v.vendor == "nvidia")


WARPSPEC = {op: _named(op, names[0]) for op, names in NAMES.items()}
TILED = {op: _named(op, names[1]) for op, names in NAMES.items()}
KEY = {"causal": True, "d": 128, "dtype": "bf16", "h_kv": 16, "h_q": 16, "s_k": 8192, "s_q": 8192, "window": None}
ON_HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (H100/H200)")


# ----------------------------------------------------------------------------- variant data, no kernel runs
@pytest.mark.parametrize("changes,expected", [
    ({}, True),
    ({"d": 64}, True),
    ({"dtype": "fp16"}, True),
    ({"causal": False, "h_kv": 2}, True),
    ({"s_q": 1, "s_k": 32768}, True),
    ({"window": 128}, False),          # windows: the tiled kernel visits only the keys a window reaches
    ({"d": 256}, False),
    ({"d": 96}, False),                # a TMA box per head dim 64 or 128 only
    ({"d": 32}, False),
    ({"dtype": "fp32"}, False),
])
@pytest.mark.parametrize("op", [F, S])
def test_supports_hopper_keys_only(op, changes, expected):
    key = {**KEY, **({"sinks": True} if op == S else {}), **changes}
    for target in ("h100", "h200"):
        assert WARPSPEC[op].supports(key, preset(target)) is expected
    for other in ("mi300x", "mi355x", "cpu"):
        assert not WARPSPEC[op].supports(key, preset(other))


@pytest.mark.parametrize("op", [F, S])
def test_registry_prefers_it_on_hopper_and_never_on_cpu(op):
    warpspec, tiled = NAMES[op]
    for target in ("h100", "h200"):
        assert [v.name for v in candidates(op, "nvidia", None, KEY, preset(target))] == [warpspec, tiled]
        assert [v.name for v in candidates(op, "nvidia", None, {**KEY, "window": 64}, preset(target))] == [tiled]
    assert [v.name for v in candidates(op, "nvidia", None, KEY, CPU)] == [tiled]
    assert not WARPSPEC[op].runs_in_interpreter and WARPSPEC[op].priority > TILED[op].priority


def test_space_and_pruning():
    """Rows per warpgroup, key tiles, ring depth, consumer warpgroups, their registers and waits: two
    consumers as before (10 configs at d 128, where 128-row warpgroups spill, 16 at d 64), three with
    160 registers and 64 rows each (6 configs at d 128, 64-key tiles only; 8 at d 64, 128-key tiles
    waiting once); every one fits an H100/H200's shared memory, and the estimate is what sm_90 compiles
    allocate, give or take the barriers' alignment."""
    from kreg.kernels.nvidia.attention_warpspec import shared_bytes

    target = preset("h200")
    warpspec = WARPSPEC[F]
    for d, two, three in ((128, 10, 6), (64, 16, 8)):
        key = {**KEY, "d": d}
        space = warpspec.space(key, target)["fwd"]
        assert len(space) == len(set(space)) == two + three
        by_consumers = {n: [c.blocks for c in space if c.blocks["CONSUMERS"] == n] for n in (2, 3)}
        assert [len(by_consumers[2]), len(by_consumers[3])] == [two, three]
        assert {c.num_warps for c in space} == {4}
        assert {b["CONSUMER_REGS"] for b in by_consumers[2]} == {232, 240}
        assert {b["MMA_WAITS"] for b in by_consumers[2]} == {2}
        assert {(b["BLOCK_M"], b["CONSUMER_REGS"]) for b in by_consumers[3]} == {(64, 160)}
        assert {b["MMA_WAITS"] for b in by_consumers[3] if b["BLOCK_N"] == 64} == {1, 2}
        assert {b["MMA_WAITS"] for b in by_consumers[3] if b["BLOCK_N"] == 128} == ({1} if d == 64 else set())
        assert all(c.blocks["NUM_STAGES"] * c.blocks["BLOCK_N"] <= 384 for c in space)
        assert all(warpspec.prune_reason("fwd", c, key, target) is None for c in space)
        assert warpspec.default_config(key, target)["fwd"] in space
        assert ({b["BLOCK_M"] for b in by_consumers[2]} == {64}) is (d == 128)
    # Measured with tuning.compile_check (bf16, sm_90): the d 128 default, the largest config, and
    # three consumers at d 128 (4 stages of 64 keys) and d 64 (3 stages of 128 keys).
    default = warpspec.default_config(KEY, target)["fwd"]
    assert default.blocks["CONSUMERS"] == 2 and default.blocks["MMA_WAITS"] == 2
    assert 0 <= 164_208 - shared_bytes(default, 128) < 512
    widest = LaunchConfig(blocks={**default.blocks, "NUM_STAGES": 3}, num_warps=4)
    assert 0 <= 229_808 - shared_bytes(widest, 128) < 512 and shared_bytes(widest, 128) < target.shared_mem_bytes
    three = {"CONSUMERS": 3, "CONSUMER_REGS": 160, "MMA_WAITS": 1}
    deep = LaunchConfig(blocks={**default.blocks, **three, "BLOCK_N": 64, "NUM_STAGES": 4}, num_warps=4)
    assert 0 <= 180_712 - shared_bytes(deep, 128) < 512
    wide = LaunchConfig(blocks={**default.blocks, **three, "NUM_STAGES": 3}, num_warps=4)
    assert 0 <= 123_368 - shared_bytes(wide, 64) < 512
    assert warpspec.prune_reason("fwd", LaunchConfig(blocks={"BLOCK_M": 64}), KEY, target).startswith("blocks")


def test_a_tuned_forward_from_before_three_consumers_keeps_its_kernel():
    """Shipped entries name the forward's blocks without CONSUMERS and MMA_WAITS: they complete with two
    consumers and two waits (the kernel they were measured with), whatever their CONSUMER_REGS."""
    target = preset("h200")
    for op in (F, S):
        key = {**KEY, "d": 64, "h_q": 64, "h_kv": 8, **({"sinks": True} if op == S else {})}
        variant = WARPSPEC[op]
        for regs in (232, 240):
            old = LaunchConfig(blocks={"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 2, "CONSUMER_REGS": regs},
                               num_warps=4)
            done = variant.complete(CallConfig({"fwd": old}), key, target)["fwd"]
            assert done.blocks == {**old.blocks, "CONSUMERS": 2, "MMA_WAITS": 2}
            assert done in variant.space(key, target)["fwd"]


@pytest.mark.parametrize("op", [F, S])
def test_backward_roles(op):
    """The pre role is the tiled variant's (kernel, space, default); dK/dV and dQ are Gluon kernels
    with spaces of their own."""
    from kreg.kernels.nvidia.attention_warpspec_bwd import (
        DKV_SPACE,
        DQ_SPACE,
        _attention_bwd_dkv_ws_kernel,
        _attention_bwd_dq_ws_kernel,
    )

    warpspec, tiled = WARPSPEC[op], TILED[op]
    assert warpspec.roles == tiled.roles == ("fwd", "bwd_pre", "bwd_dkv", "bwd_dq")
    assert warpspec.kernels["fwd"] is not tiled.kernels["fwd"]
    assert warpspec.kernels["bwd_dkv"] is _attention_bwd_dkv_ws_kernel and warpspec.spaces["bwd_dkv"] is DKV_SPACE
    assert warpspec.kernels["bwd_dq"] is _attention_bwd_dq_ws_kernel and warpspec.spaces["bwd_dq"] is DQ_SPACE
    assert warpspec.kernels["bwd_pre"] is tiled.kernels["bwd_pre"]
    assert warpspec.spaces["bwd_pre"] is tiled.spaces["bwd_pre"]
    target = preset("h200")
    assert warpspec.default_config(KEY, target)["bwd_pre"] == tiled.default_config(KEY, target)["bwd_pre"]
    assert warpspec.source_hash != tiled.source_hash


def test_dkv_space_and_pruning():
    """32- and 64-row query tiles (64 at d 64 only), 64 keys per warpgroup, at most 128 query rows in
    the ring: 6 configs at d 128, 8 at d 64, each fitting an H100/H200; the estimate is what sm_90
    compiles allocate, give or take alignment and the layout conversions' scratch."""
    from kreg.kernels.nvidia.attention_warpspec_bwd import dkv_shared_bytes

    target = preset("h200")
    warpspec = WARPSPEC[F]
    for d, size, default in ((128, 6, {"BLOCK_M": 32, "NUM_STAGES": 4}), (64, 8, {"BLOCK_M": 64, "NUM_STAGES": 2})):
        key = {**KEY, "d": d}
        space = warpspec.space(key, target)["bwd_dkv"]
        assert len(space) == len(set(space)) == size
        assert {c.num_warps for c in space} == {4} and {c.blocks["BLOCK_N"] for c in space} == {64}
        assert all(c.blocks["NUM_STAGES"] * c.blocks["BLOCK_M"] <= 128 for c in space)
        assert all(warpspec.prune_reason("bwd_dkv", c, key, target) is None for c in space)
        chosen = warpspec.default_config(key, target)["bwd_dkv"]
        assert chosen in space and {name: chosen.blocks[name] for name in default} == default
    # Measured with tuning.compile_check (bf16, sm_90): the d 128 default allocates 132_504 B.
    chosen = warpspec.default_config(KEY, target)["bwd_dkv"]
    assert 0 <= 132_504 - dkv_shared_bytes(chosen, 128) < 512
    assert warpspec.prune_reason("bwd_dkv", LaunchConfig(blocks={"BLOCK_M": 64}), KEY, target).startswith("blocks")


def test_dq_space_and_pruning():
    """64-row warpgroups, 64- or 128-key tiles (128 at d 128 only with 240 consumer registers), at most
    256 keys in the ring: 7 configs at d 128, 8 at d 64, each fitting an H100/H200; default 64 x 128
    with two stages at both; the estimate is what sm_90 compiles allocate, give or take alignment."""
    from kreg.kernels.nvidia.attention_warpspec_bwd import dq_shared_bytes

    target = preset("h200")
    warpspec = WARPSPEC[F]
    default = {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 2, "CONSUMER_REGS": 240}
    for d, size in ((128, 7), (64, 8)):
        key = {**KEY, "d": d}
        space = warpspec.space(key, target)["bwd_dq"]
        assert len(space) == len(set(space)) == size
        assert {c.num_warps for c in space} == {4} and {c.blocks["BLOCK_M"] for c in space} == {64}
        assert all(c.blocks["NUM_STAGES"] * c.blocks["BLOCK_N"] <= 256 for c in space)
        assert all(c.blocks["CONSUMER_REGS"] == 240 for c in space if c.blocks["BLOCK_N"] == 128) is (d == 128)
        assert all(warpspec.prune_reason("bwd_dq", c, key, target) is None for c in space)
        chosen = warpspec.default_config(key, target)["bwd_dq"]
        assert chosen in space and chosen.blocks == default
    # Measured with tuning.compile_check (bf16, sm_90): the d 128 default allocates 196_904 B.
    assert 0 <= 196_904 - dq_shared_bytes(warpspec.default_config(KEY, target)["bwd_dq"], 128) < 512
    assert warpspec.prune_reason("bwd_dq", LaunchConfig(blocks={"BLOCK_N": 64}), KEY, target).startswith("blocks")


def test_which_inputs_tma_can_address():
    """16-byte aligned bases and strides (size-1 dims aside); the rest runs the tiled forward."""
    from kreg.kernels.nvidia.attention_tma import tma_addressable

    def strided(shape, d_alloc=64, order=(0, 1, 2, 3)):
        full = torch.empty([shape[i] for i in order[:3]] + [d_alloc], dtype=torch.bfloat16)
        return full.permute(*[order.index(i) for i in range(4)])[..., :64]

    assert tma_addressable(strided((2, 300, 4, 64)))
    assert tma_addressable(strided((2, 300, 4, 64), order=(0, 2, 1, 3)))  # [b, h, s, d] memory
    assert tma_addressable(strided((2, 300, 4, 64), d_alloc=72))           # rows padded to 144 bytes
    assert not tma_addressable(strided((2, 300, 4, 64), d_alloc=68))       # 136-byte rows
    assert not tma_addressable(torch.empty(2, 300, 1, 64, dtype=torch.bfloat16).expand(2, 300, 4, 64))
    assert not tma_addressable(torch.empty(2 * 300 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 300, 4, 64))
    # A size-1 batch's stride is never stepped over, whatever torch says it is.
    assert tma_addressable(torch.empty(300, 4, 64, dtype=torch.bfloat16).as_strided((1, 300, 4, 64), (3, 256, 64, 1)))


# (key changes, forward blocks): the space's corners, compiled offline for sm_90 beside the defaults
# that test_shipped_and_default_configs compiles: the largest shared memory (d 128, three 128-key
# stages), 128-row warpgroups (d 64), GQA with sinks in fp16 without causal masks.
TWO = {"CONSUMERS": 2, "MMA_WAITS": 2}
THREE = {"CONSUMERS": 3, "CONSUMER_REGS": 160}
CORNERS = [
    ({}, {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 3, "CONSUMER_REGS": 232, **TWO}),
    ({"d": 64}, {"BLOCK_M": 128, "BLOCK_N": 64, "NUM_STAGES": 4, "CONSUMER_REGS": 240, **TWO}),
    ({"d": 64, "h_q": 64, "h_kv": 8, "causal": False, "dtype": "fp16", "sinks": True},
     {"BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 4, "CONSUMER_REGS": 232, **TWO}),
    # Three consumers: the gpt-oss key with 128-key tiles (the tightest registers), d 128 with the
    # deepest ring and the intra-warpgroup overlap, d 64 in fp16 without causal masks.
    ({"d": 64, "h_q": 64, "h_kv": 8, "sinks": True},
     {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 3, **THREE, "MMA_WAITS": 1}),
    ({}, {"BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 4, **THREE, "MMA_WAITS": 2}),
    ({"d": 64, "causal": False, "dtype": "fp16", "h_kv": 4},
     {"BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 2, **THREE, "MMA_WAITS": 1}),
]


# The dK/dV space's corners: the deepest ring at d 128 with GQA 8 (causal), 64-row tiles at d 64 with
# GQA 8 in fp16, without causal masks.
DKV_CORNERS = [
    ({"h_kv": 2}, {"BLOCK_M": 32, "BLOCK_N": 64, "NUM_STAGES": 4, "CONSUMER_REGS": 232}),
    ({"d": 64, "h_kv": 2, "causal": False, "dtype": "fp16"},
     {"BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 2, "CONSUMER_REGS": 240}),
]


def _shape_arguments(key: dict) -> list[str]:
    """compile_check's arguments for a shape with this tuning key (batch 1)."""
    shape = {"b": 1, **{name: value for name, value in key.items() if name != "dtype"}}
    return ["--shape-json", json.dumps(shape), "--dtype", key.get("dtype", "bf16")]


# The dQ space's corners: the deepest ring at d 128 with GQA 8 (causal), 128-key tiles at 232 registers
# at d 64 in fp16, without causal masks.
DQ_CORNERS = [
    ({"h_kv": 2}, {"BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 4, "CONSUMER_REGS": 232}),
    ({"d": 64, "h_kv": 2, "causal": False, "dtype": "fp16"},
     {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 2, "CONSUMER_REGS": 232}),
]


# Each corner is a test of its own: the compiles spread over the workers.
CORNER_CASES = [(role, kernel, changes, blocks)
                for role, corners, kernel in [("fwd", CORNERS, "_attention_fwd_ws_kernel"),
                                              ("bwd_dkv", DKV_CORNERS, "_attention_bwd_dkv_ws_kernel"),
                                              ("bwd_dq", DQ_CORNERS, "_attention_bwd_dq_ws_kernel")]
                for changes, blocks in corners]


@pytest.mark.long
@pytest.mark.parametrize("role,kernel,changes,blocks", CORNER_CASES,
                         ids=[f"{role}-{n}" for n, (role, *_) in enumerate(CORNER_CASES)])
def test_space_corners_compile_for_sm_90_without_spills(role, kernel, changes, blocks):
    op = S if "sinks" in changes else F
    config = {role: {"blocks": blocks, "num_warps": 4}}
    proc, rows = run_compile_check("--variant", NAMES[op][0], "--vendor", "nvidia", "--target", "h200", "--roles",
                                   role, *_shape_arguments({**KEY, **changes}), "--config-json", json.dumps(config))
    own = [row for row in rows if row["kernel"] == kernel]
    assert proc.returncode == 0 and own, proc.stderr[-2000:]
    for row in own:
        assert row["fits"] and row["spills"] == 0 and row["config"][role]["blocks"] == blocks, row
        assert row["shared_bytes"] <= preset("h200").shared_mem_bytes


# ----------------------------------------------------------------------------- inputs
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
DTYPE = torch.bfloat16 if HAS_GPU else INTERPRETER_DTYPE


def _make(op: str, b, s_q, s_k, h_q, h_kv, d, *, sinks=None, seed=0, dtype=None, **kw) -> dict:
    """Validated arguments: random q, k, v; sinks None, "random" (around ln s_k) or one value per head
    (repeated over the heads)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or DTYPE
    q = random_normal((b, s_q, h_q, d), device=DEVICE, dtype=dtype, generator=gen)
    k = random_normal((b, s_k, h_kv, d), device=DEVICE, dtype=dtype, generator=gen)
    v = random_normal((b, s_k, h_kv, d), device=DEVICE, dtype=dtype, generator=gen)
    if op == S:
        if isinstance(sinks, str):
            sinks = random_normal((h_q,), device=DEVICE, dtype=torch.float32, generator=gen, scale=2.0) + math.log(s_k)
        elif sinks is not None:
            sinks = torch.tensor(sinks, dtype=torch.float32).repeat(h_q // len(sinks)).to(DEVICE)
        kw["sinks"] = sinks
    return OPS[op].validate(q, k, v, **{"return_lse": True, **kw})


def _packed(op: str, seed: int = 3) -> dict:
    """A varlen call: three sequences, one of length 1 (GQA 4, causal, sinks for sink_attention)."""
    gen = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [19, 1, 40], [33, 5, 40]
    total_q, total_k = sum(lens_q), sum(lens_k)
    cu_q = torch.tensor([0, 19, 20, 60], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 33, 38, 78], dtype=torch.int32, device=DEVICE)
    q = random_normal((total_q, 8, 64), device=DEVICE, dtype=DTYPE, generator=gen)
    k = random_normal((total_k, 2, 64), device=DEVICE, dtype=DTYPE, generator=gen)
    v = random_normal((total_k, 2, 64), device=DEVICE, dtype=DTYPE, generator=gen)
    extra = {"sinks": random_normal((8,), device=DEVICE, dtype=torch.float32, generator=gen) + 3.0} if op == S else {}
    return OPS[op].validate(q, k, v, causal=True, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **extra)


def _misaligned(op: str, args: dict) -> dict:
    """The same call with q moved to a base 2 bytes past a 16-byte boundary (its strides unchanged)."""
    q = args["q"]
    room = torch.empty(q.numel() + 8, dtype=q.dtype, device=q.device)
    moved = room[1:1 + q.numel()].view(q.shape).copy_(q)
    assert moved.data_ptr() % 16
    return OPS[op].validate(**{**args, "q": moved})


@pytest.fixture
def no_gluon(monkeypatch):
    """The warp-specialized launcher fails if called: what runs is the tiled forward."""
    import kreg.kernels.nvidia.attention_warpspec as module

    def refuse(*args, **kwargs):
        raise AssertionError("the warp-specialized kernel ran on a call it must hand over")

    monkeypatch.setattr(module, "warpspec_forward", refuse)
    monkeypatch.setattr(module, "warpspec_backward", refuse)


@pytest.mark.parametrize("op", [F, S])
def test_calls_it_hands_over_run_the_tiled_kernels(op, no_gluon):
    """Varlen calls and a q that TMA cannot address run the tiled forward and backward with the tiled
    variant's default forward, dK/dV and dQ configs for the key (here in the interpreter; on a GPU through
    its own kernels)."""
    variant = WARPSPEC[op]
    device = detect(DEVICE)
    for args in (_packed(op), _misaligned(op, _make(op, 1, 21, 37, 4, 1, 64, sinks="random", causal=True))):
        key = dict(OPS[op].tuning_key(args))
        # Off Hopper the backward roles take the interpreter's tiles (the forward's config is not read).
        config = (variant if HAS_GPU else TILED[op]).default_config(key, device)
        assert_close(variant.call(args, config), OPS[op].reference(**args), TOLERANCE[DTYPE])
        plan = variant.plan(args, config)
        for role in ("fwd", "bwd_dkv", "bwd_dq"):
            assert variant.fallback(plan)[role] == TILED[op].role_default(role, key, device)
        # The backward launcher on these very tensors (autograd's leaves would be fresh, aligned copies).
        out, lse = variant.call(args, config)
        dout = random_normal(out.shape, device=DEVICE, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
        backward = variant.launchers(plan)[1]
        got = backward(args["q"], args["k"], args["v"], args.get("sinks"), out, lse, dout, args, config)
        got = [g.float() for g in got if g is not None]
        assert max_relative_error(got, reference_gradients(OPS[op], args, dout)) <= GRAD_TOLERANCE[DTYPE]


# ----------------------------------------------------------------------------- on an sm_90 GPU
def _error(variant, args: dict, config: CallConfig | None = None) -> float:
    key = dict(OPS[variant.op].tuning_key(args))
    config = config or variant.default_config(key, preset("h200"))
    out = variant.call(args, config)
    if args["return_lse"]:
        assert out[0].dtype == args["q"].dtype and out[1].dtype == torch.float32
    return max_relative_error(out, OPS[variant.op].reference(**args))


# (op, b, s_q, s_k, h_q, h_kv, d, causal, sinks, return_lse, dtype)
CASES = {
    "causal-1000-d128": (F, 2, 1000, 1000, 4, 4, 128, True, None, True, None),
    "full-127-gqa4-d64": (F, 1, 127, 127, 8, 2, 64, False, None, True, None),
    "causal-sq<sk-gqa8-d128": (F, 2, 17, 1000, 8, 1, 128, True, None, True, None),
    "causal-sq>sk-empty-rows-d64": (F, 1, 1000, 17, 4, 4, 64, True, None, True, None),
    "causal-q1-k8191-d128": (F, 1, 1, 8191, 4, 1, 128, True, None, True, None),
    "causal-8191-fp16-no-lse": (F, 1, 8191, 8191, 2, 2, 64, True, None, False, torch.float16),
    "full-1-d64": (F, 3, 1, 1, 2, 1, 64, False, None, True, None),
    "sinks-causal-1000-gqa8-d64": (S, 1, 1000, 1000, 16, 2, 64, True, "random", True, None),
    "sinks+-30-causal-gqa4-d128": (S, 2, 127, 300, 8, 2, 128, True, (30.0, -30.0), True, None),
    "sinks+-30-full-sq>sk-d64": (S, 1, 300, 127, 4, 4, 64, False, (-30.0, 30.0), True, None),
    "sinks-full-17-fp16-no-lse": (S, 2, 17, 17, 4, 1, 128, False, "random", False, torch.float16),
}


@hopper
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    op, b, s_q, s_k, h_q, h_kv, d, causal, sinks, lse, dtype = CASES[case]
    args = _make(op, b, s_q, s_k, h_q, h_kv, d, sinks=sinks, causal=causal, return_lse=lse, dtype=dtype,
                 seed=len(case))
    err = _error(WARPSPEC[op], args)
    assert err <= TOLERANCE[args["q"].dtype], f"{case}: relative error {err:.3g}"


@pytest.mark.long
@hopper
@pytest.mark.parametrize("part", range(3))
@pytest.mark.parametrize("d", [64, 128])
def test_every_config_of_the_space_matches_reference(d, part):
    """Causal GQA with lengths no tile divides, and s_q < s_k, at every config of the space (a third of
    it per test: each config compiles, minutes for the whole space on one worker)."""
    variant = WARPSPEC[S]
    args = _make(S, 1, 999, 1001, 8, 2, d, sinks="random", causal=True, seed=d)
    key = dict(OPS[S].tuning_key(args))
    default = variant.default_config(key, preset("h200"))
    expected = OPS[S].reference(**args)
    for config in variant.space(key, preset("h200"))["fwd"][part::3]:
        out = variant.call(args, default.replace("fwd", config))
        assert_close(out, expected, TOLERANCE[torch.bfloat16], what=str(config))


@hopper
@pytest.mark.parametrize("case", ["causal-sq>sk-empty-rows-d64", "sinks+-30-full-sq>sk-d64"])
def test_three_consumers_on_edge_cases(case):
    """Every three-consumer config of the space on two d 64 edge cases: rows with no key (whole
    warpgroups' and CTAs' among them), extreme sinks without causal masks (a CTA whose later
    warpgroups hold no row of the sequence: the every-config test's s_q 999 too)."""
    op, b, s_q, s_k, h_q, h_kv, d, causal, sinks, lse, dtype = CASES[case]
    args = _make(op, b, s_q, s_k, h_q, h_kv, d, sinks=sinks, causal=causal, return_lse=lse, dtype=dtype,
                 seed=len(case))
    variant = WARPSPEC[op]
    key = dict(OPS[op].tuning_key(args))
    default = variant.default_config(key, preset("h200"))
    expected = OPS[op].reference(**args)
    configs = [c for c in variant.space(key, preset("h200"))["fwd"] if c.blocks["CONSUMERS"] == 3]
    assert len(configs) == 8
    for config in configs:
        out = variant.call(args, default.replace("fwd", config))
        assert_close(out, expected, TOLERANCE[args["q"].dtype], what=f"{case} {config}")


# (op, b, s_q, s_k, h_q, h_kv, d, causal, sinks): the backward's cases, lengths no tile divides.
GRAD_CASES = {
    "causal-77x93-gqa4-d64-sinks": (S, 2, 77, 93, 8, 2, 64, True, "random"),
    "causal-77x93-gqa4-d128": (F, 2, 77, 93, 8, 2, 128, True, None),
    "causal-300-gqa1-d128": (F, 1, 300, 300, 4, 4, 128, True, None),
    "causal-sq>sk-empty-rows-gqa8-d64": (F, 1, 333, 65, 8, 1, 64, True, None),
    "causal-sq<sk-gqa8-d128-sinks+-30": (S, 1, 65, 333, 8, 1, 128, True, (30.0, -30.0)),
    "full-201x130-gqa1-d64-sinks+-30": (S, 2, 201, 130, 4, 4, 64, False, (-30.0, 30.0)),
    "full-130x201-gqa4-d128": (F, 1, 130, 201, 8, 2, 128, False, None),
    "full-1x1-gqa8-d64-sinks": (S, 2, 1, 1, 8, 1, 64, False, "random"),  # with no sink dQ = dK = 0 exactly
}


def _gradient_error(variant, args: dict, config: CallConfig | None = None) -> float:
    config = config or variant.default_config(dict(OPS[variant.op].tuning_key(args)), preset("h200"))
    got, dout = gradients(OPS[variant.op], lambda a: variant.call(a, config), args)
    return max_relative_error([g.float() for g in got], reference_gradients(OPS[variant.op], args, dout))


@hopper
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_match_reference(case):
    """Gradients of q, k, v (and sinks) through the Gluon forward, dK/dV and dQ kernels against the
    reference's fp32 autograd."""
    op, b, s_q, s_k, h_q, h_kv, d, causal, sinks = GRAD_CASES[case]
    args = _make(op, b, s_q, s_k, h_q, h_kv, d, sinks=sinks, causal=causal, seed=len(case))
    err = _gradient_error(WARPSPEC[op], args)
    assert err <= GRAD_TOLERANCE[torch.bfloat16], f"{case}: relative error {err:.3g}"


@hopper
@pytest.mark.parametrize("role", ["bwd_dkv", "bwd_dq"])
@pytest.mark.parametrize("d", [64, 128])
def test_every_backward_config_matches_reference(d, role):
    """Causal GQA 4 with sinks, lengths no tile divides and s_q < s_k, at every dK/dV and every dQ
    config (the other roles at their defaults)."""
    variant = WARPSPEC[S]
    args = _make(S, 1, 199, 301, 8, 2, d, sinks="random", causal=True, seed=d)
    key = dict(OPS[S].tuning_key(args))
    default = variant.default_config(key, preset("h200"))
    for config in variant.space(key, preset("h200"))[role]:
        err = _gradient_error(variant, args, default.replace(role, config))
        assert err <= GRAD_TOLERANCE[torch.bfloat16], f"{config}: relative error {err:.3g}"


@hopper
def test_backward_is_reproducible():
    """No atomics: two backward passes give the same bits."""
    variant = WARPSPEC[S]
    args = _make(S, 1, 257, 257, 8, 1, 128, sinks="random", causal=True, seed=9)
    config = variant.default_config(dict(OPS[S].tuning_key(args)), preset("h200"))
    first, dout = gradients(OPS[S], lambda a: variant.call(a, config), args)
    second, _ = gradients(OPS[S], lambda a: variant.call(a, config), args, dout)
    assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))


@hopper
def test_strided_inputs():
    """q from a packed qkv projection, k and v in [b, h, s, d] memory: 4-D descriptors take any
    strides TMA can address."""
    gen = torch.Generator().manual_seed(11)
    b, s, h, d = 2, 333, 4, 128
    qkv = random_normal((b, s, 3 * h, d), device=DEVICE, dtype=DTYPE, generator=gen)
    kv = random_normal((2, b, h, s, d), device=DEVICE, dtype=DTYPE, generator=gen)
    args = OPS[F].validate(qkv[:, :, :h], kv[0].transpose(1, 2), kv[1].transpose(1, 2), causal=True, return_lse=True)
    assert args["q"].stride(1) == 3 * h * d and args["k"].stride(1) == d
    assert _error(WARPSPEC[F], args) <= TOLERANCE[DTYPE]


@hopper
@pytest.mark.parametrize("op", [F, S])
def test_dispatch_by_name_and_fallbacks(op, no_gluon, monkeypatch):
    """Forced by name, a padded call runs these kernels (forward and backward); windowed calls go to the
    tiled variant (sink_attention's to its short-window one, tests/test_attention_window_tma.py) through
    dispatch; varlen calls, forced to this variant, run the tiled forward and
    backward (the Gluon launchers refuse)."""
    from kreg import registry

    forced = registry.get(op, variant=NAMES[op][0])
    args = _make(op, 1, 257, 257, 8, 2, 64, sinks="random", causal=True)
    assert forced.choice(**args).variant.name == NAMES[op][0]
    windowed = _make(op, 1, 257, 257, 8, 2, 64, sinks="random", causal=True, window=32)
    window_variant = "sink_attention_window_tma" if op == S else NAMES[op][1]
    assert registry.get(op).choice(**windowed).variant.name == window_variant
    packed = _packed(op)
    assert forced.choice(**packed).variant.name == NAMES[op][0]
    assert_close(forced(**packed), OPS[op].reference(**packed), TOLERANCE[DTYPE])

    def gradient_error(call_args: dict) -> float:
        got, dout = gradients(OPS[op], lambda a: forced(**a), call_args)
        return max_relative_error([g.float() for g in got], reference_gradients(OPS[op], call_args, dout))

    assert gradient_error(packed) <= GRAD_TOLERANCE[DTYPE]  # the tiled backward
    monkeypatch.undo()  # the Gluon launchers back: the padded call runs them
    assert_close(forced(**args), OPS[op].reference(**args), TOLERANCE[DTYPE])
    assert gradient_error(args) <= GRAD_TOLERANCE[DTYPE]
