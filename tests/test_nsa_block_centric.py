"""nsa_block_centric (kernels/common/nsa_selected.py): the key-block-centric selected branch against the
op's reference and each branch computed alone (tests/test_nsa_kernel.py's `branches`, fp64 on the CPU),
its gradients through the shared backward against the reference's autograd, and its lists and worklist
against a Python count.

Cases: a single token, t shorter than the candidate span (block_count above the blocks that exist),
t not a multiple of the block, GQA groups of 4 and 16, blocks of 16 and 32 keys, caller ids with -1,
other negatives, future blocks, ids past the last block, both int32 ends and duplicates, and the
kernel's own selection. On the CPU the kernels run in the Triton interpreter in fp16, one vendor per
case (the rows without a valid id on both); on a GPU in bf16 on the vendor present, plus the target's
heads.
"""

from __future__ import annotations

import pytest
import torch

from kernels.common.nsa import NSAForward, group_centric_selected, nsa_forward_parts, shared_branches
from kernels.common.nsa_backward import block_entries
from kernels.common.nsa_selected import BLOCK_CENTRIC_TILES, block_centric_selected, chunk_worklist
from registry.catalog import load_all
from registry.device import CPU, detect, preset
from registry.ops import OPS
from registry.testing import GRAD_TOLERANCE, TOLERANCE, gradient_error, output_error, relative_error
from tuning_db.records import LaunchConfig

from .conftest import HAS_GPU
from .test_nsa_kernel import branches
from .test_ref_nsa import make_case

OP = OPS["nsa"]
DTYPE = torch.bfloat16 if HAS_GPU else torch.float16
TOL = TOLERANCE[DTYPE]
INFO = detect() if HAS_GPU else CPU
DEVICE = "cuda" if HAS_GPU else "cpu"
VARIANTS = {v.vendor: v for v in load_all()["nsa"] if v.name == "nsa_block_centric"}


def _args(spec: dict, seed: int, extremes: bool = False) -> dict:
    """Validated inputs in DTYPE on the test device; `extremes` puts both int32 ends into the ids."""
    spec = dict(spec)
    blocks = spec.pop("blocks", False)
    args = make_case(**spec, blocks=blocks, seed=seed, dtype=DTYPE)
    if extremes:
        ids = args["block_indices"]
        ids[..., -1] = torch.where(ids[..., -1] % 2 == 0, -(2**31), 2**31 - 1)
    return OP.validate(**{n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in args.items()})


def _config(variant, args: dict, overrides: dict | None = None):
    config = variant.default_config(dict(OP.tuning_key(args)), INFO)
    for role, blocks in (overrides or {}).items():
        config = config.replace(role, config[role].model_copy(update={"blocks": LaunchConfig(blocks=blocks).blocks}))
    return config


# name -> (shape, vendors on the CPU, role configs replacing the interpreter's defaults)
CASES = {
    "t1-group4": (dict(b=1, t=1, h_q=16, h_kv=4, d=16, block_size=16, block_count=2, window=4), ("amd",), {}),
    "t17-block16-count-over-blocks": (dict(b=2, t=17, h_q=16, h_kv=4, d=32, block_size=16, block_count=4,
                                           window=5), ("nvidia",), {}),
    "t100-block32-group16-given-ids": (dict(b=1, t=100, h_q=16, h_kv=1, d=16, block_size=32, block_count=3,
                                            window=20, blocks=True), ("nvidia",), {}),
    "t130-block16-second-tiles": (dict(b=1, t=130, h_q=4, h_kv=1, d=16, block_size=16, block_count=3, window=9),
                                  ("amd",), {role: tiles[1] for role, tiles in BLOCK_CENTRIC_TILES.items()}),
}
GPU_CASES = {
    "target-heads-t1536": (dict(b=1, t=1536, h_q=64, h_kv=4, d=128, block_size=64, block_count=16, window=512),
                           (), {}),
    "target-heads-given-ids": (dict(b=1, t=1000, h_q=64, h_kv=4, d=128, block_size=64, block_count=16,
                                    window=512, blocks=True), (), {}),
}
RUNS = [(name, vendor) for name, (_, vendors, _) in CASES.items() for vendor in vendors] if not HAS_GPU else \
    [(name, INFO.vendor) for name in {**CASES, **GPU_CASES}]


