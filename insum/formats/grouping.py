"""Grouping entries into fixed-size groups: the paper's group-size rule, the group counts
packers read in their one sync, the half-precision accumulation rule that a group count
(fan-in) decides, and slot grouping by row (packing) or by column (the transposed pattern
that SparseLinear's input gradient runs on).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..arith import next_power_of_2
from ..dtypes import HALF_DTYPES, compute_dtype

__all__ = [
    "COVER_BLOCK",
    "HALF_FAN_IN",
    "GroupCounts",
    "CoveringLayout",
    "accumulation_dtype",
    "covering_layout",
    "covering_slots",
    "default_group_size",
    "grouped_slots",
    "pack_row_groups",
    "round_pow2",
]


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
    return _group_size_rule(nnz, nonempty, next_power_of_2(int(longest)))


class GroupCounts:
    """Groups per row for every power-of-two group size the paper's rule can pick.

    Computed on the device before the packer's one sync (`values`), so that the rule and
    the padded size G, which the host must know to allocate, cost no sync of their own.
    """

    def __init__(self, counts: torch.Tensor, width: int):
        # Exponents 0 .. bit_length(width): the last exceeds any row (at most `width`
        # entries), so it counts the non-empty rows, and the rule's g <= next_power_of_2(width).
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
    if dtype in HALF_DTYPES and fan_in is not None and fan_in <= HALF_FAN_IN:
        return dtype
    return compute_dtype(dtype)


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


#: A covering layout keeps each row's groups inside one aligned block of this many groups.
#: A segment-reduced kernel tiles the groups by powers of two of at least 16
#: (`codegen.tune.SEGMENT_TILE`, or the whole extent): each tile then holds whole blocks, so
#: whole rows.
COVER_BLOCK = 16


class CoveringLayout:
    """Where each row's groups go when every row, empty ones too, keeps its groups inside one
    aligned block of COVER_BLOCK groups: rows in order, each at the next position from which
    it fits in the current block (next fit); the groups skipped at a block's end are padding
    of the row before them (value 0). An empty row holds one all-padding group, so that the
    kernel stores its zeros and the output needs no zero fill.

    Next fit is sequential, but a row, seen from the residue r of its start in a block,
    moves the next row's start by delta(r) to a new residue: a map on the block's residues,
    and the rows' starts are a scan (Hillis-Steele) over those maps, on the device without a
    sync. Only for rows of at most COVER_BLOCK groups (the caller checks their fan-in).

    per_row: groups per row (M,). `start` (M,) is each row's first group, `total` (a 0-d
    tensor) the padded group count, read by the caller's sync.
    """

    def __init__(self, per_row: torch.Tensor):
        B = COVER_BLOCK
        groups = per_row.clamp(min=1).unsqueeze(1)  # an empty row: one padding group
        r = torch.arange(B, device=per_row.device)
        # From residue r a row of c groups moves c, or first to the next block when it would cross.
        delta = torch.where(r + groups <= B, groups, B - r + groups)
        after = (r + delta) % B
        step, M = 1, per_row.numel()
        while step < M:  # row i's map becomes rows i-2*step+1 .. i's: the earlier ones first
            before, residue = delta[:-step], after[:-step]
            delta = torch.cat([delta[:step], before + delta[step:].gather(1, residue)])
            after = torch.cat([after[:step], after[step:].gather(1, residue)])
            step *= 2
        end = delta[:, 0]  # after each row, from group 0
        self.start = end - groups.view(-1)  # (where a row skipped to the next block)
        self.total = end[-1] if M else end.new_zeros(())
        self.padded = 0  # the total, once read

    def groups(self, G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row [G], rank [G]) of every group of the padded layout of G (`total`) groups: its
        output row and its rank among that row's groups (from the row's own count on: padding)."""
        at = torch.arange(G, device=self.start.device)
        row = torch.searchsorted(self.start, at, right=True) - 1
        return row, at - self.start[row]


def covering_slots(
    crow: torch.Tensor, layout: CoveringLayout, g: int, G: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(group_row [G], idx [G, g], valid [G, g]) of the covering layout of G groups of g slots.

    A slot past its row's end pads with its group's first entry, a padding group's slots with
    its row's first entry, an empty row's with entry 0 (a column of the matrix): each reads a
    row of B that the kernel reads anyway.
    """
    row, rank = layout.groups(G)
    start, end = crow[:-1][row], crow[1:][row]
    first = start + rank * g
    pad = torch.where(first < end, first, torch.where(start < end, start, 0))
    slots = first.unsqueeze(1) + torch.arange(g, device=crow.device)
    idx, valid = grouped_slots(slots, end, pad)
    return row, idx, valid


def covering_layout(per_row: torch.Tensor, G: int, g: int, fan_in: int) -> CoveringLayout | None:
    """The covering layout of rows of per_row groups of g slots (G in all, at most fan_in in
    a row), where it applies: some groups, no row over COVER_BLOCK groups, and at most M
    padding slots added (empty rows' groups and those skipped at block ends). Reads the
    padded count in one host sync (only where the fan-in allows the layout).

    The bound is the byte balance of what the layout replaces: the zero fill writes M rows
    of C; a padding slot re-reads a row of B that its row reads anyway (its own first
    column, so mostly from cache) and adds zero. At most M of them cost no more than the
    fill's writes and save its launch, which is what a small, launch-bound product pays for.
    """
    if G == 0 or fan_in > COVER_BLOCK:
        return None
    layout = CoveringLayout(per_row)
    layout.padded = int(layout.total)
    if (layout.padded - G) * g > per_row.numel():
        return None
    return layout
