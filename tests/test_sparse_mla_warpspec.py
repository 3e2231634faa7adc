"""The Hopper Gluon variant of sparse_mla (kernels/nvidia/sparse_mla.py): where it runs, its
config space, its fallback for kv layouts it cannot copy from; on an sm_90 GPU, every config of its space
against the reference. (The shared correctness tests in test_sparse_mla_kernel.py run it on sm_90 too;
its offline sm_90 compiles are in test_shipped_and_default_configs.py.)"""

import pytest
import torch

from kernels.base import load_all
from registry.device import CPU, preset
from registry.dispatch import candidates
from registry.ops.sparse_mla import make_inputs, reference, validate
from registry.testing import TOLERANCE, assert_close
from tuning_db.records import LaunchConfig

from .conftest import HAS_GPU

WARPSPEC = next(v for v in load_all()["sparse_mla"] if v.name == "sparse_mla_warpspec")
HEADBLOCK_NVIDIA = next(v for v in load_all()["sparse_mla"]
                        if v.name == "sparse_mla_headblock" and v.vendor == "nvidia")
V32 = {"d_qk": 576, "d_v": 512, "h_q": 128, "h_kv": 1, "dtype": "bf16", "topk": 2048}
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
    """Fixed tiles (32-slot blocks, four stages: what fits beside Q), so the space is the producer's warps
    and the follower's registers; everything fits at the V3.2 dims, and the shared-memory estimate
    says what the compiler allocates, give or take the alignment of the small buffers."""
    from kernels.nvidia.sparse_mla import shared_bytes

    target = preset("h200")
    space = WARPSPEC.space(V32, target)
    assert len(space) == len(set(space)) == 4
    assert {(c.blocks["PRODUCER_WARPS"], c.blocks["FOLLOWER_REGS"]) for c in space} == {(2, 200), (2, 208),
                                                                                         (4, 200), (4, 208)}
    assert {(c.blocks["BLOCK_TOPK"], c.num_stages, c.num_warps) for c in space} == {(32, 4, 4)}
    assert all(WARPSPEC.prune_reason(c, V32, target) is None for c in space)
    assert WARPSPEC.default_config(V32, target) in space
    assert 230_000 < shared_bytes(512, 64) <= target.shared_mem_bytes
    # A 16-head group: the config records 16 heads per program (the backward's dq cap).
    small = {**V32, "h_q": 16}
    assert {c.blocks["BLOCK_H"] for c in WARPSPEC.space(small, target)} == {16}


def test_configs_of_the_earlier_kernel_still_launch():
    """A config tuned before the knobs existed (stale, still used: ARCHITECTURE.md) launches with the
    defaults for what it lacks; its own knobs win where it has them."""
    from kernels.nvidia.sparse_mla import DEFAULT_KNOBS, launch_knobs

    old = LaunchConfig(blocks={"BLOCK_H": 64, "BLOCK_TOPK": 64, "PRODUCER_WARPS": 2}, num_warps=8, num_stages=2)
    assert launch_knobs(old) == {**DEFAULT_KNOBS, "PRODUCER_WARPS": 2}
    assert launch_knobs(WARPSPEC.default_config(V32, preset("h200"))) == DEFAULT_KNOBS
    spec = WARPSPEC.compile_specs(V32, old)[0]
    assert spec.constexprs["FOLLOWER_REGS"] == DEFAULT_KNOBS["FOLLOWER_REGS"]


def test_backward_is_the_head_block_variants():
    config = WARPSPEC.default_config(V32, preset("h200"))
    assert WARPSPEC.backward_configs(config) == HEADBLOCK_NVIDIA.backward_configs(config)


def test_copies_need_16_element_rows():
    from kernels.nvidia.sparse_mla import _copies_aligned

    kv = torch.empty(1, 8, 1, 576, dtype=torch.bfloat16)
    assert _copies_aligned(kv)
    assert not _copies_aligned(torch.empty(1, 8, 1, 584, dtype=torch.bfloat16)[..., :576])  # row stride 584
    assert not _copies_aligned(torch.empty(1, 8 * 576 + 1, dtype=torch.bfloat16)[:, 1:].view(1, 8, 1, 576))


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
    for config in WARPSPEC.space(key, preset("h200")):
        if WARPSPEC.prune_reason(config, key, preset("h200")) is None:
            assert_close(WARPSPEC.launch(args, config), expected, TOLERANCE[torch.bfloat16], what=str(config))


@hopper
def test_unaligned_kv_runs_the_head_block_kernel():
    args = _args(2, s_q=3, s_kv=50, h_q=64, h_kv=1, d_qk=576, d_v=512, topk=40)
    padded = torch.zeros(50, 1, 584, device="cuda", dtype=torch.bfloat16)
    padded[..., :576] = args["kv"]
    args["kv"] = padded[..., :576]
    out = WARPSPEC.launch(args, WARPSPEC.default_config(V32, preset("h200")))
    assert_close(out, reference(**args), TOLERANCE[torch.bfloat16])
