"""insum.nn.irreps: O(3) irreps strings and Clebsch–Gordan (Wigner-3j) tables in e3nn's basis.

    >>> from insum.nn.irreps import Irreps, wigner_3j
    >>> Irreps("16x0e + 16x1o").dim
    64
    >>> tuple(wigner_3j(1, 1, 2).shape)
    (3, 3, 5)

`Irreps` reads e3nn's notation (`"16x0e+8x1o+2e"`, an `e3nn.o3.Irreps`, or a list of
`(mul, (l, p))`). Data laid out by irreps is e3nn's: one block per entry, each block
`[mul, 2l+1]` flattened with the multiplicity outermost.

`wigner_3j(l1, l2, l3)` is computed here, not taken from e3nn: the complex (SU(2))
Clebsch–Gordan coefficients from Racah's formula, then the change to the real basis of
spherical harmonics that e3nn uses (components ordered m = -l..l, so l = 1 is (y, z, x)),
scaled to unit Frobenius norm. It equals `e3nn.o3.wigner_3j` (the tests check l ≤ 3).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InsumError

__all__ = ["Irrep", "Irreps", "IrrepsError", "wigner_3j", "clebsch_gordan_complex", "real_to_complex"]


class IrrepsError(InsumError):
    """An irreps description does not parse, or two irreps descriptions do not fit together."""


@dataclass(frozen=True, order=True)
class Irrep:
    """One irreducible representation of O(3): degree l >= 0 and parity p = +1 (e) or -1 (o)."""

    l: int  # noqa: E741 (the physicists' name)
    p: int

    def __post_init__(self) -> None:
        if self.l < 0 or self.p not in (1, -1):
            raise IrrepsError(f"irrep needs l >= 0 and parity +1 or -1, got l={self.l}, p={self.p}")

    @property
    def dim(self) -> int:
        return 2 * self.l + 1

    def __mul__(self, other: Irrep) -> list[Irrep]:
        """The irreps in the product of two irreps (|l1-l2| .. l1+l2, parity p1*p2)."""
        p = self.p * other.p
        return [Irrep(l, p) for l in range(abs(self.l - other.l), self.l + other.l + 1)]  # noqa: E741

    def __str__(self) -> str:
        return f"{self.l}{'e' if self.p == 1 else 'o'}"


_TERM = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\d+)\s*([eoy])\s*$")


@dataclass(frozen=True)
class Irreps:
    """A direct sum of irreps with multiplicities, e.g. `Irreps("16x0e+16x1o")`."""

    entries: tuple[tuple[int, Irrep], ...]

    def __init__(self, spec: Any = ()) -> None:
        object.__setattr__(self, "entries", _parse(spec))

    @functools.cached_property
    def dim(self) -> int:  # read on every layer call: computed once
        return sum(mul * ir.dim for mul, ir in self.entries)

    @property
    def lmax(self) -> int:
        return max((ir.l for _, ir in self.entries), default=0)

    def offsets(self) -> list[int]:
        """Where each entry's block starts in the flattened layout."""
        starts, at = [], 0
        for mul, ir in self.entries:
            starts.append(at)
            at += mul * ir.dim
        return starts

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __getitem__(self, i: int) -> tuple[int, Irrep]:
        return self.entries[i]

    def __str__(self) -> str:
        return "+".join(f"{mul}x{ir}" for mul, ir in self.entries)

    def __repr__(self) -> str:
        return f"Irreps({str(self)!r})"


def _parse(spec: Any) -> tuple[tuple[int, Irrep], ...]:
    if isinstance(spec, Irreps):
        return spec.entries
    if not isinstance(spec, str) and type(spec).__module__.startswith("e3nn"):
        spec = str(spec)  # an e3nn.o3.Irreps prints in the same notation
    if isinstance(spec, str):
        entries = []
        for term in spec.split("+") if spec.strip() else []:
            match = _TERM.match(term)
            if match is None:
                raise IrrepsError(f"irreps {spec!r}: cannot read the term {term.strip()!r} (expected e.g. '16x1o')")
            mul, l, parity = match.groups()  # noqa: E741
            if parity == "y":
                parity = "e" if int(l) % 2 == 0 else "o"  # spherical-harmonic parity (-1)^l
            entries.append((int(mul) if mul is not None else 1, Irrep(int(l), 1 if parity == "e" else -1)))
        return tuple(entries)
    try:
        entries = []
        for mul, ir in spec:
            l, p = (ir.l, ir.p) if isinstance(ir, Irrep) else ir  # noqa: E741
            if isinstance(mul, bool) or int(mul) != mul or mul < 0 or int(l) != l:
                raise IrrepsError(f"irreps {spec!r}: multiplicities must be integers >= 0 and degrees integers, got ({mul!r}, {ir!r})")
            entries.append((int(mul), Irrep(int(l), int(p))))
        return tuple(entries)
    except (TypeError, ValueError) as e:
        if isinstance(e, IrrepsError):
            raise
        raise IrrepsError(f"irreps {spec!r}: expected a string like '16x0e+8x1o' or (mul, (l, p)) pairs") from e


