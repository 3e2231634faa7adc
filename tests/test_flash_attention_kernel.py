"""The tiled flash_attention kernel (both vendors' variants, one body) against the reference.

Without a GPU the kernel runs in the Triton interpreter, so shapes are tiny; every case runs each
vendor's variant with its CPU default config and with a second CPU-space config, on fresh random fp16
inputs, with the launcher's output buffers poisoned (NaN) so an unwritten element fails the compare.
"""

from __future__ import annotations

import math

import pytest
import torch

from registry.catalog import load_all
from registry.device import CPU, PRESETS
from registry.ops import flash_attention as fa_op
from registry.ops._contract import random_normal
from registry.testing import TOLERANCE, assert_close, relative_error
from tuning_db.records import CallConfig, LaunchConfig

RTOL = TOLERANCE[torch.float16]
# The interpreter turns the loop bounds (0-d arrays) into ints through a path numpy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _variants():
    variants = [v for v in load_all()["flash_attention"] if v.name == "flash_attention_tiled"]
    assert sorted(v.vendor for v in variants) == ["amd", "nvidia"]
    return variants


def _configs(variant, key: dict) -> list[CallConfig]:
    """The CPU default, then a different CPU-space config (smaller tiles: more blocks and stages)."""
    default = variant.default_config(key, CPU)
    other = next(c for c in variant.space(key, CPU)["fwd"] if c.blocks["BLOCK_M"] == 16 and c.blocks["BLOCK_N"] == 16)
    assert other != default["fwd"]
    return [default, default.replace("fwd", other)]


def _fwd(blocks: dict, **knobs) -> CallConfig:
    return CallConfig({"fwd": LaunchConfig(blocks=blocks, **knobs)})


def _launch_poisoned(variant, args: dict, config: LaunchConfig, monkeypatch):
    """launch() with every torch.empty it allocates filled with NaN first."""
    real_empty = torch.empty

    def poisoned_empty(*shape, **kwargs):
        t = real_empty(*shape, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", poisoned_empty)
        return variant.launch(args, config)


def _reference(args: dict):
    return fa_op.reference(**{**args, "q": args["q"].float(), "k": args["k"].float(), "v": args["v"].float()})


def _check_all(args: dict, monkeypatch, key: dict | None = None) -> None:
    expected = _reference(args)
    key = key or dict(fa_op.tuning_key(args))
    for variant in _variants():
        for config in _configs(variant, key):
            out = _launch_poisoned(variant, args, config, monkeypatch)
            what = f"{variant.vendor} [{config}]"
            if args["return_lse"]:
                assert isinstance(out, tuple) and len(out) == 2, what
                assert out[0].dtype == args["q"].dtype and out[1].dtype == torch.float32, what
            else:
                assert isinstance(out, torch.Tensor), what
            assert_close(out, expected, RTOL, what)


def _dense(device, b, s_q, s_k, h_q, h_kv, d, *, seed=0, **kw) -> dict:
    gen = torch.Generator().manual_seed(seed)
    q = random_normal((b, s_q, h_q, d), device=device, dtype=torch.float16, generator=gen)
    k = random_normal((b, s_k, h_kv, d), device=device, dtype=torch.float16, generator=gen)
    v = random_normal((b, s_k, h_kv, d), device=device, dtype=torch.float16, generator=gen)
    return fa_op.validate(q, k, v, **{"return_lse": True, **kw})


# (b, s_q, s_k, h_q, h_kv, d, causal, window)
CASES = {
    "causal-37-d64": (2, 37, 37, 2, 2, 64, True, None),
    "full-17-d64-gqa4": (1, 17, 17, 4, 1, 64, False, None),
    "causal-d128-sq<sk": (1, 17, 37, 2, 1, 128, True, None),
    "causal-sq>sk-empty-rows": (1, 37, 17, 2, 2, 64, True, None),
    "full-sq>sk": (1, 37, 17, 4, 2, 64, False, None),
    "full-sq<sk-d128-gqa4": (1, 17, 37, 4, 1, 128, False, None),
    "len1": (2, 1, 1, 2, 1, 64, True, None),
    "q1-k37-decode-like": (1, 1, 37, 4, 1, 64, True, None),
    "window1": (1, 37, 37, 2, 1, 64, True, 1),
    "window16-block-boundary": (1, 37, 37, 2, 2, 64, True, 16),
    "window17-sq<sk": (1, 17, 37, 2, 2, 64, True, 17),
    "window-longer-than-seq": (1, 37, 37, 2, 2, 64, True, 100),
    "d80-not-pow2": (1, 37, 37, 4, 2, 80, True, None),
    "d80-window5": (1, 17, 37, 2, 1, 80, True, 5),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_dense_matches_reference(case, device, monkeypatch):
    b, s_q, s_k, h_q, h_kv, d, causal, window = CASES[case]
    args = _dense(device, b, s_q, s_k, h_q, h_kv, d, causal=causal, window=window)
    _check_all(args, monkeypatch)


def test_out_only_without_lse(device, monkeypatch):
    args = _dense(device, 1, 17, 17, 2, 1, 64, causal=True, return_lse=False)
    _check_all(args, monkeypatch)


def test_empty_rows_are_zero_with_infinite_lse(device):
    # s_q > s_k, causal: queries 0..s_q-s_k-1 sit before every key.
    args = _dense(device, 1, 37, 17, 2, 2, 64, causal=True)
    variant = _variants()[0]
    out, lse = variant.launch(args, variant.default_config(dict(fa_op.tuning_key(args)), CPU))
    assert torch.equal(out[:, :20], torch.zeros_like(out[:, :20]))
    assert torch.isinf(lse[:, :, :20]).all() and (lse[:, :, :20] > 0).all()
    assert torch.isfinite(lse[:, :, 20:]).all()


def test_non_contiguous_inputs(device, monkeypatch):
    """q from a packed qkv tensor, k and v as transposed views: only the last dim is contiguous."""
    gen = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 37, 2, 64
    qkv = random_normal((b, s, 3, h, d), device=device, dtype=torch.float16, generator=gen)
    k_bhsd = random_normal((b, h, s + 5, d), device=device, dtype=torch.float16, generator=gen)
    v_bhsd = random_normal((b, h, s + 5, d), device=device, dtype=torch.float16, generator=gen)
    q, k, v = qkv[:, :, 0], k_bhsd.transpose(1, 2)[:, 5:], v_bhsd.transpose(1, 2)[:, 5:]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    args = fa_op.validate(q, k, v, causal=True, return_lse=True)
    _check_all(args, monkeypatch)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 7)], ids=["causal", "full", "w7"])
