"""Correctness-gated autotune sweeps: `python -m kreg.tuning.sweep --device h200 [--op flash_attention]`.

The command line of `tuning.engine` (each preset shape of each op is one tuning key, tuned role by role,
every config gated against the op's reference, then timed; every trial committed as it ends, so a
killed sweep loses nothing and `--resume` continues it; `--max-minutes` stops cleanly between trials)
and `tuning.fleet` (the work as units: run here one after another, or over this machine's GPUs with
`--gpus N`, or over a Ray cluster with `--ray`). `--stale` lists the device's entries tuned for older
kernels and `--retune-stale` re-tunes exactly those.

`--compile-only` instead compiles every config for a target that is not present (AMD from an NVIDIA
or CPU machine) and records registers, spills and shared memory/LDS, pruning what does not fit.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

from kreg.core.device import INTERPRETER_VENDOR, DeviceInfo, usable_cores
from kreg.core.space import INTERPRETER_DTYPE, KNOB_NAMES
from kreg.ops.contract import DTYPE_NAMES, Op
from kreg.tuning.engine import UsageError, compile_only_op, present_device, shape_key, target_device
from kreg.tuning.export import ExportError, check_replaceable, export_json, table_path
from kreg.tuning.fleet import Inline, Pool, Ray, SweepSpec, plan_units, resume_point, stale_entries, stale_units
from kreg.tuning.tuner import trial_configs
from kreg.tuning_db.errors import TuningDatabaseError

# --------------------------------------------------------------------------------------------- CLI
MAX_MINUTES = 7 * 24 * 60
LOCAL_CLUSTER = "local"  # `--ray` without an address
COMPILE_SAMPLE = 4
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
    p.add_argument("--resume", action="store_true",
                   help="continue the last killed or stopped sweep (with --compile-only: also skip every config "
                        "compiled before for the same source and Triton)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this many minutes")
    p.add_argument("--trial-timeout", type=float, default=None, metavar="SECONDS",
                   help="kill a trial (compile, gate and timing) that runs longer and record it as a timeout "
                        "(default 300)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile configs for the target offline, in parallel over this machine's cores, and record "
                        "registers/spills/LDS: each role's default and --sample others (seeded)")
    p.add_argument("--sample", type=int, default=COMPILE_SAMPLE, metavar="N",
                   help=f"with --compile-only: configs drawn per role besides its default (default {COMPILE_SAMPLE})")
    p.add_argument("--full-space", action="store_true",
                   help="with --compile-only: every config of every role (the MI355X's tiny presets: about 17,000 "
                        "configs, 3.8 core-hours, so 15 minutes on 16 cores)")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="write the tuned JSON tables to DIR afterwards (with --compile-only: the resource report "
                        "of each op compiled, <device>__<op>__resources.csv and .md)")
    p.add_argument("--stale", action="store_true",
                   help="list the device's tuned configs whose kernel source changed, and exit")
    p.add_argument("--retune-stale", action="store_true",
                   help="re-tune exactly the device's stale entries (database and shipped tables): each key "
                        "and variant, all its roles (with --op: only those ops')")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="spread the sweep over N GPUs of this machine, a worker process each (on the CPU: N "
                        "interpreter processes)")
    p.add_argument("--ray", nargs="?", const=LOCAL_CLUSTER, default=None, metavar="ADDRESS",
                   help="spread the sweep over every GPU of a Ray cluster (ADDRESS as ray.init takes it; none: "
                        "a local cluster on this machine); needs pip install 'kreg[distributed]' on every host")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs and CI)")
    return p.parse_args(argv)


def _shapes(op: Op, spec: str) -> tuple[str, list[int]]:
    """The preset and the indices of its shapes `--shapes` names for `op` ("full", "tiny:0,2")."""
    name, _, picks = spec.partition(":")
    if name not in op.presets:
        raise UsageError(f"--shapes: {op.name} has presets {', '.join(op.presets)}, got {name!r}")
    count = len(op.presets[name])
    if not picks:
        return name, list(range(count))
    chosen = []
    for pick in picks.split(","):
        if not re.fullmatch(r"[0-9]+", pick.strip()) or int(pick) >= count:
            raise UsageError(f"--shapes: {op.name}'s {name!r} preset has shapes 0..{count - 1}, got {pick!r}")
        chosen.append(int(pick))
    return name, chosen


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
    """List the stale tuned entries of `device_key` (`stale_entries`)."""
    stale = stale_entries(store, registry_variants, device_key)
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
    target = target_device(args.device)
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

    from kreg.ops import OPS
    from kreg.ops.catalog import load_all
    from kreg.tuning_db.environment import default_url
    from kreg.tuning_db.store import TuningStore

    console = Console(stderr=True)
    store = TuningStore(default_url())
    registry_variants = load_all()
    if args.stale:
        return _stale(store, registry_variants, target.key)

    fan_out = args.gpus is not None or args.ray is not None
    if args.compile_only and (fan_out or args.retune_stale):
        raise UsageError("--compile-only compiles in this process; --gpus, --ray and --retune-stale are for "
                         "timed sweeps")
    if args.compile_only:
        device_info, torch_device = target, torch.device("cpu")
    elif args.ray is not None:
        device_info, torch_device = target, None  # each worker checks its own GPU
    else:
        device_info, torch_device = present_device(target)
    vendor = INTERPRETER_VENDOR if device_info.key == "cpu" else device_info.vendor
    gpu = device_info.key != "cpu" and not args.compile_only
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}[args.dtype] or (
        torch.bfloat16 if gpu or args.compile_only else INTERPRETER_DTYPE)
    executor = _executor(args, device_info, gpu)

    if args.retune_stale:
        unknown_ops = [name for name in args.op or () if name not in OPS]
        if unknown_ops:
            raise UsageError(f"--op: unknown op {unknown_ops[0]!r}; expected one of {', '.join(OPS)}")
        units, unmatched = stale_units(store, registry_variants, device_info, dtype, args.op)
        for t in unmatched:
            console.print(f"not re-tuned (no preset shape has this key): {t.op} {t.tuning_key} {t.variant}",
                          highlight=False, markup=False, soft_wrap=True)
        console.print(f"{len(units)} stale entr{'y' if len(units) == 1 else 'ies'} of {device_info.key} to re-tune"
                      + (f", {len(unmatched)} without a preset shape" if unmatched else ""))
        ops = sorted({u.op for u in units})
    else:
        work = _selected_work(args, OPS, registry_variants, vendor, device_info, dtype, roles, wanted, console)
        ops = [op.name for op, _, _, _ in work]
    if args.export:  # a target export would refuse is refused now, not after the sweep
        from kreg.tuning.resources import report_paths

        targets = [path for name in ops for path in report_paths(args.export, device_info, name)] \
            if args.compile_only else [table_path(args.export, device_info.key, name) for name in ops]
        for path in targets:
            check_replaceable(path, "--export")

    deadline = time.monotonic() + 60 * args.max_minutes if args.max_minutes is not None else None
    out = Console(width=None if sys.stdout.isatty() else 220)  # piped output keeps whole rows
    if args.compile_only:
        return _compile_only(args, work, device_info, dtype, store, deadline, roles, wanted, console, out,
                             registry_variants)

    if not args.retune_stale:
        units = plan_units(work, device_info, dtype)

    sweep_id = None
    if args.resume:
        sweep_id, done = resume_point(store, units, device_info.key)
        if done:
            console.print(f"resuming sweep {sweep_id}: {len(done)} of {len(units)} units already finished")
        units = [u for u in units if u not in done]
    spec = SweepSpec(device=args.device,  # "auto": each worker's own GPU, which present_device checks
                     db_url=_absolute(store.url), dtype=DTYPE_NAMES[dtype], sweep_id=sweep_id or SweepSpec.new_id(),
                     roles=tuple(roles) if roles else None, wanted=tuple(sorted(wanted.items())),
                     trial_timeout=args.trial_timeout,
                     deadline=None if deadline is None else time.time() + (deadline - time.monotonic()))
    summary = _run_units(executor, spec, units, console, args.no_progress)
    if summary["stopped"]:
        console.print(f"stopped after {args.max_minutes} min; `--resume` continues the sweep")
    out.print(_winners_table(store, device_info.key, ops))
    if args.export:
        try:
            written = export_json(store, device_info.key, None, args.export)
        except OSError as err:  # the sweep's results are in the store; `tuning.export` can write them later
            raise ExportError(f"--export: {err}; the tuned configs are in the database "
                              f"(python -m kreg.tuning.export --device {device_info.key} --out DIR)") from None
        for path in written:
            console.print(f"wrote {path}")
    return 1 if summary["failed"] else 0


def _compile_only(args, work, device_info: DeviceInfo, dtype, store, deadline, roles, wanted, console, out,
                  registry_variants) -> int:
    """--compile-only: each op's configs compiled in one pool of this machine's cores; a line per op; with
    --export, the device's resource report (`tuning.resources`) written there."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kreg.tuning.compile_check import compile_pool

    if not 0 <= args.sample <= 10_000:
        raise UsageError(f"--sample: expected a count from 0 to 10000, got {args.sample}")
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("rejected {task.fields[rejected]}"), TimeElapsedColumn()]
    resources = []
    with compile_pool(usable_cores()) as pool, \
            Progress(*columns, console=console, disable=args.no_progress or not console.is_terminal) as progress:
        for op, variants, preset_name, indices in work:
            start = time.monotonic()
            rows, finished = compile_only_op(op, variants, device_info, [op.presets[preset_name][i] for i in indices],
                                             dtype, store, resume=args.resume, deadline=deadline, progress=progress,
                                             roles=roles, wanted=wanted, pool=pool,
                                             sample=None if args.full_space else args.sample)
            resources += rows
            rejected = sum(r[4] != "ok" for r in rows)
            console.print(f"{op.name} -> {device_info.arch}: {len(rows)} configs compiled, {rejected} rejected, "
                          f"in {time.monotonic() - start:.0f} s", highlight=False)
            if not finished:
                console.print(f"stopped after {args.max_minutes} min; `--resume` continues the sweep")
                break
    out.print(_resources_table(device_info, resources))
    from kreg.tuning.resources import default_problems, report_rows, write_report

    if device_info.vendor == "amd":  # untimed there: its defaults are chosen from this report
        # Every config this device's runs compiled for the current sources, not only this run's.
        for problem in default_problems(report_rows(store, device_info, registry_variants), registry_variants,
                                        device_info):
            console.print(f"default not the report's best: {problem}", highlight=False, markup=False,
                          soft_wrap=True)
    if args.export:
        for path in write_report(store, device_info, registry_variants, args.export, [op.name for op, *_ in work]):
            console.print(f"wrote {path}")
    return 0


