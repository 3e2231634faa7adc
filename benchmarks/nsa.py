"""nsa (Native Sparse Attention) on a GPU: the forward against torch SDPA dense causal attention on the
same q, k, v, at the target's heads (b 1, h_q 64, h_kv 4, d 128, block 64, 16 blocks, window 512) and t
8192 .. 65536; and `python -m benchmarks.nsa`, config exploration at these shapes.

`run()` (what `python -m benchmarks.run` prints):
- "nsa fwd": `registry.get("nsa")` with the kernels' own selection, and SDPA (flash backend; k and v
  expanded to h_q heads beforehand, not timed), both checked first (ours against the reference on the
  reduced shape, t 2048, in the op's error measure). Our TFLOP/s counts the pairs the three branches
  attend (`Op.flops`); SDPA's counts its dense causal pairs, so compare times (the table's ratio).
- "nsa fwd, ids given": the same shape with the kernels' selection passed in as block_indices: the
  forward without the selection; the difference is what selecting costs.
- notes: each kernel's time in one profiled call (compress, cmp with and without the selection pass,
  the window's attention forward, slc with the gated sum), and the bytes the selected branch gathers.
- "nsa fwd+bwd" against SDPA's forward+backward, only once the op is differentiable and the chosen
  variant has backward kernels (a backward through the reference's autograd holds [t, t] scores per
  head and is not a peer at these lengths; a note says which case held).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kreg import registry
from kreg.benchmarks.common import PROVIDER, Measurement, checked, checked_backward, explore_main, kernel_ms, measure
from kreg.ops import OPS
from kreg.ops.testing import cotangent
from kreg.ops.variant import Variant

FAMILY = "nsa"
OP = OPS["nsa"]
LENGTHS = (8192, 16384, 32768, 65536)
_NOTES: list[str] = []


def _shapes() -> list[dict]:
    """The target's heads and blocks at each of LENGTHS (the full presets hold 8192 and 65536)."""
    base = next(s for s in OP.presets["full"] if s["t"] == 65536)
    return [{**base, "t": t} for t in LENGTHS]


def _name(s: dict) -> str:
    ids = " ids given" if s.get("block_indices") else ""
    return (f"b{s['b']} t{s['t']} h{s['h_q']}/{s['h_kv']} d{s['d']} block {s['block_size']}x{s['block_count']} "
            f"window {s['window']}{ids}")


def _dense_flops(b: int, t: int, h_q: int, d: int) -> float:
    """SDPA's dense causal forward: 4 * b * h_q * pairs * d with t (t + 1) / 2 pairs."""
    return 4.0 * b * h_q * (t * (t + 1) // 2) * d


def _sdpa_inputs(args: dict, requires_grad: bool = False):
    """q, k, v as [b, h, t, d] for SDPA, k and v expanded to the query heads (flash needs equal heads)."""
    group = args["q"].shape[2] // args["k"].shape[2]
    q = args["q"].transpose(1, 2)
    k, v = (args[n].repeat_interleave(group, 2).transpose(1, 2) for n in ("k", "v"))
    if requires_grad:
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    return q, k, v


def _kernel_notes(name: str, args: dict, given: dict) -> None:
    """Per-kernel times of one profiled call, with and without the selection pass."""
    handle = registry.get("nsa")
    choice = handle.choice(**args)
    if choice.variant is None:
        _NOTES.append(f"nsa {name}: no kernel variant chosen (the reference ran)")
        return
    kernels = list(choice.variant.kernels.values())
    _NOTES.append(f"nsa {name} kernels (ms, {choice.source} config): {kernel_ms(lambda: handle(**args), kernels)}")
    _NOTES.append(f"nsa {name} ids given, kernels (ms): {kernel_ms(lambda: handle(**given), kernels)}")
    b, t, _, d = args["q"].shape
    h_kv, bs, count = args["k"].shape[2], args["block_size"], args["block_count"]
    valid = ((given["block_indices"] >= 0).sum().item()) * bs
    _NOTES.append(f"nsa {name}: the selected branch gathers {2 * valid * d * 2 / 1e9:.1f} GB of K and V "
                  f"({valid / (b * t * h_kv * count * bs):.0%} of {count} full blocks per token and kv head)")


def _backward_rows(name: str, shape: dict, args: dict, dtype: torch.dtype) -> list[Measurement]:
    """nsa and SDPA forward+backward, when the op has a backward worth timing (module docstring)."""
    if not OP.differentiable:
        _NOTES.append(f"nsa {name}: no fwd+bwd rows: the op is not differentiable yet")
        return []
    variant = registry.get("nsa").choice(**args).variant
    if variant is None or type(variant).backward is Variant.backward:
        _NOTES.append(f"nsa {name}: no fwd+bwd rows: the backward would run the reference's autograd")
        return []
    handle = registry.get("nsa")
    call = lambda a: handle(**a)  # noqa: E731
    small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
    err = checked_backward(OP, small, call)
    leaves = {n: args[n].detach().clone().requires_grad_() for n in OP.grad_inputs}
    dout = cotangent(args["q"])

    def ours():
        out = handle(**{**args, **leaves})
        return torch.autograd.grad(out, list(leaves.values()), dout)

    q, k, v = _sdpa_inputs(args, requires_grad=True)
    dout_sdpa = dout.transpose(1, 2)

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), dout_sdpa)

    b, t, h_q, d = args["q"].shape
    return [measure("nsa fwd+bwd", name, PROVIDER, ours, 3.5 * OP.flops(args), "TFLOP/s", err),
            measure("nsa fwd+bwd", name, "torch-sdpa dense causal", sdpa, 3.5 * _dense_flops(b, t, h_q, d), "TFLOP/s",
                    None)]


