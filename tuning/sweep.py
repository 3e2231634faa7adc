"""Correctness-gated autotune sweeps: `python -m kreg.tuning.sweep --device h200 [--op flash_attention]`.

Each preset shape of each op is one tuning key, tuned by `tuning.tuner.KeyTuner` (role by role, every
config gated against the op's reference on fresh random inputs, a reduced shape when the reference
would not fit, then timed). Every trial is committed as it finishes, so a killed sweep loses nothing
and `--resume` continues it; `--max-minutes` stops cleanly between trials. Trials run in a child
process that is killed when one outlasts `--trial-timeout`.

`--compile-only` instead compiles every config for a target that is not present (AMD from an NVIDIA
or CPU machine) and records registers, spills and shared memory/LDS, pruning what does not fit.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Iterable

import torch

from kreg.core.device import INTERPRETER_VENDOR, DeviceInfo, detect, preset
from kreg.core.records import TrialResult, canonical_json
from kreg.core.space import INTERPRETER_DTYPE, KNOB_NAMES
from kreg.ops.contract import DTYPE_NAMES, Op
from kreg.tuning.export import ExportError, check_replaceable, export_json, table_path
from kreg.tuning.launch_record import meta_calls
from kreg.tuning.tuner import KeyTuner, SweepStats, trial_configs, versions
from kreg.tuning_db.errors import TuningDatabaseError


def shape_key(op: Op, shape: dict, dtype: torch.dtype) -> dict:
    """The tuning key of a preset shape without allocating it: inputs are made on the "meta" device
    (falling back to the reduced shape on the CPU for ops whose inputs cannot be made there)."""
    try:
        args = op.validate(**op.make_inputs(shape, device=torch.device("meta"), dtype=dtype, seed=0))
    except (RuntimeError, NotImplementedError):
        args = op.validate(**op.make_inputs(op.reduce_shape(shape), device="cpu", dtype=dtype, seed=0))
    return dict(op.tuning_key(args))


def sweep_op(op: Op, variants, device_info: DeviceInfo, torch_device: torch.device, shapes: Iterable[dict],
             dtype: torch.dtype, store, *, resume: bool, deadline: float | None, progress=None, seed: int = 0,
             roles: Iterable[str] | None = None, wanted: dict[str, int] | None = None,
             trial_timeout: float | None = None, isolate: bool = True) -> tuple[SweepStats, bool]:
    """Sweep one op over `shapes`. Returns (stats, finished): finished is False when the deadline hit."""
    from kreg.tuning.trials import DEFAULT_TRIAL_TIMEOUT_S, TrialRunner

    shapes = list(shapes)
    stats = SweepStats()
    run_id = store.resumable_run(op.name, device_info) if resume else None
    if run_id is None:
        run_id = store.start_run(op.name, device_info, {"dtype": DTYPE_NAMES[dtype], "shapes": shapes,
                                                        "roles": None if roles is None else list(roles)})
    task = progress.add_task(op.name, total=None, rejected=0, best="-") if progress else None
    timeout = trial_timeout or DEFAULT_TRIAL_TIMEOUT_S
    with TrialRunner(op.name, torch_device, timeout_s=timeout, isolate=isolate) as runner:
        tuner = KeyTuner(op, device_info, store, run_id, runner, deadline=deadline, roles=roles, wanted=wanted,
                         stats=stats, progress=progress, task=task)
        for shape in shapes:
            dims = shape_key(op, shape, dtype)
            pool = [v for v in variants if v.supports(dims, device_info)]
            if progress:
                planned = sum(len(c) for p in tuner.plans(pool, dims).values() for c in p.values())
                progress.update(task, total=(progress.tasks[task].total or 0) + planned)
            prepared, calls = [], []

            def prepare(shape=shape, prepared=prepared) -> None:
                if not prepared:
                    runner.prepare(shape, dtype, seed)
                    prepared.append(True)

            def key_calls(shape=shape, calls=calls) -> list[dict]:
                if not calls:
                    calls += meta_calls(op.name, shape, dtype)
                return calls

            if not tuner.tune(pool, dims, canonical_json(dims), prepare, key_calls):
                store.finish_run(run_id, "stopped")
                return stats, False
    store.finish_run(run_id, "finished")
    return stats, True


def compile_only_op(op: Op, variants, target: DeviceInfo, shapes: Iterable[dict], dtype: torch.dtype, store,
                    *, resume: bool, deadline: float | None, progress=None, roles: Iterable[str] | None = None,
                    wanted: dict[str, int] | None = None) -> tuple[list, bool]:
    """Compile every config of every role for `target` offline (the other roles at their defaults);
    record resources; prune what spills or does not fit."""
    from kreg.tuning.compile_check import check_variant, unfit

    run_id = store.resumable_run(op.name, target) if resume else None
    if run_id is None:
        run_id = store.start_run(op.name, target, {"compile_only": True, "dtype": DTYPE_NAMES[dtype]})
    done = {(t.variant, t.source_hash, t.tuning_key, t.config.to_json(), t.role) for t in store.trials(run_id=run_id)}
    triton_version, torch_version = versions()
    rows = []
    task = progress.add_task(f"{op.name} -> {target.arch}", total=None, rejected=0, best="-") if progress else None
    for shape in shapes:
        dims = shape_key(op, shape, dtype)
        key_json = canonical_json(dims)
        calls = meta_calls(op.name, shape, dtype)
        for variant in (v for v in variants if v.supports(dims, target)):
            default = variant.default_config(dims, target)
            for role, configs in trial_configs(variant, dims, target, roles, wanted or {}).items():
                if progress:
                    progress.update(task, total=(progress.tasks[task].total or 0) + len(configs))
                for config in configs:
                    call = default.replace(role, config)
                    if (variant.name, variant.source_hash, key_json, call.to_json(), role) in done:
                        if progress:
                            progress.advance(task)
                        continue
                    if deadline is not None and time.monotonic() > deadline:
                        store.finish_run(run_id, "stopped")
                        return rows, False
                    regs = spills = shared = None
                    reason = variant.prune_reason(role, config, dims, target)
                    if reason:
                        status, error = "pruned", reason
                    else:
                        reports = check_variant(variant, calls, call, target, roles=(role,))
                        regs = max((r.registers or 0 for r in reports), default=None)
                        spills = max((r.spills or 0 for r in reports), default=None)
                        shared = max((r.shared_bytes or 0 for r in reports), default=None)
                        status, error = unfit(reports) or ("ok", None)
                    store.record(run_id, TrialResult(
                        op=op.name, variant=variant.name, vendor=variant.vendor, source_hash=variant.source_hash,
                        device_key=target.key, tuning_key=key_json, config=call, role=role, status=status,
                        error=error, registers=regs, spills=spills, shared_bytes=shared,
                        triton_version=triton_version, torch_version=torch_version))
                    rows.append((key_json, variant.name, role, str(config), status, regs, spills, shared))
                    if progress:
                        progress.update(task, advance=1, rejected=sum(r[4] != "ok" for r in rows))
    store.finish_run(run_id, "finished")
    return rows, True


# --------------------------------------------------------------------------------------------- CLI
class UsageError(ValueError):
    """A command-line argument that cannot work; main prints it and exits 2."""


MAX_MINUTES = 7 * 24 * 60
MAX_TRIAL_SECONDS = 24 * 3600


def _parse_filter(text: str | None) -> dict[str, int]:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"-?[0-9]+", value.strip()):
            raise UsageError(f"--filter: expected K=V pairs with integer values, got {item!r}")
        out[name.strip()] = int(value)
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tuning.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", required=True,
                   help="target: h100, h200, mi300x (mi300), mi355x (mi355), cpu (the interpreter) "
                   "or auto (the device present)")
    p.add_argument("--op", action="append", help="op to sweep (repeatable; default: every op with variants)")
    p.add_argument("--shapes", default=None,
                   help="preset name, tiny or full (default: tiny on cpu, full on a GPU), optionally with the "
                        "indices of its shapes to sweep: full:0,2")
    p.add_argument("--variant", default=None, metavar="NAME",
                   help="sweep only this variant of each op (default: every variant of the device's vendor)")
    p.add_argument("--roles", default=None, metavar="ROLE,...",
                   help="tune only these kernel roles (e.g. bwd_dq,bwd_dkv); the others keep their best known "
                        "or default configs")
    p.add_argument("--filter", default=None, metavar="K=V,...",
                   help="only configs whose blocks/knobs have these values, e.g. BLOCK_H=64,num_stages=2 "
                        "(a role whose configs never have them is not tuned)")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default=None,
                   help="input dtype (default: bf16 on a GPU, fp16 in the interpreter)")
    p.add_argument("--db", default=None, help="SQLAlchemy URL (default: KREG_TUNING_DB or the user cache file)")
    p.add_argument("--resume", action="store_true", help="continue the last killed or stopped sweep")
    p.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this many minutes")
    p.add_argument("--trial-timeout", type=float, default=None, metavar="SECONDS",
                   help="kill a trial (compile, gate and timing) that runs longer and record it as a timeout "
                        "(default 300)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every config for the target offline and record registers/spills/LDS")
    p.add_argument("--export", default=None, metavar="DIR", help="write the tuned JSON tables to DIR afterwards")
    p.add_argument("--stale", action="store_true",
                   help="list the device's tuned configs whose kernel source changed, and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs and CI)")
    return p.parse_args(argv)


def _target(name: str) -> DeviceInfo:
    if name == "auto":
        return detect()
    for key in ("h100", "h200", "mi300x", "mi355x", "cpu"):
        if preset(key).key == name:
            return preset(key)
    try:
        return preset(name)
    except ValueError:
        raise UsageError(f"--device: unknown device {name!r}; expected h100, h200, mi300x, mi355x, cpu "
                         "or auto") from None


def _present_device(target: DeviceInfo) -> tuple[DeviceInfo, torch.device]:
    """The device to time on; a clear error when the target is not the device that is present."""
    if target.key == "cpu":
        return target, torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {target.key}: no GPU is present on this machine; "
                         f"use --compile-only to compile for {target.arch}, or --device cpu")
    here = detect(torch.device("cuda"))
    if (here.vendor, here.arch) != (target.vendor, target.arch) or here.key != target.key:
        raise UsageError(f"--device {target.key}: this machine has {here.name} ({here.key}, {here.arch}); "
                         f"timings would be wrong. Use --device {here.key.split('-', 1)[-1]} here, "
                         f"or --compile-only to compile for {target.arch}")
    return here, torch.device("cuda")


def _shapes(op: Op, spec: str) -> list[dict]:
    """The preset shapes `--shapes` names for `op` ("full", "tiny:0,2")."""
    name, _, picks = spec.partition(":")
    if name not in op.presets:
        raise UsageError(f"--shapes: {op.name} has presets {', '.join(op.presets)}, got {name!r}")
    shapes = list(op.presets[name])
    if not picks:
        return shapes
    chosen = []
    for pick in picks.split(","):
        if not re.fullmatch(r"[0-9]+", pick.strip()) or int(pick) >= len(shapes):
            raise UsageError(f"--shapes: {op.name}'s {name!r} preset has shapes 0..{len(shapes) - 1}, got {pick!r}")
        chosen.append(shapes[int(pick)])
    return chosen


def _check_selection(op: Op, variants, shapes: list[dict], device: DeviceInfo, dtype: torch.dtype,
                     roles: list[str] | None, wanted: dict[str, int]) -> None:
    """Refuse `--roles` naming no role of the variants, and a `--roles`/`--filter` pair that leaves no
    config to try anywhere (a sweep that would silently do nothing)."""
    if roles is not None:
        known = {r for v in variants for r in v.roles}
        unknown = [r for r in roles if r not in known]
        if unknown:
            raise UsageError(f"--roles: {op.name}'s variants have the roles {', '.join(sorted(known))}, "
                             f"got {', '.join(unknown)}")
    for shape in shapes:
        dims = shape_key(op, shape, dtype)
        for variant in (v for v in variants if v.supports(dims, device)):
            if any(trial_configs(variant, dims, device, roles, wanted).values()):
                return
    what = f"--filter {','.join(f'{k}={v}' for k, v in wanted.items())}" if wanted else "--roles"
    raise UsageError(f"{what}: selects no config of {op.name} at the chosen shapes on {device.key}")


def _winners_table(store, device_key: str, ops: list[str]):
    from rich.table import Table

    table = Table(title=f"tuned configs on {device_key}")
    for col in ("op", "tuning key", "variant", "config", "ms", "bwd ms"):
        table.add_column(col)
    for op in ops:
        for t in store.tuned(op=op, device_key=device_key):
            table.add_row(op, t.tuning_key, t.variant, str(t.config), "-" if t.time_ms is None else f"{t.time_ms:.4f}",
                          "-" if t.backward_ms is None else f"{t.backward_ms:.4f}")
    return table


def _resources_table(target: DeviceInfo, rows: list):
    from rich.table import Table

    table = Table(title=f"compile-only resources for {target.key} ({target.arch})")
    for col in ("tuning key", "variant", "role", "config", "status", "regs", "spills", "shared B"):
        table.add_column(col)
    for key, variant, role, config, status, regs, spills, shared in rows:
        table.add_row(key, variant, role, config, status,
                      *("-" if v is None else str(v) for v in (regs, spills, shared)))
    return table


def _stale(store, registry_variants, device_key: str) -> int:
    """List the tuned entries of `device_key` (database and shipped tables) whose kernel source changed
    since they were tuned."""
    from kreg.tuning_db.table_files import ShippedTables

    hashes = {(v.vendor, v.name): v.source_hash for vs in registry_variants.values() for v in vs}
    shipped = [t for t in ShippedTables().tuned() if t.device_key == device_key
               and hashes.get((t.variant_vendor, t.variant), t.source_hash) != t.source_hash]
    stale = [("database", t) for t in store.stale(hashes) if t.device_key == device_key]
    stale += [("shipped", t) for t in shipped]
    for where, t in stale:
        print(f"stale ({where}): {t.op} {t.device_key} {t.tuning_key} {t.variant} (tuned for source {t.source_hash})")
    print(f"{len(stale)} stale tuned config(s) on {device_key}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return _main(args)
    except (UsageError, TuningDatabaseError, ExportError) as err:
        # A database failure mid-sweep loses nothing recorded so far (`--resume` continues); its message
        # names the database without the URL's password.
        print(f"error: {err}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    target = _target(args.device)
    if args.compile_only and target.key == "cpu":
        raise UsageError("--compile-only needs a GPU target (h100, h200, mi300x, mi355x), got cpu")
    if args.max_minutes is not None and not 0 <= args.max_minutes <= MAX_MINUTES:
        raise UsageError(f"--max-minutes: expected minutes from 0 to {MAX_MINUTES} (a week), got {args.max_minutes:g}")
    if args.trial_timeout is not None and not 0 < args.trial_timeout <= MAX_TRIAL_SECONDS:
        raise UsageError(f"--trial-timeout: expected seconds above 0, at most {MAX_TRIAL_SECONDS} (a day), got "
                         f"{args.trial_timeout:g}")
    wanted = _parse_filter(args.filter)
    unknown = [n for n in wanted if n not in KNOB_NAMES and not n.isupper()]
    if unknown:
        raise UsageError(f"--filter: {unknown[0]!r} is neither a block (upper case) nor a knob "
                         f"({', '.join(KNOB_NAMES)})")
    roles = [r.strip() for r in args.roles.split(",")] if args.roles else None
    # TRITON_INTERPRET is read when kernels are decorated: settle it before anything imports them.
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
    elif target.key == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if args.db:
        os.environ["KREG_TUNING_DB"] = args.db

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kreg.ops import OPS
    from kreg.ops.catalog import load_all
    from kreg.tuning_db.environment import default_url
    from kreg.tuning_db.store import TuningStore

    console = Console(stderr=True)
    store = TuningStore(default_url())
    registry_variants = load_all()
    if args.stale:
        return _stale(store, registry_variants, target.key)

    if args.compile_only:
        device_info, torch_device = target, torch.device("cpu")
    else:
        device_info, torch_device = _present_device(target)
    vendor = INTERPRETER_VENDOR if device_info.key == "cpu" else device_info.vendor
    ops = args.op or [name for name in OPS if any(v.vendor == vendor for v in registry_variants.get(name, []))]
    unknown_ops = [o for o in ops if o not in OPS]
    if unknown_ops:
        raise UsageError(f"--op: unknown op {unknown_ops[0]!r}; expected one of {', '.join(OPS)}")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}[args.dtype] or (
        torch.bfloat16 if torch_device.type == "cuda" or args.compile_only else INTERPRETER_DTYPE)
    shapes_spec = args.shapes or ("tiny" if device_info.key == "cpu" or args.compile_only else "full")

    # Every selection is checked before the first trial: a typo must not cost a half-done sweep.
    work = []
    for name in ops:
        op = OPS[name]
        variants = [v for v in registry_variants.get(name, []) if v.vendor == vendor]
        if args.variant is not None:
            variants = [v for v in variants if v.name == args.variant]
        if not variants:
            if args.variant is not None and args.op:
                known = ", ".join(v.name for v in registry_variants.get(name, []) if v.vendor == vendor) or "none"
                raise UsageError(f"--variant: {name} has {vendor} variants {known}, got {args.variant!r}")
            console.print(f"{name}: no {vendor} variant yet, skipped")
            continue
        shapes = _shapes(op, shapes_spec)
        _check_selection(op, variants, shapes, device_info, dtype, roles, wanted)
        work.append((op, variants, shapes))
    if not work:
        raise UsageError(f"--variant: no {vendor} variant named {args.variant!r} among the ops swept"
                         if args.variant else f"nothing to sweep for {vendor}")
    if args.export:  # a target export would refuse is refused now, not after the sweep
        for op, _, _ in work:
            check_replaceable(table_path(args.export, device_info.key, op.name), "--export")

    deadline = time.monotonic() + 60 * args.max_minutes if args.max_minutes is not None else None
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("rejected {task.fields[rejected]}"), TimeElapsedColumn(),
               TextColumn("best {task.fields[best]}")]
    resources = []
    with Progress(*columns, console=console, disable=args.no_progress) as progress:
        for op, variants, shapes in work:
            if args.compile_only:
                rows, finished = compile_only_op(op, variants, device_info, shapes, dtype, store, resume=args.resume,
                                                 deadline=deadline, progress=progress, roles=roles, wanted=wanted)
                resources += rows
            else:
                _, finished = sweep_op(op, variants, device_info, torch_device, shapes, dtype, store,
                                       resume=args.resume, deadline=deadline, progress=progress, roles=roles,
                                       wanted=wanted, trial_timeout=args.trial_timeout)
            if not finished:
                console.print(f"stopped after {args.max_minutes} min; `--resume` continues the sweep")
                break
    # Piped output (logs, CI) keeps whole rows instead of wrapping at 80 columns.
    out = Console(width=None if sys.stdout.isatty() else 220)
    if args.compile_only:
        out.print(_resources_table(device_info, resources))
    else:
        out.print(_winners_table(store, device_info.key, [op.name for op, _, _ in work]))
    if args.export:
        try:
            written = export_json(store, device_info.key, None, args.export)
        except OSError as err:  # the sweep's results are in the store; `tuning.export` can write them later
            raise ExportError(f"--export: {err}; the tuned configs are in the database "
                              f"(python -m kreg.tuning.export --device {device_info.key} --out DIR)") from None
        for path in written:
            console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
