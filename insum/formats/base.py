"""The interface every sparse format shares, its registry, and the packers' common helpers.

A format turns a sparse matrix into plain dense index and value tensors plus the one
indirect Einsum that multiplies it with a dense matrix; `spmm` just runs that statement
through the public `insum()`. Formats never import the code generator or the runtime, so
packing, inspecting and converting need neither Triton nor a GPU.

All packing is vectorised torch code on the input's device, never a Python loop over rows
or nonzeros. On a GPU its time is host syncs (anything whose size or value the host reads)
and kernel launches, so a packer works from the row pointer with `cumsum` / gathers, reads
every size it needs in ONE sync (`Coords.read`), and counts are kept in check by tests
(`opcount.count_ops`).
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..api import insum
from ..errors import InsumError, InsumShapeError, InsumTypeError

__all__ = [
    "FORMATS",
    "SparseFormat",
    "Coords",
    "coords_of",
    "format_class",
    "index_dtype_for",
    "VALUE_DTYPES",
]

VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT32_MAX = 2**31 - 1

#: Every format class by its lower-case name; filled as the format modules are imported.
FORMATS: dict[str, type[SparseFormat]] = {}


def format_class(name: str) -> type[SparseFormat]:
    """Look a format up by name, case-insensitively, listing the valid names when unknown.

    >>> format_class("GroupCOO").__name__
    'GroupCOO'
    """
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise InsumError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}") from None


# --------------------------------------------------------------------------- coordinates


@dataclass(frozen=True)
class Coords:
    """A matrix as row-major coordinates: the common input of every packer.

    rows and cols are int64; vals has the matrix's floating dtype. `crow` is the row
    pointer (M + 1) when the source had one. `unchecked` is None when the coordinates are
    known to be sorted and duplicate-free; otherwise (a CSR tensor, whose invariants torch
    checks only on request) it is a device scalar, positive iff they are. Packers read it in
    their one host sync (`read`) instead of paying a sync of its own, and start again
    from `canonical()` when it fails.
    """

    shape: tuple[int, int]
    rows: torch.Tensor
    cols: torch.Tensor
    vals: torch.Tensor
    crow: torch.Tensor | None = None
    unchecked: torch.Tensor | None = None

    @property
    def nnz(self) -> int:
        return int(self.rows.numel())

    @property
    def device(self) -> torch.device:
        return self.vals.device

    @property
    def dtype(self) -> torch.dtype:
        return self.vals.dtype

    @cached_property
    def row_ptr(self) -> torch.Tensor:
        """Row pointer (int64, M + 1): row r holds entries row_ptr[r] .. row_ptr[r+1] - 1."""
        if self.crow is not None:
            return self.crow
        bounds = torch.arange(self.shape[0] + 1, device=self.device)
        return torch.searchsorted(self.rows, bounds)

    @cached_property
    def counts(self) -> torch.Tensor:
        """Entries per row (int64, length M), without bincount (which syncs on a GPU)."""
        return self.row_ptr.diff()

    def row_counts(self) -> torch.Tensor:
        """Nonzeros per row (int64, length M)."""
        return self.counts

    def read(self, *tensors: torch.Tensor) -> list[int] | None:
        """The integer values of `tensors`, flattened and concatenated, in ONE host sync.

        Returns None when the coordinates turn out not to be canonical: the caller then
        packs `self.canonical()` instead (its device work so far is discarded).
        """
        parts = [t.reshape(-1) for t in tensors]
        if self.unchecked is not None:
            parts.insert(0, self.unchecked.reshape(1))
        if not parts:
            return []
        parts = [p if p.dtype == torch.int64 else p.long() for p in parts]
        values = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        if self.unchecked is not None and values.pop(0) <= 0:
            return None
        return values

    def checked(self) -> Coords:
        """These coordinates if canonical (one sync when unverified), else `canonical()`."""
        if self.unchecked is None:
            return self
        if self.read() is None:
            return self.canonical()
        return Coords(self.shape, self.rows, self.cols, self.vals, self.crow)

    def canonical(self) -> Coords:
        """Sorted row-major with duplicates summed (torch's coalesce rule)."""
        K = max(self.shape[1], 1)
        key, order = torch.sort(self.rows * K + self.cols, stable=True)
        vals = self.vals[order]
        key, inverse = torch.unique_consecutive(key, return_inverse=True)
        summed = torch.zeros(key.numel(), dtype=vals.dtype, device=vals.device)
        return Coords(self.shape, key // K, key % K, summed.index_add_(0, inverse, vals))


def check_values(dtype: torch.dtype, what: str = "matrix values have") -> None:
    if dtype not in VALUE_DTYPES:
        raise InsumTypeError(
            f"{what} dtype {dtype}; formats store and multiply float16, bfloat16, float32 or "
            "float64 values (convert with .float() first)"
        )


def _unchecked(shape: tuple[int, int], rows, cols, vals, crow=None) -> Coords:
    """Coordinates whose canonical check is left on the device for the packer's one sync."""
    rows, cols = rows.long(), cols.long()
    check = None
    if cols.numel() > 1:
        # Strictly increasing row-major keys: sorted and duplicate-free.
        check = torch.add(cols, rows, alpha=max(shape[1], 1)).diff().min()
    return Coords(shape, rows, cols, vals, crow, check)


def coords_of(A: torch.Tensor) -> Coords:
    """Coordinates of a dense or sparse (COO, CSR, CSC, BSR, BSC) 2-D matrix.

    Dense matrices and BSR/BSC blocks keep their nonzero elements only (zeros inside a
    stored block are block padding); COO and CSR keep every stored entry, explicit zeros
    included, because the caller chose to store them. A CSR tensor costs no host sync:
    its rows come from the row pointer and its check waits for the packer's sync.
    """
    if not isinstance(A, torch.Tensor):
        raise InsumTypeError(f"expected a torch.Tensor, got {type(A).__name__}")
    if A.dim() != 2:
        raise InsumShapeError(f"formats pack matrices; got a tensor of shape {tuple(A.shape)}")
    check_values(A.dtype)
    shape = (int(A.shape[0]), int(A.shape[1]))
    layout = A.layout
    if layout == torch.strided:
        rows, cols = A.nonzero(as_tuple=True)
        return Coords(shape, rows, cols, A[rows, cols])
    if layout == torch.sparse_coo:
        if A.sparse_dim() != 2:
            raise InsumShapeError(
                "hybrid sparse COO tensors (with dense dimensions) are not supported"
            )
        A = A.coalesce()
        rows, cols = A.indices()
        return Coords(shape, rows, cols, A.values())
    if layout == torch.sparse_csr:
        if A.values().dim() != 1:
            raise InsumShapeError("batched or hybrid sparse CSR tensors are not supported")
        crow, cols = A.crow_indices().long(), A.col_indices()
        counts = crow.diff()
        rows = torch.repeat_interleave(counts, output_size=cols.numel())
        coords = _unchecked(shape, rows, cols, A.values(), crow)
        coords.__dict__["counts"] = counts  # the cached property, already computed
        return coords
    if layout == torch.sparse_bsr:
        blocks = A.values()
        if blocks.dim() != 3:
            raise InsumShapeError("batched or hybrid sparse BSR tensors are not supported")
        nb, bm, bk = blocks.shape
        crow = A.crow_indices().long()
        brow = torch.repeat_interleave(crow.diff(), output_size=nb)
        rows = brow.view(nb, 1, 1) * bm + torch.arange(bm, device=A.device).view(1, bm, 1)
        cols = A.col_indices().long().view(nb, 1, 1) * bk + torch.arange(bk, device=A.device).view(
            1, 1, bk
        )
        rows, cols = rows.expand(nb, bm, bk).reshape(-1), cols.expand(nb, bm, bk).reshape(-1)
        vals = blocks.reshape(-1)
        keep = vals != 0
        return _unchecked(shape, rows[keep], cols[keep], vals[keep]).checked()
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        coo = A.to_sparse_coo().coalesce()
        rows, cols = coo.indices()
        vals = coo.values()
        if layout == torch.sparse_bsc:
            keep = vals != 0
            rows, cols, vals = rows[keep], cols[keep], vals[keep]
        return Coords(shape, rows, cols, vals)
    raise InsumTypeError(f"unsupported tensor layout {layout}")


# --------------------------------------------------------------------------- helpers


def index_dtype_for(*sizes: int, requested: torch.dtype | None = None) -> torch.dtype:
    """int32 unless an index could exceed it (any size >= 2**31), or the caller's choice.

    int32 halves the index traffic of a gather-heavy kernel, so it is the default.
    """
    need64 = any(int(s) > INT32_MAX for s in sizes)
    if requested is None:
        return torch.int64 if need64 else torch.int32
    if requested not in (torch.int32, torch.int64):
        raise InsumTypeError(f"index_dtype must be torch.int32 or torch.int64, not {requested}")
    if requested == torch.int32 and need64:
        raise InsumError(f"index_dtype=torch.int32 cannot hold indices up to {max(sizes)}")
    return requested


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """Validate an integer parameter, raising an InsumError that names it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InsumError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def round_pow2(x: float) -> int:
    """The power of two nearest to x in log scale (at least 1)."""
    return 1 if x <= 1 else 1 << round(math.log2(x))


def _group_size_rule(nnz: int, nonempty: int, longest_pow2: int) -> int:
    if nonempty == 0:
        return 1
    return min(round_pow2(math.sqrt(nnz / nonempty)), longest_pow2)


def default_group_size(counts: torch.Tensor) -> int:
    """The InSum paper's group size: minimise gathers plus scatters (paper §4.2).

    With group size g, row i issues ceil(n_i/g) scatters and g gathers per group; bounding
    ceil(x) by x + 1 gives nnz + nnz/g + R g + R over the R non-empty rows, minimised at
    g = sqrt(nnz / R). Rounded to the nearest power of two (Triton's tiles are powers of
    two) and capped at the longest row, beyond which a larger g only adds padding.
    """
    nnz, nonempty, longest = torch.stack(
        [counts.sum(), (counts > 0).sum(), counts.max() if counts.numel() else counts.sum()]
    ).tolist()
    return _group_size_rule(nnz, nonempty, next_pow2(longest))


class GroupCounts:
    """Groups per row for every power-of-two group size the paper's rule can pick.

    Computed on the device before the packer's one sync (`values`), so that the rule and
    the padded size G, which the host must know to allocate, cost no sync of their own.
    """

    def __init__(self, counts: torch.Tensor, width: int):
        # Exponents 0 .. bit_length(width): the last exceeds any row (at most `width`
        # entries), so it counts the non-empty rows, and the rule's g <= next_pow2(width).
        shifts = torch.arange(max(width, 1).bit_length() + 1, device=counts.device)
        # ceil(c / 2^e) = -((-c) >> e): kept negated, the host flips the sums.
        self.neg_groups = (-counts).unsqueeze(0) >> shifts.unsqueeze(1)
        self.exponents = len(shifts)
        # Group counts per exponent, then the most groups any row has (its fan-in).
        padded = F.pad(self.neg_groups, (0, 1))  # a zero column: rows may be absent
        self.values = torch.cat([self.neg_groups.sum(1), padded.min(1).values])

    def choose(self, host: list[int]) -> tuple[int, int]:
        """(g, G) by the paper's rule from `values` read back."""
        groups = [-v for v in host[: self.exponents]]
        nnz, nonempty = groups[0], groups[-1]  # g = 1: one group per entry
        longest = next(e for e, n in enumerate(groups) if n == nonempty)
        g = _group_size_rule(nnz, nonempty, 1 << longest)
        return g, groups[g.bit_length() - 1]

    def per_row(self, g: int) -> torch.Tensor:
        """Groups in each row for a power-of-two g."""
        return self.neg_groups[g.bit_length() - 1].neg()

    def fan_in(self, host: list[int], g: int) -> int:
        """The most groups one row has for a power-of-two g (from `values` read back)."""
        return -host[self.exponents + g.bit_length() - 1]


#: A scattering SpMM adds each group's partial sum into its output row. Up to this many per
#: row, half-precision outputs take them in their own precision (native atomics); more
#: are accumulated in float32 and rounded once.
HALF_FAN_IN = 8


def accumulation_dtype(dtype: torch.dtype, fan_in: int | None) -> torch.dtype:
    """The output dtype a scattering SpMM accumulates in (fan_in None: unknown, so float32)."""
    if dtype in (torch.float16, torch.bfloat16) and (fan_in is None or fan_in > HALF_FAN_IN):
        return torch.float32
    return dtype


def grouped_slots(
    idx: torch.Tensor, end: torch.Tensor, pad: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx [G, g], valid [G, g]) for groups of consecutive entries idx[j, 0] ... < end[j].

    A padded slot's idx becomes its group's `pad` (default: its first entry), so that the
    column gathered there re-reads a row of B that the group reads anyway.
    """
    valid = idx < end.unsqueeze(1)
    return torch.where(valid, idx, idx[:, :1] if pad is None else pad.unsqueeze(1)), valid


def pack_row_groups(
    crow: torch.Tensor, per_row: torch.Tensor, g: int, G: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each row's entries into per_row[r] groups of g slots, by gathers, no sync.

    Returns (group_row [G], idx [G, g], valid [G, g], base [M]); group j (global) of row r
    holds entries base[r] + j*g onwards. Groups are ordered by row and never empty.
    """
    cum = torch.cumsum(per_row, 0)
    base = torch.sub(crow[:-1], cum - per_row, alpha=g)
    group_row = torch.repeat_interleave(per_row, output_size=G)
    slots = torch.arange(G * g, device=crow.device).view(G, g)  # j*g + q
    idx, valid = grouped_slots(slots + base[group_row].unsqueeze(1), crow[1:][group_row])
    return group_row, idx, valid, base


def normalise_device(device: torch.device | str) -> torch.device:
    """`cuda` -> `cuda:<current>`, so that devices compare equal to a tensor's."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def value_dtype_of(*dtypes: torch.dtype) -> torch.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def overwrite(expression: str) -> str:
    """The statement with `=` for `+=`: the output needs no zero fill (single-owner outputs
    are stored once; scattered ones are zeroed by the runtime only where it must).

    Plain string work, so that torch.compile traces it."""
    output, product = expression.split("+=", 1)
    return f"{output.rstrip()} = {product.lstrip()}"


# --------------------------------------------------------------------------- the base class


class SparseFormat:
    """A sparse matrix packed as dense index/value tensors plus its SpMM statement.

    Subclasses set `name` (the registry key) and `expression`, implement `_pack(coords,
    **params)` and `to_dense()` (and `_spmm(...)` when the output is not C (M, N)), and
    list their value tensors in `_value_names` so that `padding_ratio` can count stored
    slots.

    Attributes: shape (M, K); nnz (entries packed, explicit zeros included); dtype (of the
    values); index_dtype; device; params (the chosen parameters); each packed tensor is
    also an attribute (`fmt.AK`).
    """

    name: ClassVar[str] = ""
    expression: ClassVar[str] = ""
    _value_names: ClassVar[tuple[str, ...]] = ()
    #: Index tensors the packer keeps sorted (equal values adjacent): passed to `insum()`
    #: as `sorted_indices`, so a scatter through them is reduced per segment in registers.
    sorted_indices: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        shape: tuple[int, int],
        tensors: Mapping[str, torch.Tensor],
        *,
        nnz: int,
        dtype: torch.dtype,
        index_dtype: torch.dtype,
        device: torch.device,
        params: Mapping[str, Any] | None = None,
    ):
        self.shape = (int(shape[0]), int(shape[1]))
        self._tensors = dict(tensors)
        self.nnz = int(nnz)
        self.dtype = dtype  # of the values
        self.index_dtype = index_dtype
        self.device = normalise_device(device)
        self.params = dict(params or {})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            FORMATS[cls.name.lower()] = cls

    # ----------------------------------------------------------------- construction

    @classmethod
    def _packed(
        cls,
        coords: Coords,
        tensors: Mapping[str, torch.Tensor],
        index_dtype: torch.dtype,
        params: Mapping[str, Any] | None = None,
    ) -> SparseFormat:
        """The format holding `tensors` packed from `coords` (shape, nnz, dtype, device)."""
        return cls(
            coords.shape,
            tensors,
            nnz=coords.nnz,
            dtype=coords.dtype,
            index_dtype=index_dtype,
            device=coords.device,
            params=params,
        )

    @classmethod
    def from_dense(cls, A: torch.Tensor, **params: Any) -> SparseFormat:
        """Pack the nonzeros of a dense matrix (on its own device)."""
        if isinstance(A, torch.Tensor) and A.layout != torch.strided:
            raise InsumTypeError(
                f"from_dense expects a dense tensor, got layout {A.layout}; use from_torch"
            )
        cls._check_params(params)
        return cls._pack(coords_of(A), **params)

    @classmethod
    def from_torch(cls, t: torch.Tensor, **params: Any) -> SparseFormat:
        """Pack a torch sparse matrix (COO, CSR, CSC, BSR or BSC layout)."""
        if not isinstance(t, torch.Tensor) or t.layout == torch.strided:
            got = t.layout if isinstance(t, torch.Tensor) else type(t).__name__
            raise InsumTypeError(
                f"from_torch expects a torch sparse tensor, got {got}; use from_dense"
            )
        cls._check_params(params)
        return cls._pack(coords_of(t), **params)

    @classmethod
    def _check_params(cls, params: Mapping[str, Any]) -> None:
        """Reject a misspelt parameter by name, listing the valid ones."""
        valid = [p for p in inspect.signature(cls._pack).parameters if p not in ("coords", "cls")]
        unknown = [p for p in params if p not in valid]
        if unknown:
            raise InsumError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))} for {cls.__name__}; "
                f"valid: {', '.join(valid)}"
            )

    @classmethod
    def _pack(cls, coords: Coords, **params: Any) -> SparseFormat:
        raise NotImplementedError

    # ----------------------------------------------------------------- inspection

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The packed tensors by the names the SpMM statement uses."""
        return dict(self._tensors)

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("_tensors")
        if tensors is not None and name in tensors:
            return tensors[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed tensors (indices, values and padding)."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def stored_values(self) -> int:
        """Value slots stored, padding included."""
        return sum(t.numel() for n, t in self._tensors.items() if self._is_value(n))

    @property
    def padding_ratio(self) -> float:
        """Fraction of stored value slots that are padding (0.0 when nothing is stored)."""
        slots = self.stored_values
        return 0.0 if slots == 0 else 1.0 - self.nnz / slots

    def _describe(self) -> dict[str, Any]:
        """Parameters shown by repr; subclasses add their own."""
        return dict(self.params)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self._describe().items())
        return (
            f"{type(self).__name__}(shape={self.shape}, nnz={self.nnz}"
            + (f", {params}" if params else "")
            + f", padding={self.padding_ratio:.1%}, dtype={self.dtype}, "
            f"index_dtype={self.index_dtype}, device={self.device})"
        )

    def describe(self) -> str:
        """The repr, and why this format was chosen when `formats.auto` chose it."""
        chosen = self.params.get("chosen")
        return repr(self) + (f"\n{chosen}" if chosen else "")

    def to(self, device: torch.device | str) -> SparseFormat:
        """A copy with every tensor on `device` (the packing itself is not repeated)."""
        moved = copy.copy(self)
        moved._tensors = {k: v.to(device) for k, v in self._tensors.items()}
        moved.device = normalise_device(device)
        moved.params = dict(self.params)
        return moved

    def to_dense(self) -> torch.Tensor:
        """The matrix as a dense tensor; padding adds exact zeros, so this is exact."""
        raise NotImplementedError

    # ----------------------------------------------------------------- SpMM

    def spmm(
        self, B: torch.Tensor, *, backend: str = "auto", precision: str = "tf32"
    ) -> torch.Tensor:
        """A @ B by running the format's indirect Einsum through `insum()`.

        B is (K, N) or a vector (K,). The result has the promoted dtype of A and B;
        half-precision results are accumulated in float32 and rounded once.
        """
        if not isinstance(B, torch.Tensor) or B.layout != torch.strided:
            raise InsumTypeError("spmm expects a dense torch.Tensor operand")
        vector = B.dim() == 1
        if vector:
            B = B.unsqueeze(1)
        if B.dim() != 2 or B.shape[0] != self.shape[1]:
            raise InsumShapeError(
                f"cannot multiply {type(self).__name__} of shape {self.shape} with B of shape "
                f"{tuple(B.shape)}: A has {self.shape[1]} columns, B dimension 0 has {B.shape[0] if B.dim() else 0}"
            )
        check_values(B.dtype, f"the dense operand B of {type(self).__name__} @ B has")
        if B.device != self.device:
            raise InsumTypeError(
                f"B is on {B.device} but the {type(self).__name__} tensors are on {self.device}; use .to()"
            )
        out_dtype = value_dtype_of(self.dtype, B.dtype)
        M, N = self.shape[0], B.shape[1]
        if self.nnz == 0 or M == 0 or N == 0:
            C = torch.zeros(M, N, dtype=out_dtype, device=B.device)
        else:
            # Both factors and the output in the promoted dtype: the kernel sees one value
            # dtype and accumulates half precision in float32 itself.
            B = B if B.dtype == out_dtype else B.to(out_dtype)  # (a no-op .to still costs a dispatch)
            C = self._spmm(B, out_dtype, backend, precision)  # any strides
        return C.squeeze(1) if vector else C

    def __matmul__(self, B: torch.Tensor) -> torch.Tensor:
        return self.spmm(B)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """`fmt @ B` under torch.compile: dynamo hands it over as `B.matmul(fmt)` (operands
        swapped) or `Tensor.__rmatmul__`; both are the format's SpMM."""
        if (
            len(args) == 2
            and not kwargs
            and isinstance(args[0], torch.Tensor)
            and isinstance(args[1], SparseFormat)
            and (func is torch.Tensor.__rmatmul__ or (func is torch.Tensor.matmul and torch.compiler.is_compiling()))
        ):
            return args[1].spmm(args[0])
        return NotImplemented

    def _values(self, compute: torch.dtype) -> dict[str, torch.Tensor]:
        """Tensors with value tensors converted to the compute dtype (no copy when equal)."""
        if compute == self.dtype:
            return self._tensors
        return {k: (v.to(compute) if self._is_value(k) else v) for k, v in self._tensors.items()}

    def _is_value(self, name: str) -> bool:
        return name in self._value_names

    @property
    def fan_in(self) -> int | None:
        """The most groups that add into one output row (None: not recorded)."""
        return self.params.get("fan_in")

    def _spmm(self, B: torch.Tensor, dtype: torch.dtype, backend: str, precision: str) -> torch.Tensor:
        """A @ B for a statement whose output is C (M, N), run with `=`; half precision
        accumulates in float32 where many groups meet in one row (`accumulation_dtype`)."""
        C = torch.empty(self.shape[0], B.shape[1], dtype=accumulation_dtype(dtype, self.fan_in), device=B.device)
        self._run(overwrite(self.expression), backend, precision, C=C, B=B, **self._values(dtype))
        return C if C.dtype == dtype else C.to(dtype)

    def _run(
        self, expression: str, backend: str, precision: str, **tensors: torch.Tensor
    ) -> torch.Tensor:
        # Packing guarantees in-range indices: no index check, whatever INSUM_CHECK_INDICES says.
        facts = self.sorted_indices & tensors.keys()
        return insum(
            expression, backend=backend, precision=precision, check_indices=False, sorted_indices=facts, **tensors
        )


def time_spmm(fmt: SparseFormat, B: torch.Tensor, backend: str, reps: int = 5) -> float:
    """Median seconds of `fmt.spmm(B)` on the current device, after one warm-up run."""

    def sync() -> None:
        if B.device.type == "cuda":
            torch.cuda.synchronize(B.device)

    fmt.spmm(B, backend=backend)  # compiles and autotunes on the first call
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fmt.spmm(B, backend=backend)
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def tuning_operand(coords: Coords, tune_cols: int) -> torch.Tensor:
    """The dense B that `group_size="tune"` times SpMMs with: seeded, so tuning repeats."""
    generator = torch.Generator(device=coords.device).manual_seed(0)
    return torch.randn(
        coords.shape[1],
        check_positive_int("tune_cols", tune_cols),
        generator=generator,
        dtype=coords.dtype,
        device=coords.device,
    )


def tune(
    candidates: list[int], build: Callable[[int], SparseFormat], B: torch.Tensor, backend: str
) -> tuple[SparseFormat, dict[int, float]]:
    """Build the format for each candidate, time its SpMM, and keep the fastest."""
    best, best_time, times = None, math.inf, {}
    for candidate in candidates:
        fmt = build(candidate)
        times[candidate] = time_spmm(fmt, B, backend)
        if times[candidate] < best_time:
            best, best_time = fmt, times[candidate]
    return best, times
