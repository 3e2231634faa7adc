"""One trial: a call config gated against the op's reference, then timed; and the runner that keeps a
hanging kernel from stopping a sweep.

A trial varies one kernel role. A forward role is gated on the call's outputs and timed on the forward
call; a backward role (`bwd...`) is gated on the gradients, against the reference's autograd in fp32,
and timed on the backward alone. Both run with the role's `Variant.role_arguments` added to the key's
inputs (the calls that launch that role). A wrong result is never timed.

`TrialRunner` runs trials in a child process (spawned, so it holds its own GPU context): when a trial
outlasts its timeout the child is killed, the trial is a `timeout`, and a new child takes the next
one. A child that dies (a crash in a driver, say) makes that trial a `runtime_error`. In-process
running (`isolate=False`) is for tuning on first use, where the inputs are the caller's tensors.
"""

from __future__ import annotations

import multiprocessing
import traceback
from dataclasses import dataclass, field

import torch

from kreg.core.records import CallConfig, is_backward_role
from kreg.ops.testing import (
    GRAD_TOLERANCE,
    TOLERANCE,
    backward_call,
    cotangent,
    first_output,
    gradient_error,
    output_error,
    reference_gradients,
)
from kreg.ops.variant import CallPlan
from kreg.tuning.bench import rotating, time_call

# How long one trial (compile, gate, time) may take, and the setup of a key's inputs and reference.
DEFAULT_TRIAL_TIMEOUT_S = 300.0
SETUP_TIMEOUT_S = 900.0


