"""A sweep's work as units, spread over the GPUs of a machine or of a Ray cluster.

A unit is one (op, preset shape, variant) with all its roles: what one GPU tunes, gates and times on its
own (`run_unit`, through `engine.sweep_op`), writing every trial and its winner straight to the one store
every worker shares. A unit has its own sweep run in the store, named in the run's arguments by the
unit and by the sweep it belongs to, so:
- a unit whose worker dies is run again (on another GPU when one is free) and resumes its own run: the
  trials already recorded are skipped, nothing recorded is lost;
- `--resume` adopts the latest sweep of the planned units: units it finished are skipped, the others
  resume their runs;
- winners meet in the store: a unit promotes its variant's best call config only when it beats the
  stored winner of its key (`tuner.improves`, decided inside the write transaction), so units of one
  key finishing in any order leave the fastest variant.

Three executors run the same `run_unit`: `Inline` (this process, one unit after another: a plain
`python -m kreg.tuning.sweep`), `Pool` (a process per GPU of this machine, `--gpus N`; on the CPU, N
interpreter processes) and `Ray` (a task per unit on every GPU of a cluster, `--ray [ADDRESS]`).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait

import torch

from kreg.core.device import DeviceInfo
from kreg.core.records import canonical_json
from kreg.tuning.engine import present_device, shape_key, sweep_op, target_device

# A unit is tried this often in all before it is reported as failed (a worker that dies, not a unit
# whose code raises: that fails at once).
MAX_ATTEMPTS = 3
# The variables that give a worker one GPU, by vendor.
VISIBLE_DEVICES = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "ROCR_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class WorkUnit:
    op: str
    preset: str  # "full" or "tiny"
    index: int  # the shape's index in the preset
    variant: str
    vendor: str
    source_hash: str  # the kernels the unit tunes; a worker with other sources refuses the unit

    @property
    def label(self) -> str:
        return f"{self.op} {self.preset}:{self.index} {self.variant}"


@dataclass(frozen=True)
class SweepSpec:
    """What every unit of one sweep shares (sent to every worker)."""

    device: str  # the target as `--device` names it: h200, mi355x, cpu, ...
    db_url: str
    dtype: str  # "bf16" or "fp16"
    sweep_id: str
    roles: tuple[str, ...] | None = None
    wanted: tuple[tuple[str, int], ...] = ()
    trial_timeout: float | None = None
    deadline: float | None = None  # wall clock (time.time()): the same on every host of a cluster

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex[:12]


@dataclass
class UnitResult:
    unit: WorkUnit
    status: str  # "finished", "stopped" (the deadline), "failed"
    trials: int = 0
    rejected: int = 0
    skipped: int = 0
    best: str = "-"
    winners: list[str] = field(default_factory=list)
    error: str | None = None
    where: str = ""
    attempts: int = 1
    seconds: float = 0.0


def stale_entries(store, registry_variants, device_key: str) -> list[tuple[str, object]]:
    """(where, entry) for every tuned entry of `device_key`, in the database ("database") and the shipped
    tables ("shipped"), whose kernel source changed since it was tuned."""
    from kreg.tuning_db.table_files import ShippedTables

    hashes = {(v.vendor, v.name): v.source_hash for vs in registry_variants.values() for v in vs}
    stale = [("database", t) for t in store.stale(hashes) if t.device_key == device_key]
    stale += [("shipped", t) for t in ShippedTables().tuned() if t.device_key == device_key
              and hashes.get((t.variant_vendor, t.variant), t.source_hash) != t.source_hash]
    return stale


def plan_units(work, device_info: DeviceInfo, dtype: torch.dtype) -> list:
    """The sweep's work units: every (op, preset shape, variant that supports the shape's key)."""
    units = []
    for op, variants, preset_name, indices in work:
        for index in indices:
            dims = shape_key(op, op.presets[preset_name][index], dtype)
            units += [WorkUnit(op.name, preset_name, index, v.name, v.vendor, v.source_hash)
                      for v in variants if v.supports(dims, device_info)]
    return units


def stale_units(store, registry_variants, device_info: DeviceInfo, dtype: torch.dtype,
                ops: list[str] | None = None) -> tuple[list, list]:
    """(units, entries left): a unit for each stale tuned entry of the device (database and shipped
    tables) of `ops` (None: every op), the preset shape with the entry's key and the entry's variant;
    the entries whose key no preset shape has are left as they are."""
    from kreg.ops import OPS

    variants = {(v.vendor, v.name): v for vs in registry_variants.values() for v in vs}
    stale = [t for _, t in stale_entries(store, registry_variants, device_info.key) if not ops or t.op in ops]
    keys: dict[tuple[str, str], tuple[str, int]] = {}
    for op_name in sorted({t.op for t in stale}):
        op = OPS[op_name]
        for preset_name in ("full", "tiny"):
            for index, shape in enumerate(op.presets[preset_name]):
                keys.setdefault((op_name, canonical_json(shape_key(op, shape, dtype))), (preset_name, index))
    units, missing = [], []
    for t in stale:
        found = keys.get((t.op, t.tuning_key))
        variant = variants[(t.variant_vendor, t.variant)]
        if found is None:
            missing.append(t)
            continue
        unit = WorkUnit(t.op, found[0], found[1], variant.name, variant.vendor, variant.source_hash)
        if unit not in units:
            units.append(unit)
    return units, missing


def unit_args(unit: WorkUnit, sweep_id: str) -> dict:
    """The run arguments that name a unit's run: the unit and the sweep."""
    return {"unit": asdict(unit), "sweep": sweep_id}


