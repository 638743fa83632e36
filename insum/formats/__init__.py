"""Sparse formats as dense index/value tensors plus the indirect Einsum that uses them.

Every format packs a matrix with `Format.from_dense(A, **params)` or
`Format.from_torch(sparse)`, multiplies with `fmt @ B` (one `insum()` statement, or one
per bucket width for CELL), and converts back with `fmt.to_dense()`.

    >>> import torch
    >>> from insum.formats import GroupCOO
    >>> A = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    >>> G = GroupCOO.from_dense(A)
    >>> G.expression
    'C[AM[p],n] += AV[p,q]*B[AK[p,q],n]'
    >>> torch.equal(G @ torch.eye(2), A)
    True

The package imports nothing from the code generator or the runtime.
"""

from .auto import auto
from .base import FORMATS, SparseFormat, format_class
from .blockgroupcoo import BlockGroupCOO
from .cell import CELL
from .coo import COO
from .ell import ELL
from .groupcoo import GroupCOO
from .io import load_mtx, load_smtx
from .nm import NM
from .synthetic import power_law_matrix

__all__ = [
    "FORMATS",
    "SparseFormat",
    "format_class",
    "COO",
    "GroupCOO",
    "ELL",
    "BlockGroupCOO",
    "CELL",
    "NM",
    "load_mtx",
    "load_smtx",
    "power_law_matrix",
    "auto",
]
