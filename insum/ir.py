"""The statement IR: small frozen dataclasses whose `str()` prints the statement back.

Every index is normalised to an affine combination `sum(coef * atom) + const`, where an
atom is an index variable or an indirect access; a plain variable is one term with
coefficient 1. Normalisation makes `parse(str(stmt)) == stmt`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Literal as _Literal

__all__ = ["Var", "Access", "Term", "Index", "Literal", "Factor", "Statement", "Role", "ROLES"]

#: How a variable relates to the output (see `insum.bind`).
Role = _Literal["output", "scattered", "reduced"]
ROLES: tuple[Role, ...] = ("output", "scattered", "reduced")


@dataclass(frozen=True)
class Var:
    """An index variable such as `p` or `n`."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Term:
    """`coef * atom` inside an affine index."""

    coef: int
    atom: Var | Access

    def __str__(self) -> str:
        body = str(self.atom)
        magnitude = abs(self.coef)
        return body if magnitude == 1 else f"{body}*{magnitude}"


@dataclass(frozen=True)
class Index:
    """An affine index: `terms[0] + terms[1] + ... + const`."""

    terms: tuple[Term, ...]
    const: int = 0

    @staticmethod
    def of(*parts: Var | Access | int | tuple[int, Var | Access]) -> Index:
        """Build a normalised index from atoms, `(coef, atom)` pairs and integers."""
        coefs: dict[Var | Access, int] = {}
        const = 0
        for part in parts:
            if isinstance(part, int):
                const += part
                continue
            coef, atom = part if isinstance(part, tuple) else (1, part)
            coefs[atom] = coefs.get(atom, 0) + coef
        terms = tuple(Term(c, a) for a, c in coefs.items() if c != 0)
        return Index(terms, const)

    @property
    def variable(self) -> str | None:
        """The variable's name when the index is exactly one plain variable, else None."""
        if self.const == 0 and len(self.terms) == 1:
            term = self.terms[0]
            if term.coef == 1 and isinstance(term.atom, Var):
                return term.atom.name
        return None

    @property
    def is_direct(self) -> bool:
        return self.variable is not None

    def variables(self) -> tuple[str, ...]:
        """Every variable the index depends on, through indirect accesses too, in order."""
        seen: dict[str, None] = {}
        for term in self.terms:
            if isinstance(term.atom, Var):
                seen[term.atom.name] = None
            else:
                for name in term.atom.variables():
                    seen[name] = None
        return tuple(seen)

    def indirect_accesses(self) -> tuple[Access, ...]:
        return tuple(t.atom for t in self.terms if isinstance(t.atom, Access))

    def __str__(self) -> str:
        parts: list[str] = []
        for term in self.terms:
            if not parts:
                parts.append(("-" if term.coef < 0 else "") + str(term))
            else:
                parts.append(("- " if term.coef < 0 else "+ ") + str(term))
        if self.const or not parts:
            if not parts:
                parts.append(str(self.const))
            else:
                parts.append(("- " if self.const < 0 else "+ ") + str(abs(self.const)))
        return " ".join(parts)


@dataclass(frozen=True)
class Access:
    """`name[indices]`; a scalar tensor has no indices."""

    name: str
    indices: tuple[Index, ...]

    def variables(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for index in self.indices:
            for name in index.variables():
                seen[name] = None
        return tuple(seen)

    def __str__(self) -> str:
        return f"{self.name}[{', '.join(str(i) for i in self.indices)}]"


@dataclass(frozen=True)
class Literal:
    """A numeric constant factor."""

    value: int | float

    def __str__(self) -> str:
        return repr(self.value)


Factor = Access | Literal


@dataclass(frozen=True)
class Statement:
    """`output op factor * factor * ... [+ addend]` with op `+=` (accumulate) or `=`
    (overwrite). The addend is one access added to each output element once, after the
    product's reduction (a bias in the kernel's epilogue): its variables are the output's,
    whose indices are distinct plain variables (each element has one owner)."""

    output: Access
    op: str
    factors: tuple[Factor, ...]
    addend: Access | None = None

    @cached_property
    def _hash(self) -> int:
        return hash((self.output, self.op, self.factors, self.addend))

    def __hash__(self) -> int:
        # Statements key every cache on the launch path: hash the nested IR only once.
        return self._hash

    @property
    def accumulate(self) -> bool:
        return self.op == "+="

    def accesses(self) -> tuple[Access, ...]:
        """The product's accesses (the addend aside)."""
        return tuple(f for f in self.factors if isinstance(f, Access))

    def walk(self) -> Iterator[tuple[Access, bool]]:
        """Every access, breadth first from the output then each factor, paired with whether
        it is read as an index (nested inside another access's indices).

        >>> from insum.parser import parse
        >>> [(a.name, as_index) for a, as_index in parse("C[AM[p], n] += AV[p] * B[AK[p], n]").walk()]
        [('C', False), ('AV', False), ('B', False), ('AM', True), ('AK', True)]
        """
        addend = (self.addend,) if self.addend is not None else ()
        queue = [(access, False) for access in (self.output, *self.accesses(), *addend)]
        for access, as_index in queue:
            yield access, as_index
            for index in access.indices:
                queue.extend((inner, True) for inner in index.indirect_accesses())

    def variables(self) -> tuple[str, ...]:
        """All index variables, output first, in order of appearance."""
        seen: dict[str, None] = {}
        for access in (self.output, *self.accesses()):
            for name in access.variables():
                seen[name] = None
        return tuple(seen)

    def __str__(self) -> str:
        rhs = " * ".join(str(f) for f in self.factors)
        if self.addend is not None:
            rhs += f" + {self.addend}"
        return f"{self.output} {self.op} {rhs}"
