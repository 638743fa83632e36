"""CELL, the Composable Ellpack format of LiteForm (Peng et al., HPDC'25, §4 and §5.3).

Columns are split evenly into `partitions`. Inside a partition each row's run of
nonzeros goes to the bucket of width 2^i with 2^(i-1) < length <= 2^i, padded to that
width (Ellpack per bucket). Rows longer than the partition's maximum width are *folded*
into several bucket rows of that width that share one row index. The maximum width of
each partition is chosen by LiteForm's cost model (eq. 7), minimised over the powers of
two (exhaustively by default; the paper's binary search, Algorithm 3, on request).

Each bucket is the GroupCOO-like statement `C[RI[r],n] += V[r,w]*B[CI[r,w],n]`. Buckets
of equal width from different partitions are concatenated into one statement, since
their rows use the same global row and column indices: an SpMM costs one launch per
distinct width, not one per (partition, bucket). The generated kernel chooses atomic
updates itself because RI is an indirect output index (LiteForm needs atomics for folded
rows and for several partitions, which is when one row appears in several programs).

The product needs no zero fill where the packer can lay the buckets out to cover C
(`covering_block`, one partition): every row, empty ones too, gets a bucket row, and the
widest bucket keeps each folded row inside one aligned block of 16 bucket rows, so that
every row is summed and stored by one program and the repeated product's one launch stores
into an uninitialised output (`insum_many`'s covering claim). The layout is the default
where it pads at most M slots; `cover=False` keeps the plain one.

Not reproduced from the paper: the random-forest models that decide whether to use
CELL and how many partitions to use (pass `partitions`), and the mapping of 2^k-nonzero
blocks to thread blocks (the kernel's tiling decides that).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..arith import cdiv
from ..errors import InsumError
from .base import SparseFormat
from .coords import Coords, check_positive_int, coords_of, index_dtype_for

__all__ = ["CELL", "cell_cost"]


class _Segments:
    """Each (partition, row)'s run of nonzeros as a dense (P, M) grid of cells, and the
    cost model over every maximum width, all sync-free.

    The grid replaces a sort and `unique` over the nonzeros: a cell's run starts at
    `start[p, r]` in the row-major coordinates (columns are sorted within a row). The cost
    tables hold, per width exponent e (rows) and partition (columns), LiteForm's terms,
    so that choosing every partition's width is one argmin, not a loop of evaluations.
    """

    def __init__(self, coords: Coords, partitions: int):
        M, K = coords.shape
        P = self.partitions = partitions
        pw = self.part_width = max(cdiv(K, P), 1)
        device = coords.device
        if P == 1:
            crow = coords.row_ptr
            self.start, self.end = crow[:-1].view(1, M), crow[1:].view(1, M)
            count = coords.counts.view(1, M)
        else:
            stride = P * pw  # row r, partition p starts at key r*stride + p*pw
            key = torch.add(coords.cols, coords.rows, alpha=stride)
            bounds = torch.arange(0, (P + 1) * pw, pw, device=device).unsqueeze(1)
            pos = torch.searchsorted(
                key, bounds + torch.arange(0, M * stride, stride, device=device)
            )
            self.start, self.end = pos[:-1], pos[1:]
            count = pos.diff(dim=0)
        # A cell holds at most pw <= 2^(E-2) entries: width exponents 0 .. E-1, the last
        # above any cell. An unverified CSR input (unsorted or duplicated, its result then
        # discarded) may exceed that, but the exponents stay below E, so indices stay valid.
        E = self.E = (pw - 1).bit_length() + 2
        self.caps = torch.arange(E, device=device)
        # Natural bucket exponent ceil(log2(count)) (0 for empty cells), exactly.
        self.natural = torch.bucketize(count, 1 << self.caps[:-1])
        self.neg_count = -count

        # Distinct columns per bucket under any cap, from an occupancy map of (natural
        # exponent, column) pairs and each column's widest exponent.
        if P == 1:
            exp_nz = self.natural[0][coords.rows]
        else:
            part = torch.div(coords.cols, pw, rounding_mode="floor")
            exp_nz = self.natural.view(-1)[torch.add(coords.rows, part, alpha=M)]
        Kp = P * pw
        pairs = torch.zeros(E * Kp, dtype=torch.bool, device=device)
        pairs.index_fill_(0, torch.add(coords.cols, exp_nz, alpha=Kp), True)
        col_top = torch.full((Kp,), -1, dtype=exp_nz.dtype, device=device)
        col_top.scatter_reduce_(0, coords.cols, exp_nz, reduce="amax")
        pair_hist = pairs.view(E, P, pw).sum(2)
        top_hist = (col_top.view(1, P, pw) == self.caps.view(E, 1, 1)).sum(2)
        # Below the cap every natural bucket keeps its columns; at or above they merge.
        below = pair_hist - top_hist
        distinct = torch.cumsum(below, 0) - below + top_hist.sum(0)

        # Folded rows and their slots under each cap: ceil(count / 2^e) = -((-count) >> e).
        width_exp = torch.minimum(self.natural.unsqueeze(0), self.caps.view(E, 1, 1))
        self.neg_folds = self.neg_count.unsqueeze(0) >> width_exp  # (E, P, M)
        # cost = 2 * slots + J * (folds + distinct), kept as its two parts.
        self._per_j = distinct - self.neg_folds.sum(2)
        self._neg_slots = (self.neg_folds << width_exp).sum(2)

    def table(self, dense_cols: int, scale: int = 1) -> torch.Tensor:
        """LiteForm eq. (7) for every cap exponent (rows) and partition (columns), int64,
        times `scale`.

        cost(bucket) = 2 I1 W + |set(CI)| J + I1 J, with I1 the bucket's (folded) rows, W
        its width, |set(CI)| its distinct columns and J the dense operand's columns. Above
        a partition's widest natural bucket the cost stays at its value there.
        """
        return torch.sub(self._per_j * (dense_cols * scale), self._neg_slots, alpha=2 * scale)

    def cost(self, cap_exp: torch.Tensor, dense_cols: int) -> torch.Tensor:
        """The cost of each partition when partition p folds rows longer than 2^cap_exp[p]."""
        caps = cap_exp.to(self.caps.device).clamp(max=self.E - 1).view(1, -1)
        return self.table(dense_cols).gather(0, caps).view(-1).double()

    def natural_exp(self) -> torch.Tensor:
        """Per partition, the exponent of the widest bucket before any folding (0 without rows)."""
        if self.natural.shape[1] == 0:
            return self.natural.new_zeros(self.natural.shape[0])
        return self.natural.amax(1)


def _search_widths(seg: _Segments, dense_cols: int) -> torch.Tensor:
    """LiteForm Algorithm 3, run for all partitions at once over width exponents.

    lo and hi bound the best exponent; at mid the cost of width 2^mid is compared with
    2^(mid+1): if the wider one is cheaper the optimum lies right of mid, else at or left.
    It assumes the cost is unimodal in the width, which the distinct-column term breaks
    (folding a long row pays off only once it merges into a bucket sharing its columns).
    A fixed number of steps (enough for E exponents) keeps it free of host syncs.
    """
    table = seg.table(dense_cols)
    hi = seg.natural_exp().clamp(max=seg.E - 2)  # (only an unverified input reaches E - 1)
    lo = torch.zeros_like(hi)
    for _ in range(seg.E.bit_length()):
        mid = (lo + hi) // 2
        wider_is_cheaper = table.gather(0, mid.view(1, -1)) > table.gather(0, mid.view(1, -1) + 1)
        wider_is_cheaper = wider_is_cheaper.view(-1)
        active = lo < hi
        lo = torch.where(active & wider_is_cheaper, mid + 1, lo)
        hi = torch.where(active & ~wider_is_cheaper, mid, hi)
    return lo


def _scan_widths(seg: _Segments, dense_cols: int) -> torch.Tensor:
    """The cost model's true minimum: every power of two up to the partition's widest row.

    One argmin over the (exponent, partition) table, without the binary search's
    unimodality assumption. Ties go to the wider width (fewer folds).
    """
    # Integer costs: cost * E - e orders by cost, then by the wider width. Caps above the
    # widest natural bucket cost the same as it, and name it.
    key = seg.table(dense_cols, scale=seg.E) - seg.caps.view(-1, 1)
    return torch.minimum(key.argmin(0), seg.natural_exp())


_SEARCHES = {"scan": _scan_widths, "binary": _search_widths}

#: The covering layout keeps each row's bucket rows inside one aligned block of this many
#: bucket rows, so that a kernel tiling the bucket by a multiple of it (or by the whole
#: bucket) owns every row in one program.
ROW_BLOCK = 16


def _next_fit(per_fold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the widest bucket's rows go in the covering layout, per fold count, on the device.

    Rows are placed most folds first (then by row), each at the next position from which its
    f bucket rows stay inside one aligned block of ROW_BLOCK (next fit): the bucket rows
    skipped at a block's end are padding. Within the run of rows of one f this is a formula
    (`_covering_rows`); where each run starts follows from the runs before it. A run, seen
    from the residue r of its start in a block, advances by delta(r) to a new residue: a map
    on ROW_BLOCK residues, and the runs' starts are a scan (Hillis-Steele) over those maps,
    ROW_BLOCK of them, so it runs without reading anything on the host.

    per_fold: (ROW_BLOCK + 1,) the widest bucket's rows per fold count f (index f).
    Returns a (4, ROW_BLOCK) table, column f - 1 for f folds: the run's first row among the
    bucket's (rank), its first bucket row (start), how many of its rows fit before the next
    block boundary (fit) and that boundary (block); the bucket's rows, and its padding rows.
    """
    B = ROW_BLOCK
    device = per_fold.device
    f = torch.arange(B, 0, -1, device=device)  # the runs, most folds first
    n = per_fold.flip(0)[:B]
    r = torch.arange(B, device=device)
    fc, nc = f.view(-1, 1), n.view(-1, 1)
    late = nc - torch.div(B - r, fc, rounding_mode="floor") - 1  # the last row's index past the first block
    per_block = torch.div(B, fc, rounding_mode="floor")
    delta = torch.where(
        late < 0,
        nc * fc,
        (B - r) + torch.div(late, per_block, rounding_mode="floor") * B + late % per_block * fc + fc,
    )
    after = (r + delta) % B
    step = 1
    while step < B:  # run g's map becomes runs g-2*step+1 .. g's: the earlier ones first
        before, residue = delta[:-step], after[:-step]
        delta = torch.cat([delta[:step], before + delta[step:].gather(1, residue)])
        after = torch.cat([after[:step], after[step:].gather(1, residue)])
        step *= 2
    end = delta[:, 0]  # after each run, starting from bucket row 0
    start = torch.cat([end.new_zeros(1), end[:-1]])
    offset = start % B
    table = torch.stack([torch.cumsum(n, 0) - n, start, torch.div(B - offset, f, rounding_mode="floor"), start - offset + B])
    return table.flip(1), end[-1], end[-1] - (n * f).sum()


