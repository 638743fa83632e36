"""The dtype policy: which dtypes insum accepts, their short names, and how half precision
accumulates.

Half precision (float16, bfloat16) is multiplied and summed in float32 and rounded once
at the end: the torch lowering, the generated kernels' accumulators and the derived
gradients all follow `compute_dtype`.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "VALUE_DTYPES",
    "INDEX_DTYPES",
    "HALF_DTYPES",
    "HALF_NAMES",
    "DTYPE_NAMES",
    "TL_DTYPES",
    "INT32_MAX",
    "DtypeName",
    "compute_dtype",
    "as_dtype",
    "promoted",
]

#: Factors and outputs.
VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Index tensors.
INDEX_DTYPES = (torch.int32, torch.int64)
#: Half precision: accumulated in float32 (see `compute_dtype`).
HALF_DTYPES = (torch.float16, torch.bfloat16)

DtypeName = Literal["fp16", "bf16", "fp32", "fp64", "int32", "int64"]
#: The short names that kernel specs, plans and generated source use.
DTYPE_NAMES: dict[torch.dtype, DtypeName] = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "int32",
    torch.int64: "int64",
}
HALF_NAMES: tuple[DtypeName, ...] = tuple(DTYPE_NAMES[d] for d in HALF_DTYPES)
#: Short name -> the Triton dtype in generated source.
TL_DTYPES = {"fp16": "tl.float16", "bf16": "tl.bfloat16", "fp32": "tl.float32", "fp64": "tl.float64"}

#: The largest element offset that 32-bit addressing (and an int32 index) can hold.
INT32_MAX = 2**31 - 1


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype values of `dtype` are multiplied and summed in: float32 for half precision.

    >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
    (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in HALF_DTYPES else dtype


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`: itself where it already is (`Tensor.to` returns it too, after about
    1.8 µs of dispatch on the development VM; a layer's backward asks six times a step).

    >>> t = torch.zeros(2)
    >>> as_dtype(t, torch.float32) is t, as_dtype(t, torch.float16).dtype
    (True, torch.float16)
    """
    return t if t.dtype == dtype else t.to(dtype)


def promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """`torch.promote_types(a, b)`, without its dispatch where the two are the same (a
    layer's backward asks three times a step).

    >>> promoted(torch.float16, torch.float16), promoted(torch.float16, torch.float32)
    (torch.float16, torch.float32)
    """
    return a if a == b else torch.promote_types(a, b)
