"""Triton kernels: shared bodies in `common/`, per-vendor variants in `nvidia/` and `amd/`."""