def unit_runs(store, unit: WorkUnit, device_key: str, runs: list | None = None) -> list[tuple[int, str, str]]:
    """(run id, status, sweep id) of every run of `unit` on devices with this key, oldest first; `runs`
    is the op's `store.runs` when the caller has read them already."""
    runs = store.runs(unit.op, device_key) if runs is None else runs
    return [(run_id, status, args.get("sweep", "")) for run_id, status, args in runs
            if args.get("unit") == asdict(unit)]


def resume_point(store, units: Iterable[WorkUnit], device_key: str) -> tuple[str | None, set[WorkUnit]]:
    """(the latest sweep any of `units` ran in, the units it finished): what `--resume` continues."""
    units = list(units)
    by_op = {op: store.runs(op, device_key) for op in {u.op for u in units}}  # one read per op
    runs = {unit: unit_runs(store, unit, device_key, by_op[unit.op]) for unit in units}
    latest = max(((run_id, sweep) for unit_list in runs.values() for run_id, _, sweep in unit_list if sweep),
                 default=None)
    if latest is None:
        return None, set()
    sweep_id = latest[1]
    done = {unit for unit, unit_list in runs.items()
            if any(status == "finished" and sweep == sweep_id for _, status, sweep in unit_list)}
    return sweep_id, done


def run_unit(spec: SweepSpec, unit: WorkUnit, progress=None) -> UnitResult:
    """Tune one unit on this process's device (its GPU, or the interpreter for `cpu`), resuming the
    unit's unfinished run of this sweep if it has one. Imports kernels only here: a worker sets its
    device and the interpreter first."""
    start = time.monotonic()
    target = target_device(spec.device)
    if target.key == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated
    from kreg.ops import OPS
    from kreg.ops.catalog import load_all
    from kreg.tuning_db.store import TuningStore

    where = _where()
    variant = next((v for v in load_all().get(unit.op, []) if (v.name, v.vendor) == (unit.variant, unit.vendor)), None)
    if variant is None or variant.source_hash != unit.source_hash:
        return UnitResult(unit, "failed", where=where, error=f"this worker's kreg has other kernel sources for "
                          f"{unit.variant} ({'none' if variant is None else variant.source_hash}); install the "
                          "coordinator's version on every host")
    device_info, torch_device = present_device(target)
    store = TuningStore(spec.db_url)
    try:
        unfinished = [run_id for run_id, status, sweep in unit_runs(store, unit, device_info.key)
                      if sweep == spec.sweep_id and status in ("running", "stopped")]
        deadline = None if spec.deadline is None else time.monotonic() + (spec.deadline - time.time())
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
        stats, finished = sweep_op(
            OPS[unit.op], [variant], device_info, torch_device, [OPS[unit.op].presets[unit.preset][unit.index]],
            dtype, store, resume=False, run_id=unfinished[-1] if unfinished else None,
            run_args=unit_args(unit, spec.sweep_id), deadline=deadline, progress=progress,
            roles=spec.roles, wanted=dict(spec.wanted), trial_timeout=spec.trial_timeout)
    finally:
        store.close()
    return UnitResult(unit, "finished" if finished else "stopped", trials=stats.done, rejected=stats.rejected,
                      skipped=stats.skipped, best=stats.best,
                      winners=[f"{w.variant} {w.config} {w.time_ms:.4f} ms" for w in stats.winners],
                      where=where, seconds=time.monotonic() - start)


def _where() -> str:
    """Which GPU (or process) this worker is, for the report."""
    import socket

    devices = [f"{name}={os.environ[name]}" for name in (*VISIBLE_DEVICES.values(), "HIP_VISIBLE_DEVICES")
               if name in os.environ]
    return f"{socket.gethostname()} pid {os.getpid()}" + (f" {' '.join(devices)}" if devices else "")


def _failed(unit: WorkUnit, err: BaseException, where: str = "") -> UnitResult:
    lines = traceback.format_exception_only(type(err), err)
    return UnitResult(unit, "failed", error="".join(lines).strip()[-2000:], where=where)


Report = Callable[[UnitResult], None]


class Inline:
    """Every unit in this process, one after another (the default: one GPU, or the interpreter)."""

    name = "this process"

    def __init__(self, progress=None) -> None:
        self.progress = progress

    def run(self, spec: SweepSpec, units: list[WorkUnit], report: Report) -> None:
        for unit in units:
            try:
                result = run_unit(spec, unit, self.progress)
            except Exception as err:  # noqa: BLE001 - reported as the unit's failure; the sweep goes on
                result = _failed(unit, err, _where())
            report(result)
            if result.status == "stopped":
                return


