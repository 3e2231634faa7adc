"""Memory safety on the GPU: every registered variant of this GPU's vendor runs its op's tiny presets,
in every layout (packed varlen too), with hostile integer inputs (indices, lengths, offsets, block
tables: both int32 ends, -1, sizes and sizes + 1, all-invalid rows), forward and, for differentiable
ops, backward. Run it under
`compute-sanitizer --tool memcheck` (scripts/memcheck.sh): any read or write outside a tensor fails.
Op names as arguments (`scripts/memcheck.sh sparse_mla`) check only those ops.

Calls the contract rejects are skipped (a clear error is the guarantee there); everything else must
run to completion.
"""

from __future__ import annotations

import sys

import torch

from kreg.core.device import detect
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.testing import HOSTILE_INTEGERS, first_output, hostile_integers
from kreg.registry import dispatch

FILLS = (None, None, None, -1, -(2**31), 2**31 - 1)  # three random mixes, then all of one value


def _cases(op, shape: dict):
    """The preset's inputs, then each integer input replaced by each fill (the others kept)."""
    base = op.make_inputs(shape, device="cuda", dtype=torch.bfloat16, seed=0)
    yield "as generated", base
    ints = [k for k, v in base.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()]
    for name in ints:
        for i, fill in enumerate(FILLS):
            t = hostile_integers(base[name], torch.Generator().manual_seed(i), fill=fill)
            yield f"{name} {'mixed' if fill is None else fill}", {**base, name: t}


def main() -> int:
    vendor = detect().vendor
    only = set(sys.argv[1:])
    runs = skipped = 0
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
                    if op.differentiable:
                        leaves = {k: kwargs[k].detach().clone().requires_grad_() for k in op.grad_inputs
                                  if isinstance(kwargs.get(k), torch.Tensor)}
                        out = first_output(handle(**{**kwargs, **leaves}))
                        torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out), allow_unused=True)
                    else:
                        handle(**kwargs)
                    torch.cuda.synchronize()
                    runs += 1
    print(f"memcheck inputs: {runs} calls ran, {skipped} rejected by their contracts "
          f"(integer values drawn from {len(HOSTILE_INTEGERS)} hostile ones)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
