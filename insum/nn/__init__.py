"""insum.nn: layers whose heavy lifting is one insum statement, one module per layer family.

    >>> import torch
    >>> from insum.nn import SparseLinear
    >>> layer = SparseLinear(8, 4, format="GroupCOO", sparsity=0.5)
    >>> layer(torch.randn(3, 8)).shape
    torch.Size([3, 4])

- `linear`: `SparseLinear` (a weight held in a sparse format), `magnitude_prune`.
- `tensor_product`: `FullyConnectedTensorProduct`, `TensorProduct` ("uvw" and channel-wise
  "uvu" paths), e3nn-compatible, `from_e3nn`.
- `irreps`: `Irreps` and the Clebsch–Gordan (Wigner-3j) tables in e3nn's real basis.
- `functional`: the functional forms (`sparse_linear`).
"""

from . import functional
from .irreps import Irreps, wigner_3j
from .linear import SparseLinear, magnitude_prune, sparse_linear
from .tensor_product import FullyConnectedTensorProduct, TensorProduct

__all__ = [
    "SparseLinear",
    "sparse_linear",
    "magnitude_prune",
    "functional",
    "FullyConnectedTensorProduct",
    "TensorProduct",
    "Irreps",
    "wigner_3j",
]
