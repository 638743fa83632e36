"""Integer helpers that tiling, grids and padding share."""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` cover `a` (negative `a` rounds toward zero).

    >>> cdiv(10, 4), cdiv(8, 4), cdiv(0, 4), cdiv(-5, 2)
    (3, 2, 0, -2)
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least `n` (1 for n <= 1).

    >>> next_power_of_2(1), next_power_of_2(5), next_power_of_2(64)
    (1, 8, 64)
    """
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
