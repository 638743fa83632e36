"""The torch lowering: the semantic oracle, the CPU path and the fallback.

Every value is evaluated as a tensor over all of the statement's variables, with size-1
dimensions for the variables it does not depend on. Gathers are advanced indexing with such
tensors, the contraction is one `torch.einsum`, and the scatter is `index_put_` with
accumulation. Index values are bounds-checked, so a bad index raises instead of wrapping.
"""

from __future__ import annotations

import torch

from .bind import Bound
from .dtypes import compute_dtype
from .errors import InsumIndexError
from .ir import Access, Index, Var

__all__ = ["run_reference"]

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class _Evaluator:
    def __init__(self, bound: Bound, check_bounds: bool):
        self.bound = bound
        self.check_bounds = check_bounds
        self.order = bound.stmt.variables()
        self.device = bound.device

    def shape_of(self, variables) -> list[int]:
        return [self.bound.extents[v] if v in variables else 1 for v in self.order]

    def index(self, index: Index) -> torch.Tensor:
        total = torch.full([1] * len(self.order), index.const, dtype=torch.int64, device=self.device)
        for term in index.terms:
            if isinstance(term.atom, Var):
                atom = torch.arange(self.bound.extents[term.atom.name], device=self.device)
                atom = atom.view(self.shape_of({term.atom.name}))
            else:
                atom = self.gather(term.atom).long()
            total = total + term.coef * atom
        return total

    def gather(self, access: Access) -> torch.Tensor:
        tensor = self.bound.tensors[access.name]
        if not access.indices:
            return tensor.reshape([1] * len(self.order))
        indices = [self.index(i) for i in access.indices]
        if self.check_bounds:
            for dim, (idx, size) in enumerate(zip(indices, tensor.shape)):
                _check_bounds(idx, size, access.name, dim)
        return tensor[tuple(indices)]


def _check_bounds(idx: torch.Tensor, size: int, name: str, dim: int) -> None:
    if idx.numel() == 0:
        return
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        raise InsumIndexError(f"index {bad} out of range for {name} dimension {dim} of size {size}")


def _addend(ev: _Evaluator, addend: Access, out_vars: list[str]) -> torch.Tensor:
    """The added term over the output's dimensions (size 1 where it does not vary)."""
    value = ev.gather(addend)  # over every variable of the statement, in `ev.order`
    present = [v for v in ev.order if v in out_vars]  # the others are size 1 (the parser checked)
    used = set(addend.variables())
    value = value.reshape([ev.bound.extents[v] if v in used else 1 for v in present])
    return value.permute([present.index(v) for v in out_vars])


def run_reference(bound: Bound, out: torch.Tensor, *, check_bounds: bool = True) -> torch.Tensor:
    """Evaluate the bound statement into `out` (which must have the output's shape).

    check_bounds: check every index value on the host first (a sync; an index out of range
    raises `InsumIndexError`). False skips the checks, for indices known to be in range: a
    bad index then fails inside torch's indexing, and `torch.compile` can trace the lowering
    without a graph break.
    """
    stmt = bound.stmt
    ev = _Evaluator(bound, check_bounds)
    order = ev.order
    letter = {v: _LETTERS[i] for i, v in enumerate(order)}
    # The kernel's: float32 for half precision, float64 where the output or a factor is.
    dtype = out.dtype
    for factor in (*stmt.factors, *((stmt.addend,) if stmt.addend is not None else ())):
        if isinstance(factor, Access) and bound.tensors[factor.name].dtype != dtype:
            dtype = torch.promote_types(dtype, bound.tensors[factor.name].dtype)
    dtype = compute_dtype(dtype)

    scale = 1.0
    operands, subscripts, covered = [], [], set()
    for factor in stmt.factors:
        if isinstance(factor, Access):
            variables = [v for v in order if v in factor.variables()]
            value = ev.gather(factor).to(dtype)
            operands.append(value.reshape([bound.extents[v] for v in variables]))
            subscripts.append("".join(letter[v] for v in variables))
            covered.update(variables)
        else:
            scale *= factor.value
    kept = [v for v in order if v in stmt.output.variables() and v in covered]
    if operands:
        spec = ",".join(subscripts) + "->" + "".join(letter[v] for v in kept)
        result = torch.einsum(spec, *operands)
    else:
        result = torch.ones((), dtype=dtype, device=bound.device)
    if scale != 1.0:
        result = result * scale

    out_vars = [i.variable for i in stmt.output.indices]
    if all(v is not None for v in out_vars) and len(set(out_vars)) == len(out_vars):
        # Every output element has one owner: a permuted, broadcast add, no scatter.
        present = [v for v in out_vars if v in kept]
        full = result.permute([kept.index(v) for v in present]) if kept else result
        full = full.reshape([bound.extents[v] if v in kept else 1 for v in out_vars])
        if stmt.addend is not None:
            full = full + _addend(ev, stmt.addend, out_vars).to(dtype)
        # (one rounding into the output's dtype: a half output adds in float32 first)
        out.copy_((full + out.to(dtype) if stmt.accumulate else full).to(out.dtype))
        return out
    indices = [ev.index(i) for i in stmt.output.indices]
    if check_bounds:
        for dim, (idx, size) in enumerate(zip(indices, out.shape)):
            _check_bounds(idx, size, stmt.output.name, dim)
    result = result.reshape(ev.shape_of(set(kept)))  # back to the full variable space
    shape = torch.broadcast_shapes(*(i.shape for i in indices), result.shape)
    if not stmt.accumulate:  # only now: a bad index above must leave `out` untouched
        out.zero_()
    out.index_put_(
        tuple(i.expand(shape) for i in indices), result.expand(shape).to(out.dtype), accumulate=True
    )
    return out