def _pool_worker(spec: SweepSpec, unit: WorkUnit, env: dict[str, str], conn) -> None:
    os.environ.update(env)  # before anything initializes the GPU runtime
    try:
        result = run_unit(spec, unit)
    except Exception as err:  # noqa: BLE001 - sent back as the unit's failure
        result = _failed(unit, err, _where())
    conn.send(result)
    conn.close()


class Pool:
    """A process per slot of this machine (a GPU each, through its vendor's visible-devices variable;
    on the CPU, interpreter processes), each running one unit at a time. A process that dies without a
    result (killed, a crash below Python) has its unit run again, on another slot when one is free."""

    def __init__(self, slots: list[dict[str, str]], on_retry: Callable[[WorkUnit, str], None] | None = None) -> None:
        if not slots:
            raise ValueError("slots: expected at least one")
        self.slots, self.on_retry = slots, on_retry
        self.name = f"{len(slots)} processes"

    @classmethod
    def for_device(cls, vendor: str | None, count: int, on_retry=None) -> Pool:
        """`count` slots: GPUs 0..count-1 of those visible to this process (vendor None: CPU processes)."""
        if vendor is None:
            return cls([{} for _ in range(count)], on_retry)
        variable = VISIBLE_DEVICES[vendor]
        visible = os.environ.get(variable) or os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(count)]
        env = [{variable: ids[i]} for i in range(count)]
        if vendor == "amd":  # HIP applies its own list on top of ROCR's: one device, index 0
            env = [{**e, "HIP_VISIBLE_DEVICES": "0"} for e in env]
        return cls(env, on_retry)

    def run(self, spec: SweepSpec, units: list[WorkUnit], report: Report) -> None:
        running: dict[int, tuple] = {}  # slot -> (process, connection, unit, attempt)
        try:
            self._run(spec, units, report, running)
        finally:  # interrupted: no worker outlives the sweep (their runs stay resumable)
            for process, *_ in running.values():
                process.kill()
                process.join()

    def _run(self, spec: SweepSpec, units: list[WorkUnit], report: Report, running: dict) -> None:
        ctx = multiprocessing.get_context("spawn")
        queue = deque((unit, 1, None) for unit in units)  # (unit, attempt, slot to avoid)
        stopped = False
        while running or (queue and not stopped):
            free = [s for s in range(len(self.slots)) if s not in running]
            while queue and free and not stopped:
                unit, attempt, avoid = queue.popleft()
                slot = next((s for s in free if s != avoid), free[0])
                free.remove(slot)
                receive, send = ctx.Pipe(duplex=False)
                # Not a daemon: the worker spawns its own trial processes (tuning.trials).
                process = ctx.Process(target=_pool_worker, args=(spec, unit, self.slots[slot], send))
                process.start()
                send.close()
                running[slot] = (process, receive, unit, attempt)
            wait([p.sentinel for p, *_ in running.values()] + [c for _, c, *_ in running.values()], timeout=5.0)
            for slot, (process, conn, unit, attempt) in list(running.items()):
                result = None
                if conn.poll():
                    try:
                        result = conn.recv()
                    except (EOFError, OSError):
                        result = None
                elif process.is_alive():
                    continue
                process.join()
                conn.close()
                del running[slot]
                if result is None:  # died without a result: run the unit again (it resumes its run)
                    why = f"exit code {process.exitcode}"
                    if attempt < MAX_ATTEMPTS:
                        if self.on_retry:
                            self.on_retry(unit, f"worker on slot {slot} died ({why}); attempt {attempt + 1}")
                        queue.appendleft((unit, attempt + 1, slot))
                        continue
                    result = UnitResult(unit, "failed", error=f"its worker died {attempt} times (last: {why})")
                result.attempts = attempt
                report(result)
                stopped = stopped or result.status == "stopped"


class Ray:
    """A Ray task per unit on the cluster at `address` (None: a local cluster over this machine's
    GPUs, or its CPUs for the interpreter). Ray gives each task one GPU and runs a task again when its
    worker dies (`max_retries`); the unit then resumes its run."""

    def __init__(self, address: str | None, gpu: bool, env: dict[str, str]) -> None:
        import ray  # the caller turns an ImportError into one clear line

        self.ray = ray
        self.address, self.gpu, self.env = address, gpu, env
        self.name = f"Ray ({address or 'local cluster'})"

    def run(self, spec: SweepSpec, units: list[WorkUnit], report: Report) -> None:
        ray = self.ray
        ray.init(address=self.address, runtime_env={"env_vars": self.env}, log_to_driver=False,
                 include_dashboard=False, ignore_reinit_error=True)
        try:
            task = ray.remote(run_unit).options(max_retries=MAX_ATTEMPTS - 1, num_gpus=1 if self.gpu else 0,
                                                num_cpus=1)
            pending = {task.remote(spec, unit): unit for unit in units}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    unit = pending.pop(ref)
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.RayError as err:
                        result = _failed(unit, err)
                    report(result)
        finally:
            ray.shutdown()
