"""Correctness-gated autotune sweeps: `python -m tuning.sweep --device h200 [--op flash_attention]`.

For every preset shape of an op, every (variant, config) that survives static pruning is first checked
against the op's reference on fresh random inputs (a reduced shape when the reference would not fit);
a wrong config is recorded as rejected and never timed. The rest are timed on the full shape. Every
trial is committed as it finishes, so a killed sweep loses nothing and `--resume` continues it;
`--max-minutes` stops cleanly between trials. The winner of each key is upserted into the database.

`--compile-only` instead compiles every config for a target that is not present (AMD from an NVIDIA
or CPU machine) and records registers, spills and shared memory/LDS, pruning what does not fit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from registry.device import DeviceInfo, detect, preset
from registry.ops._contract import DTYPE_NAMES


@dataclass
class SweepStats:
    done: int = 0
    rejected: int = 0
    skipped: int = 0
    best_ms: float | None = None
    best: str = "-"
    winners: list = field(default_factory=list)


def _classify(err: BaseException) -> str:
    """Map an exception from compiling or launching a config to a trial status."""
    name = type(err).__name__
    text = str(err)
    if name == "OutOfResources" or "out of resource" in text.lower():
        return "out_of_resources"
    if name in ("CompilationError", "CompileTimeAssertionFailure") or "compil" in name.lower():
        return "compile_error"
    return "runtime_error"


def _short_error(err: BaseException) -> str:
    lines = [ln for ln in traceback.format_exception_only(type(err), err) if ln.strip()]
    return "".join(lines).strip()[-2000:]


def _versions() -> tuple[str, str]:
    import triton

    return triton.__version__, torch.__version__


def _gate_and_time(op, variant, config, gate_args, gate_ref, full_sets, tol,
                   device) -> tuple[str, float | None, str | None]:
    """Correctness gate on `gate_args`, then a timing on the full-shape input sets."""
    from registry.testing import max_relative_error
    from tuning.bench import rotating, time_call

    try:
        out = variant.launch(gate_args, config)
        if device.type == "cuda":
            torch.cuda.synchronize()
        err = max_relative_error(out, gate_ref)
        if not err <= tol:
            return "wrong_result", None, f"relative error {err:.3g} > {tol:.3g}"
        ms = time_call(rotating(lambda a: variant.launch(a, config), full_sets), device)
        return "ok", ms, None
    except Exception as exc:  # noqa: BLE001 - every failure of a config is a recorded trial, not a crash
        if device.type == "cuda":
            torch.cuda.synchronize()
        return _classify(exc), None, _short_error(exc)


def _spills_or_overflows(cand, dims: dict, device_info: DeviceInfo) -> tuple[str, None, str] | None:
    """On a GPU, a config whose kernels spill registers or overflow shared memory/LDS is rejected
    before it is timed (shipped configs must be spill-free): (status, None, reason), or None when it
    fits. The interpreter has no registers to check."""
    if device_info.key == "cpu":
        return None
    from tuning.compile_check import check_variant

    bad = [r for r in check_variant(cand.variant, dims, cand.config, device_info) if not r.fits]
    if not bad:
        return None
    reason = f"{bad[0].kernel}: {bad[0].reason}"
    return ("compile_error" if (bad[0].reason or "").startswith("compile_error") else "out_of_resources"), None, reason


def _input_sets(op, shape: dict, device: torch.device, dtype: torch.dtype, count: int, seed: int) -> list[dict]:
    return [op.validate(**op.make_inputs(shape, device=device, dtype=dtype, seed=seed + i)) for i in range(count)]


def _rotation_count(op, args: dict, device: torch.device) -> int:
    """Enough input sets that one call's bytes times the count exceed a 60 MB L2 (at most 4)."""
    if device.type != "cuda":
        return 1
    per_call = max(op.bytes_moved(args), 1.0)
    return int(min(4, max(1, -(-60e6 // per_call))))


def _trial(op, cand, device_key: str, key_json: str, status: str, **fields):
    """The record of one (variant, config) tried on one key."""
    from tuning_db.records import TrialResult

    triton_v, torch_v = _versions()
    return TrialResult(op=op.name, variant=cand.variant.name, source_hash=cand.variant.source_hash,
                       device_key=device_key, tuning_key=key_json, config=cand.config, status=status,
                       triton_version=triton_v, torch_version=torch_v, **fields)


def _run_key(op, todo, dims: dict, key_json: str, device_info: DeviceInfo, torch_device: torch.device,
             gate_args: dict, gate_ref, full_sets: list[dict], tol: float, store, run_id: int, stats: SweepStats,
             deadline: float | None, progress=None, task=None) -> bool:
    """Prune, compile-check, gate and time each candidate of one key, recording every trial as it ends.
    Returns False when the deadline stopped it."""
    for cand in todo:
        if deadline is not None and time.monotonic() > deadline:
            return False
        if cand.pruned:
            status, ms, error = "pruned", None, cand.pruned
        elif (unfit := _spills_or_overflows(cand, dims, device_info)) is not None:
            status, ms, error = unfit
        else:
            status, ms, error = _gate_and_time(op, cand.variant, cand.config, gate_args, gate_ref,
                                               full_sets, tol, torch_device)
        store.record(run_id, _trial(op, cand, device_info.key, key_json, status, time_ms=ms, error=error))
        stats.done += 1
        if status != "ok":
            stats.rejected += status != "pruned"
        elif stats.best_ms is None or ms < stats.best_ms:
            stats.best_ms, stats.best = ms, f"{cand.variant.name} {cand.config} {ms:.3f} ms"
        if progress:
            progress.update(task, advance=1, rejected=stats.rejected, best=stats.best)
    return True


def _promote_winner(op, store, run_id: int, device_info: DeviceInfo, key_json: str, stats: SweepStats) -> None:
    """Upsert the run's fastest correct config of this key, unless an earlier slice found a faster one."""
    from tuning_db.records import TunedConfig

    winner = _winner(store, run_id, key_json)
    if winner is None:
        return
    tuned = TunedConfig(op=op.name, device_key=device_info.key, tuning_key=key_json, variant=winner.variant,
                        source_hash=winner.source_hash, config=winner.config, time_ms=winner.time_ms,
                        triton_version=winner.triton_version, torch_version=winner.torch_version)
    if _improves(store, tuned, device_info):
        store.upsert_tuned(tuned, device_info)
        stats.winners.append(tuned)


def sweep_op(op, variants, device_info: DeviceInfo, torch_device: torch.device, shapes: Iterable[dict],
             dtype: torch.dtype, store, *, resume: bool, deadline: float | None, progress=None,
             seed: int = 0) -> tuple[SweepStats, bool]:
    """Sweep one op over `shapes`. Returns (stats, finished): finished is False when the deadline hit."""
    from registry.testing import TOLERANCE
    from tuning.space import candidates
    from tuning_db.records import canonical_json

    stats = SweepStats()
    run_id = store.resumable_run(op.name, device_info) if resume else None
    if run_id is None:
        run_id = store.start_run(op.name, device_info, {"dtype": DTYPE_NAMES[dtype], "shapes": list(shapes)})
    done = store.done_configs(run_id)
    task = progress.add_task(op.name, total=None, rejected=0, best="-") if progress else None
    for shape in shapes:
        full = op.validate(**op.make_inputs(shape, device=torch_device, dtype=dtype, seed=seed))
        dims = dict(op.tuning_key(full))
        key_json = canonical_json(dims)
        pool = candidates(variants, dims, device_info)
        todo = [c for c in pool if (c.variant.name, c.variant.source_hash, key_json, c.config.to_json()) not in done]
        stats.skipped += len(pool) - len(todo)
        if progress:
            progress.update(task, total=(progress.tasks[task].total or 0) + len(pool))
            progress.advance(task, len(pool) - len(todo))
        if todo:
            reduced = op.reduce_shape(shape)
            gate_args = full if reduced == shape else op.validate(
                **op.make_inputs(reduced, device=torch_device, dtype=dtype, seed=seed + 1000))
            full_sets = [full] + _input_sets(op, shape, torch_device, dtype,
                                             _rotation_count(op, full, torch_device) - 1, seed + 1)
            if not _run_key(op, todo, dims, key_json, device_info, torch_device, gate_args,
                            op.reference(**gate_args), full_sets, TOLERANCE[dtype], store, run_id, stats,
                            deadline, progress, task):
                store.finish_run(run_id, "stopped")
                return stats, False
        _promote_winner(op, store, run_id, device_info, key_json, stats)
    store.finish_run(run_id, "finished")
    return stats, True


def _improves(store, tuned, device_info: DeviceInfo) -> bool:
    """Whether `tuned` should replace the stored winner of its key: always, unless that winner was
    measured on this very device for the same kernel source and versions and is faster (a sweep slice
    over part of a space must not undo a better result of an earlier slice)."""
    current = store.best(tuned.op, device_info, tuned.tuning_key)
    same_measurement = current is not None and (
        (current.device_key, current.variant, current.source_hash, current.triton_version, current.torch_version)
        == (tuned.device_key, tuned.variant, tuned.source_hash, tuned.triton_version, tuned.torch_version))
    return not (same_measurement and current.time_ms is not None and current.time_ms <= tuned.time_ms)


def _winner(store, run_id: int, key_json: str):
    """The run's fastest trial of this key that passed the gate and was timed."""
    ok = [t for t in store.trials(run_id=run_id, status="ok") if t.tuning_key == key_json and t.time_ms is not None]
    return min(ok, key=lambda t: t.time_ms) if ok else None


def compile_only_op(op, variants, target: DeviceInfo, shapes: Iterable[dict], dtype: torch.dtype, store,
                    *, resume: bool, deadline: float | None, progress=None) -> tuple[list, bool]:
    """Compile every config for `target` offline; record resources; prune what spills or does not fit."""
    from tuning.compile_check import check_variant
    from tuning.space import candidates
    from tuning_db.records import canonical_json

    run_id = store.resumable_run(op.name, target) if resume else None
    if run_id is None:
        run_id = store.start_run(op.name, target, {"compile_only": True, "dtype": DTYPE_NAMES[dtype]})
    done = store.done_configs(run_id)
    rows = []
    task = progress.add_task(f"{op.name} -> {target.arch}", total=None, rejected=0, best="-") if progress else None
    for shape in shapes:
        dims_for_key = _shape_key(op, shape, dtype)
        key_json = canonical_json(dims_for_key)
        pool = candidates(variants, dims_for_key, target)
        if progress:
            progress.update(task, total=(progress.tasks[task].total or 0) + len(pool))
        for cand in pool:
            if (cand.variant.name, cand.variant.source_hash, key_json, cand.config.to_json()) in done:
                if progress:
                    progress.advance(task)
                continue
            if deadline is not None and time.monotonic() > deadline:
                store.finish_run(run_id, "stopped")
                return rows, False
            regs = spills = shared = None
            if cand.pruned:
                status, error = "pruned", cand.pruned
            else:
                reports = check_variant(cand.variant, dims_for_key, cand.config, target)
                regs = max(r.registers or 0 for r in reports)
                spills = max(r.spills or 0 for r in reports)
                shared = max(r.shared_bytes or 0 for r in reports)
                bad = [r for r in reports if not r.fits]
                status = "ok" if not bad else (
                    "compile_error" if (bad[0].reason or "").startswith("compile_error") else "out_of_resources")
                error = bad[0].reason if bad else None
            store.record(run_id, _trial(op, cand, target.key, key_json, status, error=error, registers=regs,
                                        spills=spills, shared_bytes=shared))
            rows.append((key_json, cand.variant.name, str(cand.config), status, regs, spills, shared))
            if progress:
                progress.update(task, advance=1, rejected=sum(r[3] != "ok" for r in rows))
    store.finish_run(run_id, "finished")
    return rows, True


def _shape_key(op, shape: dict, dtype: torch.dtype) -> dict:
    """The tuning key of a preset shape without allocating it: inputs are made on the "meta" device
    (falling back to the reduced shape on the CPU for ops whose inputs cannot be made there)."""
    try:
        args = op.validate(**op.make_inputs(shape, device=torch.device("meta"), dtype=dtype, seed=0))
    except (RuntimeError, NotImplementedError):
        args = op.validate(**op.make_inputs(op.reduce_shape(shape), device="cpu", dtype=dtype, seed=0))
    return dict(op.tuning_key(args))


def autotune_call(op, variants, device_info: DeviceInfo, args: dict, store):
    """KREG_AUTOTUNE=1: tune the key of one call on its own (validated) inputs, persist and return the
    winner (None when no config passed the gate)."""
    from registry.testing import TOLERANCE
    from tuning.space import candidates
    from tuning_db.records import canonical_json

    dims = dict(op.tuning_key(args))
    key_json = canonical_json(dims)
    torch_device = args[next(iter(args))].device
    dtype = args[next(iter(args))].dtype
    stats = SweepStats()
    run_id = store.start_run(op.name, device_info, {"autotune_call": key_json})
    _run_key(op, candidates(variants, dims, device_info), dims, key_json, device_info, torch_device, args,
             op.reference(**args), [args], TOLERANCE[dtype], store, run_id, stats, None)
    _promote_winner(op, store, run_id, device_info, key_json, stats)
    store.finish_run(run_id, "finished")
    return store.best(op.name, device_info, key_json)


# --------------------------------------------------------------------------------------------- CLI
def _parse_filter(text: str | None) -> dict[str, int]:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"expected K=V pairs with integer values, got {item!r}")
        out[name.strip()] = int(value)
    return out


class _FilteredVariant:
    """A variant whose space keeps only configs with the requested block sizes and knob values."""

    def __init__(self, variant, wanted: dict[str, int]) -> None:
        self._variant, self._wanted = variant, wanted

    def __getattr__(self, name):
        return getattr(self._variant, name)

    def space(self, key, device):
        def keep(config):
            values = {**config.blocks, **config.knobs()}
            return all(values.get(k) == v for k, v in self._wanted.items())

        return [c for c in self._variant.space(key, device) if keep(c)]


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
    p.add_argument("--filter", default=None, metavar="K=V,...",
                   help="only configs whose blocks/knobs have these values, e.g. BLOCK_H=64,num_stages=2")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default=None,
                   help="input dtype (default: bf16 on a GPU, fp16 in the interpreter)")
    p.add_argument("--db", default=None, help="SQLAlchemy URL (default: KREG_TUNING_DB or the user cache file)")
    p.add_argument("--resume", action="store_true", help="continue the last killed or stopped sweep")
    p.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this many minutes")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every config for the target offline and record registers/spills/LDS")
    p.add_argument("--export", default=None, metavar="DIR", help="write the tuned JSON tables to DIR afterwards")
    p.add_argument("--stale", action="store_true", help="list tuned configs whose kernel source changed, and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs and CI)")
    return p.parse_args(argv)


def _present_device(target: DeviceInfo) -> tuple[DeviceInfo, torch.device]:
    """The device to time on; a clear error when the target is not the device that is present."""
    if target.key == "cpu":
        return target, torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"error: --device {target.key}: no GPU is present on this machine; "
                         f"use --compile-only to compile for {target.arch}, or --device cpu")
    here = detect(torch.device("cuda"))
    if (here.vendor, here.arch) != (target.vendor, target.arch) or here.key != target.key:
        raise SystemExit(f"error: --device {target.key}: this machine has {here.name} ({here.key}, {here.arch}); "
                         f"timings would be wrong. Use --device {here.key.split('-', 1)[-1]} here, "
                         f"or --compile-only to compile for {target.arch}")
    return here, torch.device("cuda")


