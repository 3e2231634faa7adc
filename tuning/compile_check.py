"""Offline compiles for a target GPU that is not here: registers, spills and shared memory/LDS.

`check_variant` compiles every kernel one call of a variant launches with a call config for a
`DeviceInfo` target: what the call launches comes from running its launcher on meta tensors
(`tuning.launch_record`), typed as the JIT types it for that target, and `triton.compile` builds it
there. Resources come from the amdgcn text's metadata (AMD) or the cubin through the `cuobjdump`
Triton bundles (NVIDIA). Shared memory/LDS is checked against the target's budget here, because an
overflow does not fail the compile (it fails at launch).

TRITON_INTERPRET is read when kernels are decorated, and an interpreted kernel cannot be recorded or
compiled, so these checks run in a process without it: tests and CI call

    python -m kreg.tuning.compile_check --variant flash_attention_tiled --vendor amd --target mi355x

in a subprocess with TRITON_INTERPRET removed from the environment.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from kreg.core.device import VENDORS, DeviceInfo, preset, usable_cores
from kreg.core.records import CallConfig, canonical_json
from kreg.ops import OPS
from kreg.ops.catalog import load_all
from kreg.ops.variant import Variant
from kreg.tuning.launch_record import CompileJob, distinct, meta_calls, record_calls, specialize


@dataclass(frozen=True)
class CompileReport:
    """Resources of one compiled kernel for one target and config.

    registers: per thread (NVIDIA) or VGPRs per lane, AGPRs included (AMD); spills: NVIDIA, bytes of
    per-thread stack/local memory (where ptxas spills; these kernels have no local arrays); AMD, VGPR
    spills (SGPR spills go to VGPR lanes and are only listed in `detail`). None when it did not compile.
    fits: compiled, no spills, shared memory/LDS within the target's budget; reason says why not.
    roles: the variant roles the kernel belongs to (`launch_record.record_calls`).
    """

    registers: int | None
    spills: int | None
    shared_bytes: int | None
    fits: bool
    reason: str | None
    seconds: float
    kernel: str = ""
    detail: dict[str, int] = field(default_factory=dict)
    roles: tuple[str, ...] = ()


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


def compile_job(job: CompileJob, target: DeviceInfo) -> CompileReport:
    """Compile one specialized launch for `target` (no GPU needed) and report its resources; a compile
    error is a report with fits False and reason "compile_error: ..."."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    roles = tuple(sorted(job.roles))
    source_type = ASTSource
    if job.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    source = source_type(job.kernel(), dict(job.signature), dict(job.constexprs),
                         {path: [list(a) for a in value] for path, value in job.attrs})
    try:
        kernel = triton.compile(source, target=GPUTarget(*target.target), options=dict(job.options))
    except Exception as err:  # noqa: BLE001 - any compiler failure is this config's result
        # Triton puts the source excerpt first and the cause last: keep the end.
        message = " ".join(str(err).split())[-500:]
        return CompileReport(None, None, None, False, f"compile_error: {type(err).__name__}: {message}",
                             time.perf_counter() - start, job.name, roles=roles)
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
                         time.perf_counter() - start, job.name, detail, roles)


def unfit(reports: list[CompileReport]) -> tuple[str, str] | None:
    """The trial status and reason of the first kernel that does not fit (`compile_error` or
    `out_of_resources`), None when every kernel fits."""
    bad = [r for r in reports if not r.fits]
    if not bad:
        return None
    status = "compile_error" if (bad[0].reason or "").startswith("compile_error") else "out_of_resources"
    return status, f"{bad[0].kernel}: {bad[0].reason}"


# Reports by (job, target) for this process: sweeping many shapes of one head dim, or one role of a call
# config, compiles each specialization once.
_reports: dict[tuple[CompileJob, DeviceInfo], CompileReport] = {}


def jobs(variant: Variant, calls: list[dict], config: CallConfig, target: DeviceInfo,
         roles: Iterable[str] | None = None) -> list[CompileJob]:
    """The distinct specialized launches `calls` make with `config` on `target` (only the kernels of
    `roles`, when given)."""
    wanted = None if roles is None else set(roles)
    out: list[CompileJob] = []
    for launch in distinct(record_calls(variant, calls, config, target)):
        if wanted is not None and not launch.roles & wanted:
            continue
        job = specialize(launch, target)
        if job not in out:
            out.append(job)
    return out


def check_variant(variant: Variant, calls: list[dict], config: CallConfig, target: DeviceInfo,
                  roles: Iterable[str] | None = None) -> list[CompileReport]:
    """Compile every kernel the calls of one tuning key (`launch_record.meta_calls`) launch with this
    call config on `target`, or only those of `roles`."""
    reports = []
    for job in jobs(variant, calls, config, target, roles):
        if (job, target) not in _reports:
            _reports[(job, target)] = compile_job(job, target)
        reports.append(_reports[(job, target)])
    return reports


