"""insum statements as torch.library custom operators: torch.compile, autograd, opcheck.

Two operators take the statement text, its input tensors as a list of names and a list of
tensors, and `insum()`'s options (backend, precision, and optionally autotune,
check_indices, None following the environment as in `insum()`, sorted_indices and
unique_indices, lists of names):

    insum::insum_(expr, out, names, tensors, backend, precision, autotune, check_indices,
                  sorted_indices, unique_indices) -> ()
        runs the statement into `out` in place; declared as a mutation of `out`.
    insum::insum(expr, init, names, tensors, shape, dtype, backend, precision, autotune,
                 check_indices, sorted_indices, unique_indices) -> Tensor
        functional: a new output that starts as a copy of `init` (for `+=` into a given
        output), or as zeros of `shape`/`dtype`, or (both None) as the output `insum()`
        would allocate. Differentiable: the backward runs the derived gradient statements
        (`insum.autograd`) through this same operator, so it compiles and differentiates
        again.

`insum()`'s declared `lengths` travel among the tensors, each under its key prefixed
`lengths:` (`"lengths:q[p]"`: AL), so that a compiled call's kernel stops at them too;
the key is static, the tensor an input like any other. The fake implementations ignore
them, and so do the gradient statements (padding holds zeros: the same sums); a factor
indexed by a length's own variables gets a zero gradient past it (`_past_lengths_zeroed`).

`insum()` goes through them only when it must: while torch.compile traces, or when a
tensor requires grad. An eager call without gradients goes to the executor directly
(`insum.execute.run`), which the operators' implementations call too. The operators take
the statement as text (their schema holds no Python objects), so an implementation looks
the statement and its binding up again: hits in the parser's and the binding's caches.
Fake (meta) implementations give torch.compile the output's shape without running
anything, with symbolic sizes, so a new nnz does not recompile under dynamic shapes.
Nothing on the launch path reads device data on the host (no `.item()`), so a call on
CUDA can be captured in a CUDA graph; the torch backend checks index bounds on the
host and cannot be.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch

from .autograd import Derivation, derive, tensor_names
from .autograd import tangents as tangents_of
from .bind import PLAIN_TENSORS, bind, has_tangent
from .dtypes import HALF_DTYPES, as_dtype, compute_dtype
from .execute import LENGTH_KEY, declared_key, prepared, run_and_prepare
from .ir import Access, Statement, Var
from .parser import parse

__all__ = ["call", "insum_", "insum_functional"]

_OPTIONS_SCHEMA = (
    "str backend, str precision, bool? autotune=None, bool? check_indices=None, "
    "str[]? sorted_indices=None, str[]? unique_indices=None"
)
#: The prefix of a declared length's name among an operator's tensors.
LENGTHS = "lengths:"


def _device(tensors: Sequence[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def _split(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> tuple[dict, dict]:
    """The statement's tensors and the declared lengths (`"lengths:q[p]"` -> `"q[p]"`)."""
    given, lengths = {}, {}
    for name, tensor in zip(names, tensors):
        if name.startswith(LENGTHS):
            lengths[name[len(LENGTHS):]] = tensor
        else:
            given[name] = tensor
    return given, lengths


def _run(
    expr: str,
    given: dict[str, torch.Tensor],
    lengths: dict[str, torch.Tensor],
    backend: str,
    precision: str,
    autotune: bool | None,
    check_indices: bool | None,
    sorted_indices: Sequence[str] | None,
    unique_indices: Sequence[str] | None,
) -> torch.Tensor:
    """Run as `insum()`'s direct call does, facts and lengths included, into the output in
    `given` (else the one it would allocate). A call like an earlier one (text, options and
    tensor signatures) goes straight to its prepared launch (`insum.execute.prepared`), as a
    direct call does: a compiled graph calls the operators once per step."""
    sorted_names, unique_names = frozenset(sorted_indices or ()), frozenset(unique_indices or ())
    key = (backend, precision, autotune, check_indices, sorted_names, unique_names)
    lengths = lengths or None
    repeat = prepared(expr, key, given, lengths)
    if repeat is not None:
        return repeat(given, lengths)
    options = {"backend": backend, "precision": precision, "autotune": autotune, "check_indices": check_indices}
    return run_and_prepare(expr, key, bind(parse(expr), given), given, lengths, sorted_names, unique_names, **options)


# --------------------------------------------------------------------------- forward mode


