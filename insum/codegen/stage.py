"""Staging a gathered operand: one statement rewritten as a gather, then a dense product.

In `C[m,n] = A[m,k] * B[I[k],n]` every program of the product reloads B's rows through the
index (pointer loads: Hopper's tensor-memory engine copies boxes, it has no row gather), and
each gathered row serves every row tile of m. When that reuse is large, gathering once,

    S[k,n] = B[I[k],n]          (a copy: each element read and written once)
    C[m,n] = A[m,k] * S[k,n]    (a dense product: S's tiles load as boxes)

costs less than gathering inside the product: on an H200 the fused fp16 product ran at
0.78-0.85x cuBLAS at 4096^3 and 8192^3, gather then product at 0.83-0.99x, copy included
(benchmarks/results/h200/session9/call1, `python -m benchmarks.explore.order_stage`).

`staging` picks at most one factor: an access with an indirect index whose elements are each
reused by at least STAGE_REUSE values of the statement's other variables (the staged copy
then costs at most 1/STAGE_REUSE of the product's multiply-adds in memory traffic), of at
least STAGE_MIN_ELEMENTS elements (below that the extra launch is what costs), and at most
STAGE_MAX_ELEMENTS. Only statements with another tensor factor qualify (a lone gather is
already a copy). `INSUM_STAGE=0` keeps every gather inside the product.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..ir import Access, Index, Statement, Var

__all__ = ["Staging", "staging", "STAGE_REUSE", "STAGE_MIN_ELEMENTS", "STAGE_MAX_ELEMENTS"]

STAGE_REUSE = 2048
STAGE_MIN_ELEMENTS = 1 << 18
STAGE_MAX_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class Staging:
    """The two statements a staged statement runs as, and the staged tensor between them."""

    gather: Statement  # name[vars] = factor
    main: Statement  # the statement with the factor replaced by name[vars]
    name: str  # the staged tensor
    variables: tuple[str, ...]  # its dimensions, in order
    source: str  # the tensor the factor reads (the staged tensor's dtype)
    reuse: int  # how many products each staged element enters

    def __str__(self) -> str:
        return f"{self.gather}   then   {self.main}   (each staged element used {self.reuse} times)"


def _fresh_name(stmt: Statement, base: str) -> str:
    taken = {access.name for access, _ in stmt.walk()}
    name = f"{base}_staged"
    while name in taken:
        name += "_"
    return name


def staging(stmt: Statement, extents: Mapping[str, int]) -> Staging | None:
    """The staging for `stmt` at these extents, or None when every gather stays fused."""
    accesses = stmt.accesses()
    if len(accesses) < 2:
        return None
    best: Staging | None = None
    everything = stmt.variables()
    for position, factor in enumerate(stmt.factors):
        if not isinstance(factor, Access) or all(index.is_direct for index in factor.indices):
            continue
        variables = factor.variables()
        elements = math.prod(extents[v] for v in variables)
        reuse = math.prod(extents[v] for v in everything if v not in variables)
        if reuse < STAGE_REUSE or not STAGE_MIN_ELEMENTS <= elements <= STAGE_MAX_ELEMENTS:
            continue
        if best is not None and reuse <= best.reuse:
            continue
        name = _fresh_name(stmt, factor.name)
        staged = Access(name, tuple(Index.of(Var(v)) for v in variables))
        factors = stmt.factors[:position] + (staged,) + stmt.factors[position + 1:]
        best = Staging(
            gather=Statement(staged, "=", (factor,)),
            main=Statement(stmt.output, stmt.op, factors, stmt.addend),
            name=name,
            variables=variables,
            source=factor.name,
            reuse=reuse,
        )
    return best
