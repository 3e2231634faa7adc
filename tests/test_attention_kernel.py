"""The attention kernel family (kernels/common/attention/: flash_attention_tiled and
sink_attention_flash, NVIDIA and AMD, one body) against the references, forward and backward.

Without a GPU the kernels run in the Triton interpreter in fp16, so shapes are tiny (on a GPU: bf16,
the same shapes and tiles). Both vendors' variants run
the same kernels with the same interpreter tiles, so each case runs on one vendor's variant, the two
alternating (tests/test_conformance.py runs both on every tiny preset, every role's configs). Outputs
come from launches whose `torch.empty`/`empty_like` allocations are poisoned with NaN, so an element a
kernel fails to write fails the compare; inputs are fresh random fp16, compared in relative error
against the fp32 reference (gradients against the reference's autograd).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from kreg.core.device import CPU, PRESETS
from kreg.core.records import CallConfig, LaunchConfig
from kreg.core.space import INTERPRETER_DTYPE
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.contract import random_normal
from kreg.ops.testing import (
    GRAD_TOLERANCE,
    TOLERANCE,
    assert_close,
    cotangent,
    gradients,
    max_relative_error,
    reference_gradients,
)

from .conftest import HAS_GPU

DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
DTYPE = torch.bfloat16 if HAS_GPU else INTERPRETER_DTYPE
RTOL, GRAD_RTOL = TOLERANCE[DTYPE], GRAD_TOLERANCE[DTYPE]
VENDORS = ("nvidia", "amd")
ROLES = ("fwd", "bwd_pre", "bwd_dkv", "bwd_dq")
# The interpreter turns the loop bounds (0-d arrays) into ints through a path numpy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _variant(op: str, vendor: str):
    return next(v for v in _variants() if v.op == op and v.vendor == vendor)


def _variants():
    """The tiled variants (the Hopper Gluon forward has its own tests: test_attention_warpspec.py)."""
    return [v for op in ("flash_attention", "sink_attention") for v in load_all()[op] if v.runs_in_interpreter]


# Tiles other than the interpreter defaults for every role: other block shapes (16 rows against 32
# keys and the reverse), more blocks per loop, other stage boundaries; the forward packs a GQA group's
# heads along its rows (two heads: 16 rows of 8 tokens, where the case's group is even) and walks its
# key blocks in one masked loop (KEY_LOOPS 1) instead of three.
OTHER_TILES = CallConfig({"fwd": LaunchConfig(blocks={"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 2, "KEY_LOOPS": 1}),
                          "bwd_pre": LaunchConfig(blocks={"BLOCK_M": 16}),
                          "bwd_dkv": LaunchConfig(blocks={"BLOCK_M": 32, "BLOCK_N": 16}),
                          "bwd_dq": LaunchConfig(blocks={"BLOCK_M": 16, "BLOCK_N": 32})})


def _other_config(variant, key: dict) -> CallConfig:
    default = variant.default_config(key, CPU)
    assert all(OTHER_TILES[role].blocks != default[role].blocks for role in ROLES)
    return OTHER_TILES


@contextlib.contextmanager
def _poisoned():
    """torch.empty and torch.empty_like return NaN-filled tensors (floating dtypes)."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(math.nan) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_like


def _make(op: str, b, s_q, s_k, h_q, h_kv, d, *, sinks=None, seed=0, **kw) -> dict:
    """Validated arguments: random q, k, v; sinks None, "random" (around ln s_k) or one value per head."""
    gen = torch.Generator().manual_seed(seed)
    q = random_normal((b, s_q, h_q, d), device=DEVICE, dtype=DTYPE, generator=gen)
    k = random_normal((b, s_k, h_kv, d), device=DEVICE, dtype=DTYPE, generator=gen)
    v = random_normal((b, s_k, h_kv, d), device=DEVICE, dtype=DTYPE, generator=gen)
    if op == "sink_attention":
        if isinstance(sinks, str):
            sinks = random_normal((h_q,), device=DEVICE, dtype=torch.float32, generator=gen, scale=2.0) + math.log(s_k)
        elif sinks is not None:
            sinks = torch.tensor(sinks, dtype=torch.float32, device=DEVICE)
        kw["sinks"] = sinks
    return OPS[op].validate(q, k, v, **{"return_lse": True, **kw})


def _forward_error(variant, args: dict, config: CallConfig) -> float:
    with _poisoned():
        out = variant.call(args, config)
    if args["return_lse"]:
        assert isinstance(out, tuple) and out[0].dtype == args["q"].dtype and out[1].dtype == torch.float32
    return max_relative_error(out, OPS[variant.op].reference(**args))


def _gradient_error(variant, args: dict, config: CallConfig) -> float:
    """Gradients of out for every tensor input (q, k, v and sinks) against the reference's autograd."""
    op = OPS[variant.op]
    with _poisoned():
        got, dout = gradients(op, lambda a: variant.call(a, config), args)
    return max_relative_error([g.float() for g in got], reference_gradients(op, args, dout))


