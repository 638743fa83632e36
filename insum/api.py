"""The public entry points: insum(), compile(), explain()."""

from __future__ import annotations

import functools
import os
import warnings

import torch

from .bind import Bound, bind
from .errors import InsumError, InsumTypeError, UnsupportedStatement
from .library import call
from .parser import parse
from .reference import run_reference

__all__ = ["insum", "explain", "run_bound", "check_options", "BACKENDS", "PRECISIONS", "OPTIONS"]

BACKENDS = ("auto", "torch", "triton")
PRECISIONS = ("tf32", "ieee")
OPTIONS = ("backend", "precision", "autotune", "check_indices", "sorted_indices")  # keywords that are not tensors
_warned_fallback: set[str] = set()


def check_options(**options) -> None:
    """Reject an unknown option value, or a tensor passed under an option's name."""
    for name, value in options.items():
        if isinstance(value, torch.Tensor):
            raise InsumError(
                f"a tensor was passed as {name}=: '{name}' is an option of insum(), so no tensor "
                "may be named so; rename it in the statement"
            )
    backend, precision = options.get("backend", "auto"), options.get("precision", "tf32")
    if backend not in BACKENDS:
        raise InsumError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if precision not in PRECISIONS:
        raise InsumError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    for name in ("autotune", "check_indices"):
        if options.get(name) not in (None, True, False):
            raise InsumError(f"{name} must be True, False or None, not {options[name]!r}")


def _check_names(stmt) -> None:
    taken = _option_names_in(stmt)
    if taken:
        raise InsumError(
            f"tensor name {taken[0]!r} in '{stmt}' is an option of insum() ({', '.join(OPTIONS)}); "
            "rename the tensor"
        )


@functools.lru_cache(maxsize=4096)
def _option_names_in(stmt) -> tuple[str, ...]:
    """Tensor names of the statement that are insum() options (per statement: a cached call
    walks it once, not on every launch)."""
    return tuple(sorted({a.name for a in _all_accesses(stmt)} & set(OPTIONS)))


def _all_accesses(stmt):
    stack = [stmt.output, *stmt.accesses()]
    while stack:
        access = stack.pop()
        yield access
        for index in access.indices:
            stack.extend(index.indirect_accesses())


def insum(
    expr: str,
    /,
    *,
    backend: str = "auto",
    precision: str = "tf32",
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: frozenset[str] = frozenset(),
    **tensors: torch.Tensor,
) -> torch.Tensor:
    """Evaluate one indirect Einsum and return its output.

    `+=` accumulates into the output, `=` overwrites it. When the output is passed by its
    name it is updated in place and returned; otherwise it is allocated (zeros, the inputs'
    promoted dtype) when its shape follows from direct indices.

    backend: "torch" (the reference lowering), "triton" (the generated kernel), or "auto"
    (the generated kernel on CUDA when the statement is supported, else the reference).
    precision: "tf32" (default) or "ieee" for float32 `tl.dot`.
    autotune: measure tile candidates on a new size's first call (None: INSUM_AUTOTUNE,
    default on); False bounds the first call's latency.
    check_indices: check index values before the generated kernel runs (None:
    INSUM_CHECK_INDICES, default off); the torch backend always checks. See `insum.bounds`.
    sorted_indices: names of index tensors whose values the caller guarantees sorted
    (equal values adjacent), such as a format's row index. A scatter through one
    (`C[AM[p], n]` with AM sorted) then sums adjacent contributions to one row in
    registers and writes once per row and tile. Unchecked: a wrong claim gives wrong
    sums. Used by the direct call; under autograd or torch.compile it is ignored.

    >>> import torch
    >>> AV = torch.ones(2, 3); AK = torch.tensor([[0, 1, 2], [2, 2, 0]]); B = torch.eye(3)
    >>> insum("C[p, n] += AV[p, q] * B[AK[p, q], n]", AV=AV, AK=AK, B=B, backend="torch")
    tensor([[1., 1., 1.],
            [1., 0., 2.]])
    """
    check_options(backend=backend, precision=precision, autotune=autotune, check_indices=check_indices)
    if torch.compiler.is_compiling():  # torch.compile traces the registered operators
        return call(expr, tensors, backend, precision)
    stmt = parse(expr)
    _check_names(stmt)
    if torch.is_grad_enabled() and _any_requires_grad(tensors):  # the derived backward
        return call(expr, tensors, backend, precision)
    bound = bind(stmt, tensors)
    facts = _sorted_facts(bound, sorted_indices) if sorted_indices else frozenset()
    return run_bound(
        bound, bound.output(), backend, precision, autotune=autotune, check_indices=check_indices, sorted_indices=facts
    )


