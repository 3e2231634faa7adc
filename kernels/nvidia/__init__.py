"""NVIDIA variants (Hopper H100/H200). Importing this package registers them."""

from kernels.nvidia import (  # noqa: F401
    decode,
    flash_attention,
    gsa_indexer,
    gsa_sparse_attention,
    gsa_topk,
    nsa,
    sink_attention,
    sparse_mla,
)
