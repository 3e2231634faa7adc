"""Tuning on first use (`KREG_AUTOTUNE=1`): a call whose key has no tuned entry is swept on the call's
own validated inputs, in this process, before it runs; the winner is stored in the user's database,
so the next process finds it there. Only dispatch calls this; sweeps over presets are `tuning.sweep`.

The caller's inputs serve as both the gate and the timing inputs, so the reference must fit next to
them, and a trial that hangs hangs the call (there is no child process to kill, unlike a sweep).
"""

from __future__ import annotations

import functools

from kreg.core.device import DeviceInfo
from kreg.core.records import TunedConfig, canonical_json
from kreg.ops.contract import Op


def autotune_call(op: Op, variants, device_info: DeviceInfo, args: dict, store) -> TunedConfig | None:
    """Tune the key of one call (validated `args`) over `variants`, persist and return the winner
    (None when no config passed the gate)."""
    from kreg.tuning.launch_record import meta_like
    from kreg.tuning.trials import KeyInputs, TrialRunner
    from kreg.tuning.tuner import KeyTuner

    dims = dict(op.tuning_key(args))
    key_json = canonical_json(dims)
    inputs = KeyInputs.for_args(op, args)
    run_id = store.start_run(op.name, device_info, {"autotune_call": key_json})
    with TrialRunner(op.name, inputs.device, isolate=False) as runner:
        runner.use(inputs)
        tuner = KeyTuner(op, device_info, store, run_id, runner, deadline=None)
        calls = functools.cache(lambda: meta_like(op.name, args))
        tuner.tune(variants, dims, key_json, prepare=lambda: None, calls=calls)
    store.finish_run(run_id, "finished")
    return store.best(op.name, device_info, key_json)