def _output_tangent(
    expr: str,
    primals: Mapping[str, torch.Tensor],
    tangents: Mapping[str, torch.Tensor],
    like: tuple[torch.Size, torch.dtype, torch.device],
    backend: str,
    precision: str,
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: Sequence[str] | None = None,
    unique_indices: Sequence[str] | None = None,
) -> torch.Tensor:
    """The forward-mode tangent of `expr`'s output: the sum of its tangent statements
    (`insum.autograd.tangents`) on the primal tensors (declared lengths among them under
    `LENGTHS`) and the given tangents, plus the incoming output's tangent for `+=` (under
    the output's name). `like`: the output's (shape, dtype, device)."""
    stmt = parse(expr)
    plan = tangents_of(stmt)
    given, lengths = _split(list(primals), list(primals.values()))
    incoming = tangents.get(stmt.output.name) if stmt.accumulate else None
    shape, dtype, device = like
    tangent = incoming.to(dtype, copy=True) if incoming is not None else torch.zeros(shape, dtype=dtype, device=device)
    declared = [declared_key(names or ()) for names in (sorted_indices, unique_indices)]
    for name, access, term in plan.terms:
        if tangents.get(name) is None:
            continue
        read = _zeroed_past_lengths(access, tangents[name], lengths)  # (padding's tangent: not read)
        env = {**given, plan.names[name]: read}
        reads = tensor_names(term)
        variables = set(term.variables())
        # only the lengths, facts of this term's own variables and tensors (an added term's has none)
        names = [*reads, *(LENGTHS + k for k in lengths if LENGTH_KEY.match(k).group(1) in variables)]
        values = [env[n] for n in reads] + [lengths[n[len(LENGTHS):]] for n in names[len(reads):]]
        facts = [sorted(n for n in names_ if n in reads) if isinstance(names_, frozenset) else names_
                 for names_ in declared]
        # (differentiable where grad is on: reverse mode over this tangent)
        tangent = run_functional(str(term), tangent, names, values, None, None, backend, precision, autotune,
                                 check_indices, *facts)
    return tangent


# --------------------------------------------------------------------------- in place


#: The in-place operator is defined on the dispatcher directly (one kernel for every device,
#: no autograd kernel: `call` runs it only where no gradient is needed), not through
#: `torch.library.custom_op`, whose Python dispatch layers cost about 90 us a call on the
#: development VM against 10 us for the kernel itself: a compiled training step calls it for
#: every product and gradient statement.
_LIBRARY = torch.library.Library("insum", "FRAGMENT")
_LIBRARY.define(f"insum_(str expr, Tensor(a!) out, str[] names, Tensor[] tensors, {_OPTIONS_SCHEMA}) -> ()")


def insum_(
    expr: str,
    out: torch.Tensor,
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    backend: str,
    precision: str,
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: Sequence[str] | None = None,
    unique_indices: Sequence[str] | None = None,
) -> None:
    """Run `expr` into `out` in place (`out` is the statement's output)."""
    given, lengths = _split(names, tensors)
    given[_output_of(expr)[0]] = out
    _run(expr, given, lengths, backend, precision, autotune, check_indices, sorted_indices, unique_indices)


_LIBRARY.impl("insum_", insum_, "CompositeExplicitAutograd")


@torch.library.register_fake("insum::insum_", lib=_LIBRARY)
def _insum_fake(
    expr, out, names, tensors, backend, precision, autotune=None, check_indices=None, sorted_indices=None,
    unique_indices=None,
) -> None:
    return None


# --------------------------------------------------------------------------- functional


def _functional(
    expr: str,
    init: torch.Tensor | None,
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    shape: Sequence[int] | None,
    dtype: torch.dtype | None,
    backend: str,
    precision: str,
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: Sequence[str] | None = None,
    unique_indices: Sequence[str] | None = None,
) -> torch.Tensor:
    """The statement's output as a new tensor: a copy of `init`, zeros of `shape`, or
    allocated. `insum::insum`'s implementation, also called without the operator
    (`_EagerInsum`, `run_functional`)."""
    given, lengths = _split(names, tensors)
    out = None
    if init is not None:
        out = init.clone()
    elif shape is not None:
        out = torch.zeros(shape, dtype=dtype or torch.float32, device=_device(tensors))
    if out is not None:
        given[_output_of(expr)[0]] = out
    return _run(expr, given, lengths, backend, precision, autotune, check_indices, sorted_indices, unique_indices)


