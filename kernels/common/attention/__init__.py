"""Dense attention (FlashAttention-2) with sinks, sliding windows, GQA and varlen packing: the Triton
kernel family flash_attention and sink_attention share, forward and backward, on both vendors.

One call runs up to four kernels, each the kernel of one role of a tuned entry:

- `fwd`: a program per (query block, query head, sequence) runs an online softmax over the keys the
  block may see and applies the sink once at the end (`out = out_nosink * sigmoid(lse - sink)`); it
  writes out, and the lse without the sink.
- `bwd_pre`: a program per (row block, query head, sequence) reads dO and O once and writes
  `Delta = rowsum(dO * O)`, the row's total lse (sink included, log2 units) and its share of
  `d sink = -sigmoid(sink - lse) * Delta` (summed later in a fixed order).
- `bwd_dkv`: a program per (key block, kv head, sequence) walks the GQA group's query heads and the
  query blocks that may see its keys, summing in registers; dK and dV are written once.
- `bwd_dq`: the forward's program layout, recomputing P and dS over the same key range for dQ.

No kernel uses atomics, so gradients are bitwise reproducible. Sinks, windows, causal masks and varlen
are constexpr switches of every kernel. Varlen bounds read from cu_seqlens are clamped into the packed
tensors inside the kernels and programs stride over their blocks, so no row outside the tensors is
touched and a short max_seqlen still covers every row; nothing is read on the host.

The files, by role (this package's `__init__` holds nothing but this map):

- `masks.py`: the jitted helpers both directions call (sequence bounds, block order, the key and
  query ranges a block visits, the allowed-key mask);
- `forward.py`: the forward kernels and their launcher, `attention_forward`;
- `backward.py`: the pre, dK/dV and dQ kernels and their launchers (`attention_backward`,
  `backward_pre`, `attention_backward_dq`);
- `layout.py`: host-side arguments both launchers build (strides, rows and spans, mask arguments);
- `tile_rules.py`: what a config's tiles mean for a call (HEADS packing, KEY_LOOPS, short windows);
- `variant.py`: the autograd Function, the entry point `attention_call`, the interpreter's tiles and
  `AttentionTiledBase`, the variant logic the vendor files subclass.

Semantics: `ops.flash_attention.reference` and `ops.sink_attention.reference`.
"""
