"""insum.nn.linear: a linear layer whose weight lives in a sparse format.

    >>> import torch
    >>> from insum.nn import SparseLinear
    >>> layer = SparseLinear(8, 4, format="GroupCOO", sparsity=0.5)
    >>> layer(torch.randn(3, 8)).shape
    torch.Size([3, 4])

`SparseLinear` computes y = x @ W^T + b as the format's SpMM, W @ x^T, one insum
statement (or one per bucket for CELL). The format's value tensors are parameters, its
index tensors buffers, so `.to()`, `.half()`, optimizers and `state_dict` see them; the
pattern itself never changes in training. The pattern is the weight's nonzeros when the
layer is built (or its state loaded), each position trained once: padding slots (an empty
row's, which point at column 0; a group's tail, which repeats a stored position) and repeated
positions get zero gradients (`frozen_slots`, kept as non-persistent `frozen_<name>` buffers
where a value tensor has any), so padding stays zero and a step moves every weight entry as
a dense layer's masked step would. Where the format declares its padding (Block-ELL's
`declared_lengths`) the products skip it as well.
`insum.nn.functional.sparse_linear(x, fmt, bias)` is the functional form: it differentiates
every slot of the format it is given, padding included (the derivative of its product).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..arith import cdiv
from ..bind import tensor_version
from ..dtypes import INDEX_DTYPES, VALUE_DTYPES
from ..errors import InsumError, InsumIndexError, InsumShapeError
from ..formats.auto import packer, pruning_block
from ..formats.base import SparseFormat, aligned_rows, format_class
from ..formats.coords import check_block
from .sparse_autograd import (
    KeptLinear,
    apply_kept,
    apply_linear,
    apply_sparse_linear,
    format_meta,
    frozen_slots,
    gradient_statements,
    linear_info,
    linear_product,
    rebuild_format,
)

__all__ = ["SparseLinear", "sparse_linear", "magnitude_prune"]

#: A saved state's dtype (written as str(dtype)) back to the dtype.
_DTYPES = {str(d): d for d in (*INDEX_DTYPES, *VALUE_DTYPES)}


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
    and W. Differentiable with respect to x, the weight's value tensors and the bias (x's
    gradient by the derived scatter; a SparseLinear keeps the transposed pattern instead).
    """
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise InsumShapeError(
            f"sparse_linear: x has {x.shape[-1]} features (shape {tuple(x.shape)}) but the "
            f"weight has shape ({out_features}, {in_features})"
        )
    x2 = x.reshape(-1, in_features)
    # A bias of one value per output feature joins the product (its epilogue, where the format
    # allows); any other broadcastable bias is added after it.
    joined = (
        bias is not None and tuple(bias.shape) == (out_features,) and bias.device == x.device
        and bias.dtype == torch.promote_types(x.dtype, weight.dtype)
    )
    y = apply_sparse_linear(x2, weight, format_meta(weight), {}, gradient_statements(weight), backend, precision,
                            bias if joined else None)
    if bias is not None and not joined:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)


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
    bm, bk = (1, 1) if block is None else check_block(block)
    MB, KB = cdiv(M, bm), cdiv(K, bk)
    padded = torch.nn.functional.pad(weight.double(), (0, KB * bk - K, 0, MB * bm - M))
    norms = padded.view(MB, bm, KB, bk).square().sum(dim=(1, 3)).flatten()
    keep = norms.numel() - int(round(sparsity * norms.numel()))
    mask = torch.zeros(norms.numel(), dtype=torch.bool, device=weight.device)
    if keep > 0:
        # Ties go to the lower index (a stable sort), so the result is deterministic.
        mask[torch.sort(norms, descending=True, stable=True).indices[:keep]] = True
    mask = mask.view(MB, 1, KB, 1).expand(MB, bm, KB, bk).reshape(MB * bm, KB * bk)[:M, :K]
    return weight * mask


def pruned(weight: torch.Tensor, format: str, sparsity: float, format_params: dict[str, Any]) -> torch.Tensor:
    """weight pruned by magnitude to `sparsity` at the format's granularity (its
    `pruning_block`: whole blocks for BlockGroupCOO; NM refuses, it prunes itself)."""
    if not sparsity:
        return weight
    return magnitude_prune(weight, sparsity, pruning_block(format, format_params))


