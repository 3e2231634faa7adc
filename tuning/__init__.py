"""Tuning: correctness-gated sweeps, tuning on first use, offline compile checks, table export and import."""

from kreg._checkout import alias as _alias  # noqa: E402

_alias(__name__)  # `import tuning` in a checkout is `kreg.tuning`
