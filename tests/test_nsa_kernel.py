"""The NSA forward kernels (both vendors' variants, one body) against the reference and against each
branch computed alone: t not a multiple of the block and shorter than one block, fewer candidate
blocks than block_count, windows of 1 and wider than t, GQA groups of 1, 4 and 16, block sizes that are
not powers of two or longer than a key tile, strided inputs, given block ids of every invalid kind with
duplicates and rows without a valid id, and the kernel's own selection compared as sets with the
reference's (a swap allowed only between near-equal importances).

On the CPU the kernels run in the Triton interpreter in fp16, one vendor per case (two cases run both);
on a GPU in bf16, the vendor present, plus a case at the target's head shape.
"""

from __future__ import annotations

import pytest
import torch

from kreg.core.device import CPU, detect, preset
from kreg.core.records import LaunchConfig
from kreg.kernels.common.nsa.backward import ROLES as BACKWARD_ROLES
from kreg.kernels.common.nsa.forward import NSAForward, nsa_forward_parts
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.nsa import ambiguous_selections, select_blocks
from kreg.ops.testing import TOLERANCE, output_error, relative_error

from .conftest import HAS_GPU
from .test_ref_nsa import make_case

OP = OPS["nsa"]
DTYPE = torch.bfloat16 if HAS_GPU else torch.float16
TOL = TOLERANCE[DTYPE]
INFO = detect() if HAS_GPU else CPU
VARIANTS = {v.vendor: v for v in load_all()["nsa"]}


