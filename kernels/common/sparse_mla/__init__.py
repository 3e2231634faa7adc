"""Sparse MLA (DeepSeek-V3.2, FlashMLA's sparse prefill): the head-block kernels both vendors run, one
module per job.

- `gather`: the program grid and tiles every head-block kernel uses, and its gather of selected kv rows;
- `forward`: the forward kernel and its launcher;
- `backward`: the backward kernels (pre and fused; the deterministic dq, dkv and sum passes), their
  launchers, the workspace of the deterministic passes and `BackwardPasses`;
- `variant`: autograd, the launch every sparse_mla variant shares, the head-block variant's logic and
  the spaces and interpreter shapes both vendors' files take.

Import each name from the module that defines it: this package exports nothing of its own.
Semantics: `ops.sparse_mla.reference` (docs/op-contracts.md).
"""
