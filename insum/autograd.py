"""Gradients by derivation: the gradient of a factor of an indirect Einsum is one too.

A statement `O[o] op= c * F1[i1] * F2[i2] * ...` is linear in each factor, so the gradient
of factor Fj is the statement whose output is Fj's own access (same indices: the forward's
gathers from Fj become scatters into dFj) and whose factors are the output gradient, read
with the output's indices (the forward's scatter becomes a gather), times the other
factors, literals included:

    C[AM[p], n] += AV[p, q] * B[AK[p, q], n]
    dAV[p, q] += dC[AM[p], n] * B[AK[p, q], n]
    dB[AK[p, q], n] += AV[p, q] * dC[AM[p], n]

A tensor that appears in several factors gets one statement per appearance, all
accumulating (`+=`) into one zero-filled buffer. An added term `+ D[...]` (read once per
output element) gets `dD[...] += dO[...]`: dO summed over the output variables D lacks. Index tensors are integers and get no
gradient. For `O += ...` the gradient with respect to the incoming O is dO itself; for
`O = ...` it is zero. Every variable of a derived statement keeps a direct source of its
extent: the variables of dO's direct indices are the output's, and those of dFj's are Fj's.

    >>> print(derive("C[AM[p],n] += AV[p,q]*B[AK[p,q],n]"))
    dAV[p, q] += dC[AM[p], n] * B[AK[p, q], n]
    dB[AK[p, q], n] += AV[p, q] * dC[AM[p], n]
    dC: the output gradient itself (+=)

Forward mode (`tangents`) is the same linearity read the other way: the output's tangent is
the sum, over the factors, of the statement with that one factor replaced by its tangent
(the same indices), plus the added term's tangent and, for `+=`, the incoming output's.
"""


from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice

from .cache import memoize
from .errors import InsumError
from .ir import Access, Statement
from .parser import parse

__all__ = ["Derivation", "Tangents", "derive", "tangents", "tensor_names"]


@dataclass(frozen=True)
class Derivation:
    """The gradient statements of one statement.

    output_grad: the name the statements read the output gradient under.
    grad_names: differentiable tensor -> the name of its gradient in its statements.
    gradients: differentiable tensor -> its statements (all `+=` into a zero buffer).
    inputs: each statement -> the tensors it reads (the output gradient included).
    passthrough: True for `+=`: the incoming output's gradient is the output gradient.
    """

    stmt: Statement
    output_grad: str
    grad_names: Mapping[str, str]
    gradients: Mapping[str, tuple[Statement, ...]]
    inputs: Mapping[Statement, tuple[str, ...]]
    passthrough: bool

    def __str__(self) -> str:
        lines = [str(s) for stmts in self.gradients.values() for s in stmts]
        if self.passthrough:
            lines.append(f"{self.output_grad}: the output gradient itself (+=)")
        return "\n".join(lines)


def tensor_names(stmt: Statement) -> tuple[str, ...]:
    """Every tensor a statement reads (factors and index tensors), in order, output excluded."""
    return tuple(dict.fromkeys(access.name for access, _ in islice(stmt.walk(), 1, None)))


def _fresh(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


@memoize
def _derive(stmt: Statement) -> Derivation:
    taken = {access.name for access, _ in stmt.walk()}
    addend = (stmt.addend,) if stmt.addend is not None else ()
    value_names = list(dict.fromkeys(a.name for a in (*stmt.accesses(), *addend)))
    index_names = {access.name for access, as_index in stmt.walk() if as_index}
    for name in value_names:
        if name in index_names:
            raise InsumError(
                f"cannot differentiate '{stmt}': {name} is used both as a factor and as an index"
            )
    if stmt.output.name in value_names:
        raise InsumError(f"cannot differentiate '{stmt}': the output {stmt.output.name} is also a factor")
    output_grad = _fresh("d" + stmt.output.name, taken)
    grad_names = {name: _fresh("d" + name, taken) for name in value_names}
    dO = Access(output_grad, stmt.output.indices)
    gradients: dict[str, list[Statement]] = {name: [] for name in value_names}
    inputs: dict[Statement, tuple[str, ...]] = {}
    for j, factor in enumerate(stmt.factors):
        if not isinstance(factor, Access):
            continue
        others = tuple(dO if k == j else f for k, f in enumerate(stmt.factors))
        grad = Statement(Access(grad_names[factor.name], factor.indices), "+=", others)
        gradients[factor.name].append(grad)
        inputs[grad] = tensor_names(grad)
    for term in addend:  # added once per output element: its gradient sums dO over the rest
        grad = Statement(Access(grad_names[term.name], term.indices), "+=", (dO,))
        gradients[term.name].append(grad)
        inputs[grad] = tensor_names(grad)
    return Derivation(
        stmt=stmt,
        output_grad=output_grad,
        grad_names=grad_names,
        gradients={k: tuple(v) for k, v in gradients.items()},
        inputs=inputs,
        passthrough=stmt.accumulate,
    )


def derive(stmt: Statement | str, wrt: str | None = None) -> Derivation:
    """The gradient statements of `stmt` (a Statement or its text).

    wrt: check that this tensor is differentiable (an `InsumError` says why not).
    """
    if isinstance(stmt, str):
        stmt = parse(stmt)
    derivation = _derive(stmt)
    if wrt is not None and wrt not in derivation.gradients:
        if wrt == stmt.output.name:
            if not stmt.accumulate:
                raise InsumError(
                    f"'{stmt}' overwrites {wrt} (`=`): its result does not depend on the incoming {wrt}"
                )
        elif wrt in tensor_names(stmt):
            raise InsumError(
                f"{wrt} is an index tensor of '{stmt}': its integer values select elements and "
                "have no gradient"
            )
        else:
            raise InsumError(f"'{stmt}' does not read a tensor named {wrt}")
    return derivation


@dataclass(frozen=True)
class Tangents:
    """The forward-mode (tangent) statements of one statement: each accumulates (`+=`)
    into the output's tangent, named `output`.

    terms: (tensor, its access there, statement) for each factor and the added term: the
    statement reads that tensor's tangent under `names[tensor]` in place of the tensor at
    that one position.
    """

    output: str
    names: Mapping[str, str]
    terms: tuple[tuple[str, Access, Statement], ...]


@memoize
def tangents(stmt: Statement) -> Tangents:
    """The statements whose sum is the output's tangent, given the factors' tangents.

    >>> t = tangents(parse("C[m, n] = A[m, k] * A[k, n] + D[n]"))
    >>> for _, _, s in t.terms:
    ...     print(s)
    tC[m, n] += tA[m, k] * A[k, n]
    tC[m, n] += A[m, k] * tA[k, n]
    tC[m, n] += tD[n]
    """
    taken = {access.name for access, _ in stmt.walk()}
    output = _fresh("t" + stmt.output.name, taken)
    addend = (stmt.addend,) if stmt.addend is not None else ()
    names = {name: _fresh("t" + name, taken) for name in dict.fromkeys(a.name for a in (*stmt.accesses(), *addend))}
    out = Access(output, stmt.output.indices)
    terms = []
    for j, factor in enumerate(stmt.factors):
        if isinstance(factor, Access):
            replaced = tuple(Access(names[f.name], f.indices) if k == j else f for k, f in enumerate(stmt.factors))
            terms.append((factor.name, factor, Statement(out, "+=", replaced)))
    for term in addend:
        terms.append((term.name, term, Statement(out, "+=", (Access(names[term.name], term.indices),))))
    return Tangents(output=output, names=names, terms=tuple(terms))
