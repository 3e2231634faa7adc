"""Benchmarks against public peers on a GPU: `python -m benchmarks.run`."""

from kreg._checkout import alias as _alias  # noqa: E402

_alias(__name__)  # `import benchmarks` in a checkout is `kreg.benchmarks`
