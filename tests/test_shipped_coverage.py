"""What a user of an H200 or H100 gets: every full preset shape of every op with NVIDIA variants, in
every layout its contract accepts (batched and not, padded and packed), resolves to a shipped tuned
entry for that exact key, never to the nearest key or a default. The calls go through the contract's
validation, the op's tuning key and dispatch's resolution, as `registry.get(op)(...)` does after it
has read the tensors' device; the tensors are on the meta device (the full shapes do not fit here),
and the user's database is empty (conftest)."""

from __future__ import annotations

import pytest
import torch

from kreg.core.device import preset
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.registry import dispatch

OPS_WITH_NVIDIA = [name for name in OPS if any(v.vendor == "nvidia" for v in load_all().get(name, []))]


@pytest.fixture(autouse=True)
def _fresh():
    dispatch.clear_caches()
    yield
    dispatch.clear_caches()


@pytest.mark.parametrize("device_name", ["h200", "h100"])
@pytest.mark.parametrize("op_name", OPS_WITH_NVIDIA)
def test_every_preset_shape_in_every_layout_resolves_to_a_shipped_entry(op_name, device_name):
    op, device = OPS[op_name], preset(device_name)
    resolved = []
    for shape in op.presets["full"]:
        for layout in op.layouts(shape):
            args = op.validate(**op.make_inputs(layout, device="meta", dtype=torch.bfloat16, seed=0))
            choice = dispatch.resolve(op, "nvidia", None, op.tuning_key(args), device, args)
            resolved.append((layout, choice.source, choice.variant.name if choice.variant else None))
    missing = [(layout, source) for layout, source, _ in resolved if source != "tables"]
    assert not missing, f"{len(missing)} of {len(resolved)} calls not tuned: {missing[:4]}"
    # Every layout of every shape was resolved (GSA's ops accept one layout; sparse_mla and the dense
    # attentions two or more).
    assert len(resolved) == sum(len(op.layouts(shape)) for shape in op.presets["full"]) >= len(op.presets["full"])
