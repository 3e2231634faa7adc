"""torch.nn modules built on registry ops."""

from layers.gated_sparse_attention import GatedSparseAttention

__all__ = ["GatedSparseAttention"]
