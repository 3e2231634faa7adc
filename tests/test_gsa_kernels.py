"""The GSA kernels (gsa_indexer, gsa_topk, gsa_sparse_attention's head block; both vendors' variants, one
body each; the dense variant in tests/test_gsa_dense.py) against their PyTorch references: odd lengths,
index heads and head dims that are no power of two, strided inputs, k larger than the causal keys,
topk_length of every kind, exact ties, scores that rise with position and scores crowded into a narrow
range (the top-k's worst case: more counting passes), invalid and duplicate indices, empty rows, GQA;
gradients against the reference's autograd.

On the CPU the kernels run in the Triton interpreter in fp16, each distinct block shape once (the
vendors take turns); on a GPU in bf16, with GPU-only checks of what the interpreter cannot show (the
top-k's memory).
"""

from __future__ import annotations

import pytest
import torch

from kreg.core.device import CPU, detect
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.contract import random_normal
from kreg.ops.testing import GRAD_TOLERANCE, TOLERANCE, gradient_error, output_error

from .conftest import HAS_GPU, gpu
from .test_ref_gsa import attention_case

DTYPE = torch.bfloat16 if HAS_GPU else torch.float16
TOL = TOLERANCE[DTYPE]
INFO = detect() if HAS_GPU else CPU


def _variants(op: str) -> list:
    return [v for v in load_all()[op] if not HAS_GPU or v.vendor == INFO.vendor]


