"""A matrix as row-major coordinates, the common input of every packer, and the checks
every packer shares (value dtypes, index dtypes, integer parameters, devices).

`coords_of` reads any dense or torch sparse layout without a host sync of its own: a CSR
input's canonical check waits on the device for the packer's one sync (`Coords.read`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from ..dtypes import INT32_MAX, VALUE_DTYPES
from ..errors import InsumError, InsumShapeError, InsumTypeError

__all__ = [
    "VALUE_DTYPES",
    "Coords",
    "check_positive_int",
    "check_values",
    "coords_of",
    "index_dtype_for",
    "normalise_device",
    "value_dtype_of",
]


@dataclass(frozen=True)
class Coords:
    """A matrix as row-major coordinates: the common input of every packer.

    rows and cols are int64; vals has the matrix's floating dtype. `crow` is the row
    pointer (M + 1) when the source had one. `unchecked` is None when the coordinates are
    known to be sorted and duplicate-free; otherwise (a CSR tensor, whose invariants torch
    checks only on request) it is a device scalar, positive iff they are. Packers read it in
    their one host sync (`read`) instead of paying a sync of its own, and start again
    from `canonical()` when it fails. `outside` is None when every coordinate is known to
    lie within the shape; otherwise (a torch sparse tensor: torch checks its indices only on
    request) the least and the greatest (row and) column (`_extremes`), read in the same
    sync, which then raises: a packed index out of range would send the products (which
    trust their packed indices) outside B or C.
    """

    shape: tuple[int, int]
    rows: torch.Tensor
    cols: torch.Tensor
    vals: torch.Tensor
    crow: torch.Tensor | None = None
    unchecked: torch.Tensor | None = None
    outside: tuple[torch.Tensor, torch.Tensor] | None = None

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
        if self.outside is not None:
            parts[:0] = self.outside
        if not parts:
            return []
        parts = [p if p.dtype == torch.int64 else p.long() for p in parts]
        values = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        if self.outside is not None and _outside(
            self.shape, *([values.pop(0) for _ in range(len(part))] for part in self.outside)
        ):
            raise InsumShapeError(
                f"the sparse tensor holds an index outside its shape {self.shape} (torch checks a sparse "
                "tensor's indices only on request: torch.sparse.check_sparse_tensor_invariants)"
            )
        if self.unchecked is not None and values.pop(0) <= 0:
            return None
        return values

    def checked(self) -> Coords:
        """These coordinates if canonical and within the shape (one sync when unverified),
        else `canonical()`."""
        if self.unchecked is None and self.outside is None:
            return self
        if self.read() is None:
            return self.canonical()
        return Coords(self.shape, self.rows, self.cols, self.vals, self.crow)

    def within_shape(self) -> Coords:
        """These coordinates with any index outside the shape clamped into it (one op a
        checked axis), for a packer whose device work indexes by them before its sync: the
        sync's `read` raises all the same."""
        if self.outside is None:
            return self
        M, K = self.shape
        rows = self.rows.clamp(0, max(M - 1, 0)) if len(self.outside[0]) == 2 else self.rows
        cols = self.cols.clamp(0, max(K - 1, 0))
        return Coords(self.shape, rows, cols, self.vals, self.crow, self.unchecked, self.outside)

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
    """Coordinates whose canonical and range checks are left on the device for the packer's
    one sync."""
    rows, cols = rows.long(), cols.long()
    check = None
    if cols.numel() > 1:
        # Strictly increasing row-major keys: sorted and duplicate-free.
        check = torch.add(cols, rows, alpha=max(shape[1], 1)).diff().min()
    return Coords(shape, rows, cols, vals, crow, check, _extremes(cols.view(1, -1)))


def _extremes(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Coords.outside` in one op: the least and the greatest of each row of `indices` (2 x nnz
    rows and columns, or 1 x nnz columns whose rows follow from a row pointer). None without
    coordinates."""
    if indices.numel() == 0:
        return None
    return torch.aminmax(indices, dim=1)


def _outside(shape: tuple[int, int], least: list[int], greatest: list[int]) -> bool:
    """Whether the least / greatest (row and) column (`_extremes`) leave `shape`."""
    sizes = shape[-len(least):]
    return min(least) < 0 or any(g >= n for g, n in zip(greatest, sizes))


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
        return Coords(shape, rows, cols, A.values(), outside=_extremes(A.indices()))
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
        return Coords(shape, rows, cols, vals, outside=_extremes(torch.stack([rows, cols])))
    raise InsumTypeError(f"unsupported tensor layout {layout}")


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


def check_block(block: Any) -> tuple[int, int]:
    """A block shape (bm, bk), given as one integer (square) or a pair of positive integers."""
    if isinstance(block, int) and not isinstance(block, bool):
        block = (block, block)
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise InsumError(f"block must be an integer or a pair (bm, bk), got {block!r}")
    return check_positive_int("block bm", block[0]), check_positive_int("block bk", block[1])


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """Validate an integer parameter, raising an InsumError that names it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InsumError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def normalise_device(device: torch.device | str) -> torch.device:
    """`cuda` -> `cuda:<current>`, `cpu:0` -> `cpu`: as a tensor moved there reports its
    device, so that the two compare equal."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


def value_dtype_of(*dtypes: torch.dtype) -> torch.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out
