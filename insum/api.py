"""The public entry points: insum(), compile(), explain().

Each parses and binds its statement once and hands it down: `insum()` to the executor
(`insum.execute`) for an eager call, or to the torch.library operators (`insum.library`)
while torch.compile traces or when a tensor requires grad; `compile()` to the runtime.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch

from .bind import bind, has_tangent, mark_written, refuse_function_transforms
from .errors import InsumError, InsumTypeError, UnsupportedStatement
from .execute import (
    BACKENDS,
    OPTIONS,
    PRECISIONS,
    Backend,
    Precision,
    check_names,
    check_options,
    declared_key,
    facts_in,
    length_facts,
    prepare_batch,
    prepared,
    prepared_batch,
    run_and_prepare,
    sorted_facts,
    staged_bounds,
    staging_for,
)
from .library import call
from .parser import parse
from .widening import plain_rows, widened_bound, widening_for

__all__ = ["insum", "insum_many", "compile", "explain", "check_options", "BACKENDS", "PRECISIONS", "OPTIONS"]


def insum(
    expr: str,
    /,
    *,
    backend: Backend = "auto",
    precision: Precision = "tf32",
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: frozenset[str] = frozenset(),
    unique_indices: frozenset[str] = frozenset(),
    lengths: Mapping[str, torch.Tensor] | None = None,
    **tensors: torch.Tensor,
) -> torch.Tensor:
    """Evaluate one indirect Einsum and return its output.

    `+=` accumulates into the output, `=` overwrites it. When the output is passed by its
    name it is updated in place and returned; otherwise it is allocated (zeros, the inputs'
    promoted dtype) when its shape follows from direct indices.

    backend: "torch" (the reference lowering), "triton" (the generated kernel), or "auto"
    (the generated kernel on CUDA when the statement is supported, else the reference).
    precision: "tf32" (default) or "ieee" for float32 `tl.dot`.
    autotune: measure tile candidates on a new size's first call (None: INSUM_AUTOTUNE,
    default on); False bounds the first call's latency.
    check_indices: check index values before the generated kernel runs (None:
    INSUM_CHECK_INDICES, default off); the torch backend always checks. See `insum.bounds`.
    sorted_indices: names of index tensors whose values the caller guarantees sorted
    (equal values adjacent), such as a format's row index. A scatter through one
    (`C[AM[p], n]` with AM sorted) then sums adjacent contributions to one row in
    registers and writes once per row and tile. Unchecked: a wrong claim gives wrong
    sums. Applied by the direct call, under torch.compile and in an autograd forward; the
    gradient statements run without it.
    unique_indices: names of index tensors whose values the caller guarantees distinct
    (no value twice), such as the row index of a format with one group per row. A scatter
    whose output coordinates then determine every output-side variable (`C[RI[r], n]`
    with RI unique) has one writer per element: plain stores replace the atomics (and
    their float32 scratch buffer for half outputs). Unchecked: a duplicate value makes two
    programs race on one row and loses a contribution. Applied as sorted_indices is.
    lengths: declared lengths of reduced variables, `{"q[p]": AL}`: for each p, entries
    with q >= AL[p] are padding that contributes zero (value 0 at a valid index, as the
    formats pad), so the generated kernel stops its loop over q there (the longest row of
    a tile when p is tiled) and masks their loads (a K tile loaded through a tensor
    descriptor is still read whole: padding must be zero). Checked for shapes, and for
    negative values with the index values (check_indices); a length above q's extent is
    clamped. Under torch.compile (and in an autograd forward) the
    tensors pass through the custom operator (`insum.library`) and the kernel stops there
    too; a hint all the same: ignored where it does not apply, by the gradient statements
    and by the torch backend, which give the same result.

    >>> import torch
    >>> AV = torch.ones(2, 3); AK = torch.tensor([[0, 1, 2], [2, 2, 0]]); B = torch.eye(3)
    >>> insum("C[p, n] += AV[p, q] * B[AK[p, q], n]", AV=AV, AK=AK, B=B, backend="torch")
    tensor([[1., 1., 1.],
            [1., 0., 2.]])
    """
    refuse_function_transforms("insum()")
    _check_declarations(sorted_indices, unique_indices, lengths)
    if torch.compiler.is_compiling():  # torch.compile traces the registered operators
        check_options(backend=backend, precision=precision, autotune=autotune, check_indices=check_indices)
        return call(expr, tensors, backend=backend, precision=precision, autotune=autotune, check_indices=check_indices,
                    sorted_indices=sorted_indices, unique_indices=unique_indices, lengths=lengths)
    key = (backend, precision, autotune, check_indices, declared_key(sorted_indices), declared_key(unique_indices))
    # (forward-mode tangents never take a prepared launch, which reads the primals' memory)
    dual = has_tangent(tensors.values())
    repeat = None if dual else prepared(expr, key, tensors, lengths)  # a call like an earlier one: its launch
    if repeat is not None:
        out = repeat(tensors, lengths)
        mark_written(out)
        return out
    check_options(backend=backend, precision=precision, autotune=autotune, check_indices=check_indices)
    options = {"backend": backend, "precision": precision, "autotune": autotune, "check_indices": check_indices}
    stmt = parse(expr)
    check_names(stmt)
    # the derived backward, and forward-mode tangents (the autograd Function's jvp)
    if dual or torch.is_grad_enabled() and _any_requires_grad(tensors):
        return call(expr, tensors, stmt=stmt, sorted_indices=sorted_indices, unique_indices=unique_indices,
                    lengths=lengths, **options)
    out = run_and_prepare(expr, key, bind(stmt, tensors), tensors, lengths, sorted_indices, unique_indices, **options)
    mark_written(out)
    return out


def insum_many(
    calls: Sequence[tuple],
    /,
    *,
    backend: Backend = "auto",
    precision: Precision = "tf32",
    autotune: bool | None = None,
    check_indices: bool | None = None,
    disjoint: bool = False,
    covering: int | None = None,
) -> list[torch.Tensor]:
    """Run several statements in order, each as `insum(expr, **facts, **options, **tensors)`
    would, and return their outputs. A call is `(expr, tensors)` or `(expr, tensors, facts)`,
    facts a dict of `sorted_indices` / `unique_indices` for that statement.

    A repeated call runs them as ONE kernel launch where that gives the same sums: every
    statement ran the generated kernel, adds into its given output (`+=`) atomically, or
    with plain stores when `disjoint` (the caller guarantees that no two statements write
    one output element, as a format whose buckets hold disjoint rows; then also an
    overwriting `=` statement that stores each element of its output once, as a layout
    copy, `insum.nn.layout`), checks no indices on
    the device, and no statement reads memory another one writes. The first call runs them
    one by one (each finds its tile sizes); so do calls under torch.compile or with gradients.

    covering (with `disjoint`): the caller's claim that the statements' scattered indices
    write every element of the shared output, each output row from one statement and,
    within it, from one aligned block of `covering` entries of its sorted (or unique)
    index. The one launch then stores each row's sum where every statement owns its rows
    (`runtime.BatchLaunch`): the output's earlier contents do not matter, so the caller that
    pins the calls (`execute.pin`, whose `Pinned.covers` says so) may allocate it with
    `torch.empty`. Unchecked, as `sorted_indices` is; the calls run one by one add as usual.

    >>> C = torch.zeros(4, 2)  # doctest: +SKIP
    >>> insum_many([("C[I[p],n] += A[p]*B[p,n]", dict(C=C, I=I1, A=A1, B=B1)),
    ...             ("C[I[p],n] += A[p]*B[p,n]", dict(C=C, I=I2, A=A2, B=B2))])  # doctest: +SKIP
    """
    refuse_function_transforms("insum_many()")
    if not isinstance(calls, Sequence):
        calls = list(calls)  # (a generator: checked, then run; it would be spent by the checks)
    _check_many(calls, disjoint, covering)
    options = {"backend": backend, "precision": precision, "autotune": autotune, "check_indices": check_indices}
    # (forward-mode tangents: each call through insum(), which carries them)
    single = torch.compiler.is_compiling() or has_tangent(t for call in calls for t in call[1].values())
    if not single:
        batch = prepared_batch(calls, (backend, precision, autotune, check_indices, disjoint, covering))
        if batch is not None:
            outs = batch(calls)
            mark_written(*outs)
            return outs
    # (a widened statement would not join the repeats' one launch; traced code has no such
    # repeats, and dynamo does not trace a context variable)
    with contextlib.nullcontext() if torch.compiler.is_compiling() else plain_rows():
        outs = [insum(call[0], **(call[2] if len(call) > 2 else {}), **options, **call[1]) for call in calls]
    if not single and not (torch.is_grad_enabled() and any(_any_requires_grad(call[1]) for call in calls)):
        prepare_batch(calls, (backend, precision, autotune, check_indices, disjoint, covering))
    return outs


_FACTS = frozenset({"sorted_indices", "unique_indices"})


def _check_declarations(sorted_indices: object, unique_indices: object, lengths: object) -> None:
    """The facts name index tensors and lengths is a dict (a tensor passed in their place
    failed deep in the cached-call lookup, or was ignored)."""
    for option, names in (("sorted_indices", sorted_indices), ("unique_indices", unique_indices)):
        kind = type(names)
        if names is None or isinstance(names, str) or (kind is frozenset and not names):  # (the defaults)
            continue
        if kind not in (frozenset, set, list, tuple) or not all(isinstance(n, str) for n in names):
            raise InsumTypeError(
                f"{option} names index tensors (a name or a collection of names), got {type(names).__name__}"
                + (f" (a tensor of the statement named {option!r}? rename it: that is an option of insum())"
                   if isinstance(names, torch.Tensor) else "")
            )
    if lengths is not None and not isinstance(lengths, Mapping):
        raise InsumTypeError(
            f"lengths is a dict of declared lengths ({{'q[p]': tensor}}), got {type(lengths).__name__}"
            + (" (a tensor of the statement named 'lengths'? rename it: that is an option of insum())"
               if isinstance(lengths, torch.Tensor) else "")
        )


def _check_many(calls, disjoint: object, covering: object) -> None:
    """insum_many's arguments, checked before any call runs (a bad `covering` raised after
    every statement had written its output; a bare string call, an AttributeError)."""
    if not isinstance(disjoint, bool):
        raise InsumTypeError(f"insum_many's disjoint is a bool, not {type(disjoint).__name__}")
    if covering is not None and (isinstance(covering, bool) or not isinstance(covering, int) or covering < 1):
        raise InsumError(f"insum_many's covering is an integer >= 1 (a block of entries), got {covering!r}")
    if covering is not None and not disjoint:
        raise InsumError("insum_many's covering is a claim about disjoint statements: pass disjoint=True with it")
    for entry in calls:
        if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3) or not isinstance(entry[0], str):
            raise InsumTypeError(f"an insum_many call is (expr, tensors) or (expr, tensors, facts), not {entry!r:.80}")
        if not isinstance(entry[1], Mapping) or (len(entry) == 3 and not isinstance(entry[2], Mapping)):
            raise InsumTypeError(f"an insum_many call's tensors and facts are dicts, in the call of {entry[0]!r}")
        clash = sorted(set(entry[1]) & set(OPTIONS))
        if clash:
            raise InsumError(
                f"an insum_many call passes a tensor named {clash[0]!r}, an option of insum() ({', '.join(OPTIONS)}); "
                f"rename it in {entry[0]!r}"
            )
        unknown = set(entry[2]) - _FACTS if len(entry) == 3 else ()
        if unknown:
            raise InsumError(
                f"an insum_many call's facts are sorted_indices and unique_indices, not {', '.join(sorted(unknown))} "
                f"(in the call of {entry[0]!r})"
            )


def _any_requires_grad(tensors: dict) -> bool:
    for t in tensors.values():
        if getattr(t, "requires_grad", False):
            return True
    return False


def compile(expr: str, /, *, precision: Precision = "tf32", autotune: bool | None = None, **example_tensors: torch.Tensor):
    """Compile a statement for tensors like the examples into an `insum.runtime.Kernel`,
    callable with tensors of the same dtypes and ranks.

    autotune: measure tile candidates on each new size's first call (None: INSUM_AUTOTUNE,
    default on; False bounds the first call's latency).

    >>> k = insum.compile("C[AM[p],n] += AV[p,q]*B[AK[p,q],n]", C=C, AM=AM, AV=AV, AK=AK, B=B)  # doctest: +SKIP
    >>> print(k.source); k(C=C, AM=AM, AV=AV, AK=AK, B=B)  # doctest: +SKIP
    """
    check_options(precision=precision, autotune=autotune)
    bound = bind(parse(expr), example_tensors)
    from .runtime import cached_kernel, spec_for  # loads the code generator: on first use

    return cached_kernel(spec_for(bound, precision), autotune)


def _kernel_lines(bound, precision: str, sorted_indices, unique_indices, declared) -> list[str]:
    """The explanation of one kernel: ranked candidates, plan, source."""
    from .codegen.schedule import rank
    from .runtime import kernel_for

    try:
        kernel = kernel_for(
            bound, precision=precision, sorted_indices=sorted_indices, unique_indices=unique_indices, lengths=declared
        )
    except UnsupportedStatement as e:
        return [f"generated kernel: none ({e})"]
    lines = ["candidates (cost model, cheapest first; see insum.codegen.schedule):"]
    lines.extend(f"  {candidate}" for candidate in rank(kernel.spec))
    lines.append("plan:")
    lines.extend("  " + line for line in str(kernel.plan).splitlines())
    lines.append("source:")
    lines.append(kernel.source)
    return lines


def explain(
    expr: str,
    /,
    *,
    precision: Precision = "tf32",
    sorted_indices: frozenset[str] = frozenset(),
    unique_indices: frozenset[str] = frozenset(),
    lengths: Mapping[str, torch.Tensor] | None = None,
    **tensors: torch.Tensor,
) -> str:
    """Describe how a statement is understood and compiled: IR, extents, roles, ranked
    candidate plans, plan, source (sorted_indices, unique_indices and lengths as for
    `insum()`)."""
    check_options(precision=precision)
    bound = bind(parse(expr), tensors)
    declared = ()
    if lengths:
        bound, declared = length_facts(bound, lengths)
    lines = [f"statement: {bound.stmt}", f"ir: {bound.stmt!r}", "variables:"]
    for var in bound.stmt.variables():
        lines.append(f"  {var}: extent {bound.extents[var]}, {bound.roles[var]}")
    lines.append(f"index tensors: {', '.join(bound.index_names) or '-'}")
    lines.append(f"value tensors: {', '.join(bound.value_names) or '-'}")
    lines.append(f"output: {bound.output_name} {list(bound.out_shape)} {bound.out_dtype}")
    facts = (sorted_facts(bound, sorted_indices), sorted_facts(bound, unique_indices, "unique_indices"))
    staged = staging_for(bound, declared)
    widening = widening_for(bound, declared) if staged is None else None
    if widening is not None:
        lines.append(f"widening (insum.widening: the faster of the two kernels below, timed on the first call "
                     f"on a GPU; INSUM_WIDEN=1 always widens, 0 never): {widening}")
        lines.append("as it is:")
        lines.extend("  " + line for line in _kernel_lines(bound, precision, *facts, declared))
        lines.append("widened:")
        widened = widened_bound(widening, bound, values=False)[0]
        lines.extend("  " + line for line in _kernel_lines(widened, precision, *facts, declared))
    elif staged is None:
        lines.extend(_kernel_lines(bound, precision, *facts, declared))
    else:
        lines.append(f"staged (insum.codegen.stage; INSUM_STAGE=0 keeps the gather in the product): {staged}")
        for title, part in zip(("gather", "product"), staged_bounds(staged, bound)):
            lines.append(f"{title}: {part.stmt}")
            part_widening = widening_for(part, ())
            if part_widening is not None:  # (each part runs as a statement of its own, widened or not)
                lines.append(f"  widening (as a statement of its own, timed or forced as above): {part_widening}")
            part_facts = facts_in(part, *facts)
            lines.extend("  " + line for line in _kernel_lines(
                part, precision, part_facts["sorted_indices"], part_facts["unique_indices"], ()))
    return "\n".join(lines)
