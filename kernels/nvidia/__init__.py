"""NVIDIA variants (Hopper H100/H200). Importing this package registers them."""

from kernels.nvidia import decode, flash_attention, sink_attention, sparse_mla  # noqa: F401
