"""Triton kernels: shared bodies in `common/`, per-vendor variants in `nvidia/` and `amd/`."""

from kreg._checkout import alias as _alias  # noqa: E402

_alias(__name__)  # `import kernels` in a checkout is `kreg.kernels`
