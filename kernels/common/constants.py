"""Constants the kernels of every op share (Triton and Gluon kernels alike: a Gluon constexpr is a
Triton one). Kernels compute softmax in base 2: scores are scaled by log2(e) once, and an lse comes back
to natural log through ln(2)."""

import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
