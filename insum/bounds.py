"""check_indices(bound): index values in range before the generated kernel reads or writes.

The generated kernel trusts its indices (a bad one reads or writes out of bounds), so a raw
`insum()` call can check them first. What the statement alone decides is checked on the
host for free: literal and variable-only affine indices (`A[i + j, 0]`, `X[2]`) have a
range known from the extents. Indirect indices are checked on the device:

- an index `c * T[vars] + (variables) + const` whose variables do not occur in T's own
  indices (`AK[p, q] * 32 + k`) bounds every value of T to one interval, computed on the
  host; T is scanned once by a small range-check kernel (one launch per index tensor,
  all its uses intersected);
- any other indirect index (nested, or sharing variables) is evaluated on the device by
  broadcasting and scanned the same way.

On CUDA the scan ends in a device-side assert: no host sync, and a bad index stops the
stream before the kernel runs (CUDA reports `device-side assert triggered` at the next
synchronisation, with the tensor named in the assert message, and the CUDA context is lost,
as with torch's own indexing). On the CPU (the interpreter) the check reads the values and
raises `InsumIndexError` naming the tensor, the dimension and the value. Declared lengths
(`insum(lengths=)`) are checked the same way for negative values (a length above its
variable's extent is clamped, not an error).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .arith import cdiv
from .bind import Bound
from .cache import BoundedCache
from .errors import InsumIndexError
from .ir import Access, Index, Var

__all__ = ["check_indices"]


def _is_full(access: Access) -> bool:
    """Every element of the tensor is read: its indices are distinct plain variables."""
    names = [i.variable for i in access.indices]
    return all(n is not None for n in names) and len(set(names)) == len(names)


def _accesses(bound: Bound):
    """Every (access, dim, index) whose index is not a plain variable (bind checked those)."""
    for access, _ in bound.stmt.walk():
        for dim, index in enumerate(access.indices):
            if index.variable is None:
                yield access, dim, index


@dataclass(frozen=True)
class _Checks:
    """What a signature's index check does on the device (ints and IR only, no tensors)."""

    intervals: tuple[tuple[str, int, int, str], ...]  # (index tensor, low, high, where)
    evaluated: tuple[tuple[Index, int, str], ...]  # (index to evaluate, size, where)


_CHECKS: BoundedCache[tuple, _Checks] = BoundedCache()  # (statement, signature) -> checks; host checks passed


def check_indices(bound: Bound, out: torch.Tensor, *, device_check: bool = True, on_host: bool = False) -> None:
    """Raise `InsumIndexError` for an index that the statement alone puts out of range; with
    `device_check`, also check the values of index tensors (see the module docstring).
    on_host: read the values back and raise on CUDA too (a sync per index tensor, where the
    caller can afford one: a format read from a file), instead of the device assert.

    The host part depends on the signature only, so a repeated signature skips it."""
    key = (bound.stmt, bound.signature) if bound.signature is not None else None
    checks = _CHECKS.get(key) if key is not None else None
    if checks is None:
        checks = _plan(bound, out)
        if key is not None:
            _CHECKS[key] = checks
    if not device_check:
        return
    for name, lo, hi, where in checks.intervals:
        _check_range(bound.tensors[name], lo, hi, name, where, on_host)
    for index, size, where in checks.evaluated:
        _check_range(_evaluate(bound, index), 0, size - 1, "the index", where, on_host)
    for entry in bound.signature or ():  # declared lengths (`execute.length_facts`): none negative
        if isinstance(entry, tuple) and entry[:1] == ("lengths",):  # (a widened binding's has ints too)
            name = entry[1]
            _check_range(bound.tensors[name], 0, torch.iinfo(bound.tensors[name].dtype).max,
                         "a declared length", f"lengths of {name.removeprefix('LEN_').rstrip('_')!r}", on_host)


