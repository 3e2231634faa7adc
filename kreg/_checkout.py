"""Older spellings of kreg's modules in a checkout: `import registry` and `python -m tuning.sweep` give
the same module objects as `kreg.registry` and `kreg.tuning.sweep` (one variant catalog, one dispatch
cache, one set of `kreg::` custom ops, however a module was first named).

Each top-level package of the repository calls `alias(__name__)` first. Imported as `kreg.<name>`
(always, when kreg is installed) that does nothing. Imported under its bare name, which only happens
with the repository root on `sys.path`, it puts the `kreg.` module in `sys.modules` under the bare
name, which the import statement then returns, and installs a finder that answers that package's
submodules (`registry.dispatch`) the same way. The rest of the package's `__init__` still runs once
under the bare name, into a module nobody keeps, so those files hold no side effects of their own.
A bare name is never claimed for a package that was not first imported from the checkout, nor for one
that another installed package provides: with the repository root first on `sys.path`, `import
kernels` finds the kernels/ folder before Hugging Face's `kernels` (which transformers imports), so
there the bare name is given to the installed package, and kreg's own stays `kreg.kernels`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

PREFIX = "kreg."
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def alias(name: str) -> None:
    """Make the bare package `name` the module `kreg.<name>` (a no-op for `kreg.` names), or the package
    of that name installed outside the repository when there is one."""
    if name.startswith(PREFIX) or name == "kreg":
        return
    installed = _installed_elsewhere(name)
    if installed is not None:
        sys.modules[name] = installed
        return
    sys.modules[name] = importlib.import_module(PREFIX + name)
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def _installed_elsewhere(name: str):
    """The top-level package `name` found on `sys.path` outside the repository root, imported; or None."""
    others = [path for path in sys.path if os.path.abspath(path or os.curdir) != _ROOT]
    spec = importlib.machinery.PathFinder.find_spec(name, others)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its own submodules import it while it runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds `<name>.<sub>` as `kreg.<name>.<sub>` for packages `alias` made."""

    def find_spec(self, fullname, path=None, target=None):
        top, dot, _ = fullname.partition(".")
        if not dot or sys.modules.get(top) is None or sys.modules.get(top) is not sys.modules.get(PREFIX + top):
            return None
        real = importlib.util.find_spec(PREFIX + fullname)
        if real is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real), origin=real.origin,
                                               is_package=real.submodule_search_locations is not None)


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as the `kreg.` module itself; runpy (`python -m tuning.sweep`) gets its code."""

    def __init__(self, real) -> None:
        self.real = real

    def create_module(self, spec):
        return importlib.import_module(self.real.name)

    def exec_module(self, module) -> None:
        # The import system set the alias's spec on the shared module: it keeps its own.
        module.__spec__ = self.real

    def get_code(self, fullname):
        return self.real.loader.get_code(self.real.name)