def _check(variant, args: dict, *, grads: bool, other: bool = True) -> None:
    """The forward with the CPU default and another call config; gradients with the default (and the
    other config when `other`)."""
    key = dict(OPS[variant.op].tuning_key(args))
    configs = [variant.default_config(key, CPU)] + ([_other_config(variant, key)] if other else [])
    for i, config in enumerate(configs):
        err = _forward_error(variant, args, config)
        assert err <= RTOL, f"{variant.name} ({variant.vendor}) [{config}]: forward error {err:.3g}"
        if grads and (i == 0 or other):
            err = _gradient_error(variant, args, config)
            assert err <= GRAD_RTOL, f"{variant.name} ({variant.vendor}) [{config}]: gradient error {err:.3g}"


# ----------------------------------------------------------------------------- dense layouts
# (op, b, s_q, s_k, h_q, h_kv, d, causal, window, sinks, gradients). Interpreter key tiles are 16 and 32
# wide, so windows of 15, 16 and 17 put the window's edge on, before and past a block boundary.
S, F = "sink_attention", "flash_attention"
CASES = {
    "causal-gqa4-sinks": (S, 2, 29, 29, 8, 2, 64, True, None, "random", True),
    "causal-gqa8-sq<sk": (S, 1, 17, 37, 8, 1, 64, True, None, "random", True),
    "causal-sq>sk-empty-rows": (S, 1, 37, 17, 2, 2, 64, True, None, "random", True),
    "window1": (S, 1, 33, 33, 2, 1, 64, True, 1, "random", True),
    "window15": (S, 1, 37, 37, 4, 1, 64, True, 15, "random", False),
    "window16-gqa8": (S, 1, 33, 33, 8, 1, 64, True, 16, "random", True),
    "window17-sq<sk": (S, 1, 17, 37, 2, 2, 64, True, 17, "random", False),
    "window-longer-than-seq": (S, 1, 37, 37, 2, 2, 64, True, 100, "random", True),
    # A block's rows see an unmasked middle between a masked window start and a masked diagonal.
    "window40-gqa4": (S, 1, 70, 70, 4, 1, 64, True, 40, "random", False),
    "sinks+-30": (S, 2, 21, 21, 2, 1, 64, True, None, (30.0, -30.0), False),
    "sinks+-30-window4": (S, 1, 21, 30, 2, 2, 64, True, 4, (-30.0, 30.0), False),
    "no-sinks-d128": (S, 2, 11, 27, 2, 2, 128, True, None, None, False),
    "full-sq<sk-d128-gqa4": (F, 1, 17, 37, 4, 1, 128, False, None, None, True),
    "full-sq>sk": (F, 1, 37, 17, 4, 2, 64, False, None, None, False),
    "causal-len1": (F, 2, 1, 1, 2, 1, 64, True, None, None, False),
    "q1-k37-decode-like": (F, 1, 1, 37, 4, 1, 64, True, None, None, False),
    "d80-window5-sq<sk": (F, 1, 17, 37, 2, 1, 80, True, 5, None, True),
}


@pytest.mark.parametrize("case", list(CASES), ids=[f"{c}-{VENDORS[i % 2]}" for i, c in enumerate(CASES)])
def test_matches_reference(case):
    op, b, s_q, s_k, h_q, h_kv, d, causal, window, sinks, grads = CASES[case]
    vendor = VENDORS[list(CASES).index(case) % 2]
    args = _make(op, b, s_q, s_k, h_q, h_kv, d, sinks=sinks, causal=causal, window=window, seed=len(case))
    _check(_variant(op, vendor), args, grads=grads, other=not grads or case.startswith("full"))


