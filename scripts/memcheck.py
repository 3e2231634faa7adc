"""Memory safety on the GPU: every registered variant of this GPU's vendor runs its op's tiny presets,
in every layout (packed varlen too), with hostile integer inputs (indices, lengths, offsets, block
tables: both int32 ends, -1, sizes and sizes + 1, all-invalid rows), integer scalar arguments at the
int32 end and at sizes +-1 (windows, split counts, block sizes, k), a NaN, +inf or -inf in each float
input, and views with padded rows or a broadcast dimension, forward and, for differentiable ops,
backward. Run it under
`compute-sanitizer --tool memcheck` (scripts/memcheck.sh): any read or write outside a tensor fails.
Op names as arguments (`scripts/memcheck.sh sparse_mla`) check only those ops.

Calls the contract rejects are skipped (a clear error is the guarantee there); everything else must
run to completion, except a call a variant hands to the PyTorch reference (a key it does not support)
whose reference refuses contents only the host can check (cu_seqlens past the packed rows): counted.
"""

from __future__ import annotations

import sys

import torch

from kreg.core.device import detect
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.testing import (
    HOSTILE_INTEGERS,
    broadcast_view,
    first_output,
    hostile_integers,
    integer_parameters,
    padded_view,
)
from kreg.registry import dispatch

FILLS = (None, None, None, -1, -(2**31), 2**31 - 1)  # three random mixes, then all of one value


def _cases(op, shape: dict):
    """The preset's inputs, then one change at a time: each integer input replaced by each fill, each
    integer scalar at the int32 end and at sizes +-1, each float input with one non-finite element,
    each tensor as a view with padded rows and with a broadcast first dimension."""
    base = op.make_inputs(shape, device="cuda", dtype=torch.bfloat16, seed=0)
    yield "as generated", base
    tensors = {k: v for k, v in base.items() if isinstance(v, torch.Tensor) and v.numel()}
    for name in (k for k, v in tensors.items() if not v.is_floating_point()):
        for i, fill in enumerate(FILLS):
            t = hostile_integers(base[name], torch.Generator().manual_seed(i), fill=fill)
            yield f"{name} {'mixed' if fill is None else fill}", {**base, name: t}
    sizes = sorted({s + d for t in tensors.values() for s in t.shape for d in (-1, 1)} - {-1, 0})
    for name in integer_parameters(op):
        for value in (2**31 - 1, *sizes):
            yield f"{name}={value}", {**base, name: value}
    for name in (k for k, v in tensors.items() if v.is_floating_point()):
        for value in (float("nan"), float("inf"), float("-inf")):
            t = base[name].clone()
            t.view(-1)[t.numel() // 2] = value
            yield f"{name} holds {value}", {**base, name: t}
    for name, t in tensors.items():
        yield f"{name} with padded rows", {**base, name: padded_view(t)}
        yield f"{name} broadcast", {**base, name: broadcast_view(t)}


def _run(op, handle, kwargs: dict) -> None:
    """One call, and for a differentiable op its backward."""
    if not op.differentiable:
        handle(**kwargs)
        return
    leaves = {k: kwargs[k].detach().clone().requires_grad_() for k in op.grad_inputs
              if isinstance(kwargs.get(k), torch.Tensor)}
    out = first_output(handle(**{**kwargs, **leaves}))
    torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out), allow_unused=True)


def main() -> int:
    vendor = detect().vendor
    only = set(sys.argv[1:])
    runs = skipped = refused = 0
    for op_name, variants in sorted(load_all().items()):
        if only and op_name not in only:
            continue
        op = OPS[op_name]
        for variant in (v for v in variants if v.vendor == vendor):
            handle = dispatch.get(op_name, vendor=vendor, variant=variant.name)
            for shape in (layout for preset in op.presets["tiny"] for layout in op.layouts(preset)):
                for label, kwargs in _cases(op, shape):
                    try:
                        op.validate(**kwargs)
                    except (ValueError, TypeError):
                        skipped += 1
                        continue
                    print(f"{variant.name} {shape} {label}", flush=True)  # the last line names a crash
                    try:
                        _run(op, handle, kwargs)
                    except ValueError as err:
                        if handle.choice(**kwargs).variant is not None:
                            raise
                        print(f"  refused by the reference: {err}", flush=True)
                        refused += 1
                        continue
                    torch.cuda.synchronize()
                    runs += 1
    print(f"memcheck inputs: {runs} calls ran, {skipped} rejected by their contracts, {refused} refused by the "
          f"reference they fell back to (integer contents drawn from {len(HOSTILE_INTEGERS)} hostile values)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