@pytest.mark.parametrize("name,vendor", RUNS, ids=[f"{n}-{v}" for n, v in RUNS])
def test_selected_branch_and_out_match_the_reference(name, vendor):
    """o_slc and lse_slc against the branch computed densely with the same ids, out against the op's
    reference, the other parts as the shared kernels leave them."""
    spec, _, overrides = {**CASES, **GPU_CASES}[name]
    args = _args(spec, seed=len(name), extremes="given" in name)
    variant = VARIANTS[vendor]
    parts = nsa_forward_parts(args, _config(variant, args, overrides), variant.selected_branch)
    assert isinstance(parts, NSAForward)
    b, t, h_q, d = args["q"].shape
    assert parts.o_slc.shape == (b, t, h_q, d) and parts.o_slc.dtype == DTYPE
    assert parts.lse_slc.shape == (b, h_q, t) and parts.lse_slc.dtype == torch.float32
    want = branches(args, parts.block_indices)
    for part in ("o_slc", "lse_slc", "o_cmp", "o_swa"):
        err = relative_error(getattr(parts, part), want[part])
        assert err <= TOL, f"{part}: relative error {err:.3g}"
    err = output_error(OP, parts.out, OP.reference(**args), args)
    assert err <= TOL, f"out: error {err:.3g} against the reference"


def test_rows_without_a_valid_id_and_duplicates():
    """A token with no valid id gets o_slc 0 and lse_slc +inf; a duplicate slot counts twice (lse log 2
    above one copy's); both vendors' defaults."""
    args = make_case(1, 12, 4, 1, 16, 4, 3, 2, dtype=DTYPE)
    ids = torch.full((1, 12, 1, 3), -1, dtype=torch.int32)
    ids[0, :4, 0] = torch.tensor([2**31 - 1, -7, 1], dtype=torch.int32)  # nothing valid for queries 0..3
    ids[0, 8:, 0] = torch.tensor([0, 0, 2], dtype=torch.int32)  # block 0 twice
    ids[0, 4:8, 0] = torch.tensor([0, 3, -(2**31)], dtype=torch.int32)  # block 0 once (3 is in the future)
    args = OP.validate(**{n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x
                          for n, x in {**args, "block_indices": ids}.items()})
    want = branches(args, ids.to(DEVICE))
    for variant in VARIANTS.values() if not HAS_GPU else [VARIANTS[INFO.vendor]]:
        parts = nsa_forward_parts(args, _config(variant, args), variant.selected_branch)
        assert torch.all(parts.o_slc[:, :4] == 0) and torch.all(parts.lse_slc[..., :4] == float("inf"))
        assert torch.isfinite(parts.lse_slc[..., 4:]).all()
        assert relative_error(parts.lse_slc, want["lse_slc"]) <= TOL
        assert relative_error(parts.o_slc, want["o_slc"]) <= TOL
        assert relative_error(parts.out, OP.reference(**args)) <= TOL


def test_gradients_through_the_shared_backward():
    """The variant's forward saves o_slc and lse_slc for the group-centric backward kernels: its
    gradients (q, k, v, the three gates) against the fp32 reference's autograd, at group 16 with hostile
    ids (the conformance test runs the tiny presets' selections at group 4)."""
    spec = dict(b=1, t=17, h_q=16, h_kv=1, d=16, block_size=8, block_count=3, window=5, blocks=True)
    args = _args(spec, seed=11, extremes=True)
    variant = VARIANTS[INFO.vendor if HAS_GPU else "nvidia"]
    config = _config(variant, args)
    err = gradient_error(OP, lambda a: variant.launch(a, config), args)
    assert err <= GRAD_TOLERANCE[DTYPE], f"gradients: relative error {err:.3g}"


def test_partials_cost_no_more_than_one_rounding():
    """Partials in q's dtype: the block-centric o_slc is as close to the fp64 branch as the
    group-centric kernel's (which rounds once), within a factor of two, on the same ids and branches."""
    args = _args(dict(b=1, t=40, h_q=16, h_kv=2, d=32, block_size=8, block_count=4, window=5), seed=5)
    variant = VARIANTS[INFO.vendor if HAS_GPU else "nvidia"]
    group_centric = next(v for v in load_all()["nsa"] if v.name == "nsa_group_centric" and v.vendor == variant.vendor)
    key = dict(OP.tuning_key(args))
    config = variant.default_config(key, INFO)
    shared = shared_branches(args, config, True)
    _, ours, _ = block_centric_selected(args, config, shared, True)
    _, theirs, _ = group_centric_selected(args, group_centric.default_config(key, INFO), shared, True)
    want = branches(args, shared.block_indices)["o_slc"]
    ours_err, theirs_err = relative_error(ours, want), relative_error(theirs, want)
    assert ours_err <= 2 * theirs_err, f"o_slc relative error {ours_err:.3g} against {theirs_err:.3g}"


