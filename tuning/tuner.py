"""The tuner: how one tuning key of one op is tuned on one device, role by role, every trial recorded.

A call launches one kernel per role, so a variant's call config is tuned one role at a time, in the
variant's role order: every config of the role's space that survives static pruning (and, on a GPU,
the offline spill and shared-memory check) takes that role's place in the current call config, is
gated against the op's reference and, when right, timed (`tuning.trials`): forward roles on the
forward call, backward roles on the backward alone. The role's fastest config then stays for the next
role. Roles are separate kernels whose times add, so this finds what trying the product of the spaces
would, at the cost of their sum. The start is the variant's best known entry for the key (the
database, then the shipped tables) or its default.

Per key the winner is the variant with the fastest forward; its call config is upserted unless an
earlier measurement of the same kernels on this device was faster (`improves`, asked again inside the
write transaction, so sweeps of one key on several GPUs keep the fastest entry). Sweeps over presets
(`tuning.sweep`) and tuning on first use (`tuning.autotune`) both tune through `KeyTuner`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kreg.core.device import DeviceInfo
from kreg.core.records import CallConfig, LaunchConfig, TrialResult, TunedConfig, is_backward_role
from kreg.ops.catalog import load_all
from kreg.ops.contract import Op
from kreg.ops.variant import CallPlan
from kreg.tuning_db.table_files import shipped_tables

# The meta calls of a key (`launch_record.meta_calls`) the compile check records, made on first need.
Calls = Callable[[], list[dict]]


@dataclass
class SweepStats:
    done: int = 0
    rejected: int = 0
    skipped: int = 0
    best_ms: float | None = None
    best: str = "-"
    winners: list = field(default_factory=list)


def versions() -> tuple[str, str]:
    import triton

    return triton.__version__, torch.__version__


def phase(role: str) -> str:
    return "backward" if is_backward_role(role) else "forward"


def matches(config: LaunchConfig, wanted: dict[str, int]) -> bool:
    """Whether a config has every `--filter` value (block sizes and knobs by name)."""
    values = {**config.blocks, **config.knobs()}
    return all(values.get(name) == value for name, value in wanted.items())


def trial_configs(variant, dims: dict, device: DeviceInfo, roles: Iterable[str] | None,
                  wanted: dict[str, int]) -> dict[str, list[LaunchConfig]]:
    """The configs a sweep tries for each role of `variant` at this key: the role's space, only the
    roles asked for and only configs with the `--filter` values (a role with none is not tuned)."""
    return {role: [c for c in configs if matches(c, wanted)]
            for role, configs in variant.space(dims, device).items() if roles is None or role in roles}


def _spills_or_overflows(variant, calls: Calls, config: CallConfig, role: str,
                         device_info: DeviceInfo) -> tuple[str, str] | None:
    """On a GPU, a config whose role's kernels spill registers or overflow shared memory/LDS is
    rejected before it is timed (shipped configs must be spill-free): (status, reason), or None when
    it fits. The interpreter has no registers to check."""
    if device_info.key == "cpu":
        return None
    from kreg.tuning.compile_check import check_variant, unfit

    return unfit(check_variant(variant, calls(), config, device_info, roles=(role,)))


@dataclass
class _Outcome:
    variant: object
    config: CallConfig
    times: dict[str, float]


class KeyTuner:
    """Tunes keys of one op on one device within one sweep run, recording every trial.

    `prepare()` is called before the first trial of a key that needs running (the runner makes the
    key's inputs then, not for keys a resumed run already finished); `calls()` gives the key's meta
    calls for the compile checks of a GPU sweep."""

    def __init__(self, op: Op, device_info: DeviceInfo, store, run_id: int, runner, *, deadline: float | None,
                 roles: Iterable[str] | None = None, wanted: dict[str, int] | None = None,
                 stats: SweepStats | None = None, progress=None, task=None) -> None:
        self.op, self.device_info, self.store, self.run_id, self.runner = op, device_info, store, run_id, runner
        self.deadline, self.roles, self.wanted = deadline, roles, wanted or {}
        self.stats, self.progress, self.task = stats or SweepStats(), progress, task
        self.recorded: list[TrialResult] = store.trials(run_id=run_id)
        self.done = {self._done_key(t.variant, t.source_hash, t.tuning_key, t.config, t.role) for t in self.recorded}
        self.hashes = {(v.vendor, v.name): v.source_hash for v in load_all().get(op.name, [])}
        self.triton_version, self.torch_version = versions()
        self.calls: Calls = list  # the current key's (tune)

    @staticmethod
    def _done_key(variant: str, source_hash: str, key_json: str, config: CallConfig, role: str | None):
        return variant, source_hash, key_json, config.to_json(), role

    def plans(self, pool, dims: dict) -> dict:
        return {v: trial_configs(v, dims, self.device_info, self.roles, self.wanted) for v in pool}

    def tune(self, pool, dims: dict, key_json: str, prepare: Callable[[], None], calls: Calls) -> bool:
        """Tune every variant of `pool` at this key and promote the winner. False when the deadline
        stopped it (nothing is promoted then; a resumed run finishes the key)."""
        self.calls = calls
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
        check_many(variant, self.calls(), todo, self.device_info, roles=(role,))

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
        elif (unfit := _spills_or_overflows(variant, self.calls, config, role, self.device_info)) is not None:
            status, error = unfit
        else:
            prepare()
            status, ms, error = self.runner.run(variant, CallPlan(config, dims, self.device_info), role)
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
        # Against the entry another variant or device of the key may hold, then inside the write against
        # this device's own entry, which a sweep on another GPU may have written since.
        if not improves(self.store.best(self.op.name, self.device_info, key_json), tuned, self.hashes):
            return
        def replace(stored: TunedConfig) -> bool:
            return improves(stored, tuned, self.hashes)

        if self.store.upsert_tuned(tuned, self.device_info, replace=replace):
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