# Distinct kernels from which the command line compiles in a pool (when it has at least 2 spare cores).
PARALLEL_FROM = 16


def _compile_in_worker(item: tuple[CompileJob, DeviceInfo]) -> CompileReport:
    return compile_job(*item)


@contextlib.contextmanager
def compile_pool(workers: int):
    """Worker processes for `compile_all`. TRITON_INTERPRET stays unset while the pool lives (workers
    start when work arrives, and an interpreted kernel cannot be compiled)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            yield pool
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def compile_all(items: Iterable[tuple[Variant, list[dict], CallConfig, Iterable[str] | None]], target: DeviceInfo,
                pool=None, workers: int | None = None, parallel_from: int = 2) -> None:
    """Compile in parallel what `check_variant` would for each (variant, calls, config, roles), so that
    its later calls find the reports: in `pool` (`compile_pool`), or in a pool of `workers` processes
    made for this call (default: all cores but one) when at least `parallel_from` kernels are new.
    Compiling is CPU work that one process does one kernel at a time."""
    todo: list[CompileJob] = []
    seen: set[CompileJob] = set()
    for variant, calls, config, roles in items:
        for job in jobs(variant, calls, config, target, roles):
            if (job, target) not in _reports and job not in seen:
                seen.add(job)
                todo.append(job)
    if pool is not None:
        _compile(todo, target, pool)
    elif len(todo) >= max(2, parallel_from):
        with compile_pool(min(len(todo), workers or max(1, usable_cores() - 1))) as own:
            _compile(todo, target, own)


def _compile(todo: list[CompileJob], target: DeviceInfo, pool) -> None:
    for job, report in zip(todo, pool.map(_compile_in_worker, [(j, target) for j in todo]), strict=True):
        _reports[(job, target)] = report


def check_many(variant: Variant, calls: list[dict], configs: list[CallConfig], target: DeviceInfo,
               roles: Iterable[str] | None = None, workers: int | None = None) -> None:
    """`compile_all` for several call configs of one variant and key (a sweep's whole role stage)."""
    compile_all([(variant, calls, config, roles) for config in configs], target, workers=workers)


# ----------------------------------------------------------------------------- command line
def _find_variant(name: str, vendor: str) -> Variant:
    for variants in load_all().values():
        for variant in variants:
            if variant.name == name and variant.vendor == vendor:
                return variant
    known = sorted({f"{v.name} ({v.vendor})" for vs in load_all().values() for v in vs})
    raise ValueError(f"--variant: no variant {name!r} for vendor {vendor!r}; known: {', '.join(known)}")


def preset_shapes(op_name: str, dtype: torch.dtype, presets: Iterable[str] | None = None) -> dict[str, dict]:
    """Tuning key (JSON) -> the first preset shape with that key, over the op's presets (or those
    named), keys computed on meta tensors."""
    op = OPS[op_name]
    out: dict[str, dict] = {}
    for name in presets or op.presets:
        for shape in op.presets[name]:
            args = op.validate(**op.make_inputs(shape, device=torch.device("meta"), dtype=dtype, seed=0))
            out.setdefault(canonical_json(dict(op.tuning_key(args))), shape)
    return out


def shipped_configs(variant: Variant) -> dict[str, list[CallConfig]]:
    """The call configs the shipped tables hold for this variant on its vendor's devices, by tuning key."""
    from kreg.tuning_db.table_files import shipped_tables

    out: dict[str, list[CallConfig]] = {}
    for tuned in shipped_tables().tuned(variant.op):
        if tuned.variant == variant.name and tuned.variant_vendor == variant.vendor:
            out.setdefault(tuned.tuning_key, []).append(tuned.config)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m kreg.tuning.compile_check`: one line per compiled kernel, or JSON lines with --json."""
    parser = argparse.ArgumentParser(prog="python -m kreg.tuning.compile_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", required=True, help="variant name, e.g. flash_attention_tiled")
    parser.add_argument("--vendor", required=True, choices=VENDORS)
    parser.add_argument("--target", required=True, help="presets, comma-separated (h200, mi300x, mi355x)")
    parser.add_argument("--shape-json", action="append", help="a shape as the op's presets spell it, as JSON "
                        "(repeatable); default: the op's full preset shapes, one per tuning key")
    parser.add_argument("--config-json", action="append", help="a CallConfig as JSON, by role (repeatable)")
    parser.add_argument("--defaults", action="store_true",
                        help="the variant's default call config at each shape (what runs without --config-json, "
                             "--space or --tables)")
    parser.add_argument("--space", action="store_true",
                        help="every config of each role's space not pruned (the other roles at their defaults)")
    parser.add_argument("--tables", action="store_true",
                        help="the shipped tuned configs of this variant (tuning_db/tables), at a preset shape of "
                             "each shipped key")
    parser.add_argument("--roles", default=None, help="comma-separated kernel roles to compile (default: all)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="input dtype (default bf16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    parser.add_argument("--jobs", type=int, default=max(1, usable_cores() - 1),
                        help="compile processes (default: all cores but one; 1 compiles in this process)")
    opts = parser.parse_args(argv)
    if opts.jobs < 1:
        parser.error(f"--jobs: expected a count of at least 1, got {opts.jobs}")

    variant = _find_variant(opts.variant, opts.vendor)
    roles = tuple(opts.roles.split(",")) if opts.roles else None
    if roles is not None and not set(roles) <= set(variant.roles):
        parser.error(f"--roles: {variant.name} has the roles {', '.join(variant.roles)}, got {opts.roles}")
    targets = [preset(name) for name in opts.target.split(",")]
    for target in targets:
        if target.vendor != variant.vendor:
            parser.error(f"--target: expected a target of vendor {variant.vendor}, got {target.key} ({target.vendor})")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[opts.dtype]
    defaults = opts.defaults or not (opts.tables or opts.space or opts.config_json)
    shapes = [(json.loads(text), dtype) for text in opts.shape_json or ()]
    if not shapes and (defaults or opts.space or opts.config_json):
        shapes = [(s, dtype) for s in preset_shapes(variant.op, dtype, ["full"]).values()]
    given = {canonical_json(dict(OPS[variant.op].tuning_key(meta_calls(variant.op, s, d)[0]))) for s, d in shapes}
    shipped = {}
    if opts.tables:
        shipped = shipped_configs(variant)
        if not shipped:
            parser.error(f"--tables: no shipped table holds {variant.name} ({variant.vendor})")
        known = {}
        for dtype_of_key in (torch.float16, torch.bfloat16):
            known.update({k: (s, dtype_of_key) for k, s in preset_shapes(variant.op, dtype_of_key).items()})
        for key_json in shipped:
            if key_json not in known:
                print(f"{variant.name}: no preset shape has the shipped key {key_json}: skipped", file=sys.stderr)
            elif key_json not in given:
                shapes.append(known[key_json])
    checks = []  # (shape, key, calls, target, source, config)
    for shape, shape_dtype in shapes:
        calls = meta_calls(variant.op, shape, shape_dtype)
        key = dict(OPS[variant.op].tuning_key(calls[0]))
        key_json = canonical_json(key)
        for target in targets:
            if not variant.supports(key, target):  # dispatch never runs it there (a window, a head dim)
                print(f"{target.key}: {variant.name} does not support {key_json}: skipped", file=sys.stderr)
                continue
            default = variant.default_config(key, target)
            configs = []
            if defaults and key_json in given:
                configs.append(("default", default))
            configs += [("table", variant.complete(c, key, target)) for c in shipped.get(key_json, ())]
            configs += [("given", variant.complete(CallConfig.from_json(text), key, target))
                        for text in opts.config_json or ()]
            if opts.space:
                configs += [("space", default.replace(role, c)) for role, space in variant.space(key, target).items()
                            for c in space if variant.prune_reason(role, c, key, target) is None]
            checks += [(shape, key, calls, target, source, config) for source, config in configs]
    # With processes to spare (--jobs) and many kernels, compile them in parallel first (a machine of many
    # cores runs a whole table in a fraction of the time). A pool's start-up (~8 s) is not worth it for a
    # few kernels.
    if opts.jobs >= 2:
        for target in targets:
            items = [(variant, calls, config, roles) for _, _, calls, t, _, config in checks if t == target]
            compile_all(items, target, workers=opts.jobs, parallel_from=PARALLEL_FROM)
    all_fit = True
    for shape, key, calls, target, source, config in checks:
        for report in check_variant(variant, calls, config, target, roles):
            all_fit &= report.fits
            if opts.json:
                row = {"target": target.key, "arch": target.arch, "key": key, "shape": shape,
                       "source": source, "config": json.loads(config.to_json()), **asdict(report)}
                print(json.dumps(row), flush=True)
            else:
                why = f" ({report.reason})" if report.reason else ""
                print(f"{target.key} {target.arch} {canonical_json(key)} {source} [{config}] {report.kernel}: "
                      f"regs={report.registers} spills={report.spills} shared={report.shared_bytes} "
                      f"fits={report.fits}{why}", flush=True)
    return 0 if all_fit else 1


if __name__ == "__main__":
    sys.exit(main())
