"""Offline compiles for a target GPU that is not here: registers, spills and shared memory/LDS.

`compile_config` compiles one kernel (a `CompileSpec`) with one config for a `DeviceInfo` target
through `triton.compile`, and reads its resources: AMD from the amdgcn text's metadata, NVIDIA from the
cubin through the `cuobjdump` Triton bundles. Shared memory/LDS is checked against the target's budget
here, because an overflow does not fail the compile (it fails at launch).

TRITON_INTERPRET is read when kernels are decorated, and an interpreted kernel cannot be compiled, so
these checks run in a process without it: tests and CI call

    python -m tuning.compile_check --variant flash_attention_tiled --vendor amd --target mi355x

in a subprocess with TRITON_INTERPRET removed from the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from kreg.core.device import VENDORS, DeviceInfo
from kreg.core.records import CallConfig, LaunchConfig, canonical_json

if TYPE_CHECKING:
    from kreg.ops.variant import CompileSpec, Variant


@dataclass(frozen=True)
class CompileReport:
    """Resources of one compiled kernel for one target and config.

    registers: per thread (NVIDIA) or VGPRs per lane, AGPRs included (AMD); spills: NVIDIA, bytes of
    per-thread stack/local memory (where ptxas spills; these kernels have no local arrays); AMD, VGPR
    spills (SGPR spills go to VGPR lanes and are only listed in `detail`). None when it did not compile.
    fits: compiled, no spills, shared memory/LDS within the target's budget; reason says why not.
    """

    registers: int | None
    spills: int | None
    shared_bytes: int | None
    fits: bool
    reason: str | None
    seconds: float
    kernel: str = ""
    detail: dict[str, int] = field(default_factory=dict)


def _full_signature(spec: CompileSpec) -> dict[str, str]:
    """Every kernel argument in order, constexprs typed "constexpr" as the JIT passes them."""
    signature = {}
    for name in spec.fn.arg_names:
        if name in spec.constexprs:
            signature[name] = "constexpr"
        elif name in spec.signature:
            signature[name] = spec.signature[name]
        else:
            raise ValueError(f"spec: argument {name!r} of {spec.fn.__name__}: expected a type or a constexpr")
    return signature


def _as_jit_specializes(spec: CompileSpec) -> CompileSpec:
    """The JIT's integer specialization at the spec's `values`: an argument equal to 1 becomes a
    constant (multiples of 16 are marked divisible by `_alignment_attrs`)."""
    ones = {name: 1 for name, value in spec.values.items() if value == 1 and name in spec.fn.arg_names}
    return replace(spec, constexprs={**spec.constexprs, **ones}) if ones else spec


def _alignment_attrs(spec: CompileSpec, signature: dict[str, str]) -> dict[tuple[int, ...], list]:
    """What the JIT assumes for typical torch tensors: 16-byte aligned pointers and strides that are
    multiples of 16 elements (hidden sizes are), so loads vectorize as they would at run time; plus
    the integer `values` that are multiples of 16 at the checked shape."""
    divisible = [["tt.divisibility", 16]]
    aligned = [name for name in spec.fn.arg_names if signature[name] != "constexpr" and (
        signature[name].startswith("*") or name.startswith("stride") or spec.values.get(name, 1) % 16 == 0)]
    return {(spec.fn.arg_names.index(name),): divisible for name in aligned}


def _nvidia_resources(cubin: bytes, kernel_name: str) -> dict[str, int]:
    """REG, STACK and LOCAL of the kernel, from `cuobjdump --dump-resource-usage` on the cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    usage = text.split(f"Function {kernel_name}:", 1)[-1]
    found = re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", usage)
    return {name.lower(): int(value) for name, value in found}


def _amd_resources(amdgcn: str) -> dict[str, int]:
    """The register counts of the kernel metadata in the amdgcn text."""
    names = ("vgpr_count", "agpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count")
    return {name: int(m.group(1)) for name in names if (m := re.search(rf"\.{name}:\s+(\d+)", amdgcn))}