def _absolute(url: str) -> str:
    """`url` with a relative SQLite path made absolute, for workers that run in other folders."""
    from sqlalchemy.engine import make_url

    from kreg.tuning_db.sqlite import sqlite_file

    parsed = make_url(url)
    path = sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None
    return parsed.set(database=str(path)).render_as_string(hide_password=False) if path and not parsed.query else url


def _selected_work(args, ops_by_name, registry_variants, vendor: str, device_info: DeviceInfo, dtype, roles,
                   wanted, console) -> list[tuple[Op, list, str, list[int]]]:
    """(op, variants, preset, shape indices) for every op the arguments select, each selection checked
    before the first trial: a typo must not cost a half-done sweep."""
    names = args.op or [name for name in ops_by_name
                        if any(v.vendor == vendor for v in registry_variants.get(name, []))]
    unknown_ops = [o for o in names if o not in ops_by_name]
    if unknown_ops:
        raise UsageError(f"--op: unknown op {unknown_ops[0]!r}; expected one of {', '.join(ops_by_name)}")
    shapes_spec = args.shapes or ("tiny" if device_info.key == "cpu" or args.compile_only else "full")
    work = []
    for name in names:
        op = ops_by_name[name]
        variants = [v for v in registry_variants.get(name, []) if v.vendor == vendor]
        if args.variant is not None:
            variants = [v for v in variants if v.name == args.variant]
        if not variants:
            if args.variant is not None and args.op:
                known = ", ".join(v.name for v in registry_variants.get(name, []) if v.vendor == vendor) or "none"
                raise UsageError(f"--variant: {name} has {vendor} variants {known}, got {args.variant!r}")
            console.print(f"{name}: no {vendor} variant yet, skipped")
            continue
        preset_name, indices = _shapes(op, shapes_spec)
        _check_selection(op, variants, [op.presets[preset_name][i] for i in indices], device_info, dtype, roles,
                         wanted)
        work.append((op, variants, preset_name, indices))
    if not work:
        raise UsageError(f"--variant: no {vendor} variant named {args.variant!r} among the ops swept"
                         if args.variant else f"nothing to sweep for {vendor}")
    return work


