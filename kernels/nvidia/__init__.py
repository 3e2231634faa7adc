"""NVIDIA variants (Hopper H100/H200). Importing this package registers them."""

from kernels.nvidia import decode, flash_attention, gsa_indexer, gsa_topk, sparse_mla  # noqa: F401
