"""The autograd path of SparseLinear and `sparse_linear`: y = x W^T for a weight W held
in a sparse format, with gradients for x and the format's value tensors.

Every SparseLinear and `sparse_linear` runs through one of two autograd Functions that
differ only in what passes through autograd: under torch.compile `_SparseLinearFunction`
(every tensor of the format, rebuilt around the traced ones), outside it
`_KeptLinearFunction` (x, the bias and the value tensors; the format object kept). Both
compute the same `linear_gradients`. The forward is the format's SpMM; each value tensor's
gradient is its derived statement (insum.autograd) on the format's views of x and dy, or
the format's own cheaper one (`value_gradient`: Block-ELL runs it on the stored blocks
only, its padding left zero); x's gradient runs on the transposed pattern when the layer
keeps one (`SparseFormat.transposed_pattern`: an SpMM shaped like the forward, which the
H200 measured faster than the derived scatter of every stored slot), else as the derived
scatter statement.

A layer trains each position of its weight's pattern once (`frozen_slots`): padding slots
(an empty row's, a group's tail) and repeats of an earlier slot's position get no gradient,
so that the pattern never grows and no weight entry is stepped twice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd import forward_ad

from ..api import insum
from ..autograd import derive
from ..bind import forward_mode_on
from ..dtypes import as_dtype, compute_dtype, promoted
from ..formats.base import FORMATS, SparseFormat
from ..library import zeroed_past_lengths

__all__ = [
    "Gradients",
    "KeptLinear",
    "apply_kept",
    "apply_linear",
    "apply_sparse_linear",
    "format_meta",
    "frozen_slots",
    "gradient_statements",
    "linear_gradients",
    "linear_info",
    "linear_product",
    "rebuild_format",
]


#: Per statement of a format: (dC's name, dB's name, tensor -> its gradient statements and
#: the tensors they read).
Gradients = tuple[tuple[str, str, dict[str, tuple[tuple[str, tuple[str, ...]], ...]]], ...]


_DERIVED: dict[str, tuple] = {}


def _derived(expression: str) -> tuple:
    """One statement's entry of `Gradients`, cached in a plain dict: under torch.compile a
    hit is a constant, so the parser is never traced."""
    if expression not in _DERIVED:
        derivation = derive(expression)
        statements = {
            name: tuple((str(stmt), derivation.inputs[stmt]) for stmt in stmts)
            for name, stmts in derivation.gradients.items()
        }
        _DERIVED[expression] = (derivation.output_grad, derivation.grad_names["B"], statements)
    return _DERIVED[expression]


def gradient_statements(fmt: SparseFormat) -> Gradients:
    """The derived gradient statements of each of `fmt.statements()`, worked out before
    tracing (torch.compile does not trace the parser)."""
    return tuple(_derived(expression) for expression, _ in fmt.statements())


for _format_cls in FORMATS.values():  # every format's statements, before any tracing
    for _expression in _format_cls.statement_forms():
        _derived(_expression)


def linear_product(fmt: SparseFormat, x2: torch.Tensor, bias, backend: str, precision: str) -> torch.Tensor:
    """x2 (batch, in) @ W^T + bias, W held in `fmt`: its SpMM on x2's transpose (no gradient
    recorded; `_SparseLinearFunction` records one)."""
    return fmt.spmm(x2.t(), bias=bias, backend=backend, precision=precision).t()


class _SparseLinearFunction(torch.autograd.Function):
    """y = x W^T + b through the format's statements, with the gradients described above (the
    bias in the product's epilogue where the format allows, `SparseFormat.bias_expression`;
    its gradient dy summed over the batch, here rather than in an autograd node of its own).
    Every tensor of the format passes through it, so that a traced call rebuilds the format
    around the traced tensors; outside torch.compile a layer runs `_KeptLinearFunction`."""

    @staticmethod
    def forward(ctx, info, x2, bias, *tensors):
        fmt_cls, shape, meta, names, pattern_names, table_names, frozen_names, gradients, backend, precision = info
        fmt = rebuild_format(fmt_cls, shape, meta, dict(zip(names, tensors)))
        ctx.info = info
        ctx.biased = bias is not None
        ctx.save_for_backward(x2, *tensors)
        # (no jvp: dynamo refuses a Function that has one; eager layers run `_KeptLinearFunction`)
        return linear_product(fmt, x2, bias, backend, precision)

    @staticmethod
    def backward(ctx, dy):
        fmt_cls, shape, meta, names, pattern_names, table_names, frozen_names, gradients, backend, precision = ctx.info
        x2, *tensors = ctx.saved_tensors
        fmt = rebuild_format(fmt_cls, shape, meta, dict(zip(names, tensors)))
        rest = tensors[len(names) :]
        pattern = dict(zip(pattern_names, rest))
        tables = dict(zip(table_names, rest[len(pattern_names) :]))
        frozen = dict(zip(frozen_names, rest[len(pattern_names) + len(table_names) :]))
        needs = ctx.needs_input_grad
        wanted = {name for i, name in enumerate(names) if needs[3 + i]}
        dx, grads = linear_gradients(fmt, pattern, tables, gradients, backend, precision, x2, dy, needs[1], wanted,
                                     frozen)
        dbias = dy.sum(0) if ctx.biased and needs[2] else None
        return (None, dx, dbias, *(grads.get(name) for name in names), *([None] * len(rest)))


class KeptLinear:
    """What `_KeptLinearFunction` runs on: a format object kept from one call to the next
    (so that its products and gradients stay pinned), the transposed pattern and gradient
    tables, the frozen slots' masks (`frozen_slots`), and the names of the format's
    floating-point tensors, the only ones of its tensors that can have a gradient."""

    __slots__ = ("fmt", "pattern", "tables", "frozen", "gradients", "backend", "precision", "value_names", "values",
                 "index_tensors")

    def __init__(self, fmt: SparseFormat, pattern, gradients: Gradients, backend: str, precision: str, tables=None,
                 frozen=None):
        self.fmt = fmt
        self.pattern = dict(pattern)
        self.tables = dict(tables or {})
        self.frozen = dict(frozen or {})
        self.gradients = gradients
        self.backend = backend
        self.precision = precision
        self.value_names = tuple(name for name, t in fmt._tensors.items() if t.is_floating_point())
        self.values = tuple(fmt._tensors[name] for name in self.value_names)
        self.index_tensors = tuple(t for t in fmt._tensors.values() if not t.is_floating_point())


class _KeptLinearFunction(torch.autograd.Function):
    """`_SparseLinearFunction` for a kept format outside torch.compile: only x, the bias and
    the format's value tensors pass through autograd (the index tensors, the pattern's and
    the tables' stay with the `KeptLinear`). Every tensor given to an autograd Function costs
    the host time of its bookkeeping, in the forward and again in the backward; a Block-ELL
    layer gives it 3 tensors instead of 9."""

    @staticmethod
    def forward(ctx, kept, x2, bias, *values):
        ctx.kept = kept
        ctx.biased = bias is not None
        # (the values and the pattern's indices: an in-place change before the backward raises)
        ctx.save_for_backward(x2, *values, *kept.index_tensors)
        ctx.save_for_forward(x2)
        return linear_product(kept.fmt, x2, bias, kept.backend, kept.precision)

    @staticmethod
    def jvp(ctx, _kept, t_x2, t_bias, *t_values):
        """Forward mode: y is bilinear in x and W, so its tangent is tx W^T + x tW^T + tb."""
        kept = ctx.kept
        (x2,) = ctx.saved_tensors
        tangents = dict(zip(kept.value_names, t_values))
        return linear_tangent(kept.fmt, x2, t_x2, t_bias, tangents, kept.backend, kept.precision, ctx.biased)

    @staticmethod
    def backward(ctx, dy):
        kept = ctx.kept
        x2 = ctx.saved_tensors[0]
        needs = ctx.needs_input_grad
        wanted = {name for name, need in zip(kept.value_names, needs[3:]) if need}
        dx, grads = linear_gradients(kept.fmt, kept.pattern, kept.tables, kept.gradients, kept.backend,
                                     kept.precision, x2, dy, needs[1], wanted, kept.frozen)
        dbias = dy.sum(0) if ctx.biased and needs[2] else None
        return (None, dx, dbias, *(grads.get(name) for name in kept.value_names))


def linear_tangent(
    fmt: SparseFormat, x2: torch.Tensor, t_x2, t_bias, t_values: dict, backend: str, precision: str, biased: bool
) -> torch.Tensor:
    """The forward-mode tangent of y = x2 W^T + b (W held in `fmt`): tx W^T + x tW^T + tb
    (t_values: value tensor name -> its tangent, or None), laid out as `linear_product`'s view
    (`SparseFormat.product_tangent` on x2's transpose)."""
    given = {name: t for name, t in t_values.items() if t is not None}
    tB = None if t_x2 is None else t_x2.t()
    return fmt.product_tangent(x2.t(), tB, given, t_bias, biased=biased, backend=backend, precision=precision).t()


def linear_gradients(
    fmt: SparseFormat, pattern: dict, tables: dict, gradients: Gradients, backend: str, precision: str,
    x2: torch.Tensor, dy: torch.Tensor, x_wanted: bool, wanted: set[str], frozen: dict | None = None,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(x's gradient or None, {value tensor name: its gradient}) for the output gradient dy
    of y = x2 W^T: what both autograd Functions return. frozen: value tensor name -> the
    bool mask of its slots left untrained (`frozen_slots`), their gradients zero."""
    if fmt.nnz == 0:  # the product read nothing (`_SpmmPlan.empty`): its padding slots are not trained
        return (torch.zeros_like(x2) if x_wanted else None), {name: torch.zeros_like(fmt._tensors[name]) for name in wanted}
    if torch.is_grad_enabled():
        # A double backward (create_graph) differentiates these gradients through the values
        # too: the frozen slots read as constants there, and so do the slots past declared
        # lengths (zeros the forward skips, which a derived input gradient reads), so that no
        # order trains them.
        lengths = fmt.declared_lengths()
        held = {}
        for name, t in fmt._tensors.items():
            if not t.is_floating_point():
                continue
            value = torch.where(frozen[name], _constant(t), t) if frozen and name in frozen else t
            value = zeroed_past_lengths(fmt.expression, name, value, lengths)
            if value is not t:
                held[name] = value
        if held:
            fmt = rebuild_format(type(fmt), fmt.shape, format_meta(fmt), {**fmt._tensors, **held})
    dtype = promoted(fmt.dtype, dy.dtype)
    dC = fmt.output_view(as_dtype(dy.t(), dtype))
    # x's operand view (a copy for formats that gather its rows): for the values' and the
    # derived input gradients only
    B = fmt.operand(as_dtype(x2.t(), dtype)) if wanted or (x_wanted and not pattern) else None
    dx = None
    if x_wanted:
        if pattern:
            dB = fmt.input_gradient(pattern, dC, backend, precision)
        else:
            dB = _derived_input_gradient(fmt, gradients, B, dC, backend, precision)
        dx = as_dtype(fmt.from_operand(dB).t(), x2.dtype)
    grads = _value_gradients(fmt, gradients, wanted, B, dC, backend, precision, tables) if wanted else {}
    for name, mask in (frozen or {}).items():
        if name in grads:
            grads[name] = grads[name].masked_fill(mask, 0)
    return dx, grads


def _constant(t: torch.Tensor) -> torch.Tensor:
    """`t` without its gradient, keeping a forward-mode tangent (detach drops both: a
    Hessian-vector product then lost the tangent placed on frozen slots)."""
    constant = t.detach()
    if forward_mode_on():
        tangent = forward_ad.unpack_dual(t).tangent
        if tangent is not None:
            constant = forward_ad.make_dual(constant, tangent)
    return constant


def frozen_slots(fmt: SparseFormat, gradients: Gradients, tables=None) -> dict[str, torch.Tensor]:
    """{value tensor name: bool mask of its slots that a layer must not train}, for the value
    tensors that have any; {} when every slot the product reads is a position of the pattern
    of its own. A slot is trained when the product reads it, it holds a nonzero value (the
    pattern: packing stores zeros only as padding) and no earlier such slot holds its position.
    Otherwise an empty row's padding, which points at column 0, would grow the pattern, and a
    group's padding, which repeats a stored position, would step that weight entry twice.

    Every slot's position comes from the value gradients themselves, run once in float64 by
    the reference lowering on a dy and an x of two rows each, chosen so that a slot at (r, c)
    gets the gradient r * in_features + c + 1 exactly (0: a slot the product never reads, as
    past a declared length). Built outside traced code: it syncs to tell whether any slot is
    frozen."""
    values = [name for name, t in fmt._tensors.items() if t.is_floating_point()]
    if not values or fmt.nnz == 0:
        return {}
    exact = rebuild_format(
        type(fmt), fmt.shape, format_meta(fmt),
        {n: t.detach().double() if n in values else t for n, t in fmt._tensors.items()},
    )
    M, K = fmt.shape
    rows = torch.arange(M, dtype=torch.float64, device=fmt.device)
    cols = torch.arange(K, dtype=torch.float64, device=fmt.device)
    dy = torch.stack([rows * K + 1, torch.ones_like(rows)])
    x2 = torch.stack([torch.ones_like(cols), cols])
    _, codes = linear_gradients(exact, {}, dict(tables or {}), gradients, "torch", "ieee", x2, dy, False, set(values))
    code = torch.cat([codes[name].reshape(-1) for name in values])
    stored = torch.cat([fmt._tensors[name].detach().reshape(-1) != 0 for name in values])
    slot = torch.arange(code.numel(), device=code.device)
    _, position = torch.unique(code, return_inverse=True)
    # the first stored slot of each position (a zero slot before it does not take its place)
    first = torch.full_like(slot, code.numel()).scatter_reduce_(
        0, position, torch.where(stored, slot, code.numel()), reduce="amin")
    frozen = (code > 0) & ~(stored & (first[position] == slot))
    if not bool(frozen.any()):
        return {}
    masks, start = {}, 0
    for name in values:
        t = fmt._tensors[name]
        mask = frozen[start : start + t.numel()].reshape(t.shape)
        start += t.numel()
        if bool(mask.any()):
            masks[name] = mask
    return masks


def _derived_input_gradient(fmt: SparseFormat, gradients: Gradients, B, dC, backend: str, precision: str) -> torch.Tensor:
    """B's gradient by the derived scatter statements (half precision into float32)."""
    dB = torch.zeros(B.shape, dtype=compute_dtype(B.dtype), device=B.device)
    for (_, tensors), (output_grad, grad_name, statements) in zip(fmt.statements(), gradients):
        env = {**tensors, "B": B, output_grad: dC}
        for stmt, reads in statements["B"]:
            insum(stmt, backend=backend, precision=precision, **{grad_name: dB}, **{n: env[n] for n in reads})
    return dB


def _value_gradients(
    fmt: SparseFormat, gradients: Gradients, wanted: set[str], B, dC, backend: str, precision: str, tables
) -> dict[str, torch.Tensor]:
    """The gradient of every value tensor in `wanted`: the format's own statement where it
    has one (on `tables`, its `value_gradient_tables` kept by the layer), else the derived
    ones of every statement that reads it."""
    grads: dict[str, torch.Tensor] = {}
    for name in wanted:
        own = fmt.value_gradient(name, dC, B, backend, precision, tables)  # a cheaper statement of the format's
        if own is not None:
            grads[name] = as_dtype(own, fmt._tensors[name].dtype)
    derived = wanted.difference(grads)
    if not derived:
        return grads
    owner = {id(t): name for name, t in fmt.tensors.items()}
    for (_, tensors), (output_grad, _, statements) in zip(fmt.statements(), gradients):
        env = {**tensors, "B": B, output_grad: dC}
        for local, stmts in statements.items():
            if local not in tensors:  # B: the dense operand, no value tensor of the format
                continue
            name = owner.get(id(tensors[local]))  # id() of a tensor: traceable by dynamo
            if name not in derived:
                continue
            for stmt, reads in stmts:
                grad = insum(stmt, backend=backend, precision=precision, **{n: env[n] for n in reads})
                grad = as_dtype(grad, tensors[local].dtype)
                grads[name] = grad if name not in grads else grads[name] + grad
    return grads


def format_meta(fmt: SparseFormat) -> dict[str, Any]:
    """What rebuilds a format object around new tensors (see `rebuild_format`)."""
    return {"nnz": fmt.nnz, "index_dtype": fmt.index_dtype, "params": dict(fmt.params), "expression": fmt.expression,
            "dtype": fmt.dtype, "device": fmt.device}


def rebuild_format(fmt_cls, shape, meta, tensors) -> SparseFormat:
    """A format object over `tensors` (dtype and device from its values; from `meta` where
    the format packs no tensors, as an all-zero CELL)."""
    values = [t for n, t in tensors.items() if fmt_cls._is_value(fmt_cls, n)]
    anchor = values[0] if values else next(iter(tensors.values()), None)
    fmt = fmt_cls(
        shape,
        tensors,
        nnz=meta["nnz"],
        dtype=anchor.dtype if anchor is not None else meta.get("dtype", torch.get_default_dtype()),
        index_dtype=meta["index_dtype"],
        device=anchor.device if anchor is not None else meta.get("device", torch.device("cpu")),
        params=meta["params"],
    )
    if meta["expression"] != fmt_cls.expression:  # a variant's statement (Block-ELL rows)
        # (a fresh object has no plans for `SparseFormat.__setattr__` to drop; dynamo before
        # torch 2.13 cannot trace that method's dict operations)
        object.__setattr__(fmt, "expression", meta["expression"])
    return fmt


def linear_info(
    fmt: SparseFormat, meta, pattern, gradients: Gradients, backend: str, precision: str, tables=None, frozen=None
) -> tuple:
    """What `_SparseLinearFunction` needs besides the tensors (the format's, the transposed
    pattern's, the value-gradient tables', then the frozen slots' masks, in that order): its
    forward and backward rebuild the format object around the traced tensors (outside
    torch.compile a layer runs `_KeptLinearFunction` on its kept format instead)."""
    return (type(fmt), fmt.shape, meta, tuple(fmt._tensors), tuple(pattern), tuple(tables or ()), tuple(frozen or ()),
            gradients, backend, precision)


def apply_linear(info: tuple, x2: torch.Tensor, tensors: tuple, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 (batch, in) @ W^T + bias for `info` (`linear_info`) and the tensors it names (the
    format's, then the transposed pattern's), through the one autograd path, or the product
    alone where no gradient is recorded (traced, a Function given exactly five arguments none
    of which requires grad had them shifted by one: a dynamo bug an ELL layer met)."""
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2, bias, *tensors))):
        fmt_cls, shape, meta, names, *_, backend, precision = info
        return linear_product(rebuild_format(fmt_cls, shape, meta, dict(zip(names, tensors))), x2, bias, backend,
                              precision)
    return _SparseLinearFunction.apply(info, x2, bias, *tensors)


def apply_kept(kept: KeptLinear, x2: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 (batch, in) @ W^T + bias for a kept format (outside torch.compile)."""
    return _KeptLinearFunction.apply(kept, x2, bias, *kept.values)


def apply_sparse_linear(
    x2, fmt, meta, pattern, gradients: Gradients, backend: str, precision: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x2 (batch, in) @ W^T + bias through the one autograd path (the kept one outside
    torch.compile)."""
    if not torch.compiler.is_compiling():
        return apply_kept(KeptLinear(fmt, pattern, gradients, backend, precision), x2, bias)
    info = linear_info(fmt, meta, pattern, gradients, backend, precision)
    return apply_linear(info, x2, (*fmt._tensors.values(), *pattern.values()), bias)


