"""Times the tiled sink_attention forward at the gpt-oss window shapes (b1 h64/8 d64, window 128, s 8192
and 32768) on one NVIDIA H100/H200, config by config, beside FlexAttention with the sink rescale
(benchmarks.attention's peer) in the same process: the window's key blocks in one loop (KEY_LOOPS 1)
against no loop (KEY_LOOPS 2: the window's halves and its diagonal as three products). Each config is
checked against the reference on the op's reduced shape first (benchmarks.common.explore); tables are
not involved.

    PYTHONPATH=. python scripts/attn_window_probe.py            # both shapes, the default list
    PYTHONPATH=. python scripts/attn_window_probe.py --shape 1 --all

`--all` times every one-loop config at 4 warps and 64 rows and every no-loop config instead,
`--configs` a JSON list of [BLOCK_M, BLOCK_N, HEADS, KEY_LOOPS, num_warps, num_stages].
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks.attention import SINK, _bhsd, _flex_with_sinks, _peer_error, _shape_name
from benchmarks.common import explore, measure
from registry.device import detect
from tuning.bench import rotating


def _fwd(block_n: int, heads: int, loops: int, stages: int, block_m: int = 64, warps: int = 4) -> dict:
    return {"blocks": {"BLOCK_M": block_m, "BLOCK_N": block_n, "HEADS": heads, "KEY_LOOPS": loops},
            "num_warps": warps, "num_stages": stages}


# The session-14 H200 entries (one loop of 32-key blocks, 3 stages; s 8192 HEADS 8, s 32768 HEADS 4),
# then no loop with 8 or 16 tokens a block (4 warps) and 16 tokens over two warpgroups.
NO_LOOP = [_fwd(32, 8, 2, 2), _fwd(32, 4, 2, 2), _fwd(32, 8, 2, 2, block_m=128, warps=8)]
DEFAULT = [_fwd(32, 8, 1, 3), _fwd(32, 4, 1, 3), *NO_LOOP]


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/attn_window_probe.py")
    parser.add_argument("--shape", default="1,2", help="indices of sink_attention's full preset (1, 2: windows)")
    parser.add_argument("--all", action="store_true", help="every one-loop config at 4 warps and 64 rows, and no loop")
    parser.add_argument("--configs", default=None,
                        help="JSON list of [BLOCK_M, BLOCK_N, HEADS, KEY_LOOPS, num_warps, num_stages] instead")
    opts = parser.parse_args()
    configs = DEFAULT
    if opts.all:
        configs = [_fwd(n, h, 1, s) for n, h, s in itertools.product((32, 64, 128), (1, 2, 4, 8), (2, 3, 4))] + NO_LOOP
    if opts.configs:
        configs = [_fwd(n, h, loops, s, block_m=m, warps=w) for m, n, h, loops, w, s in json.loads(opts.configs)]
    print("device:", detect().name, flush=True)
    for index in (int(i) for i in opts.shape.split(",")):
        shape = SINK.presets["full"][index]
        name = _shape_name(shape)
        sets = [SINK.validate(**SINK.make_inputs(shape, device="cuda", dtype=torch.bfloat16, seed=i)) for i in range(2)]
        flops = SINK.flops(sets[0])
        flex = _flex_with_sinks(shape, sets[0]["q"].device)
        peer_args = [(*_bhsd(a), a["sinks"]) for a in sets]
        err = _peer_error(flex(*peer_args[0]), SINK, sets[0])
        peer = measure("sink_attention fwd", name, "flex+sink-rescale",
                       rotating(lambda t, f=flex: f(*t), peer_args), flops, "TFLOP/s", err)
        print(f"{name:40} {'flex+sink-rescale':90} {peer.median_ms:8.4f} ms  rel err {err:.1e}", flush=True)
        del sets, peer_args
        torch.cuda.empty_cache()
        for m in explore(SINK, shape, {"fwd": configs}, name=name, unit="TFLOP/s", variant_name="sink_attention_flash"):
            print(f"{name:40} {m.provider:90} {m.median_ms:8.4f} ms  {peer.median_ms / m.median_ms:5.2f}x Flex  "
                  f"rel err {m.rel_err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
