"""torch.nn modules built on registry ops."""

from kreg.layers.gated_sparse_attention import GatedSparseAttention

__all__ = ["GatedSparseAttention"]

from kreg._checkout import alias as _alias  # noqa: E402

_alias(__name__)  # `import layers` in a checkout is `kreg.layers`
