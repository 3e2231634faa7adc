"""NVIDIA variants (Hopper H100/H200): `ops.catalog.load_all` imports every module here, and each
registers its variants."""
