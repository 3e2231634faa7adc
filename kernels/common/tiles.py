"""Host-side tile arithmetic every kernel module shares."""

import triton


def dot_block(n: int) -> int:
    """A tile dimension covering `n`: the next power of two, at least 16 (the smallest M, N and K of
    tl.dot)."""
    return max(16, triton.next_power_of_2(int(n)))
