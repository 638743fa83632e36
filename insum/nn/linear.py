"""insum.nn.linear: a linear layer whose weight lives in a sparse format.

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
from typing import Any

import torch
from torch import nn

from ..api import insum
from ..autograd import derive
from ..errors import InsumError, InsumShapeError
from ..formats.auto import auto
from ..formats.base import SparseFormat, format_class

__all__ = ["SparseLinear", "sparse_linear", "magnitude_prune"]

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


# --------------------------------------------------------------------------- SparseLinear's kernels
#
# The derived gradient of x, dB[AK[p,q], n] += AV[p,q] * dC[AM[p], n], scatters every
# stored slot into x's gradient: one atomic per slot and column of x, g times the
# forward's (g slots share one scatter there). A layer knows its pattern in advance, so
# it keeps the transposed pattern (slots grouped by column, padded with a zero slot) and
# runs the input gradient as the transpose's own SpMM, shaped like the forward. Vector-wise
# N:M instead keeps, per row block, the slot of every column (a zero slot where it keeps
# none): the input gradient is then a dense-shaped tl.dot with no scatter at all.

_GRAD_X = {
    "scalar": "DX[TM[p], n] += WT[TS[p, q]] * DY[TR[p, q], n]",
    "block": "DX[TM[p], k, n] += WT[TS[p, q], m, k] * DY[TR[p, q], m, n]",
    # one group per column (for ELL and Block-ELL, whose forward has one group per row)
    "scalar_row": "DX[c, n] += WT[TS[c, q]] * DY[TR[c, q], n]",
    "block_row": "DX[c, k, n] += WT[TS[c, q], m, k] * DY[TR[c, q], m, n]",
    "nm": "DX[k, n] += WT[IU[rb, k], l] * DY[rb, l, n]",
}


def _group_size(counts: torch.Tensor) -> int:
    """sqrt(slots per non-empty column) as a power of two, capped at the longest column."""
    total, nonempty, longest = torch.stack([counts.sum(), (counts > 0).sum(), counts.max()]).tolist()
    if nonempty == 0:
        return 1
    g = 1 << max(0, round(math.log2(max(math.sqrt(total / nonempty), 1.0))))
    return max(1, min(g, 1 << (int(longest) - 1).bit_length()))


def _transpose_slots(
    rows: torch.Tensor, cols: torch.Tensor, n_cols: int, itype: torch.dtype, by_column: bool = False
) -> dict[str, torch.Tensor]:
    """Slots (row, col) grouped by column: TM[G] column, TS[G, g] slot, TR[G, g] row.

    by_column: one group per column (G = n_cols, g = the longest column, no TM).
    Padded entries point at slot S (one past the last: the zero slot) and row 0.
    """
    rows, cols = rows.reshape(-1).long(), cols.reshape(-1).long()
    S = rows.numel()
    device = rows.device
    order = torch.argsort(cols * (int(rows.max()) + 1 if S else 1) + rows, stable=True)
    sorted_cols = cols[order]
    counts = torch.bincount(sorted_cols, minlength=n_cols)
    if by_column:
        g = max(int(counts.max()) if S else 1, 1)
    else:
        g = _group_size(counts) if S else 1
    groups_per_col = (counts + g - 1) // g if not by_column else torch.ones_like(counts)
    group_start = torch.cumsum(groups_per_col, 0) - groups_per_col
    col_start = torch.cumsum(counts, 0) - counts
    within = torch.arange(S, device=device) - col_start[sorted_cols]
    group = group_start[sorted_cols] + within // g
    slot = within % g
    G = int(groups_per_col.sum())
    TM = torch.repeat_interleave(torch.arange(n_cols, device=device), groups_per_col)
    TS = torch.full((G, g), S, dtype=torch.int64, device=device)
    TS[group, slot] = order
    TR = torch.zeros((G, g), dtype=torch.int64, device=device)
    TR[group, slot] = rows[order]
    if by_column:
        return {"TS": TS.to(itype), "TR": TR.to(itype)}
    return {"TM": TM.to(itype), "TS": TS.to(itype), "TR": TR.to(itype)}


def _linear_plan(fmt: SparseFormat) -> tuple[str, dict[str, torch.Tensor]] | None:
    """(kind, index tensors) of the input gradient's statement, or None (use the derived one)."""
    t, name = fmt.tensors, fmt.name
    itype = torch.int64 if fmt.index_dtype == torch.int64 else torch.int32
    M, K = fmt.shape
    if name == "coo":
        return "scalar", _transpose_slots(t["AM"], t["AK"], K, itype)
    if name == "groupcoo":
        rows = t["AM"].unsqueeze(1).expand_as(t["AK"])
        return "scalar", _transpose_slots(rows, t["AK"], K, itype)
    if name == "ell":
        rows = torch.arange(t["AK"].shape[0], device=t["AK"].device).unsqueeze(1).expand_as(t["AK"])
        return "scalar_row", _transpose_slots(rows, t["AK"], K, itype, by_column=True)
    if name == "blockgroupcoo":
        bk = t["AV"].shape[3]
        AM = t.get("AM")  # absent when each block row is one group (group_size="row")
        by_column = AM is None
        if by_column:
            AM = torch.arange(t["AK"].shape[0], device=t["AK"].device)
        rows = AM.unsqueeze(1).expand_as(t["AK"])
        plan = _transpose_slots(rows, t["AK"], -(-K // bk), itype, by_column=by_column)
        return ("block_row" if by_column else "block"), plan
    if name == "nm":
        AK = t["AK"].long()
        RB, U = AK.shape
        if U > 1 and bool((AK[:, 1:] == AK[:, :-1]).any()):
            return None  # clamped padding columns repeat an index: one slot per column fails
        IU = torch.full((RB, K), RB * U, dtype=torch.int64, device=AK.device)
        IU.scatter_(1, AK, torch.arange(RB * U, device=AK.device).view(RB, U))
        return "nm", {"IU": IU.to(itype)}
    return None


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


class _SparseLinearFunction(torch.autograd.Function):
    """y = x W^T for a planned format: the forward SpMM, the derived value gradients,
    and the input gradient through the transposed pattern."""

    @staticmethod
    def forward(ctx, layer_info, x2, *tensors):
        fmt_cls, shape, meta, names, kind, plan_names, value_grads, backend, precision = layer_info
        fmt_tensors = dict(zip(names, tensors[: len(names)]))
        fmt = _format(fmt_cls, shape, meta, fmt_tensors)
        ctx.layer_info = layer_info
        ctx.save_for_backward(x2, *tensors)
        return fmt.spmm(x2.t(), backend=backend, precision=precision).t()

    @staticmethod
    def backward(ctx, dy):
        fmt_cls, shape, meta, names, kind, plan_names, value_grads, backend, precision = ctx.layer_info
        x2, *tensors = ctx.saved_tensors
        fmt_tensors = dict(zip(names, tensors[: len(names)]))
        plan = dict(zip(plan_names, tensors[len(names):]))
        fmt = _format(fmt_cls, shape, meta, fmt_tensors)
        needs = ctx.needs_input_grad
        dyt = dy.t()
        dx = None
        if needs[1]:
            dx = _grad_x(fmt, kind, plan, dyt, backend, precision).t().to(x2.dtype)
        grads = []
        for i, name in enumerate(names):
            if needs[2 + i] and name in value_grads:
                grads.append(_grad_values(fmt, value_grads[name], name, x2, dyt, backend, precision))
            else:
                grads.append(None)
        return (None, dx, *grads, *([None] * len(plan_names)))


def _format_class(format: str) -> type[SparseFormat]:
    """The format class by name; "auto" prunes like the unstructured formats (GroupCOO)."""
    return format_class("GroupCOO" if format.lower() == "auto" else format)


def _pack(format: str, weight: torch.Tensor, params: dict[str, Any]) -> SparseFormat:
    """Pack `weight` in `format`; "auto" asks `formats.auto` (params: n_cols, measure)."""
    if format.lower() == "auto":
        return auto(weight, **params)
    return format_class(format).from_dense(weight, **params)


def _format(fmt_cls, shape, meta, tensors) -> SparseFormat:
    """A format object over `tensors` (dtype and device from its values)."""
    values = [t for n, t in tensors.items() if fmt_cls._is_value(fmt_cls, n)]
    anchor = values[0] if values else next(iter(tensors.values()))
    fmt = fmt_cls(
        shape,
        tensors,
        nnz=meta["nnz"],
        dtype=anchor.dtype,
        index_dtype=meta["index_dtype"],
        device=anchor.device,
        params=meta["params"],
    )
    if meta["expression"] != fmt_cls.expression:  # a variant's statement (Block-ELL rows)
        fmt.expression = meta["expression"]
    return fmt


def _grad_x(fmt, kind, plan, dyt, backend, precision) -> torch.Tensor:
    """x's gradient, transposed (in_features x batch), from the transposed pattern."""
    M, K = fmt.shape
    AV = fmt.tensors["AV"]
    dtype = torch.promote_types(AV.dtype, dyt.dtype)
    AV, dyt = AV.to(dtype), dyt.to(dtype)
    N = dyt.shape[1]
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    if kind == "scalar":
        WT = torch.cat([AV.reshape(-1), AV.new_zeros(1)])
        DX = torch.zeros(K, N, dtype=acc, device=dyt.device)
        return insum(_GRAD_X[kind], DX=DX, WT=WT, DY=dyt, backend=backend, precision=precision, **plan)
    if kind == "scalar_row":  # every output row has one owner: allocated, no atomics
        WT = torch.cat([AV.reshape(-1), AV.new_zeros(1)])
        return insum(_GRAD_X[kind], WT=WT, DY=dyt, backend=backend, precision=precision, **plan)
    if kind == "block_row":
        _, _, bm, bk = AV.shape
        Mp, Kp = -(-M // bm) * bm, -(-K // bk) * bk
        WT = torch.cat([AV.reshape(-1, bm, bk), AV.new_zeros(1, bm, bk)])
        DY = _padded_rows(dyt, Mp).reshape(Mp // bm, bm, N)
        DX = insum(_GRAD_X[kind], WT=WT, DY=DY, backend=backend, precision=precision, **plan)
        return DX.reshape(Kp, N)[:K]
    if kind == "block":
        _, _, bm, bk = AV.shape
        Mp, Kp = -(-M // bm) * bm, -(-K // bk) * bk
        WT = torch.cat([AV.reshape(-1, bm, bk), AV.new_zeros(1, bm, bk)])
        DY = _padded_rows(dyt, Mp).reshape(Mp // bm, bm, N)
        DX = torch.zeros(Kp // bk, bk, N, dtype=acc, device=dyt.device)
        insum(_GRAD_X[kind], DX=DX, WT=WT, DY=DY, backend=backend, precision=precision, **plan)
        return DX.view(Kp, N)[:K]
    RB, L, U = AV.shape  # nm
    WT = torch.cat([AV.transpose(1, 2).reshape(RB * U, L), AV.new_zeros(1, L)])
    DY = _padded_rows(dyt, RB * L).reshape(RB, L, N)
    return insum(_GRAD_X[kind], WT=WT, DY=DY, backend=backend, precision=precision, **plan)


def _value_grads(fmt: SparseFormat) -> dict[str, tuple[str, tuple[str, ...], str]] | None:
    """value tensor -> (derived gradient statement, the tensors it reads, dC's name there)."""
    derivation = derive(fmt.expression)
    grads = {}
    for name, statements in derivation.gradients.items():
        if name == "B":
            continue
        if len(statements) != 1:
            return None
        (stmt,) = statements
        grads[name] = (str(stmt), derivation.inputs[stmt], derivation.output_grad)
    return grads


def _grad_values(fmt, grad, name, x2, dyt, backend, precision) -> torch.Tensor:
    """A value tensor's gradient: its derived statement on the format's views of x and dy."""
    stmt, reads, output_grad = grad
    M, K = fmt.shape
    value = fmt.tensors[name]
    dtype = torch.promote_types(value.dtype, x2.dtype)
    B, dC = x2.t().to(dtype), dyt.to(dtype)
    N = B.shape[1]
    if fmt.name == "blockgroupcoo":
        _, _, bm, bk = value.shape
        Mp, Kp = -(-M // bm) * bm, -(-K // bk) * bk
        B = _padded_rows(B, Kp).reshape(Kp // bk, bk, N)
        dC = _padded_rows(dC, Mp).reshape(Mp // bm, bm, N)
    elif fmt.name == "nm":
        RB, L, _ = value.shape
        dC = _padded_rows(dC, RB * L).reshape(RB, L, N)
    env = {**fmt.tensors, "B": B, output_grad: dC}
    inputs = {n: env[n] for n in reads}
    return insum(stmt, backend=backend, precision=precision, **inputs).to(value.dtype)


class SparseLinear(nn.Module):
    """y = x @ W^T + b with W (out_features x in_features) held in a sparse format.

    format: a format name ("GroupCOO", "BlockGroupCOO", "ELL", "COO", "NM", "CELL"), or
    "auto" for the format `insum.formats.auto` expects fastest (format_params: n_cols, the
    batch size it assumes, default 128; measure);
    format_params go to its packer (block=(32, 32), n=2, m=4, vector_len=16, ...).
    A new layer draws W as nn.Linear does, then prunes it by magnitude to `sparsity`
    (whole blocks for BlockGroupCOO; NM prunes to its own n:m pattern). Build one from a
    given weight with `from_dense` or from an nn.Linear with `from_linear`.
    backend, precision: as for `insum()`.
    transposed_backward: compute x's gradient with the transposed pattern (kept as
    non-persistent buffers; COO, GroupCOO, ELL, BlockGroupCOO, NM) instead of the derived
    scatter statement; False (and CELL) uses the derived gradients throughout.

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
        transposed_backward: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **format_params: Any,
    ):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.backend, self.precision = backend, precision
        self.transposed_backward = transposed_backward
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # as nn.Linear
        cls = _format_class(format)
        if sparsity and cls.name != "nm":
            block = format_params.get("block", (16, 16)) if cls.name == "blockgroupcoo" else None
            weight = magnitude_prune(weight, sparsity, block)
        elif sparsity and cls.name == "nm":
            raise InsumError("NM prunes to its own n:m pattern; pass n=, m= instead of sparsity=")
        self._set_format(_pack(format, weight, format_params))
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
        transposed_backward: bool = True,
        **format_params: Any,
    ) -> SparseLinear:
        """A layer holding `weight` (out x in; its zeros are the pattern, NM prunes) and `bias`."""
        if weight.dim() != 2:
            raise InsumShapeError(f"weight must be (out_features, in_features), got {tuple(weight.shape)}")
        fmt = _pack(format, weight.detach(), format_params)
        return cls.from_format(
            fmt, bias, backend=backend, precision=precision, transposed_backward=transposed_backward
        )

    @classmethod
    def from_format(
        cls,
        weight: SparseFormat,
        bias: torch.Tensor | None = None,
        *,
        backend: str = "auto",
        precision: str = "tf32",
        transposed_backward: bool = True,
    ) -> SparseLinear:
        """A layer holding an already packed weight (out x in) and an optional bias."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight.shape
        layer.backend, layer.precision = backend, precision
        layer.transposed_backward = transposed_backward
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
            block = kwargs.get("block", (16, 16)) if _format_class(format).name == "blockgroupcoo" else None
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
        self._format_meta = {
            "nnz": fmt.nnz,
            "index_dtype": fmt.index_dtype,
            "params": dict(fmt.params),
            "expression": fmt.expression,
        }
        names = []
        for name, tensor in fmt.tensors.items():
            if fmt._is_value(name):
                self.register_parameter(name, nn.Parameter(tensor.detach().clone()))
            else:
                self.register_buffer(name, tensor.detach().clone())
            names.append(name)
        self._tensor_names = tuple(names)
        self._make_plan()

    def _make_plan(self) -> None:
        """(Re)build the transposed pattern from the current index tensors."""
        for name in getattr(self, "_plan_names", ()):
            delattr(self, name)
        plan = _linear_plan(self.weight)
        self._value_grads = _value_grads(self.weight) if plan is not None else None
        if self._value_grads is None:
            plan = None
        self._plan_kind = None if plan is None else plan[0]
        self._plan_names = ()
        if plan is not None:
            for name, tensor in plan[1].items():
                self.register_buffer("grad_" + name, tensor, persistent=False)
            self._plan_names = tuple("grad_" + name for name in plan[1])

    # ------------------------------------------------------------------ use

    @property
    def weight(self) -> SparseFormat:
        """The weight as a format object over this layer's current tensors (not a copy)."""
        tensors = {name: getattr(self, name) for name in self._tensor_names}
        return _format(self._format_cls, (self.out_features, self.in_features), self._format_meta, tensors)

    @property
    def format(self) -> str:
        return self._format_cls.__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._plan_kind is None or not self.transposed_backward:
            return sparse_linear(x, self.weight, self.bias, backend=self.backend, precision=self.precision)
        if x.shape[-1] != self.in_features:
            raise InsumShapeError(
                f"SparseLinear: x has {x.shape[-1]} features (shape {tuple(x.shape)}) but the "
                f"layer has {self.in_features} in_features"
            )
        info = (
            self._format_cls,
            (self.out_features, self.in_features),
            self._format_meta,
            self._tensor_names,
            self._plan_kind,
            tuple(n[len("grad_"):] for n in self._plan_names),
            self._value_grads,
            self.backend,
            self.precision,
        )
        tensors = [getattr(self, n) for n in self._tensor_names + self._plan_names]
        y = _SparseLinearFunction.apply(info, x.reshape(-1, self.in_features), *tensors)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

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
            "expression": meta["expression"],
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
        if not error_msgs:
            self._make_plan()  # the loaded indices: a new transposed pattern

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
            "expression": state.get("expression", cls.expression),
        }
