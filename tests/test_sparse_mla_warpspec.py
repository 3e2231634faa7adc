"""The Hopper Gluon variant of sparse_mla (kernels/nvidia/sparse_mla.py, its forward
sparse_mla_warpspec_fwd.py and its backward sparse_mla_warpspec_bwd.py): where it runs, its config
spaces, dispatch's choice of the head-block kernel for kv layouts it cannot copy from; on an sm_90
GPU, every config of its forward and fused backward spaces against the reference. (The shared correctness tests in
test_sparse_mla_kernel.py run it on sm_90 too; its offline sm_90 compiles are in
test_shipped_and_default_configs.py.)"""

import pytest
import torch

from kreg.core.device import CPU, preset
from kreg.core.records import CallConfig, LaunchConfig
from kreg.ops.catalog import load_all
from kreg.ops.sparse_mla import make_inputs, reference, validate
from kreg.ops.testing import TOLERANCE, assert_close
from kreg.registry.dispatch import candidates

from .conftest import HAS_GPU

WARPSPEC = next(v for v in load_all()["sparse_mla"] if v.name == "sparse_mla_warpspec")
HEADBLOCK_NVIDIA = next(v for v in load_all()["sparse_mla"]
                        if v.name == "sparse_mla_headblock" and v.vendor == "nvidia")
V32 = {"d_qk": 576, "d_v": 512, "h_q": 128, "h_kv": 1, "dtype": "bf16", "topk": 2048, "kv_aligned": True}
ON_HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (H100/H200)")


@pytest.mark.parametrize("changes,expected", [
    ({}, True),
    ({"d_qk": 96, "d_v": 64}, True),           # rope tail 32
    ({"d_qk": 512, "d_v": 512}, True),         # no tail
    ({"dtype": "fp16"}, True),
    ({"dtype": "fp32"}, False),
    ({"d_qk": 640, "d_v": 512}, False),        # tail 128 > 64
    ({"d_qk": 580, "d_v": 512}, False),        # tail 68, and not whole 16-byte copies
    ({"d_qk": 1024, "d_v": 1024}, False),      # d_v / 2 > 256: no single wgmma per warpgroup
    ({"d_qk": 448, "d_v": 384}, False),        # d_v not a power of two
    ({"d_qk": 48, "d_v": 32}, False),          # d_v < 64
    ({"kv_aligned": False}, False),            # rows not 16-element aligned: no 16-byte copies
])
def test_supports_hopper_shapes_only(changes, expected):
    key = {**V32, **changes}
    assert WARPSPEC.supports(key, preset("h200")) is expected
    assert WARPSPEC.supports(key, preset("h100")) is expected
    for other in ("mi300x", "mi355x", "cpu"):
        assert not WARPSPEC.supports(key, preset(other))


def test_registry_prefers_it_on_hopper_and_never_on_cpu():
    names = [v.name for v in candidates("sparse_mla", "nvidia", None, V32, preset("h200"))]
    assert names == ["sparse_mla_warpspec", "sparse_mla_headblock"]
    assert [v.name for v in candidates("sparse_mla", "nvidia", None, V32, CPU)] == ["sparse_mla_headblock"]


