"""gsa_sparse_attention's dense variant (gsa_sparse_attention_dense; both vendors' variants, one body):
its build kernel's bitmap, extra occurrences and key ranges against a count of each query's slots; the
whole forward and the gradients of q, k and v against the reference on non-causal indices with every
kind of invalid index, duplicates (a query whose slots all hold one key, keys selected twice and once),
topk_length 0 and partial, empty queries, lengths that are no multiple of any tile, GQA 1 and 4; its lse
in the head-block forward's format (what the shared backward reads); and which keys it serves.

On the CPU the kernels run in the Triton interpreter in fp16, the vendors taking turns over the block
shapes (tests/test_gsa_kernels.py's runs); on a GPU in bf16, this vendor's variant with several configs
of every role.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kreg.core.device import preset
from kreg.core.records import LaunchConfig
from kreg.kernels.common.gsa_sparse_attention.dense import dense_key_sets, dense_passes
from kreg.kernels.common.gsa_sparse_attention.headblock import headblock_passes
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.registry import dispatch

from .conftest import HAS_GPU
from .test_gsa_kernels import HEADBLOCK, _attention_runs, _check_attention, _on
from .test_ref_gsa import attention_case

DENSE = "gsa_sparse_attention_dense"
OP = OPS["gsa_sparse_attention"]


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_GPU else "cpu")


def _case(b: int, t: int, h_q: int, h_kv: int, d: int, topk: int, seed: int) -> dict:
    """attention_case's inputs (random keys anywhere in [0, t), invalid indices of every kind, slot 1 a
    copy of slot 0, the last query all invalid, random topk_length), plus, in batch row 0: query 2's
    slots all one key; query 3 holding key 5 twice and key 9 once, which query 4 also holds once;
    query 5 with topk_length 0 and query 6 with 3 of its slots."""
    args = attention_case(b, t, h_q, h_kv, d, topk, lengths=True, seed=seed)
    idx, lengths = args["indices"], args["topk_length"]
    idx[0, 2] = 4
    idx[0, 3, :4] = torch.tensor([5, 9, 5, t - 1])
    idx[0, 4, :3] = torch.tensor([9, 0, -1])
    lengths[0, 2:5] = topk
    lengths[0, 5], lengths[0, 6] = 0, 3
    return args


def test_build_marks_every_selected_key_once_and_lists_the_extras(device):
    """Bits, extras, their count and the key range of every query against a Python count of its valid
    slots, with slot tiles shorter and longer than topk (extras found within a tile and across tiles)."""
    t, topk = 37, 24
    args = _on(device, _case(2, t, 2, 2, 16, topk, seed=1))
    indices, lengths = args["indices"].cpu(), args["topk_length"].cpu()
    for block in (8, 32):
        found = dense_key_sets(args["indices"], args["topk_length"], LaunchConfig(blocks={"BLOCK_SLOTS": block}))
        bits, extras, dups, lo, hi = (x.cpu() for x in found)
        assert bits.shape == (2, t, 2)
        for b in range(2):
            for i in range(t):
                slots = indices[b, i, :max(0, min(int(lengths[b, i]), topk))].tolist()
                keys = Counter(j for j in slots if 0 <= j < t)
                words = [int(w) & 0xFFFFFFFF for w in bits[b, i]]
                marked = {j for j in range(64) if words[j // 32] >> (j % 32) & 1}
                assert marked == set(keys), (block, b, i)
                n = int(dups[b, i])
                assert n == sum(keys.values()) - len(keys), (block, b, i)
                assert Counter(extras[b, i, :n].tolist()) == keys - Counter(set(keys)), (block, b, i)
                assert (int(lo[b, i]), int(hi[b, i])) == ((min(keys), max(keys) + 1) if keys else (t, 0))


DENSE_CASES = {
    "mha-t37": dict(b=1, t=37, h_q=2, h_kv=2, d=16, topk=24),
    "gqa4-t21-two-batch-rows": dict(b=2, t=21, h_q=8, h_kv=2, d=32, topk=12),
}


@pytest.mark.parametrize("case", DENSE_CASES.values(), ids=DENSE_CASES.keys())
def test_dense_matches_reference_and_gradients(device, case):
    _check_attention(_on(device, _case(**case, seed=case["t"])), DENSE)


def test_dense_lse_is_the_head_block_lse_and_empty_rows_give_zero(device):
    """The dense forward's lse (log2 units, what the shared backward reads) is the head-block forward's;
    queries with no valid slot (all invalid, topk_length 0 or negative) get out 0 and lse +inf."""
    t, topk = 19, 10
    args = OP.validate(**_on(device, _case(1, t, 4, 1, 16, topk, seed=5)))
    args["topk_length"][0, 7:10] = torch.tensor([0, -3, 0], dtype=torch.int32)
    (_, dense), (_, block) = _attention_runs(args, DENSE)[0], _attention_runs(args)[0]
    call = [args[n] for n in ("q", "k", "v", "indices", "sm_scale", "topk_length")]
    out, lse = dense_passes(*call, dense)
    _, want = headblock_passes(*call, block)
    idx = args["indices"][0]
    valid = (idx >= 0) & (idx < t) & (torch.arange(topk, device=device) < args["topk_length"][0, :, None])
    empty = ~valid.any(-1)
    assert empty[[5, 7, 8, 9, t - 1]].all() and not empty.all()
    assert torch.equal(want[0].isinf(), empty[:, None].expand(t, 4)) and torch.equal(lse.isinf(), want.isinf())
    assert torch.equal(out[0, empty], torch.zeros_like(out[0, empty]))
    assert torch.allclose(lse[0, ~empty], want[0, ~empty], rtol=1e-3, atol=1e-3)


def _key(t: int, topk: int, d: int = 128, dtype: torch.dtype = torch.bfloat16) -> dict:
    shape = {"b": 1, "t": t, "h_q": 16, "h_kv": 16, "d": d, "k": topk}
    return dict(OP.tuning_key(OP.validate(**OP.make_inputs(shape, device="meta", dtype=dtype, seed=0))))


def test_dense_serves_large_k_over_t_first():
    """Half and a quarter of the keys (GSA's layer at T 4096 and 8192) up to a 64th of them, the bucketed
    length deciding; never a bitmap over 1 GiB per batch row, fp32, or d > 256; ahead of the head block
    where it serves the key, behind nothing."""
    h200 = preset("h200")
    dense = next(v for v in load_all()["gsa_sparse_attention"] if v.name == DENSE and v.vendor == "nvidia")
    for t, topk in ((4096, 2048), (8192, 2048), (65536, 1024), (40, 1)):
        assert dense.supports(_key(t, topk), h200), (t, topk)
        assert dispatch.candidates(OP.name, "nvidia", None, _key(t, topk), h200)[0] is dense
    # 3000 <= 64 * 47, but the key's bucket, 4096, is not: the key decides, conservatively.
    for key in (_key(8192, 64), _key(65, 1), _key(3000, 47), _key(131072, 4096), _key(4096, 2048, d=512),
                _key(4096, 2048, dtype=torch.float32)):
        assert not dense.supports(key, h200), key
    assert dispatch.candidates(OP.name, "nvidia", None, _key(8192, 64), h200)[0].name == HEADBLOCK
