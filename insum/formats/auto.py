"""auto(A, n_cols, dtype): the packed format expected fastest for an SpMM A @ B.

LiteForm's approach (Peng et al., HPDC'25, §5) in two steps:

1. A cost model from the matrix's row-length statistics, read in one host sync, ranks the
   candidates: ELL (no scatter, rows padded to the longest), GroupCOO for every
   power-of-two group size (the packer sorts rows, so the kernel reduces each row's
   groups in registers and writes once per row and tile) and CELL (one launch per bucket
   width). An SpMM moves one row of B per stored slot (padding included) and one row of C
   per written segment; atomics cost more than stores; each launch costs a few
   microseconds.
2. On CUDA, the best few candidates by the model are packed and timed with the real SpMM
   (B with `n_cols` columns); the fastest is kept. The result is cached by the matrix's
   fingerprint (shape, nnz, a checksum of its pattern, dtype, n_cols, device), so a second
   call packs the winner without timing again.

The chosen format's `describe()` says what was chosen and why (the ranking, and the
measured times when there were any). `packer(name)` packs by a format's name, "auto"
included, so that layers and the distributed product take either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..arith import cdiv, next_power_of_2
from ..dtypes import HALF_DTYPES
from ..errors import InsumError, InsumTypeError
from .base import SparseFormat
from .coords import check_positive_int, check_values, coords_of
from .ell import ELL
from .grouping import HALF_FAN_IN
from .registry import format_class
from .tuning import time_spmm

__all__ = ["auto", "packer", "pruning_block", "Candidate", "RowStats", "rank", "row_stats"]

# Cost model constants, fitted to the H200 (fp32, N=128, power-law graphs; only ratios
# decide between candidates). Time is counted in gathered rows of B: each stored slot
# (padding included) gathers one; each group (a row of the kernel's tile: its index and
# value loads, its share of the K loop and of the segmented write) costs GROUP_ROWS more.
GATHER_BYTES_PER_US = 8.0e6  # gathered B rows, mostly from L2
GROUP_ROWS = 3.0
WRITE_BYTES_PER_US = 3.0e6  # plain stores, the zero fill, the float32 -> half copy
LAUNCH_US = 3.0  # one kernel launch (a zero fill is one too)
ELL_MAX_SLOTS = 1 << 26  # ELL pads every row to the longest: beyond this it is never chosen
GROUP_SIZES = tuple(1 << e for e in range(7))  # 1 .. 64
MEASURED = 4  # candidates timed on CUDA
CELL_MEASURED_NNZ = 1 << 18  # from here CELL is timed too

_CACHE: dict[tuple, tuple[str, dict[str, Any], str]] = {}


@dataclass(frozen=True)
class RowStats:
    """What the cost model needs from a matrix: row-length statistics, read in one sync."""

    shape: tuple[int, int]
    nnz: int
    nonempty: int  # rows with at least one entry
    longest: int  # entries in the longest row
    groups: dict[int, int]  # group size g -> groups (sum over rows of ceil(len / g))
    pow2_slots: int  # sum over rows of next_power_of_2(len): CELL's slots without folding
    widths: int  # distinct next_power_of_2(len) over non-empty rows: CELL's launches
    checksum: int  # of the sparsity pattern, for the fingerprint


@dataclass(frozen=True)
class Candidate:
    """A format and parameters with the model's estimate of one SpMM."""

    format: str
    params: dict[str, Any] = field(default_factory=dict)
    cost_us: float = 0.0
    why: str = ""

    def __str__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.format}({params}) ~{self.cost_us:.1f}us: {self.why}"