def test_space_and_pruning():
    """Fixed tiles (forward: two buffers of one 64-slot block each, what fits beside Q; fused backward:
    32-slot tiles, two stages, what fits beside [Q; dO]), so each space is the producer's warps and the second
    warpgroup's registers; everything fits at the V3.2 dims, and the shared-memory estimates say what
    the compiler allocates, give or take the alignment of the small buffers. The other backward roles
    are the head-block variant's, capped by the group's heads; the deterministic dq pass is the fused
    pass's kernel, with its space."""
    from kreg.kernels.nvidia.sparse_mla_warpspec_bwd import shared_bytes as bwd_shared_bytes
    from kreg.kernels.nvidia.sparse_mla_warpspec_fwd import shared_bytes

    target = preset("h200")
    space = WARPSPEC.space(V32, target)["fwd"]
    assert len(space) == len(set(space)) == 5
    assert {(c.blocks["PRODUCER_WARPS"], c.blocks["FOLLOWER_REGS"]) for c in space} == {
        (4, r) for r in (200, 208, 216, 224, 232)}
    assert {c.num_warps for c in space} == {4}
    assert all(WARPSPEC.prune_reason("fwd", c, V32, target) is None for c in space)
    assert WARPSPEC.default_config(V32, target)["fwd"] in space
    assert 230_000 < shared_bytes(512, 64) <= target.shared_mem_bytes
    fused = WARPSPEC.space(V32, target)["bwd_fused"]
    assert {(c.blocks["PRODUCER_WARPS"], c.blocks["GRADIENT_REGS"]) for c in fused} == {
        (p, r) for p in (2, 4) for r in (208, 216, 224)}
    assert all(WARPSPEC.prune_reason("bwd_fused", c, V32, target) is None for c in fused)
    assert WARPSPEC.default_config(V32, target)["bwd_fused"] in fused
    assert WARPSPEC.space(V32, target)["bwd_dq"] == fused
    assert WARPSPEC.default_config(V32, target)["bwd_dq"] == WARPSPEC.default_config(V32, target)["bwd_fused"]
    assert 220_000 < bwd_shared_bytes(512, 64) <= target.shared_mem_bytes
    small = {**V32, "h_q": 16}
    for role in ("bwd_pre", "bwd_dkv"):
        assert {c.blocks["BLOCK_H"] for c in WARPSPEC.space(small, target)[role]} == {16}
        assert WARPSPEC.default_config(small, target)[role].blocks["BLOCK_H"] == 16


def test_configs_of_the_earlier_kernel_still_launch():
    """A config tuned before the knobs existed (stale, still used: docs/architecture.md) is completed
    with the defaults for what it lacks, and loses the blocks the kernel no longer has; its own knobs
    win where it has them; the backward roles it never had take their defaults."""
    old = CallConfig(LaunchConfig(blocks={"BLOCK_H": 64, "BLOCK_TOPK": 64, "FOLLOWER_REGS": 200},
                                  num_warps=8, num_stages=2))
    default = WARPSPEC.default_config(V32, preset("h200"))
    assert default["fwd"].blocks["FOLLOWER_REGS"] != 200
    completed = WARPSPEC.complete(old, V32, preset("h200"))
    assert completed["fwd"].blocks == {**default["fwd"].blocks, "FOLLOWER_REGS": 200}
    assert all(completed[role] == default[role] for role in WARPSPEC.roles if role != "fwd")


def test_backward_is_the_head_block_variants_but_the_gluon_passes():
    """The fused pass and the deterministic dq pass are one Gluon kernel (with and without its dkv
    atomics) with one space; the other backward roles are the head-block variant's."""
    assert WARPSPEC.roles == HEADBLOCK_NVIDIA.roles
    assert WARPSPEC.kernels["bwd_fused"] is WARPSPEC.kernels["bwd_dq"] is not HEADBLOCK_NVIDIA.kernels["bwd_fused"]
    assert WARPSPEC.spaces["bwd_fused"] is WARPSPEC.spaces["bwd_dq"]
    assert WARPSPEC.passes.fused is not HEADBLOCK_NVIDIA.passes.fused
    assert WARPSPEC.passes.dq is not HEADBLOCK_NVIDIA.passes.dq
    for role in (r for r in WARPSPEC.roles if r.startswith("bwd") and r not in ("bwd_fused", "bwd_dq")):
        assert WARPSPEC.kernels[role] is HEADBLOCK_NVIDIA.kernels[role]
        assert WARPSPEC.spaces[role] is HEADBLOCK_NVIDIA.spaces[role]
        assert WARPSPEC.default_config(V32, preset("h200"))[role] == HEADBLOCK_NVIDIA.default_config(
            V32, preset("h200"))[role]


