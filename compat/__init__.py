"""Drop-in APIs for code written against other attention libraries, running kreg's ops.

    from kreg.compat.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from kreg.compat.flash_mla import flash_mla_sparse_fwd

`flash_attn` follows FlashAttention 2.8's Python interface (names, argument order, defaults, layouts,
return values) on `flash_attention`, `sink_attention` and `decode`; `flash_mla` follows FlashMLA's
sparse prefill on `sparse_mla`. What kreg cannot express raises a ValueError or TypeError naming the
argument. docs/frameworks.md lists what is supported.
"""
