"""The interface every variant implements: its kernel roles, their config spaces, support, launch.

A variant file defines a `Variant` subclass and registers it with `ops.catalog.register`.
docs/architecture.md says how a call reaches `launch`; docs/adding-an-op.md walks through a new one.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kreg.core.records import CallConfig, LaunchConfig

if TYPE_CHECKING:
    from kreg.core.device import DeviceInfo
    from kreg.core.space import ConfigSpace


@dataclass(frozen=True, eq=False)
class CallPlan:
    """What dispatch settled for one tuning key: the variant's call config, the key and the device.

    A variant launches with it and never works either out again: `device` gives the SM count a grid is
    sized by and the features a launch may use, `key` what a fallback config is chosen for. Sweeps and
    the offline compile check make plans for devices that are not present (a target, the interpreter)."""

    config: CallConfig
    key: Mapping[str, Any]
    device: DeviceInfo


class Variant:
    """One way to run an op on one vendor's GPUs.

    A call of the op launches one kernel per role ("fwd"; "bwd_dq" and "bwd_dkv" for a backward;
    "split" and "combine" for decode): `kernels` maps each role to its jitted kernel (their code is
    the variant's source hash) and `spaces` each role to its `ConfigSpace` (vendor data). Roles named
    `bwd...` run in the backward. A launch takes a `CallPlan`: one LaunchConfig per role, the tuning
    key and the device.

    Subclasses set `op`, `vendor`, `name`, `priority`, `kernels`, `spaces`, and implement `launch`;
    `supports`, `role_default` and `prune_reason` refine the defaults below. `key` is the op's tuning
    key as a dict. A variant never validates user input again (the op contract did) and masks every
    index inside its kernels; every kernel it launches goes through `kernel[grid](...)` (or a launch
    function that ends there), which is how the offline compile check sees what a call runs.
    """

    op: ClassVar[str]
    vendor: ClassVar[str]
    name: ClassVar[str]
    priority: ClassVar[int] = 0
    kernels: ClassVar[Mapping[str, Any]] = {}
    spaces: ClassVar[Mapping[str, ConfigSpace]] = {}
    # Gluon kernels (and anything else the Triton interpreter cannot run) say False: such a variant is
    # tested on its GPU and compiled offline in CI.
    runs_in_interpreter: ClassVar[bool] = True
    # Arguments a role's sweep trials add to the key's inputs: a role that only some calls launch
    # (sparse_mla's deterministic backward, under deterministic=True) is gated and timed on such calls.
    role_arguments: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    @property
    def roles(self) -> tuple[str, ...]:
        """The kernel roles of one call, in the order a sweep tunes them."""
        return tuple(self.kernels)

    def supports(self, key: dict, device: DeviceInfo) -> bool:
        return True

    def space(self, key: dict, device: DeviceInfo) -> dict[str, list[LaunchConfig]]:
        """Every config a sweep may try for each role, for this key on this device (before pruning)."""
        return {role: self.spaces[role].configs(key, device) for role in self.roles}

    def role_default(self, role: str, key: dict, device: DeviceInfo) -> LaunchConfig:
        """The heuristic config of one role; variants adjust the space's default to the key here."""
        return self.spaces[role].default(device)

    def default_config(self, key: dict, device: DeviceInfo) -> CallConfig:
        """The heuristic call config, used when no tuned entry exists."""
        return CallConfig({role: self.role_default(role, key, device) for role in self.roles})

    def complete(self, config: CallConfig, key: dict, device: DeviceInfo) -> CallConfig:
        """A tuned call config made launchable by this version of the variant: a role it lacks takes the
        default, a role the variant no longer has is dropped, and each role's blocks are made those of
        its space (`ConfigSpace.complete`)."""
        out = {}
        for role in self.roles:
            default = self.role_default(role, key, device)
            out[role] = self.spaces[role].complete(config[role], default) if role in config else default
        return CallConfig(out)

    def prune_reason(self, role: str, config: LaunchConfig, key: dict, device: DeviceInfo) -> str | None:
        """Why a role's config cannot run well here without compiling it (None when it may)."""
        return None

    def launch(self, args: dict, plan: CallPlan) -> Any:
        """Run on validated arguments (the op contract's dict) with the plan's config per role."""
        raise NotImplementedError

    def backward(self, args: dict, plan: CallPlan, outputs: tuple, grad: Any) -> dict | None:
        """Gradients of the first output (cotangent `grad`) by argument name for the op's grad_inputs,
        from validated arguments and the forward's outputs (in `Op.outputs` order), for the op's custom
        op (registry/library.py). None (the default): the variant has no backward kernels and the
        reference's gradients are used, as its eager backward does."""
        return None

    def bind(self, plan: CallPlan) -> Callable[[dict], Any]:
        """A callable(args) for the dispatch cache; override to precompute per-plan launch state."""
        launch = self.launch
        return lambda args: launch(args, plan)

    def bind_cached(self, plan: CallPlan) -> Callable[[dict], Any]:
        """A callable(args) that dispatch keeps for one tuning key and runs for every raw key that
        resolves to it (other shapes in its length buckets, other layouts): `bind`'s, but free to keep
        state across its calls that holds for any such call, such as the compiled kernels of its
        launches (`kernels.common.launch.LaunchCache`). The default is `bind(plan)`."""
        return self.bind(plan)

    def plan(self, args: Mapping[str, Any], config: CallConfig) -> CallPlan:
        """The plan dispatch would make for validated `args` with `config`: the op's tuning key of the
        arguments and the device their first tensor lives on (for tests and tools that hold a config
        but no dispatch)."""
        from kreg.core.device import detect
        from kreg.ops import OPS

        first = next(value for value in args.values() if hasattr(value, "device"))
        return CallPlan(config, dict(OPS[self.op].tuning_key(args)), detect(first.device))

    def call(self, args: Mapping[str, Any], config: CallConfig) -> Any:
        """`launch` with `plan(args, config)`: one call with this config, as dispatch would run it."""
        return self.launch(args, self.plan(args, config))

    @property
    def source_hash(self) -> str:
        """A hash of the code of the kernels this variant launches (and the jitted functions and
        constexpr globals they use), without comments and docstrings: tuned configs of an older kernel
        are stale; editing a space, a default, a launcher or another variant's kernel stales nothing."""
        cached = self.__dict__.get("_source_hash")
        if cached is None:
            digest = hashlib.sha256()
            for part in kernel_fingerprints(self.kernels[role] for role in self.roles):
                digest.update(part)
            cached = self.__dict__["_source_hash"] = digest.hexdigest()[:16]
        return cached

    def __repr__(self) -> str:
        return f"<variant {self.name} ({self.vendor})>"


# ----------------------------------------------------------------------------- source hashes
def code_fingerprint(source: str) -> bytes:
    """Code without its comments and docstrings (ast drops comments; docstrings are cut here), written
    out by `_canonical`, not `ast.dump`, so that one source gives one fingerprint on every Python."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return _canonical(tree).encode()


def _canonical(node) -> str:
    """Node type and fields, leaving out empty ones: new Python versions add fields (3.12's
    `type_params`) that are empty for code that does not use them."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node)
                  if value is not None and value != []]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return f"[{','.join(_canonical(item) for item in node)}]"
    return repr(node)