def classify(err: BaseException) -> str:
    """The trial status of an exception from compiling or launching a config, by its type."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    if isinstance(err, OutOfResources | torch.cuda.OutOfMemoryError):
        return "out_of_resources"
    if isinstance(err, CompilationError | PTXASError):
        return "compile_error"
    return "runtime_error"


def short_error(err: BaseException) -> str:
    lines = [ln for ln in traceback.format_exception_only(type(err), err) if ln.strip()]
    return "".join(lines).strip()[-2000:]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class KeyInputs:
    """What every trial of one tuning key shares: the gate's inputs and reference outputs (a reduced
    shape when the reference would not fit), the full-shape input sets timings rotate through, and,
    made on the first backward trial, the reference's gradients."""

    op: object
    gate_args: dict
    gate_ref: object
    full_sets: list[dict]
    device: torch.device
    dtype: torch.dtype
    _grads: tuple | None = field(default=None, repr=False)

    @classmethod
    def for_shape(cls, op, shape: dict, device: torch.device, dtype: torch.dtype, seed: int) -> KeyInputs:
        """Fresh random inputs for a preset shape (never zeros)."""
        full = op.validate(**op.make_inputs(shape, device=device, dtype=dtype, seed=seed))
        reduced = op.reduce_shape(shape)
        gate = full if reduced == shape else op.validate(
            **op.make_inputs(reduced, device=device, dtype=dtype, seed=seed + 1000))
        sets = [full] + [op.validate(**op.make_inputs(shape, device=device, dtype=dtype, seed=seed + 1 + i))
                         for i in range(_rotation_count(op, full, device) - 1)]
        return cls(op, gate, op.reference(**gate), sets, device, dtype)

    @classmethod
    def for_args(cls, op, args: dict) -> KeyInputs:
        """A caller's own validated arguments, gate and timing alike (tuning on first use)."""
        first = next(t for t in args.values() if isinstance(t, torch.Tensor))
        return cls(op, args, op.reference(**args), [args], first.device, first.dtype)

    def reference_gradients(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        if self._grads is None:
            dout = cotangent(first_output(self.gate_ref))
            self._grads = (reference_gradients(self.op, self.gate_args, dout), dout)
        return self._grads


def _rotation_count(op, args: dict, device: torch.device) -> int:
    """Enough input sets that one call's bytes times the count exceed a 60 MB L2 (at most 4)."""
    if device.type != "cuda":
        return 1
    per_call = max(op.bytes_moved(args), 1.0)
    return int(min(4, max(1, -(-60e6 // per_call))))


def run_trial(inputs: KeyInputs, variant, plan: CallPlan, role: str) -> tuple[str, float | None, str | None]:
    """Gate the plan's call config (varying `role`) on the key's inputs, then time its phase: (status, ms,
    error)."""
    op, device = inputs.op, inputs.device
    # The role's own arguments (Variant.role_arguments) on top of the key's inputs; the reference ignores them.
    extra = variant.role_arguments.get(role, {})
    gate_args = {**inputs.gate_args, **extra}
    full_sets = [{**args, **extra} for args in inputs.full_sets]
    launch = variant.bind(plan)
    try:
        if is_backward_role(role):
            expected, dout = inputs.reference_gradients()
            err = gradient_error(op, lambda a: launch(a), gate_args, dout, expected)
            tol = GRAD_TOLERANCE[inputs.dtype]
        else:
            out = launch(gate_args)
            _synchronize(device)
            err, tol = output_error(op, out, inputs.gate_ref, inputs.gate_args), TOLERANCE[inputs.dtype]
        if not err <= tol:
            return "wrong_result", None, f"relative error {err:.3g} > {tol:.3g}"
        if is_backward_role(role):
            ms = time_call(backward_call(op, lambda a: launch(a), full_sets[0]), device)
        else:
            ms = time_call(rotating(lambda a: launch(a), full_sets), device)
        return "ok", ms, None
    except Exception as exc:  # noqa: BLE001 - every failure of a config is a recorded trial, not a crash
        try:
            _synchronize(device)
        except Exception:  # noqa: BLE001 - a failed launch can leave the context broken; report the first error
            pass
        return classify(exc), None, short_error(exc)


# ----------------------------------------------------------------------------- the runner
def _worker(conn) -> None:
    """The child's loop: ("key", op name, shape, device, dtype, seed) prepares a key's inputs,
    ("trial", variant, config json, key, device info, role) runs one trial; None ends it."""
    from kreg.ops import OPS

    inputs = None
    while True:
        message = conn.recv()
        if message is None:
            return
        if message[0] == "key":
            _, op_name, shape, device, dtype, seed = message
            try:
                inputs = KeyInputs.for_shape(OPS[op_name], shape, torch.device(device), dtype, seed)
                conn.send(("ready", None))
            except Exception as exc:  # noqa: BLE001 - reported to the sweep, which stops with it
                conn.send(("failed", short_error(exc)))
        else:
            _, variant, config_json, key, device_info, role = message
            conn.send(run_trial(inputs, variant, CallPlan(CallConfig.from_json(config_json), key, device_info), role))


class TrialRunner:
    """Runs the trials of one op, a key at a time, under a per-trial timeout.

    isolate=True (sweeps): a spawned child process prepares each key's inputs and runs its trials; a
    trial that outlasts `timeout_s` gets its child killed and is reported as a timeout; the next trial
    starts a new child (which prepares the key again). isolate=False: trials run in this process on
    inputs given with `use` (no watchdog: tuning on first use)."""

    def __init__(self, op_name: str, device: torch.device, *, timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
                 isolate: bool = True) -> None:
        self.op_name, self.device, self.timeout_s, self.isolate = op_name, torch.device(device), timeout_s, isolate
        self._key: tuple | None = None  # (shape, dtype, seed) of the prepared key
        self._ready = False
        self._inputs: KeyInputs | None = None
        self._process = self._conn = None
        self._exit_code: int | None = None

    def __enter__(self) -> TrialRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def use(self, inputs: KeyInputs) -> None:
        """In-process runner: run the next trials on these inputs."""
        self._inputs = inputs

    def prepare(self, shape: dict, dtype: torch.dtype, seed: int) -> None:
        """Make the inputs of the key of `shape` current (done in the child when the first trial needs it)."""
        if self.isolate:
            self._key, self._ready = (shape, dtype, seed), False
        else:
            from kreg.ops import OPS

            self._inputs = KeyInputs.for_shape(OPS[self.op_name], shape, self.device, dtype, seed)

    def run(self, variant, plan: CallPlan, role: str) -> tuple[str, float | None, str | None]:
        """(status, ms, error) of one trial."""
        if not self.isolate:
            return run_trial(self._inputs, variant, plan, role)
        if not self._ready:
            self._start_key()
        self._conn.send(("trial", variant, plan.config.to_json(), dict(plan.key), plan.device, role))
        answer = self._answer(self.timeout_s)
        if answer is None:
            return "timeout", None, f"the trial did not finish in {self.timeout_s:g} s; its process was killed"
        if answer == "died":
            return "runtime_error", None, f"the trial's process died (exit code {self._exit_code})"
        return answer

    def _start_key(self) -> None:
        if self._process is None or not self._process.is_alive():
            self._spawn()
        shape, dtype, seed = self._key
        self._conn.send(("key", self.op_name, shape, str(self.device), dtype, seed))
        answer = self._answer(max(SETUP_TIMEOUT_S, self.timeout_s))
        if answer is None or answer == "died":
            raise RuntimeError(f"{self.op_name}: preparing the inputs of {shape} failed "
                               f"({'timed out' if answer is None else 'the process died'})")
        if answer[0] != "ready":
            raise RuntimeError(f"{self.op_name}: preparing the inputs of {shape} failed: {answer[1]}")
        self._ready = True

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_worker, args=(child,), daemon=True)
        self._process.start()
        child.close()

    def _answer(self, timeout_s: float):
        """The child's answer; None when it did not come in time (the child is then killed), "died"
        when the child ended without one."""
        try:
            if self._conn.poll(timeout_s):
                return self._conn.recv()
        except (EOFError, OSError):
            self._stop()
            return "died"
        self._stop()
        return None

    def _stop(self) -> None:
        """Kill the child (a hung kernel cannot be interrupted any other way); the next trial starts a
        new one and prepares its key again."""
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._exit_code = self._process.exitcode
        self._process = None
        self._ready = False

    def close(self) -> None:
        if self._process is not None and self._process.is_alive():
            try:
                self._conn.send(None)
                self._process.join(timeout=10)
            except (OSError, EOFError):
                pass
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._process = None
