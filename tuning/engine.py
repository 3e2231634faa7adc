"""The sweep engine: one op's preset shapes tuned on one device into one sweep run (`sweep_op`), or
compiled offline for a target that is not present (`compile_only_op`), and the device a sweep names.

Each shape is one tuning key, tuned by `tuning.tuner.KeyTuner` (role by role, every config gated
against the op's reference on fresh random inputs, a reduced shape when the reference would not fit,
then timed). Every trial is committed as it finishes, so a killed sweep loses nothing and a resumed
run skips what it recorded; a deadline stops cleanly between trials. Trials run in a child process
that is killed when one outlasts the trial timeout. `tuning.fleet` runs this per work unit and
`tuning.sweep` is the command line.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable

import torch

from kreg.core.device import DeviceInfo, detect, preset, usable_cores
from kreg.core.records import TrialResult, canonical_json
from kreg.ops.contract import DTYPE_NAMES, Op
from kreg.tuning.launch_record import meta_calls
from kreg.tuning.tuner import KeyTuner, SweepStats, matches, trial_configs, versions


class UsageError(ValueError):
    """A command-line argument that cannot work; main prints it and exits 2."""


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
             trial_timeout: float | None = None, isolate: bool = True, run_id: int | None = None,
             run_args: dict | None = None) -> tuple[SweepStats, bool]:
    """Sweep one op over `shapes`. Returns (stats, finished): finished is False when the deadline hit.
    The trials go to run `run_id` when given (resumed), else to the op's last unfinished run with
    `resume`, else to a new run whose arguments include `run_args`."""
    from kreg.tuning.trials import DEFAULT_TRIAL_TIMEOUT_S, TrialRunner

    shapes = list(shapes)
    stats = SweepStats()
    if run_id is None and resume:
        run_id = store.resumable_run(op.name, device_info)
    if run_id is None:
        run_id = store.start_run(op.name, device_info, {"dtype": DTYPE_NAMES[dtype], "shapes": shapes,
                                                        "roles": None if roles is None else list(roles),
                                                        **(run_args or {})})
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


def sample_configs(configs: list, default, count: int, seed: str) -> list:
    """The role's default config (when in its space) and `count` others drawn from `configs`, the same
    ones for the same seed on every machine."""
    rest = [c for c in configs if c != default]
    chosen = random.Random(seed).sample(rest, min(count, len(rest)))
    return ([default] if default in configs else []) + chosen


# The reason of a compile-only trial whose role the key's calls do not launch.
NOT_LAUNCHED = "not launched by this key's calls"


def compile_only_op(op: Op, variants, target: DeviceInfo, shapes: Iterable[dict], dtype: torch.dtype, store,
                    *, resume: bool, deadline: float | None, progress=None, roles: Iterable[str] | None = None,
                    wanted: dict[str, int] | None = None, sample: int | None = None, pool=None) -> tuple[list, bool]:
    """Compile configs of every role for `target` offline (the other roles at their defaults), in the
    processes of `pool` (`compile_check.compile_pool`; None: this one); record resources; prune what
    spills or does not fit. Every config of each role's space, or with `sample` `sample` of them drawn
    with a seed of the op, key, variant and role; and each role's default at the key either way."""
    from kreg.tuning.compile_check import check_variant, compile_all, unfit

    run_id = store.resumable_run(op.name, target) if resume else None
    if run_id is None:
        run_id = store.start_run(op.name, target, {"compile_only": True, "dtype": DTYPE_NAMES[dtype], "sample": sample})
    triton_version, torch_version = versions()
    # A compile's result depends only on the kernel source, the config and Triton: with `resume`, what any
    # compile-only run of this op on this device recorded for them is not compiled again (so a finished
    # full-space run exports its report at once).
    runs = [i for i, _, run_args in store.runs(op.name, target.key) if run_args.get("compile_only")] \
        if resume else [run_id]
    done = {(t.variant, t.source_hash, t.tuning_key, t.config.to_json(), t.role) for i in runs
            for t in store.trials(run_id=i) if i == run_id or t.triton_version == triton_version}
    plan = []  # (variant, dims, key_json, calls, role, config, call), what is left to compile
    for shape in shapes:
        dims = shape_key(op, shape, dtype)
        key_json = canonical_json(dims)
        calls = meta_calls(op.name, shape, dtype)
        for variant in (v for v in variants if v.supports(dims, target)):
            default = variant.default_config(dims, target)
            for role, configs in trial_configs(variant, dims, target, roles, wanted or {}).items():
                if sample is not None:
                    seed = f"{op.name} {key_json} {variant.name} {role}"
                    configs = sample_configs(configs, default[role], sample, seed)
                if default[role] not in configs and matches(default[role], wanted or {}):
                    # What dispatch runs at this key when nothing is tuned, in its space or not (a default
                    # cut down to a small key may lie outside it): the report must say what it costs.
                    configs = [default[role], *configs]
                plan += [(variant, dims, key_json, calls, role, c, default.replace(role, c)) for c in configs
                         if (variant.name, variant.source_hash, key_json, default.replace(role, c).to_json(), role)
                         not in done]
    rows = []
    task = progress.add_task(f"{op.name} -> {target.arch}", total=len(plan), rejected=0) if progress else None
    # In chunks, so a deadline stops between them; each chunk compiles in parallel, then is recorded.
    chunk = 4 * usable_cores() if pool is not None else 1
    for start in range(0, len(plan), chunk):
        if deadline is not None and time.monotonic() > deadline:
            store.finish_run(run_id, "stopped")
            return rows, False
        part = plan[start:start + chunk]
        if pool is not None:
            compile_all([(v, calls, call, (role,)) for v, dims, _, calls, role, c, call in part
                         if v.prune_reason(role, c, dims, target) is None], target, pool=pool)
        for variant, dims, key_json, calls, role, config, call in part:
            regs = spills = shared = None
            reason = variant.prune_reason(role, config, dims, target)
            if reason:
                status, error = "pruned", reason
            else:
                reports = check_variant(variant, calls, call, target, roles=(role,))
                regs = max((r.registers or 0 for r in reports), default=None)
                spills = max((r.spills or 0 for r in reports), default=None)
                shared = max((r.shared_bytes or 0 for r in reports), default=None)
                # A role this key's calls never launch (decode's combine when one split writes the outputs)
                # compiles nothing: recorded as such, not as a config that fits.
                status, error = unfit(reports) or (("ok", None) if reports else ("pruned", NOT_LAUNCHED))
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


def target_device(name: str) -> DeviceInfo:
    """The DeviceInfo `--device` names (auto: the device present)."""
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


def present_device(target: DeviceInfo) -> tuple[DeviceInfo, torch.device]:
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