def _sorted_facts(bound: Bound, names) -> frozenset[str]:
    """The declared sorted index tensors, each checked to be one the statement indexes with."""
    facts = frozenset(names) if not isinstance(names, str) else frozenset((names,))
    for name in facts:
        if name not in bound.index_names:
            raise InsumError(
                f"sorted_indices names {name!r}, which is not an index tensor of '{bound.stmt}' "
                f"(index tensors: {', '.join(bound.index_names) or 'none'})"
            )
    return facts


def _any_requires_grad(tensors: dict) -> bool:
    for t in tensors.values():
        if getattr(t, "requires_grad", False):
            return True
    return False


def _checking(check_indices: bool | None) -> bool:
    if check_indices is not None:
        return check_indices
    return os.environ.get("INSUM_CHECK_INDICES", "0") not in ("", "0")


def run_bound(
    bound: Bound,
    out: torch.Tensor,
    backend: str,
    precision: str,
    *,
    strict: bool | None = None,
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: frozenset[str] = frozenset(),
) -> torch.Tensor:
    """Run a bound statement into `out` on `backend`, directly (no dispatcher, no autograd).

    strict: raise when the generated kernel cannot run the statement (default: when
    backend is "triton"); otherwise fall back to the torch lowering with one warning.
    """
    if bound.device.type == "meta":
        raise InsumTypeError(
            "the tensors are on the meta device and hold no values; insum runs on them only "
            "while torch.compile traces (the operators' fake implementations)"
        )
    if backend == "torch" or (backend == "auto" and bound.device.type != "cuda"):
        return run_reference(bound, out)
    from .bounds import check_indices as check
    from .runtime import kernel_for

    try:
        kernel = kernel_for(bound, precision=precision, sorted_indices=sorted_indices)
    except UnsupportedStatement as e:
        if strict is None:
            strict = backend == "triton"
        if strict:
            raise
        key = str(bound.stmt)
        if key not in _warned_fallback:
            _warned_fallback.add(key)
            warnings.warn(f"insum: falling back to the torch lowering: {e}", stacklevel=3)
        return run_reference(bound, out)
    check(bound, out, device_check=_checking(check_indices))
    return kernel.launch(bound, out, autotune=autotune)


def explain(
    expr: str, /, *, precision: str = "tf32", sorted_indices: frozenset[str] = frozenset(), **tensors: torch.Tensor
) -> str:
    """Describe how a statement is understood and compiled: IR, extents, roles, plan, source
    (sorted_indices as for `insum()`)."""
    check_options(precision=precision)
    bound = bind(parse(expr), tensors)
    lines = [f"statement: {bound.stmt}", f"ir: {bound.stmt!r}", "variables:"]
    for var in bound.stmt.variables():
        lines.append(f"  {var}: extent {bound.extents[var]}, {bound.roles[var]}")
    lines.append(f"index tensors: {', '.join(bound.index_names) or '-'}")
    lines.append(f"value tensors: {', '.join(bound.value_names) or '-'}")
    lines.append(f"output: {bound.output_name} {list(bound.out_shape)} {bound.out_dtype}")
    from .runtime import kernel_for

    try:
        kernel = kernel_for(bound, precision=precision, sorted_indices=_sorted_facts(bound, sorted_indices))
    except UnsupportedStatement as e:
        lines.append(f"generated kernel: none ({e})")
    else:
        lines.append("plan:")
        lines.extend("  " + line for line in str(kernel.plan).splitlines())
        lines.append("source:")
        lines.append(kernel.source)
    return "\n".join(lines)
