"""AMD variants (MI300X gfx942, MI355X gfx950). Importing this package registers them."""

from kernels.amd import (  # noqa: F401
    decode,
    flash_attention,
    gsa_indexer,
    gsa_sparse_attention,
    gsa_topk,
    nsa,
    sink_attention,
    sparse_mla,
)
