"""Op contracts: one module per logical op, each defining `OP` (its validation, PyTorch reference,
tuning key, cost model and presets), found here by walking this package; `OPS` maps each op's name to
its `Op`, in name order. Beside them: what every contract declares (`contract`), the interface kernel
variants implement (`variant`), the catalog they register in (`catalog`) and how close to the
reference a kernel must come (`testing`)."""

import importlib
import pkgutil

from kreg.ops.contract import Op


def _discover() -> dict[str, Op]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        op = getattr(importlib.import_module(f"{__name__}.{info.name}"), "OP", None)
        if isinstance(op, Op):
            found.append(op)
    return {op.name: op for op in sorted(found, key=lambda op: op.name)}


OPS: dict[str, Op] = _discover()
