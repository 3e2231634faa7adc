"""The Hopper short-window forward with TMA loads (kernels/nvidia/attention_window.py,
sink_attention_window_tma; flash_attention's windows keep the tiled kernel): which keys it serves, its config space, its
offline sm_90 compiles, and the calls it hands to the tiled kernel (varlen, inputs TMA cannot address,
a window capped below 32 keys), which run here in the interpreter. On an sm_90 GPU: the forward against
the reference in bf16 and fp16 (lengths no block divides, s_q != s_k both ways, windows of 32/64/128
and a window longer than the sequence, GQA 4/8/16, sinks of +-30, d 64 and 128, with and without lse),
every config of its space, gradients through it and the tiled backward, and dispatch: a padded window
call reaches it through `registry.get`, a varlen one the tiled forward."""

from __future__ import annotations

import json

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
NAMES = {S: ("sink_attention_window_tma", "sink_attention_flash")}
# gpt-oss's sliding-window layers.
KEY = {"causal": True, "d": 64, "dtype": "bf16", "h_kv": 8, "h_q": 64, "s_k": 8192, "s_q": 8192, "sinks": True,
       "window": 128}


def _named(op: str, name: str):
    return next(v for v in load_all()[op] if v.name == name and v.vendor == "nvidia")


WINDOW = {op: _named(op, names[0]) for op, names in NAMES.items()}
TILED = {op: _named(op, names[1]) for op, names in NAMES.items()}
TILED[F] = _named(F, "flash_attention_tiled")
ON_HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (H100/H200)")


def _key(**changes) -> dict:
    return {**KEY, **changes}


# ----------------------------------------------------------------------------- variant data, no kernel runs
@pytest.mark.parametrize("changes,expected", [
    ({}, True),
    ({"window": 32}, True),
    ({"window": 64, "d": 128, "dtype": "fp16"}, True),
    ({"h_q": 32, "h_kv": 8}, True),        # GQA 4: 16 tokens x 4 heads
    ({"h_q": 16, "h_kv": 8}, False),       # GQA 2: a block would hold fewer than a warpgroup's 64 rows
    ({"window": 256}, False),              # the no-loop form covers 32..128 keys
    ({"window": 48}, False),
    ({"window": None}, False),
    ({"causal": False, "window": None}, False),
    ({"d": 96}, False),
    ({"dtype": "fp32"}, False),
])
def test_supports_hopper_window_keys_only(changes, expected):
    key = _key(**changes)
    for target in ("h100", "h200"):
        assert WINDOW[S].supports(key, preset(target)) is expected
    for other in ("mi300x", "mi355x", "cpu"):
        assert not WINDOW[S].supports(key, preset(other))


def test_registry_prefers_it_for_windows_on_hopper():
    """sink_attention's window keys on Hopper; flash_attention's windows stay with the tiled variant."""
    window, tiled = NAMES[S]
    for target in ("h100", "h200"):
        assert [v.name for v in candidates(S, "nvidia", None, _key(), preset(target))] == [window, tiled]
        flash_key = {k: v for k, v in _key().items() if k != "sinks"}
        assert [v.name for v in candidates(F, "nvidia", None, flash_key, preset(target))] == ["flash_attention_tiled"]
    assert [v.name for v in candidates(S, "nvidia", None, _key(), CPU)] == [tiled]
    assert not WINDOW[S].runs_in_interpreter and WINDOW[S].priority > TILED[S].priority


