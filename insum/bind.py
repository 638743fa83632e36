"""bind(stmt, tensors) -> Bound: check every tensor against the statement and infer extents.

Analysis needs shapes, dtypes and devices only; the tensors ride along for the backends.
Variable roles:
  output     indexes the output directly (`n` in `C[AM[p], n]`): one output slice each
  scattered  appears in the output only under an indirect or affine index (`p` above):
             contributions of different values may land on one output element
  reduced    absent from the output (`q`): summed over
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .errors import InsumError, InsumShapeError, InsumTypeError
from .ir import Access, Statement

__all__ = ["Bound", "bind", "VALUE_DTYPES", "INDEX_DTYPES"]

VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Bound:
    """A statement checked against its tensors."""

    stmt: Statement
    tensors: Mapping[str, torch.Tensor]  # every input, and the output when it was given
    extents: Mapping[str, int]  # variable -> extent
    roles: Mapping[str, str]  # variable -> "output" | "scattered" | "reduced"
    index_names: tuple[str, ...]  # tensors read as indices, in order of appearance
    value_names: tuple[str, ...]  # tensors read as factors, in order of appearance
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    device: torch.device

    @property
    def output_name(self) -> str:
        return self.stmt.output.name

    def variables(self, role: str) -> tuple[str, ...]:
        return tuple(v for v in self.stmt.variables() if self.roles[v] == role)


def _walk(access: Access):
    """Yield an access and every indirect access nested in its indices, with `as_index`."""
    stack = [(access, False)]
    while stack:
        node, as_index = stack.pop(0)
        yield node, as_index
        for index in node.indices:
            stack.extend((inner, True) for inner in index.indirect_accesses())


def _roles(stmt: Statement) -> dict[str, str]:
    direct = {i.variable for i in stmt.output.indices if i.is_direct}
    in_output = set(stmt.output.variables())
    roles = {}
    for var in stmt.variables():
        if var in direct:
            roles[var] = "output"
        elif var in in_output:
            roles[var] = "scattered"
        else:
            roles[var] = "reduced"
    return roles


def bind(stmt: Statement, tensors: Mapping[str, object]) -> Bound:
    """Check `tensors` against `stmt`; raise an `InsumError` subclass naming what is wrong."""
    out_name = stmt.output.name
    uses: dict[str, str] = {}  # tensor name -> "index" | "value"
    accesses: list[Access] = []
    for factor in stmt.accesses():
        for access, as_index in _walk(factor):
            accesses.append(access)
            role = "index" if as_index else "value"
            if uses.setdefault(access.name, role) != role:
                raise InsumTypeError(
                    f"tensor {access.name} is used both as an index and as a factor in '{stmt}'"
                )
    out_accesses = list(_walk(stmt.output))
    for access, _ in out_accesses[1:]:
        uses.setdefault(access.name, "index")
        if uses[access.name] != "index":
            raise InsumTypeError(
                f"tensor {access.name} is used both as an index and as a factor in '{stmt}'"
            )
        accesses.append(access)
    if out_name in uses:
        raise InsumError(f"the output {out_name} is also an input of '{stmt}'; pass a separate tensor")

    missing = [name for name in uses if name not in tensors]
    if missing:
        raise InsumError(f"missing tensor(s) {', '.join(missing)} for '{stmt}'")
    unused = [name for name in tensors if name not in uses and name != out_name]
    if unused:
        raise InsumError(f"unknown or unused tensor(s) {', '.join(unused)}: '{stmt}' does not read them")
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise InsumTypeError(f"{name} must be a torch.Tensor, not {type(value).__name__}")

    output = tensors.get(out_name)
    checked = accesses + ([stmt.output] if output is not None else [])
    for access in checked:
        tensor = tensors[access.name]
        if tensor.dim() != len(access.indices):
            raise InsumShapeError(
                f"{access.name} has rank {tensor.dim()} (shape {tuple(tensor.shape)}) but is "
                f"indexed with {len(access.indices)} indices in {access}"
            )

    index_names = tuple(n for n, u in uses.items() if u == "index")
    value_names = tuple(n for n, u in uses.items() if u == "value")
    for name in index_names:
        if tensors[name].dtype not in INDEX_DTYPES:
            raise InsumTypeError(
                f"index tensor {name} has dtype {tensors[name].dtype}; index tensors must be "
                "torch.int32 or torch.int64"
            )
    for name in value_names + ((out_name,) if output is not None else ()):
        if tensors[name].dtype not in VALUE_DTYPES:
            raise InsumTypeError(
                f"tensor {name} has dtype {tensors[name].dtype}; factors and outputs must be "
                "float16, bfloat16, float32 or float64"
            )

    devices = {tensors[name].device for name in tensors}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise InsumTypeError(f"tensors are on different devices: {where}")
    device = devices.pop() if devices else torch.device("cpu")

    extents: dict[str, int] = {}
    origin: dict[str, str] = {}
    for access in checked:
        shape = tensors[access.name].shape
        for dim, index in enumerate(access.indices):
            var = index.variable
            if var is None:
                continue
            if var in extents and extents[var] != shape[dim]:
                raise InsumShapeError(
                    f"extent of variable '{var}' is {extents[var]} from {origin[var]} but "
                    f"{shape[dim]} from {access.name} dimension {dim} in '{stmt}'"
                )
            extents.setdefault(var, shape[dim])
            origin.setdefault(var, f"{access.name} dimension {dim}")
    for var in stmt.variables():
        if var not in extents:
            where = "the output" if var in stmt.output.variables() else "any tensor"
            raise InsumShapeError(
                f"cannot infer the extent of variable '{var}': it indexes no dimension of "
                f"{where} directly in '{stmt}'"
                + ("; pass the output tensor" if output is None else "")
            )

    if output is not None:
        if _shares_memory(output, [tensors[n] for n in uses]):
            raise InsumError(f"the output {out_name} shares memory with an input of '{stmt}'")
        out_shape, out_dtype = tuple(output.shape), output.dtype
    else:
        if not all(i.is_direct for i in stmt.output.indices):
            raise InsumError(
                f"the shape of the output {out_name} does not follow from '{stmt}' (an output "
                f"index is indirect or affine); pass {out_name}=<tensor>"
            )
        out_shape = tuple(extents[i.variable] for i in stmt.output.indices)
        out_dtype = torch.float32
        if value_names:
            out_dtype = tensors[value_names[0]].dtype
            for name in value_names[1:]:
                out_dtype = torch.promote_types(out_dtype, tensors[name].dtype)

    return Bound(
        stmt=stmt,
        tensors=dict(tensors),
        extents=extents,
        roles=_roles(stmt),
        index_names=index_names,
        value_names=value_names,
        out_shape=out_shape,
        out_dtype=out_dtype,
        device=device,
    )


def _shares_memory(output: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    if output.numel() == 0:
        return False
    storage = output.untyped_storage().data_ptr()
    return any(t.numel() and t.untyped_storage().data_ptr() == storage for t in inputs)
