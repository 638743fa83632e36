"""Integer helpers that tiling, grids and padding share."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

#: An integer, or an integer tensor (elementwise).
Int = TypeVar("Int", int, "torch.Tensor")

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(a: Int, b: int) -> Int:
    """Ceiling division: how many blocks of `b` cover `a` (negative `a` rounds toward zero).
    Elementwise on an integer tensor, for b > 0: two elementwise ops (a packer's launches
    are counted), where the integer form would take three.

    >>> cdiv(10, 4), cdiv(8, 4), cdiv(0, 4), cdiv(-5, 2), cdiv(7, -2)
    (3, 2, 0, -2, -3)
    """
    if isinstance(a, int):
        return -(-a // b)
    return (a + (b - 1)) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least `n` (1 for n <= 1).

    >>> next_power_of_2(1), next_power_of_2(5), next_power_of_2(64)
    (1, 8, 64)
    """
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
