"""The words every layer shares: launch and call configs (`records`), config spaces (`space`), the
device description (`device`) and profiler ranges (`nvtx`). It imports nothing else of kreg."""
