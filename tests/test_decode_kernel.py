"""The split-KV decode kernels (both vendors' variants, one body) against the reference: contiguous and
paged caches, empty and partial splits, zero-length sequences beside long ones, shuffled and invalid
block tables, windows that empty whole splits, sinks, speculative tokens, GQA ratios, odd head dims.

On the CPU the kernels run in the Triton interpreter in fp16; on a GPU in bf16. Each case runs the
default call config and the other block shapes of each role, with explicit split counts (the CPU has
too few "SMs" for the heuristic to split much) and with the heuristic's own.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from registry.catalog import load_all
from registry.device import CPU, detect
from registry.ops import OPS
from registry.ops._contract import random_normal
from registry.testing import TOLERANCE, assert_close

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


def _check(args, splits=(None, 3, 7)):
    expected = OP.reference(**args)
    for variant in VARIANTS:
        for config in _configs(variant, args):
            for num_splits in splits:
                got = variant.launch({**args, "num_splits": num_splits}, config)
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
    splits = (1, 2, 4, 64) if case == "one-split-each-way" else (None, 3, 7)
    _check(_inputs(device, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, lens=lens, capacity=capacity,
                   block_size=block_size, window=window, seed=sum(map(ord, case))), splits)


@pytest.mark.parametrize("sink", [30.0, -30.0, math.inf, -math.inf, "mixed"])
def test_sinks_of_any_size(device, sink):
    """The sink enters the combine once; an empty sequence stays 0 whatever the sink."""
    sinks = torch.tensor([30.0, -30.0, 0.5, 4.0]) if sink == "mixed" else sink
    args = _inputs(device, b=2, s_q=2, h_q=4, h_kv=2, d=64, lens=[45, 0], capacity=48, block_size=16,
                   sinks=sinks, seed=3)
    _check(args, splits=(None, 4))
    out, lse = VARIANTS[0].launch(args, VARIANTS[0].default_config(dict(OP.tuning_key(args)), INFO))
    assert torch.all(out[1] == 0) and torch.all(lse[1] == math.inf)


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
    out, lse = VARIANTS[0].launch({**args, "num_splits": 3},
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
    from tuning_db.records import LaunchConfig

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
                got = variant.launch({**args, "num_splits": num_splits}, config)
                assert_close(got, expected, TOL, what=f"{variant.vendor} {config} splits={num_splits}")


def test_split_space_keeps_whole_heads_and_one_warp_per_head_or_more():
    """The split spaces hold KV_HEADS values that divide h_kv, 64..256 (NVIDIA) or 32..128 (AMD) key
    rows a step, and num_warps <= KV_HEADS with several heads; a KV_HEADS above h_kv is cut down."""
    from kernels.common.decode import heads_per_program
    from registry.device import preset

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


def test_split_count_depends_on_shapes_only():
    """num_splits comes from the device and shapes (no cache_seqlens value), is capped by the key tiles
    of the longest range a sequence can need, and a window shrinks that range (plus a tile less one
    key when tiles are aligned to pages)."""
    from kernels.common.decode import MAX_SPLITS, choose_splits, key_range

    one_long = choose_splits(1 * 8, key_range(131072, 1, None), 132, 64, 2)
    assert one_long == 33  # 2 waves of 132 SMs over 8 programs
    assert choose_splits(1, key_range(131072, 1, None), 132, 64, 2) == MAX_SPLITS  # all 8 heads in one: 264 wanted
    assert choose_splits(32 * 8, 8192, 132, 64, 2) == 2
    assert choose_splits(32 * 2, 8192, 132, 64, 2) == 5  # four kv heads per program: a quarter of the programs
    assert choose_splits(128 * 8, 8192, 132, 64, 2) == 1
    assert choose_splits(1, 1 << 20, 132, 16, 4) == MAX_SPLITS
    assert choose_splits(8, key_range(131072, 1, 128), 132, 64, 2) == 2  # a window of 128: two tiles
    assert key_range(131072, 1, 128, align=64) == 128 + 63  # the first tile aligned down to a page's tiles
    assert choose_splits(8, key_range(131072, 1, 128, align=64), 132, 64, 2) == 3
    assert key_range(100, 4, 128, align=64) == 100
    assert choose_splits(8, 40, 132, 64, 2) == 1


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay_follow_new_lengths_and_queries():
    """The serving pattern: resolve once, capture `registry.get("decode")` with a fixed num_splits, then
    replay after writing new tokens and lengths into the captured tensors (no host sync in the call)."""
    import registry

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


# ----------------------------------------------------------------------------- TMA loads (NVIDIA LOADS 2)
# The NVIDIA split space's LOADS block: 2 reads K and V through tensor descriptors the kernel builds
# (the interpreter runs them; a GPU needs sm_90). A spy on the split kernel's launches records the TMA
# constexpr each ran with, so a silent fallback to pointer loads fails these tests.
ON_HOPPER = HAS_GPU and torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
tma_runs = pytest.mark.skipif(HAS_GPU and not ON_HOPPER, reason="TMA needs an NVIDIA GPU of sm_90 or later")


@contextlib.contextmanager
def _split_launches():
    """The TMA flag of every split-kernel launch made inside, in order."""
    from kernels.common import decode

    kernel, seen = decode._decode_split_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append(kwargs["TMA"])
                return kernel[grid](*args, **kwargs)

            return run

    decode._decode_split_kernel = Recorder()
    try:
        yield seen
    finally:
        decode._decode_split_kernel = kernel


def _nvidia():
    return next(v for v in load_all()["decode"] if v.vendor == "nvidia")


def _tma_config(args, block_n: int, kv_heads: int, loads: int = 2, **knobs):
    """NVIDIA's default call config with this split tile and LOADS."""
    from tuning_db.records import LaunchConfig

    default = _nvidia().default_config(dict(OP.tuning_key(args)), INFO)
    return default.replace("split", LaunchConfig(blocks={"BLOCK_N": block_n, "WAVES": 1, "KV_HEADS": kv_heads,
                                                         "LOADS": loads}, **knobs))