def _plan(bound: Bound, out: torch.Tensor) -> _Checks:
    """Check what the extents decide; return the checks left for the index values."""
    intervals: dict[str, tuple[int, int, str]] = {}  # tensor -> (low, high, where)
    evaluated: list[tuple[Index, int, str]] = []
    extents = bound.extents
    for access, dim, index in _accesses(bound):
        tensor = out if access.name == bound.output_name else bound.tensors[access.name]
        size = tensor.shape[dim]
        where = f"{access.name} dimension {dim} (index '{index}')"  # no size: one kernel per use
        variables = [t for t in index.terms if isinstance(t.atom, Var)]
        indirect = [t for t in index.terms if not isinstance(t.atom, Var)]
        if any(extents[v.atom.name] == 0 for v in variables) or any(
            bound.tensors[t.atom.name].numel() == 0 for t in indirect
        ):
            continue  # nothing is addressed
        low = index.const + sum(min(0, t.coef * (extents[t.atom.name] - 1)) for t in variables)
        high = index.const + sum(max(0, t.coef * (extents[t.atom.name] - 1)) for t in variables)
        if not indirect:
            if low < 0 or high >= size:
                bad = low if low < 0 else high
                raise InsumIndexError(f"index {bad} out of range for {where}, of size {size}")
            continue
        (term,) = indirect if len(indirect) == 1 else (None,)
        own = set(term.atom.variables()) if term is not None else set()
        if term is not None and _is_full(term.atom) and not own & {v.atom.name for v in variables}:
            # c * T + [low, high] within [0, size - 1]  <=>  T within [lo, hi]
            c = term.coef
            if c > 0:
                lo, hi = cdiv(-low, c), (size - 1 - high) // c
            else:
                lo, hi = cdiv(size - 1 - high, c), -low // c
            old = intervals.get(term.atom.name)
            if old is not None:
                lo, hi, where = max(lo, old[0]), min(hi, old[1]), f"{old[2]} and {where}"
            intervals[term.atom.name] = (lo, hi, where)
        else:
            evaluated.append((index, size, where))
    return _Checks(
        intervals=tuple((name, lo, hi, where) for name, (lo, hi, where) in intervals.items()),
        evaluated=tuple(evaluated),
    )


def _evaluate(bound: Bound, index: Index) -> torch.Tensor:
    """The index's values over its variables, on the device (gathers clamped: an inner index
    out of range is reported by its own check)."""
    order = index.variables()
    return _values(bound, index, order)


def _values(bound: Bound, index: Index, order: tuple[str, ...]) -> torch.Tensor:
    total = torch.full([1] * len(order), index.const, dtype=torch.int64, device=bound.device)
    for term in index.terms:
        if isinstance(term.atom, Var):
            shape = [bound.extents[v] if v == term.atom.name else 1 for v in order]
            atom = torch.arange(bound.extents[term.atom.name], device=bound.device).view(shape)
        else:
            tensor = bound.tensors[term.atom.name]
            parts = []
            for d, inner in enumerate(term.atom.indices):
                parts.append(_values(bound, inner, order).clamp(0, max(tensor.shape[d] - 1, 0)))
            atom = tensor[tuple(parts)].long() if parts else tensor.reshape([1] * len(order)).long()
        total = total + term.coef * atom
    return total


def _check_range(values: torch.Tensor, lo: int, hi: int, name: str, where: str, on_host: bool = False) -> None:
    if values.numel() == 0:
        return
    type_lo, type_hi = torch.iinfo(values.dtype).min, torch.iinfo(values.dtype).max
    if lo <= type_lo and hi >= type_hi:
        return
    if values.device.type != "cuda" or on_host:
        low, high = (int(v) for v in torch.aminmax(values.reshape(-1)))
        if low < lo or high > hi:
            bad = low if low < lo else high
            valid = f"{lo}..{hi}" if hi < type_hi else f">= {lo}"
            raise InsumIndexError(f"{name} holds {bad}, out of range for {where} (valid values {valid})")
        return
    flat = values.reshape(-1)
    n = flat.numel()
    block = 1024
    kernel = _range_kernel()
    kernel[(cdiv(n, block * 8),)](
        flat, n, max(lo, type_lo), min(hi, type_hi), MESSAGE=f"insum: {name} out of range for {where}",
        BLOCK=block, STEPS=8,
    )


@functools.cache
def _range_kernel():
    """One pass over an index tensor that device-asserts every value lies in [lo, hi]."""
    import triton
    import triton.language as tl

    @triton.jit(debug=True)
    def insum_index_range(values_ptr, n, lo, hi, MESSAGE: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
        for step in tl.static_range(STEPS):
            offs = start + step * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            v = tl.load(values_ptr + offs, mask=mask, other=lo)
            tl.device_assert((v >= lo) & (v <= hi), MESSAGE)

    return insum_index_range
