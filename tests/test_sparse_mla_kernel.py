"""sparse_mla variants (both vendors) against the PyTorch reference, forward and backward.

On the CPU the Triton variants run in the interpreter in fp16 (its tl.dot is wrong for bf16); on a GPU,
bf16. The Hopper Gluon variant (sparse_mla_warpspec) cannot be interpreted: it runs on an sm_90 GPU only.
"""

import pytest
import torch

from kreg.core.device import CPU, detect
from kreg.core.records import LaunchConfig
from kreg.ops.catalog import load_all
from kreg.ops.sparse_mla import make_inputs, reference, tuning_key, validate
from kreg.ops.testing import TOLERANCE, assert_close

from .conftest import HAS_GPU, gpu

VARIANTS = load_all()["sparse_mla"]
HEADBLOCK = [v for v in VARIANTS if v.name == "sparse_mla_headblock"]
# A key every variant supports on a device that can run it (the V3.2 head dims).
V32_KEY = {"d_qk": 576, "d_v": 512, "h_q": 128, "h_kv": 1, "dtype": "bf16", "topk": 2048, "kv_aligned": True}
DTYPE = torch.bfloat16 if HAS_GPU else torch.float16
TOL = TOLERANCE[DTYPE]


def _device_info():
    return detect() if HAS_GPU else CPU


def _configs(variant, args):
    """The variant's default call config here, plus one with another forward block shape (CPU: the
    interpreter's space)."""
    key = dict(tuning_key(args))
    info = _device_info()
    default = variant.default_config(key, info)
    others = [c for c in variant.space(key, info)["fwd"]
              if c != default["fwd"] and variant.prune_reason("fwd", c, key, info) is None]
    return [default] + [default.replace("fwd", c) for c in others[:1]]


def _inputs(device, seed=0, **shape):
    return validate(**make_inputs(shape, device=device, dtype=DTYPE, seed=seed))


@pytest.fixture(params=VARIANTS, ids=lambda v: f"{v.name}-{v.vendor}")
def variant(request):
    if HAS_GPU and request.param.vendor != detect().vendor:
        pytest.skip(f"{request.param.vendor} variant cannot run on this GPU")
    if not request.param.supports(V32_KEY, _device_info()):
        pytest.skip(f"{request.param.name} does not run on {_device_info().name}")
    return request.param


