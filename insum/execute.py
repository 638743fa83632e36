"""Run a bound statement: the one executor below `insum()` and the torch.library operators.

Both entry points hand down a statement that is already parsed and bound (`insum.api` for
eager calls, the operators of `insum.library` for autograd and torch.compile); this module
decides the backend, falls back to the torch lowering with one warning when the generated
kernel cannot run, checks indices, and launches:

    parse(text) -> bind(stmt, tensors) -> run(bound, out, backend=..., ...) -> out

Options are validated here once for every entry point (`check_options`).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Literal

import torch

from .bind import Bound
from .bounds import check_indices as _check_indices
from .cache import BoundedCache, memoize
from .dtypes import INDEX_DTYPES
from .errors import InsumError, InsumShapeError, InsumTypeError, UnsupportedStatement
from .ir import Statement
from .reference import run_reference
from .settings import flag

__all__ = ["run", "check_options", "check_names", "sorted_facts", "length_facts", "Lengths", "Backend", "Precision", "BACKENDS", "PRECISIONS", "OPTIONS"]

#: "torch": the reference lowering; "triton": the generated kernel; "auto": the generated
#: kernel on CUDA tensors (falling back to the lowering with a warning), the lowering elsewhere.
Backend = Literal["auto", "torch", "triton"]
#: Float32 `tl.dot`: "tf32" tensor cores, or "ieee" full precision.
Precision = Literal["tf32", "ieee"]
BACKENDS: tuple[Backend, ...] = ("auto", "torch", "triton")
PRECISIONS: tuple[Precision, ...] = ("tf32", "ieee")
OPTIONS = ("backend", "precision", "autotune", "check_indices", "sorted_indices", "unique_indices", "lengths")  # keywords that are not tensors

_WARNED_FALLBACK: BoundedCache[str, None] = BoundedCache()  # statements that already warned


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


def check_names(stmt: Statement) -> None:
    """Reject a statement that names a tensor like an option (it could not be passed)."""
    taken = _option_names_in(stmt)
    if taken:
        raise InsumError(
            f"tensor name {taken[0]!r} in '{stmt}' is an option of insum() ({', '.join(OPTIONS)}); "
            "rename the tensor"
        )


@memoize
def _option_names_in(stmt: Statement) -> tuple[str, ...]:
    """Tensor names of the statement that are insum() options (per statement: a cached call
    walks it once, not on every launch)."""
    return tuple(sorted({access.name for access, _ in stmt.walk()} & set(OPTIONS)))


def sorted_facts(bound: Bound, names, option: str = "sorted_indices") -> frozenset[str]:
    """The index tensors declared under `option` (sorted_indices or unique_indices), each
    checked to be one the statement indexes with."""
    facts = frozenset(names) if not isinstance(names, str) else frozenset((names,))
    for name in facts:
        if name not in bound.index_names:
            raise InsumError(
                f"{option} names {name!r}, which is not an index tensor of '{bound.stmt}' "
                f"(index tensors: {', '.join(bound.index_names) or 'none'})"
            )
    return facts


#: Declared lengths as a kernel sees them: (variable, tensor name, index variables).
Lengths = tuple[tuple[str, str, tuple[str, ...]], ...]
_LENGTH_KEY = re.compile(r"^\s*([A-Za-z_]\w*)\s*\[\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*\]\s*$")


def length_facts(bound: Bound, lengths: Mapping[str, torch.Tensor]) -> tuple[Bound, Lengths]:
    """Check declared lengths (`{"q[p]": AL}`: q stops at AL[p]) against the statement and
    add their tensors to the binding under names no statement tensor uses (`LEN_q`)."""
    taken = {access.name for access, _ in bound.stmt.walk()}
    extra, facts, signature = {}, [], []
    for key, tensor in lengths.items():
        match = _LENGTH_KEY.match(key) if isinstance(key, str) else None
        if match is None:
            raise InsumError(f"lengths key {key!r} is not of the form 'q[p]' (q's length for each p)")
        var, index = match.group(1), tuple(v.strip() for v in match.group(2).split(","))
        if bound.roles.get(var) != "reduced":
            raise InsumError(f"lengths names {var!r}, which is not a reduced variable of '{bound.stmt}'")
        for v in index:
            if v == var or bound.roles.get(v) not in ("output", "scattered"):
                raise InsumError(
                    f"the length of {var!r} may depend on output-side variables of '{bound.stmt}' only, not {v!r}"
                )
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in INDEX_DTYPES:
            raise InsumTypeError(f"lengths[{key!r}] must be an int32 or int64 tensor")
        expected = tuple(bound.extents[v] for v in index)
        if tuple(tensor.shape) != expected or tensor.device != bound.device:
            raise InsumShapeError(
                f"lengths[{key!r}] has shape {tuple(tensor.shape)} on {tensor.device}; expected {expected} "
                f"(the extents of {', '.join(index)}) on {bound.device}"
            )
        name = f"LEN_{var}"
        while name in taken:
            name += "_"
        taken.add(name)
        extra[name] = tensor
        facts.append((var, name, index))
        signature.append(("lengths", name, index, tensor.dtype, tuple(tensor.stride())))
    return bound.with_tensors({**bound.tensors, **extra}, tuple(signature)), tuple(facts)


def _checking(check_indices: bool | None) -> bool:
    if check_indices is not None:
        return check_indices
    return flag("INSUM_CHECK_INDICES", default=False)


def run(
    bound: Bound,
    out: torch.Tensor,
    *,
    backend: Backend = "auto",
    precision: Precision = "tf32",
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: frozenset[str] = frozenset(),
    unique_indices: frozenset[str] = frozenset(),
    lengths: Lengths = (),
) -> torch.Tensor:
    """Run a bound statement into `out` and return `out` (no dispatcher, no autograd).

    With backend "triton" a statement the generated kernel cannot run raises
    `UnsupportedStatement`; with "auto" it falls back to the torch lowering, warning once
    per statement. autotune, check_indices, sorted_indices, unique_indices and lengths (checked, the
    tensors of `lengths` already in `bound`: `length_facts`): as for `insum()`.
    """
    if bound.device.type == "meta":
        raise InsumTypeError(
            "the tensors are on the meta device and hold no values; insum runs on them only "
            "while torch.compile traces (the operators' fake implementations)"
        )
    if backend == "torch" or (backend == "auto" and bound.device.type != "cuda"):
        return run_reference(bound, out)
    from .runtime import kernel_for  # the runtime loads the code generator: on first use

    try:
        kernel = kernel_for(
            bound, precision=precision, sorted_indices=sorted_indices, unique_indices=unique_indices, lengths=lengths
        )
    except UnsupportedStatement as e:
        if backend == "triton":
            raise
        key = str(bound.stmt)
        if key not in _WARNED_FALLBACK:
            _WARNED_FALLBACK[key] = None
            warnings.warn(f"insum: falling back to the torch lowering: {e}", stacklevel=3)
        return run_reference(bound, out)
    _check_indices(bound, out, device_check=_checking(check_indices))
    return kernel.launch(bound, out, autotune=autotune)