def _poisoned(args) -> dict:
    """`args` with every cache row that is not a key of some sequence set to NaN (K) and inf (V): rows
    at or past a sequence's length, spare blocks and block 0, which no table here uses, so a kernel
    that let one of them into a product returns NaN."""
    k, v = args["k_cache"].clone(), args["v_cache"].clone()
    lens = [min(max(n, 0), (args["block_table"].shape[1] * k.shape[1]) if args["block_table"] is not None
                else k.shape[1]) for n in args["cache_seqlens"].tolist()]
    used = torch.zeros(k.shape[:2], dtype=torch.bool, device=k.device)
    table = args["block_table"]
    for i, n in enumerate(lens):
        if table is None:
            used[i, :n] = True
            continue
        pos = torch.arange(n, device=k.device)
        blocks = table[i, pos // k.shape[1]].long()
        valid = (blocks >= 0) & (blocks < k.shape[0])
        used[blocks[valid], (pos % k.shape[1])[valid]] = True
    k[~used], v[~used] = math.inf, math.nan
    return {**args, "k_cache": k, "v_cache": v}


def _without_block_zero(args) -> dict:
    """A paged call's table remapped onto blocks 1.. (block 0 left spare, so the kernel's stand-in
    for an invalid id reads a block no sequence uses), with an invalid id inside sequence 0's blocks
    (masked) and huge ids past sequence 1's (never read)."""
    table = args["block_table"].clone()
    pool = args["k_cache"].shape[0]
    gen = torch.Generator().manual_seed(int(table.sum()))
    table.view(-1).copy_((torch.randperm(pool - 1, generator=gen)[: table.numel()] + 1).to(table))
    table[0, 1] = pool + 3
    used = -(-int(args["cache_seqlens"][1]) // args["k_cache"].shape[1])
    table[1, used:] = 2**31 - 1
    return {**args, "block_table": table}


TMA_CASES = {
    # (b, s_q, h_q, h_kv, d, lens, capacity, block_size, window, block_n, kv_heads)
    "contiguous-len37-0-1-gqa8": (3, 1, 8, 1, 64, [37, 0, 1], 40, None, None, 16, 1),
    "contiguous-2heads-gqa1-d128": (2, 1, 2, 2, 128, [29, 6], 32, None, None, 16, 2),
    "contiguous-spec4-window5-gqa4-2heads": (2, 4, 8, 2, 64, [45, 3], 48, None, 5, 16, 2),
    "contiguous-d80-past-capacity": (2, 2, 4, 2, 80, [1000, 9], 24, None, None, 16, 1),
    "paged16-spec4-gqa8": (2, 4, 8, 1, 64, [45, 20], 64, 16, None, 16, 1),
    "paged32-tile16-window9-2heads": (2, 1, 4, 2, 64, [61, 20], 64, 32, 9, 16, 2),
    "paged16-4heads-d128": (2, 2, 8, 4, 128, [33, 17], 48, 16, None, 16, 4),
}


@tma_runs
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # inf keys, masked
@pytest.mark.parametrize("case", list(TMA_CASES), ids=list(TMA_CASES))
def test_tma_loads_match_reference_and_read_no_unused_row(case, device):
    """LOADS 2 against the reference computed on a clean cache, run on one whose unused rows hold
    NaN and inf: contiguous descriptors end at each sequence's length (TMA zero-fills past it); in a
    paged pool the V rows of masked keys are zeroed, and an invalid block id inside a sequence reads
    no key."""
    b, s_q, h_q, h_kv, d, lens, capacity, block_size, window, block_n, kv_heads = TMA_CASES[case]
    args = _inputs(device, b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, d=d, lens=lens, capacity=capacity,
                   block_size=block_size, window=window, seed=sum(map(ord, case)),
                   sinks=torch.linspace(-2.0, 2.0, h_q))
    if block_size is not None:
        args = _without_block_zero(args)
    expected = OP.reference(**args)
    poisoned = _poisoned(args)
    config = _tma_config(args, block_n, kv_heads)
    for num_splits in (None, 3):
        with _split_launches() as tma:
            got = _nvidia().launch({**poisoned, "num_splits": num_splits}, config)
        assert tma == [True]
        assert_close(got, expected, TOL, what=f"{case} splits={num_splits}")


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a view one element past a 16-byte aligned base."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


def _wide_heads(t: torch.Tensor) -> torch.Tensor:
    """`t [.., h, d]`'s values in a view whose head stride is d + 4 elements (not a 16-byte multiple)."""
    wide = torch.empty((*t.shape[:-1], t.shape[-1] + 4), dtype=t.dtype, device=t.device)
    view = wide[..., : t.shape[-1]]
    view.copy_(t)
    return view


def _spread_pages(t: torch.Tensor) -> torch.Tensor:
    """A paged cache's values in a view whose blocks are twice their size apart (not one run of rows)."""
    wide = torch.empty((t.shape[0], 2 * t.shape[1], *t.shape[2:]), dtype=t.dtype, device=t.device)
    view = wide[:, : t.shape[1]]
    view.copy_(t)
    return view


@tma_runs
def test_tma_loads_fall_back_to_pointers_where_tma_cannot_read(device):
    """A misaligned cache base, a head stride of 68 elements (136 bytes), pages spread apart and pages
    smaller than the tile each run the pointer loads (the interpreter asserts TMA's rules, so a
    descriptor over them would fail) and match the reference."""
    from kernels.common.decode import descriptors_fit

    contiguous = _inputs(device, b=2, s_q=1, h_q=4, h_kv=2, d=64, lens=[30, 7], capacity=32, seed=21)
    paged = _inputs(device, b=2, s_q=1, h_q=4, h_kv=2, d=64, lens=[40, 9], capacity=48, block_size=16, seed=22)
    cases = {
        "misaligned base": ({**contiguous, "k_cache": _shifted(contiguous["k_cache"])}, 16),
        "head stride 68": ({**contiguous, "v_cache": _wide_heads(contiguous["v_cache"])}, 16),
        "pages spread apart": ({**paged, "k_cache": _spread_pages(paged["k_cache"])}, 16),
        "pages smaller than the tile": (paged, 32),
    }
    for name, (args, block_n) in cases.items():
        with _split_launches() as tma:
            got = _nvidia().launch({**args, "num_splits": 2}, _tma_config(args, block_n, 2))
        assert tma == [False], name
        assert_close(got, OP.reference(**args), TOL, what=name)
    index = -1 if device.type == "cpu" else device.index or 0
    assert descriptors_fit(contiguous["k_cache"], contiguous["v_cache"], False, index)
    assert descriptors_fit(paged["k_cache"], paged["v_cache"], True, index)
    assert not descriptors_fit(contiguous["k_cache"], _wide_heads(contiguous["v_cache"]), False, index)
    assert not descriptors_fit(_spread_pages(paged["k_cache"]), paged["v_cache"], True, index)


def test_loads_block_is_nvidias_and_optional():
    """NVIDIA's split space offers LOADS 1 and 2 (the default 1), and 2 only where tiles are whole (a
    contiguous cache, pages >= BLOCK_N); AMD's space has no LOADS; a tuned config without LOADS (the
    shipped tables') completes to LOADS 1 and its plan reads through pointers."""
    from kernels.common.decode import DecodePlan
    from registry.device import preset
    from tuning_db.records import CallConfig, LaunchConfig

    h200 = preset("h200")
    base = {"b": 8, "block_size": None, "d": 64, "dtype": "bf16", "h_kv": 8, "h_q": 64, "n": 32768,
            "paged": False, "s_q": 1, "sinks": True, "window": None}
    nvidia, amd = _nvidia(), next(v for v in load_all()["decode"] if v.vendor == "amd")
    assert nvidia.default_config(base, h200)["split"].blocks["LOADS"] == 1
    assert "LOADS" not in amd.spaces["split"].blocks
    for block_size in (None, 16, 64):
        key = {**base, "paged": block_size is not None, "block_size": block_size}
        configs = nvidia.space(key, h200)["split"]
        tma = [c for c in configs if c.blocks["LOADS"] == 2]
        assert tma and all(block_size is None or c.blocks["BLOCK_N"] <= block_size for c in tma)
        pointers = {c.model_copy(update={"blocks": {**c.blocks, "LOADS": 1}}) for c in tma}
        assert pointers <= set(configs)  # every TMA config has its pointer twin
    stale = CallConfig({"split": LaunchConfig(blocks={"BLOCK_N": 16, "WAVES": 2, "KV_HEADS": 4}, num_warps=4),
                        "combine": nvidia.default_config(base, h200)["combine"]})
    completed = nvidia.complete(stale, base, h200)
    assert completed["split"].blocks["LOADS"] == 1 and not DecodePlan.of(completed).tma
    assert DecodePlan.of(stale).tma is False


def test_tma_configs_compile_for_sm90_without_spills():
    """The TMA twins of the shipped H200 configs at the issue's shapes, and a paged one, compile for sm_90
    with TMA copies, no spills and within shared memory (in a subprocess without the interpreter)."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import json, re
        from registry.catalog import load_all
        from registry.device import preset
        from tuning.compile_check import compile_config
        from tuning_db.records import LaunchConfig

        h200 = preset("h200")
        variant = next(v for v in load_all()["decode"] if v.vendor == "nvidia")
        base = {"b": 8, "block_size": None, "d": 64, "dtype": "bf16", "h_kv": 8, "h_q": 64, "n": 32768,
                "paged": False, "s_q": 1, "sinks": True, "window": None}
        checks = [(base, 16, 4), ({**base, "b": 32, "h_q": 32, "d": 128, "n": 8192}, 128, 1),
                  ({**base, "paged": True, "block_size": 16, "s_q": 4}, 16, 4)]
        for key, block_n, kv_heads in checks:
            split = LaunchConfig(blocks={"BLOCK_N": block_n, "KV_HEADS": kv_heads, "WAVES": 2, "LOADS": 2},
                                 num_warps=4, num_stages=3)
            config = variant.default_config(key, h200).replace("split", split)
            (spec,) = [s for s in variant.compile_specs(key, config, "bf16") if s.role == "split"]
            report = compile_config(spec, split, h200)
            print(json.dumps({"tma": spec.constexprs["TMA"], "fits": report.fits, "spills": report.spills,
                              "registers": report.registers, "shared": report.shared_bytes}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(rows) == 3, proc.stderr[-3000:]
    for row in rows:
        assert row["tma"] and row["fits"] and row["spills"] == 0 and row["registers"] <= 255, row


# (b, h_q, h_kv, d, capacity, block_size, BLOCK_N, KV_HEADS, num_warps, num_stages): the heads and
# head dims at shorter caches, the shipped H200 tiles with their TMA twins.
HOPPER_TMA = {
    "d64-4heads-contiguous": (4, 64, 8, 64, 4096, None, 16, 4, 4, 3),
    "d64-4heads-paged16": (4, 64, 8, 64, 4096, 16, 16, 4, 4, 3),
    "d64-1head-tile128": (2, 64, 8, 64, 8192, None, 128, 1, 4, 3),
    "d128-1head-tile128-paged128": (4, 32, 8, 128, 2048, 128, 128, 1, 4, 3),
}


@pytest.mark.skipif(not ON_HOPPER, reason="TMA needs an NVIDIA GPU of sm_90 or later")
@pytest.mark.parametrize("case", list(HOPPER_TMA), ids=list(HOPPER_TMA))
def test_hopper_tma_loads_bf16(case, device):
    """bf16 on sm_90 with the sweep's tiles: ragged lengths (full, odd, 1, 0), sinks, unused rows of
    NaN and inf; LOADS 2 runs TMA and matches the reference and the pointer loads of the same tile."""
    b, h_q, h_kv, d, capacity, block_size, block_n, kv_heads, warps, stages = HOPPER_TMA[case]
    lens = [capacity, capacity - 777, 1, 0][:b]
    args = _inputs(device, b=b, s_q=1, h_q=h_q, h_kv=h_kv, d=d, lens=lens, capacity=capacity,
                   block_size=block_size, seed=31, sinks=torch.linspace(-2.0, 2.0, h_q))
    if block_size is not None:
        args = _without_block_zero(args)
    expected = OP.reference(**args)
    poisoned = _poisoned(args)
    with _split_launches() as tma:
        got = _nvidia().launch(poisoned, _tma_config(args, block_n, kv_heads, num_warps=warps, num_stages=stages))
        pointers = _nvidia().launch(args, _tma_config(args, block_n, kv_heads, 1, num_warps=warps,
                                                      num_stages=stages))
    assert tma == [True, False]
    assert_close(got, expected, TOL, what=case)
    assert_close(got, pointers, TOL, what=f"{case} against pointer loads")