def test_unaligned_kv_is_a_key_the_head_block_kernel_takes():
    """Dispatch, not the launcher, decides: a kv whose rows are not 16-element aligned has its own key,
    which only the head-block kernel supports (resolved on meta tensors, as on an H200)."""
    from kreg.ops import OPS
    from kreg.registry import dispatch

    op = OPS["sparse_mla"]
    shape = dict(s_q=64, s_kv=4096, h_q=128, h_kv=1, d_qk=576, d_v=512, topk=2048)
    args = op.make_inputs(shape, device="meta", dtype=torch.bfloat16, seed=0)
    aligned = op.validate(**args)
    unaligned = op.validate(**{**args, "kv": torch.empty(4096, 1, 584, device="meta", dtype=torch.bfloat16)[..., :576]})
    h200 = preset("h200")
    for call, expected in ((aligned, "sparse_mla_warpspec"), (unaligned, "sparse_mla_headblock")):
        choice = dispatch.resolve(op, "nvidia", None, op.tuning_key(call), h200, call)
        assert choice.variant.name == expected


def _args(seed: int, **shape):
    return validate(**make_inputs(shape, device="cuda", dtype=torch.bfloat16, seed=seed))


@hopper
def test_every_config_of_the_space_matches_reference():
    """Odd top-k (no multiple of either tile), invalid indices of every kind, an all-invalid row, a
    partial head block (h_q 80: one full block of 64, one of 16) and a second kv group."""
    args = _args(1, s_q=4, s_kv=300, h_q=160, h_kv=2, d_qk=576, d_v=512, topk=203, sink=True, topk_length=True)
    idx = args["indices"].clone()
    idx[0, 0, :6] = torch.tensor([-1, 300, 2**31 - 1, -(2**31), 7, 7], dtype=torch.int32)
    idx[1, 1] = -1
    args["indices"] = idx
    expected = reference(**args)
    key = {**V32, "h_q": 160, "h_kv": 2}
    default = WARPSPEC.default_config(key, preset("h200"))
    for config in WARPSPEC.space(key, preset("h200"))["fwd"]:
        if WARPSPEC.prune_reason("fwd", config, key, preset("h200")) is None:
            call = default.replace("fwd", config)
            assert_close(WARPSPEC.call(args, call), expected, TOLERANCE[torch.bfloat16], what=str(config))


