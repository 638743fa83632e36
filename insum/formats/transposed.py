"""The transposed pattern: a format's stored slots grouped by column, on which B's gradient
(SparseLinear's input gradient) runs as an SpMM shaped like the forward.

The derived gradient of B, dB[AK[p,q], n] += AV[p,q] * dC[AM[p], n], scatters every stored
slot into dB: one atomic per slot and column, g times the forward's (g slots share one
scatter there). A layer knows its pattern in advance, so it keeps the transpose (slots
grouped by column, padded with a zero slot) and runs B's gradient as the transpose's own
grouped SpMM. Measured faster than the scatter on the H200 (`benchmarks/torch_checks.py`).
"""

from __future__ import annotations

import torch

from ..arith import cdiv
from ..bind import PerTensor, kept_per_version
from ..cache import BoundedCache
from ..dtypes import compute_dtype, promoted
from .grouping import default_group_size
from .repeat import run_repeated

__all__ = [
    "BLOCK",
    "BLOCK_ROW",
    "SCALAR",
    "SCALAR_ROW",
    "block_gradient",
    "scalar_gradient",
    "transpose_slots",
    "with_zero_slot",
]

#: Groups of slots per column (TM: the column of each group).
SCALAR = "DX[TM[p], n] += WT[TS[p, q]] * DY[TR[p, q], n]"
#: One group per column (ELL, Block-ELL): every output row has one owner, no atomics, and the
#: statement overwrites a given torch.empty (under torch.compile: the in-place operator, the
#: cheaper call to the dispatcher, `insum.library`).
SCALAR_ROW = "DX[c, n] = WT[TS[c, q]] * DY[TR[c, q], n]"
BLOCK = "DX[TM[p], k, n] += WT[TS[p, q], m, k] * DY[TR[p, q], m, n]"
BLOCK_ROW = "DX[c, k, n] = WT[TS[c, q], m, k] * DY[TR[c, q], m, n]"


