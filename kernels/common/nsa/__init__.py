"""NSA (Native Sparse Attention): the nsa op's Triton kernels both vendors share, by role (this
package's `__init__` holds nothing but this map):

- `forward.py`: the compression, compressed-branch (with the block selection), and selected-branch
  kernels (the gated sum in its epilogue), and the launcher that runs them with the attention family's
  forward as the window branch (`nsa_forward_parts`);
- `backward.py`: the backward kernels (gates, compressed and selected branches), the block lists of
  the selected dK/dV pass and the launcher (`nsa_backward`), which runs the attention family's
  backward for the window branch; the backward roles and their interpreter tiles;
- `variant.py`: the autograd Function, the entry point `nsa_forward`, the forward roles' interpreter
  tiles and `NSAGroupCentricBase`, the variant logic the vendor files subclass.
"""