@hopper
def test_deterministic_backward_with_the_gluon_dq_pass():
    """deterministic=True runs the Gluon kernel without atomics as its dq pass, then the head-block dkv
    and sum passes: gradients match the reference's autograd (top-k 203, invalid and duplicate slots,
    a row cut short, 80 heads a group: 64 + 16, two kv groups, a sink, two batch rows) at two configs
    of the dq pass's space, and repeat bit for bit."""
    from kreg.ops import OPS
    from kreg.ops.testing import GRAD_TOLERANCE, gradient_error

    args = _args(7, b=2, s_q=5, s_kv=300, h_q=160, h_kv=2, d_qk=576, d_v=512, topk=203, sink=True, topk_length=True)
    idx = args["indices"].clone()
    idx[0, 0, 0, :8] = torch.tensor([-1, 300, 2**31 - 1, -(2**31), 7, 7, 7, 299], dtype=torch.int32)
    args["indices"] = idx
    args["deterministic"] = True
    key = {**V32, "h_q": 160, "h_kv": 2}
    default = WARPSPEC.default_config(key, preset("h200"))
    for config in ({"PRODUCER_WARPS": 2, "GRADIENT_REGS": 208}, {"PRODUCER_WARPS": 4, "GRADIENT_REGS": 208}):
        call = default.replace("bwd_dq", LaunchConfig(blocks=config, num_warps=4))
        err = gradient_error(OPS["sparse_mla"], lambda a, c=call: WARPSPEC.call(a, c), args)
        assert err <= GRAD_TOLERANCE[torch.bfloat16], (config, err)
    grads = []
    for _ in range(2):
        q = args["q"].detach().requires_grad_()
        kv = args["kv"].detach().requires_grad_()
        out = WARPSPEC.call({**args, "q": q, "kv": kv}, default).out
        grads.append(torch.autograd.grad(out, (q, kv), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@hopper
@pytest.mark.parametrize("topk", [1, 63, 64, 65, 127, 128, 129, 256])
def test_forward_at_the_step_boundaries(topk):
    """The forward takes 64-slot blocks in pairs (one step) and issues each next step's scores inside
    the step before; the last step is its own code. Top-k at and around the block and step sizes: one
    step whose second block is empty or partial, exactly one or two full steps, a step past them."""
    args = _args(5, s_q=3, s_kv=300, h_q=64, h_kv=1, d_qk=576, d_v=512, topk=topk)
    assert_close(WARPSPEC.call(args, WARPSPEC.default_config(V32, preset("h200"))), reference(**args),
                 TOLERANCE[torch.bfloat16], what=f"topk {topk}")


@hopper
def test_forward_rows_with_no_slot():
    """topk_length 0 everywhere: no step runs; out 0, max_logits -inf, lse +inf on every row."""
    args = _args(6, s_q=3, s_kv=300, h_q=64, h_kv=1, d_qk=576, d_v=512, topk=130, topk_length=True)
    args["topk_length"] = torch.zeros_like(args["topk_length"])
    out, max_logits, lse = WARPSPEC.call(args, WARPSPEC.default_config(V32, preset("h200")))
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((max_logits == float("-inf")).all()) and bool((lse == float("inf")).all())

@hopper
def test_unaligned_kv_runs_the_head_block_kernel():
    from kreg import registry

    args = _args(2, s_q=3, s_kv=50, h_q=64, h_kv=1, d_qk=576, d_v=512, topk=40)
    padded = torch.zeros(50, 1, 584, device="cuda", dtype=torch.bfloat16)
    padded[..., :576] = args["kv"]
    args["kv"] = padded[..., :576]
    handle = registry.get("sparse_mla")
    assert handle.choice(**args).variant.name == "sparse_mla_headblock"
    assert_close(handle(**args), reference(**args), TOLERANCE[torch.bfloat16])


@hopper
def test_every_fused_backward_config_matches_reference():
    """The Gluon fused backward pass against the reference's autograd in bf16, every config of its
    space: top-k 203 (no multiple of the 32-slot tile), invalid indices of every kind, duplicates, an
    all-invalid row, a row cut short by topk_length, a partial head block (80 heads a group: 64 + 16),
    two kv groups, a sink, two batch rows; then the V3.2 dims at h_q 128 through the registry."""
    from kreg import registry
    from kreg.ops import OPS
    from kreg.ops.testing import GRAD_TOLERANCE, gradient_error

    args = _args(3, b=2, s_q=5, s_kv=300, h_q=160, h_kv=2, d_qk=576, d_v=512, topk=203, sink=True, topk_length=True)
    idx = args["indices"].clone()
    idx[0, 0, 0, :8] = torch.tensor([-1, 300, 2**31 - 1, -(2**31), 7, 7, 7, 299], dtype=torch.int32)
    idx[1, 2, 1] = -1
    args["indices"] = idx
    key = {**V32, "h_q": 160, "h_kv": 2}
    default = WARPSPEC.default_config(key, preset("h200"))
    for config in WARPSPEC.space(key, preset("h200"))["bwd_fused"]:
        if WARPSPEC.prune_reason("bwd_fused", config, key, preset("h200")) is None:
            call = default.replace("bwd_fused", config)
            err = gradient_error(OPS["sparse_mla"], lambda a, c=call: WARPSPEC.call(a, c), args)
            assert err <= GRAD_TOLERANCE[torch.bfloat16], (str(config), err)
    v32 = _args(4, s_q=8, s_kv=4096, h_q=128, h_kv=1, d_qk=576, d_v=512, topk=2048)
    handle = registry.get("sparse_mla")
    assert handle.choice(**v32).variant.name == "sparse_mla_warpspec"
    err = gradient_error(OPS["sparse_mla"], lambda a: handle(**a), v32)
    assert err <= GRAD_TOLERANCE[torch.bfloat16], err
