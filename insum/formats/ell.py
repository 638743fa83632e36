"""ELL (Ellpack): every row padded to the longest row's length W; no scatter at all.

C is indexed directly by the row, so each output row has one owner and the kernel needs
no atomics; the price is padding, which grows with the skew of the row lengths.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import SparseFormat
from .coords import Coords, index_dtype_for

__all__ = ["ELL"]


class ELL(SparseFormat):
    """Ellpack: AK[M, W] columns and AV[M, W] values, W = longest row (at least 1).

    Padded slots hold value 0 and the row's first column (column 0 in empty rows), so they
    add nothing and re-read a row of B that is already being read.

    >>> A = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    >>> ELL.from_dense(A).AK.tolist()
    [[0, 2], [2, 2]]
    """

    name = "ell"
    expression = "C[m,n] += AV[m,q]*B[AK[m,q],n]"
    _value_names = ("AV",)

    @classmethod
    def _pack(cls, coords: Coords, *, index_dtype: torch.dtype | None = None) -> ELL:
        M, K = coords.shape
        itype = index_dtype_for(M, K, requested=index_dtype)
        counts, crow = coords.counts, coords.row_ptr
        host = coords.read(counts.max() if M else counts.sum())  # the one sync: W
        if host is None:
            return cls._pack(coords.canonical(), index_dtype=index_dtype)
        width = max(host[0], 1)  # a zero-width tensor helps no kernel
        # Scatter the entries into padded rows (padding can dwarf nnz: gathering every slot
        # would cost more). A row's pad is its first (smallest) column, 0 when empty.
        rows, cols = coords.rows, coords.cols
        slot = torch.arange(coords.nnz, device=coords.device) - crow[rows]
        pad = torch.zeros(M, dtype=torch.int64, device=coords.device)
        pad.scatter_reduce_(0, rows, cols, reduce="amin", include_self=False)
        AK = pad.unsqueeze(1).repeat(1, width)
        AK[rows, slot] = cols
        AV = torch.zeros(M, width, dtype=coords.dtype, device=coords.device)
        AV[rows, slot] = coords.vals
        return cls._packed(coords, {"AK": AK.to(itype), "AV": AV}, itype)

    @classmethod
    def row_padding_slots(cls, shape: tuple[int, int], longest: int, params: Mapping[str, Any]) -> int:
        """M x W: every row padded to the longest."""
        return shape[0] * max(longest, 1)

    @property
    def width(self) -> int:
        """W, the padded row length."""
        return int(self.AK.shape[1])

    @property
    def fan_in(self) -> int:
        """One group per row: every output row has one owner."""
        return 1

    def _slot_rows(self) -> tuple[torch.Tensor, bool]:
        rows = torch.arange(self.AK.shape[0], device=self.AK.device)
        return rows.unsqueeze(1).expand_as(self.AK), True

    def _describe(self) -> dict[str, Any]:
        return {"width": self.width}