def _covering_rows(
    width_exp: torch.Tensor, folds: torch.Tensor, narrow: int, runs: torch.Tensor, R: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, fold) of every bucket row in the covering layout (one partition).

    Every row gets a bucket row: an empty row one of width 1 whose slots are padding, so the
    buckets' stores write it (zeros) and C needs no zero fill. The `narrow` rows of the
    narrower buckets hold a bucket row each, in row order. In the widest bucket rows are
    placed by next fit (`_next_fit`, whose `runs` table this reads), so that no row crosses
    an aligned block of ROW_BLOCK bucket rows; a padding bucket row repeats the row before
    it with a fold past that row's end (value 0). Within a width, equal rows stay adjacent
    (the sorted claim).
    """
    device = folds.device
    B = ROW_BLOCK
    f = folds.clamp(min=1)  # (an empty row: one bucket row)
    # Width first; in the widest bucket the most folds first; then by row.
    order = torch.sort(width_exp * (B + 1) + (B - f), stable=True).indices
    f = f[order]
    rank, start, fit, block = runs[:, f - 1]
    i = torch.arange(order.numel(), device=device)
    late = i - narrow - rank - fit  # (widest rows) the row's rank in its run, less those that fit first
    per_block = torch.div(B, f, rounding_mode="floor")
    aligned = torch.where(
        late < 0, start + (late + fit) * f, block + torch.div(late, per_block, rounding_mode="floor") * B + late % per_block * f
    )
    position = torch.where(i < narrow, i, narrow + aligned)
    starts = torch.full((R,), -1, dtype=torch.int64, device=device)
    starts[position] = i
    # Each bucket row belongs to the last row that starts at or before it.
    at = torch.arange(R, device=device)
    first = torch.cummax(torch.where(starts >= 0, at, 0), 0).values
    return order[starts[first]], at - first


def cell_cost(
    A: torch.Tensor, *, partitions: int = 1, max_width: int, dense_cols: int = 128
) -> list[float]:
    """LiteForm's modelled cost per partition of packing A with a given maximum width.

    Exposed for notebooks and benchmarks that plot the cost against the width.
    """
    check_positive_int("max_width", max_width)
    if max_width & (max_width - 1):
        raise InsumError(f"max_width must be a power of two, got {max_width}")
    seg = _Segments(coords_of(A).checked(), partitions)
    cap = torch.full((partitions,), max_width.bit_length() - 1, dtype=torch.int64)
    return seg.cost(cap, dense_cols).tolist()


class CELL(SparseFormat):
    """Composable Ellpack: per bucket width W, RI_W[r] rows, CI_W[r, W] columns, V_W[r, W].

    partitions: number of equal column partitions (LiteForm predicts it with a trained
    model; here it is a parameter, default 1).
    max_width: the widest bucket (a power of two), same for every partition; rows longer
    than it are folded. None (default) chooses it per partition with the cost model.
    dense_cols: J, the dense operand's column count that the cost model assumes.
    search: how the cost model picks the maximum width: "scan" (default) evaluates every
    power of two and takes the minimum; "binary" is the paper's Algorithm 3, which can
    stop at a local minimum.
    cover: lay the buckets out to cover C where that costs at most M padded slots (see
    `covering_block`), so that the repeated product needs no zero fill; False keeps the
    plain layout (every product zero-fills C).

    `tensors` holds RI_W / CI_W / V_W for every width W in `widths`; `buckets` lists
    (partition, width, bucket rows). `expression` is the statement each width runs.

    >>> A = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 6.0, 0.0, 0.0]])
    >>> F = CELL.from_dense(A, max_width=2)
    >>> F.widths, F.RI_2.tolist(), F.RI_1.tolist()
    ([1, 2], [0, 0, 0], [1])
    """

    name = "cell"
    expression = "C[RI[r],n] += V[r,w]*B[CI[r,w],n]"
    #: Buckets add into shared rows: accumulated from zeros, half precision in float32 (no
    #: fan-in is recorded), so that the output is rounded once rather than once per bucket.
    accumulates = True

    @classmethod
    def _pack(
        cls,
        coords: Coords,
        *,
        partitions: int = 1,
        max_width: int | None = None,
        dense_cols: int = 128,
        search: str = "scan",
        cover: bool = True,
        index_dtype: torch.dtype | None = None,
    ) -> CELL:
        coords = coords.within_shape()  # (its device work indexes by them before its sync)
        M, K = coords.shape
        check_positive_int("partitions", partitions)
        if partitions > max(K, 1):
            raise InsumError(f"partitions={partitions} exceeds the {K} columns of the matrix")
        check_positive_int("dense_cols", dense_cols)
        itype = index_dtype_for(M, K, requested=index_dtype)
        device = coords.device
        if search not in _SEARCHES:
            raise InsumError(f"unknown search {search!r}; choose one of {', '.join(_SEARCHES)}")
        seg = _Segments(coords, partitions)
        if max_width is None:
            cap_exp = _SEARCHES[search](seg, dense_cols)
        else:
            check_positive_int("max_width", max_width)
            if max_width & (max_width - 1):
                raise InsumError(f"max_width must be a power of two, got {max_width}")
            cap_exp = torch.full(
                (partitions,), max_width.bit_length() - 1, dtype=torch.int64, device=device
            )

        # Cell (p, r) becomes folds[p, r] bucket rows of width 2^width_exp[p, r].
        E = seg.E
        width_exp = torch.minimum(seg.natural, cap_exp.view(-1, 1))
        folds = -(seg.neg_count >> width_exp)
        # Bucket rows per (width, partition), negated: seg.neg_folds[e] holds -folds for
        # every cell whose width is 2^e.
        chosen = width_exp.unsqueeze(1) == seg.caps.view(1, -1, 1)
        neg_rows = (chosen * seg.neg_folds.transpose(0, 1)).sum(2)  # (P, E)
        # What the covering layout (`_covering_rows`) needs: the most folds of a row, rows
        # per width (empty rows included), and folded rows per fold count.
        layout = ()
        if partitions == 1 and cover:
            widest = torch.where(width_exp[0] == cap_exp, folds[0].clamp(1, ROW_BLOCK), 0)
            per_fold = torch.zeros(ROW_BLOCK + 1, dtype=torch.int64, device=device)
            per_fold.scatter_add_(0, widest, torch.ones_like(widest))
            runs, widest_rows, padding = _next_fit(per_fold)
            per_width = (width_exp == seg.caps.view(-1, 1)).sum(1)
            empty = (seg.neg_count == 0).sum()
            layout = (F.pad(folds[0], (0, 1)).max(), empty, widest_rows, padding, per_width)
        host = coords.read(cap_exp, neg_rows, *layout)  # the one sync
        if host is None:
            return cls._pack(
                coords.canonical(),
                partitions=partitions,
                max_width=max_width,
                dense_cols=dense_cols,
                search=search,
                cover=cover,
                index_dtype=index_dtype,
            )
        caps, per_bucket = host[:partitions], [-n for n in host[partitions : partitions + partitions * E]]
        host = host[partitions + partitions * E :]
        # Cover C (every row in exactly one bucket, each within one aligned block of its
        # bucket) with one partition, some nonzeros, no row folded more than ROW_BLOCK times,
        # and at most M padding slots added (empty rows', bucket rows skipped at block ends):
        # a padding slot reads a row of B that its row reads anyway, where the zero fill it
        # replaces writes M rows of C.
        covering = bool(layout) and coords.nnz > 0 and host[0] <= ROW_BLOCK
        if covering:
            empty, widest_rows, padding, per_width = host[1], host[2], host[3], host[4:]
            covering = empty + (padding << caps[0]) <= M
        if covering:
            narrow = sum(per_width[: caps[0]])
            per_bucket = [*per_width[: caps[0]], widest_rows, *per_width[caps[0] + 1 :]]
        buckets = [
            (p, 1 << e, per_bucket[p * E + e])
            for p in range(partitions)
            for e in range(E)
            if per_bucket[p * E + e]
        ]
        rows_of = [sum(per_bucket[p * E + e] for p in range(partitions)) for e in range(E)]
        params = {
            "partitions": partitions,
            "max_widths": [1 << e for e in caps],
            "dense_cols": dense_cols,
            "buckets": buckets,
        }
        if covering:
            params["covering_block"] = ROW_BLOCK
        R = sum(rows_of)
        if R == 0:
            return cls._packed(coords, {}, itype, params)
        S = sum(n << e for e, n in enumerate(rows_of))

        # Bucket rows ordered by width, then partition, row and fold: each width's
        # statement is one contiguous slice. All by gathers from the cell grid.
        if covering:
            cell, fold = _covering_rows(width_exp[0], folds[0], narrow, runs, R)
        else:
            order = torch.sort(width_exp.view(-1), stable=True).indices
            cell_folds = folds.view(-1)[order]
            which = torch.repeat_interleave(cell_folds, output_size=R)
            fold = torch.arange(R, device=device) - (torch.cumsum(cell_folds, 0) - cell_folds)[which]
            cell = order[which]
        row_exp = width_exp.view(-1)[cell]
        row_width = 1 << row_exp
        start = seg.start.reshape(-1)[cell]
        first = start + (fold << row_exp)
        end = seg.end.reshape(-1)[cell]
        # A slot past its row's end pads with the first column of its fold (a position the
        # row stores), a covering layout's padding bucket row with its row's first column, and
        # every empty row with the first entry's column (one row of B for all of them). A
        # SparseLinear freezes every such slot (`insum.nn.sparse_autograd.frozen_slots`).
        pad = torch.where(first < end, first, torch.where(start < end, start, 0)) if covering else first
        RI = (cell if partitions == 1 else cell % M).to(itype)
        # Slots: row_width[j] consecutive slots per bucket row, all widths in one array.
        slot_row = torch.repeat_interleave(row_width, output_size=S)
        slot_start = torch.cumsum(row_width, 0) - row_width
        idx = first[slot_row] + (torch.arange(S, device=device) - slot_start[slot_row])
        valid = idx < end[slot_row]
        idx = torch.where(valid, idx, pad[slot_row])
        CI = coords.cols[idx].to(itype)
        V = torch.where(valid, coords.vals[idx], 0)

        tensors: dict[str, torch.Tensor] = {}
        row, slot = 0, 0
        for e, n in enumerate(rows_of):
            if n:
                w = 1 << e
                tensors[f"RI_{w}"] = RI[row : row + n]
                tensors[f"CI_{w}"] = CI[slot : slot + n * w].view(n, w)
                tensors[f"V_{w}"] = V[slot : slot + n * w].view(n, w)
                row, slot = row + n, slot + n * w
        return cls._packed(coords, tensors, itype, params)

    def _is_value(self, name: str) -> bool:
        return name.startswith("V_")

    @property
    def sorted_indices(self) -> frozenset[str]:
        """RI is sorted within each width when there is one partition (equal rows adjacent: rows
        in order, or in the covering layout's widest bucket by fold count, folds adjacent);
        partitions interleave rows, so then it is not."""
        return frozenset({"RI"}) if self.params["partitions"] == 1 else frozenset()

    @property
    def disjoint_statements(self) -> bool:
        """With one partition each row's run goes to one bucket (folds stay in the widest), so
        the widths' statements write disjoint rows of C; partitions repeat rows."""
        return self.params["partitions"] == 1

    @property
    def covering_block(self) -> int | None:
        """ROW_BLOCK where the packer laid the buckets out to cover C (`_covering_rows`): every
        row, empty ones included, in one bucket, and a folded row inside one aligned block of
        ROW_BLOCK bucket rows of the widest. Not with partitions (they repeat rows), rows
        folded more than ROW_BLOCK times, or where it would pad more than M slots."""
        return self.params.get("covering_block")

    def unique_in(self, tensors: Mapping[str, torch.Tensor]) -> frozenset[str]:
        """RI of a width below the widest holds each row once: with one partition a row
        narrower than the cap is one bucket row of its own width (no folds). The widest
        bucket folds long rows into several bucket rows, and partitions repeat rows."""
        partitions, caps = self.params["partitions"], self.params.get("max_widths", [])
        if partitions != 1 or "RI" not in tensors or not caps:
            return frozenset()
        return frozenset({"RI"}) if tensors["V"].shape[1] < caps[0] else frozenset()

    @property
    def widths(self) -> list[int]:
        """The bucket widths present, ascending: one statement (one launch) each."""
        return sorted(int(n[2:]) for n in self._tensors if n.startswith("V_"))

    @property
    def buckets(self) -> list[tuple[int, int, int]]:
        """(partition, width, bucket rows) for every non-empty bucket."""
        return list(self.params["buckets"])

    def statements(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """The (statement, tensors) pairs that `spmm` runs, B and C excluded."""
        return [
            (
                self.expression,
                {
                    "RI": self._tensors[f"RI_{w}"],
                    "CI": self._tensors[f"CI_{w}"],
                    "V": self._tensors[f"V_{w}"],
                },
            )
            for w in self.widths
        ]

    def _dense(self) -> torch.Tensor:
        dense = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        for _, t in self.statements():
            rows = t["RI"].long().unsqueeze(1).expand_as(t["CI"])
            dense.index_put_((rows, t["CI"].long()), t["V"], accumulate=True)
        return dense

    def _describe(self) -> dict[str, Any]:
        return {
            "partitions": self.params["partitions"],
            "max_widths": self.params["max_widths"],
            "widths": self.widths,
        }
