"""Host-side tile arithmetic and offset checks every kernel module shares.

Plain integer math on purpose: `triton.cdiv` and `triton.next_power_of_2` are constexpr functions in
Triton 3.6, which cost ~3 us per call from host code, several times per launch of a tiny kernel.
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1."""
    return 1 << (int(n) - 1).bit_length()


def dot_block(n: int) -> int:
    """A tile dimension covering `n`: the next power of two, at least 16 (the smallest M, N and K of
    tl.dot)."""
    return max(16, next_pow2(n))


def rows_fit_int32(*tensors) -> bool:
    """Whether every offset a kernel forms inside one batch entry of these [b, t, h, d] tensors (row
    index * row stride, plus the heads and the row) fits in int32, which kernels then use instead of
    64-bit address arithmetic (it costs registers)."""
    return all((x.shape[1] - 1) * x.stride(1) + (x.shape[2] - 1) * x.stride(2) + x.shape[3] < 2**31
               for x in tensors)