def pruned_linear(
    linear: nn.Linear, format: str, sparsity: float, format_params: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An nn.Linear's (weight pruned for the format, bias), detached."""
    bias = None if linear.bias is None else linear.bias.detach()
    return pruned(linear.weight.detach(), format, sparsity, format_params), bias


def initial_weight(
    out_features: int, in_features: int, format: str, sparsity: float, format_params: dict[str, Any], device, dtype
) -> torch.Tensor:
    """A weight drawn as nn.Linear draws it, then pruned for the format (`pruned`)."""
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # as nn.Linear
    return pruned(weight, format, sparsity, format_params)


def initial_bias(out_features: int, in_features: int, device, dtype) -> torch.Tensor:
    """A bias drawn as nn.Linear draws it: uniform in +-1/sqrt(in_features)."""
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    return torch.empty(out_features, device=device, dtype=dtype).uniform_(-bound, bound)


#: The prefixes of a layer's plan buffers: the transposed pattern's, the value gradient's
#: tables', the frozen slots' masks' (`_plan_of`'s order).
_PLAN_PREFIXES = ("grad_", "wgrad_", "frozen_")


def _refuse_coarsening(format_params: Mapping[str, Any]) -> None:
    """A coarsened weight's explicit zero blocks would train like stored ones: refused from
    the packing parameters, before packing (`coarsen="tune"` chose by timing, so a layer was
    built or refused by the clock), and from a packed format's."""
    coarsen = format_params.get("coarsen", 1)
    if coarsen != 1:
        raise InsumError(
            f"a layer's weight cannot be coarsened (coarsen={coarsen!r}): its explicit zero blocks would be "
            "trained like stored ones; pack it with coarsen=1"
        )


def _saved_meta(state: dict[str, Any]) -> dict[str, Any]:
    """The format metadata (`format_meta`) that a saved weight's extra state records."""
    return {
        "nnz": int(state["nnz"]),
        "index_dtype": _DTYPES[state["index_dtype"]],
        "params": dict(state["params"]),
        "expression": state.get("expression", format_class(state["format"]).expression),
    }


def _plan_of(fmt: SparseFormat, gradients) -> tuple[dict, dict, dict]:
    """What a layer's backward runs on besides the format: its transposed pattern, the value
    gradient's tables and the frozen slots (host syncs: outside traced code)."""
    tables = fmt.value_gradient_tables()
    return fmt.transposed_pattern() or {}, tables, frozen_slots(fmt, gradients, tables)


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

    Outside torch.compile the layer keeps its format object (`weight`) and what its autograd
    Function is handed, from one forward to the next, so that a repeated product runs pinned
    to the format's tensors (`SparseFormat.spmm`) in the forward and the backward. Values
    updated in place (an optimizer's step) are read by the next call; assigning any
    attribute (a parameter or buffer replaced, `load_state_dict`, `backend = ...`) or
    `.to()` / `.half()` / `.cuda()` drops what is kept. Replacing a tensor's `.data` by hand
    with one of another dtype, shape or device is not seen: assign a new Parameter instead.
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
        _refuse_coarsening(format_params)
        weight = initial_weight(out_features, in_features, format, sparsity, format_params, device, dtype)
        self._set_format(packer(format)(weight, **format_params))
        if bias:
            self.bias = nn.Parameter(initial_bias(out_features, in_features, device, dtype))
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
        _refuse_coarsening(format_params)
        fmt = packer(format)(weight.detach(), **format_params)
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
        return cls.from_dense(*pruned_linear(linear, format, sparsity, kwargs), format, **kwargs)

    def _set_format(self, fmt: SparseFormat) -> None:
        """Hold `fmt`'s tensors: values as parameters, indices as buffers."""
        if fmt.shape != (self.out_features, self.in_features):
            raise InsumShapeError(
                f"the weight has shape {fmt.shape}; this layer is ({self.out_features}, {self.in_features})"
            )
        _refuse_coarsening(fmt.params)
        for name in getattr(self, "_tensor_names", ()):
            delattr(self, name)
        self._format_cls = type(fmt)
        self._format_meta = format_meta(fmt)
        names = []
        for name, tensor in fmt.packed_tensors.items():
            tensor = tensor.detach()
            if name in fmt.aligned_tensors:  # a copy in aligned rows (`clone` would pack them densely)
                tensor = aligned_rows(tensor.new_empty_strided(tensor.shape, tensor.stride()).copy_(tensor))
            else:
                tensor = tensor.clone()
            if fmt._is_value(name):
                self.register_parameter(name, nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)
            names.append(name)
        self._tensor_names = tuple(names)
        self._make_plan()

    def _make_plan(self) -> None:
        """(Re)build the transposed pattern, the value gradient's tables and the frozen slots
        from the current tensors (outside traced code: counting them may need a host sync),
        kept as non-persistent buffers."""
        self._drop_kept()
        for prefix, names in self._plan_buffers():
            for name in names:
                delattr(self, prefix + name)
        fmt = self._current_format()
        self._gradients = gradient_statements(fmt)
        plan = _plan_of(fmt, self._gradients)
        for prefix, part in zip(_PLAN_PREFIXES, plan):
            for name, tensor in part.items():
                self.register_buffer(prefix + name, tensor, persistent=False)
        self._pattern_names, self._table_names, self._frozen_names = (tuple(part) for part in plan)
        self._note_plan_source()
        self._drop_kept()

    def refresh_plan(self) -> bool:
        """Rebuild what the backward derives from the index tensors (transposed pattern,
        gradient tables, frozen slots, counted params) if they were edited in place since it
        was made; returns whether it did. An eager call does this itself. A layer under
        torch.compile runs its traced graph, which cannot see an in-place edit of a buffer:
        call this after editing the pattern in place (outside the compiled region; it may
        sync). Replacing a tensor (assignment, load_state_dict) needs no call."""
        if torch.compiler.is_compiling():
            raise InsumError("SparseLinear.refresh_plan() runs outside torch.compile (it may sync)")
        if self._plan_is_current():
            return False
        self._recount()
        self._make_plan()
        return True

    def _recount(self) -> None:
        """Count the format's counted params (`SparseFormat.counted_params`, e.g. Block-ELL's
        stored blocks) off the layer's current tensors, for a pattern assigned or edited in
        place (outside traced code: it may sync)."""
        counted = self._current_format().counted_params()
        if counted:
            self._format_meta = {**self._format_meta, "params": {**self._format_meta["params"], **counted}}

    def _note_plan_source(self) -> None:
        """Record the index tensors the plan is made from, and their versions."""
        self._plan_source = self._index_tensors()
        self._plan_versions = tuple(tensor_version(t) for t in self._plan_source)

    def _plan_is_current(self) -> bool:
        """Whether the index tensors the plan was made from are unedited since (their version
        counters; an inference tensor keeps none and is trusted)."""
        versions = self.__dict__.get("_plan_versions")
        if versions is None:
            return True
        return all(v is None or t._version == v for t, v in zip(self._plan_source, versions))

    def _plan_buffers(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return tuple(zip(_PLAN_PREFIXES, (getattr(self, "_pattern_names", ()), getattr(self, "_table_names", ()),
                                          getattr(self, "_frozen_names", ()))))

    def _index_tensors(self) -> tuple[torch.Tensor, ...]:
        """The format's index tensors as the layer holds them now (what its plan is built from)."""
        tensors = (getattr(self, name) for name in self._tensor_names)
        return tuple(t for t in tensors if not t.is_floating_point())

    # ------------------------------------------------------------------ the kept call

    def _drop_kept(self) -> None:
        """Forget the kept format object and call (`_kept_call`)."""
        self.__dict__.pop("_kept", None)

    def __setattr__(self, name: str, value: Any) -> None:
        self._drop_kept()  # (register_parameter / register_buffer callers drop it themselves)
        super().__setattr__(name, value)
        if name in self.__dict__.get("_tensor_names", ()) and not self.__dict__.get("_loading"):
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                self._recount()  # another pattern: the packing's counts describe the old one
            self._make_plan()  # a format tensor replaced: the plan follows it (another pattern, other values)

    def __delattr__(self, name: str) -> None:
        self._drop_kept()
        super().__delattr__(name)

    def _apply(self, fn, recurse: bool = True):
        # .to() / .half() / .cuda() swap the tensors' data under the same Parameter objects.
        # A move packs a tensor with aligned rows densely (`aligned_rows`): stored aligned again.
        self._drop_kept()
        try:
            return super()._apply(fn, recurse)
        finally:
            meta = getattr(self, "_format_meta", None)
            if meta is not None and not self._tensor_names:  # (no tensor carries the dtype and device)
                probe = fn(torch.empty(0, dtype=meta.get("dtype", torch.get_default_dtype()),
                                       device=meta.get("device", "cpu")))
                meta.update(dtype=probe.dtype, device=probe.device)
            for name in self._format_cls.aligned_tensors if hasattr(self, "_format_cls") else ():
                tensor = getattr(self, name)
                aligned = aligned_rows(tensor.data)
                if aligned is not tensor.data:
                    tensor.data = aligned
            if "_plan_source" in self.__dict__:  # (the plan's buffers moved alike)
                self._note_plan_source()
            self._drop_kept()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_kept", None)  # (a copy or pickle builds its own)
        return state

    def _kept_call(self) -> tuple[tuple, tuple[torch.Tensor, ...], KeptLinear | None]:
        """(the traced autograd Function's info, its tensors, the kept call or None) for the
        current tensors: built once and kept outside torch.compile, so that the format object,
        and with it its pinned plans, lives from one forward to the next; built anew for every
        trace (no kept call then)."""
        kept = None if torch.compiler.is_compiling() else self.__dict__.get("_kept")
        if kept is not None:
            info, tensors, held, call = kept
            # A tensor swapped in the module's dicts (torch.func.functional_call): built anew.
            if all(where.get(name) is t for where, name, t in held) and self._plan_is_current():
                return info, tensors, call
        planned = self.__dict__.get("_plan_source")  # (None: a layer pickled before it was kept)
        source = self._index_tensors()
        same = planned is not None and len(source) == len(planned) and all(a is b for a, b in zip(source, planned))
        if same and not torch.compiler.is_compiling():
            self.refresh_plan()  # the pattern edited in place (`layer.AK.copy_(...)`): its plan again
        meta = self._format_meta
        fmt = self._current_format()
        if not (planned is None or same):
            # Index tensors swapped in (torch.func.functional_call): the packing's counts are
            # another pattern's (traced, counting them breaks the graph, as the plan below does).
            meta = {**meta, "params": {**meta["params"], **fmt.counted_params()}}
            fmt = self._current_format(meta)
        if planned is None or same:
            pattern, tables, frozen = ({name: getattr(self, prefix + name) for name in names}
                                       for prefix, names in self._plan_buffers())
        else:
            # Index tensors swapped in (torch.func.functional_call): a plan of their own, for this
            # call only (its host syncs each time; traced, they break the graph).
            pattern, tables, frozen = _plan_of(fmt, self._gradients)
        if not self.transposed_backward:
            pattern = {}
        info = linear_info(fmt, meta, pattern, self._gradients, self.backend, self.precision, tables, frozen)
        tensors = (*fmt._tensors.values(), *pattern.values(), *tables.values(), *frozen.values())
        call = None
        if not torch.compiler.is_compiling():
            call = KeptLinear(fmt, pattern, self._gradients, self.backend, self.precision, tables, frozen)
            held = []
            kept = (*fmt._tensors.items(), *((prefix + n, t) for prefix, part in zip(_PLAN_PREFIXES, (pattern, tables, frozen))
                                             for n, t in part.items()))
            for name, t in kept:
                held.append((self._parameters if name in self._parameters else self._buffers, name, t))
            self.__dict__["_kept"] = (info, tensors, tuple(held), call)  # (not through __setattr__, which drops it)
        return info, tensors, call

    def _current_format(self, meta: dict[str, Any] | None = None) -> SparseFormat:
        tensors = {name: getattr(self, name) for name in self._tensor_names}
        return rebuild_format(self._format_cls, (self.out_features, self.in_features), meta or self._format_meta,
                              tensors)

    # ------------------------------------------------------------------ use

    @property
    def weight(self) -> SparseFormat:
        """The weight as a format object over this layer's current tensors (not a copy): the
        one the forward runs on, kept across calls outside torch.compile."""
        if torch.compiler.is_compiling():
            return self._current_format()
        return self._kept_call()[2].fmt

    @property
    def format(self) -> str:
        return self._format_cls.__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise InsumShapeError(
                f"SparseLinear: x has {x.shape[-1]} features (shape {tuple(x.shape)}) but the "
                f"layer has {self.in_features} in_features"
            )
        info, tensors, call = self._kept_call()
        # (a reshape that changes nothing still adds an autograd node, run on every backward)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if call is None:
            y = apply_linear(info, x2, tensors, self.bias)
        elif not torch.is_grad_enabled():
            # No gradient to record (inference): the product straight, without the autograd
            # Function's own host time.
            y = linear_product(call.fmt, x2, self.bias, self.backend, self.precision)
        else:
            y = apply_kept(call, x2, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def to_dense(self) -> torch.Tensor:
        """W as a dense (out_features x in_features) tensor."""
        return self.weight.to_dense()

    def extra_repr(self) -> str:
        fmt = self.weight
        params = fmt.describe()
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
            absent = [name for name in state["tensors"] if prefix + name not in state_dict]
            if absent:  # a format is loaded whole or not at all (its tensors describe one pattern)
                error_msgs.append(
                    f"missing tensors {', '.join(prefix + n for n in absent)} of the saved weight of {prefix or 'the layer'}: "
                    "its format cannot be loaded in part; the layer keeps its weight"
                )
                return
        bad = self._index_error(state, state_dict, prefix)
        if bad is not None:  # (before any tensor is taken: the layer keeps its weight)
            error_msgs.append(f"the saved weight of {prefix or 'the layer'} {bad}; the layer keeps its weight")
            return
        if state is not None:
            self._adopt(state, state_dict, prefix)
        self._loading = True  # (assign=True sets the tensors one by one: the plan is made once, after)
        try:
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
            )
        finally:
            del self._loading
        if not error_msgs:
            self._make_plan()  # the loaded indices: a new transposed pattern
        self._drop_kept()

    def _index_error(self, state: dict[str, Any] | None, state_dict, prefix: str) -> str | None:
        """What is wrong with the index tensors a state_dict would load (a value outside what
        it indexes: `SparseFormat.check_indices`), or None."""
        names = state["tensors"] if state is not None else self._tensor_names
        tensors = {name: state_dict.get(prefix + name, getattr(self, name, None)) for name in names}
        if any(not isinstance(t, torch.Tensor) for t in tensors.values()):
            return None  # (reported by the default loader)
        if state is None:
            cls, meta = self._format_cls, self._format_meta
        else:
            cls, meta = format_class(state["format"]), _saved_meta(state)
        try:
            rebuild_format(cls, (self.out_features, self.in_features), meta, tensors).check_indices()
        except InsumIndexError as e:
            return f"holds an index out of range: {e}"
        return None

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
            if name in cls.aligned_tensors and tensor is not old:
                tensor = aligned_rows(tensor)  # (the packer's layout; the values are copied in next)
            if cls._is_value(cls, name):
                self.register_parameter(name, tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)
        self._tensor_names = tuple(n for n in state["tensors"] if prefix + n in state_dict)
        # The values first, as a constructed layer registers them (an optimizer's saved state
        # follows the order of `parameters()`).
        order = sorted(self._parameters, key=lambda n: n not in self._tensor_names)
        reordered = {n: self._parameters[n] for n in order}
        self._parameters.clear()
        self._parameters.update(reordered)
        self._format_cls = cls
        old_meta = getattr(self, "_format_meta", {})
        self._format_meta = {**{k: old_meta[k] for k in ("dtype", "device") if k in old_meta}, **_saved_meta(state)}