def compile_config(spec: CompileSpec, config: LaunchConfig, target: DeviceInfo) -> CompileReport:
    """Compile `spec` with `config`'s knobs (its role's config) for `target` (no GPU needed) and report
    its resources.

    A compile error gives a report with fits False and reason "compile_error: ...". Raises
    RuntimeError when the kernel was decorated under TRITON_INTERPRET (it cannot be compiled then).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(spec.fn, JITFunction):
        raise RuntimeError(
            f"spec: {getattr(spec.fn, '__name__', spec.fn)!r} is not a compilable JIT function (was it "
            "decorated under TRITON_INTERPRET=1?); run `python -m tuning.compile_check` without it")
    name = spec.fn.__name__
    start = time.perf_counter()
    spec = _as_jit_specializes(spec)
    signature = _full_signature(spec)
    # Gluon kernels (JITFunctions that say so) are lowered from their own source type.
    source_type = ASTSource
    if spec.fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    source = source_type(spec.fn, signature, constexprs=dict(spec.constexprs), attrs=_alignment_attrs(spec, signature))
    try:
        kernel = triton.compile(source, target=GPUTarget(*target.target),
                                options={**config.knobs(), **spec.options})
    except Exception as err:  # noqa: BLE001 - any compiler failure is this config's result
        # Triton puts the source excerpt first and the cause last: keep the end.
        message = " ".join(str(err).split())[-500:]
        return CompileReport(None, None, None, False, f"compile_error: {type(err).__name__}: {message}",
                             time.perf_counter() - start, name)
    shared = int(kernel.metadata.shared)
    if target.vendor == "amd":
        detail = _amd_resources(kernel.asm["amdgcn"])
        registers = detail.get("vgpr_count")
        spills = detail.get("vgpr_spill_count", 0)
    else:
        detail = _nvidia_resources(kernel.asm["cubin"], kernel.metadata.name)
        registers = detail.get("reg")
        spills = detail.get("stack", 0) + detail.get("local", 0)
    problems = []
    if spills:
        problems.append(f"spills {spills}")
    if shared > target.shared_mem_bytes:
        problems.append(f"shared memory {shared} B > {target.shared_mem_bytes} B")
    return CompileReport(registers, spills, shared, not problems, "; ".join(problems) or None,
                         time.perf_counter() - start, name, detail)


_reports: dict[tuple, CompileReport] = {}


def unfit(reports: list[CompileReport]) -> tuple[str, str] | None:
    """The trial status and reason of the first kernel that does not fit (`compile_error` or
    `out_of_resources`), None when every kernel fits."""
    bad = [r for r in reports if not r.fits]
    if not bad:
        return None
    status = "compile_error" if (bad[0].reason or "").startswith("compile_error") else "out_of_resources"
    return status, f"{bad[0].kernel}: {bad[0].reason}"


def _memo(spec: CompileSpec, config: LaunchConfig, target: DeviceInfo) -> tuple:
    """What a compile depends on: kernel, signature, constexprs, specialized values, options, target."""
    return (spec.fn.__name__, tuple(spec.signature.items()), tuple(sorted(spec.constexprs.items())),
            tuple(sorted(spec.values.items())), tuple(sorted({**config.knobs(), **spec.options}.items())), target)


def _compile_job(job: tuple) -> CompileReport:
    """A worker process's compile: the kernel named by (module, attribute), rebuilt from its spec."""
    import importlib

    module, name, spec, config, target = job
    return compile_config(replace(spec, fn=getattr(importlib.import_module(module), name)), config, target)


def check_many(variant: Variant, key: dict, configs: list[CallConfig], target: DeviceInfo,
               roles: tuple[str, ...] | None = None, workers: int | None = None) -> None:
    """Compile, in parallel worker processes, what `check_variant` would for each of `configs`, so its
    later calls find the reports (a sweep does this for a role's whole stage: compiling is CPU work
    that one process does one kernel at a time)."""
    import concurrent.futures
    import multiprocessing

    jobs, memos = [], []
    for config in configs:
        for spec in variant.compile_specs(key, config, dtype=key.get("dtype", "fp16")):
            memo = _memo(spec, config[spec.role], target)
            if (roles is None or spec.role in roles) and memo not in _reports and memo not in memos:
                jobs.append((spec.fn.fn.__module__, spec.fn.fn.__name__, replace(spec, fn=None),
                             config[spec.role], target))
                memos.append(memo)
    if len(jobs) < 2:
        return
    workers = min(len(jobs), workers or max(1, (os.cpu_count() or 2) - 1))
    context = multiprocessing.get_context("spawn")
    saved = os.environ.pop("TRITON_INTERPRET", None)  # the workers compile; they must not interpret
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            for memo, report in zip(memos, pool.map(_compile_job, jobs), strict=True):
                _reports[memo] = report
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def check_variant(variant: Variant, key: dict, config: CallConfig, target: DeviceInfo,
                  roles: tuple[str, ...] | None = None) -> list[CompileReport]:
    """Compile every kernel one call of `variant` with this tuning key and call config launches (or
    only those of `roles`), each with its role's config.

    Reports are remembered per process by what the compile depends on (kernel, signature,
    constexprs, options, target), so sweeping many shapes of one head dim, or one role of a call
    config, compiles each kernel's config once."""
    specs = [spec for spec in variant.compile_specs(key, config, dtype=key.get("dtype", "fp16"))
             if roles is None or spec.role in roles]
    reports = []
    for spec in specs:
        role_config = config[spec.role]
        memo = _memo(spec, role_config, target)
        if memo not in _reports:
            _reports[memo] = compile_config(spec, role_config, target)
        reports.append(_reports[memo])
    return reports