def _winners_table(store, device_key: str, ops: list[str]):
    from rich.table import Table

    table = Table(title=f"tuned configs on {device_key}")
    for col in ("op", "tuning key", "variant", "config", "ms"):
        table.add_column(col)
    for op in ops:
        for t in store.tuned(op=op, device_key=device_key):
            table.add_row(op, t.tuning_key, t.variant, str(t.config), "-" if t.time_ms is None else f"{t.time_ms:.4f}")
    return table


def _resources_table(target: DeviceInfo, rows: list):
    from rich.table import Table

    table = Table(title=f"compile-only resources for {target.key} ({target.arch})")
    for col in ("tuning key", "variant", "config", "status", "regs", "spills", "shared B"):
        table.add_column(col)
    for key, variant, config, status, regs, spills, shared in rows:
        table.add_row(key, variant, config, status, *("-" if v is None else str(v) for v in (regs, spills, shared)))
    return table


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        target = detect() if args.device == "auto" else preset(args.device) if "-" not in args.device else next(
            p for p in map(preset, ("h100", "h200", "mi300x", "mi355x", "cpu")) if p.key == args.device)
    except (ValueError, StopIteration):
        print(f"error: --device: unknown device {args.device!r}; expected h100, h200, mi300x, mi355x or cpu",
              file=sys.stderr)
        return 2
    if args.compile_only and target.key == "cpu":
        print("error: --compile-only needs a GPU target (h100, h200, mi300x, mi355x), got cpu", file=sys.stderr)
        return 2
    # TRITON_INTERPRET is read when kernels are decorated: settle it before anything imports them.
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
    elif target.key == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if args.db:
        os.environ["KREG_TUNING_DB"] = args.db

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kernels.base import load_all
    from registry.ops import OPS
    from tuning_db.store import TuningDatabaseError, TuningStore, default_url

    console = Console(stderr=True)
    try:
        store = TuningStore(default_url())
    except TuningDatabaseError as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
    registry_variants = load_all()
    if args.stale:
        from tuning_db.store import ShippedTables

        hashes = {(v.vendor, v.name): v.source_hash for vs in registry_variants.values() for v in vs}
        # Shipped tables name their device by key ("<vendor>-<model>"); the database by its device row.
        shipped = [t for t in ShippedTables().tuned()
                   if hashes.get((t.device_key.split("-", 1)[0], t.variant), t.source_hash) != t.source_hash]
        stale = [("database", t) for t in store.stale(hashes)] + [("shipped", t) for t in shipped]
        for where, t in stale:
            print(f"stale ({where}): {t.op} {t.device_key} {t.tuning_key} {t.variant} "
                  f"(tuned for source {t.source_hash})")
        print(f"{len(stale)} stale tuned config(s)")
        return 0

    if not args.compile_only:
        try:
            device_info, torch_device = _present_device(target)
        except SystemExit as err:
            print(err, file=sys.stderr)
            return 2
    else:
        device_info, torch_device = target, torch.device("cpu")
    vendor = "nvidia" if device_info.key == "cpu" else device_info.vendor
    ops = args.op or [name for name in OPS if any(v.vendor == vendor for v in registry_variants.get(name, []))]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        print(f"error: --op: unknown op {unknown[0]!r}; expected one of {', '.join(OPS)}", file=sys.stderr)
        return 2
    preset_name, _, picks = (args.shapes or ("tiny" if device_info.key == "cpu" or args.compile_only
                                             else "full")).partition(":")
    try:
        wanted = _parse_filter(args.filter)
    except ValueError as err:
        print(f"error: --filter: {err}", file=sys.stderr)
        return 2
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, None: None}[args.dtype] or (
        torch.bfloat16 if torch_device.type == "cuda" or args.compile_only else torch.float16)
    deadline = time.monotonic() + 60 * args.max_minutes if args.max_minutes is not None else None

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("rejected {task.fields[rejected]}"), TimeElapsedColumn(),
               TextColumn("best {task.fields[best]}")]
    finished = True
    resources = []
    with Progress(*columns, console=console, disable=args.no_progress) as progress:
        for name in ops:
            op = OPS[name]
            variants = [v for v in registry_variants.get(name, [])
                        if v.vendor == vendor and args.variant in (None, v.name)]
            if not variants:
                which = f"variant {args.variant}" if args.variant else "variant"
                console.print(f"{name}: no {vendor} {which} yet, skipped")
                continue
            if preset_name not in op.presets:
                print(f"error: --shapes: {name} has presets {', '.join(op.presets)}, got {preset_name!r}",
                      file=sys.stderr)
                return 2
            shapes = list(op.presets[preset_name])
            if picks:
                shapes = [shapes[int(i)] for i in picks.split(",")]
            if wanted:
                variants = [_FilteredVariant(v, wanted) for v in variants]
            if args.compile_only:
                rows, finished = compile_only_op(op, variants, device_info, shapes, dtype, store,
                                                 resume=args.resume, deadline=deadline, progress=progress)
                resources += rows
            else:
                _, finished = sweep_op(op, variants, device_info, torch_device, shapes, dtype, store,
                                       resume=args.resume, deadline=deadline, progress=progress)
            if not finished:
                console.print(f"stopped after {args.max_minutes} min; `--resume` continues the sweep")
                break
    # Piped output (logs, CI) keeps whole rows instead of wrapping at 80 columns.
    out = Console(width=None if sys.stdout.isatty() else 220)
    if args.compile_only:
        out.print(_resources_table(device_info, resources))
    else:
        out.print(_winners_table(store, device_info.key, ops))
    if args.export:
        from tuning.export import export_json

        for path in export_json(store, device_info.key, None, args.export):
            console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
