"""NSA's backward kernels (kernels/common/nsa/backward.py) against torch.autograd of the op's fp32
reference, with the same block ids: odd lengths, a sequence shorter than one block, fewer blocks than
block_count, windows of 1 and longer than the sequence, GQA ratios 1, 4 and 16, caller ids with -1,
out-of-range ids, duplicates and rows without a valid id, and the reference's own selection.

The saved forward tensors (each branch's ungated output, stored in the input dtype, and its lse) come
from an fp32 torch model of the branches written here. On the CPU the kernels run in the Triton
interpreter in fp16; on a GPU in bf16. The variant's default configs are compiled for sm_90, gfx942
and gfx950 by tests/test_shipped_and_default_configs.py.
"""

from __future__ import annotations

import pytest
import torch

from kreg.core.records import CallConfig, LaunchConfig
from kreg.kernels.common.nsa.backward import INTERPRETER, ROLES, block_lists, nsa_backward
from kreg.ops.nsa import _compressed, reference, select_blocks, validate
from kreg.ops.testing import GRAD_TOLERANCE, relative_error

from .conftest import HAS_GPU, gpu
from .test_ref_nsa import make_case

DTYPE = torch.bfloat16 if HAS_GPU else torch.float16


def _config(which: int = 0) -> CallConfig:
    """The interpreter's shapes per role: the defaults (0) or the second shapes (1)."""
    return CallConfig({role: LaunchConfig(blocks=INTERPRETER[role][min(which, len(INTERPRETER[role]) - 1)])
                       for role in ROLES})


