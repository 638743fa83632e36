"""Generated power-law graphs for the distributed study (`study_distributed.py`).

Graphs (n nodes, about n * avg nonzeros, out-degrees Zipf(alpha) as in power_law_matrix):
- "community": a reordered graph's locality: `local` of the edges land within +-window
  rows of their source (communities after a locality ordering, as RCM or METIS give), the
  rest on power-law hubs (column rank drawn log-uniformly, so popular nodes are shared).
- "uniform": `insum.formats.power_law_matrix` (columns uniform): no locality at all, so
  every rank needs nearly every remote row and the halo is as large as an all-gather.
"""

from __future__ import annotations

import torch

from insum.formats import power_law_matrix

__all__ = ["community_power_law", "make_graph"]


def community_power_law(
    n: int, avg: float, *, alpha: float, local: float, window: int, seed: int, device
) -> torch.Tensor:
    """An n x n CSR graph with Zipf out-degrees, `local` of the edges within +-window of the
    source row and the rest on log-uniformly popular hubs. Duplicates merged; vectorised."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rank = torch.randperm(n, generator=gen, device=device).double() + 1
    weight = rank.pow(-alpha)
    expected = weight / weight.mean() * avg
    lengths = torch.floor(expected + torch.rand(n, generator=gen, device=device, dtype=torch.float64))
    lengths = lengths.long().clamp_(0, n)
    total = int(lengths.sum())
    row = torch.repeat_interleave(torch.arange(n, device=device), lengths, output_size=total)
    near = torch.randint(-window, window + 1, (total,), generator=gen, device=device)
    popularity = torch.pow(float(n), torch.rand(total, generator=gen, device=device, dtype=torch.float64))
    hubs = torch.randperm(n, generator=gen, device=device)[(popularity.long() - 1).clamp_(0, n - 1)]
    is_local = torch.rand(total, generator=gen, device=device) < local
    col = torch.where(is_local, (row + near).remainder(n), hubs)
    del near, popularity, hubs, is_local
    key = torch.unique(row * n + col)
    del row, col
    row, col = key // n, key % n
    crow = torch.zeros(n + 1, dtype=torch.int64, device=device)
    crow[1:] = torch.cumsum(torch.bincount(row, minlength=n), 0)
    values = torch.randn(key.numel(), generator=gen, device=device)
    return torch.sparse_csr_tensor(crow, col, values, (n, n), check_invariants=False)


def make_graph(kind: str, n: int, avg: float, device) -> torch.Tensor:
    """The study's graph of `kind` ("community" or "uniform"), n x n CSR, seed 1."""
    if kind == "community":
        return community_power_law(n, avg, alpha=0.7, local=0.7, window=max(n // 400, 8), seed=1, device=device)
    return power_law_matrix(n, n, avg, alpha=0.7, seed=1, device=device)