insum_functional = torch.library.custom_op(
    "insum::insum",
    mutates_args=(),
    schema=(
        "(str expr, Tensor? init, str[] names, Tensor[] tensors, SymInt[]? shape, "
        f"ScalarType? dtype, {_OPTIONS_SCHEMA}) -> Tensor"
    ),
)(_functional)


@insum_functional.register_fake
def _insum_functional_fake(
    expr, init, names, tensors, shape, dtype, backend, precision, autotune=None, check_indices=None,
    sorted_indices=None, unique_indices=None,
):
    if init is not None:
        return torch.empty_like(init)
    if shape is not None:
        return torch.empty(shape, dtype=dtype or torch.float32, device=_device(tensors))
    bound = bind(parse(expr), _split(names, tensors)[0])
    return torch.empty(bound.out_shape, dtype=bound.out_dtype, device=bound.device)


def _setup_context(ctx, inputs, output) -> None:
    expr, init, names, tensors, shape, _dtype, backend, precision, autotune, check_indices, *_facts = inputs
    ctx.expr, ctx.names = expr, tuple(names)
    ctx.options = (backend, precision, autotune, check_indices)
    # The backward returns one entry per input, and an empty list input as an empty list.
    ctx.no_names = [] if not names else None
    ctx.no_shape = [] if shape is not None and len(shape) == 0 else None
    ctx.init_dtype = None if init is None else init.dtype
    ctx.save_for_backward(*tensors)


def _gradients(ctx, grad: torch.Tensor, wanted: Sequence[bool]) -> tuple[torch.Tensor | None, list]:
    """The incoming output's gradient (`init`, for `+=`) and each saved tensor's, where
    wanted: the backward of `insum::insum` and of `_EagerInsum` alike."""
    derivation = derive(ctx.expr)
    saved = ctx.saved_tensors
    tensors = dict(zip(ctx.names, saved))
    lengths = {name[len(LENGTHS):]: t for name, t in tensors.items() if name.startswith(LENGTHS)}
    if lengths and has_tangent(saved):
        # Under forward mode (a Hessian-vector product) a factor's tangent past a length is
        # padding's, which the forward does not read: neither do the gradient statements.
        for factor in derivation.stmt.accesses():
            if sum(f.name == factor.name for f in derivation.stmt.accesses()) == 1:
                tensors[factor.name] = _zeroed_past_lengths(factor, tensors[factor.name], lengths)
    grads = [
        _gradient(derivation, name, tensor, tensors, grad, ctx.options, lengths)
        if want and name in derivation.gradients else None
        for name, tensor, want in zip(ctx.names, saved, wanted)
    ]
    grad_init = None
    if ctx.init_dtype is not None and ctx.needs_input_grad[1] and derivation.passthrough:
        grad_init = grad.to(ctx.init_dtype)
    return grad_init, grads


def zeroed_past_lengths(expr: str, name: str, values: torch.Tensor, lengths: Mapping[str, torch.Tensor] | None):
    """`values` of the tensor `name` that `expr` reads, zero where its one access skips under
    the declared `lengths` (a format's padding: a tangent or gradient there is not read)."""
    accesses = [a for a in parse(expr).accesses() if a.name == name]
    return _zeroed_past_lengths(accesses[0], values, lengths) if lengths and len(accesses) == 1 else values


def _zeroed_past_lengths(access: Access, values: torch.Tensor, lengths: Mapping[str, torch.Tensor]):
    """`values` (of the tensor `access` reads) with the entries that this access skips under
    the declared lengths set to zero. The gradient statements run without the lengths (the
    padding past them holds zeros, so their sums are the same), but a factor indexed by the
    length's own variables, AV[p, q] under q < AL[p], has a gradient at every q, and one past
    AL[p] would make the padding that the forward skips nonzero after an update; a tangent
    there would be read by the torch backend and not by the kernel."""
    if not lengths:
        return values
    dims = {index.terms[0].atom.name: d for d, index in enumerate(access.indices)
            if not index.const and len(index.terms) == 1 and index.terms[0].coef == 1
            and isinstance(index.terms[0].atom, Var)}
    for key, length in lengths.items():
        var, over = LENGTH_KEY.match(key).groups()  # (checked when the call bound them)
        over = [v.strip() for v in over.split(",")]
        if var not in dims or any(v not in dims for v in over):
            continue
        at = [dims[v] for v in over] + [dims[var]]
        past = torch.arange(values.shape[dims[var]], device=values.device) >= length.unsqueeze(-1)
        past = past.permute(sorted(range(len(at)), key=at.__getitem__))  # into the tensor's dimension order
        shape = [1] * values.dim()
        for size, d in zip(past.shape, sorted(at)):
            shape[d] = size
        values = values.masked_fill(past.reshape(shape), 0)
    return values


