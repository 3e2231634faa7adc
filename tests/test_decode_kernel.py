"""The split-KV decode kernels (both vendors' variants, one body) against the reference: contiguous and
paged caches, empty and partial splits, zero-length sequences beside long ones, shuffled and invalid
block tables, windows that empty whole splits, sinks, speculative tokens, GQA ratios, odd head dims.

On the CPU the kernels run in the Triton interpreter in fp16; on a GPU in bf16. Each case runs the
default call config and the other block shapes of each role, with explicit split counts (the CPU has
too few "SMs" for the heuristic to split much) and with the heuristic's own.
"""

from __future__ import annotations

import math

import pytest
import torch

from kreg.core.device import CPU, detect
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.contract import random_normal
from kreg.ops.testing import TOLERANCE, assert_close

from .conftest import HAS_GPU

OP = OPS["decode"]
DTYPE = torch.bfloat16 if HAS_GPU else torch.float16
TOL = TOLERANCE[DTYPE]
INFO = detect() if HAS_GPU else CPU
VARIANTS = [v for v in load_all()["decode"] if not HAS_GPU or v.vendor == INFO.vendor]


def _inputs(device, *, b, s_q, h_q, h_kv, d, lens, capacity, block_size=None, sinks=None, window=None, seed=0,
            shuffle=True):
    """q, a cache holding `capacity` positions per sequence (paged: a shuffled pool with spare blocks),
    cache_seqlens = lens."""
    gen = torch.Generator().manual_seed(seed)
    q = random_normal((b, h_q, d) if s_q == 1 else (b, s_q, h_q, d), device=device, dtype=DTYPE, generator=gen)
    args = {"q": q, "cache_seqlens": torch.tensor(lens, dtype=torch.int32, device=device), "window": window,
            "return_lse": True}
    if block_size is None:
        shape = (b, capacity, h_kv, d)
    else:
        max_blocks = -(-capacity // block_size)
        pool = b * max_blocks + 5
        order = torch.randperm(pool, generator=gen) if shuffle else torch.arange(pool)
        args["block_table"] = order[: b * max_blocks].reshape(b, max_blocks).to(device=device, dtype=torch.int32)
        shape = (pool, block_size, h_kv, d)
    args["k_cache"] = random_normal(shape, device=device, dtype=DTYPE, generator=gen)
    args["v_cache"] = random_normal(shape, device=device, dtype=DTYPE, generator=gen)
    if sinks is not None:
        args["sinks"] = torch.full((h_q,), float(sinks), device=device) if not isinstance(sinks, torch.Tensor) \
            else sinks.to(device)
    return OP.validate(**args)


def _configs(variant, args):
    """The default call config, then each role's other configs in its place (on a GPU, three of each
    role's space, spread over it)."""
    key = dict(OP.tuning_key(args))
    default = variant.default_config(key, INFO)
    out = [default]
    for role, configs in variant.space(key, INFO).items():
        configs = [c for c in configs if c != default[role] and variant.prune_reason(role, c, key, INFO) is None]
        if HAS_GPU:
            configs = configs[:: max(1, len(configs) // 3)][:3]
        out += [default.replace(role, c) for c in configs]
    return out


def _check(args, splits=(None, 1, 7)):
    expected = OP.reference(**args)
    for variant in VARIANTS:
        for config in _configs(variant, args):
            for num_splits in splits:
                got = variant.call({**args, "num_splits": num_splits}, config)
                assert_close(got, expected, TOL, what=f"{variant.vendor} {config} splits={num_splits}")


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_GPU else "cpu")


CASES = {
    # (b, s_q, h_q, h_kv, d, lens, capacity, block_size, window)
    "mha-contiguous": (2, 1, 2, 2, 64, [37, 5], 37, None, None),
    "one-split-each-way": (1, 1, 4, 1, 64, [64], 64, 16, None),
    "gqa4-len0-beside-long": (3, 1, 8, 2, 64, [0, 61, 1], 61, None, None),
    "gqa8-paged16-shuffled": (2, 1, 8, 1, 64, [70, 33], 80, 16, None),
    "gqa16-paged32": (1, 1, 16, 1, 128, [95], 96, 32, None),
    "spec4-gqa4-paged16": (2, 4, 8, 2, 64, [50, 4], 64, 16, None),
    "spec8-window16": (2, 8, 4, 1, 64, [90, 20], 96, None, 16),
    "window1": (2, 1, 4, 4, 64, [40, 17], 40, None, 1),
    "window-empties-splits-paged": (1, 2, 4, 2, 64, [120], 128, 16, 9),
    "d80-odd": (2, 3, 4, 2, 80, [33, 2], 40, None, None),
    "len-below-s_q": (2, 4, 4, 4, 64, [2, 0], 16, 16, None),
    "len-over-capacity-clamped": (2, 1, 4, 2, 64, [1000, -5], 24, None, None),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_decode_matches_reference(case, device):
    b, s_q, h_q, h_kv, d, lens, capacity, block_size, window = CASES[case]
    splits = (1, 2, 4, 64) if case == "one-split-each-way" else (None, 1, 7)
    _check(_inputs(device, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, lens=lens, capacity=capacity,
                   block_size=block_size, window=window, seed=sum(map(ord, case))), splits)


@pytest.mark.parametrize("sink", [30.0, -30.0, math.inf, -math.inf, "mixed"])
def test_sinks_of_any_size(device, sink):
    """The sink enters the combine once; an empty sequence stays 0 whatever the sink."""
    sinks = torch.tensor([30.0, -30.0, 0.5, 4.0]) if sink == "mixed" else sink
    args = _inputs(device, b=2, s_q=2, h_q=4, h_kv=2, d=64, lens=[45, 0], capacity=48, block_size=16,
                   sinks=sinks, seed=3)
    _check(args, splits=(None, 1, 4))
    config = VARIANTS[0].default_config(dict(OP.tuning_key(args)), INFO)
    for splits in (1, 4):
        out, lse = VARIANTS[0].call({**args, "num_splits": splits}, config)
        assert torch.all(out[1] == 0) and torch.all(lse[1] == math.inf)
        # Without the lse (one split: the split kernel stores out alone) the output is the same.
        assert torch.equal(VARIANTS[0].call({**args, "num_splits": splits, "return_lse": False}, config), out)


def test_invalid_block_ids_in_use_are_masked_and_entries_past_the_length_never_read(device):
    """Within a sequence's blocks an id outside [0, num_blocks) masks its keys; past its blocks the
    table may hold anything (huge values, -1) and is never read."""
    args = _inputs(device, b=2, s_q=1, h_q=4, h_kv=1, d=64, lens=[40, 20], capacity=64, block_size=16, seed=5)
    table = args["block_table"].clone()
    num_blocks = args["k_cache"].shape[0]
    table[0, 1] = num_blocks + 7  # inside sequence 0's three blocks: invalid, masked
    table[1, 1] = -(2**31)  # inside sequence 1's two blocks
    table[1, 2:] = 2**31 - 1  # past sequence 1's blocks: never read
    args["block_table"] = table
    _check(args, splits=(1, 5))


def test_a_sequence_with_every_block_invalid_returns_zero_and_infinite_lse(device):
    args = _inputs(device, b=2, s_q=1, h_q=4, h_kv=2, d=64, lens=[32, 10], capacity=32, block_size=16, seed=6)
    table = args["block_table"].clone()
    table[0] = -1
    args["block_table"] = table
    out, lse = VARIANTS[0].call({**args, "num_splits": 3},
                                  VARIANTS[0].default_config(dict(OP.tuning_key(args)), INFO))
    assert torch.all(out[0] == 0) and torch.all(lse[0] == math.inf)
    assert_close((out, lse), OP.reference(**args), TOL)


def test_non_contiguous_inputs(device):
    args = _inputs(device, b=2, s_q=3, h_q=4, h_kv=2, d=64, lens=[30, 11], capacity=32, seed=7)
    q = torch.empty((2, 3, 8, 64), device=device, dtype=DTYPE)[:, :, ::2].copy_(args["q"])  # strided heads
    k = torch.empty((2, 32, 2, 128), device=device, dtype=DTYPE)[..., :64].copy_(args["k_cache"])
    v = torch.empty((2, 32, 2, 128), device=device, dtype=DTYPE)[..., 64:].copy_(args["v_cache"])
    _check(OP.validate(**{**args, "q": q, "k_cache": k, "v_cache": v}), splits=(None, 2))


def _with_split(variant, args, **blocks):
    """The variant's default call config with the split role's blocks replaced."""
    from kreg.core.records import LaunchConfig

    default = variant.default_config(dict(OP.tuning_key(args)), INFO)
    return default.replace("split", LaunchConfig(blocks=blocks, **default["split"].knobs()))


KV_HEADS_CASES = {
    # (b, s_q, h_q, h_kv, d, lens, capacity, block_size, window, block_ns, splits): pages of 16 with
    # tiles of 16 (one table entry per tile) and 32 (one per key), a zero length, a length-1 sequence
    # and an invalid block id in use; tiles aligned to pages under a window; one kv head, and two,
    # with more asked for.
    "h8-paged16-spec2": (3, 2, 16, 8, 64, [45, 0, 1], 64, 16, None, (16, 32), (3,)),
    "h8-paged32-window9": (2, 1, 8, 8, 64, [61, 20], 64, 32, 9, (16, 32), (4,)),
    "h1-contiguous": (2, 1, 4, 1, 64, [33, 7], 40, None, None, (16,), (4,)),
    "h2-contiguous-window5": (2, 3, 4, 2, 64, [29, 3], 32, None, 5, (16,), (3,)),
}


@pytest.mark.parametrize("kv_heads", [2, 4, 8])
@pytest.mark.parametrize("case", list(KV_HEADS_CASES), ids=list(KV_HEADS_CASES))
def test_several_kv_heads_per_program(case, kv_heads, device):
    """KV_HEADS kv heads per split program: each head's rows see only that head's keys; a KV_HEADS
    above h_kv (or not dividing it) runs with the largest power of two dividing h_kv."""
    b, s_q, h_q, h_kv, d, lens, capacity, block_size, window, block_ns, splits = KV_HEADS_CASES[case]
    args = _inputs(device, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, lens=lens, capacity=capacity,
                   block_size=block_size, window=window, seed=kv_heads + sum(map(ord, case)),
                   sinks=torch.linspace(-3.0, 3.0, h_q))
    if block_size is not None:
        table = args["block_table"].clone()
        table[0, 1] = args["k_cache"].shape[0] + 3  # inside sequence 0's blocks: its keys are masked
        args = {**args, "block_table": table}
    expected = OP.reference(**args)
    for variant in VARIANTS:
        for block_n in block_ns:
            config = _with_split(variant, args, BLOCK_N=block_n, WAVES=1, KV_HEADS=kv_heads)
            for num_splits in splits:
                got = variant.call({**args, "num_splits": num_splits}, config)
                assert_close(got, expected, TOL, what=f"{variant.vendor} {config} splits={num_splits}")


def test_split_space_keeps_whole_heads_and_one_warp_per_head_or_more():
    """The split spaces hold KV_HEADS values that divide h_kv, 64..256 (NVIDIA) or 32..128 (AMD) key
    rows a step, and num_warps <= KV_HEADS with several heads; a KV_HEADS above h_kv is cut down."""
    from kreg.core.device import preset
    from kreg.kernels.common.decode import heads_per_program

    assert [heads_per_program(h_kv, 8) for h_kv in (1, 2, 6, 8, 16)] == [1, 2, 2, 8, 8]
    key = dict(OP.tuning_key(OP.validate(**OP.make_inputs(OP.presets["targets"][0], device="meta",
                                                          dtype=torch.bfloat16, seed=0))))
    for variant in load_all()["decode"]:
        target = preset("h200" if variant.vendor == "nvidia" else "mi300x")
        low, high = (64, 256) if variant.vendor == "nvidia" else (32, 128)
        for h_kv in (1, 2, 8):
            configs = variant.space({**key, "h_kv": h_kv, "h_q": 8 * h_kv}, target)["split"]
            heads = {c.blocks["KV_HEADS"] for c in configs}
            assert heads == {k for k in (1, 2, 4, 8) if k <= h_kv}
            for c in configs:
                assert low <= c.blocks["KV_HEADS"] * c.blocks["BLOCK_N"] <= high
                assert c.blocks["KV_HEADS"] == 1 or c.num_warps <= c.blocks["KV_HEADS"]


def test_combine_space_keeps_chunks_that_fit_in_registers():
    """A combine config's chunk of partial outputs, ROWS * CHUNK * d fp32 values, is at most 128 per
    thread of 32-lane warps: wide chunks come with more warps, and at d 128 ROWS 4 x CHUNK 64 never."""
    from kreg.core.device import preset

    key = dict(OP.tuning_key(OP.validate(**OP.make_inputs(OP.presets["targets"][0], device="meta",
                                                          dtype=torch.bfloat16, seed=0))))
    for variant in load_all()["decode"]:
        target = preset("h200" if variant.vendor == "nvidia" else "mi300x")
        for d in (64, 128):
            configs = variant.space({**key, "d": d}, target)["combine"]
            assert configs and all(c.blocks["ROWS"] * c.blocks["CHUNK"] * d <= 4096 * c.num_warps for c in configs)
            assert (1, 64) in {(c.blocks["ROWS"], c.blocks["CHUNK"]) for c in configs}
            assert ((4, 64) in {(c.blocks["ROWS"], c.blocks["CHUNK"]) for c in configs}) == (d == 64)


def test_split_count_depends_on_shapes_only():
    """num_splits comes from the device and shapes (no cache_seqlens value), fills whole waves of SMs
    where it can, is capped by the key tiles of the longest range a sequence can need, and a window
    shrinks that range (plus a tile less one key when tiles are aligned to pages)."""
    from kreg.kernels.common.decode import MAX_SPLITS, choose_splits, key_range

    one_long = choose_splits(1 * 8, key_range(131072, 1, None), 132, 64, 2)
    assert one_long == 33  # 2 waves of 132 SMs over 8 programs
    assert choose_splits(1, key_range(131072, 1, None), 132, 64, 2) == MAX_SPLITS  # all 8 heads in one: 264 wanted
    assert choose_splits(32 * 8, 8192, 132, 64, 2) == 1  # 256 programs fill 2 waves as well as 512 fill 4
    assert choose_splits(32 * 2, 8192, 132, 64, 2) == 4  # 256 programs, not 320: 2.4 waves take 3
    assert choose_splits(8 * 8, 32768, 132, 64, 1) == 2  # 128 programs in one wave, not 192 in two
    assert choose_splits(1 * 8, 131072, 132, 64, 1) == 16
    assert choose_splits(128 * 8, 8192, 132, 64, 2) == 1
    assert choose_splits(1, 1 << 20, 132, 16, 4) == MAX_SPLITS
    assert choose_splits(8, key_range(131072, 1, 128), 132, 64, 2) == 2  # a window of 128: two tiles
    assert key_range(131072, 1, 128, align=64) == 128 + 63  # the first tile aligned down to a page's tiles
    assert choose_splits(8, key_range(131072, 1, 128, align=64), 132, 64, 2) == 3
    assert key_range(100, 4, 128, align=64) == 100
    assert choose_splits(8, 40, 132, 64, 2) == 1


@pytest.mark.parametrize("paged", [False, True])
def test_a_cache_one_key_longer_takes_the_geometry_worked_out_for_its_signature(paged):
    """A signature that differs from a known one in its capacity alone (a growing cache) reuses the
    known geometry with the new capacity: at every capacity over split-count changes, a window capped
    by the capacity, one-split and several-split calls and page sizes, it equals the geometry worked
    out from scratch, and signs its split launch with a key no other geometry has."""
    from kreg.kernels.common.decode import DecodeLaunch, _geometry, _new_signature_geometry

    plan = DecodeLaunch(block_n=32, waves=2, kv_heads=1, rows=1, chunk=8, split_knobs={"num_warps": 4},
                        combine_knobs={"num_warps": 2}, num_sms=6, pdl=True)
    reused, split_keys = 0, set()
    for window in (None, 70):
        for num_splits in (None, 3):
            for n in range(1, 400, 7):
                for page in ((16, 32) if paged else (None,)):
                    if paged:
                        blocks = math.ceil(n / page)
                        k_shape, table = (2 * blocks + 1, page, 2, 64), ((2, blocks), blocks)
                    else:
                        k_shape, table = (2, n, 2, 64), None
                    k_stride = (k_shape[1] * 256 if paged else 400 * 256, 256, 128, 1)  # views of one cache
                    signature = ((2, 4, 64), (256, 64, 1), k_shape, k_stride, k_stride, table, window, num_splits,
                                 True, True)
                    known = len(plan.by_splitting)
                    made, expected = _new_signature_geometry(plan, signature), _geometry(plan, *signature)
                    # Equal but for the launches' signature keys: every geometry signs its split launch
                    # with a key of its own (a new capacity may specialize otherwise).
                    assert made._replace(split_key=0, combine_key=0) == expected._replace(split_key=0, combine_key=0)
                    assert made.split_key not in split_keys, signature
                    split_keys.add(made.split_key)
                    reused += len(plan.by_splitting) == known
    assert reused > 100  # most capacities took a known geometry


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay_follow_new_lengths_and_queries():
    """The serving pattern: resolve once, capture `registry.get("decode")` with a fixed num_splits, then
    replay after writing new tokens and lengths into the captured tensors (no host sync in the call)."""
    from kreg import registry

    device = torch.device("cuda")
    args = _inputs(device, b=3, s_q=1, h_q=8, h_kv=2, d=64, lens=[300, 1, 0], capacity=512, block_size=16,
                   sinks=0.5, seed=11)
    call = {k: args[k] for k in ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "sinks")}
    handle = registry.get("decode")
    handle(**call, num_splits=4)  # resolve and compile before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = handle(**call, num_splits=4)
    torch.cuda.current_stream().wait_stream(stream)
    for lens, seed in (([300, 1, 0], 12), ([512, 77, 5], 13)):
        args["cache_seqlens"].copy_(torch.tensor(lens, dtype=torch.int32))
        args["q"].copy_(random_normal(args["q"].shape, device=device, dtype=DTYPE,
                                      generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, OP.reference(**{**args, "return_lse": False}), TOL, what=f"replay with lengths {lens}")


def test_split_partials_are_taken_again_per_stream_and_thread(device):
    """The split partials' buffers of a bound plan are allocated on its first several-split call and
    taken again by later calls of those shapes on the same stream and thread, which stay right on new
    inputs and leave earlier outputs as they were; a call of other split shapes, or from another thread,
    gets buffers of its own."""
    import threading

    variant = VARIANTS[0]
    # A capacity of several key tiles of any config's BLOCK_N (a GPU default takes 64 or more keys per
    # tile), so that three splits are three splits and not one.
    first = _inputs(device, b=2, s_q=1, h_q=4, h_kv=2, d=64, lens=[500, 9], capacity=512, seed=21)
    second = _inputs(device, b=2, s_q=1, h_q=4, h_kv=2, d=64, lens=[3, 512], capacity=512, seed=22)
    plan = variant.plan(first, variant.default_config(dict(OP.tuning_key(first)), INFO))
    call = variant.bind(plan)
    out_first, _ = call({**first, "num_splits": 3})
    (kept,) = _plan_partials(call)
    out_second, _ = call({**second, "num_splits": 3})
    (again,) = _plan_partials(call)
    assert again[0] is kept[0] and again[1] is kept[1]  # the same buffers, taken again
    assert_close(out_first, OP.reference(**first)[0], TOL, what="the first call's output, after the second")
    assert_close(out_second, OP.reference(**second)[0], TOL, what="the second call, on the first's partials")
    call({**second, "num_splits": 2})
    assert len(_plan_partials(call)) == 1 and _plan_partials(call)[0][0] is not kept[0]
    done = []
    worker = threading.Thread(target=lambda: done.append(call({**first, "num_splits": 2})))
    worker.start()
    worker.join()
    assert len(_plan_partials(call)) == 2
    assert_close(done[0][0], OP.reference(**first)[0], TOL, what="a call from another thread")


def _plan_partials(call) -> list[tuple]:
    """The (o_part, lse_part) pairs a bound decode call's plan keeps."""
    from kreg.kernels.common.decode import DecodeLaunch

    (plan,) = [c.cell_contents for c in call.__closure__ if isinstance(c.cell_contents, DecodeLaunch)]
    return [(o_part, lse_part) for _, o_part, lse_part in plan.partials.values()]
