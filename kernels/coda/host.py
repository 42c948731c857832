"""Integer arithmetic of the host functions: launch grids, tile counts, block sizes.

Plain Python on purpose: ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions, whose host calls
cost ~9 us each (their argument unwrapping), several times per host function call."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` for ``n`` >= 1 (0 for 0, as triton's)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