def test_space_defaults_and_pruning():
    """16 rows a warp and HEADS dividing the GQA group; the default packs 8 heads (4 where the group is
    4) into one warpgroup with 96 registers at d 64 and 168 at d 128; the backward roles are the tiled
    variant's; the shared-memory estimate is what sm_90 compiles allocate."""
    from kreg.kernels.nvidia.attention_window import shared_bytes, tiled_equivalent

    target = preset("h100")
    variant = WINDOW[S]
    space = variant.space(KEY, target)
    assert set(space) == {"fwd", "bwd_pre", "bwd_dkv", "bwd_dq"}
    for role in ("bwd_pre", "bwd_dkv", "bwd_dq"):
        assert space[role] == TILED[S].space(KEY, target)[role]
    fwd = space["fwd"]
    assert len(fwd) == len(set(fwd)) == 9
    assert all(c.blocks["TOKENS"] * c.blocks["HEADS"] == 16 * c.num_warps for c in fwd)
    assert {c.blocks["HEADS"] for c in fwd} == {4, 8}  # 16 does not divide the group of 8
    assert all(variant.prune_reason("fwd", c, KEY, target) is None for c in fwd)
    default = variant.default_config(KEY, target)["fwd"]
    assert default.blocks == {"HEADS": 8, "MAX_REGS": 96, "TOKENS": 8} and default.num_warps == 4
    group4 = {**KEY, "h_q": 32, "d": 128}
    assert variant.default_config(group4, target)["fwd"].blocks == {"HEADS": 4, "MAX_REGS": 168, "TOKENS": 16}
    assert shared_bytes(default, KEY) == 45_072  # sm_90 compile: 45 080 (barrier alignment)
    assert tiled_equivalent(default) == LaunchConfig(blocks={"BLOCK_M": 64, "BLOCK_N": 32, "HEADS": 8, "KEY_LOOPS": 2},
                                                     num_warps=4, num_stages=2)
    wrong = LaunchConfig(blocks={"TOKENS": 16, "HEADS": 8, "MAX_REGS": 96}, num_warps=4)
    assert "16 * num_warps" in variant.prune_reason("fwd", wrong, KEY, target)
    assert variant.prune_reason("fwd", LaunchConfig(blocks={"BLOCK_M": 64}), KEY, target).startswith("blocks")


def _shape_arguments(key: dict) -> list[str]:
    """compile_check's arguments for a shape with this tuning key (batch 1)."""
    shape = {"b": 1, **{name: value for name, value in key.items() if name != "dtype"}}
    return ["--shape-json", json.dumps(shape), "--dtype", key.get("dtype", "bf16")]


@pytest.mark.parametrize("changes,config", [
    ({}, {"TOKENS": 8, "HEADS": 8, "MAX_REGS": 96}),
    ({"d": 128, "h_q": 32, "window": 64}, {"TOKENS": 16, "HEADS": 4, "MAX_REGS": 168}),
    ({"window": 32, "dtype": "fp16"}, {"TOKENS": 16, "HEADS": 8, "MAX_REGS": 96}),
])
def test_compiles_for_sm_90_without_spills(changes, config):
    """The kernel (lse on) and the tiled forward its handed-over calls run, for sm_90, offline."""
    warps = config["TOKENS"] * config["HEADS"] // 16
    proc, rows = run_compile_check("--variant", NAMES[S][0], "--vendor", "nvidia", "--target", "h100", "--roles", "fwd",
                                   *_shape_arguments({**KEY, **changes}),
                                   "--config-json", json.dumps({"fwd": {"blocks": config, "num_warps": warps}}))
    assert proc.returncode == 0 and rows, proc.stderr[-2000:]
    # Padded calls run this kernel, varlen ones the tiled forward (each with and without lse).
    assert {r["kernel"] for r in rows} == {"_attention_fwd_kernel", "_attention_fwd_window_tma_kernel"}
    for row in rows:
        assert row["fits"] and row["spills"] == 0, row
        if row["kernel"] == "_attention_fwd_window_tma_kernel":
            assert row["registers"] <= config["MAX_REGS"]


# ----------------------------------------------------------------------------- inputs
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
DTYPE = torch.bfloat16 if HAS_GPU else INTERPRETER_DTYPE


