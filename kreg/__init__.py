"""kreg: a multi-backend kernel registry with cross-vendor autotuning for sparse and long-context
attention.

    from kreg import registry
    out, max_logits, lse = registry.get("sparse_mla")(q, kv, indices)

Installed, the layers are subpackages of this one (kreg.core, kreg.ops, kreg.kernels, ...). In the
repository they are top-level folders beside this one, so this package reaches them through its
`__path__`; `kreg._checkout` also lets the folders' older names (`import registry`, `python -m
tuning.sweep`) stand for the same module objects. docs/architecture.md shows the layers.
"""

import os as _os

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_ROOT = _os.path.dirname(_HERE)

if not _os.path.isdir(_os.path.join(_HERE, "registry")) and _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")):
    __path__.append(_ROOT)  # a checkout: kreg.registry is <repository>/registry
