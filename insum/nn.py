"""insum.nn: a linear layer whose weight lives in a sparse format.

    >>> import torch
    >>> from insum.nn import SparseLinear
    >>> layer = SparseLinear(8, 4, format="GroupCOO", sparsity=0.5)
    >>> layer(torch.randn(3, 8)).shape
    torch.Size([3, 4])

`SparseLinear` computes y = x @ W^T + b as the format's SpMM, W @ x^T, one insum
statement (or one per bucket for CELL). The format's value tensors are parameters, its
index tensors buffers, so `.to()`, `.half()`, optimizers and `state_dict` see them; the
pattern itself never changes in training (padding slots are trained too: a padded slot
repeats a stored position, so it is the same weight entry counted twice).
`insum.nn.functional.sparse_linear(x, fmt, bias)` is the functional form.
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import torch
from torch import nn

from .errors import InsumError, InsumShapeError
from .formats.base import SparseFormat, format_class

__all__ = ["SparseLinear", "sparse_linear", "magnitude_prune", "functional"]

_DTYPES = {str(d): d for d in (torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def sparse_linear(
    x: torch.Tensor,
    weight: SparseFormat,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    precision: str = "tf32",
) -> torch.Tensor:
    """y = x @ W^T + b for a weight W (out_features x in_features) held in a sparse format.

    x is (..., in_features); the result is (..., out_features) in the promoted dtype of x
    and W. Differentiable with respect to x, the weight's value tensors and the bias.
    """
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise InsumShapeError(
            f"sparse_linear: x has {x.shape[-1]} features (shape {tuple(x.shape)}) but the "
            f"weight has shape ({out_features}, {in_features})"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    y = weight.spmm(x2.t(), backend=backend, precision=precision).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, out_features)


functional = types.ModuleType(__name__ + ".functional", "Functional forms: sparse_linear.")
functional.sparse_linear = sparse_linear
sys.modules[functional.__name__] = functional


def magnitude_prune(
    weight: torch.Tensor, sparsity: float, block: int | tuple[int, int] | None = None
) -> torch.Tensor:
    """A copy of `weight` with the `sparsity` fraction of smallest entries (or blocks) zeroed.

    block: (bm, bk) prunes whole blocks by their L2 norm (partial blocks at the edges
    count as blocks); None prunes single entries by magnitude.
    """
    if not 0.0 <= sparsity <= 1.0:
        raise InsumError(f"sparsity must be in [0, 1], got {sparsity}")
    if weight.dim() != 2:
        raise InsumShapeError(f"magnitude_prune expects a matrix, got shape {tuple(weight.shape)}")
    weight = weight.detach()
    if sparsity == 0.0:
        return weight.clone()
    M, K = weight.shape
    if block is None:
        bm = bk = 1
    else:
        bm, bk = (block, block) if isinstance(block, int) else block
    MB, KB = -(-M // bm), -(-K // bk)
    padded = torch.nn.functional.pad(weight.double(), (0, KB * bk - K, 0, MB * bm - M))
    norms = padded.view(MB, bm, KB, bk).square().sum(dim=(1, 3)).flatten()
    keep = norms.numel() - int(round(sparsity * norms.numel()))
    mask = torch.zeros(norms.numel(), dtype=torch.bool, device=weight.device)
    if keep > 0:
        # Ties go to the lower index (a stable sort), so the result is deterministic.
        mask[torch.sort(norms, descending=True, stable=True).indices[:keep]] = True
    mask = mask.view(MB, 1, KB, 1).expand(MB, bm, KB, bk).reshape(MB * bm, KB * bk)[:M, :K]
    return weight * mask


class SparseLinear(nn.Module):
    """y = x @ W^T + b with W (out_features x in_features) held in a sparse format.

    format: a format name ("GroupCOO", "BlockGroupCOO", "ELL", "COO", "NM", "CELL");
    format_params go to its packer (block=(32, 32), n=2, m=4, vector_len=16, ...).
    A new layer draws W as nn.Linear does, then prunes it by magnitude to `sparsity`
    (whole blocks for BlockGroupCOO; NM prunes to its own n:m pattern). Build one from a
    given weight with `from_dense` or from an nn.Linear with `from_linear`.
    backend, precision: as for `insum()`.

    A state_dict carries the format, its parameters and every tensor, so it loads into
    any SparseLinear of the same in/out features: tensors whose shapes differ (another
    pattern) are replaced, so build the optimizer after loading.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        format: str = "GroupCOO",
        *,
        sparsity: float = 0.0,
        backend: str = "auto",
        precision: str = "tf32",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **format_params: Any,
    ):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.backend, self.precision = backend, precision
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # as nn.Linear
        cls = format_class(format)
        if sparsity and cls.name != "nm":
            block = format_params.get("block", (16, 16)) if cls.name == "blockgroupcoo" else None
            weight = magnitude_prune(weight, sparsity, block)
        elif sparsity and cls.name == "nm":
            raise InsumError("NM prunes to its own n:m pattern; pass n=, m= instead of sparsity=")
        self._set_format(cls.from_dense(weight, **format_params))
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        format: str = "GroupCOO",
        *,
        backend: str = "auto",
        precision: str = "tf32",
        **format_params: Any,
    ) -> SparseLinear:
        """A layer holding `weight` (out x in; its zeros are the pattern, NM prunes) and `bias`."""
        if weight.dim() != 2:
            raise InsumShapeError(f"weight must be (out_features, in_features), got {tuple(weight.shape)}")
        fmt = format_class(format).from_dense(weight.detach(), **format_params)
        return cls.from_format(fmt, bias, backend=backend, precision=precision)

    @classmethod
    def from_format(
        cls,
        weight: SparseFormat,
        bias: torch.Tensor | None = None,
        *,
        backend: str = "auto",
        precision: str = "tf32",
    ) -> SparseLinear:
        """A layer holding an already packed weight (out x in) and an optional bias."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight.shape
        layer.backend, layer.precision = backend, precision
        layer._set_format(weight)
        if bias is None:
            layer.register_parameter("bias", None)
        else:
            if tuple(bias.shape) != (layer.out_features,):
                raise InsumShapeError(f"bias must have shape ({layer.out_features},), got {tuple(bias.shape)}")
            layer.bias = nn.Parameter(bias.detach().clone())
        return layer

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, format: str = "GroupCOO", *, sparsity: float = 0.0, **kwargs: Any
    ) -> SparseLinear:
        """Prune an nn.Linear's weight by magnitude (blocks for BlockGroupCOO) and pack it."""
        weight = linear.weight.detach()
        if sparsity:
            block = kwargs.get("block", (16, 16)) if format_class(format).name == "blockgroupcoo" else None
            weight = magnitude_prune(weight, sparsity, block)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls.from_dense(weight, bias, format, **kwargs)

    def _set_format(self, fmt: SparseFormat) -> None:
        """Hold `fmt`'s tensors: values as parameters, indices as buffers."""
        if fmt.shape != (self.out_features, self.in_features):
            raise InsumShapeError(
                f"the weight has shape {fmt.shape}; this layer is ({self.out_features}, {self.in_features})"
            )
        for name in getattr(self, "_tensor_names", ()):
            delattr(self, name)
        self._format_cls = type(fmt)
        self._format_meta = {"nnz": fmt.nnz, "index_dtype": fmt.index_dtype, "params": dict(fmt.params)}
        names = []
        for name, tensor in fmt.tensors.items():
            if fmt._is_value(name):
                self.register_parameter(name, nn.Parameter(tensor.detach().clone()))
            else:
                self.register_buffer(name, tensor.detach().clone())
            names.append(name)
        self._tensor_names = tuple(names)

    # ------------------------------------------------------------------ use

    @property
    def weight(self) -> SparseFormat:
        """The weight as a format object over this layer's current tensors (not a copy)."""
        tensors = {name: getattr(self, name) for name in self._tensor_names}
        values = [t for n, t in tensors.items() if self._format_cls._is_value(self._format_cls, n)]
        anchor = values[0] if values else next(iter(tensors.values()))
        meta = self._format_meta
        return self._format_cls(
            (self.out_features, self.in_features),
            tensors,
            nnz=meta["nnz"],
            dtype=anchor.dtype,
            index_dtype=meta["index_dtype"],
            device=anchor.device,
            params=meta["params"],
        )

    @property
    def format(self) -> str:
        return self._format_cls.__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse_linear(x, self.weight, self.bias, backend=self.backend, precision=self.precision)

    def to_dense(self) -> torch.Tensor:
        """W as a dense (out_features x in_features) tensor."""
        return self.weight.to_dense()

    def extra_repr(self) -> str:
        fmt = self.weight
        params = ", ".join(f"{k}={v}" for k, v in fmt._describe().items())
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.format}, nnz={fmt.nnz}"
            + (f", {params}" if params else "")
        )

    # ------------------------------------------------------------------ state_dict

    def get_extra_state(self) -> dict[str, Any]:
        meta = self._format_meta
        return {
            "format": self._format_cls.name,
            "shape": [self.out_features, self.in_features],
            "nnz": meta["nnz"],
            "index_dtype": str(meta["index_dtype"]),
            "params": dict(meta["params"]),
            "tensors": list(self._tensor_names),
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        pass  # applied before the tensors are loaded, in _load_from_state_dict

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        state = state_dict.get(prefix + "_extra_state")
        if state is not None:
            shape = tuple(state["shape"])
            if shape != (self.out_features, self.in_features):
                error_msgs.append(
                    f"size mismatch for {prefix}: the saved weight is {shape}, this layer is "
                    f"({self.out_features}, {self.in_features})"
                )
                return
            self._adopt(state, state_dict, prefix)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _adopt(self, state: dict[str, Any], state_dict, prefix: str) -> None:
        """Take the saved format and tensor shapes; the values are copied in afterwards."""
        cls = format_class(state["format"])
        params = {p: getattr(self, p) for p in self._parameters if p != "bias"}
        anchor = next(iter(params.values()), None)
        device = anchor.device if anchor is not None else None
        dtype = anchor.dtype if anchor is not None else None
        keep: dict[str, torch.Tensor] = {}
        for name in self._tensor_names:
            keep[name] = getattr(self, name)
        for name in self._tensor_names:
            delattr(self, name)
        for name in state["tensors"]:
            saved = state_dict.get(prefix + name)
            if saved is None:
                continue  # reported as a missing key by the default loader
            old = keep.get(name)
            if old is not None and old.shape == saved.shape and old.dtype == saved.dtype:
                tensor = old
            elif cls._is_value(cls, name):
                tensor = torch.empty(saved.shape, dtype=dtype or saved.dtype, device=device)
            else:
                tensor = torch.empty(saved.shape, dtype=saved.dtype, device=device)
            if cls._is_value(cls, name):
                self.register_parameter(name, tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)
        self._tensor_names = tuple(n for n in state["tensors"] if prefix + n in state_dict)
        self._format_cls = cls
        self._format_meta = {
            "nnz": int(state["nnz"]),
            "index_dtype": _DTYPES[state["index_dtype"]],
            "params": dict(state["params"]),
        }
