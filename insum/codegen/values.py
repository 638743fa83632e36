"""Block-shaped values and the one broadcast helper (lazy broadcasting).

A value is a Triton expression plus the tile axes its block has, a subset of ("M", "K", "N")
in that order. Values stay as small as their dependencies: an offset along N is 1-D. They
are broadcast only where two values meet, by indexing with `:` and `None`, so a gathered
(M, K) operand and a (K, N) operand come out in exactly the shapes `tl.dot` wants.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedule import AXES

__all__ = ["Value", "union", "broadcast"]


@dataclass(frozen=True)
class Value:
    expr: str
    axes: tuple[str, ...]  # tile axes of the block, in AXES order; () for a scalar
    level: int  # loop depth where it can first be computed: 0 outside every loop


def union(*axes: tuple[str, ...]) -> tuple[str, ...]:
    present = {a for group in axes for a in group}
    return tuple(a for a in AXES if a in present)


def broadcast(value: Value, axes: tuple[str, ...]) -> str:
    """`value` as an expression of block shape `axes` (a superset of its own axes)."""
    missing = set(value.axes) - set(axes)
    if missing:
        raise ValueError(f"cannot broadcast a block over {value.axes} to {axes}")
    if not value.axes or value.axes == axes:
        return value.expr
    expr = value.expr if value.expr.isidentifier() else f"({value.expr})"
    return f"{expr}[{', '.join(':' if a in value.axes else 'None' for a in axes)}]"
