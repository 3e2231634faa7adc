"""What a config's tiles mean for an attention-family call, read by the launchers and the variant logic
alike (and by the vendors' spaces and Gluon variants): the tile sizes without the forward's HEADS and
KEY_LOOPS blocks, the forward's loop form (KEY_LOOPS 3, 1, or 2 for a short causal window and when it
may run), and whether HEADS (query heads of one kv head packed along a program's rows) fits a key.
"""

from __future__ import annotations

from collections.abc import Mapping

from kreg.core.records import LaunchConfig


def tile_blocks(blocks: Mapping[str, int]) -> dict[str, int]:
    """A config's tile sizes: its blocks without the forward's HEADS (query heads per program) and
    KEY_LOOPS (how its key blocks are looped over)."""
    return {name: size for name, size in blocks.items() if name not in ("HEADS", "KEY_LOOPS")}


def key_loops(config: LaunchConfig) -> int:
    """The forward's KEY_LOOPS: 3 (masked edges and an unmasked middle) unless the config says 1 (one
    loop, the score mask applied on its edge blocks only) or 2 (no loop: a short window's two halves
    and its diagonal as three products, see `window_reason`); configs of spaces without the block
    (older tables, other ops' window roles) take 3."""
    return config.blocks.get("KEY_LOOPS", 3)


def window_reason(window: int | None, tokens: int) -> str | None:
    """Why KEY_LOOPS 2 (no loop: a causal window's two halves and its diagonal in three products) cannot
    run a window of `window` keys over blocks of `tokens` tokens (None when it can): the window must be
    a power of two from 32 to 128 (its halves are products of their own; 256 would hold 136 scores a
    thread) and the block's tokens at most 16 (its diagonal is one 16-key product)."""
    if window not in (32, 64, 128):
        return f"KEY_LOOPS=2 needs a window of 32, 64 or 128 keys, got {window}"
    if tokens > 16:
        return f"KEY_LOOPS=2 needs at most 16 tokens per block (BLOCK_M // HEADS), got {tokens}"
    return None


def causal_window(args: Mapping, rows_k: int) -> int | None:
    """The causal window a call's forward runs, capped at its `rows_k` keys (as `_masks` caps it); None
    without a window or without causal masking. What `forward_loops` and the short-window kernels judge."""
    if args["window"] is None or not args["causal"]:
        return None
    return min(args["window"], rows_k)


def forward_loops(config: LaunchConfig, window: int | None, tokens: int) -> tuple[int, int]:
    """(KEY_LOOPS, WINDOW_HALF) the forward runs a config with, for a causal window of `window` keys (None
    without one) over blocks of `tokens` tokens: KEY_LOOPS 2 where `window_reason` allows it (a config
    carried over from another key, or a window capped at the sequence's length, runs as one loop),
    WINDOW_HALF 0 unless it is 2. The launcher and the offline compile specs both ask here."""
    loops = key_loops(config)
    if loops != 2:
        return loops, 0
    if window_reason(window, tokens) is not None:
        return 1, 0
    return 2, window // 2


def one_loop_only_for_windows(config: LaunchConfig, key: Mapping) -> bool:
    """Keep: KEY_LOOPS 1 only for windowed keys, 2 where `window_reason` allows it; without a window the
    middle blocks of a long causal or full row are unmasked, which the three-loop form exploits."""
    loops = key_loops(config)
    if loops == 2:
        # No loop: neither the key tile nor a pipeline's depth plays a part, so one value of each stays.
        tokens = config.blocks["BLOCK_M"] // config.blocks.get("HEADS", 1)
        return window_reason(key.get("window"), tokens) is None and config.blocks["BLOCK_N"] == 32 and \
            config.num_stages <= 2
    return loops == 3 or key.get("window") is not None


def packing_reason(blocks: Mapping[str, int], key: Mapping) -> str | None:
    """Why a forward config's HEADS (query heads of one kv head packed along the rows) cannot run at
    this key (None when it can): it must divide the GQA group and BLOCK_M."""
    if "HEADS" not in blocks:
        return None
    heads, group = blocks["HEADS"], key["h_q"] // key["h_kv"]
    if group % heads or blocks["BLOCK_M"] % heads:
        return f"HEADS={heads} must divide the GQA group {group} and BLOCK_M {blocks['BLOCK_M']}"
    return None


def packed_heads(config: LaunchConfig, group: int) -> int:
    """Query heads per forward program: the config's HEADS block where it divides the GQA group and
    BLOCK_M (a config carried over from another key may not), else 1."""
    heads = config.blocks.get("HEADS", 1)
    return heads if group % heads == 0 and config.blocks["BLOCK_M"] % heads == 0 else 1