SHAPES = {
    # V3.2 head dims with few queries; topk 100 is no multiple of any tile.
    "h16-d576": dict(s_q=2, s_kv=150, h_q=16, h_kv=1, d_qk=576, d_v=512, topk=100),
    "h64-d96": dict(s_q=3, s_kv=77, h_q=64, h_kv=1, d_qk=96, d_v=64, topk=45),
    "h128-d96": dict(s_q=2, s_kv=61, h_q=128, h_kv=1, d_qk=96, d_v=64, topk=33),
    "hkv2-sink-len": dict(s_q=5, s_kv=40, h_q=32, h_kv=2, d_qk=96, d_v=64, topk=50, sink=True, topk_length=True),
    "batched": dict(b=2, s_q=4, s_kv=29, h_q=16, h_kv=1, d_qk=96, d_v=64, topk=37, sink=True, topk_length=True),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_matches_reference(variant, device, shape):
    args = _inputs(device, **shape)
    expected = reference(**args)
    for config in _configs(variant, args):
        assert_close(variant.call(args, config), expected, TOL, what=f"{variant.vendor} {config}")


def test_every_kind_of_invalid_index_and_empty_rows(variant, device):
    args = _inputs(device, seed=3, s_q=4, s_kv=20, h_q=16, h_kv=1, d_qk=96, d_v=64, topk=24)
    idx = args["indices"].clone()
    s_kv = args["kv"].shape[0]
    # Row 0: every kind of invalid value among valid ones, plus duplicates.
    idx[0, 0, :8] = torch.tensor([-1, -7, s_kv, 2**31 - 1, 3, 3, 3, s_kv - 1], dtype=torch.int32)
    idx[1, 0, :] = -1  # row 1: all invalid
    idx[2, 0, :] = torch.tensor([s_kv + 5] * 12 + [-(2**31)] * 12, dtype=torch.int32)  # row 2: out of range
    args["indices"] = idx.to(device)
    out, max_logits, lse = variant.call(args, _configs(variant, args)[0])
    expected = reference(**args)
    assert_close((out, max_logits, lse), expected, TOL)
    for row in (1, 2):
        assert torch.all(out[row] == 0)
        assert torch.all(lse[row] == float("inf"))
        assert torch.all(max_logits[row] == float("-inf"))


@pytest.mark.parametrize("sink_value", [-1e4, 1e4, float("inf"), float("-inf")])
def test_large_sinks(variant, device, sink_value):
    args = _inputs(device, seed=4, s_q=3, s_kv=30, h_q=16, h_kv=1, d_qk=96, d_v=64, topk=20)
    args["attn_sink"] = torch.full((16,), sink_value, device=device)
    args["indices"][1] = -1
    out = variant.call(args, _configs(variant, args)[0])
    assert not torch.isnan(out.out).any()
    assert_close(out, reference(**args), TOL)


def test_topk_length_zero_and_over_topk(variant, device):
    args = _inputs(device, seed=5, s_q=3, s_kv=30, h_q=16, h_kv=1, d_qk=96, d_v=64, topk=20)
    args["topk_length"] = torch.tensor([0, 7, 1000], dtype=torch.int32, device=device)
    out = variant.call(args, _configs(variant, args)[0])
    assert torch.all(out.lse[0] == float("inf"))
    assert_close(out, reference(**args), TOL)


def _assert_gradients_match(variant, args, config, seed=7):
    """dq, dkv (and d attn_sink) of the variant's backward against the reference's fp32 autograd."""
    leaves = {"q": args["q"], "kv": args["kv"]}
    if args["attn_sink"] is not None:
        leaves["attn_sink"] = args["attn_sink"]
    ours = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    theirs = {n: t.detach().float().requires_grad_() for n, t in leaves.items()}
    out = variant.call({**args, **ours}, config).out
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    got = torch.autograd.grad(out, list(ours.values()), grad_out)
    ref_out = reference(**{**args, **theirs}).out
    want = torch.autograd.grad(ref_out, list(theirs.values()), grad_out.float())
    for name, g, w in zip(ours, got, want, strict=True):
        assert torch.isfinite(g).all(), f"d{name}"
        assert_close(g.float(), w, 2 * TOL, what=f"d{name} (deterministic={args['deterministic']})")


@pytest.mark.parametrize("shape", [SHAPES["hkv2-sink-len"], SHAPES["batched"],
                                   dict(s_q=2, s_kv=70, h_q=16, h_kv=1, d_qk=576, d_v=512, topk=40),
                                   # 40 heads: several head blocks and dkv head chunks, the last partial.
                                   dict(s_q=3, s_kv=90, h_q=40, h_kv=1, d_qk=96, d_v=64, topk=70),
                                   dict(s_q=2, s_kv=50, h_q=64, h_kv=1, d_qk=96, d_v=64, topk=40)],
                         ids=["hkv2-sink-len", "batched", "d576", "h40", "h64"])
def test_backward_matches_reference_autograd(variant, device, shape):
    """The default backward (pre pass, fused pass) on every group size and layout."""
    args = _inputs(device, seed=6, **shape)
    _assert_gradients_match(variant, args, _configs(variant, args)[0])


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_backward_with_hostile_indices(variant, device, deterministic):
    """Both backward paths with every kind of invalid index, duplicates, an all-invalid row, rows cut by
    topk_length (0, and past topk), a sink and two kv groups."""
    args = _inputs(device, seed=13, s_q=5, s_kv=30, h_q=32, h_kv=2, d_qk=96, d_v=64, topk=24, sink=True)
    idx = args["indices"].clone()
    idx[0, :, :8] = torch.tensor([-1, -7, 30, 2**31 - 1, 3, 3, 3, 29], dtype=torch.int32)
    idx[1, 1, :] = -1  # one group of row 1 selects nothing
    idx[2, :, :] = 5  # every slot of row 2 selects the same row
    args["indices"] = idx.to(device)
    args["topk_length"] = torch.tensor([24, 20, 1000, 0, 7], dtype=torch.int32, device=device)
    args["deterministic"] = deterministic
    _assert_gradients_match(variant, args, _configs(variant, args)[0])


def test_backward_with_large_and_infinite_sinks(variant, device):
    """Sinks of +-inf and +-1e4 (one per head) and an empty row: finite gradients equal to the
    reference's (a +inf sink zeroes its head's output, so every gradient through it is 0)."""
    args = _inputs(device, seed=14, s_q=3, s_kv=30, h_q=16, h_kv=1, d_qk=96, d_v=64, topk=20)
    values = [float("inf"), float("-inf"), 1e4, -1e4] + [0.5] * 12
    args["attn_sink"] = torch.tensor(values, device=device)
    args["indices"][1] = -1
    _assert_gradients_match(variant, args, _configs(variant, args)[0])


def test_int64_row_offsets_match(variant, device, monkeypatch):
    """The 64-bit row-offset path (taken when s_kv * row stride does not fit in int32) gives the same
    forward and gradients as the int32 one that every other test takes."""
    from kreg.kernels.common.sparse_mla import backward, forward

    args = _inputs(device, seed=9, s_q=3, s_kv=50, h_q=16, h_kv=1, d_qk=96, d_v=64, topk=30, sink=True)
    config = _configs(variant, args)[0]

    def run():
        results = []
        for deterministic in (False, True):
            q, kv = args["q"].detach().clone().requires_grad_(), args["kv"].detach().clone().requires_grad_()
            out = variant.call({**args, "q": q, "kv": kv, "deterministic": deterministic}, config).out
            results += [out, *torch.autograd.grad(out.float().square().sum(), [q, kv])]
        return results

    narrow = run()
    # The forward's and the backward passes' launchers each read the name from their own module.
    for launchers in (forward, backward):
        monkeypatch.setattr(launchers, "_rows_fit_int32", lambda *tensors: False)
    wide = run()
    for a, b in zip(narrow, wide, strict=True):
        assert_close(a.float(), b.float(), TOL)


def test_deterministic_backward_in_query_chunks(variant, device, monkeypatch):
    """With workspaces of one query, the deterministic backward runs query by query, each chunk reusing
    them; topk_length shrinking from query to query leaves earlier queries' values in the slots a later
    query does not visit, which must not leak into its gradients; two batch rows make the chunks
    strided views."""
    from kreg.kernels.common.sparse_mla import backward

    args = _inputs(device, seed=10, b=2, s_q=3, s_kv=90, h_q=40, h_kv=1, d_qk=96, d_v=64, topk=70)
    args["topk_length"] = torch.tensor([[70, 20, 5], [3, 70, 0]], dtype=torch.int32, device=device)
    args["indices"][0, 1, 0, 3] = -1
    args["deterministic"] = True
    monkeypatch.setattr(backward, "WORKSPACE_BYTES", 1)
    _assert_gradients_match(variant, args, _configs(variant, args)[0], seed=11)


def test_deterministic_path_is_taken_when_asked(variant, device, monkeypatch):
    """deterministic=True, or torch's deterministic mode, runs the passes without atomics; the default
    runs the fused pass."""
    from kreg.kernels.common.sparse_mla import backward

    calls = []
    passes = backward._deterministic_passes
    monkeypatch.setattr(backward, "_deterministic_passes", lambda *a: calls.append(1) or passes(*a))
    args = _inputs(device, seed=15, s_q=2, s_kv=20, h_q=16, h_kv=1, d_qk=96, d_v=64, topk=16)
    config = _configs(variant, args)[0]

    def backward(**extra):
        q = args["q"].detach().clone().requires_grad_()
        variant.call({**args, **extra, "q": q}, config).out.float().sum().backward()

    backward()
    assert not calls
    backward(deterministic=True)
    assert len(calls) == 1
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    backward()
    assert len(calls) == 2


def test_deterministic_roles_use_no_atomics():
    """The kernels of the deterministic backward (and the pre pass it shares) never add atomically;
    the fused pass does (its dkv rows)."""
    import inspect

    from kreg.ops.variant import _python_function

    variant = HEADBLOCK[0]
    for role in ("bwd_pre", "bwd_dq", "bwd_dkv", "bwd_sum"):
        assert "tl.atomic" not in inspect.getsource(_python_function(variant.kernels[role])), role
    assert "tl.atomic_add" in inspect.getsource(_python_function(variant.kernels["bwd_fused"]))
    assert set(variant.role_arguments) == {"bwd_dq", "bwd_dkv", "bwd_sum"}


@gpu
def test_deterministic_backward_is_bitwise_reproducible():
    """Two deterministic backwards of one call give the same bits, on a shape where many queries
    select the same rows (so atomics would reorder sums)."""
    from kreg import registry

    shape = dict(s_q=256, s_kv=512, h_q=64, h_kv=1, d_qk=576, d_v=512, topk=256, sink=True)
    args = _inputs("cuda", seed=16, **shape)
    args["deterministic"] = True
    leaves = {n: args[n].detach().clone().requires_grad_() for n in ("q", "kv", "attn_sink")}
    out = registry.get("sparse_mla")(**{**args, **leaves}).out
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, list(leaves.values()), dout, retain_graph=True)
    second = torch.autograd.grad(out, list(leaves.values()), dout)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_invalid_slots_get_no_gradient(variant, device):
    """Rows of kv that no valid slot selects keep a zero gradient, whatever invalid indices point at."""
    args = _inputs(device, seed=8, s_q=3, s_kv=40, h_q=16, h_kv=1, d_qk=96, d_v=64, topk=16)
    idx = torch.full_like(args["indices"], -1)
    idx[:, 0, :4] = torch.tensor([1, 2, 2, 5], dtype=torch.int32)
    idx[:, 0, 4:8] = torch.tensor([40, 41, 2**31 - 1, -3], dtype=torch.int32)
    args["indices"] = idx
    kv = args["kv"].detach().clone().requires_grad_()
    out = variant.call({**args, "kv": kv}, _configs(variant, args)[0]).out
    (grad,) = torch.autograd.grad(out.float().sum(), [kv])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[[1, 2, 5]] = False
    assert torch.all(grad[untouched.to(device)] == 0)
    assert torch.all(grad[[1, 2, 5]].abs().sum(-1) > 0)