def _backward(ctx, grad: torch.Tensor):
    grad_init, grads = _gradients(ctx, grad, ctx.needs_input_grad[3])
    full = (None, grad_init, ctx.no_names, grads, ctx.no_shape, None, None, None, None, None, None, None)
    # One entry per input given: the dispatcher drops trailing options left at their defaults.
    return full[: len(ctx.needs_input_grad)]


def _gradient(
    derivation: Derivation,
    name: str,
    tensor: torch.Tensor,
    tensors: Mapping[str, torch.Tensor],
    grad: torch.Tensor,
    options: tuple[str, str, bool | None, bool | None],
    lengths: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The gradient of one factor: its derived statements, accumulated into one buffer; with
    declared lengths, each appearance's part zeroed where that appearance skips
    (`_zeroed_past_lengths`) before it is added."""
    statements = derivation.gradients[name]
    if not lengths:
        return _gradient_sum(derivation, statements, tensor, tensors, grad, options)
    stmt = derivation.stmt
    accesses = [f for f in stmt.factors if isinstance(f, Access) and f.name == name]
    accesses += [stmt.addend] if stmt.addend is not None and stmt.addend.name == name else []
    parts = [
        _zeroed_past_lengths(access, _gradient_sum(derivation, (part,), tensor, tensors, grad, options), lengths)
        for access, part in zip(accesses, statements)
    ]
    return functools.reduce(torch.add, parts)


def _gradient_sum(
    derivation: Derivation,
    statements: Sequence[Statement],
    tensor: torch.Tensor,
    tensors: Mapping[str, torch.Tensor],
    grad: torch.Tensor,
    options: tuple[str, str, bool | None, bool | None],
) -> torch.Tensor:
    """The sum of gradient `statements` of `tensor`, accumulated into one buffer."""
    # Half-precision gradients accumulate in float32 and round once, as torch's embedding
    # backward does: a gradient's scatter (gathers become scatters) may gather hundreds
    # of contributions per element, and several statements add into one buffer.
    dtype = compute_dtype(tensor.dtype)
    result = None
    for stmt in statements:
        inputs = derivation.inputs[stmt]
        others = [tensors[n] for n in inputs if n != derivation.output_grad and n in derivation.grad_names]
        d_out = grad
        if others:
            # Half-precision factors multiply a half-precision output gradient (tensor
            # cores need one operand dtype), as dense autocast training would.
            common = others[0].dtype
            for t in others[1:]:
                common = torch.promote_types(common, t.dtype)
            if common in HALF_DTYPES and d_out.dtype != common:
                d_out = d_out.to(common)
        env = {**tensors, derivation.output_grad: d_out}
        result = run_functional(
            str(stmt),
            result,
            list(inputs),
            [env[n] for n in inputs],
            list(tensor.shape) if result is None else None,
            dtype if result is None else None,
            *options,
        )
    return as_dtype(result, tensor.dtype)


insum_functional.register_autograd(_backward, setup_context=_setup_context)


def run_functional(*args) -> torch.Tensor:
    """`insum::insum` where it must be the operator (traced code, or a gradient that is
    itself differentiated: create_graph), else its implementation called directly (an
    eager backward: the operator's dispatch and autograd layers cost more than the launch)."""
    _, init, _, tensors, *_ = args
    plain = all(type(t) in PLAIN_TENSORS for t in tensors) and (init is None or type(init) in PLAIN_TENSORS)
    if not plain or torch.compiler.is_compiling():  # (fake tensors: traced)
        return torch.ops.insum.insum(*args)
    if torch.is_grad_enabled() or has_tangent((*tensors, init)):  # (tangents: a backward under forward mode)
        return _eager_functional(*args)
    return _functional(*args)


class _EagerInsum(torch.autograd.Function):
    """`insum()` with gradients, eager: the forward and derived backward of `insum::insum`
    without `torch.library`'s autograd wrapper (about 300 against 20 µs of host time a call
    without gradients on the development VM, launches stubbed). Traced code keeps the
    operator, whose fake implementation torch.compile needs."""

    @staticmethod
    def forward(ctx, expr, init, names, shape, dtype, options, *values):
        ctx.expr, ctx.names, ctx.options, ctx.all_options = expr, tuple(names), options[:4], options
        ctx.init_dtype = None if init is None else init.dtype
        ctx.save_for_backward(*values)
        ctx.save_for_forward(*values)
        out = _functional(expr, init, names, values, shape, dtype, *options)
        ctx.out_meta = (out.shape, out.dtype, out.device)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_init, grads = _gradients(ctx, grad, ctx.needs_input_grad[6:])
        return (None, grad_init, None, None, None, None, *grads)

    @staticmethod
    def jvp(ctx, _expr, init_tangent, _names, _shape, _dtype, _options, *value_tangents):
        """Forward mode (the output's tangent), also under a reverse-mode graph: a Hessian-
        vector product runs the backward on tensors that carry tangents (`run_functional`)."""
        tangents = {n: t for n, t in zip(ctx.names, value_tangents) if t is not None}
        if init_tangent is not None:
            tangents[_output_of(ctx.expr)[0]] = init_tangent
        primals = dict(zip(ctx.names, ctx.saved_tensors))
        return _output_tangent(ctx.expr, primals, tangents, ctx.out_meta, *ctx.all_options)


# --------------------------------------------------------------------------- insum()'s path


@torch._dynamo.assume_constant_result
def _output_of(expr: str) -> tuple[str, bool]:
    """The output's name and whether the statement accumulates (a constant under tracing)."""
    stmt = parse(expr)
    return stmt.output.name, stmt.accumulate


def call(
    expr: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    backend: str,
    precision: str,
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: frozenset[str] = frozenset(),
    unique_indices: frozenset[str] = frozenset(),
    lengths: Mapping[str, torch.Tensor] | None = None,
    stmt: Statement | None = None,
) -> torch.Tensor:
    """insum() through the operators: traceable by torch.compile, differentiable.

    `stmt`: the parsed statement, given by eager calls (which are bound here, once); while
    tracing it is None and the text alone is read, as a constant. A given output is updated in
    place and returned: by the mutating operator when no gradient is needed, else by the
    functional one and a `copy_` that autograd records. sorted_indices, unique_indices and
    lengths: as for `insum()`, the lengths' tensors passed among the inputs (`LENGTHS`).
    """
    out_name, accumulate = _output_of(expr) if stmt is None else (stmt.output.name, stmt.accumulate)
    facts = (_names(sorted_indices), _names(unique_indices))
    options = (backend, precision, autotune, check_indices, *facts)
    out = tensors.get(out_name)
    names = [n for n in tensors if n != out_name]
    values = [tensors[n] for n in names]
    if stmt is not None:
        # Eager: bind once here, for the direct path's checks and error messages, with the
        # tensors in the order the operator binds them (the output last): its binding is then
        # a hit in the binding cache.
        given = dict(zip(names, values))
        if out is not None:
            given[out_name] = out
        bind(stmt, given)
    for key, tensor in (lengths or {}).items():
        names.append(LENGTHS + key)
        values.append(tensor)
    # Eager (`stmt` given) on plain tensors, the differentiable calls skip the operator
    # (`_EagerInsum`); traced code and tensor subclasses keep it.
    eager = stmt is not None and all(type(v) in PLAIN_TENSORS for v in values) and (
        out is None or type(out) in PLAIN_TENSORS)
    functional = _eager_functional if eager else torch.ops.insum.insum
    if out is None:
        return functional(expr, None, names, values, None, None, *options)
    needs_grad = torch.is_grad_enabled() and (out.requires_grad or any(v.requires_grad for v in values))
    if not needs_grad and not has_tangent((out, *values)):  # (tangents: the Function's jvp carries them)
        torch.ops.insum.insum_(expr, out, names, values, *options)
        return out
    if accumulate:
        result = functional(expr, out, names, values, None, None, *options)
    else:
        result = functional(expr, None, names, values, list(out.shape), out.dtype, *options)
    return out.copy_(result)


def _eager_functional(expr, init, names, values, shape, dtype, *options) -> torch.Tensor:
    """`insum::insum`'s signature, through `_EagerInsum`."""
    return _EagerInsum.apply(expr, init, names, shape, dtype, options, *values)


def _names(facts: frozenset[str] | str | None) -> list[str] | None:
    """A fact's names as the operators' `str[]?` argument, in a fixed order (None: none, as
    the direct call reads None too)."""
    if isinstance(facts, str):
        return [facts]
    return sorted(facts or ()) or None
