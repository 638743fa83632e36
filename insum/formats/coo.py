"""COO: one (row, column, value) triple per nonzero; one scatter and one gather each.

The simplest format and the degenerate GroupCOO with group size 1: it has no padding at
all, but every nonzero updates C on its own, so it issues the most atomics.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Coords, SparseFormat, index_dtype_for, overwrite

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

    @classmethod
    def _pack(cls, coords: Coords, *, index_dtype: torch.dtype | None = None) -> COO:
        itype = index_dtype_for(*coords.shape, requested=index_dtype)
        if coords.read() is None:  # the one sync: is a CSR input canonical?
            coords = coords.canonical()
        tensors = {
            "AM": coords.rows.to(itype),
            "AK": coords.cols.to(itype),
            "AV": coords.vals.clone(),
        }
        return cls._packed(coords, tensors, itype)

    def to_dense(self) -> torch.Tensor:
        dense = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return dense.index_put_((self.AM.long(), self.AK.long()), self.AV, accumulate=True)

    def _spmm(self, B, dtype, backend, precision) -> torch.Tensor:
        C = torch.empty(self.shape[0], B.shape[1], dtype=dtype, device=B.device)
        return self._run(overwrite(self.expression), backend, precision, C=C, B=B, **self._values(dtype))

    def _describe(self) -> dict[str, Any]:
        return {}
