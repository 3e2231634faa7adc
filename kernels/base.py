"""The variant interface every kernel file implements, and the registry variants join by decorator."""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from registry.device import DeviceInfo
from tuning_db.records import LaunchConfig


@dataclass(frozen=True)
class CompileSpec:
    """One Triton kernel to compile offline: the jitted function, its signature and constexprs.

    `signature` maps every non-constexpr argument to Triton's type string ("*fp16", "i32", "fp32");
    `constexprs` maps constexpr argument names to values. `options` are extra compile options.
    `values` gives integer arguments' values at the shape being checked, so that the check can
    specialize them as the JIT does at run time (it changes pipelining and shared memory).
    """

    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    values: dict[str, int] = field(default_factory=dict)


class Variant:
    """One way to run an op on one vendor's GPUs.

    Subclasses set `op`, `vendor`, `name`, `priority` and `source_modules` (the modules whose source
    defines the kernel, default: the variant's own module; their hash marks tuned configs of an older
    kernel as stale), and implement the
    methods below. `key` is the op's tuning key as a dict. A variant never validates user input again
    (the op contract did) and masks every index inside its kernels.
    """

    op: ClassVar[str]
    vendor: ClassVar[str]
    name: ClassVar[str]
    priority: ClassVar[int] = 0
    source_modules: ClassVar[tuple[str, ...]] = ()

    def supports(self, key: dict, device: DeviceInfo) -> bool:
        return True

    def space(self, key: dict, device: DeviceInfo) -> list[LaunchConfig]:
        """Every config a sweep may try for this key on this device (before static pruning)."""
        raise NotImplementedError

    def default_config(self, key: dict, device: DeviceInfo) -> LaunchConfig:
        """The heuristic config used when no tuned entry exists."""
        raise NotImplementedError

    def prune_reason(self, config: LaunchConfig, key: dict, device: DeviceInfo) -> str | None:
        """Why a config cannot run well here without compiling it (None when it may)."""
        return None

    def launch(self, args: dict, config: LaunchConfig) -> Any:
        """Run on validated arguments (the op contract's dict) with this config."""
        raise NotImplementedError

    def bind(self, config: LaunchConfig) -> Callable[[dict], Any]:
        """A callable(args) for the dispatch cache; override to precompute per-config launch state."""
        launch = self.launch
        return lambda args: launch(args, config)

    def compile_specs(self, key: dict, config: LaunchConfig, dtype: str = "fp16") -> list[CompileSpec]:
        """The kernels one call with this key and config launches, for offline compile checks."""
        raise NotImplementedError

    @property
    def source_hash(self) -> str:
        cached = self.__dict__.get("_source_hash")
        if cached is None:
            digest = hashlib.sha256()
            # The kernel's own modules: a vendor file that only holds config data (spaces, defaults)
            # can change without marking the configs tuned for an unchanged kernel as stale.
            for module in self.source_modules or (type(self).__module__,):
                digest.update(code_fingerprint(inspect.getsource(importlib.import_module(module))))
            cached = self.__dict__["_source_hash"] = digest.hexdigest()[:16]
        return cached

    def __repr__(self) -> str:
        return f"<variant {self.name} ({self.vendor})>"


def code_fingerprint(source: str) -> bytes:
    """A module's code without its comments and docstrings (ast drops comments; docstrings are cut
    here): editing documentation does not mark the configs tuned for that code as stale. Written out
    by `_canonical`, not `ast.dump`, so that one source gives one fingerprint on every Python."""
    tree = ast.parse(source)
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


VARIANTS: dict[str, list[Variant]] = {}


def register(cls: type[Variant]) -> type[Variant]:
    """Class decorator: instantiate the variant and list it under its op."""
    variants = VARIANTS.setdefault(cls.op, [])
    if any(v.name == cls.name and v.vendor == cls.vendor for v in variants):
        raise ValueError(f"variant {cls.name!r} ({cls.vendor}) is registered twice for op {cls.op!r}")
    variants.append(cls())
    variants.sort(key=lambda v: -v.priority)
    return cls


def load_all() -> dict[str, list[Variant]]:
    """Import every vendor package so their variants register; returns the registry."""
    importlib.import_module("kernels.nvidia")
    importlib.import_module("kernels.amd")
    return VARIANTS
