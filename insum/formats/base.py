"""The interface every sparse format shares: packing, inspection, and its computation.

A format turns a sparse matrix into plain dense index and value tensors plus the indirect
Einsum(s) that multiply it with a dense matrix, and owns everything around them: the views
its statements read B and write C through (`operand`, `output_shape`, `result`,
`output_view`), the transposed pattern its input gradient runs on (`transposed_pattern`,
`input_gradient`), its pruning granularity (`pruning_block`) and how far it pads rows
(`row_padding_slots`). Nothing outside `insum.formats` needs to know which format it holds.
`spmm` runs the statements through the public `insum()` (several as one `insum_many`), and
a repeated product through the same prepared launches pinned to the format's tensors.

The packers' helpers live beside it: `coords` (coordinates and checks), `grouping` (group
sizes, the accumulation rule, slot grouping), `tuning` (group_size and coarsen="tune"), `registry`.
Formats never import the code generator or the runtime, so packing, inspecting and
converting need neither Triton nor a GPU.

All packing is vectorised torch code on the input's device, never a Python loop over rows
or nonzeros. On a GPU its time is host syncs (anything whose size or value the host reads)
and kernel launches, so a packer works from the row pointer with `cumsum` / gathers, reads
every size it needs in ONE sync (`Coords.read`), and counts are kept in check by tests
(`opcount.count_ops`).

A little over 400 lines, as one module: it is the one class every format subclasses, and
its defaults (views, transposed pattern, SpMM) are written in terms of each other.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch.autograd import forward_ad

from ..api import insum, insum_many
from ..bind import PLAIN_TENSORS, bind, forward_mode_on, refuse_function_transforms, tangents_alone
from ..bounds import check_indices
from ..cache import BoundedCache
from ..dtypes import as_dtype
from ..errors import InsumError, InsumShapeError, InsumTypeError
from ..execute import PIN_TRIES, Pinned, length_facts, pin
from ..library import zeroed_past_lengths
from ..parser import parse
from .coords import (
    VALUE_DTYPES,
    Coords,
    check_positive_int,
    check_values,
    coords_of,
    index_dtype_for,
    normalise_device,
    value_dtype_of,
)
from .grouping import HALF_FAN_IN, accumulation_dtype, default_group_size
from .registry import FORMATS, format_class
from .transposed import scalar_gradient, transpose_slots

#: A transposing copy: X (N, K) into T (K, N) with contiguous rows (`SparseFormat.operand`).
TRANSPOSE = "T[k, n] = X[n, k]"

__all__ = [
    "FORMATS",
    "HALF_FAN_IN",
    "VALUE_DTYPES",
    "Coords",
    "SparseFormat",
    "accumulation_dtype",
    "aligned_rows",
    "check_positive_int",
    "coords_of",
    "default_group_size",
    "format_class",
    "index_dtype_for",
    "overwrite",
    "pad_rows",
]

#: Elements between row starts that Triton's specialisation recognises (a stride divisible by 16).
ROW_ALIGNMENT = 16


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it, whose rows (last dimension) start a multiple of ROW_ALIGNMENT
    elements apart: padded in memory, not in shape. Triton specialises an integer stride only
    on divisibility by 16 and vectorises a tile's loads only then; N:M's compressed rows are
    K * n / m wide, any width. H200, fp16, a 3000 x 5000 A by 2048 (`python -m
    benchmarks.explore.shapes --only strides`, session 16): 2:4 167.6 -> 72.4 us, 1:8 52.8 ->
    27.8 us. Rows narrower than ROW_ALIGNMENT, and tensors whose last dimension is not
    contiguous, are left as they are."""
    width = t.shape[-1] if t.dim() else 0
    if t.dim() < 2 or width < ROW_ALIGNMENT or t.stride(-1) != 1:
        return t
    if all(stride % ROW_ALIGNMENT == 0 for stride in t.stride()[:-1]):
        return t
    padded = -(-width // ROW_ALIGNMENT) * ROW_ALIGNMENT
    return t.new_empty(*t.shape[:-1], padded)[..., :width].copy_(t)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows appended up to `rows` (a blocked format's padded operand or output)."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def overwrite(expression: str) -> str:
    """The statement with `=` for `+=`: the output needs no zero fill (single-owner outputs
    are stored once; scattered ones are zeroed by the runtime only where it must).

    Plain string work, so that torch.compile traces it."""
    output, product = expression.split("+=", 1)
    return f"{output.rstrip()} = {product.lstrip()}"


class SparseFormat:
    """A sparse matrix packed as dense index/value tensors plus its SpMM statement.

    Adding a format is one module: a subclass sets `name` (the registry key) and
    `expression`, implements `_pack(coords, **params)`, lists its value tensors in
    `_value_names` (so that `padding_ratio` can count stored slots) and, where the
    defaults do not fit, overrides the computation hooks below: `statements()` (several
    statements), the views `operand` / `from_operand` / `output_shape` / `result` /
    `output_view` (blocked or padded operands), `fan_in`, `pruning_block`, and the
    transposed pattern (`_slot_rows()` for scalar slots AV/AK, which also gives
    `to_dense()`, or `transposed_pattern()` with `input_gradient()`).

    Attributes: shape (M, K); nnz (entries packed, explicit zeros included); dtype (of the
    values); index_dtype; device; params (the chosen parameters); each packed tensor is
    also an attribute (`fmt.AK`).
    """

    name: ClassVar[str] = ""
    expression: ClassVar[str] = ""
    _value_names: ClassVar[tuple[str, ...]] = ()
    #: Packed tensors kept with their rows ROW_ALIGNMENT elements apart (`aligned_rows`): by
    #: the packer, `to()` and `SparseLinear`'s moves.
    aligned_tensors: ClassVar[tuple[str, ...]] = ()
    #: Index tensors the packer keeps sorted (equal values adjacent): passed to `insum()`
    #: as `sorted_indices`, so a scatter through them is reduced per segment in registers.
    sorted_indices: ClassVar[frozenset[str]] = frozenset()
    #: Index tensors the packer keeps free of duplicate values (one group per output row):
    #: passed as `unique_indices`, so a scatter through them stores without atomics.
    unique_indices: ClassVar[frozenset[str]] = frozenset()
    #: Packed tensors that the statement does not read but is told about (`declared_lengths`).
    _declared_names: ClassVar[frozenset[str]] = frozenset()
    #: Why `formats.auto` chose this format and these parameters (None: not chosen by it).
    chosen_because: str | None = None

    def __init__(
        self,
        shape: tuple[int, int],
        tensors: Mapping[str, torch.Tensor],
        *,
        nnz: int,
        dtype: torch.dtype,
        index_dtype: torch.dtype,
        device: torch.device,
        params: Mapping[str, Any] | None = None,
    ):
        fields = dict(
            shape=(int(shape[0]), int(shape[1])),
            _tensors=dict(tensors),
            nnz=int(nnz),
            dtype=dtype,  # of the values
            index_dtype=index_dtype,
            device=normalise_device(device),
            params=dict(params or {}),
        )
        for name, value in fields.items():  # not through __setattr__: nothing to drop yet
            object.__setattr__(self, name, value)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            FORMATS[cls.name.lower()] = cls

    # ----------------------------------------------------------------- construction

    @classmethod
    def _packed(
        cls,
        coords: Coords,
        tensors: Mapping[str, torch.Tensor],
        index_dtype: torch.dtype,
        params: Mapping[str, Any] | None = None,
    ) -> SparseFormat:
        """The format holding `tensors` packed from `coords` (shape, nnz, dtype, device)."""
        return cls(
            coords.shape,
            tensors,
            nnz=coords.nnz,
            dtype=coords.dtype,
            index_dtype=index_dtype,
            device=coords.device,
            params=params,
        )

    @classmethod
    def from_dense(cls, A: torch.Tensor, **params: Any) -> SparseFormat:
        """Pack the nonzeros of a dense matrix (on its own device)."""
        if isinstance(A, torch.Tensor) and A.layout != torch.strided:
            raise InsumTypeError(
                f"from_dense expects a dense tensor, got layout {A.layout}; use from_torch"
            )
        cls._check_params(params)
        return cls._pack(coords_of(A), **params)

    @classmethod
    def from_torch(cls, t: torch.Tensor, **params: Any) -> SparseFormat:
        """Pack a torch sparse matrix (COO, CSR, CSC, BSR or BSC layout)."""
        if not isinstance(t, torch.Tensor) or t.layout == torch.strided:
            got = t.layout if isinstance(t, torch.Tensor) else type(t).__name__
            raise InsumTypeError(
                f"from_torch expects a torch sparse tensor, got {got}; use from_dense"
            )
        cls._check_params(params)
        return cls._pack(coords_of(t), **params)

    @classmethod
    def _check_params(cls, params: Mapping[str, Any]) -> None:
        """Reject a misspelt parameter by name, listing the valid ones."""
        valid = [p for p in inspect.signature(cls._pack).parameters if p not in ("coords", "cls")]
        unknown = [p for p in params if p not in valid]
        if unknown:
            raise InsumError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))} for {cls.__name__}; "
                f"valid: {', '.join(valid)}"
            )

    @classmethod
    def _pack(cls, coords: Coords, **params: Any) -> SparseFormat:
        raise NotImplementedError

    # ----------------------------------------------------------------- inspection

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The packed tensors the SpMM statement reads, by its names (`insum(fmt.expression,
        C=C, B=B, **fmt.tensors)`)."""
        return {k: v for k, v in self._tensors.items() if k not in self._declared_names}

    @property
    def packed_tensors(self) -> dict[str, torch.Tensor]:
        """Every packed tensor: the statement's and those it is given as facts (Block-ELL's
        block counts, AL): what rebuilds the format (`SparseLinear` holds them all)."""
        return dict(self._tensors)

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("_tensors")
        if tensors is not None and name in tensors:
            return tensors[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        """A packed tensor cannot be replaced (`fmt.AV = ...`): the products' plans are pinned
        to the packed tensors (their signatures checked once, `insum.execute.Pinned`). Values
        may change in place (`fmt.AV.copy_(...)`, a layer's weights). Index tensors carry the
        packing's invariants (a sorted row index, the covering layout, declared lengths), which
        the products rely on unchecked: another pattern is a new format. Any other assignment
        (`expression`, `params`, `to()`'s tensors) drops the plans and what was derived from
        the tensors (`_derived`)."""
        tensors = self.__dict__.get("_tensors")
        if tensors is not None and name in tensors:
            how = (f"update its values in place ({name}.copy_(...)) or pack a new {type(self).__name__}"
                   if tensors[name].is_floating_point() else
                   f"it is an index tensor, whose packing's invariants (sorted rows, covering blocks) the "
                   f"products rely on: pack a new {type(self).__name__} for another pattern")
            raise InsumError(f"{type(self).__name__}.{name} is a packed tensor and cannot be replaced: {how}")
        # (the SpMM plans, the gradients' pinned calls of `formats.repeat`, and what a format
        # works out from its tensors once)
        for built in self._BUILT:
            self.__dict__.pop(built, None)
        object.__setattr__(self, name, value)

    #: What a format builds from its tensors on use, dropped by an assignment and by a copy.
    _BUILT = ("_spmm_plans", "_repeated", "_derived")

    def __getstate__(self) -> dict[str, Any]:
        """Pickle, `torch.save`, copy and deepcopy take the format without what its products
        built (plans hold kernel launchers, and views pinned to these very tensors); a copy
        builds its own on its first product."""
        return {k: v for k, v in self.__dict__.items() if k not in self._BUILT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)  # (not through __setattr__, which refuses packed tensors)
        # A file read back (torch.load, pickle) may hold any index values: the products run
        # without an index check, so a value out of range would read or write out of bounds.
        self.check_indices()

    def __copy__(self) -> SparseFormat:
        """A copy in this process (its tensors are this packing's: not checked again)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__getstate__())
        return twin

    def __deepcopy__(self, memo: dict) -> SparseFormat:
        twin = object.__new__(type(self))
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(self.__getstate__(), memo))
        return twin

    def check_indices(self) -> None:
        """Raise `InsumIndexError`, naming the tensor, where an index tensor holds a value
        outside what it indexes in the format's statements (B's rows, C's rows, a declared
        length below 0). Packing never makes one; a format read back from a file, or whose
        index tensors were edited, may hold one. Syncs once per index tensor; tensors without
        values (meta, traced) are not checked."""
        indices = [t for t in self._tensors.values() if not t.is_floating_point()]
        if not indices or any(type(t) not in PLAIN_TENSORS or t.is_meta for t in indices):
            return
        B = torch.empty(self.shape[1], 1, dtype=self.dtype, device=self.device)
        C = torch.empty(self.output_shape(1), dtype=self.dtype, device=self.device)
        lengths = self.declared_lengths()
        for expression, tensors in self.statements():
            bound = bind(parse(expression), {**tensors, "B": self.operand(B), "C": C})
            if lengths is not None:
                bound, _ = length_facts(bound, lengths)
            check_indices(bound, C, device_check=True, on_host=True)  # (an InsumIndexError on CUDA too)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed tensors (indices, values and padding)."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def stored_values(self) -> int:
        """Value slots stored, padding included."""
        return sum(t.numel() for n, t in self._tensors.items() if self._is_value(n))

    @property
    def padding_ratio(self) -> float:
        """Fraction of stored value slots that are padding (0.0 when nothing is stored)."""
        slots = self.stored_values
        return 0.0 if slots == 0 else 1.0 - self.nnz / slots

    def _describe(self) -> dict[str, Any]:
        """Parameters shown by repr; subclasses add their own."""
        return dict(self.params)

    def describe(self) -> str:
        """The chosen parameters as `name=value, ...` (what repr shows), and why when
        `formats.auto` chose them."""
        params = self._params_text()
        if self.chosen_because:
            return f"{params}; {self.chosen_because}" if params else self.chosen_because
        return params

    def _params_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self._describe().items())

    def __repr__(self) -> str:
        params = self._params_text()
        return (
            f"{type(self).__name__}(shape={self.shape}, nnz={self.nnz}"
            + (f", {params}" if params else "")
            + f", padding={self.padding_ratio:.1%}, dtype={self.dtype}, "
            f"index_dtype={self.index_dtype}, device={self.device})"
        )

    def to(self, device: torch.device | str) -> SparseFormat:
        """A copy with every tensor on `device` (the packing itself is not repeated). A dtype
        is not a device: pack again (`from_dense(A.to(dtype))`) for other values' dtypes."""
        if isinstance(device, torch.dtype):
            raise InsumTypeError(f"{type(self).__name__}.to() moves a format to a device; {device} is a dtype")
        moved = copy.copy(self)
        # (drops the plans: __setattr__)
        moved._tensors = self.with_aligned_rows({k: v.to(device) for k, v in self._tensors.items()})
        moved.device = normalise_device(device)
        moved.params = dict(self.params)
        return moved

    @classmethod
    def with_aligned_rows(cls, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` with those in `aligned_tensors` stored by `aligned_rows` (a copy where
        one's rows are not aligned: a move to another device or dtype packs them densely)."""
        return {k: aligned_rows(v) if k in cls.aligned_tensors else v for k, v in tensors.items()}

    def to_dense(self) -> torch.Tensor:
        """The matrix as a dense tensor; padding adds exact zeros, so this is exact. With
        nothing stored, zeros (as the product, which reads nothing then: a matrix without
        columns packs padding at a column it does not have)."""
        if self.nnz == 0:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self._dense()

    def _dense(self) -> torch.Tensor:
        """`to_dense` where something is stored."""
        slots = self._slot_rows()
        if slots is None:
            raise NotImplementedError
        dense = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return dense.index_put_((slots[0].long(), self.AK.long()), self.AV, accumulate=True)

    # ----------------------------------------------------------------- SpMM

    def spmm(
        self, B: torch.Tensor, *, bias: torch.Tensor | None = None, backend: str = "auto", precision: str = "tf32"
    ) -> torch.Tensor:
        """A @ B (+ bias[:, None]) by running the format's indirect Einsum through `insum()`.

        B is (K, N) or a vector (K,). The result has the promoted dtype of A and B. Each
        group's (each row's, each block's) products are summed in float32; a half-precision
        result adds those partial sums into its rows in float32 and rounds once, except where
        at most `grouping.HALF_FAN_IN` (8) add into one row: there they add in the result's
        own precision (native atomics). bias: one value
        per row of A (M,), added to every column; in the kernel's epilogue where the format's
        product is one statement over C's rows (ELL, Block-ELL, NM: `bias_expression`), else
        added after it.
        """
        refuse_function_transforms(f"{type(self).__name__} @ B")
        if forward_mode_on() and tangents_alone((B, bias, *self._tensors.values())):
            return self._forward_mode(B, bias, backend, precision)
        key = None
        if (
            type(B) in PLAIN_TENSORS and B.layout == torch.strided and not torch.compiler.is_compiling()
            and (bias is None or type(bias) in PLAIN_TENSORS) and not B.is_neg()
        ):
            # A repeated product (same format, same kind of B) skips the checks and decisions.
            key = (B.dtype, B.shape, B.stride(), B.device, backend, precision,
                   None if bias is None else (bias.dtype, bias.shape, bias.stride(), bias.device))
            plans = self.__dict__.get("_spmm_plans")
            plan = plans.get(key) if plans is not None else None
            if plan is not None:
                return plan.repeat(self, B, bias)
        if not isinstance(B, torch.Tensor) or B.layout != torch.strided:
            raise InsumTypeError("spmm expects a dense torch.Tensor operand")
        # A negative-bit view (z.conj().imag) holds its values negated in memory, which the
        # kernels read: its values, copied (the products' statements refuse such views).
        B = B.resolve_neg()
        bias = bias.resolve_neg() if isinstance(bias, torch.Tensor) else bias
        vector = B.dim() == 1
        original = B
        if vector:
            B = B.unsqueeze(1)
        if B.dim() != 2:
            raise InsumShapeError(
                f"{type(self).__name__} @ B takes a (K, N) matrix or a (K,) vector; B has shape {tuple(original.shape)}"
            )
        if B.shape[0] != self.shape[1]:
            raise InsumShapeError(
                f"cannot multiply {type(self).__name__} of shape {self.shape} with B of shape "
                f"{tuple(B.shape)}: A has {self.shape[1]} columns, B dimension 0 has {B.shape[0]}"
            )
        check_values(B.dtype, f"the dense operand B of {type(self).__name__} @ B has")
        if B.device != self.device:
            raise InsumTypeError(
                f"B is on {B.device} but the {type(self).__name__} tensors are on {self.device}; use .to()"
            )
        if bias is not None:
            self._check_bias(bias)
        plan = _SpmmPlan(self, B, vector, backend, precision, bias)
        C = plan(self, original, bias)
        if key is not None:  # kept once it has run (its options are then valid)
            self.__dict__.setdefault("_spmm_plans", BoundedCache(_PLANS_PER_FORMAT))[key] = plan
        return C

    def _forward_mode(self, B: torch.Tensor, bias, backend: str, precision: str) -> torch.Tensor:
        """`spmm` on tensors that carry forward-mode tangents (B, the bias, the values): the
        product is bilinear, so its tangent is A @ tB + tA @ B (+ the bias's), each an ordinary
        product of primals (the pinned plans never see a tangent)."""
        B, tB = forward_ad.unpack_dual(B)
        bias, tbias = forward_ad.unpack_dual(bias) if bias is not None else (None, None)
        unpacked = {name: forward_ad.unpack_dual(t) for name, t in self._tensors.items()}
        tangents = {name: u.tangent for name, u in unpacked.items() if u.tangent is not None}
        A = self._over({name: unpacked[name].primal for name in tangents}) if tangents else self
        options = {"backend": backend, "precision": precision}
        C = A.spmm(B, bias=bias, **options)
        tangent = A.product_tangent(B, tB, tangents, tbias, biased=bias is not None, **options)
        return forward_ad.make_dual(C, tangent.to(C.dtype))

    def product_tangent(
        self, B: torch.Tensor, tB: torch.Tensor | None, value_tangents: Mapping[str, torch.Tensor],
        tbias: torch.Tensor | None, *, biased: bool, backend: str = "auto", precision: str = "tf32",
    ) -> torch.Tensor:
        """The forward-mode tangent of `self.spmm(B, bias=...)` for tangents of B, the values
        and the bias: A @ tB + tA @ B + tbias, each an ordinary product, summed in place into
        the first: laid out as that product (with a bias where `biased`, as the primal's),
        which torch asks of the tangent of an autograd Function's view output (`SparseLinear`)."""
        options = {"backend": backend, "precision": precision}
        zero = torch.zeros(self.shape[0], dtype=self.dtype, device=self.device) if biased else None
        terms = [] if tB is None else [self.spmm(tB, bias=zero, **options)]
        if value_tangents:
            terms.append(self._tangent_values(value_tangents).spmm(B, bias=None if terms else zero, **options))
        if not terms:  # the bias's alone, in the product's layout
            terms.append(self.spmm(torch.zeros_like(B), bias=zero, **options))
        tangent = terms[0]
        for term in terms[1:]:
            tangent.add_(term)
        if tbias is not None:
            tangent.add_(tbias if tangent.dim() == 1 else tbias[:, None])
        return tangent

    def _tangent_values(self, tangents: Mapping[str, torch.Tensor]) -> SparseFormat:
        """The same pattern over value tangents (zeros for a value tensor without one), zero
        past the declared lengths: the padding's tangent is not read (the kernel stops at the
        lengths, the torch lowering multiplies every slot)."""
        lengths = self.declared_lengths()
        values = {n: zeroed_past_lengths(self.expression, n, tangents[n], lengths) if n in tangents
                  else torch.zeros_like(t) for n, t in self._tensors.items() if self._is_value(n)}
        return self._over(values)

    def _over(self, replaced: Mapping[str, torch.Tensor]) -> SparseFormat:
        """The same format over other tensors of the same shapes (none of its plans)."""
        twin = copy.copy(self)
        object.__setattr__(twin, "_tensors", {**self._tensors, **replaced})
        return twin

    def _check_bias(self, bias: torch.Tensor) -> None:
        if not isinstance(bias, torch.Tensor) or bias.layout != torch.strided:
            raise InsumTypeError("spmm's bias must be a dense torch.Tensor")
        if tuple(bias.shape) != (self.shape[0],):
            raise InsumShapeError(
                f"spmm's bias has shape {tuple(bias.shape)}; {type(self).__name__} of shape {self.shape} "
                f"takes one value per row, ({self.shape[0]},)"
            )
        check_values(bias.dtype, f"the bias of {type(self).__name__} @ B has")
        if bias.device != self.device:
            raise InsumTypeError(f"the bias is on {bias.device} but the {type(self).__name__} tensors are on {self.device}")

    def bias_expression(self) -> str | None:
        """The SpMM's statement with a bias over C's rows as its added term (`+ D[...]`, the bias
        seen through `bias_view`), where the product is one statement whose output is indexed
        by plain variables, each element written once (ELL, Block-ELL, NM); None where the bias
        is added after the product (scattered rows, buckets)."""
        statements = self.statements()
        if len(statements) != 1 or type(self).accumulates or self.covering_block is not None:
            return None
        expression = statements[0][0]
        # Plain string work (traced by torch.compile, as `overwrite` is): the output access's
        # indices, each a lone variable name, none twice.
        output = expression.split("=", 1)[0].rstrip("+ ")
        head, _, inner = output.partition("[")
        names = [name.strip() for name in inner.rstrip("]").split(",")]
        if "[" in inner or not all(n.isidentifier() for n in names) or len(set(names)) != len(names):
            return None
        return f"{overwrite(expression)} + D[{', '.join(names[:-1])}]"

    def bias_view(self, bias: torch.Tensor) -> torch.Tensor:
        """A bias over the matrix's rows (M,) as `bias_expression` indexes it: padded to C's
        rows and viewed with C's shape but its last dimension (`output_shape`)."""
        rows = self.output_shape(1)[:-1]
        return pad_rows(bias, math.prod(rows)).view(rows)

    def __matmul__(self, B: torch.Tensor) -> torch.Tensor:
        return self.spmm(B)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """`fmt @ B` under torch.compile: dynamo hands it over as `Tensor.__rmatmul__(B, fmt)`
        (`_reflected_matmul_in_dynamo`), the format's SpMM. `B @ fmt` (which arrives as
        `Tensor.matmul(B, fmt)` or `Tensor.__matmul__`) is not supported, eager or traced."""
        if len(args) == 2 and not kwargs and isinstance(args[0], torch.Tensor) and isinstance(args[1], SparseFormat):
            if func is torch.Tensor.__rmatmul__:
                return args[1].spmm(args[0])
            if func in (torch.Tensor.matmul, torch.Tensor.__matmul__, torch.matmul):
                # (eager: a TypeError becomes NotImplemented, then Python's own operand error)
                raise TypeError(f"B @ {cls.__name__} (a dense matrix times a format) is not supported; fmt @ B is")
        return NotImplemented

    def _is_value(self, name: str) -> bool:
        return name in self._value_names

    @property
    def fan_in(self) -> int | None:
        """The most groups that add into one output row (None: not recorded)."""
        return self.params.get("fan_in")

    def counted_params(self) -> dict[str, Any]:
        """The params that packing counted off its tensors, counted again off this object's
        (None where that takes more than the tensors hold: not recorded). A format object
        built over another pattern's index tensors (a layer's swapped or assigned pattern)
        takes these in place of its packing's, which describe other tensors. May sync."""
        return {"fan_in": None} if "fan_in" in self.params else {}

    # ----------------------------------------------------------------- the computation
    #
    # A format's SpMM is its statements run on views: B as `operand(B)`, C allocated as
    # `output_shape(N)` and read back as `result(C)`. The defaults are the (M, N) output
    # and the (K, N) operand; blocked and padded formats override the views.

    #: Whether no two of the statements write one output element (each row in one bucket),
    #: so that they may run concurrently in one launch even where each stores without atomics.
    disjoint_statements: ClassVar[bool] = False

    #: The statements add into one output (several buckets): zero-filled, `+=`. Otherwise
    #: the one statement runs with `=` into an uninitialised output.
    accumulates: ClassVar[bool] = False

    @property
    def covering_block(self) -> int | None:
        """For disjoint statements: that their scattered row indices write every output row,
        each row from one statement and, within it, from one aligned block of this many
        entries (None: not so). The repeated product's one launch then stores every row
        (`insum_many`'s covering claim) into an output allocated without a zero fill."""
        return None

    def declared_lengths(self) -> dict[str, torch.Tensor] | None:
        """For a single-statement format whose groups end in padding slots (zero values after
        a group's stored entries): the statement's per-group entry counts as `insum()`'s
        `lengths` ({"q[p]": counts}), so that its product stops each group at its count
        instead of multiplying the padding. None: no padding declared. The padding must hold
        zeros (packing writes them; `SparseLinear` keeps them: the format's `value_gradient`
        leaves the padding's gradient zero)."""
        return None

    def value_gradient(
        self, name: str, dC: torch.Tensor, B: torch.Tensor, backend: str, precision: str,
        tables: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """The gradient of value tensor `name` for the output gradient dC and the operand B
        (both as the statements index them), where the format has a cheaper statement than
        the derived one; None: the derived statements run (`insum.nn.sparse_autograd`).
        tables: this format's `value_gradient_tables()`, built earlier (None: built here
        where needed, or not used)."""
        return None

    def value_gradient_tables(self) -> dict[str, torch.Tensor]:
        """Index tensors `value_gradient` runs on whose sizes need a host sync to count, for a
        caller to build once outside traced code and pass back (`SparseLinear` keeps them as
        buffers, like the transposed pattern, so that a compiled layer runs the same
        gradient as an eager one); {} where there are none."""
        return {}

    @classmethod
    def statement_forms(cls) -> tuple[str, ...]:
        """Every statement text that an instance's `statements()` may run."""
        return (cls.expression,)

    @property
    def single_statement(self) -> bool:
        """Whether the SpMM is one statement over C (M, N) and B (K, N) as given (COO,
        GroupCOO, ELL), so that another product can add into its output with `+=`."""
        cls = type(self)
        hooks = ("statements", "operand", "output_shape", "result")
        return not cls.accumulates and all(getattr(cls, h) is getattr(SparseFormat, h) for h in hooks)

    def statements(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """The (statement, tensors) pairs `spmm` runs, B and C excluded."""
        return [(self.expression, self.tensors)]

    def operand(self, B: torch.Tensor) -> torch.Tensor:
        """B (K, N) as the statements read it: with contiguous rows, which they gather
        (`B[AK[p, q], n]`). A layer passes x^T, whose rows lie a width apart; it is copied
        once, by insum's own transposing kernel (TRANSPOSE: tiles loaded along x's rows,
        stored along x^T's: 20 us at 4096 x 4096 fp16, against 125 us for torch's
        `.contiguous()`). H200, fp16, 4096 x 4096 by batch 4096, x^T as given -> copied
        (`python -m benchmarks.explore.nm_layout`, session 12 call15): N:M 2:4 427 -> 240 us,
        GroupCOO at 90% 25.3 -> 18.4 ms, ELL at 90% 6.26 -> 2.42 ms. (Block-ELL gathers
        whole blocks through its own view, contiguous along the block's rows: 68 us either way.)"""
        if B.dim() < 2 or B.stride(-1) == 1 or B.shape[-1] == 1:
            return B
        return insum(TRANSPOSE, X=B.t())

    def from_operand(self, dB: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like `operand(B)` back as (K, N) (for B's gradient)."""
        return dB

    def output_shape(self, N: int) -> tuple[int, ...]:
        """The shape of C the statements write, for a B with N columns."""
        return (self.shape[0], N)

    def result(self, C: torch.Tensor) -> torch.Tensor:
        """C as the statements wrote it, viewed as the (M, N) product."""
        return C

    def output_view(self, dC: torch.Tensor) -> torch.Tensor:
        """An (M, N) tensor (C's gradient) as the statements index C."""
        return dC

    @classmethod
    def pruning_block(cls, params: Mapping[str, Any]) -> tuple[int, int] | None:
        """The blocks magnitude pruning keeps or drops for a layer packed with `params`
        (None: single entries)."""
        return None

    @classmethod
    def row_granule(cls, params: Mapping[str, Any]) -> int:
        """How many rows packing treats together (1: each row on its own): rows split at its
        multiples pack, part by part, as the whole matrix does (`DistributedSparseLinear`)."""
        return 1

    @classmethod
    def row_padding_slots(cls, shape: tuple[int, int], longest: int, params: Mapping[str, Any]) -> int:
        """At most how many value slots packing a matrix of `shape` whose longest row holds
        `longest` entries stores, for a format that pads rows toward the longest (0: it does
        not, its slots stay within a small multiple of the nonzeros). Read before packing,
        to skip a matrix whose padding would not fit."""
        return 0

    def _slot_rows(self) -> tuple[torch.Tensor, bool] | None:
        """For a format of scalar slots (values AV, columns AK): the output row of every slot,
        and whether each row is one group; None when the format has no transposed pattern."""
        return None

    def transposed_pattern(self) -> dict[str, torch.Tensor] | None:
        """Index tensors of the transposed pattern that `input_gradient` runs on, or None
        when the format has none (B's gradient is then the derived scatter statement)."""
        slots = self._slot_rows()
        if slots is None:
            return None
        rows, one_group_per_row = slots
        return transpose_slots(rows, self.AK, self.shape[1], self.index_dtype, by_column=one_group_per_row)

    def input_gradient(
        self, pattern: dict[str, torch.Tensor], dC: torch.Tensor, backend: str, precision: str
    ) -> torch.Tensor:
        """B's gradient, shaped like `operand(B)`, for the output gradient dC (viewed by
        `output_view`) on the transposed pattern: an SpMM shaped like the forward, with no
        scatter per stored slot."""
        return scalar_gradient(as_dtype(self.AV, dC.dtype), pattern, dC, self.shape[1], backend, precision, owner=self)


    def unique_in(self, tensors: Mapping[str, torch.Tensor]) -> frozenset[str]:
        """The index tensors among one statement's `tensors` that hold no value twice."""
        return frozenset(name for name in self.unique_indices if name in tensors)


_PLANS_PER_FORMAT = 16  # B signatures remembered per format object
_VARYING = frozenset({"B", "C"})  # the tensors of a format's calls that change from call to call


class _EmptyProduct(torch.autograd.Function):
    """An empty format's product: zeros that still belong to B's and the values' graphs
    (zero gradients), as a product over no entries would (a loss on it alone can backward)."""

    @staticmethod
    def forward(ctx, shape, dtype, B, *values):
        ctx.like = [(t.shape, t.dtype, t.device) for t in (B, *values)]
        return torch.zeros(shape, dtype=dtype, device=B.device)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like))


class _SpmmPlan:
    """A format's SpMM decided for one kind of B (dtype, shape, strides, device, options) and
    of bias: the output dtype and buffer, the statements with their tensors and facts. Checks
    passed when it was made; it is kept on the format object (not holding it) and run again
    for every B of that kind. Values are cast on each call (never cached: they may be updated
    in place, as a layer's weights are). From the first repeat that finds its calls prepared,
    it runs them pinned to the format's tensors (`insum.execute.Pinned`): checks of B, C (and
    the bias) per call, of the format's tensors once (`SparseFormat.__setattr__` keeps them
    from being replaced). A bias is the statement's added term where the format has one
    (`SparseFormat.bias_expression`), else added after the product.
    """

    __slots__ = (
        "vector", "empty", "dtype", "cast", "acc", "shape", "zeros", "statements", "disjoint", "covering", "single", "options",
        "M", "N", "biased", "fused", "varying",
        "pinned", "tries", "views",
    )

    def __init__(
        self, fmt: SparseFormat, B: torch.Tensor, vector: bool, backend: str, precision: str,
        bias: torch.Tensor | None = None,
    ):
        self.vector = vector
        self.dtype = dtype = value_dtype_of(fmt.dtype, B.dtype)
        self.M, self.N = fmt.shape[0], B.shape[1]
        self.empty = fmt.nnz == 0 or self.M == 0 or self.N == 0
        # Both factors and the output in the promoted dtype: the kernel sees one value dtype
        # and accumulates half precision in float32 itself.
        self.cast = B.dtype != dtype  # (a no-op .to still costs a dispatch)
        # Half precision accumulates in float32 where many groups meet in one row.
        self.acc = accumulation_dtype(dtype, fmt.fan_in)
        self.shape = fmt.output_shape(self.N)
        self.disjoint = fmt.disjoint_statements
        self.covering = fmt.covering_block if self.disjoint else None
        self.biased = bias is not None
        biased_expression = fmt.bias_expression() if self.biased and not self.empty else None
        self.fused = biased_expression is not None  # the bias in the kernel's epilogue
        self.varying = _VARYING | {"D"} if self.fused else _VARYING
        # Buckets, and a covering layout's statements, add into a zero-filled C with `+=` (the
        # covering batch then runs their `=` kernels into torch.empty); else the one statement
        # runs with `=` into torch.empty, which its launch zero-fills only where it must.
        adds = fmt.accumulates or self.covering is not None
        self.zeros = adds
        self.options = {"backend": backend, "precision": precision}
        self.statements = []
        for expression, tensors in ([] if self.empty else fmt.statements()):
            cast = tuple(k for k, v in tensors.items() if v.is_floating_point() and v.dtype != dtype)
            statement = biased_expression or (expression if adds else overwrite(expression))
            # Packing guarantees in-range indices: no index check, whatever INSUM_CHECK_INDICES says.
            facts = {
                "sorted_indices": frozenset(name for name in fmt.sorted_indices if name in tensors),  # traceable by dynamo
                "unique_indices": fmt.unique_in(tensors),
            }
            lengths = fmt.declared_lengths()
            if lengths is not None:  # (declared by single-statement formats only)
                facts["lengths"] = lengths
            self.statements.append((statement, dict(tensors), cast, facts))
        # (Covering buckets run as a batch even when there is one: its launch needs no zero fill.)
        self.single = len(self.statements) == 1 and self.covering is None
        self.pinned: Pinned | None = None  # the calls pinned to the format's tensors (on a repeat)
        # Repeats that tried to pin them; none where values are cast per call (a copy per
        # value tensor: not a call that the host's time limits).
        self.tries = PIN_TRIES if self.empty or any(cast for _, _, cast, _ in self.statements) else 0
        # How the format views B and C (`_views`), learnt on the call that pins the plan.
        self.views: tuple | None = None

    def _bias(self, fmt: SparseFormat, bias: torch.Tensor) -> torch.Tensor:
        """The bias as the fused statement reads it (`D`)."""
        return fmt.bias_view(as_dtype(bias, self.dtype))

    def _calls(self, fmt: SparseFormat, B: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, list]:
        """The output to write and the calls that write it, for B as given (not a vector)."""
        dtype = self.dtype
        if self.cast:
            B = B.to(dtype)
        C = (torch.zeros if self.zeros else torch.empty)(self.shape, dtype=self.acc, device=B.device)
        operand = fmt.operand(B)
        added = {"D": self._bias(fmt, bias)} if self.fused else {}
        calls = []
        for statement, tensors, cast, facts in self.statements:
            if cast:
                tensors = {k: (v.to(dtype) if k in cast else v) for k, v in tensors.items()}
            calls.append((statement, {"C": C, "B": operand, **added, **tensors}, facts))
        return C, calls

    def _run(self, calls: list) -> None:
        if self.single:
            statement, tensors, facts = calls[0]
            insum(statement, check_indices=False, **facts, **self.options, **tensors)
        else:  # several statements into one C (buckets): one launch once they have run
            insum_many(calls, check_indices=False, disjoint=self.disjoint, covering=self.covering, **self.options)

    def __call__(self, fmt: SparseFormat, B: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.vector:
            B = B.unsqueeze(1)
        if self.empty:
            values = [t for t in fmt._tensors.values() if t.is_floating_point()]
            if torch.is_grad_enabled() and (B.requires_grad or any(t.requires_grad for t in values)):
                C = _EmptyProduct.apply((self.M, self.N), self.dtype, B, *values)
            else:
                C = torch.zeros(self.M, self.N, dtype=self.dtype, device=B.device)
            return self._finish(fmt, C, bias, viewed=True)
        C, calls = self._calls(fmt, B, bias)
        self._run(calls)
        return self._finish(fmt, C, bias)

    def _finish(self, fmt: SparseFormat, C: torch.Tensor, bias: torch.Tensor | None, viewed: bool = False) -> torch.Tensor:
        if not viewed:
            C = fmt.result(C)  # any strides
        if C.dtype != self.dtype:
            C = C.to(self.dtype)
        if self.biased and not self.fused:
            C = C + bias.to(self.dtype)[:, None]
        return C.squeeze(1) if self.vector else C

    def _learn_views(self, fmt: SparseFormat, B: torch.Tensor | None, operand: torch.Tensor, C: torch.Tensor) -> None:
        """Record how `fmt.operand(B)` and `fmt.result(C)` view B and C, where they are views:
        B's and C's layouts are fixed for the plan (its key, its allocation), so a pinned call
        takes the same views directly (`_views`) instead of through the format's methods (a
        few µs of Python each). Where a view is not the same strided window of the same
        memory, the format's method runs on every call (B None: B is cast per call, a copy)."""
        result = fmt.result(C)

        def window(view: torch.Tensor, of: torch.Tensor | None) -> tuple | None:
            if view is of:
                return ()
            if of is None or not view.numel() or view.untyped_storage().data_ptr() != of.untyped_storage().data_ptr():
                return None
            return (tuple(view.shape), view.stride(), view.storage_offset() - of.storage_offset())

        self.views = (window(operand, B), window(result, C))

    def _views(self, fmt: SparseFormat, B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B's operand view, C's result view) for a pinned call (`_learn_views`)."""
        operand, result = self.views
        if operand is None:
            B = fmt.operand(B)
        elif operand:
            B = B.as_strided(operand[0], operand[1], B.storage_offset() + operand[2])
        if result is None:
            C = fmt.result(C)
        elif result:
            C = C.as_strided(result[0], result[1], C.storage_offset() + result[2])
        return B, C

    def repeat(self, fmt: SparseFormat, B: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Another product with a B (and bias) of the plan's kind, outside torch.compile:
        through the pinned launch (`insum.execute.Pinned`: the format's tensors checked once,
        B, C and the bias per call), pinned on the first repeat that finds the calls prepared."""
        pinned = self.pinned
        if pinned is None:
            if self.tries >= PIN_TRIES or torch.compiler.is_compiling():
                return self(fmt, B, bias)
            self.tries += 1
            if self.vector:
                B = B.unsqueeze(1)
            C, calls = self._calls(fmt, B, bias)
            self._run(calls)
            self.pinned = pin(
                calls, varying=self.varying, check_indices=False, disjoint=self.disjoint, covering=self.covering,
                **self.options,
            )
            if self.pinned is not None:
                self._learn_views(fmt, None if self.cast else B, calls[0][1]["B"], C)
            return self._finish(fmt, C, bias)
        ready = pinned.ready(B, bias) if self.fused else pinned.ready(B)
        if not ready:
            if pinned.moved():  # memory moved under a packed tensor: pinned anew (within the tries)
                self.pinned = None
            return self(fmt, B, bias)
        original = B
        if self.vector:
            B = B.unsqueeze(1)
        if self.cast:
            B = B.to(self.dtype)
        # A launch that writes every element of C (covering buckets) needs no zero fill.
        C = (torch.zeros if self.zeros and not pinned.covers else torch.empty)(self.shape, dtype=self.acc, device=B.device)
        operand, result = self._views(fmt, B, C)
        varying = {"C": C, "B": operand}
        if self.fused:
            varying["D"] = self._bias(fmt, bias)
        if not pinned.run(varying):
            return self(fmt, original, bias)
        return self._finish(fmt, result, bias, viewed=True)


def _reflected_matmul_in_dynamo() -> None:
    """Make dynamo trace `fmt @ B` as `Tensor.__rmatmul__(B, fmt)`. For an operator whose left
    operand is not a tensor but has `__torch_function__`, dynamo swaps the operands and calls
    the tensor method of the operator's reflection, but it has none recorded for `@` and calls
    `Tensor.matmul(B, fmt)`, exactly what `B @ fmt` gives: the two would be one product (a
    silently wrong one where both shapes fit). Recording `__rmatmul__` for `@` keeps them
    apart (checked by tests/test_reliability.py on every torch this runs on); without dynamo's
    table (another torch) `fmt @ B` breaks the graph and runs eagerly, never swapped."""
    import operator

    try:
        from torch._dynamo.variables import builtin
    except ImportError:
        return
    reflected = getattr(builtin, "BUILTIN_TO_TENSOR_RFN_MAP", None)
    if isinstance(reflected, dict):
        reflected.setdefault(operator.matmul, torch.Tensor.__rmatmul__)


_reflected_matmul_in_dynamo()
