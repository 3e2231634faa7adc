"""AMD variants (MI300X gfx942, MI355X gfx950). Importing this package registers them."""

from kernels.amd import decode, flash_attention, gsa_indexer, gsa_topk, sparse_mla  # noqa: F401