def _executor(args, device_info: DeviceInfo, gpu: bool):
    """Inline (default), the process pool (--gpus N) or Ray (--ray [ADDRESS])."""
    if args.ray is not None:
        if args.gpus is not None:
            raise UsageError("--gpus and --ray: choose one (Ray gives every GPU of its cluster a worker)")
        # Workers must import kreg as this process does; the database and the interpreter come in the spec.
        env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
        try:
            return Ray(None if args.ray == LOCAL_CLUSTER else args.ray, gpu, env)
        except ImportError:
            raise UsageError("--ray needs Ray: pip install 'kreg[distributed]'") from None
    if args.gpus is None:
        return Inline()
    if gpu:
        present = torch.cuda.device_count()
        if not 1 <= args.gpus <= present:
            raise UsageError(f"--gpus: this machine shows {present} GPU(s), got {args.gpus}")
    elif not 1 <= args.gpus <= usable_cores():
        raise UsageError(f"--gpus: the interpreter runs one process per core ({usable_cores()}), got {args.gpus}")
    return Pool.for_device(device_info.vendor if gpu else None, args.gpus,
                           on_retry=lambda unit, why: print(f"retrying {unit.label}: {why}", file=sys.stderr))


def _run_units(executor, spec, units: list, console, quiet: bool) -> dict[str, int]:
    """Run the units, printing a line for each as it ends; counts of finished, stopped and failed."""
    counts = {"finished": 0, "stopped": 0, "failed": 0}
    console.print(f"sweep {spec.sweep_id}: {len(units)} unit(s) on {executor.name}")
    start = time.monotonic()

    def report(result) -> None:
        counts[result.status] += 1
        done = sum(counts.values())
        what = (f"{result.trials} trials ({result.skipped} resumed, {result.rejected} rejected), best {result.best}"
                if result.status != "failed" else f"FAILED: {result.error}")
        console.print(f"[{done}/{len(units)}] {result.unit.label}: {result.status} in {result.seconds:.0f} s on "
                      f"{result.where or '?'}" + (f" after {result.attempts} attempts" if result.attempts > 1 else "")
                      + f"; {what}", highlight=False, markup=False, soft_wrap=True)

    if isinstance(executor, Inline) and not quiet and console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("rejected {task.fields[rejected]}"), TimeElapsedColumn(),
                   TextColumn("best {task.fields[best]}")]
        with Progress(*columns, console=console) as progress:
            executor.progress = progress
            executor.run(spec, units, report)
    else:
        executor.run(spec, units, report)
    console.print(f"{counts['finished']} finished, {counts['stopped']} stopped, {counts['failed']} failed in "
                  f"{time.monotonic() - start:.0f} s")
    return counts


if __name__ == "__main__":
    sys.exit(main())
