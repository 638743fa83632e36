"""insum.nn: layers whose heavy lifting is one insum statement, one module per layer family.

    >>> import torch
    >>> from insum.nn import SparseLinear
    >>> layer = SparseLinear(8, 4, format="GroupCOO", sparsity=0.5)
    >>> layer(torch.randn(3, 8)).shape
    torch.Size([3, 4])

- `linear`: `SparseLinear` (a weight held in a sparse format), `magnitude_prune`.
- `sparse_autograd`: the one autograd path of `SparseLinear` and `sparse_linear`.
- `conv`: `SparseConv3d` (submanifold, strided and transposed sparse convolution).
- `kernel_map`: the GPU kernel-map builder, its packings and `KernelMapCache`.
- `distributed`: `DistributedSparseLinear` (output features split across ranks).
- `tensor_product`: `FullyConnectedTensorProduct`, `TensorProduct` ("uvw" and channel-wise
  "uvu" paths), e3nn-compatible, `from_e3nn`.
- `irreps`: `Irreps` and the Clebsch–Gordan (Wigner-3j) tables in e3nn's real basis.
- `functional`: the functional forms (`sparse_linear`, `sparse_conv3d`).
"""

from . import functional, kernel_map
from .conv import SparseConv3d, sparse_conv3d
from .distributed import DistributedSparseLinear
from .irreps import Irreps, wigner_3j
from .kernel_map import KernelMap, KernelMapCache, build_kernel_map
from .linear import SparseLinear, magnitude_prune, sparse_linear
from .tensor_product import FullyConnectedTensorProduct, TensorProduct

__all__ = [
    "SparseLinear",
    "DistributedSparseLinear",
    "sparse_linear",
    "magnitude_prune",
    "SparseConv3d",
    "sparse_conv3d",
    "KernelMap",
    "KernelMapCache",
    "build_kernel_map",
    "functional",
    "kernel_map",
    "FullyConnectedTensorProduct",
    "TensorProduct",
    "Irreps",
    "wigner_3j",
]