# KEY_LOOPS 2: a causal window of 32, 64 or 128 keys in three products (its two halves and the block's
# diagonal), no loop, for blocks of at most 16 tokens. (op, b, s_q, s_k, h_q, h_kv, d, window, sinks,
# fwd blocks): the window's start clamped at key 0 in the first blocks and free after them, s_q != s_k
# (rows with no key), 16 tokens a block, d below the tile, sinks of +-30; a window longer than the
# sequence (capped to it) and 32 tokens a block run the one-loop form instead.
NO_LOOP_CASES = {
    "w32-gqa4-8tokens": (S, 1, 70, 70, 4, 1, 64, 32, "random", {"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 2}),
    "w64-sq<sk-sinks+-30": (S, 1, 17, 100, 2, 2, 64, 64, (30.0, -30.0), {"BLOCK_M": 16, "BLOCK_N": 32, "HEADS": 1}),
    "w32-sq>sk-empty-rows": (S, 2, 45, 20, 2, 1, 64, 32, "random", {"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 2}),
    "w128-d80": (F, 1, 150, 150, 2, 1, 80, 128, None, {"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 1}),
    "w32-16tokens": (S, 1, 81, 81, 4, 2, 64, 32, "random", {"BLOCK_M": 32, "BLOCK_N": 16, "HEADS": 2}),
    "w64-longer-than-seq": (S, 1, 37, 37, 2, 1, 64, 64, "random", {"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 1}),
    "w32-32tokens": (F, 1, 77, 77, 2, 2, 64, 32, None, {"BLOCK_M": 32, "BLOCK_N": 16, "HEADS": 1}),
}


@pytest.mark.parametrize("case", list(NO_LOOP_CASES),
                         ids=[f"{c}-{VENDORS[i % 2]}" for i, c in enumerate(NO_LOOP_CASES)])
def test_short_windows_without_a_loop(case):
    """KEY_LOOPS 2 against the reference (out and lse), and the gradients once (the backward is the
    family's; the forward's lse feeds it)."""
    op, b, s_q, s_k, h_q, h_kv, d, window, sinks, blocks = NO_LOOP_CASES[case]
    variant = _variant(op, VENDORS[list(NO_LOOP_CASES).index(case) % 2])
    args = _make(op, b, s_q, s_k, h_q, h_kv, d, sinks=sinks, causal=True, window=window, seed=len(case))
    default = variant.default_config(dict(OPS[op].tuning_key(args)), CPU)
    config = default.replace("fwd", LaunchConfig(blocks={**blocks, "KEY_LOOPS": 2}))
    err = _forward_error(variant, args, config)
    assert err <= RTOL, f"{variant.name} ({variant.vendor}) [{config['fwd']}]: forward error {err:.3g}"
    if case.startswith("w32-gqa4"):
        assert _gradient_error(variant, args, config) <= GRAD_RTOL


def test_infinite_sinks_and_lse_without_the_sink():
    """A sink of +inf takes the whole softmax (out 0), -inf none of it (plain attention); the lse never
    includes the sink; rows with no key stay 0 with lse +inf whatever the sink."""
    args = _make(S, 1, 37, 17, 2, 2, 64, sinks=(math.inf, -math.inf), causal=True)
    variant = _variant(S, "nvidia")
    out, lse = variant.call(args, variant.default_config(dict(OPS[S].tuning_key(args)), CPU))
    plain_out, plain_lse = OPS[F].reference(**{n: args[n] for n in ("q", "k", "v")}, causal=True, return_lse=True)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert_close(out[:, :, 1], plain_out[:, :, 1], RTOL)
    assert_close(lse, plain_lse, RTOL)
    assert torch.isposinf(lse[:, :, :20]).all() and torch.equal(out[:, :20], torch.zeros_like(out[:, :20]))


def test_sinks_of_30_gradients():
    """Sinks of +30 and -30 around rows whose lse is ~3: the gradients of q, k and v match in relative
    error. A sink's own gradient is then ~1e-12 (sigmoid'(lse - sink) is e^-27 or less), below what the
    fp32 reference and an fp16 output resolve, so it must only be finite and that small."""
    args = _make(S, 2, 21, 21, 2, 1, 64, sinks=(30.0, -30.0), causal=True, window=9, seed=9)
    variant = _variant(S, "amd")
    config = variant.default_config(dict(OPS[S].tuning_key(args)), CPU)
    with _poisoned():
        got, dout = gradients(OPS[S], lambda a: variant.call(a, config), args)
    expected = reference_gradients(OPS[S], args, dout)
    assert max_relative_error([g.float() for g in got[:3]], expected[:3]) <= GRAD_RTOL
    assert torch.allclose(got[3], expected[3], rtol=GRAD_RTOL, atol=1e-9)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_negative_and_zero_scales(scale):
    """The forward fuses the scale with the shift only for a positive scale (POSITIVE_SCALE); a negative
    scale and zero (the uniform softmax) take the unfused path and match the reference, forward and
    gradients, with sinks and a window."""
    for vendor in VENDORS:
        args = _make(S, 1, 23, 23, 4, 2, 64, sinks="random", causal=True, window=9, sm_scale=scale,
                     seed=int(10 * abs(scale)) + len(vendor))
        _check(_variant(S, vendor), args, grads=True, other=False)


@pytest.mark.parametrize("step", [0.5, 3.0])
def test_scores_growing_along_the_keys(step):
    """Scores that climb along the keys (by `step` nats per key: a row's maximum grows past the last
    tile's within every tile, by a little or by far more than exp can hold) must keep the online
    softmax's rescaling exact mid-row: causal with a window, and full attention, with sinks."""
    for i, vendor in enumerate(VENDORS):
        causal, window = (True, 29) if i == 0 else (False, None)
        args = _make(S, 1, 37, 37, 4, 2, 64, sinks="random", causal=causal, window=window, seed=7 + i)
        ramp = torch.arange(37, device=DEVICE, dtype=torch.float32) * step
        # q . k gains ramp[j] for key j: q's first component 1, key j's ramp[j] / sm_scale.
        q = args["q"].float()
        q[..., 0] = 1.0
        k = args["k"].float()
        k[..., 0] = (ramp / args["sm_scale"])[None, :, None].to(torch.float32)
        args = OPS[S].validate(q.to(DTYPE), k.to(DTYPE), args["v"], sinks=args["sinks"], causal=causal,
                               window=window, return_lse=True)
        _check(_variant(S, vendor), args, grads=False, other=True)


def test_non_contiguous_inputs_and_gradients():
    """q from a packed qkv tensor, k and v as transposed views: only the last dim is contiguous."""
    gen = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 21, 4, 64
    qkv = random_normal((b, s, 3, h, d), device=DEVICE, dtype=DTYPE, generator=gen)
    k_bhsd = random_normal((b, 2, s + 5, d), device=DEVICE, dtype=DTYPE, generator=gen)
    v_bhsd = random_normal((b, 2, s + 5, d), device=DEVICE, dtype=DTYPE, generator=gen)
    q, k, v = qkv[:, :, 0], k_bhsd.transpose(1, 2)[:, 5:], v_bhsd.transpose(1, 2)[:, 5:]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    args = OPS[S].validate(q, k, v, sinks=(torch.randn(h, generator=gen) + 2.0).to(DEVICE), window=6, return_lse=True)
    _check(_variant(S, "amd"), args, grads=True, other=False)


def test_only_reachable_key_blocks_are_visited():
    """Keys that no query's window reaches hold NaN: a kernel that visited their blocks (cost s^2,
    not s * W) would spread it into out and dQ through the masked products."""
    args = _make(S, 1, 16, 64, 2, 1, 64, sinks="random", causal=True, window=8)
    for name in ("k", "v"):
        args[name][:, :32] = math.nan  # queries sit at 48..63, so their windows start at 41 or later
    variant = _variant(S, "nvidia")
    config = variant.default_config(dict(OPS[S].tuning_key(args)), CPU)
    assert _forward_error(variant, args, config) <= RTOL
    assert _gradient_error(variant, args, config) <= GRAD_RTOL
    # Without a loop (a window of 32 over blocks of 8 tokens), the window's keys only: [16, 64).
    args = _make(S, 1, 16, 64, 2, 1, 64, sinks="random", causal=True, window=32)
    for name in ("k", "v"):
        args[name][:, :16] = math.nan
    no_loop = LaunchConfig(blocks={"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 2, "KEY_LOOPS": 2})
    assert _forward_error(variant, args, config.replace("fwd", no_loop)) <= RTOL


def test_lse_is_returned_but_not_differentiable():
    args = _make(S, 1, 17, 17, 2, 1, 64, sinks="random", causal=True)
    leaves = {n: args[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "sinks")}
    variant = _variant(S, "amd")
    out, lse = variant.call({**args, **leaves}, variant.default_config(dict(OPS[S].tuning_key(args)), CPU))
    assert out.requires_grad and not lse.requires_grad
    out.float().sum().backward()
    assert all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in leaves.values())


def test_deterministic_gradients_are_bitwise_reproducible():
    args = _make(S, 1, 21, 21, 4, 1, 64, sinks="random", causal=True, window=11)
    variant = _variant(S, "nvidia")
    config = variant.default_config(dict(OPS[S].tuning_key(args)), CPU)
    call = lambda a: variant.call(a, config)  # noqa: E731
    det = {**args, "deterministic": True}
    first, dout = gradients(OPS[S], call, det)
    again, _ = gradients(OPS[S], call, det, dout)
    default, _ = gradients(OPS[S], call, args, dout)
    for a, b, c in zip(first, again, default, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert max_relative_error([g.float() for g in first], reference_gradients(OPS[S], args, dout)) <= GRAD_RTOL


# ----------------------------------------------------------------------------- varlen
def _packed(op: str, lens_q, lens_k, h_q, h_kv, d, *, lead=0, tail=0, seed=0, sinks=True, **kw) -> dict:
    """Packed sequences with `lead` and `tail` rows of q outside every sequence."""
    gen = torch.Generator().manual_seed(seed)
    cu_q = [lead, *(lead + sum(lens_q[: i + 1]) for i in range(len(lens_q)))]
    cu_k = [0, *(sum(lens_k[: i + 1]) for i in range(len(lens_k)))]
    q = random_normal((cu_q[-1] + tail, h_q, d), device=DEVICE, dtype=DTYPE, generator=gen)
    k = random_normal((cu_k[-1], h_kv, d), device=DEVICE, dtype=DTYPE, generator=gen)
    v = random_normal((cu_k[-1], h_kv, d), device=DEVICE, dtype=DTYPE, generator=gen)
    if op == "sink_attention":
        kw["sinks"] = random_normal((h_q,), device=DEVICE, dtype=torch.float32, generator=gen) + 2.0 if sinks else None
    cu_q, cu_k = (torch.tensor(cu, dtype=torch.int32, device=DEVICE) for cu in (cu_q, cu_k))
    return OPS[op].validate(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                            max_seqlen_k=max(lens_k), return_lse=True, **kw)


@pytest.mark.parametrize("op,vendor,window", [(S, "nvidia", 7), (S, "amd", None), (F, "nvidia", None)],
                         ids=["sink-window7-nvidia", "sink-causal-amd", "flash-full-nvidia"])
def test_varlen_with_empty_and_length_one_sequences(op, vendor, window):
    """Lengths 13, 0, 1, 21 and 6 (two with s_q > s_k: empty rows under causal), GQA 4, and q rows before
    and after every sequence, which come back as out 0, lse +inf and zero gradients."""
    causal = op == S
    args = _packed(op, [13, 0, 1, 21, 6], [17, 3, 1, 18, 4], 4, 1, 64, lead=2, tail=3, causal=causal,
                   window=window, seed=11)
    _check(_variant(op, vendor), args, grads=True, other=False)
    variant = _variant(op, vendor)
    out, lse = variant.call(args, _other_config(variant, dict(OPS[op].tuning_key(args))))
    for rows in (slice(0, 2), slice(-3, None)):
        assert torch.equal(out[rows], torch.zeros_like(out[rows])) and torch.isposinf(lse[:, rows]).all()


def test_short_window_without_a_loop_on_packed_sequences():
    """KEY_LOOPS 2 on packed sequences of lengths 45, 0, 1 and 70 (one with s_q < s_k), q rows outside
    every sequence, and a max_seqlen shorter than the longest sequence (programs stride past it)."""
    args = _packed(S, [45, 0, 1, 70], [45, 3, 1, 90], 4, 1, 64, lead=2, tail=3, causal=True, window=32, seed=4)
    variant = _variant(S, "amd")
    no_loop = LaunchConfig(blocks={"BLOCK_M": 16, "BLOCK_N": 16, "HEADS": 2, "KEY_LOOPS": 2})
    config = variant.default_config(dict(OPS[S].tuning_key(args)), CPU).replace("fwd", no_loop)
    assert _forward_error(variant, args, config) <= RTOL
    with _poisoned():
        out = variant.call({**args, "max_seqlen_q": 16}, config)
    assert max_relative_error(out, OPS[S].reference(**args)) <= RTOL


def test_max_seqlen_shorter_than_a_sequence_still_covers_every_row():
    """max_seqlen sizes the grid only: programs stride over the blocks of longer sequences."""
    args = _packed(S, [45, 7], [50, 9], 4, 1, 64, causal=True, window=12, seed=5)
    short = {**args, "max_seqlen_q": 8, "max_seqlen_k": 8}
    variant = _variant(S, "amd")
    config = variant.default_config(dict(OPS[S].tuning_key(args)), CPU)
    with _poisoned():
        out = variant.call(short, config)
    assert max_relative_error(out, OPS[S].reference(**args)) <= RTOL
    with _poisoned():
        got, dout = gradients(OPS[S], lambda a: variant.call(a, config), short)
    assert max_relative_error([g.float() for g in got], reference_gradients(OPS[S], args, dout)) <= GRAD_RTOL


_ALLOCATORS = ("empty", "zeros", "full", "empty_like")


class _Guarded:
    """Allocations (and inputs) placed inside NaN-filled buffers with guards on both sides: a kernel
    that reads past a tensor pulls NaN into its results, one that writes past it changes a guard."""

    PAD = 4096

    def __init__(self):
        self.buffers = []
        self.real = {name: getattr(torch, name) for name in _ALLOCATORS}

    def place(self, t: torch.Tensor) -> torch.Tensor:
        flat = self.real["full"]((t.numel() + 2 * self.PAD,), math.nan, dtype=t.dtype, device=t.device)
        view = flat[self.PAD: self.PAD + t.numel()].view(t.shape)
        view.copy_(t)
        self.buffers.append((flat, t.numel()))
        return view

    @contextlib.contextmanager
    def allocations(self):
        def wrap(name):
            def allocate(*a, **k):
                t = self.real[name](*a, **k)
                return self.place(t) if t.is_floating_point() and t.numel() else t
            return allocate

        for name in _ALLOCATORS:
            setattr(torch, name, wrap(name))
        try:
            yield
        finally:
            for name, fn in self.real.items():
                setattr(torch, name, fn)

    def guards_intact(self) -> bool:
        return all(torch.isnan(flat[: self.PAD]).all() and torch.isnan(flat[self.PAD + n:]).all()
                   for flat, n in self.buffers)


# cu_seqlens_q, cu_seqlens_k (q has 20 rows, k 24) and, where the clamped sequences do not overlap, the
# offsets they act as (the kernels clamp each sequence into the packed rows).
HOSTILE = {
    "past-the-end": ([0, 5, 100], [0, 9, 2**31 - 1], [0, 5, 20], [0, 9, 24]),
    "negative": ([-7, 6, 20], [-2**31, 10, 24], [0, 6, 20], [0, 10, 24]),
    "decreasing": ([0, 12, 4, 20], [0, 20, 3, 24], None, None),
    "all-out-of-range": ([40, 50, 60], [-9, -5, -1], None, None),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_cu_seqlens_stay_inside_the_tensors(case):
    """Whatever cu_seqlens hold, forward and backward read and write only the tensors' own rows; where
    the clamped sequences are well formed, the results are those of the clamped offsets."""
    cu_q, cu_k, fixed_q, fixed_k = HOSTILE[case]
    gen = torch.Generator().manual_seed(2)
    guarded = _Guarded()
    shapes = {"q": (20, 4, 64), "k": (24, 2, 64), "v": (24, 2, 64)}
    leaves = {n: guarded.place(random_normal(shape, device=DEVICE, dtype=DTYPE, generator=gen))
              for n, shape in shapes.items()}
    leaves["sinks"] = guarded.place(torch.randn(4, generator=gen).to(DEVICE))
    leaves = {n: t.requires_grad_() for n, t in leaves.items()}
    cu = {name: torch.tensor(values, dtype=torch.int32, device=DEVICE)
          for name, values in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k))}
    args = OPS[S].validate(**leaves, **cu, window=9, return_lse=True, max_seqlen_q=8, max_seqlen_k=8)
    variant = _variant(S, VENDORS[list(HOSTILE).index(case) % 2])
    config = variant.default_config(dict(OPS[S].tuning_key(args)), CPU)
    with guarded.allocations():
        out, lse = variant.call(args, config)
        dout = guarded.place(cotangent(out))
        grads = torch.autograd.grad(out, list(leaves.values()), dout)
    assert guarded.guards_intact()
    assert torch.isfinite(out).all() and not torch.isnan(lse).any() and all(torch.isfinite(g).all() for g in grads)
    if fixed_q is not None:
        fixed = {**args, "cu_seqlens_q": torch.tensor(fixed_q, dtype=torch.int32, device=DEVICE),
                 "cu_seqlens_k": torch.tensor(fixed_k, dtype=torch.int32, device=DEVICE),
                 "max_seqlen_q": 20, "max_seqlen_k": 24}
        assert max_relative_error((out, lse), OPS[S].reference(**fixed)) <= RTOL
        expected = reference_gradients(OPS[S], fixed, dout)
        assert max_relative_error([g.float() for g in grads], expected) <= GRAD_RTOL


# ----------------------------------------------------------------------------- variant data, no kernel runs
KEY = {"causal": True, "d": 128, "dtype": "bf16", "h_kv": 8, "h_q": 32, "s_k": 8192, "s_q": 8192, "window": None}


def test_variants_are_registered_with_the_family_kernels():
    from kreg.kernels.common.attention import backward

    names = {(v.op, v.name, v.vendor) for v in _variants()}
    assert names == {(op, name, vendor) for op, name in ((F, "flash_attention_tiled"), (S, "sink_attention_flash"))
                     for vendor in VENDORS}
    for variant in _variants():
        assert variant.roles == ROLES and variant.priority == 0
        assert variant.kernels["bwd_dkv"] is backward._attention_bwd_dkv_kernel
        assert len(variant.source_hash) == 16
    assert len({v.source_hash for v in _variants()}) == 1  # one kernel family for both ops and vendors


def test_spaces_differ_only_by_vendor_data():
    nvidia, amd = _variant(F, "nvidia"), _variant(F, "amd")
    h200, mi300x, mi355x = PRESETS["h200"], PRESETS["mi300x"], PRESETS["mi355x"]
    spaces = nvidia.space(KEY, h200)
    for role in ("fwd", "bwd_dkv", "bwd_dq"):
        assert {c.blocks["BLOCK_M"] for c in spaces[role]} >= {64, 128}
        assert {c.blocks["BLOCK_N"] for c in spaces[role]} >= {32, 64, 128}
        assert {c.num_warps for c in spaces[role]} == {4, 8} and {2, 3, 4} <= {c.num_stages for c in spaces[role]}
        assert all(c.waves_per_eu is None for c in spaces[role])
    # 8 warps are two warpgroups of 64 rows: the rows are dK/dV's keys, the others' queries.
    assert not any(c.num_warps == 8 and c.blocks["BLOCK_M"] < 128 for c in spaces["fwd"] + spaces["bwd_dq"])
    assert not any(c.num_warps == 8 and c.blocks["BLOCK_N"] < 128 for c in spaces["bwd_dkv"])
    assert _variant(S, "nvidia").space(KEY, h200) == spaces
    for role in ROLES:
        gfx950 = amd.space(KEY, mi355x)[role]
        assert {c.num_stages for c in gfx950} <= {1, 2}
        if role != "bwd_pre":  # no products there: no MFMA knobs
            assert {c.kpack for c in gfx950} == {1} and {c.kpack for c in amd.space(KEY, mi300x)[role]} == {1, 2}
            assert {c.waves_per_eu for c in gfx950} == {0, 1, 2}
            assert {c.matrix_instr_nonkdim for c in gfx950} == {16, 32}
    for variant in _variants():
        cpu_space = variant.space(KEY, CPU)
        assert [len(cpu_space[role]) for role in ROLES] == [2, 1, 1, 1]
        assert all(max(c.blocks.values()) <= 32 for configs in cpu_space.values() for c in configs)


def test_prune_reasons():
    nvidia, amd = _variant(F, "nvidia"), _variant(S, "amd")
    h200, mi300x = PRESETS["h200"], PRESETS["mi300x"]
    huge = LaunchConfig(blocks={"BLOCK_M": 128, "BLOCK_N": 128, "HEADS": 1, "KEY_LOOPS": 3}, num_warps=8, num_stages=5)
    assert "shared memory" in nvidia.prune_reason("fwd", huge, KEY, h200)
    assert nvidia.prune_reason("fwd", huge.model_copy(update={"num_stages": 2}), KEY, h200) is None
    wide = LaunchConfig(blocks={"BLOCK_M": 128, "BLOCK_N": 128, "HEADS": 1, "KEY_LOOPS": 3}, num_warps=8, num_stages=2,
                        kpack=1)
    assert "LDS" in amd.prune_reason("fwd", wide, {**KEY, "d": 256}, mi300x)
    short = {**KEY, "s_q": 16}
    wide_dq = LaunchConfig(blocks={"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2)
    assert "s_q bucket" in nvidia.prune_reason("bwd_dq", wide_dq, short, h200)
    small = LaunchConfig(blocks={"BLOCK_M": 64, "BLOCK_N": 64, "HEADS": 1, "KEY_LOOPS": 3}, num_warps=4, num_stages=2)
    assert nvidia.prune_reason("fwd", small, short, h200) is None  # the smallest BLOCK_M always survives
    assert "blocks must be" in nvidia.prune_reason("bwd_pre", small, KEY, h200)
    # Packed query heads must divide the GQA group (and so BLOCK_M): 4 of a group of 8 may run, 16 not.
    gqa8 = {**KEY, "h_q": 64, "h_kv": 8}
    packed = small.model_copy(update={"blocks": {**small.blocks, "HEADS": 4}})
    assert nvidia.prune_reason("fwd", packed, gqa8, h200) is None
    assert "must divide the GQA group" in nvidia.prune_reason("fwd", packed, {**gqa8, "h_kv": 64}, h200)
    too_many = small.model_copy(update={"blocks": {**small.blocks, "HEADS": 16}})
    assert "must divide the GQA group" in nvidia.prune_reason("fwd", too_many, gqa8, h200)
    assert nvidia.prune_reason("bwd_pre", LaunchConfig(blocks={"BLOCK_M": 128}), KEY, h200) is None


def test_one_key_loop_only_for_windows():
    """The forward spaces offer KEY_LOOPS 1 (one masked loop) at windowed keys only, and 2 (no loop) at
    windows of 32, 64 and 128 keys over blocks of at most 16 tokens."""
    for variant, device in ((_variant(F, "nvidia"), PRESETS["h200"]), (_variant(S, "amd"), PRESETS["mi355x"])):
        space = variant.spaces["fwd"]
        loops = {c.blocks["KEY_LOOPS"] for c in space.configs({**KEY, "window": None}, device)}
        assert loops == {3}
        loops = {c.blocks["KEY_LOOPS"] for c in space.configs({**KEY, "window": 512}, device)}
        assert loops == {1, 3}
        no_loop = [c for c in space.configs({**KEY, "window": 128}, device) if c.blocks["KEY_LOOPS"] == 2]
        assert no_loop and all(c.blocks["BLOCK_M"] // c.blocks["HEADS"] <= 16 for c in no_loop)


@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_defaults_survive_pruning(d):
    key = {**KEY, "d": d}
    for variant in _variants():
        for device in (PRESETS["h200"], PRESETS["mi300x"], PRESETS["mi355x"], CPU):
            if device.vendor not in (variant.vendor, "cpu"):
                continue
            for role in ROLES:
                config = variant.default_config(key, device)[role]
                assert variant.prune_reason(role, config, key, device) is None, (variant.vendor, device.key, role)
                space = variant.spaces[role]
                if device.key != "cpu" and space.keep is not None:
                    assert space.keep(config, key), (variant.vendor, role, config)
    # Short sequences shrink the tiles to the smallest the space has.
    for vendor, device in (("amd", PRESETS["mi355x"]), ("nvidia", PRESETS["h200"])):
        short = _variant(S, vendor).default_config({**KEY, "d": d, "s_q": 16, "s_k": 32}, device)
        assert short["fwd"].blocks["BLOCK_M"] == 64 and short["fwd"].blocks["BLOCK_N"] <= 32
        assert short["bwd_dq"].blocks["BLOCK_M"] == 32 and short["bwd_dkv"].blocks["BLOCK_N"] == 32


def test_supports_fp16_bf16_only():
    for variant in _variants():
        assert variant.supports(KEY, CPU) and variant.supports({**KEY, "dtype": "fp16", "d": 256}, CPU)
        assert not variant.supports({**KEY, "dtype": "fp32"}, CPU)


def test_backward_with_a_strided_lse_matches_a_dense_one():
    """attention_backward indexes its delta/lse2 workspaces with lse's strides: an lse that is a view
    with gaps (another op keeping the family's lse inside a wider buffer) must give the same gradients."""
    variant = _variant(F, "nvidia")
    shape = {"b": 1, "s_q": 21, "s_k": 21, "h_q": 2, "h_kv": 1, "d": 16, "causal": True}
    args = OPS[F].validate(**OPS[F].make_inputs(shape, device=DEVICE, dtype=DTYPE, seed=3))
    config = variant.default_config(OPS[F].tuning_key(args), CPU)
    out, lse = variant.call({**args, "return_lse": True}, config)
    wide = torch.full((*lse.shape[:-1], 2 * lse.shape[-1]), 7.0, dtype=lse.dtype, device=lse.device)
    wide[..., ::2] = lse
    dout = cotangent(out, seed=4)
    plan = variant.plan(args, config)
    dense = variant.backward(args, plan, (out, lse), dout)
    strided = variant.backward(args, plan, (out, wide[..., ::2]), dout)
    for name in ("q", "k", "v"):
        assert torch.equal(dense[name], strided[name]), name
    assert max_relative_error([dense[n].float() for n in ("q", "k", "v")],
                              reference_gradients(OPS[F], args, dout)) <= GRAD_RTOL


def test_a_forward_signature_fixes_every_launch_argument_but_the_tensors_and_scale():
    """Calls whose `forward_signature` is equal launch with the same grid, scalars and constexprs (what a
    plan keeps per signature), over layouts, strided views, varlen batches, masks, sinks, lse and scales;
    calls that differ in any of them have signatures of their own."""
    from kreg.kernels.common.attention.forward import _forward_launch, forward_signature

    config = LaunchConfig(blocks={"BLOCK_M": 32, "BLOCK_N": 16, "HEADS": 2, "KEY_LOOPS": 2}, num_warps=4)
    calls = []
    for op in ("flash_attention", "sink_attention"):
        for causal, window in ((False, None), (True, None), (True, 32), (True, 7)):
            for seed, scale in ((0, None), (1, 0.3), (2, -0.5)):
                extra = {"sinks": "random"} if op == "sink_attention" else {}
                calls.append(_make(op, 2, 37, 45, 4, 2, 64, causal=causal, window=window, sm_scale=scale, seed=seed,
                                   **extra))
        wide = random_normal((2, 45, 4, 80), device=DEVICE, dtype=DTYPE, generator=torch.Generator().manual_seed(6))
        view = wide[..., :64][:, :37]  # strided: another row and head stride, the same shape
        calls.append(OPS[op].validate(view, wide[:, :, :2, :64], wide[:, :, 2:, :64], causal=True,
                                      **({"sinks": torch.zeros(4)} if op == "sink_attention" else {})))
        # The same packed shapes with other lengths (a new max_seqlen_q changes only the grid), and a repeat.
        for lens_q, lens_k, seed in (([5, 11], [9, 20], 3), ([8, 8], [17, 12], 4), ([20, 20], [9, 20], 7),
                                     ([5, 35], [9, 20], 8), ([5, 11], [9, 20], 5)):
            calls.append(_packed(op, lens_q, lens_k, 4, 2, 64, seed=seed, causal=True))
    seen: dict = {}
    repeated = 0
    for args in calls:
        for keep in (False, True):
            lse = torch.empty(0) if keep or args["return_lse"] else None
            signature = forward_signature(args, lse is None)
            out = torch.empty(args["q"].shape, dtype=args["q"].dtype)
            if lse is not None:
                q = args["q"]
                shape = (q.shape[-2], q.shape[0]) if args["cu_seqlens_q"] is not None else \
                    (q.shape[0], q.shape[2], q.shape[1])
                lse = torch.empty(shape, dtype=torch.float32)
            grid, scalars, constexprs, _ = _forward_launch(args, config, out, lse)
            made = (grid, scalars, constexprs)
            if signature in seen:
                repeated += 1
                assert seen[signature] == made, signature
            seen[signature] = made
    assert repeated >= 10 and len(seen) >= 20  # both kinds met: shared signatures and distinct ones