def run(dtype: torch.dtype = torch.bfloat16) -> list[Measurement]:
    """The rows of the module docstring; kernel times and skipped rows go to `notes()`."""
    from kreg.kernels.common.nsa.forward import nsa_forward_parts

    _NOTES.clear()
    handle = registry.get("nsa")
    call = lambda a: handle(**a)  # noqa: E731
    out: list[Measurement] = []
    for shape in _shapes():
        name = _name(shape)
        small = OP.validate(**OP.make_inputs(OP.reduce_shape(shape), device="cuda", dtype=dtype, seed=1))
        err = checked(OP, small, call)
        args = OP.validate(**OP.make_inputs(shape, device="cuda", dtype=dtype, seed=0))
        out.append(measure("nsa fwd", name, PROVIDER, lambda a=args: call(a), OP.flops(args), "TFLOP/s", err))
        choice = handle.choice(**args)
        if choice.variant is not None:
            ids = nsa_forward_parts(args, choice.config).block_indices
            given = OP.validate(**{**args, "block_indices": ids})
            given_err = checked(OP, OP.validate(**{**small, "block_indices": nsa_forward_parts(
                small, handle.choice(**small).config).block_indices}), call)
            out.append(measure("nsa fwd, ids given", name, PROVIDER, lambda a=given: call(a), OP.flops(given),
                               "TFLOP/s", given_err))
            _kernel_notes(name, args, given)
            del ids, given
        q, k, v = _sdpa_inputs(args)
        b, t, h_q, d = args["q"].shape
        sdpa = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        out.append(measure("nsa fwd", name, "torch-sdpa dense causal", sdpa, _dense_flops(b, t, h_q, d), "TFLOP/s",
                           None))
        del q, k, v
        torch.cuda.empty_cache()
        out += _backward_rows(name, shape, args, dtype)
        del args
        torch.cuda.empty_cache()
    return out


def notes() -> list[str]:
    return list(_NOTES)


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.nsa --configs '{"slc": [{"blocks": {"BLOCK_N": 128}, "num_warps": 8,
    "num_stages": 3}]}' [--shape 0,3]`: explore configs (benchmarks.common.explore; each row names
    every kernel's time) at this module's shapes."""
    return explore_main("python -m benchmarks.nsa", OP, _shapes(), _name, "TFLOP/s", argv)


if __name__ == "__main__":
    raise SystemExit(main())