def test_lists_and_worklist_match_a_count():
    """block_entries lists every valid (token, slot) once under its (batch, kv head, block), in token
    then slot order; chunk_worklist cuts each list into chunks of `tokens` entries, covers every entry
    once, orders chunks by (batch, kv head, first token) and pads the bound with n_lists and -1."""
    spec = dict(b=2, t=37, h_q=8, h_kv=2, d=16, block_size=8, block_count=5, window=11)
    ids = make_case(**spec, blocks=True, seed=4)["block_indices"]
    ids[0, 3, 1, 2] = -(2**31)
    b, t, h_kv, count = ids.shape
    bs, n_blocks, tokens = spec["block_size"], -(-spec["t"] // spec["block_size"]), 3
    offsets, positions = block_entries(ids, bs)
    want = {}
    for bi in range(b):
        for hk in range(h_kv):
            for i in range(t):
                for s in range(count):
                    blk = int(ids[bi, i, hk, s])
                    if 0 <= blk <= i // bs:
                        want.setdefault((bi * h_kv + hk) * n_blocks + blk, []).append((i, s))
    n_lists = b * h_kv * n_blocks
    decode = lambda p: (p // (h_kv * count) % t, p % count)  # noqa: E731 - position -> (token, slot)
    for lst in range(n_lists):
        got = [decode(int(p)) for p in positions[offsets[lst]:offsets[lst + 1]]]
        assert got == want.get(lst, []), lst
    assert int(offsets[-1]) == sum(len(x) for x in want.values())

    work_list, chunk_pos, n_work = chunk_worklist(offsets, positions, tokens, t, n_blocks, h_kv * count)
    bound = b * t * h_kv * count // tokens + n_lists
    assert work_list.shape == (bound,) and chunk_pos.shape == (bound, tokens) and chunk_pos.dtype == torch.int32
    n = int(n_work[0])
    assert bool((work_list[n:] == n_lists).all()) and bool((chunk_pos[n:] == -1).all()), "padding past the chunks"
    covered, keys = [], []
    for lst, entries in zip(work_list[:n].tolist(), chunk_pos[:n].tolist(), strict=True):
        listed = [p for p in entries if p >= 0]
        assert listed and entries == listed + [-1] * (tokens - len(listed)), "entries first, -1 after"
        # A chunk is `tokens` consecutive entries of its list, starting at a multiple of `tokens`.
        start = positions[offsets[lst]:offsets[lst + 1]].tolist().index(listed[0])
        assert start % tokens == 0
        assert positions[offsets[lst] + start:offsets[lst] + start + len(listed)].tolist() == listed
        assert len(listed) == min(tokens, int(offsets[lst + 1] - offsets[lst]) - start)
        covered += listed
        keys.append((lst // n_blocks, decode(listed[0])[0]))
    assert sorted(covered) == sorted(positions[: int(offsets[-1])].tolist()), "every entry in exactly one chunk"
    assert keys == sorted(keys), "chunks ordered by (batch, kv head, first token)"


def test_defaults_fit_the_targets_and_name_the_roles():
    """The heuristic defaults at the full presets pass the variant's static pruning on every target;
    the roles are the group-centric variant's with slc replaced by slc_block and slc_combine, and the
    variant sits below it in priority until measured."""
    group_centric = {v.vendor: v for v in load_all()["nsa"] if v.name == "nsa_group_centric"}
    for vendor, variant in VARIANTS.items():
        assert variant.priority < group_centric[vendor].priority
        roles = [r if r != "slc" else None for r in group_centric[vendor].roles]
        assert [r for r in variant.roles if r not in ("slc_block", "slc_combine")] == [r for r in roles if r]
    for shape in OP.presets["full"]:
        args = OP.validate(**OP.make_inputs(shape, device="meta", dtype=torch.bfloat16, seed=0))
        key = dict(OP.tuning_key(args))
        for vendor, target in (("nvidia", "h200"), ("nvidia", "h100"), ("amd", "mi300x"), ("amd", "mi355x")):
            device = preset(target)
            config = VARIANTS[vendor].default_config(key, device)
            for role in config.roles():
                assert VARIANTS[vendor].prune_reason(role, config[role], key, device) is None, (target, role)
            assert config["slc_block"].blocks["BLOCK_N"] <= shape["block_size"]  # no step past the block


def test_nan_reaches_what_it_reaches_in_the_reference():
    """A NaN query element, gate or key reaches exactly the outputs it reaches in the reference (the
    cases tests/test_nan.py runs on the dispatched variant): a NaN partial stays NaN through the merge."""
    from .test_nan import _nan_masks, _nsa_cases

    variant = VARIANTS[INFO.vendor if HAS_GPU else "nvidia"]
    for kw, expect_nan in _nsa_cases():
        args = OP.validate(**kw)
        want = _nan_masks(OP.reference(**args))[0]
        got = _nan_masks(variant.launch(args, _config(variant, args)))[0]
        assert bool(want.any()) == expect_nan
        assert torch.equal(got, want), f"NaN at {int(got.sum())} elements, reference {int(want.sum())}"