def _make(op: str, b, s_q, s_k, h_q, h_kv, d, window, *, sinks=None, seed=0, dtype=None, return_lse=True) -> dict:
    """Validated causal window arguments; sinks None (random, around 3), "none" (no sinks) or one value
    per head (repeated over the heads)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or DTYPE
    q = random_normal((b, s_q, h_q, d), device=DEVICE, dtype=dtype, generator=gen)
    k = random_normal((b, s_k, h_kv, d), device=DEVICE, dtype=dtype, generator=gen)
    v = random_normal((b, s_k, h_kv, d), device=DEVICE, dtype=dtype, generator=gen)
    extra = {}
    if op == S and sinks != "none":
        if sinks is None:
            sinks = random_normal((h_q,), device=DEVICE, dtype=torch.float32, generator=gen, scale=2.0) + 3.0
        else:
            sinks = torch.tensor(sinks, dtype=torch.float32).repeat(h_q // len(sinks)).to(DEVICE)
        extra["sinks"] = sinks
    return OPS[op].validate(q, k, v, causal=True, window=window, return_lse=return_lse, **extra)


def _packed(op: str, seed: int = 3) -> dict:
    """A varlen window call: three sequences, one of length 1 (GQA 4)."""
    gen = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [19, 1, 40], [33, 5, 40]
    cu_q = torch.tensor([0, 19, 20, 60], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 33, 38, 78], dtype=torch.int32, device=DEVICE)
    q = random_normal((sum(lens_q), 8, 64), device=DEVICE, dtype=DTYPE, generator=gen)
    k = random_normal((sum(lens_k), 2, 64), device=DEVICE, dtype=DTYPE, generator=gen)
    v = random_normal((sum(lens_k), 2, 64), device=DEVICE, dtype=DTYPE, generator=gen)
    extra = {"sinks": random_normal((8,), device=DEVICE, dtype=torch.float32, generator=gen) + 3.0} if op == S else {}
    return OPS[op].validate(q, k, v, causal=True, window=32, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **extra)


def _misaligned(args: dict) -> dict:
    """The same call with q moved to a base 2 bytes past a 16-byte boundary (its strides unchanged)."""
    q = args["q"]
    room = torch.empty(q.numel() + 8, dtype=q.dtype, device=q.device)
    moved = room[1:1 + q.numel()].view(q.shape).copy_(q)
    assert moved.data_ptr() % 16
    return {**args, "q": moved}


@pytest.fixture
def no_gluon(monkeypatch):
    """The TMA launcher fails if called: what runs is the tiled forward."""
    import kreg.kernels.nvidia.attention_window as module

    def refuse(*args, **kwargs):
        raise AssertionError("the TMA window kernel ran on a call it must hand over")

    monkeypatch.setattr(module, "window_tma_forward", refuse)


def test_calls_it_hands_over_run_the_tiled_kernel(no_gluon):
    """Varlen calls, a q that TMA cannot address and a window capped at a 20-key sequence run the tiled
    forward in the same no-loop form (`tiled_equivalent`), and the tiled backward (the interpreter
    here; on a GPU its own kernels)."""
    from kreg.kernels.nvidia.attention_window import window_tma_served

    op, variant, device = S, WINDOW[S], detect(DEVICE)
    calls = [_packed(op), OPS[op].validate(**_misaligned(_make(op, 1, 21, 37, 8, 2, 64, 32))),
             _make(op, 1, 20, 20, 8, 2, 64, 64)]
    for args in calls:
        key = dict(OPS[op].tuning_key(args))
        fwd = variant.role_default("fwd", key, device)
        assert not window_tma_served(args, fwd)
        # Off Hopper the backward roles take the interpreter's tiles.
        config = (variant if HAS_GPU else TILED[op]).default_config(key, device).replace("fwd", fwd)
        out, lse = variant.call(args, config)
        assert_close((out, lse), OPS[op].reference(**args), TOLERANCE[DTYPE])
        dout = random_normal(out.shape, device=DEVICE, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
        backward = variant.launchers(variant.plan(args, config))[1]
        got = backward(args["q"], args["k"], args["v"], args.get("sinks"), out, lse, dout, args, config)
        got = [g.float() for g in got if g is not None]
        assert max_relative_error(got, reference_gradients(OPS[op], args, dout)) <= GRAD_TOLERANCE[DTYPE]


# ----------------------------------------------------------------------------- on an sm_90 GPU
def _error(variant, args: dict, config: CallConfig | None = None) -> float:
    config = config or variant.default_config(dict(OPS[variant.op].tuning_key(args)), preset("h100"))
    return max_relative_error(variant.call(args, config), OPS[variant.op].reference(**args))


# (op, b, s_q, s_k, h_q, h_kv, d, window, sinks, return_lse, dtype)
CASES = {
    "w128-1000-gqa8-d64": (S, 2, 1000, 1000, 16, 2, 64, 128, None, True, None),
    "w128-sinks+-30-gqa8-d64": (S, 1, 333, 333, 8, 1, 64, 128, (30.0, -30.0), True, None),
    "w64-sq<sk-gqa4-d128": (S, 2, 77, 301, 8, 2, 128, 64, None, True, None),
    "w32-sq>sk-empty-rows-gqa4-d64": (S, 1, 301, 77, 8, 2, 64, 32, None, True, None),
    "w128-q1-k8191-gqa16-d128": (S, 1, 1, 8191, 16, 1, 128, 128, None, True, None),
    "w128-17-gqa8-fp16-no-lse": (S, 1, 17, 17, 8, 1, 64, 128, None, False, torch.float16),
    "w32-999-gqa8-d128": (S, 1, 999, 999, 16, 2, 128, 32, None, True, None),
    "w64-1-gqa4-d64": (S, 3, 1, 1, 4, 1, 64, 64, None, True, None),
    "w128-capped-at-100-gqa8-d64": (S, 1, 100, 100, 8, 1, 64, 128, None, True, None),
    "w128-no-sinks-gqa8-d64": (S, 2, 500, 500, 8, 1, 64, 128, "none", True, None),
}


@hopper
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    op, b, s_q, s_k, h_q, h_kv, d, window, sinks, lse, dtype = CASES[case]
    args = _make(op, b, s_q, s_k, h_q, h_kv, d, window, sinks=sinks, return_lse=lse, dtype=dtype, seed=len(case))
    err = _error(WINDOW[op], args)
    assert err <= TOLERANCE[args["q"].dtype], f"{case}: relative error {err:.3g}"


@pytest.mark.long
@hopper
@pytest.mark.parametrize("d", [64, 128])
def test_every_config_of_the_space_matches_reference(d):
    """Lengths no block divides with s_q < s_k, GQA 16 (so HEADS 16 is in the space), at every config
    the sm_90 compile keeps (spilling ones are what a sweep drops untimed: at d 128 only MAX_REGS 168
    fits, and one of its four tile shapes does not)."""
    from kreg.tuning.compile_check import check_variant
    from kreg.tuning.launch_record import meta_like

    variant = WINDOW[S]
    args = _make(S, 1, 999, 1001, 16, 1, d, 128, seed=d)
    key = dict(OPS[S].tuning_key(args))
    default = variant.default_config(key, preset("h100"))
    expected = OPS[S].reference(**args)
    ran = 0
    calls = meta_like(S, args)
    for config in variant.space(key, preset("h100"))["fwd"]:
        if not all(r.fits for r in check_variant(variant, calls, default.replace("fwd", config), preset("h100"),
                                                 roles=("fwd",))):
            continue
        assert_close(variant.call(args, default.replace("fwd", config)), expected, TOLERANCE[torch.bfloat16],
                     what=str(config))
        ran += 1
    assert ran >= (6 if d == 64 else 3)


@hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gradients_match_reference(d):
    """Gradients of q, k, v and sinks through this forward (its lse) and the tiled backward."""
    op = S
    args = _make(op, 2, 201, 233, 8, 2, d, 64, seed=d)
    config = WINDOW[op].default_config(dict(OPS[op].tuning_key(args)), preset("h100"))
    got, dout = gradients(OPS[op], lambda a: WINDOW[op].call(a, config), args)
    err = max_relative_error([g.float() for g in got], reference_gradients(OPS[op], args, dout))
    assert err <= GRAD_TOLERANCE[torch.bfloat16], f"relative error {err:.3g}"


@hopper
def test_dispatch_reaches_it_and_hands_varlen_over(no_gluon, monkeypatch):
    """Through `registry.get`, a padded window call picks this variant and a varlen one too (same key),
    which then runs the tiled forward (the TMA launcher refuses here); with the launcher back, the padded
    call runs it."""
    from kreg import registry

    op = S
    call = registry.get(op)
    args = _make(op, 1, 257, 257, 8, 2, 64, 64)
    packed = _packed(op)
    assert call.choice(**args).variant.name == NAMES[op][0]
    assert call.choice(**packed).variant.name == NAMES[op][0]
    assert_close(call(**packed), OPS[op].reference(**packed), TOLERANCE[DTYPE])
    monkeypatch.undo()
    assert_close(call(**args), OPS[op].reference(**args), TOLERANCE[DTYPE])
