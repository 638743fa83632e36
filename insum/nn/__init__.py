"""insum.nn: layers whose heavy lifting is one insum statement, one module per layer family.

    >>> import torch
    >>> from insum.nn import SparseLinear
    >>> layer = SparseLinear(8, 4, format="GroupCOO", sparsity=0.5)
    >>> layer(torch.randn(3, 8)).shape
    torch.Size([3, 4])

- `linear`: `SparseLinear` (a weight held in a sparse format), `magnitude_prune`.
- `distributed`: `DistributedSparseLinear` (output features split across ranks).
- `functional`: the functional forms (`sparse_linear`).
"""

from . import functional
from .distributed import DistributedSparseLinear
from .linear import SparseLinear, magnitude_prune, sparse_linear

__all__ = [
    "SparseLinear",
    "DistributedSparseLinear",
    "sparse_linear",
    "magnitude_prune",
    "functional",
]