def row_stats(A: torch.Tensor) -> RowStats:
    """Row-length statistics of a dense or torch sparse matrix (one host sync)."""
    coords = coords_of(A).checked()
    counts = coords.counts
    M, K = coords.shape
    groups = [cdiv(counts, g).sum() for g in GROUP_SIZES]
    nonzero = counts[counts > 0] if M else counts
    pow2 = torch.where(counts > 0, 1 << torch.ceil(torch.log2(counts.clamp(min=1).double())).long(), 0)
    present = torch.zeros(64, dtype=torch.int64, device=counts.device)
    if nonzero.numel():
        present.index_fill_(0, torch.ceil(torch.log2(nonzero.double())).long(), 1)
    weights = torch.arange(1, coords.nnz + 1, device=counts.device) % 1000003
    checksum = (torch.add(coords.cols, coords.rows, alpha=max(K, 1)) % 1000003 * weights).sum()
    values = torch.stack(
        [
            counts.sum(),
            (counts > 0).sum(),
            counts.max() if M else counts.sum(),
            pow2.sum(),
            present.sum(),
            checksum,
            *groups,
        ]
    ).tolist()
    nnz, nonempty, longest, pow2_slots, widths, check, *group_counts = values
    return RowStats(
        shape=(M, K),
        nnz=nnz,
        nonempty=nonempty,
        longest=longest,
        groups=dict(zip(GROUP_SIZES, group_counts)),
        pow2_slots=pow2_slots,
        widths=widths,
        checksum=check,
    )


def rank(stats: RowStats, n_cols: int, dtype: torch.dtype = torch.float32) -> list[Candidate]:
    """Every candidate with its modelled SpMM time, cheapest first."""
    M, _ = stats.shape
    row_bytes = n_cols * torch.empty((), dtype=dtype).element_size()
    # A half-precision scatter into many-group rows accumulates in a float32 buffer: one
    # more launch and a pass over C to round it.
    half = dtype in HALF_DTYPES

    def gathers(slots: int, groups: int) -> float:
        return (slots + GROUP_ROWS * groups) * row_bytes / GATHER_BYTES_PER_US

    def scatter(launches: int, fan_in: int) -> float:
        """Zero fill, launches, and the float32 buffer a half-precision scatter may need."""
        fill = M * row_bytes / WRITE_BYTES_PER_US
        wide = half and fan_in > HALF_FAN_IN
        convert = (M * row_bytes * 3 / WRITE_BYTES_PER_US + LAUNCH_US) if wide else 0.0
        return fill + convert + (launches + 1) * LAUNCH_US

    out = []
    ell_slots = ELL.row_padding_slots(stats.shape, stats.longest, {})
    if ell_slots <= ELL_MAX_SLOTS:
        cost = gathers(ell_slots, M) + M * row_bytes / WRITE_BYTES_PER_US + LAUNCH_US
        out.append(Candidate("ELL", {}, cost, f"{ell_slots / max(stats.nnz, 1):.2f} slots per nonzero, no atomics"))
    for g in GROUP_SIZES:
        if g > 1 and g > next_power_of_2(stats.longest):
            break
        G = stats.groups[g]
        cost = gathers(G * g, G) + scatter(1, cdiv(stats.longest, g))
        out.append(
            Candidate(
                "GroupCOO",
                {"group_size": g},
                cost,
                f"{G * g / max(stats.nnz, 1):.2f} slots per nonzero, {G} groups, sorted rows reduced per segment",
            )
        )
    if stats.widths:
        cost = gathers(stats.pow2_slots, stats.nonempty) + scatter(stats.widths, HALF_FAN_IN + 1)
        out.append(
            Candidate(
                "CELL",
                {},
                cost,
                f"{stats.pow2_slots / max(stats.nnz, 1):.2f} slots per nonzero, {stats.widths} bucket launches",
            )
        )
    return sorted(out, key=lambda c: c.cost_us)


def _pack(
    candidate: Candidate | tuple[str, dict], A: torch.Tensor, dtype: torch.dtype, index_dtype: torch.dtype | None
) -> SparseFormat:
    name, params = (candidate.format, candidate.params) if isinstance(candidate, Candidate) else candidate
    return packer(name)(A.to(dtype), **params, index_dtype=index_dtype)


def packer(format: str) -> Callable[..., SparseFormat]:
    """How to pack a matrix (dense or torch sparse) in the named format: `auto` for "auto",
    else the format's `from_dense` or `from_torch` by the matrix's layout. An unknown name
    raises here, before any packing.

    >>> packer("ell")(torch.tensor([[1.0, 0.0], [0.0, 2.0]])).AK.tolist()
    [[0], [1]]
    """
    if not isinstance(format, str):
        raise InsumTypeError(f"format must be a format's name or \"auto\", got {format!r}")
    if format.lower() == "auto":
        return auto
    cls = format_class(format)

    def pack(A: torch.Tensor, **params: Any) -> SparseFormat:
        return (cls.from_dense if A.layout == torch.strided else cls.from_torch)(A, **params)

    return pack