def test_varlen_three_sequences(causal, window, device, monkeypatch):
    """Lengths differ per sequence (one with s_q > s_k: empty rows under causal); q has a leading
    and a trailing row outside every sequence, which must come back as out 0 and lse +inf."""
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k = [5, 37, 20], [9, 30, 20]
    cu_q = torch.tensor([2, 7, 44, 64], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 39, 59], dtype=torch.int32, device=device)
    h_q, h_kv, d = 4, 2, 64
    q = random_normal((66, h_q, d), device=device, dtype=torch.float16, generator=gen)
    k = random_normal((59, h_kv, d), device=device, dtype=torch.float16, generator=gen)
    v = random_normal((59, h_kv, d), device=device, dtype=torch.float16, generator=gen)
    args = fa_op.validate(q, k, v, causal=causal, window=window, return_lse=True, cu_seqlens_q=cu_q,
                          cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    _check_all(args, monkeypatch)
    out, lse = _variants()[0].launch(args, _fwd({"BLOCK_M": 16, "BLOCK_N": 16}))
    for rows in (slice(0, 2), slice(64, 66)):
        assert torch.equal(out[rows], torch.zeros_like(out[rows]))
        assert torch.isposinf(lse[:, rows]).all()


def test_gradients_recompute_through_the_reference(device):
    args = _dense(device, 1, 17, 17, 2, 1, 64, causal=True)
    leaves = [args[n].float().requires_grad_() for n in ("q", "k", "v")]
    grad_args = {**args, **{n: t.half().detach().requires_grad_() for n, t in zip("qkv", leaves, strict=True)}}
    variant = _variants()[0]
    out, lse = variant.launch(grad_args, variant.default_config(dict(fa_op.tuning_key(args)), CPU))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(device)
    out.float().mul(dout).sum().backward()
    ref_out, _ = fa_op.reference(**{**args, "q": leaves[0], "k": leaves[1], "v": leaves[2]})
    ref_out.mul(dout).sum().backward()
    for name, leaf in zip("qkv", leaves, strict=True):
        assert relative_error(grad_args[name].grad.float(), leaf.grad) < RTOL, name
    assert lse.requires_grad


# ----------------------------------------------------------------------------- variant data, no kernel runs
KEY = {"causal": True, "d": 128, "dtype": "bf16", "h_kv": 8, "h_q": 32, "s_k": 8192, "s_q": 8192, "window": None}


def _keep(variant, config) -> bool:
    return variant.spaces["fwd"].keep(config, KEY)


def test_variants_are_registered_with_their_kernel():
    from kernels.common.flash_attention import _flash_attention_fwd_kernel

    for variant in _variants():
        assert variant.op == "flash_attention" and variant.priority == 0
        assert variant.roles == ("fwd",) and variant.kernels["fwd"] is _flash_attention_fwd_kernel
        assert len(variant.source_hash) == 16
    assert len({v.source_hash for v in _variants()}) == 1  # one kernel body for both vendors


def test_spaces_differ_only_by_vendor_data():
    nvidia, amd = sorted(_variants(), key=lambda v: v.vendor != "nvidia")
    h200, mi300x, mi355x = PRESETS["h200"], PRESETS["mi300x"], PRESETS["mi355x"]
    space = nvidia.space(KEY, h200)["fwd"]
    assert {c.num_stages for c in space} == {2, 3, 4, 5}
    assert {c.blocks["BLOCK_N"] for c in space} == {32, 64, 128}
    assert all(c.waves_per_eu is None for c in space) and all(_keep(nvidia, c) for c in space)
    assert not any(c.num_warps == 8 and c.blocks["BLOCK_M"] == 64 for c in space)
    assert {c.kpack for c in amd.space(KEY, mi300x)["fwd"]} == {1, 2}
    gfx950 = amd.space(KEY, mi355x)["fwd"]
    assert {c.kpack for c in gfx950} == {1}
    assert {c.num_stages for c in gfx950} == {1, 2} and {c.waves_per_eu for c in gfx950} == {0, 1, 2}
    assert {c.matrix_instr_nonkdim for c in gfx950} == {16, 32}
    for variant in (nvidia, amd):
        cpu_space = variant.space(KEY, CPU)["fwd"]
        assert len({c.to_json() for c in cpu_space}) == len(cpu_space) <= 4
        assert all(max(c.blocks.values()) <= 32 for c in cpu_space)
        assert max(variant.default_config(KEY, CPU)["fwd"].blocks.values()) <= 32


def test_prune_reasons():
    nvidia, amd = sorted(_variants(), key=lambda v: v.vendor != "nvidia")
    h200, mi300x = PRESETS["h200"], PRESETS["mi300x"]
    huge = LaunchConfig(blocks={"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=5)
    assert "shared memory" in nvidia.prune_reason("fwd", huge, KEY, h200)
    assert nvidia.prune_reason("fwd", huge.model_copy(update={"num_stages": 2}), KEY, h200) is None
    wide = LaunchConfig(blocks={"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2, kpack=1)
    assert "LDS" in amd.prune_reason("fwd", wide, {**KEY, "d": 256}, mi300x)
    short = {**KEY, "s_q": 16}
    assert "s_q bucket" in nvidia.prune_reason("fwd", huge.model_copy(update={"num_stages": 2}), short, h200)
    small = LaunchConfig(blocks={"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
    assert nvidia.prune_reason("fwd", small, short, h200) is None  # the smallest BLOCK_M always survives


@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_defaults_survive_pruning(d):
    key = {**KEY, "d": d}
    for variant in _variants():
        for device in (PRESETS["h200"], PRESETS["mi300x"], PRESETS["mi355x"], CPU):
            if device.vendor not in (variant.vendor, "cpu"):
                continue
            config = variant.default_config(key, device)["fwd"]
            assert variant.prune_reason("fwd", config, key, device) is None, (variant.vendor, device.key, config)
            if device.key != "cpu":
                assert _keep(variant, config)
                # NVIDIA's d 256 default runs num_stages 1 (no spills), below the sweep's stages.
                assert config in variant.space(key, device)["fwd"] or (variant.vendor, d) == ("nvidia", 256)
    # Short sequences shrink the tiles to the smallest the space has.
    for variant, device in zip(sorted(_variants(), key=lambda v: v.vendor),
                               (PRESETS["mi355x"], PRESETS["h200"]), strict=True):
        short = variant.default_config({**key, "s_q": 16, "s_k": 32}, device)["fwd"]
        assert short.blocks == {"BLOCK_M": 64, "BLOCK_N": 32} and _keep(variant, short)


def test_supports_fp16_bf16_only():
    for variant in _variants():
        assert variant.supports(KEY, CPU) and variant.supports({**KEY, "dtype": "fp16", "d": 256}, CPU)
        assert not variant.supports({**KEY, "dtype": "fp32"}, CPU)


def test_compile_specs_type_every_kernel_argument():
    """Padded and packed (varlen) calls share a key, so a key's config is compiled both ways."""
    variant = _variants()[0]
    for key in (KEY, {**KEY, "h_kv": 32, "window": 128, "d": 80}):
        config = variant.default_config(key, PRESETS["h200"])
        specs = variant.compile_specs(key, config)
        assert [spec.constexprs["IS_VARLEN"] for spec in specs] == [False, True]
        for spec in specs:
            names = set(spec.signature) | set(spec.constexprs)
            assert names == set(spec.fn.arg_names) and not set(spec.signature) & set(spec.constexprs)
            assert spec.role == "fwd" and spec.constexprs["BLOCK_M"] == config["fwd"].blocks["BLOCK_M"]
            assert spec.constexprs["HEAD_DIM"] == key["d"] and spec.constexprs["BLOCK_D"] == 128
            assert spec.signature["Q"] == "*bf16"
