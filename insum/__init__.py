"""insum: indirect Einsums compiled to fused gather / tl.dot / scatter Triton kernels.

    from insum import insum
    insum("C[AM[p],n] += AV[p,q] * B[AK[p,q],n]", C=C, AM=AM, AV=AV, AK=AK, B=B)

Differentiable (`insum.autograd`), traceable by torch.compile (`insum.library`), and
`insum.nn.SparseLinear` for models.
"""

from . import autograd, errors, library  # noqa: F401  (registers the torch.library operators)
from .api import compile, explain, insum, insum_many
from .errors import (  # noqa: F401  (exported by errors.__all__ below)
    InsumError,
    InsumIndexError,
    InsumShapeError,
    InsumSyntaxError,
    InsumTypeError,
    UnsupportedStatement,
)
from .parser import parse

__all__ = ["insum", "insum_many", "explain", "compile", "parse", *errors.__all__]  # every error class by name

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("formats", "nn", "distributed"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(name)