def _configs(variant, op, args) -> list:
    """The default call config, then the other configs of its one role (on a GPU, two of them)."""
    key = dict(op.tuning_key(args))
    default = variant.default_config(key, INFO)
    others = [c for c in variant.space(key, INFO)["fwd"]
              if c != default["fwd"] and variant.prune_reason("fwd", c, key, INFO) is None]
    return [default] + [default.replace("fwd", c) for c in others[:: max(1, len(others) // 2)][:2]]


def _runs(op_name: str, args: dict) -> list:
    """(variant, call config) pairs to run. On a GPU: this vendor's variants, each with `_configs`. In
    the interpreter, which ignores launch knobs, both vendors' block shapes are the same: each distinct
    shape runs once, the vendors taking turns, so both variants run and nothing runs twice."""
    op = OPS[op_name]
    pairs = [(v, c) for v in _variants(op_name) for c in _configs(v, op, args)]
    if HAS_GPU:
        return pairs
    variants = _variants(op_name)
    shapes = list(dict.fromkeys(tuple(sorted(c["fwd"].blocks.items())) for _, c in pairs))
    return [next((v, c) for v, c in pairs if v is variants[i % len(variants)]
                 and tuple(sorted(c["fwd"].blocks.items())) == shape) for i, shape in enumerate(shapes)]


def _check(op_name: str, args: dict) -> None:
    op = OPS[op_name]
    args = op.validate(**args)
    expected = op.reference(**args)
    for variant, config in _runs(op_name, args):
        err = output_error(op, variant.call(args, config), expected, args)
        assert err <= TOL, f"{variant.vendor} {config}: error {err:.3g}"


def _index_inputs(device, b, t, h_i, d_i, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "q_idx": random_normal((b, t, h_i, d_i), device=device, dtype=DTYPE, generator=gen),
        "k_idx": random_normal((b, t, d_i), device=device, dtype=DTYPE, generator=gen),
        "w": random_normal((b, t, h_i), device=device, dtype=DTYPE, generator=gen),
        "bias": random_normal((h_i,), device=device, dtype=torch.float32, generator=gen, scale=0.5),
    }


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_GPU else "cpu")


# ----------------------------------------------------------------------------- gsa_indexer
@pytest.mark.parametrize("b, t, h_i, d_i", [(1, 1, 1, 8), (2, 45, 3, 20), (1, 70, 4, 16)],
                         ids=["t1", "odd-heads-dims", "t70"])
def test_indexer_matches_reference(device, b, t, h_i, d_i):
    _check("gsa_indexer", _index_inputs(device, b, t, h_i, d_i))


def test_indexer_strided_inputs_and_future_is_minus_inf(device):
    args = _index_inputs(device, 2, 33, 4, 16, seed=3)
    args["q_idx"] = torch.cat([args["q_idx"], -args["q_idx"]], 2)[:, :, ::2]  # head stride 2 * d_i
    args["k_idx"] = args["k_idx"].transpose(0, 1).contiguous().transpose(0, 1)
    args["w"] = args["w"].float()
    _check("gsa_indexer", args)
    scores = _variants("gsa_indexer")[0].call(OPS["gsa_indexer"].validate(**args), _default("gsa_indexer", args))
    assert torch.equal(scores.isneginf().cpu(), torch.ones(33, 33, dtype=torch.bool).triu(1).expand(2, 33, 33))


def _default(op_name: str, args: dict):
    op = OPS[op_name]
    variant = _variants(op_name)[0]
    return variant.default_config(dict(op.tuning_key(op.validate(**args))), INFO)


# ----------------------------------------------------------------------------- gsa_topk
# The interpreter's 16-key blocks make lists of CAP = 3 max(k', 16) entries, so on these rows brackets
# go through the list select over several steps.
TOPK_CASES = {
    "k_gt_t": dict(b=2, t=21, h_i=4, d_i=16, k=30),
    "k1-one-index-head": dict(b=1, t=40, h_i=1, d_i=8, k=1),
    "odd-heads-dims": dict(b=1, t=80, h_i=3, d_i=20, k=6),
    "lengths": dict(b=2, t=35, h_i=4, d_i=16, k=9, lengths=True),
}


@pytest.mark.parametrize("case", TOPK_CASES.values(), ids=TOPK_CASES.keys())
def test_topk_selects_the_reference_score_sets(device, case):
    case = dict(case)
    lengths, k = case.pop("lengths", False), case.pop("k")
    args = {**_index_inputs(device, **case, seed=case["t"]), "k": k}
    if lengths:
        # Negative, zero, short and past-k lengths alike.
        gen = torch.Generator().manual_seed(5)
        args["topk_length"] = torch.randint(-3, k + 4, (case["b"], case["t"]), generator=gen,
                                            dtype=torch.int32).to(device)
    _check("gsa_topk", args)


def test_topk_exact_ties(device):
    """Every key of a query scores the same: any n of them is right, each picked once, no more than n
    (topk_length below k makes n < k). The brackets narrow to one value and take their first keys."""
    args = {**_index_inputs(device, 1, 60, 4, 16), "k": 10}
    args["k_idx"] = torch.zeros_like(args["k_idx"])
    args["topk_length"] = (torch.arange(60, dtype=torch.int32, device=device) % 13)[None]
    _check("gsa_topk", args)


def test_topk_rising_scores(device):
    """Scores that rise with the key position: the best keys are always the latest ones."""
    args = {**_index_inputs(device, 1, 70, 2, 16), "k": 8}
    args["q_idx"] = torch.ones_like(args["q_idx"])
    positions = torch.arange(70, device=device, dtype=torch.float32) / 35.0
    args["k_idx"] = (positions[:, None] * torch.ones(16, device=device)).to(DTYPE)[None]
    _check("gsa_topk", args)


def test_topk_crowded_scores_and_short_flushes(device, monkeypatch):
    """Scores within a few thousandths of each other (tiny queries): the first bracket's 16 bins hold
    them all, so counting passes repeat before the lists take over; and counters flushed after every
    key block or list tile instead of every 15."""
    import kreg.kernels.common.gsa_topk as topk

    monkeypatch.setattr(topk, "FLUSH_STEPS", 1)
    args = {**_index_inputs(device, 1, 75, 2, 16, seed=7), "k": 5}
    args["q_idx"] = args["q_idx"] * 1e-3
    _check("gsa_topk", args)


@gpu
def test_topk_never_allocates_the_score_matrix():
    """The fused top-k's peak memory at t 8192 stays far below the [b, t, t] fp32 scores (256 MiB)."""
    op = OPS["gsa_topk"]
    args = op.validate(**op.make_inputs({"b": 1, "t": 8192, "h_i": 4, "d_i": 64, "k": 512}, device="cuda",
                                        dtype=DTYPE, seed=0))
    variant = _variants("gsa_topk")[0]
    config = variant.default_config(dict(op.tuning_key(args)), INFO)
    variant.call(args, config)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    variant.call(args, config)
    torch.cuda.synchronize()
    # 16 MB of output and the programs' lists, whose size follows the SM count and k, not t (at the
    # default 264 programs x 16 queries x 2048 entries x 8 B, 69 MB on an H200); the scores would be
    # 256 MiB.
    assert torch.cuda.max_memory_allocated() - before < 8192 * 8192 * 4 // 2


# ----------------------------------------------------------------------------- gsa_sparse_attention
HEADBLOCK = "gsa_sparse_attention_headblock"


def _attention_runs(args: dict, name: str = HEADBLOCK) -> list:
    """(variant, call config) pairs of the variant `name` for the forward and backward: on a GPU, its
    default and two more configs of every role; in the interpreter the default on one vendor and every
    role's other block shape, where it has one, on the other (knobs are ignored there, both vendors
    share the shapes). tests/test_gsa_dense.py runs the dense variant through these."""
    op = OPS["gsa_sparse_attention"]
    key = dict(op.tuning_key(op.validate(**args)))
    runs = []
    for n, variant in enumerate(v for v in _variants("gsa_sparse_attention") if v.name == name):
        default = variant.default_config(key, INFO)
        others = {role: [c for c in configs if c != default[role]
                         and variant.prune_reason(role, c, key, INFO) is None]
                  for role, configs in variant.space(key, INFO).items()}
        if HAS_GPU:
            runs.append((variant, default))
            for i in (1, 2):
                config = default
                for role, configs in others.items():
                    config = config.replace(role, configs[i * len(configs) // 3]) if configs else config
                runs.append((variant, config))
        elif n == 0:
            runs.append((variant, default))
        else:
            config = default
            for role, configs in others.items():
                config = config.replace(role, configs[0]) if configs else config
            runs.append((variant, config))
    return runs


def _check_attention(args: dict, name: str = HEADBLOCK) -> None:
    op = OPS["gsa_sparse_attention"]
    args = op.validate(**args)
    expected = op.reference(**args)
    for variant, config in _attention_runs(args, name):
        call = lambda a, c=config, v=variant: v.call(a, c)  # noqa: E731
        err = output_error(op, call(args), expected, args)
        assert err <= TOL, f"{variant.vendor} {config}: error {err:.3g}"
        grad_err = gradient_error(op, call, args)
        assert grad_err <= GRAD_TOLERANCE[DTYPE], f"{variant.vendor} {config}: gradient error {grad_err:.3g}"


def _on(device, args: dict) -> dict:
    return {n: x.to(device=device, dtype=DTYPE if x.is_floating_point() else x.dtype) for n, x in args.items()}


# Each case holds every kind of invalid index (-1, -7, t, 2**31 - 1), duplicate slots and one query
# whose slots are all invalid (tests.test_ref_gsa.attention_case).
ATTENTION_CASES = {
    "gqa4-lengths": dict(b=2, t=7, h_q=8, h_kv=2, d=16, topk=6, lengths=True),
    "gqa16-two-head-blocks": dict(b=1, t=6, h_q=16, h_kv=1, d=8, topk=5),
    "mha-odd-heads-dims-topk-gt-t": dict(b=1, t=7, h_q=3, h_kv=3, d=24, topk=9, lengths=True),
}


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_sparse_attention_and_gradients(device, case):
    args = _on(device, attention_case(**case, seed=case["t"]))
    _check_attention(args)


def test_sparse_attention_strided_inputs(device):
    args = _on(device, attention_case(2, 6, 4, 2, 16, 5, lengths=True, seed=9))
    args["q"] = torch.stack([args["q"], -args["q"]], 3)[..., 0, :]
    args["v"] = args["v"].transpose(1, 2).contiguous().transpose(1, 2)
    args["indices"] = torch.cat([args["indices"]] * 2, -1)[..., :5]
    assert not (args["q"].is_contiguous() or args["v"].is_contiguous() or args["indices"].is_contiguous())
    _check_attention(args)


def test_sparse_attention_empty_rows_give_zero_and_no_gradient(device):
    """No valid slot anywhere: out is 0 and every gradient 0 (never NaN)."""
    args = _on(device, attention_case(1, 5, 4, 2, 16, 3, seed=2))
    args["indices"] = torch.tensor([-1, 5, -7], dtype=torch.int32, device=device).expand(1, 5, 3).contiguous()
    op = OPS["gsa_sparse_attention"]
    for variant, config in _attention_runs(args)[:1]:
        leaves = {n: args[n].clone().requires_grad_() for n in "qkv"}
        out = variant.call(op.validate(**{**args, **leaves}), config)
        assert torch.equal(out, torch.zeros_like(out))
        out.float().sum().backward()
        assert all(torch.equal(x.grad, torch.zeros_like(x)) for x in leaves.values())


def test_sparse_attention_backward_is_deterministic(device):
    """The backward has no atomics: two runs give the same bits."""
    args = _on(device, attention_case(1, 9, 4, 1, 16, 6, seed=4))
    op = OPS["gsa_sparse_attention"]
    variant, config = _attention_runs(args)[0]
    grads = []
    for _ in range(2):
        leaves = {n: args[n].clone().requires_grad_() for n in "qkv"}
        variant.call(op.validate(**{**args, **leaves}), config).float().square().sum().backward()
        grads.append([x.grad for x in leaves.values()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
