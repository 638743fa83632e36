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

Not reproduced from the paper: the random-forest models that decide whether to use
CELL and how many partitions to use (pass `partitions`), and the mapping of 2^k-nonzero
blocks to thread blocks (the kernel's tiling decides that).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InsumError
from .base import Coords, SparseFormat, check_positive_int, coords_of, index_dtype_for

__all__ = ["CELL", "cell_cost"]


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Elementwise smallest power of two >= x (x >= 1, int64)."""
    w = torch.pow(2, torch.ceil(torch.log2(x.double()))).long()
    w = torch.where(w < x, w * 2, w)
    return torch.where((w // 2) >= x, w // 2, w)


class _Segments:
    """Each (partition, row)'s run of nonzeros: the unit that buckets and folding place."""

    def __init__(self, coords: Coords, partitions: int):
        M, K = coords.shape
        self.part_width = max(-(-K // partitions), 1)
        part = coords.cols // self.part_width
        key = part * M + coords.rows
        key, order = torch.sort(key, stable=True)  # coordinates are row-major already
        self.rows, self.cols, self.vals = coords.rows[order], coords.cols[order], coords.vals[order]
        keys, self.length = torch.unique_consecutive(key, return_counts=True)
        self.part, self.row = keys // max(M, 1), keys % max(M, 1)
        self.start = torch.cumsum(self.length, 0) - self.length
        self.of_nz = torch.repeat_interleave(
            torch.arange(keys.numel(), device=key.device), self.length
        )
        self.within = torch.arange(key.numel(), device=key.device) - self.start[self.of_nz]
        self.partitions, self.K = partitions, K
        self.natural = _pow2_ceil(self.length)  # bucket width before folding
        exponent = torch.log2(self.natural.double()).long()
        # Distinct columns per bucket under any cap, from two small histograms: distinct
        # (natural bucket exponent, column) pairs, and each column's widest exponent.
        span = max(K, 1)
        self.n_exp = int(exponent.max()) + 2 if exponent.numel() else 2
        pairs = torch.unique(exponent[self.of_nz] * span + self.cols)
        pair_exp, pair_part = pairs // span, (pairs % span) // self.part_width
        self.pair_hist = torch.bincount(
            pair_part * self.n_exp + pair_exp, minlength=partitions * self.n_exp
        )
        self.pair_hist = self.pair_hist.view(partitions, self.n_exp)
        col_top = torch.full((span,), -1, dtype=torch.int64, device=key.device)
        col_top.scatter_reduce_(0, pairs % span, pair_exp, reduce="amax")
        used = col_top >= 0
        col_part = torch.arange(span, device=key.device)[used] // self.part_width
        self.top_hist = torch.bincount(
            col_part * self.n_exp + col_top[used], minlength=partitions * self.n_exp
        )
        self.top_hist = self.top_hist.view(partitions, self.n_exp)

    def widths(self, cap_exp: torch.Tensor) -> torch.Tensor:
        """Bucket width of each segment when partition p folds rows longer than 2^cap_exp[p]."""
        return torch.minimum(self.natural, torch.pow(2, cap_exp[self.part]))

    def cost(self, cap_exp: torch.Tensor, dense_cols: int) -> torch.Tensor:
        """LiteForm eq. (7) summed over each partition's buckets: one cost per partition.

        cost(bucket) = 2 I1 W + |set(CI)| J + I1 J, with I1 the bucket's (folded) rows, W
        its width, |set(CI)| its distinct columns and J the dense operand's columns.
        """
        width = self.widths(cap_exp)
        folds = -(-self.length // width)
        P = self.partitions
        per_row = torch.zeros(P, dtype=torch.float64, device=width.device)
        per_row.index_add_(0, self.part, (folds * (2 * width + dense_cols)).double())
        # A column keeps its distinct buckets below the cap; those at or above it merge.
        exps = torch.arange(self.n_exp, device=width.device).view(1, -1)
        below = exps < cap_exp.view(-1, 1)
        narrow = (self.pair_hist * below).sum(1)
        capped = (self.top_hist * ~below).sum(1)
        return per_row + (narrow + capped).double() * dense_cols

    def natural_exp(self) -> torch.Tensor:
        """Per partition, the exponent of the widest bucket before any folding."""
        top = torch.zeros(self.partitions, dtype=torch.int64, device=self.length.device)
        top.scatter_reduce_(0, self.part, self.natural, reduce="amax")
        return torch.log2(top.clamp(min=1).double()).long()


def _search_widths(seg: _Segments, dense_cols: int) -> torch.Tensor:
    """LiteForm Algorithm 3, run for all partitions at once over width exponents.

    lo and hi bound the best exponent; at mid the cost of width 2^mid is compared with
    2^(mid+1): if the wider one is cheaper the optimum lies right of mid, else at or left.
    It assumes the cost is unimodal in the width, which the distinct-column term breaks
    (folding a long row pays off only once it merges into a bucket sharing its columns).
    """
    hi = seg.natural_exp()
    lo = torch.zeros_like(hi)
    while bool((lo < hi).any()):
        mid = (lo + hi) // 2
        wider_is_cheaper = seg.cost(mid, dense_cols) > seg.cost(mid + 1, dense_cols)
        active = lo < hi
        lo = torch.where(active & wider_is_cheaper, mid + 1, lo)
        hi = torch.where(active & ~wider_is_cheaper, mid, hi)
    return lo


def _scan_widths(seg: _Segments, dense_cols: int) -> torch.Tensor:
    """The cost model's true minimum: evaluate every power of two up to the widest row.

    That is log2(longest row) + 1 evaluations of an O(rows) model, cheap enough to skip
    the binary search's unimodality assumption. Ties go to the wider width (fewer folds).
    """
    top = seg.natural_exp()
    exps = range(int(top.max()) + 1 if top.numel() else 1)
    costs = torch.stack(
        [seg.cost(torch.minimum(top, torch.full_like(top, e)), dense_cols) for e in exps]
    )
    best = costs.min(dim=0).values
    chosen = torch.zeros_like(top)
    for e in exps:  # ascending: the last exponent reaching the minimum wins
        chosen = torch.where(costs[e] <= best, torch.minimum(top, torch.full_like(top, e)), chosen)
    return chosen


_SEARCHES = {"scan": _scan_widths, "binary": _search_widths}


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
    exp = max_width.bit_length() - 1
    cap = torch.full((partitions,), exp, dtype=torch.int64, device=seg.length.device)
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

    `tensors` holds RI_W / CI_W / V_W for every width W in `widths`; `buckets` lists
    (partition, width, bucket rows). `expression` is the statement each width runs.

    >>> A = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 6.0, 0.0, 0.0]])
    >>> F = CELL.from_dense(A, max_width=2)
    >>> F.widths, F.RI_2.tolist(), F.RI_1.tolist()
    ([1, 2], [0, 0, 0], [1])
    """

    name = "cell"
    expression = "C[RI[r],n] += V[r,w]*B[CI[r,w],n]"

    @classmethod
    def _pack(
        cls,
        coords: Coords,
        *,
        partitions: int = 1,
        max_width: int | None = None,
        dense_cols: int = 128,
        search: str = "scan",
        index_dtype: torch.dtype | None = None,
    ) -> CELL:
        M, K = coords.shape
        check_positive_int("partitions", partitions)
        if partitions > max(K, 1):
            raise InsumError(f"partitions={partitions} exceeds the {K} columns of the matrix")
        check_positive_int("dense_cols", dense_cols)
        itype = index_dtype_for(M, K, requested=index_dtype)
        device = coords.device
        if search not in _SEARCHES:
            raise InsumError(f"unknown search {search!r}; choose one of {', '.join(_SEARCHES)}")
        coords = coords.checked()
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

        # Folded rows: segment s becomes folds[s] bucket rows of width[s].
        width = seg.widths(cap_exp)
        folds = -(-seg.length // width)
        fold_start = torch.cumsum(folds, 0) - folds
        of_fold = torch.repeat_interleave(torch.arange(width.numel(), device=device), folds)
        fold_index = torch.arange(of_fold.numel(), device=device) - fold_start[of_fold]
        fold_width, fold_row = width[of_fold], seg.row[of_fold]
        # Pad a folded row with its own first column.
        fold_pad = seg.cols[seg.start[of_fold] + fold_index * fold_width]
        nz_width = width[seg.of_nz]
        nz_fold = fold_start[seg.of_nz] + seg.within // nz_width
        nz_slot = seg.within % nz_width

        tensors: dict[str, torch.Tensor] = {}
        widths = torch.unique(width).tolist()  # one statement each: a handful at most
        for w in widths:
            chosen = fold_width == w
            position = torch.cumsum(chosen, 0) - 1  # row within this width's statement
            rows = int(chosen.sum())
            CI = fold_pad[chosen].unsqueeze(1).repeat(1, w)
            V = torch.zeros(rows, w, dtype=coords.dtype, device=device)
            mine = nz_width == w
            target = position[nz_fold[mine]]
            CI[target, nz_slot[mine]] = seg.cols[mine]
            V[target, nz_slot[mine]] = seg.vals[mine]
            tensors[f"RI_{w}"] = fold_row[chosen].to(itype)
            tensors[f"CI_{w}"] = CI.to(itype)
            tensors[f"V_{w}"] = V

        exp = torch.log2(width.double()).long() if width.numel() else width
        n_exp = int(exp.max()) + 1 if width.numel() else 1
        per_bucket = torch.zeros(partitions * n_exp, dtype=torch.int64, device=device)
        per_bucket.index_add_(0, seg.part * n_exp + exp, folds)
        nonzero_buckets = per_bucket.nonzero().flatten().tolist()
        counts = per_bucket[nonzero_buckets].tolist()
        buckets = [(b // n_exp, 1 << (b % n_exp), c) for b, c in zip(nonzero_buckets, counts)]
        params = {
            "partitions": partitions,
            "max_widths": [1 << e for e in cap_exp.tolist()],
            "dense_cols": dense_cols,
            "buckets": buckets,
        }
        return cls._packed(coords, tensors, itype, params)

    def _is_value(self, name: str) -> bool:
        return name.startswith("V_")

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

    def to_dense(self) -> torch.Tensor:
        dense = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        for _, t in self.statements():
            rows = t["RI"].long().unsqueeze(1).expand_as(t["CI"])
            dense.index_put_((rows, t["CI"].long()), t["V"], accumulate=True)
        return dense

    def _spmm(self, B, compute, acc, backend, precision) -> torch.Tensor:
        C = torch.zeros(self.shape[0], B.shape[1], dtype=acc, device=B.device)
        for expression, t in self.statements():
            self._run(
                expression,
                backend,
                precision,
                C=C,
                B=B,
                RI=t["RI"],
                CI=t["CI"],
                V=t["V"].to(compute),
            )
        return C

    def _describe(self) -> dict[str, Any]:
        return {
            "partitions": self.params["partitions"],
            "max_widths": self.params["max_widths"],
            "widths": self.widths,
        }
