"""bind(stmt, tensors) -> Bound: check every tensor against the statement and infer extents.

Analysis needs shapes, dtypes and devices only; the tensors ride along for the backends.
Variable roles:
  output     indexes the output directly (`n` in `C[AM[p], n]`): one output slice each
  scattered  appears in the output only under an indirect or affine index (`p` above):
             contributions of different values may land on one output element
  reduced    absent from the output (`q`): summed over

Beside the binding, what every entry point asks of the tensors it is given: whether they
carry forward-mode tangents (`has_tangent`), a refusal of torch.func's wrapped tensors, and
the version bump after a kernel writes an output (`mark_written`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import islice

import torch
from torch.autograd import forward_ad

from .cache import BoundedCache, memoize
from .dtypes import INDEX_DTYPES, VALUE_DTYPES
from .errors import InsumError, InsumShapeError, InsumTypeError
from .ir import Access, Role, Statement

__all__ = [
    "Bound", "bind", "tensor_signature", "tensor_version", "kept_per_version", "PerTensor", "PLAIN_TENSORS",
    "check_aliasing", "keyable",
]


@dataclass(frozen=True)
class Bound:
    """A statement checked against its tensors."""

    stmt: Statement
    tensors: Mapping[str, torch.Tensor]  # every input, and the output when given (not cached)
    extents: Mapping[str, int]  # variable -> extent
    roles: Mapping[str, Role]  # variable -> "output" | "scattered" | "reduced"
    index_names: tuple[str, ...]  # tensors read as indices, in order of appearance
    value_names: tuple[str, ...]  # tensors read as factors, in order of appearance
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    device: torch.device
    signature: tuple | None = None  # dtypes, shapes, strides and devices (None: not cacheable)

    @property
    def output_name(self) -> str:
        return self.stmt.output.name

    def output(self) -> torch.Tensor:
        """The given output, or a new zero-filled one of the output's shape and dtype."""
        given = self.tensors.get(self.output_name)
        if given is not None:
            return given
        return torch.zeros(self.out_shape, dtype=self.out_dtype, device=self.device)

    def variables(self, role: Role) -> tuple[str, ...]:
        return tuple(v for v in self.stmt.variables() if self.roles[v] == role)

    def with_tensors(self, tensors: Mapping[str, torch.Tensor], signature_extra: tuple = ()) -> Bound:
        """The same binding for other tensors of the same signature (no checks repeated);
        signature_extra: the signature of tensors added beside the statement's (declared
        lengths), appended to the cache key."""
        new = object.__new__(Bound)
        new.__dict__.update(self.__dict__)
        new.__dict__["tensors"] = dict(tensors)
        if signature_extra and self.signature is not None:
            new.__dict__["signature"] = self.signature + signature_extra
        return new

    def output_strides(self) -> tuple[int, ...]:
        """The output's strides: as given, or contiguous as `output()` allocates it."""
        out = self.tensors.get(self.output_name)
        if out is not None:
            return out.stride()
        strides, step = [], 1
        for extent in reversed(self.out_shape):
            strides.append(step)
            step *= max(extent, 1)
        return tuple(reversed(strides))

    def with_extent(self, var: str, extent: int, tensors: Mapping[str, torch.Tensor]) -> Bound:
        """The binding with `var` of another extent over `tensors`, whose dimensions `var`
        indexes have that extent (the output's too, given among them): the run in widened rows
        (`insum.widening`). Its signature is this one's with the widening in front, which the
        widened tensors' layout follows from."""
        new = self.with_tensors(tensors)
        new.__dict__["extents"] = {**self.extents, var: extent}
        dims = [d for d, index in enumerate(self.stmt.output.indices) if index.variable == var]
        new.__dict__["out_shape"] = tuple(extent if d in dims else s for d, s in enumerate(self.out_shape))
        if self.signature is not None:
            new.__dict__["signature"] = ("widened", var, extent, *self.signature)
        return new


def _roles(stmt: Statement) -> dict[str, Role]:
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


@dataclass(frozen=True)
class _Analysis:
    """Everything about a statement that does not depend on the tensors (cached)."""

    uses: Mapping[str, str]  # tensor -> "index" | "value"
    checked: tuple[tuple[str, int, tuple[tuple[int, str], ...]], ...]  # (tensor, rank, (dim, var))
    output_dims: tuple[tuple[int, str], ...]  # (dim, var) of the output's direct indices
    roles: Mapping[str, Role]
    index_names: tuple[str, ...]
    value_names: tuple[str, ...]


