"""Synthetic sparse matrices with skewed row lengths, for demos and benchmarks.

Real graphs and pruned weights have a few very long rows and many short ones; that skew
is what separates ELL, GroupCOO and CELL. These generators make such matrices at any
size, vectorised and reproducible from a seed.
"""

from __future__ import annotations

import math

import torch

from ..errors import InsumError

__all__ = ["power_law_matrix"]


def power_law_matrix(
    rows: int,
    cols: int,
    avg_nnz_per_row: float,
    *,
    alpha: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A rows x cols sparse CSR matrix whose row lengths follow a Zipf power law.

    The row of rank r (ranks shuffled over the rows) expects a length proportional to
    r^-alpha, scaled to average `avg_nnz_per_row`, capped at `cols` and rounded
    stochastically (so the mean is kept up to the cap). alpha = 0 gives equal rows,
    larger alpha more skew. A row of length l takes one column from each of l equal
    strata of the (randomly permuted) columns, so columns never repeat within a row.
    Values are standard normal. Everything is drawn from one generator seeded by `seed`.

    >>> A = power_law_matrix(1000, 500, 8.0, alpha=1.0, seed=0)
    >>> A.layout, A.shape
    (torch.sparse_csr, torch.Size([1000, 500]))
    """
    if not (rows >= 0 and cols >= 0 and 0 <= avg_nnz_per_row < math.inf and 0 <= alpha < math.inf):  # (nan too)
        raise InsumError(
            f"power_law_matrix needs rows, cols, avg_nnz_per_row, alpha >= 0 and finite; got "
            f"{rows}, {cols}, {avg_nnz_per_row}, {alpha}"
        )
    device = torch.device(device) if device is not None else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)

    rank = torch.randperm(rows, generator=gen, device=device).double() + 1
    weight = rank.pow(-alpha)
    expected = weight / weight.mean() * avg_nnz_per_row if rows else weight
    draw = torch.rand(rows, generator=gen, device=device, dtype=torch.float64)
    lengths = torch.floor(expected + draw).long().clamp(0, cols)

    crow = torch.zeros(rows + 1, dtype=torch.int64, device=device)
    crow[1:] = torch.cumsum(lengths, 0)
    total = int(crow[-1])
    row = torch.repeat_interleave(torch.arange(rows, device=device), lengths)
    j = torch.arange(total, device=device) - crow[row]
    length = lengths[row]
    low, high = (j * cols) // length, ((j + 1) * cols) // length  # stratum j of the row
    offset = torch.rand(total, generator=gen, device=device, dtype=torch.float64)
    stratum_col = low + torch.floor(offset * (high - low)).long()
    permutation = torch.randperm(max(cols, 1), generator=gen, device=device)
    col = permutation[stratum_col] if total else stratum_col
    col = torch.sort(row * max(cols, 1) + col).values % max(cols, 1)  # sorted within rows
    values = torch.randn(total, generator=gen, device=device, dtype=torch.float64).to(dtype)
    return torch.sparse_csr_tensor(crow, col, values, (rows, cols), check_invariants=False)