def test_every_backward_config_of_the_space_matches_reference(variant, device):
    """Each backward role's configs other than its default (the interpreter's tiles on the CPU; a sample
    of the GPU space on a GPU), the other roles at their defaults: 40 heads make partial head blocks
    and dkv chunks."""
    from kreg.ops import OPS
    from kreg.ops.testing import GRAD_TOLERANCE, gradient_error

    args = _inputs(device, seed=12, s_q=3, s_kv=90, h_q=40, h_kv=1, d_qk=96, d_v=64, topk=70, sink=True)
    key, info = dict(tuning_key(args)), _device_info()
    default = variant.default_config(key, info)
    for role in (r for r in variant.roles if r.startswith("bwd")):
        # As the sweep runs them: the deterministic roles under deterministic=True.
        role_args = {**args, **variant.role_arguments.get(role, {})}
        configs = [c for c in variant.space(key, info)[role] if variant.prune_reason(role, c, key, info) is None]
        # The defaults run in every other backward test.
        for config in [c for c in configs[:: max(1, len(configs) // 4)] if c != default[role]]:
            call = default.replace(role, config)
            err = gradient_error(OPS["sparse_mla"], lambda a, c=call: variant.call(a, c), role_args)
            assert err <= GRAD_TOLERANCE[DTYPE], (role, str(config), err)


@gpu
def test_v32_shape_bf16_on_gpu():
    """The DeepSeek-V3.2 shape on the GPU through the registry, in bf16."""
    from kreg import registry

    shape = dict(s_q=64, s_kv=4096, h_q=128, h_kv=1, d_qk=576, d_v=512, topk=2048)
    args = _inputs("cuda", seed=9, **shape)
    out = registry.get("sparse_mla")(**args)
    assert_close(out, reference(**args), TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("d_split", [1, 2])
def test_value_part_in_d_tiles_with_odd_dims(device, d_split):
    """D_SPLIT 2 with a value part that is no power of two (d_v 100: tiles of 64, the second 36 wide) and
    a rope tail of 20, against the reference (the head-block variants of both vendors)."""
    args = _inputs(device, seed=5, s_q=3, s_kv=90, h_q=24, h_kv=1, d_qk=120, d_v=100, topk=70, sink=True)
    expected = reference(**args)
    for variant in HEADBLOCK:
        if HAS_GPU and variant.vendor != detect().vendor:
            continue
        config = variant.default_config(dict(tuning_key(args)), _device_info())
        config = config.replace("fwd", LaunchConfig(blocks={"BLOCK_H": 16, "BLOCK_TOPK": 32, "D_SPLIT": d_split}))
        assert_close(variant.call(args, config), expected, TOL, what=f"{variant.vendor}")


def test_interpreter_space_is_small_and_valid():
    info = CPU
    for variant in HEADBLOCK:
        spaces = variant.space({**V32_KEY, "dtype": "fp16"}, info)
        assert set(spaces) == {"fwd", "bwd_pre", "bwd_fused", "bwd_dq", "bwd_dkv", "bwd_sum"}
        for space in spaces.values():
            assert 1 <= len(space) <= 4
            assert all(isinstance(c, LaunchConfig) and c.knobs() == LaunchConfig().knobs() for c in space)


def test_gpu_spaces_offer_wide_head_blocks():
    """BLOCK_H 16..128 is offered for h_q 128 on every target; NVIDIA prunes what cannot hold the
    d_v 512 accumulator, AMD keeps BLOCK_H 128 and offers num_stages 1-2 (kpack fixed to 1 on gfx950)."""
    from kreg.core.device import preset

    key = V32_KEY
    for variant in HEADBLOCK:
        target = preset("h200") if variant.vendor == "nvidia" else preset("mi355x")
        space = variant.space(key, target)["fwd"]
        assert {c.blocks["BLOCK_H"] for c in space} == {16, 32, 64, 128}
        assert {c.blocks["D_SPLIT"] for c in space} == {1, 2}
        kept = [c for c in space if variant.prune_reason("fwd", c, key, target) is None]
        default = variant.default_config(key, target)
        assert kept and all(variant.prune_reason(role, default[role], key, target) is None for role in variant.roles)
        if variant.vendor == "amd":
            assert {c.num_stages for c in space} == {1, 2}
            assert {c.kpack for c in space} == {1}
            assert 128 in {c.blocks["BLOCK_H"] for c in kept}
        else:
            assert 128 not in {c.blocks["BLOCK_H"] for c in kept}
    # A group of 8 heads never gets a head block wider than 16.
    small = {**key, "h_q": 16, "h_kv": 2}
    for role, space in HEADBLOCK[0].space(small, preset("h200")).items():
        assert {c.blocks.get("BLOCK_H", 16) for c in space} == {16}, role