def transpose_slots(
    rows: torch.Tensor,
    cols: torch.Tensor,
    n_cols: int,
    itype: torch.dtype,
    by_column: bool = False,
    stored: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Slots (row, col) grouped by column: TM[G] column, TS[G, g] slot, TR[G, g] row.

    The group size is the paper's rule applied to columns. by_column: one group per column
    (G = n_cols, g = the longest column, no TM), its entries first, and TL[G] their counts
    (the product's declared lengths, kept with the pattern so that no call recounts them).
    Padded entries point at slot S (one past the last: the zero slot of `with_zero_slot`) and
    row 0. stored: a bool mask shaped like rows, False at a format's declared padding, which
    is left out.
    """
    rows, cols = rows.reshape(-1).long(), cols.reshape(-1).long()
    S = rows.numel()
    device = rows.device
    slots = None
    if stored is not None:
        slots = stored.reshape(-1).nonzero().squeeze(1)
        rows, cols = rows[slots], cols[slots]
    order = torch.argsort(cols * (int(rows.max()) + 1 if rows.numel() else 1) + rows, stable=True)
    sorted_cols = cols[order]
    counts = torch.bincount(sorted_cols, minlength=n_cols)
    if by_column:
        g = max(int(counts.max()) if rows.numel() else 1, 1)
    else:
        g = default_group_size(counts) if rows.numel() else 1
    groups_per_col = cdiv(counts, g) if not by_column else torch.ones_like(counts)
    group_start = torch.cumsum(groups_per_col, 0) - groups_per_col
    col_start = torch.cumsum(counts, 0) - counts
    within = torch.arange(rows.numel(), device=device) - col_start[sorted_cols]
    group = group_start[sorted_cols] + within // g
    slot = within % g
    G = int(groups_per_col.sum())
    TM = torch.repeat_interleave(torch.arange(n_cols, device=device), groups_per_col)
    TS = torch.full((G, g), S, dtype=torch.int64, device=device)
    TS[group, slot] = order if slots is None else slots[order]
    TR = torch.zeros((G, g), dtype=torch.int64, device=device)
    TR[group, slot] = rows[order]
    if by_column:
        return {"TS": TS.to(itype), "TR": TR.to(itype), "TL": counts.to(itype)}
    return {"TM": TM.to(itype), "TS": TS.to(itype), "TR": TR.to(itype)}


#: One zero slot per (slot shape, dtype, device), made once: appending it is then one copy
#: (`torch.cat`) instead of a fill and a copy, a launch less on every backward.
_ZERO_SLOTS: BoundedCache = BoundedCache(64)


def with_zero_slot(values: torch.Tensor) -> torch.Tensor:
    """values (slots, ...) with one zero slot appended: where padded entries point."""
    shape = values.shape[1:]
    if torch.compiler.is_compiling() or (values.is_cuda and torch.cuda.is_current_stream_capturing()):
        # (traced: no global tensor; captured: a tensor made now would live in the graph's
        # memory pool, filled only when the graph replays)
        return torch.cat([values, values.new_zeros(1, *shape)])
    key = (shape, values.dtype, values.device)
    zero = _ZERO_SLOTS.get(key)
    if zero is None:
        zero = _ZERO_SLOTS[key] = values.new_zeros(1, *shape)
    return torch.cat([values, zero])


#: Column lengths per pattern tensor TS (the tensor object itself, while it lives), for a
#: pattern kept without its counts TL (a layer saved before they were kept).
_LENGTHS: PerTensor = PerTensor()


def _column_lengths(pattern: dict[str, torch.Tensor], zero_slot: int) -> dict:
    """One group per column holds its entries first, then padding at the zero slot: its
    entry counts (TL) are `insum()`'s declared lengths, so that the product skips the
    padding. TL is a tensor the pattern keeps, so the program order insum derives from it
    (`insum.execute.longest_first`) is computed once per layer, also under torch.compile;
    without TL, the counts are kept per TS object and version (traced code counts each
    call)."""
    TS = pattern["TS"]
    if TS.shape[1] <= 1:
        return {}
    lengths = pattern.get("TL")
    if lengths is None:
        lengths = kept_per_version(_LENGTHS, TS, zero_slot, lambda: (TS != zero_slot).sum(1))
    return {"lengths": {"q[c]": lengths}}


def _slots(pattern: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The pattern's tensors that the gradient statement reads (TL is its declared lengths)."""
    return {name: t for name, t in pattern.items() if name != "TL"}


#: What changes from one gradient call to the next: the output, the values with their zero
#: slot (copied anew: the values change in place between steps) and dC.
_VARYING = frozenset({"DX", "WT", "DY"})


def scalar_gradient(
    AV: torch.Tensor, pattern: dict[str, torch.Tensor], DY: torch.Tensor, K: int, backend: str, precision: str,
    owner: object | None = None,
) -> torch.Tensor:
    """dB (K, N) from scalar slots AV (any shape, one value per slot) and dC (M, N). owner:
    the format object that keeps the call pinned from one backward to the next (`run_repeated`)."""
    WT = with_zero_slot(AV.reshape(-1))
    if "TM" not in pattern:  # one owner per output row: no atomics
        facts = _column_lengths(pattern, WT.shape[0] - 1)
        DX = DY.new_empty(pattern["TS"].shape[0], DY.shape[1], dtype=promoted(WT.dtype, DY.dtype))
        statement = SCALAR_ROW
    else:
        facts = {}
        DX = torch.zeros(K, DY.shape[1], dtype=compute_dtype(DY.dtype), device=DY.device)
        statement = SCALAR
    run_repeated(owner, statement, {"DX": DX, "WT": WT, "DY": DY, **_slots(pattern)}, facts, _VARYING,
                 backend=backend, precision=precision)
    return DX


def block_gradient(
    AV: torch.Tensor, pattern: dict[str, torch.Tensor], DY: torch.Tensor, KB: int, backend: str, precision: str,
    owner: object | None = None,
) -> torch.Tensor:
    """dB viewed (KB, bk, N) from blocks AV (..., bm, bk) and dC viewed (M'/bm, bm, N); owner:
    as for `scalar_gradient`."""
    bm, bk = AV.shape[-2:]
    WT = with_zero_slot(AV.reshape(-1, bm, bk))
    if "TM" not in pattern:
        facts = _column_lengths(pattern, WT.shape[0] - 1)
        DX = DY.new_empty(pattern["TS"].shape[0], bk, DY.shape[2], dtype=promoted(WT.dtype, DY.dtype))
        statement = BLOCK_ROW
    else:
        facts = {}
        DX = torch.zeros(KB, bk, DY.shape[2], dtype=compute_dtype(DY.dtype), device=DY.device)
        statement = BLOCK
    run_repeated(owner, statement, {"DX": DX, "WT": WT, "DY": DY, **_slots(pattern)}, facts, _VARYING,
                 backend=backend, precision=precision)
    return DX