def clebsch_gordan_complex(j1: int, j2: int, j3: int) -> np.ndarray:
    """<j1 m1 j2 m2 | j3 m3> (Condon–Shortley phase) by Racah's formula, as [m1+j1, m2+j2, m3+j3]."""
    out = np.zeros((2 * j1 + 1, 2 * j2 + 1, 2 * j3 + 1))
    if not abs(j1 - j2) <= j3 <= j1 + j2:
        return out
    f = math.factorial
    # The factor that depends on the three degrees only.
    triangle = f(j1 + j2 - j3) * f(j1 - j2 + j3) * f(-j1 + j2 + j3) / f(j1 + j2 + j3 + 1)
    for m1 in range(-j1, j1 + 1):
        for m2 in range(-j2, j2 + 1):
            m3 = m1 + m2
            if abs(m3) > j3:
                continue
            norm = (2 * j3 + 1) * triangle
            norm *= f(j1 + m1) * f(j1 - m1) * f(j2 + m2) * f(j2 - m2) * f(j3 + m3) * f(j3 - m3)
            total = 0.0
            for k in range(0, j1 + j2 - j3 + 1):
                denominators = (k, j1 + j2 - j3 - k, j1 - m1 - k, j2 + m2 - k, j3 - j2 + m1 + k, j3 - j1 - m2 + k)
                if min(denominators) < 0:
                    continue
                total += (-1) ** k / math.prod(f(d) for d in denominators)
            out[j1 + m1, j2 + m2, j3 + m3] = math.sqrt(norm) * total
    return out


def real_to_complex(l: int) -> np.ndarray:  # noqa: E741
    """e3nn's unitary change of basis between real and complex spherical harmonics (2l+1 square).

    Each order m != 0 mixes the complex harmonics of orders +m and -m with weights 1/sqrt(2)
    (the (-1)^m Condon–Shortley sign for m > 0); the overall (-i)^l makes the real CG tables real.
    """
    q = np.zeros((2 * l + 1, 2 * l + 1), dtype=np.complex128)
    r = 1 / math.sqrt(2)
    for m in range(-l, 0):
        q[l + m, l - m] = r
        q[l + m, l + m] = -1j * r
    q[l, l] = 1
    for m in range(1, l + 1):
        q[l + m, l + m] = (-1) ** m * r
        q[l + m, l - m] = 1j * (-1) ** m * r
    return (-1j) ** l * q


@functools.cache
def _wigner_3j(l1: int, l2: int, l3: int) -> np.ndarray:
    cg = clebsch_gordan_complex(l1, l2, l3).astype(np.complex128)
    q1, q2, q3 = real_to_complex(l1), real_to_complex(l2), real_to_complex(l3)
    # C_real[a, b, c] = sum_{m1 m2 m3} Q1[m1, a] Q2[m2, b] conj(Q3[m3, c]) CG[m1, m2, m3]
    real = np.einsum("ia,jb,kc,ijk->abc", q1, q2, np.conj(q3), cg)
    if np.abs(real.imag).max(initial=0.0) > 1e-9:
        raise AssertionError(f"wigner_3j({l1}, {l2}, {l3}) is not real in the chosen basis")
    real = real.real
    norm = np.linalg.norm(real)
    return real / norm if norm > 0 else real


def wigner_3j(l1: int, l2: int, l3: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The real Clebsch–Gordan table [2l1+1, 2l2+1, 2l3+1] of e3nn's basis, Frobenius norm 1.

    Zero when (l1, l2, l3) violates the triangle inequality.
    """
    for l in (l1, l2, l3):  # noqa: E741
        if isinstance(l, bool) or not isinstance(l, numbers.Integral) or l < 0:
            raise IrrepsError(f"wigner_3j needs integer degrees l >= 0, got ({l1!r}, {l2!r}, {l3!r})")
    l1, l2, l3 = int(l1), int(l2), int(l3)
    return torch.from_numpy(_wigner_3j(l1, l2, l3).copy()).to(dtype)