# ----------------------------------------------------------------------------- each branch alone
def _attend(z: torch.Tensor, weight: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with per-key multiplicities `weight` (0: not allowed) over the last dim of z
    [b, h, t, n] and values v [b, h, n, d]: (out [b, t, h, d], lse [b, h, t]); out 0 and lse +inf for a
    row with no allowed key."""
    z = torch.where(weight > 0, z + torch.log(weight.clamp(min=1e-30)), float("-inf"))
    lse = torch.logsumexp(z, -1)
    empty = torch.isinf(lse)
    p = torch.where(empty[..., None], 0.0, torch.exp(z - torch.where(empty, 0.0, lse)[..., None]))
    return (p @ v).transpose(1, 2), torch.where(empty, float("inf"), lse)


def branches(args: dict, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """o_cmp/lse_cmp, o_slc/lse_slc (attending `blocks`), o_swa/lse_swa and the importance of every
    (b, t, h_kv, compressed block), computed densely in fp64 (fp32 on a GPU) from their definitions."""
    ct = torch.float32 if HAS_GPU else torch.float64
    q, k, v = (args[n].to(ct) for n in ("q", "k", "v"))
    b, t, h_q, _ = q.shape
    h_kv, bs, window = k.shape[2], args["block_size"], args["window"]
    group, n = h_q // h_kv, t // bs
    qh = q.transpose(1, 2)  # [b, h_q, t, d]
    kh, vh = (x.repeat_interleave(group, 2).transpose(1, 2) for x in (k, v))
    k_cmp = kh[:, :, : n * bs].unflatten(2, (n, bs)).mean(3)
    v_cmp = vh[:, :, : n * bs].unflatten(2, (n, bs)).mean(3)
    i = torch.arange(t, device=q.device)[:, None]
    z_cmp = qh @ k_cmp.transpose(-1, -2) * args["sm_scale"]
    visible = ((torch.arange(n, device=q.device) + 1) * bs - 1 <= i).to(ct)
    o_cmp, lse_cmp = _attend(z_cmp, visible.expand_as(z_cmp), v_cmp)
    p_cmp = torch.where(torch.isinf(lse_cmp)[..., None], 0.0, torch.exp(z_cmp - lse_cmp[..., None]))
    importance = p_cmp.unflatten(1, (h_kv, group)).sum(2).transpose(1, 2)  # [b, t, h_kv, n]

    j = torch.arange(t, device=q.device)[None, :]
    z = qh @ kh.transpose(-1, -2) * args["sm_scale"]
    o_swa, lse_swa = _attend(z, ((j <= i) & (i - j < window)).to(ct).expand_as(z), vh)
    # Multiplicity of key j for query i: how often its block is among i's valid ids, causally.
    ids = blocks.long()
    valid = (ids >= 0) & (ids <= i[None, :, :, None] // bs)
    count = torch.zeros(b, t, h_kv, -(-t // bs), dtype=ct, device=q.device)
    count.scatter_add_(-1, torch.where(valid, ids, 0), valid.to(ct))
    mult = count[..., j[0] // bs] * (j <= i)[None, :, None, :]  # [b, t, h_kv, t]
    o_slc, lse_slc = _attend(z, mult.repeat_interleave(group, 2).transpose(1, 2), vh)
    return {"o_cmp": o_cmp, "lse_cmp": lse_cmp, "o_slc": o_slc, "lse_slc": lse_slc, "o_swa": o_swa,
            "lse_swa": lse_swa, "importance": importance}


def check_selection(args: dict, got: torch.Tensor, importance: torch.Tensor) -> None:
    """The kernel's ids against the reference's as sets per (b, t, h_kv): the own block first, valid ids
    first and distinct, as many as the reference's, and the same ids except where the importances of
    the swapped blocks are within the dtype's budget of each other (a near tie)."""
    want = select_blocks(args["q"], args["k"], args["block_size"], args["block_count"], args["sm_scale"])
    got, want = got.cpu().long(), want.cpu().long()
    t, bs = got.shape[1], args["block_size"]
    own = (torch.arange(t) // bs)[None, :, None]
    assert torch.equal(got[..., 0], own.expand_as(got[..., 0])), "slot 0 must hold the own block"
    count = (want >= 0).sum(-1)
    assert torch.equal((got >= 0).sum(-1), count), "another number of selected blocks"
    assert torch.equal(got >= 0, torch.arange(got.shape[-1]) < count[..., None]), "-1 fillers must come last"
    assert bool(((got == -1) | ((got >= 0) & (got <= own[..., None]))).all()), "an id outside the candidates"
    ordered = torch.where(got >= 0, got, -1 - torch.arange(got.shape[-1])).sort(-1).values
    assert not bool((ordered[..., 1:] == ordered[..., :-1]).any()), "a block picked twice"
    # Compare the importances of the picks (the own block left out), sorted: equal sets give zero.
    imp = torch.nn.functional.pad(importance.cpu().double(), (0, 1))  # a column of 0 for the -1 fillers
    picked = [imp.gather(-1, torch.where(x[..., 1:] >= 0, x[..., 1:], imp.shape[-1] - 1)).sort(-1).values
              for x in (got, want)]
    same = (got.sort(-1).values == want.sort(-1).values).all(-1)
    if picked[0].shape[-1]:
        gap = (picked[0] - picked[1]).abs().amax(-1)
        near = gap <= TOL * picked[1].amax(-1)
        worst = torch.where(same, 0.0, gap / picked[1].amax(-1).clamp(min=1e-30)).max().item()
        assert bool((same | near).all()), f"selection differs beyond near ties: relative gap {worst:.3g}"


# ----------------------------------------------------------------------------- cases
def _case(spec: dict, seed: int, device) -> dict:
    """Validated inputs in DTYPE on `device` (strided variants when spec["strided"])."""
    spec = dict(spec)
    strided, blocks = spec.pop("strided", False), spec.pop("blocks", False)
    args = make_case(**spec, blocks=blocks, seed=seed, dtype=DTYPE)
    args = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in args.items()}
    if strided:
        # Heads interleaved with others (last dim still contiguous), k/v stored head-major, a gate
        # sliced from a wider tensor.
        args["q"] = torch.stack([args["q"], -args["q"]], 3)[..., 0, :]
        args["k"] = args["k"].transpose(1, 2).contiguous().transpose(1, 2)
        args["v"] = args["v"].transpose(1, 2).contiguous().transpose(1, 2)
        args["g_slc"] = torch.cat([args["g_slc"], args["g_cmp"]], -1)[..., : args["g_slc"].shape[-1]]
        assert not args["q"].is_contiguous() and not args["k"].is_contiguous()
    return OP.validate(**args)


# name -> (shape, vendors on the CPU, role configs replacing the interpreter's defaults)
CASES = {
    "t29-group4-window-gt-t": (dict(b=1, t=29, h_q=8, h_kv=2, d=32, block_size=8, block_count=3, window=64),
                               ("nvidia", "amd"), {}),
    "t5-shorter-than-a-block": (dict(b=2, t=5, h_q=4, h_kv=1, d=16, block_size=8, block_count=2, window=3),
                                ("amd",), {}),
    "block5-fewer-candidates-strided": (dict(b=1, t=22, h_q=4, h_kv=2, d=16, block_size=5, block_count=6,
                                             window=7, strided=True), ("nvidia",), {}),
    "group16-window1": (dict(b=1, t=24, h_q=16, h_kv=1, d=16, block_size=4, block_count=3, window=1),
                        ("amd",), {"cmp": {"BLOCK_M": 16, "BLOCK_N": 32}}),
    "group1": (dict(b=1, t=30, h_q=2, h_kv=2, d=32, block_size=8, block_count=2, window=9), ("nvidia",),
               {"slc": {"BLOCK_N": 32}}),
    "block24-in-two-key-tiles": (dict(b=1, t=60, h_q=4, h_kv=1, d=16, block_size=24, block_count=2, window=10),
                                 ("amd",), {"slc": {"BLOCK_N": 16}}),
    "36-blocks-three-tiles": (dict(b=1, t=72, h_q=4, h_kv=1, d=16, block_size=2, block_count=6, window=4),
                              ("nvidia",), {}),
    "given-ids-invalid-duplicates": (dict(b=1, t=26, h_q=8, h_kv=2, d=16, block_size=4, block_count=6, window=5,
                                          blocks=True), ("nvidia", "amd"), {}),
}
GPU_CASES = {
    "target-heads-t1536": (dict(b=1, t=1536, h_q=64, h_kv=4, d=128, block_size=64, block_count=16, window=512),
                           (), {}),
    "target-heads-given-ids": (dict(b=1, t=1000, h_q=64, h_kv=4, d=128, block_size=64, block_count=16,
                                    window=512, blocks=True), (), {}),
}
RUNS = [(name, vendor) for name, (_, vendors, _) in CASES.items() for vendor in vendors] if not HAS_GPU else \
    [(name, INFO.vendor) for name in {**CASES, **GPU_CASES}]


def _config(variant, args: dict, overrides: dict):
    key = dict(OP.tuning_key(args))
    config = variant.default_config(key, INFO)
    for role, blocks in overrides.items():
        config = config.replace(role, config[role].model_copy(update={"blocks": LaunchConfig(blocks=blocks).blocks}))
    return config


@pytest.mark.parametrize("name,vendor", RUNS, ids=[f"{n}-{v}" for n, v in RUNS])
def test_parts_match_each_branch_and_out_matches_the_reference(name, vendor, device):
    spec, _, overrides = {**CASES, **GPU_CASES}[name]
    args = _case(spec, seed=len(name), device=device)
    parts = nsa_forward_parts(args, _config(VARIANTS[vendor], args, overrides))
    assert isinstance(parts, NSAForward)
    b, t, h_q, d = args["q"].shape
    h_kv, count = args["k"].shape[2], args["block_count"]
    for x in (parts.out, parts.o_cmp, parts.o_slc, parts.o_swa):
        assert x.shape == (b, t, h_q, d) and x.dtype == DTYPE
    for x in (parts.lse_cmp, parts.lse_slc, parts.lse_swa):
        assert x.shape == (b, h_q, t) and x.dtype == torch.float32
    assert parts.block_indices.shape == (b, t, h_kv, count) and parts.block_indices.dtype == torch.int32
    if args["block_indices"] is not None:
        assert parts.block_indices is args["block_indices"]
    else:
        assert parts.block_indices.is_contiguous()

    want = branches(args, parts.block_indices)
    for part in ("o_cmp", "lse_cmp", "o_slc", "lse_slc", "o_swa", "lse_swa"):
        err = relative_error(getattr(parts, part), want[part])
        assert err <= TOL, f"{part}: relative error {err:.3g}"
    gates = [args[n].to(torch.float32)[..., None] for n in ("g_cmp", "g_slc", "g_swa")]
    summed = gates[0] * parts.o_cmp.float() + gates[1] * parts.o_slc.float() + gates[2] * parts.o_swa.float()
    assert relative_error(parts.out, summed) <= TOL
    if args["block_indices"] is None:
        check_selection(args, parts.block_indices, want["importance"])
    err = output_error(OP, parts.out, OP.reference(**args), args)
    assert err <= TOL, f"out: error {err:.3g} against the reference"


def test_rows_without_a_valid_id_and_before_the_first_block():
    """Given ids: a row with none valid gets o_slc 0 and lse_slc +inf; duplicates count twice (their
    lse is log 2 above a single copy's); queries before the first complete block get o_cmp 0 and
    lse_cmp +inf. Run on both vendors' defaults."""
    device = "cuda" if HAS_GPU else "cpu"
    args = make_case(1, 12, 4, 1, 16, 4, 3, 2, dtype=DTYPE)
    ids = torch.full((1, 12, 1, 3), -1, dtype=torch.int32)
    ids[0, :4, 0] = torch.tensor([2**31 - 1, -7, 1], dtype=torch.int32)  # all invalid for queries 0..3
    ids[0, 8:, 0] = torch.tensor([0, 0, 2], dtype=torch.int32)  # block 0 twice
    ids[0, 4:8, 0] = torch.tensor([0, 3, -1], dtype=torch.int32)  # block 0 once (3 is in the future)
    args = OP.validate(**{n: x.to(device) if isinstance(x, torch.Tensor) else x
                          for n, x in {**args, "block_indices": ids}.items()})
    for variant in VARIANTS.values() if not HAS_GPU else [VARIANTS[INFO.vendor]]:
        parts = nsa_forward_parts(args, variant.default_config(dict(OP.tuning_key(args)), INFO))
        assert torch.all(parts.o_slc[:, :4] == 0) and torch.all(parts.lse_slc[..., :4] == float("inf"))
        assert torch.all(parts.o_cmp[:, :3] == 0) and torch.all(parts.lse_cmp[..., :3] == float("inf"))
        assert torch.isfinite(parts.lse_cmp[..., 3:]).all() and torch.isfinite(parts.lse_slc[..., 4:]).all()
        once = OP.reference(**{**args, "block_indices": torch.where(ids == 0, -1, ids).to(device)})
        assert relative_error(parts.out, OP.reference(**args)) <= TOL
        assert relative_error(parts.out[:, 8:], once[:, 8:]) > 10 * TOL  # the duplicate changed the rows
        want = branches(args, ids.to(device))
        assert relative_error(parts.lse_slc, want["lse_slc"]) <= TOL


def test_near_ties_are_the_only_rows_the_error_leaves_out():
    """ambiguous_selections marks a (query, group) only where the best unselected block's importance is
    within the gap of the last selected one's; the op's error ignores exactly those rows."""
    args = OP.validate(**make_case(1, 40, 4, 2, 8, 4, 3, 5, seed=3))
    importance = branches(args, torch.full((1, 40, 2, 3), -1, dtype=torch.int32))["importance"]
    for gap in (0.0, 0.05, 1.0):
        unclear = ambiguous_selections(args["q"], args["k"], 4, 3, args["sm_scale"], gap)
        own = torch.arange(40) // 4
        for i in range(40):
            for g in range(2):
                others = importance[0, i, g, : own[i]].sort(descending=True).values
                if len(others) < 3:  # every candidate fits: nothing to break a tie over
                    assert not unclear[0, i, g]
                    continue
                last, nxt = others[1].item(), others[2].item()
                assert bool(unclear[0, i, g]) == (last - nxt <= gap * last + 1e-12)
    wrong = OP.reference(**args).clone()
    wrong[0, 20, 1] += 1.0  # query 20, head 1 (group 0)
    unclear = ambiguous_selections(args["q"], args["k"], 4, 3, args["sm_scale"], TOLERANCE[torch.float32])
    err = output_error(OP, wrong, OP.reference(**args), args)
    assert (err == 0.0) == bool(unclear[0, 20, 0])


def test_defaults_fit_the_targets_without_compiling():
    """The heuristic defaults at the full presets pass the variant's static pruning on every target
    (the offline compile test checks spills and shared memory for real)."""
    for shape in OP.presets["full"]:
        args = OP.validate(**OP.make_inputs(shape, device="meta", dtype=torch.bfloat16, seed=0))
        key = dict(OP.tuning_key(args))
        for variant, target in ((VARIANTS["nvidia"], "h200"), (VARIANTS["nvidia"], "h100"),
                                (VARIANTS["amd"], "mi300x"), (VARIANTS["amd"], "mi355x")):
            device = preset(target)
            config = variant.default_config(key, device)
            assert set(config.roles()) == {"compress", "cmp", "swa", "slc", *BACKWARD_ROLES}
            for role in config.roles():
                assert variant.prune_reason(role, config[role], key, device) is None, (target, role, config[role])
