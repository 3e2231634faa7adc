"""Every registered variant against its op's PyTorch reference, on the op's tiny presets in every layout
the contract accepts: outputs, and gradients where the op is differentiable. A new variant is covered
by registering it; a new op by giving it tiny presets.

Each variant runs its default call config and, role by role, the other configs of the role's space
(the interpreter's block shapes on the CPU, a sample of the space on a GPU), on fresh random inputs.
On the CPU the variants of both vendors run in the Triton interpreter in fp16; a variant the
interpreter cannot run (a Gluon kernel) runs on a GPU of its vendor only, and compiles offline in CI
(test_shipped_and_default_configs.py).
"""

from __future__ import annotations

import pytest
import torch

from kreg.core.device import CPU, detect
from kreg.core.records import is_backward_role
from kreg.core.space import INTERPRETER_DTYPE
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.testing import GRAD_TOLERANCE, TOLERANCE, gradient_error, output_error

from .conftest import HAS_GPU

VARIANTS = sorted((v for vs in load_all().values() for v in vs), key=lambda v: (v.op, v.name, v.vendor))
CASES = [(v, i) for v in VARIANTS for i in range(len(OPS[v.op].presets["tiny"]))]
DTYPE = torch.bfloat16 if HAS_GPU else INTERPRETER_DTYPE
# Configs per role beyond the default on a GPU, spread over the space (the interpreter tries all of its).
GPU_SAMPLE = 3


def _where(variant) -> tuple[torch.device, object] | None:
    """(torch device, DeviceInfo) where this variant runs here, None when it cannot."""
    if HAS_GPU:
        info = detect()
        return (torch.device("cuda"), info) if info.vendor == variant.vendor else None
    return (torch.device("cpu"), CPU) if variant.runs_in_interpreter else None


def _call_configs(variant, key: dict, info) -> list:
    """The default call config, then each role's other configs in its place (pruned ones left out)."""
    default = variant.default_config(key, info)
    out = [default]
    for role, configs in variant.space(key, info).items():
        configs = [c for c in configs if c != default[role] and variant.prune_reason(role, c, key, info) is None]
        if HAS_GPU:
            configs = configs[:: max(1, len(configs) // GPU_SAMPLE)][:GPU_SAMPLE]
        out += [default.replace(role, c) for c in configs]
    return out


@pytest.mark.parametrize("variant,index", CASES, ids=[f"{v.op}-{v.name}-{v.vendor}-tiny{i}" for v, i in CASES])
def test_variant_matches_reference(variant, index):
    where = _where(variant)
    if where is None:
        pytest.skip(f"{variant.name} ({variant.vendor}) does not run here: "
                    f"{'another vendor' if HAS_GPU else 'the interpreter cannot run it'}")
    device, info = where
    op = OPS[variant.op]
    checked = 0
    for n, layout in enumerate(op.layouts(op.presets["tiny"][index])):
        args = op.validate(**op.make_inputs(layout, device=device, dtype=DTYPE, seed=100 * index + n))
        key = dict(op.tuning_key(args))
        if not variant.supports(key, info):
            continue
        expected = op.reference(**args)
        for config in _call_configs(variant, key, info):
            what = f"{layout} {config}"
            err = output_error(op, variant.call(args, config), expected, args)
            assert err <= TOLERANCE[DTYPE], f"{what}: error {err:.3g} > {TOLERANCE[DTYPE]:.3g}"
            varied = [r for r in variant.roles if config[r] != variant.default_config(key, info)[r]]
            if op.differentiable and (not varied or any(is_backward_role(r) for r in varied)):
                err = gradient_error(op, lambda a, c=config: variant.call(a, c), args)
                assert err <= GRAD_TOLERANCE[DTYPE], f"gradients of {what}: relative error {err:.3g}"
            checked += 1
    if checked == 0:
        pytest.skip(f"{variant.name} supports no layout of tiny preset {index} on {info.key}")


def test_every_variant_is_checked_on_some_tiny_preset():
    """A variant must support at least one of its op's tiny presets where it runs, or the test above
    would check nothing for it."""
    for variant in VARIANTS:
        where = _where(variant)
        if where is None:
            continue
        device, info = where
        op = OPS[variant.op]
        keys = [dict(op.tuning_key(op.validate(**op.make_inputs(layout, device="meta", dtype=DTYPE, seed=0))))
                for shape in op.presets["tiny"] for layout in op.layouts(shape)]
        assert any(variant.supports(key, info) for key in keys), f"{variant.name} ({variant.vendor})"