def _direct_dims(access: Access) -> tuple[tuple[int, str], ...]:
    return tuple((d, i.variable) for d, i in enumerate(access.indices) if i.variable is not None)


@memoize
def _analyse(stmt: Statement) -> _Analysis:
    uses: dict[str, str] = {}
    accesses: list[Access] = []
    for access, as_index in islice(stmt.walk(), 1, None):  # the output's own access aside
        accesses.append(access)
        role = "index" if as_index else "value"
        if uses.setdefault(access.name, role) != role:
            raise InsumTypeError(
                f"tensor {access.name} is used both as an index and as a factor in '{stmt}'"
            )
    if stmt.output.name in uses:
        raise InsumError(
            f"the output {stmt.output.name} is also an input of '{stmt}'; pass a separate tensor"
        )
    return _Analysis(
        uses=uses,
        checked=tuple((a.name, len(a.indices), _direct_dims(a)) for a in accesses),
        output_dims=_direct_dims(stmt.output),
        roles=_roles(stmt),
        index_names=tuple(n for n, u in uses.items() if u == "index"),
        value_names=tuple(n for n, u in uses.items() if u == "value"),
    )


_BOUND: BoundedCache[tuple, Bound] = BoundedCache()  # (statement, signature) -> a checked binding


#: The tensor types whose signature is cached; anything else (fake and functional tensors
#: while tracing, subclasses, non-tensors) takes the uncached path.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def tensor_version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter, for caches of what is derived from its values;
    None where there is none to trust: fake and functional tensors while tracing, and
    inference tensors (which keep no counter)."""
    if type(t) not in PLAIN_TENSORS or t.is_inference():
        return None
    return t._version


class PerTensor:
    """Values kept per tensor object, each dropped when its tensor dies.

    What `torch.utils.weak.WeakIdKeyDictionary` does, looked up by `id()` and one weak
    reference's call instead of a key object built and hashed per lookup: the declared
    lengths' order is looked up on every call of a Block-ELL statement (3.0 -> 0.4 µs a lookup
    on the development VM)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, tensor: torch.Tensor):
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:  # (an id reused by a newer object)
            return None
        return entry[1]

    def __setitem__(self, tensor: torch.Tensor, value) -> None:
        key, entries = id(tensor), self._entries

        def drop(ref: weakref.ref) -> None:
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(tensor, drop), value)

    def __len__(self) -> int:
        return len(self._entries)


def kept_per_version(cache: PerTensor, tensor: torch.Tensor, key, compute: Callable[[], object]):
    """`compute()`, something derived from `tensor`'s values, kept in `cache` per tensor
    object (held weakly: the entry dies with it), version and `key`: an in-place change
    recomputes it. Computed on each call where there is no version to trust (traced code,
    fake and inference tensors)."""
    version = None if torch.compiler.is_compiling() else tensor_version(tensor)
    if version is None:
        return compute()
    kept = cache.get(tensor)
    if kept is None or kept[0] != (version, key):
        kept = cache[tensor] = ((version, key), compute())
    return kept[1]


def tensor_signature(tensors: Mapping[str, object]) -> tuple | None:
    """What a binding depends on: names, dtypes, shapes, strides, devices.

    None (not cached) for anything but plain strided tensors: fake and functional tensors seen
    while tracing, non-tensors and sparse layouts (which `_bind` rejects).
    """
    if not all(map(keyable, tensors.values())):
        return None
    return tuple((n, t.dtype, t.shape, t.stride(), t.device) for n, t in tensors.items())


def keyable(t: object) -> bool:
    """A plain strided tensor whose memory holds its values (not a fake, sparse or nested
    tensor, nor a negative-bit view): what a cached binding or launch may be keyed by."""
    return type(t) in PLAIN_TENSORS and t.layout == torch.strided and not t.is_nested and not t.is_neg()


def forward_mode_on() -> bool:
    """Whether a forward-mode AD level is open (`forward_ad.dual_level`): one module attribute,
    read before anything else is looked at."""
    return forward_ad._current_level >= 0


