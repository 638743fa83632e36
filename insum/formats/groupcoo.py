"""GroupCOO: each row's nonzeros cut into groups of g, one row index per group (InSum §4).

Between COO (g = 1: no padding, one scatter per nonzero) and ELL (g = longest row: no
scatter, most padding). A group accumulates its g products in registers and issues one
scatter, so g trades atomics for padding; the default g minimises gathers plus scatters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..arith import cdiv, next_power_of_2
from ..errors import InsumError
from .base import SparseFormat
from .coords import Coords, check_positive_int, index_dtype_for
from .grouping import (
    COVER_BLOCK,
    GroupCounts,
    covering_layout,
    covering_slots,
    default_group_size,
    pack_row_groups,
)
from .tuning import tune, tuning_operand

__all__ = ["GroupCOO"]


class GroupCOO(SparseFormat):
    """Grouped COO: AM[G] group rows, AK[G, g] columns, AV[G, g] values.

    Groups never span two rows and are ordered by row (AM is non-decreasing). Padded
    slots hold value 0 and the group's first column. In the covering layout every row, empty
    ones too, has at least one group and no row's groups cross an aligned block of 16 (the
    groups skipped at a block's end are all-padding groups of the row before them).

    group_size: an integer >= 1; None (default) for the paper's rule, about
    sqrt(nnz / non-empty rows) rounded to a power of two; or "tune" to time that value
    and its power-of-two neighbours with the real SpMM on the matrix's device (B with
    `tune_cols` columns, `backend` as given) and keep the fastest.
    cover: lay the groups out to cover C where that applies (`covering_block`: rows of at
    most 16 groups, at most M padding slots), so that the repeated product stores every row
    into an uninitialised C with no zero fill; False keeps the plain layout.

    >>> A = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    >>> G = GroupCOO.from_dense(A, group_size=2)
    >>> G.AM.tolist(), G.AK.tolist()
    ([0, 0, 1], [[0, 1], [2, 2], [2, 2]])
    """

    name = "groupcoo"
    expression = "C[AM[p],n] += AV[p,q]*B[AK[p,q],n]"
    _value_names = ("AV",)
    sorted_indices = frozenset({"AM"})
    #: One statement: no other writes its rows.
    disjoint_statements = True

    @classmethod
    def _pack(
        cls,
        coords: Coords,
        *,
        group_size: int | str | None = None,
        index_dtype: torch.dtype | None = None,
        tune_cols: int = 128,
        backend: str = "auto",
        cover: bool = True,
    ) -> GroupCOO:
        if group_size == "tune":
            return cls._tuned(coords, index_dtype, tune_cols, backend, cover)
        if isinstance(group_size, str):
            raise InsumError(
                f"group_size must be an integer >= 1, None or 'tune', got {group_size!r}"
            )
        if group_size is not None:
            check_positive_int("group_size", group_size)
        M, K = coords.shape
        itype = index_dtype_for(M, K, requested=index_dtype)
        counts = coords.counts
        # The one host sync: the group count G (and, by default, the rule's inputs).
        if group_size is None:
            rule = GroupCounts(counts, K)
            host = coords.read(rule.values)
            if host is None:
                return cls._pack(coords.canonical(), index_dtype=index_dtype, cover=cover)
            g, G = rule.choose(host)
            fan_in = rule.fan_in(host, g)
            per_row = rule.per_row(g)
        else:
            g = group_size
            per_row = cdiv(counts, g)
            host = coords.read(per_row.sum(), F.pad(per_row, (0, 1)).max())
            if host is None:
                return cls._pack(coords.canonical(), group_size=g, index_dtype=index_dtype, cover=cover)
            G, fan_in = host
        params = {"group_size": g, "fan_in": fan_in}
        layout = covering_layout(per_row, G, g, fan_in) if cover else None
        if layout is not None:
            G = layout.padded
            group_row, idx, valid = covering_slots(coords.row_ptr, layout, g, G)
            params["covering_block"] = COVER_BLOCK
        else:
            group_row, idx, valid, _ = pack_row_groups(coords.row_ptr, per_row, g, G)
        tensors = {
            "AM": group_row.to(itype),
            "AK": coords.cols[idx].to(itype),
            "AV": torch.where(valid, coords.vals[idx], 0),
        }
        return cls._packed(coords, tensors, itype, params)

    @classmethod
    def _tuned(cls, coords: Coords, index_dtype, tune_cols: int, backend: str, cover: bool) -> GroupCOO:
        coords = coords.checked()
        counts = coords.row_counts()
        g0 = default_group_size(counts)
        cap = next_power_of_2(int(counts.max())) if coords.nnz else 1
        candidates = sorted({max(1, g0 // 2), g0, min(cap, 2 * g0)})
        B = tuning_operand(coords, tune_cols)

        def build(g: int) -> GroupCOO:
            return cls._pack(coords, group_size=g, index_dtype=index_dtype, cover=cover)

        best, times = tune(candidates, build, B, backend)
        best.params["tuned_seconds"] = times
        return best

    @property
    def group_size(self) -> int:
        return int(self.AK.shape[1])

    @property
    def groups(self) -> int:
        return int(self.AK.shape[0])

    @property
    def covering_block(self) -> int | None:
        """COVER_BLOCK where the packer laid the groups out to cover C (`grouping.CoveringLayout`):
        every row, empty ones included, holds groups inside one aligned block of that many
        groups, so a segment tile of a multiple of it stores whole rows into an uninitialised
        C. Not where a row has more groups than that (a hub row), or where the layout would pad
        more than M slots (`grouping.covering_layout`); not with cover=False."""
        return self.params.get("covering_block")

    def _slot_rows(self) -> tuple[torch.Tensor, bool]:
        return self.AM.unsqueeze(1).expand_as(self.AK), False

    def _describe(self) -> dict[str, Any]:
        shown = {"group_size": self.group_size, "groups": self.groups}
        if "tuned_seconds" in self.params:
            shown["tuned"] = {
                g: f"{t * 1e6:.0f}us" for g, t in self.params["tuned_seconds"].items()
            }
        return shown