def pruning_block(format: str, params: Mapping[str, Any]) -> tuple[int, int] | None:
    """The blocks magnitude pruning keeps or drops for a layer packed as `format` with
    `params` (None: single entries, as for "auto", which picks an unstructured format)."""
    return None if format.lower() == "auto" else format_class(format).pruning_block(params)


def auto(
    A: torch.Tensor,
    n_cols: int | None = None,
    dtype: torch.dtype | None = None,
    *,
    measure: bool | None = None,
    index_dtype: torch.dtype | None = None,
    **unknown: Any,
) -> SparseFormat:
    """Pack A (dense or torch sparse COO/CSR/BSR) in the format expected fastest for
    `fmt @ B` with B of `n_cols` columns (default 128) in `dtype` (default A's).

    measure: time the model's best few candidates with the real SpMM and keep the fastest
    (default: on CUDA). Results are cached per matrix fingerprint.
    index_dtype: the packed indices' dtype (default: int32 where the sizes allow).

    >>> A = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]])
    >>> fmt = auto(A, n_cols=16)
    >>> torch.allclose(fmt @ torch.eye(3), A)
    True
    """
    if unknown:
        raise InsumError(
            f"unknown parameter(s) {', '.join(map(repr, unknown))} for formats.auto; "
            "valid: n_cols, dtype, measure, index_dtype"
        )
    if not isinstance(A, torch.Tensor):
        raise InsumError(f"auto expects a torch.Tensor matrix, got {type(A).__name__}")
    n_cols = 128 if n_cols is None else check_positive_int("n_cols", n_cols)
    dtype = A.dtype if dtype is None else dtype
    check_values(dtype)
    stats = row_stats(A)
    ranked = rank(stats, n_cols, dtype)
    if measure is not None and not isinstance(measure, bool):
        raise InsumTypeError(f"auto's measure must be True, False or None, got {measure!r}")
    measure = A.device.type == "cuda" if measure is None else measure
    key = (stats.shape, stats.nnz, stats.checksum, str(dtype), n_cols, str(A.device), measure, str(index_dtype))
    cached = _CACHE.get(key)
    if cached is not None:
        name, params, why = cached
        fmt = _pack((name, params), A, dtype, index_dtype)
        fmt.chosen_because = why + " (cached choice for this matrix)"
        return fmt
    model = "; ".join(str(c) for c in ranked[:4])
    if not measure or stats.nnz == 0:
        best = ranked[0]
        fmt = _pack(best, A, dtype, index_dtype)
        why = f"auto: {best.format}{best.params or ''} by the cost model ({stats.nnz} nonzeros, longest row {stats.longest}, N={n_cols}); ranked: {model}"
    else:
        B = torch.randn(stats.shape[1], n_cols, dtype=dtype, device=A.device, generator=torch.Generator(A.device).manual_seed(0))
        timed = []
        # A device-bound SpMM also times the best CELL packing (its bucket launches cost
        # little there, and the model knows least about it).
        extra = [c for c in ranked[MEASURED:] if c.format == "CELL"][:1] if stats.nnz >= CELL_MEASURED_NNZ else []
        for candidate in ranked[:MEASURED] + extra:
            fmt = _pack(candidate, A, dtype, index_dtype)
            timed.append((time_spmm(fmt, B) * 1e6, candidate, fmt))  # device microseconds
        seconds, best, fmt = min(timed, key=lambda t: t[0])
        times = ", ".join(f"{c.format}{c.params or ''} {t:.1f}us" for t, c, _ in timed)
        why = f"auto: {best.format}{best.params or ''} measured fastest at N={n_cols} ({times}); model ranked: {model}"
    _CACHE[key] = (best.format, dict(best.params), why)
    fmt.chosen_because = why
    return fmt