def tangents_alone(tensors) -> bool:
    """Whether `tensors` carry forward-mode tangents and no gradient is being recorded for
    them: a layer may then compute its tangent from products of primals. With a gradient
    recorded too (forward over reverse), that would cut the tangents out of the backward's
    graph (a Hessian-vector product's cross terms): the layer's own autograd path runs."""
    tensors = [t for t in tensors if t is not None]
    if not has_tangent(tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def has_tangent(tensors) -> bool:
    """Whether forward-mode AD is on and a tensor carries a tangent (call it behind
    `forward_mode_on()` where building `tensors` costs anything)."""
    if forward_ad._current_level < 0:
        return False
    return any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def refuse_function_transforms(what: str) -> None:
    """torch.func's transforms (vmap, grad, jvp, jacrev, ...) hand over wrapped tensors without
    storage, which no kernel reads and no insum operator has rules for: refused by name (they
    failed inside the launch path)."""
    if torch._C._are_functorch_transforms_active():
        raise InsumError(
            f"{what} does not run under torch.func transforms (vmap, grad, jvp, jacrev, jacfwd, hessian); "
            "differentiate with torch.autograd (backward, torch.autograd.grad, torch.autograd.forward_ad) and "
            "batch with a loop or a batch variable in the statement"
        )


def mark_written(*outs: torch.Tensor) -> None:
    """Tell autograd that a launch wrote `outs` in place (the kernel writes memory behind
    torch's back): a tensor autograd saved before is then reported as modified at backward,
    as after torch's own in-place ops, instead of being read with its new values. An
    inference tensor written outside inference mode raises, as torch's in-place ops do (after
    the write: the check is on every launch path's way out)."""
    for out in outs:
        if not out.is_inference():  # (no version counter)
            torch.autograd.graph.increment_version(out)
        elif not torch.is_inference_mode_enabled():
            raise InsumError(
                "the output is an inference tensor (made under torch.inference_mode()) updated in place outside "
                "inference mode, which torch does not allow; pass a clone, or call under torch.inference_mode()"
            )


def bind(stmt: Statement, tensors: Mapping[str, object]) -> Bound:
    """Check `tensors` against `stmt`; raise an `InsumError` subclass naming what is wrong.

    A binding depends only on the tensors' signature (dtypes, shapes, strides, devices), so a
    repeated signature reuses the checked binding and only re-checks output aliasing. The
    cache keeps the binding without its tensors, so it never holds user memory alive.
    """
    signature = tensor_signature(tensors)
    if signature is not None:
        known = _BOUND.get((stmt, signature))
        if known is not None:
            check_aliasing(stmt, known.value_names + known.index_names, tensors)
            return known.with_tensors(tensors)
    bound = _bind(stmt, tensors, signature)
    if signature is not None:
        _BOUND[(stmt, signature)] = bound.with_tensors({})
    return bound


def check_aliasing(stmt: Statement, inputs: tuple[str, ...], tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise when the given output shares memory with one of the `inputs` (checked on every
    call: it depends on the tensors' memory, not on their signature)."""
    output = tensors.get(stmt.output.name)
    if output is None or output.numel() == 0:
        return
    storage = output.untyped_storage()
    ptr = storage.data_ptr()  # 0 for meta (shape-only) tensors: no memory
    if ptr == 0:
        return
    end = ptr + storage.nbytes()
    for name in inputs:
        other = tensors[name]
        if not other.numel():
            continue
        # One storage, or two over one buffer (from_numpy, frombuffer, DLPack): their bytes meet.
        held = other.untyped_storage()
        start = held.data_ptr()
        if start == ptr or (start < end and ptr < start + held.nbytes()):
            raise InsumError(
                f"the output {stmt.output.name} shares memory with the input {name} of '{stmt}'; "
                "pass a separate tensor"
            )


def _bind(stmt: Statement, tensors: Mapping[str, object], signature: tuple | None) -> Bound:
    analysis = _analyse(stmt)
    uses = analysis.uses
    out_name = stmt.output.name
    missing = [name for name in uses if name not in tensors]
    if missing:
        raise InsumError(f"missing tensor(s) {', '.join(missing)} for '{stmt}'")
    unused = [name for name in tensors if name not in uses and name != out_name]
    if unused:
        raise InsumError(f"unknown or unused tensor(s) {', '.join(unused)}: '{stmt}' does not read them")
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise InsumTypeError(f"{name} must be a torch.Tensor, not {type(value).__name__}")
        if value.layout != torch.strided:
            raise InsumTypeError(
                f"{name} has layout {value.layout}; insum reads dense (strided) tensors: a sparse matrix "
                "becomes index and value tensors through insum.formats (e.g. GroupCOO.from_torch)"
            )
        if value.is_nested:
            raise InsumTypeError(f"{name} is a nested tensor; insum reads dense (strided) tensors")
        if value.is_neg():  # (the kernel reads and writes memory: it would see the values negated)
            raise InsumTypeError(
                f"{name} is a negative-bit view (as z.conj().imag gives), whose memory holds its values "
                f"negated; pass {name}.resolve_neg()"
            )

    output = tensors.get(out_name)
    checked = analysis.checked
    if output is not None:
        checked = checked + ((out_name, len(stmt.output.indices), analysis.output_dims),)
    for name, rank, _ in checked:
        tensor = tensors[name]
        if tensor.dim() != rank:
            access = next(a for a, _ in stmt.walk() if a.name == name and len(a.indices) == rank)
            raise InsumShapeError(
                f"{name} has rank {tensor.dim()} (shape {tuple(tensor.shape)}) but is "
                f"indexed with {rank} indices in {access}"
            )

    for name in analysis.index_names:
        if tensors[name].dtype not in INDEX_DTYPES:
            raise InsumTypeError(
                f"index tensor {name} has dtype {tensors[name].dtype}; index tensors must be "
                "torch.int32 or torch.int64"
            )
    for name in analysis.value_names + ((out_name,) if output is not None else ()):
        if tensors[name].dtype not in VALUE_DTYPES:
            raise InsumTypeError(
                f"tensor {name} has dtype {tensors[name].dtype}; factors and outputs must be "
                "float16, bfloat16, float32 or float64"
            )

    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise InsumTypeError(f"tensors are on different devices: {where}")
    device = devices.pop() if devices else torch.device("cpu")

    extents: dict[str, int] = {}
    origin: dict[str, tuple[str, int]] = {}
    for name, _, dims in checked:
        shape = tensors[name].shape
        for dim, var in dims:
            size = shape[dim]
            known = extents.setdefault(var, size)
            if known != size:
                first, first_dim = origin[var]
                raise InsumShapeError(
                    f"extent of variable '{var}' is {known} from {first} dimension {first_dim} "
                    f"but {size} from {name} dimension {dim} in '{stmt}'"
                )
            origin.setdefault(var, (name, dim))
    for var in analysis.roles:
        if var not in extents:
            where = "the output" if var in stmt.output.variables() else "any tensor"
            raise InsumShapeError(
                f"cannot infer the extent of variable '{var}': it indexes no dimension of "
                f"{where} directly in '{stmt}'"
                + ("; pass the output tensor" if output is None else "")
            )

    if output is not None:
        check_aliasing(stmt, tuple(uses), tensors)
        _check_distinct_elements(out_name, output)
        out_shape, out_dtype = tuple(output.shape), output.dtype
    else:
        if len(analysis.output_dims) != len(stmt.output.indices):
            raise InsumError(
                f"the shape of the output {out_name} does not follow from '{stmt}' (an output "
                f"index is indirect or affine); pass {out_name}=<tensor>"
            )
        out_shape = tuple(extents[i.variable] for i in stmt.output.indices)
        out_dtype = torch.float32
        if analysis.value_names:
            out_dtype = tensors[analysis.value_names[0]].dtype
            for name in analysis.value_names[1:]:
                out_dtype = torch.promote_types(out_dtype, tensors[name].dtype)

    return Bound(
        stmt=stmt,
        tensors=dict(tensors),
        extents=extents,
        roles=analysis.roles,
        index_names=analysis.index_names,
        value_names=analysis.value_names,
        out_shape=out_shape,
        out_dtype=out_dtype,
        device=device,
        signature=signature,
    )


def _check_distinct_elements(name: str, output: torch.Tensor) -> None:
    """An output whose elements share memory (a stride 0 from `expand`, or strides that
    overlap, from `as_strided`) cannot be written: two of its elements would be one."""
    for dim, (size, stride) in enumerate(zip(output.shape, output.stride())):
        if size > 1 and stride == 0:
            raise InsumShapeError(
                f"the output {name} has stride 0 in dimension {dim} (size {size}): its elements "
                "share memory (an expanded tensor?); pass a tensor with its own storage, e.g. "
                f"{name}.clone()"
            )
    if _overlaps(output):
        raise InsumShapeError(
            f"the output {name} (shape {tuple(output.shape)}, strides {output.stride()}) has elements "
            f"that share memory; pass a tensor with its own storage, e.g. {name}.clone()"
        )


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of `t` share an address. Dimensions sorted by stride, each
    stride beyond the span of the smaller ones proves there are none (every layout torch
    makes); otherwise the addresses are counted."""
    if t.is_contiguous():
        return False
    span = 0
    for stride, size in sorted((abs(st), s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride <= span:
            break
        span += (size - 1) * stride
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return offsets.unique().numel() < t.numel()