# ----------------------------------------------------------------------------- command line
def _find_variant(name: str, vendor: str) -> Variant:
    from kreg.ops.catalog import load_all

    for variants in load_all().values():
        for variant in variants:
            if variant.name == name and variant.vendor == vendor:
                return variant
    known = sorted({f"{v.name} ({v.vendor})" for vs in load_all().values() for v in vs})
    raise ValueError(f"--variant: no variant {name!r} for vendor {vendor!r}; known: {', '.join(known)}")


def _preset_keys(op_name: str) -> list[dict]:
    """The tuning keys of the op's "full" preset shapes, computed from meta tensors (nothing allocated)."""
    import torch

    from kreg.ops import OPS

    op = OPS[op_name]
    keys = []
    for shape in op.presets["full"]:
        args = op.validate(**op.make_inputs(shape, device=torch.device("meta"), dtype=torch.bfloat16, seed=0))
        key = dict(op.tuning_key(args))
        if key not in keys:
            keys.append(key)
    return keys


def shipped_configs(variant: Variant) -> dict[str, list[CallConfig]]:
    """The call configs the shipped tables hold for this variant on its vendor's devices, by tuning key."""
    from kreg.tuning_db.table_files import ShippedTables

    out: dict[str, list[CallConfig]] = {}
    for tuned in ShippedTables().tuned(variant.op):
        if tuned.variant == variant.name and tuned.variant_vendor == variant.vendor:
            out.setdefault(tuned.tuning_key, []).append(tuned.config)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m tuning.compile_check`: one line per (key, target, config), or JSON lines with --json."""
    from kreg.core.device import preset

    parser = argparse.ArgumentParser(prog="python -m tuning.compile_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", required=True, help="variant name, e.g. flash_attention_tiled")
    parser.add_argument("--vendor", required=True, choices=VENDORS)
    parser.add_argument("--target", required=True, help="presets, comma-separated (h200, mi300x, mi355x)")
    parser.add_argument("--key-json", action="append", help="a tuning key as JSON (repeatable); "
                        "default: the keys of the op's full preset shapes")
    parser.add_argument("--config-json", action="append", help="a CallConfig as JSON, by role (repeatable); "
                        "default: the variant's default call config for each key and target")
    parser.add_argument("--space", action="store_true",
                        help="every config of each role's space not pruned (the other roles at their defaults)")
    parser.add_argument("--tables", action="store_true",
                        help="the shipped tuned configs of this variant (tuning_db/tables) instead of defaults")
    parser.add_argument("--roles", default=None, help="comma-separated kernel roles to compile (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    opts = parser.parse_args(argv)

    variant = _find_variant(opts.variant, opts.vendor)
    roles = tuple(opts.roles.split(",")) if opts.roles else None
    if roles is not None and not set(roles) <= set(variant.roles):
        parser.error(f"--roles: {variant.name} has the roles {', '.join(variant.roles)}, got {opts.roles}")
    targets = [preset(name) for name in opts.target.split(",")]
    for target in targets:
        if target.vendor != variant.vendor:
            parser.error(f"--target: expected a target of vendor {variant.vendor}, got {target.key} ({target.vendor})")
    keys = [json.loads(text) for text in opts.key_json] if opts.key_json else _preset_keys(variant.op)
    shipped = shipped_configs(variant) if opts.tables else {}
    if opts.tables:
        if not shipped:
            parser.error(f"--tables: no shipped table holds {variant.name} ({variant.vendor})")
        keys = [json.loads(k) for k in shipped]
    all_fit = True
    for key in keys:
        for target in targets:
            if not variant.supports(key, target):  # dispatch never runs it there (a window, a head dim)
                print(f"{target.key}: {variant.name} does not support {canonical_json(key)}: skipped", file=sys.stderr)
                continue
            default = variant.default_config(key, target)
            if opts.tables:
                configs = [variant.complete(c, key, target) for c in shipped[canonical_json(key)]]
            elif opts.config_json:
                configs = [variant.complete(CallConfig.from_json(text), key, target) for text in opts.config_json]
            elif opts.space:
                configs = [default.replace(role, c) for role, space in variant.space(key, target).items()
                           for c in space if variant.prune_reason(role, c, key, target) is None]
            else:
                configs = [default]
            for config in configs:
                for report in check_variant(variant, key, config, target, roles):
                    all_fit &= report.fits
                    if opts.json:
                        row = {"target": target.key, "arch": target.arch, "key": key,
                               "config": json.loads(config.to_json()), **asdict(report)}
                        print(json.dumps(row), flush=True)
                    else:
                        why = f" ({report.reason})" if report.reason else ""
                        print(f"{target.key} {target.arch} {canonical_json(key)} [{config}] {report.kernel}: "
                              f"regs={report.registers} spills={report.spills} shared={report.shared_bytes} "
                              f"fits={report.fits}{why}", flush=True)
    return 0 if all_fit else 1


if __name__ == "__main__":
    sys.exit(main())