def _python_function(kernel: Any):
    """The Python function behind a @triton.jit or @gluon.jit kernel (compiled or interpreted), else None."""
    from triton.runtime.jit import KernelInterface

    return kernel.fn if isinstance(kernel, KernelInterface) and callable(getattr(kernel, "fn", None)) else None


def _referenced(fn, tree: ast.AST) -> Iterable[tuple[str, Any]]:
    """(name, object) of every global `fn` reads by a plain name or a dotted name (`module.helper`)."""
    for node in ast.walk(tree):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in fn.__globals__:
            continue
        value, name = fn.__globals__[node.id], node.id
        for attr in reversed(parts):
            if not inspect.ismodule(value) or not hasattr(value, attr):
                break
            value, name = getattr(value, attr), f"{name}.{attr}"
        yield name, value


def kernel_fingerprints(kernels: Iterable[Any]) -> list[bytes]:
    """The code fingerprints of `kernels` and of every jitted function they reach, plus the values of
    the constexpr globals they read, in a fixed order."""
    import triton.language as tl

    out: list[bytes] = []
    seen: set[int] = set()
    queue = list(kernels)
    while queue:
        fn = _python_function(queue.pop(0))
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        out.append(code_fingerprint(inspect.getsource(fn)))
        for name, value in _referenced(fn, tree):
            if _python_function(value) is not None:
                queue.append(value)
            elif isinstance(value, tl.constexpr):
                out.append(f"{name}={value.value!r}".encode())
    return out
