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
from .grouping import COVER_BLOCK, covering_layout, covering_slots

__all__ = ["COO"]


class COO(SparseFormat):
    """Coordinate format: AM[nnz] rows, AK[nnz] columns, AV[nnz] values.

    cover: where every row holds at most 16 entries and the layout pads at most M entries,
    pack GroupCOO's covering layout with groups of one (`GroupCOO.covering_block`): every row,
    empty ones too, inside one aligned block of 16 entries (padding entries hold value 0),
    so that the repeated product stores every row into an uninitialised C with no zero fill.
    False keeps one entry per nonzero.

    >>> A = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    >>> (COO.from_dense(A) @ torch.eye(2)).tolist()
    [[0.0, 2.0], [3.0, 0.0]]
    """

    name = "coo"
    expression = "C[AM[p],n] += AV[p]*B[AK[p],n]"
    _value_names = ("AV",)
    sorted_indices = frozenset({"AM"})
    #: One statement: no other writes its rows.
    disjoint_statements = True

    @classmethod
    def _pack(cls, coords: Coords, *, index_dtype: torch.dtype | None = None, cover: bool = True) -> COO:
        itype = index_dtype_for(*coords.shape, requested=index_dtype)
        # The one sync: is a CSR input canonical, and the longest row (each entry of a row
        # is a contribution to its output row).
        host = coords.read(F.pad(coords.counts, (0, 1)).max())
        if host is None:
            coords = coords.canonical()
            host = coords.read(F.pad(coords.counts, (0, 1)).max())
        params = {"fan_in": host[0]}
        layout = covering_layout(coords.counts, coords.nnz, 1, host[0]) if cover else None
        if layout is None:
            tensors = {
                "AM": coords.rows.to(itype),
                "AK": coords.cols.to(itype),
                "AV": coords.vals.clone(),
            }
        else:
            rows, idx, valid = covering_slots(coords.row_ptr, layout, 1, layout.padded)
            idx, valid = idx.view(-1), valid.view(-1)
            tensors = {"AM": rows.to(itype), "AK": coords.cols[idx].to(itype), "AV": torch.where(valid, coords.vals[idx], 0)}
            params["covering_block"] = COVER_BLOCK
        return cls._packed(coords, tensors, itype, params)

    @property
    def covering_block(self) -> int | None:
        """16 where the packer laid the entries out to cover C (see `GroupCOO.covering_block`)."""
        return self.params.get("covering_block")

    def _slot_rows(self) -> tuple[torch.Tensor, bool]:
        return self.AM, False

    def _describe(self) -> dict[str, Any]:
        return {}
