"""insum: indirect Einsums compiled to fused gather / tl.dot / scatter Triton kernels.

    from insum import insum
    insum("C[AM[p],n] += AV[p,q] * B[AK[p,q],n]", C=C, AM=AM, AV=AV, AK=AK, B=B)

Differentiable (`insum.autograd`), traceable by torch.compile (`insum.library`), and
`insum.nn.SparseLinear` for models.
"""

from . import autograd, library  # noqa: F401  (registers the torch.library operators)
from .api import explain, insum
from .errors import (
    InsumError,
    InsumIndexError,
    InsumShapeError,
    InsumSyntaxError,
    InsumTypeError,
    UnsupportedStatement,
)
from .parser import parse

__all__ = [
    "insum",
    "explain",
    "compile",
    "parse",
    "InsumError",
    "InsumSyntaxError",
    "InsumShapeError",
    "InsumTypeError",
    "InsumIndexError",
    "UnsupportedStatement",
]

__version__ = "0.1.0"


def __getattr__(name):
    # compile() lives with the runtime, which imports triton: load it on first use.
    if name == "compile":
        from .runtime import compile

        return compile
    if name in ("formats", "nn", "distributed"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(name)