def _attend(z: torch.Tensor, weight: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of logits z [b, h, i, j] weighted by key multiplicities (0: masked) over values
    [b, h, j, d]: (out [b, i, h, d], lse [b, h, i]; +inf and out 0 for a row without a key)."""
    z = torch.where(weight > 0, z + torch.log(weight.clamp_min(1e-30)), float("-inf"))
    lse = torch.logsumexp(z, -1)
    empty = ~torch.isfinite(lse)
    p = torch.exp(z - torch.where(empty, 0.0, lse)[..., None])
    out = torch.einsum("bhij,bhjd->bihd", p, values)
    return out, torch.where(empty, float("inf"), lse)


def branches(q, k, v, block_size: int, window: int, sm_scale: float, block_indices: torch.Tensor) -> dict:
    """Each branch's ungated output [b, t, h_q, d] and lse [b, h_q, t] in fp32, dense over [t, t]."""
    b, t, h_q, _ = q.shape
    group = h_q // k.shape[2]
    qf, kf, vf = q.float(), k.float(), v.float()
    heads = lambda x: x.repeat_interleave(group, 2).transpose(1, 2)  # noqa: E731 - [b, h_q, n, d]
    rows = torch.arange(t, device=q.device)[:, None]
    cols = torch.arange(t, device=q.device)
    n_cmp = t // block_size
    z_cmp = torch.einsum("bihd,bhcd->bhic", qf, heads(_compressed(kf, block_size))) * sm_scale
    visible = ((torch.arange(n_cmp, device=q.device) + 1) * block_size - 1 <= rows).float()
    o_cmp, lse_cmp = _attend(z_cmp, visible.expand_as(z_cmp), heads(_compressed(vf, block_size)))
    z = torch.einsum("bihd,bhjd->bhij", qf, heads(kf)) * sm_scale
    own = rows // block_size  # [t, 1]
    ids = block_indices.long()
    chosen = (ids >= 0) & (ids <= own[None, :, :, None])
    counts = torch.zeros(b, t, k.shape[2], -(-t // block_size), device=q.device)
    counts.scatter_add_(-1, torch.where(chosen, ids, 0), chosen.float())
    mult = counts[..., cols // block_size] * (cols <= rows)[:, None, :]  # [b, t, h_kv, t]
    o_slc, lse_slc = _attend(z, mult.repeat_interleave(group, 2).transpose(1, 2), heads(vf))
    in_window = ((cols <= rows) & (cols > rows - window)).float()
    o_swa, lse_swa = _attend(z, in_window.expand_as(z), heads(vf))
    return {"o_cmp": o_cmp, "lse_cmp": lse_cmp, "o_slc": o_slc, "lse_slc": lse_slc, "o_swa": o_swa,
            "lse_swa": lse_swa}


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x as a view into a wider tensor: unit last stride, every other stride unlike a contiguous one."""
    wide = torch.zeros((*x.shape[:-1], x.shape[-1] + 3), dtype=x.dtype, device=x.device)
    return wide[..., : x.shape[-1]].copy_(x)


def _check(case: dict, *, blocks: str = "given", config: CallConfig | None = None, strided: bool = False,
           dout_step: int = 1, seed: int = 0, repeat: bool = False) -> None:
    """Run nsa_backward on the case (inputs cast to DTYPE, on the test device) and compare its six
    gradients with autograd of the fp32 reference on the same values and block ids ("given": hostile
    caller ids from make_case; "select": the reference's selection). `strided` passes every tensor as
    a padded view and the gates in fp32; `dout_step` spaces dout's last dim; `repeat` runs it twice and
    asks for the same bits."""
    device = torch.device("cuda" if HAS_GPU else "cpu")
    args = make_case(**case, blocks=blocks == "given", seed=seed)
    gate_dtype = torch.float32 if strided else DTYPE
    args = {n: x.to(device=device, dtype=gate_dtype if n.startswith("g_") else DTYPE)
            if isinstance(x, torch.Tensor) and x.is_floating_point()
            else x.to(device) if isinstance(x, torch.Tensor) else x for n, x in args.items()}
    args = validate(**args)
    q, k, v = args["q"], args["k"], args["v"]
    bs, window, scale = args["block_size"], args["window"], args["sm_scale"]
    ids = args["block_indices"]
    if ids is None:
        ids = select_blocks(q.float(), k.float(), bs, args["block_count"], scale)
    b, t, h_q, d = q.shape
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, t, h_q, d * dout_step, generator=gen)[..., ::dout_step].to(device=device, dtype=DTYPE)

    names = ("q", "k", "v", "g_cmp", "g_slc", "g_swa")
    leaves = {n: args[n].float().requires_grad_() for n in names}
    out = reference(**{**args, **leaves, "block_indices": ids})
    expected = torch.autograd.grad(out, list(leaves.values()), dout.float())

    saved = branches(q, k, v, bs, window, scale, ids)
    for name in ("o_cmp", "o_slc", "o_swa"):
        saved[name] = saved[name].to(DTYPE)
    inputs = [args[n] for n in names] + [dout]
    if strided:
        inputs, ids = [_padded(x) for x in inputs], _padded(ids)
        saved = {n: _padded(x) for n, x in saved.items()}
    run = lambda: nsa_backward(*inputs, block_size=bs, window=window, sm_scale=scale,  # noqa: E731
                               block_indices=ids, **saved, config=config or _config())
    got = run()
    for name, grad, want, like in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"), got, expected,
                                      (args[n] for n in names), strict=True):
        assert grad.dtype == like.dtype and grad.shape == like.shape, name
        err = relative_error(grad.float(), want)
        assert err <= GRAD_TOLERANCE[DTYPE], f"{name}: relative error {err:.3g}"
    if repeat:
        assert all(torch.equal(a, b) for a, b in zip(got, run(), strict=True)), "gradients differ between runs"


CASES = {
    # t not a multiple of the block; hostile ids by default.
    "odd_t": dict(b=2, t=37, h_q=8, h_kv=2, d=16, block_size=8, block_count=3, window=11),
    "t_below_block": dict(b=1, t=7, h_q=2, h_kv=1, d=16, block_size=16, block_count=2, window=3),
    "fewer_blocks_than_count": dict(b=1, t=17, h_q=4, h_kv=2, d=16, block_size=4, block_count=10, window=7),
    "window1_gqa1": dict(b=1, t=21, h_q=3, h_kv=3, d=16, block_size=4, block_count=3, window=1),
    "window_over_t_gqa16": dict(b=1, t=19, h_q=16, h_kv=1, d=16, block_size=4, block_count=3, window=100),
    "gqa4_d24": dict(b=1, t=23, h_q=8, h_kv=2, d=24, block_size=5, block_count=3, window=6),
    # Every token its own (compressed) block; d below the smallest tile.
    "block1_d8": dict(b=1, t=9, h_q=4, h_kv=2, d=8, block_size=1, block_count=3, window=2),
    # A block of two key tiles (BLOCK_N 16), a partial last block.
    "block_over_tile": dict(b=1, t=45, h_q=4, h_kv=1, d=16, block_size=20, block_count=2, window=9),
}


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_gradients_with_hostile_ids(case):
    """Caller ids with -1, -7, the next block, n_blocks, 2**31 - 1, duplicates and a row with no valid id."""
    _check(CASES[case])


@pytest.mark.parametrize("case", ["gqa4_d24", "window_over_t_gqa16"])
def test_gradients_with_the_reference_selection(case):
    _check(CASES[case], blocks="select", seed=3)


def test_strided_tensors_fp32_gates_and_the_second_shapes():
    """Every tensor (inputs, dout, saved outputs and lse, ids) a strided view, fp32 gates, and the
    interpreter's second block shapes (key tiles wider than the block, longer row steps, another split
    of the query range)."""
    _check(CASES["odd_t"], config=_config(1), strided=True, seed=5)


def test_dout_without_a_unit_last_stride():
    _check(CASES["window1_gqa1"], dout_step=2, seed=6)


def test_block_lists_match_a_loop():
    """Every valid (token, slot) is in its (batch, kv head, block) list once per slot, in token order;
    nothing else is listed."""
    args = make_case(**CASES["odd_t"], blocks=True, seed=2)
    ids, bs = args["block_indices"], args["block_size"]
    b, t, h_kv, count = ids.shape
    n_blocks = -(-t // bs)
    offsets, tokens = block_lists(ids, bs)
    assert offsets.shape == (b * h_kv * n_blocks + 1,) and offsets[0] == 0
    for bi in range(b):
        for hk in range(h_kv):
            for blk in range(n_blocks):
                want = [i for i in range(t) for s in range(count) if ids[bi, i, hk, s] == blk and blk <= i // bs]
                lst = (bi * h_kv + hk) * n_blocks + blk
                assert tokens[offsets[lst]:offsets[lst + 1]].tolist() == want
    assert offsets[-1] == sum(1 for i in range(t) for x in ids[:, i].flatten().tolist() if 0 <= x <= i // bs)


# ----------------------------------------------------------------------------- proposed defaults
# The default configs proposed for each vendor's variant (d 128, h_q / h_kv 16, block 64): compiled
# below for sm_90, gfx942 and gfx950 without spills; the GPU test runs them.
TARGET_KEY = {"block_count": 16, "block_indices": False, "block_size": 64, "d": 128, "dtype": "bf16", "h_kv": 4,
              "h_q": 64, "t": 65536, "window": 512}


def _default_config(vendor: str) -> CallConfig:
    """The registered nsa variant's default call config (backward roles included) at the target key."""
    from kreg.core.device import preset
    from kreg.ops.catalog import load_all

    variant = next(v for v in load_all()["nsa"] if v.vendor == vendor)
    return variant.default_config(TARGET_KEY, preset("h200" if vendor == "nvidia" else "mi355x"))


@gpu
def test_gpu_target_like_shape_with_default_configs():
    """The target's head layout (d 128, 16 query heads per kv head, block 64, 16 blocks, window 512) on a
    longer sequence, the variant's default configs, both id sources; bitwise reproducible. (The defaults'
    offline compiles for sm_90/gfx942/gfx950 are tests/test_shipped_and_default_configs.py's.)"""
    from kreg.core.device import detect

    config = _default_config(detect().vendor)
    case = dict(b=1, t=2113, h_q=32, h_kv=2, d=128, block_size=64, block_count=16, window=512)
    _check(case, config=config, repeat=True)
    _check(case, blocks="select", config=config, seed=7)


