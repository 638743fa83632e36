"""COO: one (row, column, value) triple per nonzero; one scatter and one gather each.

The simplest format and the degenerate GroupCOO with group size 1: it has no padding at
all, but every nonzero updates C on its own, so it issues the most atomics.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .base import SparseFormat
from .coords import Coords, index_dtype_for

__all__ = ["COO"]


class COO(SparseFormat):
    """Coordinate format: AM[nnz] rows, AK[nnz] columns, AV[nnz] values.

    >>> A = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    >>> (COO.from_dense(A) @ torch.eye(2)).tolist()
    [[0.0, 2.0], [3.0, 0.0]]
    """

    name = "coo"
    expression = "C[AM[p],n] += AV[p]*B[AK[p],n]"
    _value_names = ("AV",)
    sorted_indices = frozenset({"AM"})

    @classmethod
    def _pack(cls, coords: Coords, *, index_dtype: torch.dtype | None = None) -> COO:
        itype = index_dtype_for(*coords.shape, requested=index_dtype)
        # The one sync: is a CSR input canonical, and the longest row (each entry of a row
        # is a contribution to its output row).
        host = coords.read(F.pad(coords.counts, (0, 1)).max())
        if host is None:
            coords = coords.canonical()
            host = coords.read(F.pad(coords.counts, (0, 1)).max())
        tensors = {
            "AM": coords.rows.to(itype),
            "AK": coords.cols.to(itype),
            "AV": coords.vals.clone(),
        }
        return cls._packed(coords, tensors, itype, {"fan_in": host[0]})

    def _slot_rows(self) -> tuple[torch.Tensor, bool]:
        return self.AM, False

    def _describe(self) -> dict[str, Any]:
        return {}
