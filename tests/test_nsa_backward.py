"""NSA's backward kernels (kernels/common/nsa_backward.py) against torch.autograd of the op's fp32
reference, with the same block ids: odd lengths, a sequence shorter than one block, fewer blocks than
block_count, windows of 1 and longer than the sequence, GQA ratios 1, 4 and 16, caller ids with -1,
out-of-range ids, duplicates and rows without a valid id, and the reference's own selection.

The saved forward tensors (each branch's ungated output, stored in the input dtype, and its lse) come
from an fp32 torch model of the branches written here. On the CPU the kernels run in the Triton
interpreter in fp16; on a GPU in bf16. The offline compile check of the proposed default configs (sm_90,
gfx942, gfx950) runs in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.common.nsa_backward import INTERPRETER, ROLES, block_lists, nsa_backward
from registry.ops.nsa import _compressed, reference, select_blocks, validate
from registry.testing import GRAD_TOLERANCE, relative_error
from tuning_db.records import CallConfig, LaunchConfig

from .conftest import HAS_GPU
from .test_ref_nsa import make_case

DTYPE = torch.bfloat16 if HAS_GPU else torch.float16
ROOT = Path(__file__).resolve().parents[1]


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
    rows = torch.arange(t)[:, None]
    n_cmp = t // block_size
    z_cmp = torch.einsum("bihd,bhcd->bhic", qf, heads(_compressed(kf, block_size))) * sm_scale
    visible = ((torch.arange(n_cmp) + 1) * block_size - 1 <= rows).float()
    o_cmp, lse_cmp = _attend(z_cmp, visible.expand_as(z_cmp), heads(_compressed(vf, block_size)))
    z = torch.einsum("bihd,bhjd->bhij", qf, heads(kf)) * sm_scale
    own = rows // block_size  # [t, 1]
    ids = block_indices.long()
    chosen = (ids >= 0) & (ids <= own[None, :, :, None])
    counts = torch.zeros(b, t, k.shape[2], -(-t // block_size))
    counts.scatter_add_(-1, torch.where(chosen, ids, 0), chosen.float())
    cols = torch.arange(t)
    mult = counts[..., cols // block_size] * (cols <= rows)[:, None, :]  # [b, t, h_kv, t]
    o_slc, lse_slc = _attend(z, mult.repeat_interleave(group, 2).transpose(1, 2), heads(vf))
    in_window = ((cols <= rows) & (cols > rows - window)).float()
    o_swa, lse_swa = _attend(z, in_window.expand_as(z), heads(vf))
    return {"o_cmp": o_cmp, "lse_cmp": lse_cmp, "o_slc": o_slc, "lse_slc": lse_slc, "o_swa": o_swa,
            "lse_swa": lse_swa}


def _check(case: dict, *, blocks: str = "given", config: CallConfig | None = None, strided_dout: bool = False,
           seed: int = 0) -> None:
    """Run nsa_backward on the case (inputs cast to DTYPE) and compare its six gradients against
    autograd of the fp32 reference on the same values and ids."""
    args = make_case(**case, blocks=blocks == "given", seed=seed)
    for name in ("q", "k", "v", "g_cmp", "g_slc", "g_swa"):
        args[name] = args[name].to(DTYPE)
    args = validate(**args)
    q, k, v = args["q"], args["k"], args["v"]
    bs, window, scale = args["block_size"], args["window"], args["sm_scale"]
    ids = args["block_indices"]
    if ids is None:
        ids = select_blocks(q.float(), k.float(), bs, args["block_count"], scale)
    b, t, h_q, d = q.shape
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, t, h_q, d, generator=gen)
    if strided_dout:
        dout = torch.randn(b, h_q, t, 2 * d, generator=gen)[..., ::2].transpose(1, 2)
    dout = dout.to(DTYPE)

    leaves = {n: args[n].float().requires_grad_() for n in ("q", "k", "v", "g_cmp", "g_slc", "g_swa")}
    out = reference(**{**args, **leaves, "block_indices": ids})
    expected = torch.autograd.grad(out, list(leaves.values()), dout.float())

    saved = branches(q, k, v, bs, window, scale, ids)
    for name in ("o_cmp", "o_slc", "o_swa"):
        saved[name] = saved[name].to(DTYPE)
    device = torch.device("cuda" if HAS_GPU else "cpu")
    on = lambda x: x.to(device)  # noqa: E731
    got = nsa_backward(on(q), on(k), on(v), on(args["g_cmp"]), on(args["g_slc"]), on(args["g_swa"]), on(dout),
                       block_size=bs, window=window, sm_scale=scale, block_indices=on(ids),
                       **{n: on(x) for n, x in saved.items()}, config=config or _config())
    for name, g, want, like in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"), got, expected,
                                   (q, k, v, args["g_cmp"], args["g_slc"], args["g_swa"]), strict=True):
        assert g.dtype == like.dtype and g.shape == like.shape, name
        err = relative_error(g.float(), want)
        print(name, f"{err:.2e}")
        assert err <= GRAD_TOLERANCE[DTYPE], f"{name}: relative error {err:.3g}"


def test_smoke():
    _check(dict(b=2, t=37, h_q=8, h_kv=2, d=16, block_size=8, block_count=3, window=11))
