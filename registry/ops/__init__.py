"""Op contracts, one file per logical op. `OPS` maps each op name to its `Op`."""

from registry.ops import (
    decode,
    flash_attention,
    gsa_indexer,
    gsa_sparse_attention,
    gsa_topk,
    nsa,
    sink_attention,
    sparse_mla,
)
from registry.ops._contract import Op

OPS: dict[str, Op] = {
    m.OP.name: m.OP
    for m in (
        sparse_mla,
        gsa_indexer,
        gsa_topk,
        gsa_sparse_attention,
        sink_attention,
        flash_attention,
        decode,
        nsa,
    )
}
