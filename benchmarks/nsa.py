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
- "nsa fwd, overlapping ids": block_indices from `overlapping_selection` (consecutive tokens of a kv
  head share 50-75% of their blocks, as a trained model's do; the row names the measured share), with
  a note of the bytes the selected branch gathers per token and the rates they imply.
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


def overlapping_selection(b: int, t: int, h_kv: int, block_size: int, block_count: int, keep: float, *,
                          seed: int = 0) -> torch.Tensor:
    """Block ids [b, t, h_kv, block_count] (int32, on the CPU) as a trained NSA model's selection looks:
    consecutive tokens of a kv head select mostly the same blocks. Slot 0 holds the token's own block
    (the op's selection forces it too); every other slot keeps its block from the previous token with
    probability `keep` and otherwise draws a new one uniformly from the token's candidates 0 .. i //
    block_size. A block drawn at token i is a candidate of every later token, so each id stays causal.
    Two slots holding one block would count it twice (the op keeps duplicates, a trained top-k has
    none): the second is replaced by the most recent candidate block the row lacks, so every token
    with block_count candidates selects block_count distinct blocks, as the op's own selection does;
    a shorter prefix has -1 in its spare slots. Rows are sorted, -1 last. `shared_fraction` measures
    the share consecutive tokens have in common: at keep 0.5 and the target's blocks (64 tokens, 16
    selected) 0.68 at t 8192 and 0.56 at t 65536 (chance redraws of a held block add more at fewer blocks)."""
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep: expected a probability in [0, 1], got {keep}")
    gen = torch.Generator().manual_seed(seed)
    own = torch.arange(t) // block_size  # [t]
    shape = (b, h_kv, block_count - 1, t)
    # A slot's block changes at token i with probability 1 - keep (always at token 0); each token holds
    # the block drawn at its slot's last change, found as the running max of the change positions.
    changes = torch.rand(shape, generator=gen) >= keep
    changes[..., 0] = True
    last = torch.where(changes, torch.arange(t), 0).cummax(-1).values
    drifting = (torch.rand(shape, generator=gen, dtype=torch.float64) * (own + 1)).long().gather(-1, last)
    ids = torch.cat([own.expand(b, h_kv, 1, t), drifting], dim=2).permute(0, 3, 1, 2)  # [b, t, h_kv, count]
    filler = t // block_size + 1  # sorts after every real id
    ids, _ = ids.sort(-1)
    repeated = torch.zeros_like(ids, dtype=torch.bool)
    repeated[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.where(repeated, filler, ids)
    # Fill each dropped slot with the latest blocks before the token's own that the row lacks: the
    # 2 * block_count most recent candidates always hold enough (at most block_count - 1 are taken).
    recent = own[None, :, None, None] - torch.arange(2 * block_count)  # [1, t, 1, 2 * count]
    missing = repeated.sum(-1, keepdim=True)
    free = (recent >= 0) & ~(recent[..., :, None] == ids[..., None, :]).any(-1)
    chosen = free & (free.cumsum(-1) <= missing)
    ids, _ = torch.cat([ids, torch.where(chosen, recent, filler).expand(*ids.shape[:-1], -1)], -1).sort(-1)
    ids = ids[..., :block_count]
    return torch.where(ids == filler, -1, ids).to(torch.int32).contiguous()


def shared_fraction(ids: torch.Tensor) -> float:
    """Of the valid ids of token i + 1 (every token but the first, every batch entry and kv head), the
    share token i also selects: the overlap `overlapping_selection` aims at. Rows hold no duplicates."""
    prev, cur = ids[:, :-1].long(), ids[:, 1:].long()
    # Chunks of tokens bound the [tokens, count, count] comparison's memory at t 65536; -1 never
    # matches, since a row's valid ids are compared only where the current id is valid.
    hits = sum(int(((c[..., :, None] == p[..., None, :]).any(-1) & (c >= 0)).sum())
               for c, p in zip(cur.split(4096, dim=1), prev.split(4096, dim=1), strict=True))
    return hits / max(int((cur >= 0).sum()), 1)


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
    ids, count = given["block_indices"], args["block_count"]
    valid = int((ids >= 0).sum())
    _NOTES.append(f"nsa {name}: the selected branch gathers {_gathered_bytes(ids, args) / 1e9:.1f} GB of K and V "
                  f"({valid / ids.numel():.0%} of {count} full blocks per token and kv head)")


def _gathered_bytes(ids: torch.Tensor, args: dict) -> int:
    """Bytes of K and V the selected branch reads for these block ids: every valid id's block_size rows
    of both (each (token, kv head) reads its own blocks)."""
    k = args["k"]
    return int((ids >= 0).sum()) * args["block_size"] * 2 * k.shape[-1] * k.element_size()


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


# Consecutive tokens keep each selected block with this probability (`overlapping_selection`).
KEEP = 0.5


def _overlapping_row(shape: dict, args: dict, small: dict, call) -> Measurement:
    """The row "nsa fwd, overlapping ids": the forward with `overlapping_selection` as block_indices
    (checked on the reduced shape with its own such selection), and a note of what the selected branch
    reads."""
    b, t, h_kv, bs, count = (shape[n] for n in ("b", "t", "h_kv", "block_size", "block_count"))
    ids = overlapping_selection(b, t, h_kv, bs, count, KEEP, seed=2)
    shared = shared_fraction(ids)
    small_ids = overlapping_selection(b, small["q"].shape[1], h_kv, bs, count, KEEP, seed=3)
    err = checked(OP, OP.validate(**{**small, "block_indices": small_ids.to(small["q"].device)}), call)
    given = OP.validate(**{**args, "block_indices": ids.to(args["q"].device)})
    name = f"{_name(shape)} overlapping ids ({shared:.0%} shared)"
    row = measure("nsa fwd, overlapping ids", name, PROVIDER, lambda: call(given), OP.flops(given), "TFLOP/s", err)
    gathered, unique = _gathered_bytes(ids, args), 2 * args["k"].numel() * args["k"].element_size()
    _NOTES.append(f"nsa {name}: the selected branch gathers {gathered / (b * t) / 1e6:.2f} MB of K and V per "
                  f"token ({gathered / 1e9:.1f} GB; {gathered / row.median_ms / 1e9:.1f} TB/s over the whole "
                  f"call's {row.median_ms:.3f} ms, served mostly from L2) out of {unique / 1e9:.2f} GB of K "
                  f"and V ({unique / row.median_ms / 1e9:.2f} TB/s if each byte came from HBM once)")
    return row


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
            out.append(_overlapping_row(shape, args, small, call))
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
