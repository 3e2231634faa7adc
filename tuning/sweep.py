"""Correctness-gated autotune sweeps: `python -m tuning.sweep --device h200 [--op flash_attention]`.

A call launches one kernel per role, so a variant's call config is tuned one role at a time, in the
variant's role order: every config of the role's space that survives static pruning (and, on a GPU,
the offline spill and shared-memory check) takes that role's place in the current call config, is
gated against the op's reference on fresh random inputs (a reduced shape when the reference would not
fit; gradients against the reference's autograd for a backward role) and, when right, timed: forward
roles on the forward call, backward roles on the backward alone. The role's fastest config then stays
for the next role. Roles are separate kernels whose times add, so this finds what trying the product
of the spaces would, at the cost of their sum. The start is the variant's best known entry for the key
(your database, then the shipped tables) or its default.

Per key the winner is the variant with the fastest forward; its call config is upserted unless an
earlier measurement of the same kernels on this device was faster. Every trial is committed as it
finishes, so a killed sweep loses nothing and `--resume` continues it; `--max-minutes` stops cleanly
between trials. Trials run in a child process that is killed when one outlasts `--trial-timeout`.

`--compile-only` instead compiles every config for a target that is not present (AMD from an NVIDIA
or CPU machine) and records registers, spills and shared memory/LDS, pruning what does not fit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kreg.core.device import INTERPRETER_VENDOR, DeviceInfo, detect, preset
from kreg.core.records import CallConfig, LaunchConfig, TrialResult, TunedConfig, canonical_json, is_backward_role
from kreg.core.space import INTERPRETER_DTYPE, KNOB_NAMES
from kreg.ops.contract import DTYPE_NAMES, Op
from kreg.tuning_db.errors import TuningDatabaseError


@dataclass
class SweepStats:
    done: int = 0
    rejected: int = 0
    skipped: int = 0
    best_ms: float | None = None
    best: str = "-"
    winners: list = field(default_factory=list)


def _versions() -> tuple[str, str]:
    import triton

    return triton.__version__, torch.__version__


def phase(role: str) -> str:
    return "backward" if is_backward_role(role) else "forward"


def matches(config: LaunchConfig, wanted: dict[str, int]) -> bool:
    """Whether a config has every `--filter` value (block sizes and knobs by name)."""
    values = {**config.blocks, **config.knobs()}
    return all(values.get(name) == value for name, value in wanted.items())


def plan(variant, dims: dict, device: DeviceInfo, roles: Iterable[str] | None,
         wanted: dict[str, int]) -> dict[str, list[LaunchConfig]]:
    """The configs a sweep tries for each role of `variant` at this key: the role's space, only the
    roles asked for and only configs with the `--filter` values (a role with none is not tuned)."""
    return {role: [c for c in configs if matches(c, wanted)]
            for role, configs in variant.space(dims, device).items() if roles is None or role in roles}


def shape_key(op: Op, shape: dict, dtype: torch.dtype) -> dict:
    """The tuning key of a preset shape without allocating it: inputs are made on the "meta" device
    (falling back to the reduced shape on the CPU for ops whose inputs cannot be made there)."""
    try:
        args = op.validate(**op.make_inputs(shape, device=torch.device("meta"), dtype=dtype, seed=0))
    except (RuntimeError, NotImplementedError):
        args = op.validate(**op.make_inputs(op.reduce_shape(shape), device="cpu", dtype=dtype, seed=0))
    return dict(op.tuning_key(args))


def _spills_or_overflows(variant, dims: dict, config: CallConfig, role: str,
                         device_info: DeviceInfo) -> tuple[str, str] | None:
    """On a GPU, a config whose role's kernels spill registers or overflow shared memory/LDS is
    rejected before it is timed (shipped configs must be spill-free): (status, reason), or None when
    it fits. The interpreter has no registers to check."""
    if device_info.key == "cpu":
        return None
    from kreg.tuning.compile_check import check_variant, unfit

    return unfit(check_variant(variant, dims, config, device_info, roles=(role,)))


@dataclass
class _Outcome:
    variant: object
    config: CallConfig
    times: dict[str, float]


class KeyTuner:
    """Tunes keys of one op on one device within one sweep run, recording every trial.

    `prepare()` is called before the first trial of a key that needs running (the runner makes the
    key's inputs then, not for keys a resumed run already finished)."""

    def __init__(self, op: Op, device_info: DeviceInfo, store, run_id: int, runner, *, deadline: float | None,
                 roles: Iterable[str] | None = None, wanted: dict[str, int] | None = None,
                 stats: SweepStats | None = None, progress=None, task=None) -> None:
        from kreg.ops.catalog import load_all

        self.op, self.device_info, self.store, self.run_id, self.runner = op, device_info, store, run_id, runner
        self.deadline, self.roles, self.wanted = deadline, roles, wanted or {}
        self.stats, self.progress, self.task = stats or SweepStats(), progress, task
        self.recorded: list[TrialResult] = store.trials(run_id=run_id)
        self.done = {self._done_key(t.variant, t.source_hash, t.tuning_key, t.config, t.role) for t in self.recorded}
        self.hashes = {(v.vendor, v.name): v.source_hash for v in load_all().get(op.name, [])}
        self.triton_version, self.torch_version = _versions()

    @staticmethod
    def _done_key(variant: str, source_hash: str, key_json: str, config: CallConfig, role: str | None):
        return variant, source_hash, key_json, config.to_json(), role

    def plans(self, pool, dims: dict) -> dict:
        return {v: plan(v, dims, self.device_info, self.roles, self.wanted) for v in pool}

    def tune(self, pool, dims: dict, key_json: str, prepare: Callable[[], None]) -> bool:
        """Tune every variant of `pool` at this key and promote the winner. False when the deadline
        stopped it (nothing is promoted then; a resumed run finishes the key)."""
        outcomes = []
        for variant, roles in self.plans(pool, dims).items():
            outcome = self._tune_variant(variant, roles, dims, key_json, prepare)
            if outcome is False:
                return False
            if outcome is not None:
                outcomes.append(outcome)
        if outcomes:
            self._promote(min(outcomes, key=lambda o: o.times["forward"]), key_json)
        return True

    def _start(self, variant, dims: dict, key_json: str) -> CallConfig:
        """Where tuning the variant at this key starts: the variant's best known call config for the key
        (database, then shipped tables), else its default. A resumed run starts where it first started:
        its earliest trial of the variant and key differs from that start only in the role it varied,
        which the first stage replaces anyway (the database may hold this run's own winner by now)."""
        from kreg.tuning_db.table_files import shipped_tables

        for trial in self.recorded:
            if (trial.variant, trial.source_hash, trial.tuning_key) == (variant.name, variant.source_hash, key_json):
                return variant.complete(trial.config, dims, self.device_info)
        for source in (self.store, shipped_tables()):
            tuned = source.best(self.op.name, self.device_info, key_json)
            if tuned is not None and tuned.variant == variant.name \
                    and tuned.variant_vendor == variant.vendor:
                return variant.complete(tuned.config, dims, self.device_info)
        return variant.default_config(dims, self.device_info)

    def _phases(self, variant) -> set[str]:
        backward = self.op.differentiable and any(is_backward_role(r) for r in variant.roles)
        return {"forward", "backward"} if backward else {"forward"}

    def _tune_variant(self, variant, roles: dict[str, list[LaunchConfig]], dims: dict, key_json: str, prepare):
        """The variant's tuned (config, phase times), None when no config of some role passed, False when
        the deadline stopped it."""
        current = self._start(variant, dims, key_json)
        times: dict[str, float] = {}
        for role, configs in roles.items():
            if not configs:
                continue
            self._precompile(variant, dims, key_json, current, role, configs)
            for config in configs:
                if not self._try(variant, current.replace(role, config), role, dims, key_json, prepare):
                    return False
            best = self._best(variant, key_json, role, current)
            if best is None:
                return None
            current = best.config
            # A role only some calls launch (role_arguments: sparse_mla's deterministic backward) is timed
            # on those calls: its time is not the phase's time of the call a user makes by default.
            if not variant.role_arguments.get(role):
                times[phase(role)] = best.time_ms
        # A phase none of whose default roles was tuned here (--roles, --filter) is timed once as it stands.
        for missing in sorted(self._phases(variant) - times.keys()):
            in_phase = [r for r in variant.roles if phase(r) == missing]
            role = next((r for r in in_phase if not variant.role_arguments.get(r)), in_phase[0])
            if not self._try(variant, current, role, dims, key_json, prepare):
                return False
            best = self._best(variant, key_json, role, current, exact=True)
            if best is None:
                return None
            times[missing] = best.time_ms
        return _Outcome(variant, current, times)

    def _precompile(self, variant, dims: dict, key_json: str, current: CallConfig, role: str, configs) -> None:
        """On a GPU, the offline compile checks of a stage's untried configs, in parallel processes."""
        if self.device_info.key == "cpu":
            return
        from kreg.tuning.compile_check import check_many

        todo = [current.replace(role, c) for c in configs
                if variant.prune_reason(role, c, dims, self.device_info) is None
                and self._done_key(variant.name, variant.source_hash, key_json, current.replace(role, c), role)
                not in self.done]
        check_many(variant, dims, todo, self.device_info, roles=(role,))

    def _best(self, variant, key_json: str, role: str, current: CallConfig, exact: bool = False):
        """The run's fastest passing trial of this role at this key whose other roles are `current`'s."""
        def fits(config: CallConfig) -> bool:
            if exact:
                return config == current
            return set(config.roles()) == set(current.roles()) and all(
                config[r] == current[r] for r in current.roles() if r != role)

        ok = [t for t in self.recorded if t.status == "ok" and t.variant == variant.name and t.role == role
              and t.source_hash == variant.source_hash and t.tuning_key == key_json and fits(t.config)]
        return min(ok, key=lambda t: t.time_ms) if ok else None

    def _try(self, variant, config: CallConfig, role: str, dims: dict, key_json: str, prepare) -> bool:
        """Run and record one trial unless this run has it already; False when the deadline has passed."""
        if self._done_key(variant.name, variant.source_hash, key_json, config, role) in self.done:
            self.stats.skipped += 1
            self._advance()
            return True
        if self.deadline is not None and time.monotonic() > self.deadline:
            return False
        ms = None
        reason = variant.prune_reason(role, config[role], dims, self.device_info)
        if reason:
            status, error = "pruned", reason
        elif (unfit := _spills_or_overflows(variant, dims, config, role, self.device_info)) is not None:
            status, error = unfit
        else:
            prepare()
            status, ms, error = self.runner.run(variant, config, role)
        self._record(variant, key_json, config, role, status, time_ms=ms, error=error)
        if status == "ok" and phase(role) == "forward" and (self.stats.best_ms is None or ms < self.stats.best_ms):
            self.stats.best_ms, self.stats.best = ms, f"{variant.name} {config} {ms:.3f} ms"
        self.stats.rejected += status not in ("ok", "pruned")
        return True

    def _record(self, variant, key_json: str, config: CallConfig, role: str, status: str, **fields) -> None:
        trial = TrialResult(op=self.op.name, variant=variant.name, vendor=variant.vendor,
                            source_hash=variant.source_hash, device_key=self.device_info.key, tuning_key=key_json,
                            config=config, role=role, status=status, triton_version=self.triton_version,
                            torch_version=self.torch_version, **fields)
        self.store.record(self.run_id, trial)
        self.recorded.append(trial)
        self.done.add(self._done_key(variant.name, variant.source_hash, key_json, config, role))
        self.stats.done += 1
        self._advance()

    def _advance(self) -> None:
        if self.progress:
            self.progress.update(self.task, advance=1, rejected=self.stats.rejected, best=self.stats.best)

    def _promote(self, outcome: _Outcome, key_json: str) -> None:
        variant = outcome.variant
        tuned = TunedConfig(op=self.op.name, device_key=self.device_info.key, tuning_key=key_json,
                            variant=variant.name, vendor=variant.vendor, source_hash=variant.source_hash,
                            config=outcome.config, time_ms=outcome.times["forward"],
                            backward_ms=outcome.times.get("backward"), triton_version=self.triton_version,
                            torch_version=self.torch_version)
        if improves(self.store.best(self.op.name, self.device_info, key_json), tuned, self.hashes):
            self.store.upsert_tuned(tuned, self.device_info)
            self.stats.winners.append(tuned)


def improves(current: TunedConfig | None, new: TunedConfig, hashes: dict[tuple[str, str], str]) -> bool:
    """Whether `new` should replace the stored winner of its key: always, unless the stored one was
    measured on this very device for the current kernels of its variant with the same versions and is
    faster (a sweep slice over part of a space, or of one variant, must not undo a better result of an
    earlier one). Two call configs with the same variant and forward compare by their backward."""
    if current is None or current.time_ms is None:
        return True
    comparable = (current.device_key == new.device_key
                  and (current.triton_version, current.torch_version) == (new.triton_version, new.torch_version)
                  and hashes.get((current.variant_vendor, current.variant)) == current.source_hash)
    if not comparable or current.config == new.config:
        return True

    def forward(config: CallConfig) -> dict:
        return {r: c for r, c in config.items() if not is_backward_role(r)}

    if current.variant == new.variant and forward(current.config) == forward(new.config):
        if current.backward_ms is None or new.backward_ms is None:
            return True
        return new.backward_ms <= current.backward_ms
    return new.time_ms <= current.time_ms


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
            prepared = []

            def prepare(shape=shape, prepared=prepared) -> None:
                if not prepared:
                    runner.prepare(shape, dtype, seed)
                    prepared.append(True)

            if not tuner.tune(pool, dims, canonical_json(dims), prepare):
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
    triton_version, torch_version = _versions()
    rows = []
    task = progress.add_task(f"{op.name} -> {target.arch}", total=None, rejected=0, best="-") if progress else None
    for shape in shapes:
        dims = shape_key(op, shape, dtype)
        key_json = canonical_json(dims)
        for variant in (v for v in variants if v.supports(dims, target)):
            default = variant.default_config(dims, target)
            for role, configs in plan(variant, dims, target, roles, wanted or {}).items():
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
                        reports = check_variant(variant, dims, call, target, roles=(role,))
                        regs = max(r.registers or 0 for r in reports)
                        spills = max(r.spills or 0 for r in reports)
                        shared = max(r.shared_bytes or 0 for r in reports)
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


def _parse_filter(text: str | None) -> dict[str, int]:
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
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
    p.add_argument("--stale", action="store_true", help="list tuned configs whose kernel source changed, and exit")
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
        if not pick.strip().isdigit() or int(pick) >= len(shapes):
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
            if any(plan(variant, dims, device, roles, wanted).values()):
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


def _stale(store, registry_variants) -> int:
    from kreg.tuning_db.table_files import ShippedTables

    hashes = {(v.vendor, v.name): v.source_hash for vs in registry_variants.values() for v in vs}
    shipped = [t for t in ShippedTables().tuned()
               if hashes.get((t.variant_vendor, t.variant), t.source_hash) != t.source_hash]
    stale = [("database", t) for t in store.stale(hashes)] + [("shipped", t) for t in shipped]
    for where, t in stale:
        print(f"stale ({where}): {t.op} {t.device_key} {t.tuning_key} {t.variant} (tuned for source {t.source_hash})")
    print(f"{len(stale)} stale tuned config(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return _main(args)
    except (UsageError, TuningDatabaseError) as err:
        # A database failure mid-sweep loses nothing recorded so far (`--resume` continues); its message
        # names the database without the URL's password.
        print(f"error: {err}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    target = _target(args.device)
    if args.compile_only and target.key == "cpu":
        raise UsageError("--compile-only needs a GPU target (h100, h200, mi300x, mi355x), got cpu")
    if args.max_minutes is not None and args.max_minutes < 0:
        raise UsageError(f"--max-minutes: expected a number of minutes >= 0, got {args.max_minutes:g}")
    if args.trial_timeout is not None and args.trial_timeout <= 0:
        raise UsageError(f"--trial-timeout: expected a positive number of seconds, got {args.trial_timeout:g}")
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
        return _stale(store, registry_variants)

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
        from kreg.tuning.export import export_json

        for path in export_json(store, device_info.key, None, args.export):
            console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
