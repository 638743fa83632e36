"""Run a bound statement: the one executor below `insum()` and the torch.library operators.

Both entry points hand down a statement that is already parsed and bound (`insum.api` for
eager calls, the operators of `insum.library` for autograd and torch.compile); this module
decides the backend, falls back to the torch lowering with one warning when the generated
kernel cannot run, checks indices, and launches:

    parse(text) -> bind(stmt, tensors) -> run(bound, out, backend=..., ...) -> out

Options are validated here once for every entry point (`check_options`).

A repeated eager call skips all of that: `prepare` keeps what a call decided (the backend,
the kernel's launch for the signature, the output to allocate), keyed by the statement text,
the options and the tensors' signature, and `prepared` finds it again after the checks whose
outcome can change between two calls of one signature (torch.compile tracing, gradients,
the environment switches, aliasing of output and input, descriptor alignment).
"""

from __future__ import annotations

import operator
import re
import warnings
from collections.abc import Mapping
from typing import Literal

import torch

from .bind import (
    PLAIN_TENSORS,
    Bound,
    PerTensor,
    bind,
    check_aliasing,
    kept_per_version,
    keyable,
    tensor_signature,
)
from .bounds import check_indices as _check_indices
from .cache import BoundedCache, memoize
from .dtypes import INDEX_DTYPES
from .errors import InsumError, InsumShapeError, InsumTypeError, UnsupportedStatement
from .ir import Statement
from .reference import run_reference
from .settings import flag, snapshot
from .widening import WidenedLaunch, run_widened, widened_bound, widening_for, widening_forced

__all__ = [
    "run",
    "prepare",
    "prepared",
    "Prepared",
    "call_signature",
    "declared_key",
    "staging_for",
    "staged_bounds",
    "facts_in",
    "PIN_TRIES",
    "prepared_batch",
    "PreparedBatch",
    "prepare_batch",
    "pin",
    "Pinned",
    "check_options",
    "check_names",
    "sorted_facts",
    "length_facts",
    "Lengths",
    "Backend",
    "Precision",
    "BACKENDS",
    "PRECISIONS",
    "OPTIONS",
]

#: "torch": the reference lowering; "triton": the generated kernel; "auto": the generated
#: kernel on CUDA tensors (falling back to the lowering with a warning), the lowering elsewhere.
Backend = Literal["auto", "torch", "triton"]
#: Float32 `tl.dot`: "tf32" tensor cores, or "ieee" full precision.
Precision = Literal["tf32", "ieee"]
BACKENDS: tuple[Backend, ...] = ("auto", "torch", "triton")
PRECISIONS: tuple[Precision, ...] = ("tf32", "ieee")
OPTIONS = ("backend", "precision", "autotune", "check_indices", "sorted_indices", "unique_indices", "lengths")  # keywords that are not tensors

_WARNED_FALLBACK: BoundedCache[str, None] = BoundedCache()  # statements that already warned


def check_options(**options) -> None:
    """Reject an unknown option value, or a tensor passed under an option's name."""
    for name, value in options.items():
        if isinstance(value, torch.Tensor):
            raise InsumError(
                f"a tensor was passed as {name}=: '{name}' is an option of insum(), so no tensor "
                "may be named so; rename it in the statement"
            )
    backend, precision = options.get("backend", "auto"), options.get("precision", "tf32")
    if backend not in BACKENDS:
        raise InsumError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if precision not in PRECISIONS:
        raise InsumError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    for name in ("autotune", "check_indices"):
        if options.get(name) not in (None, True, False):
            raise InsumError(f"{name} must be True, False or None, not {options[name]!r}")


def check_names(stmt: Statement) -> None:
    """Reject a statement that names a tensor like an option (it could not be passed)."""
    taken = _option_names_in(stmt)
    if taken:
        raise InsumError(
            f"tensor name {taken[0]!r} in '{stmt}' is an option of insum() ({', '.join(OPTIONS)}); "
            "rename the tensor"
        )


@memoize
def _option_names_in(stmt: Statement) -> tuple[str, ...]:
    """Tensor names of the statement that are insum() options (per statement: a cached call
    walks it once, not on every launch)."""
    return tuple(sorted({access.name for access, _ in stmt.walk()} & set(OPTIONS)))


def sorted_facts(bound: Bound, names, option: str = "sorted_indices") -> frozenset[str]:
    """The index tensors declared under `option` (sorted_indices or unique_indices), each
    checked to be one the statement indexes with."""
    facts = frozenset(names) if not isinstance(names, str) else frozenset((names,))
    for name in facts:
        if name not in bound.index_names:
            raise InsumError(
                f"{option} names {name!r}, which is not an index tensor of '{bound.stmt}' "
                f"(index tensors: {', '.join(bound.index_names) or 'none'})"
            )
    return facts


#: Declared lengths as a kernel sees them: (variable, tensor name, index variables, order
#: tensor name: "" unless the length is over one variable, see `longest_first`).
Lengths = tuple[tuple[str, str, tuple[str, ...], str], ...]
LENGTH_KEY = re.compile(r"^\s*([A-Za-z_]\w*)\s*\[\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*\]\s*$")


def length_facts(bound: Bound, lengths: Mapping[str, torch.Tensor]) -> tuple[Bound, Lengths]:
    """Check declared lengths (`{"q[p]": AL}`: q stops at AL[p]) against the statement and
    add their tensors to the binding under names no statement tensor uses (`LEN_q`)."""
    taken = {access.name for access, _ in bound.stmt.walk()}
    extra, facts, signature = {}, [], []
    for key, tensor in lengths.items():
        match = LENGTH_KEY.match(key) if isinstance(key, str) else None
        if match is None:
            raise InsumError(f"lengths key {key!r} is not of the form 'q[p]' (q's length for each p)")
        var, index = match.group(1), tuple(v.strip() for v in match.group(2).split(","))
        if bound.roles.get(var) != "reduced":
            raise InsumError(f"lengths names {var!r}, which is not a reduced variable of '{bound.stmt}'")
        for v in index:
            if v == var or bound.roles.get(v) not in ("output", "scattered"):
                raise InsumError(
                    f"the length of {var!r} may depend on output-side variables of '{bound.stmt}' only, not {v!r}"
                )
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in INDEX_DTYPES:
            raise InsumTypeError(f"lengths[{key!r}] must be an int32 or int64 tensor")
        expected = tuple(bound.extents[v] for v in index)
        if tuple(tensor.shape) != expected or tensor.device != bound.device:
            raise InsumShapeError(
                f"lengths[{key!r}] has shape {tuple(tensor.shape)} on {tensor.device}; expected {expected} "
                f"(the extents of {', '.join(index)}) on {bound.device}"
            )
        name = f"LEN_{var}"
        while name in taken or order_name(name) in taken:
            name += "_"
        taken.add(name)
        extra[name] = tensor
        order = ""
        if len(index) == 1:  # the programs of index[0] may run longest first
            order = order_name(name)
            taken.add(order)
            extra[order] = longest_first(tensor)
        facts.append((var, name, index, order))
        signature.append(("lengths", name, index, tensor.dtype, tuple(tensor.stride())))
    return bound.with_tensors({**bound.tensors, **extra}, tuple(signature)), tuple(facts)


def order_name(length_name: str) -> str:
    """The binding's name for the order of a declared length's tensor (`longest_first`)."""
    return f"ORDER_{length_name}"


#: Per lengths tensor (held weakly: an entry dies with its tensor), its version and order.
_ORDERS: PerTensor = PerTensor()


def longest_first(lengths: torch.Tensor) -> torch.Tensor:
    """The positions of a 1-D lengths tensor from the longest to the shortest (int32, stable):
    the order in which a kernel whose programs each run one position's length starts them
    (`insum.codegen.schedule.Plan.ordered`).

    Kept per tensor object and version, so a format's packed lengths are sorted once, not on
    every call; sorted on each call where the tensor keeps no version (tracing, inference
    tensors). Any permutation gives the same result: only the programs' order depends on it."""
    return kept_per_version(_ORDERS, lengths, (),
                            lambda: torch.argsort(lengths, descending=True, stable=True).to(torch.int32))


def with_lengths(tensors: Mapping[str, torch.Tensor], lengths: Mapping[str, torch.Tensor], names) -> dict:
    """`tensors` with the declared lengths (and the orders the kernel reads) under the
    binding's names; names: (key in `lengths=`, the binding's name, whether its order is
    read) per declared length, as prepared."""
    tensors = dict(tensors)
    for key, name, ordered in names:
        tensors[name] = lengths[key]
        if ordered:
            tensors[order_name(name)] = longest_first(lengths[key])
    return tensors


def _checking(check_indices: bool | None) -> bool:
    if check_indices is not None:
        return check_indices
    return flag("INSUM_CHECK_INDICES", default=False)


def run(
    bound: Bound,
    out: torch.Tensor,
    *,
    backend: Backend = "auto",
    precision: Precision = "tf32",
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: frozenset[str] = frozenset(),
    unique_indices: frozenset[str] = frozenset(),
    lengths: Lengths = (),
) -> torch.Tensor:
    """Run a bound statement into `out` and return `out` (no dispatcher, no autograd).

    With backend "triton" a statement the generated kernel cannot run raises
    `UnsupportedStatement`; with "auto" it falls back to the torch lowering, warning once
    per statement. autotune, check_indices, sorted_indices, unique_indices and lengths (checked, the
    tensors of `lengths` already in `bound`: `length_facts`): as for `insum()`.
    """
    if bound.device.type == "meta":
        raise InsumTypeError(
            "the tensors are on the meta device and hold no values; insum runs on them only "
            "while torch.compile traces (the operators' fake implementations)"
        )
    if backend == "torch" or (backend == "auto" and bound.device.type != "cuda"):
        return run_reference(bound, out)
    from .runtime import kernel_for  # the runtime loads the code generator: on first use

    staged = staging_for(bound, lengths)
    if staged is not None:
        options = dict(backend=backend, precision=precision, autotune=autotune, check_indices=check_indices)
        gather, main = staged_bounds(staged, bound)
        run(gather, gather.output(), **options, **facts_in(gather, sorted_indices, unique_indices))
        return run(main, out, **options, **facts_in(main, sorted_indices, unique_indices))
    facts = (sorted_indices, unique_indices, lengths)
    widening = widening_for(bound, lengths)
    if widening is not None and _widening_chosen(widening, bound, out, precision, facts, autotune, check_indices):
        inner, buffer = widened_bound(widening, bound)
        options = dict(backend=backend, precision=precision, autotune=autotune, check_indices=check_indices)
        return run_widened(widening, buffer, out, bound.stmt.accumulate, lambda: run(
            inner, buffer, **options, sorted_indices=sorted_indices, unique_indices=unique_indices, lengths=lengths))
    try:
        kernel = kernel_for(
            bound, precision=precision, sorted_indices=sorted_indices, unique_indices=unique_indices, lengths=lengths
        )
    except UnsupportedStatement as e:
        if backend == "triton":
            raise
        key = str(bound.stmt)
        if key not in _WARNED_FALLBACK:
            _WARNED_FALLBACK[key] = None
            warnings.warn(f"insum: falling back to the torch lowering: {e}", stacklevel=3)
        return run_reference(bound, out)
    _check_indices(bound, out, device_check=_checking(check_indices))
    return kernel.launch(bound, out, autotune=autotune)


#: Per statement, signature and facts: whether its product runs widened (`insum.widening`),
#: as timed on its first call.
_WIDENED: BoundedCache[tuple, bool] = BoundedCache()


def _widening_key(bound: Bound, precision, facts: tuple) -> tuple | None:
    return None if bound.signature is None else (bound.stmt, bound.signature, precision, *facts)


def _widening_chosen(widening, bound: Bound, out: torch.Tensor, precision, facts: tuple, autotune, check_indices) -> bool:
    """Whether `bound` runs in widened rows: INSUM_WIDEN=1 always; otherwise, where a GPU
    times it (compiled, tuning on, not inside a CUDA graph's capture), the faster of the two
    runs on this first call, kept per signature; elsewhere not (untimed, the copies may cost
    more than they save)."""
    if widening_forced():
        return True
    key = _widening_key(bound, precision, facts)
    chosen = _WIDENED.get(key) if key is not None else None
    if chosen is not None:
        return chosen
    if key is None or not _can_time(bound, autotune):
        return False
    _check_indices(bound, out, device_check=_checking(check_indices))  # (before the timed launches)
    try:
        chosen = _widened_is_faster(widening, bound, out, precision, facts, autotune)
    except UnsupportedStatement:
        return False  # (the plain run reports it, or falls back)
    _WIDENED[key] = chosen
    return chosen


def _can_time(bound: Bound, autotune) -> bool:
    """Whether a first call may time its launches: compiled on a GPU, tuning on, and not
    inside a CUDA graph's capture."""
    from .runtime import _interpreting, _tuning_enabled

    return (bound.device.type == "cuda" and not _interpreting() and _tuning_enabled(autotune)
            and not torch.cuda.is_current_stream_capturing())


def _time_launch(fn) -> float:
    """Milliseconds per call of `fn` (the median of a few do_bench repetitions; host time
    included where it exceeds the device's)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=20, return_mode="median")


def _widened_is_faster(widening, bound: Bound, out: torch.Tensor, precision, facts: tuple, autotune) -> bool:
    """Time `bound`'s product as it is and widened (each tuned first), into a scratch copy of
    `out`."""
    from .runtime import kernel_for

    sorted_indices, unique_indices, lengths = facts
    plain = kernel_for(
        bound, precision=precision, sorted_indices=sorted_indices, unique_indices=unique_indices, lengths=lengths
    ).prepared(bound)
    inner, _ = widened_bound(widening, bound, values=False)
    widened = WidenedLaunch(widening, _prepared_launch(inner, precision, sorted_indices, unique_indices, lengths),
                            bound.stmt.accumulate, bound.output_name)
    scratch = out.clone()
    times = []
    for launch in (plain, widened):
        launch.run(bound.tensors, scratch, autotune)  # compiles and tunes
        times.append(_time_launch(lambda launch=launch: launch.run(bound.tensors, scratch)))
    return times[1] < times[0]


def staging_for(bound: Bound, lengths: Lengths):
    """The staging of a gathered operand for `bound` (`insum.codegen.stage`), or None: none
    qualifies, lengths are declared (the staged copy would read the padding), or
    INSUM_STAGE is off."""
    if lengths or not flag("INSUM_STAGE", default=True):
        return None
    from .codegen.stage import staging

    return staging(bound.stmt, bound.extents)


def staged_bounds(staged, bound: Bound) -> tuple[Bound, Bound]:
    """The gather and the product of a staged statement, bound to `bound`'s tensors and a new
    staged tensor (uninitialised: the gather writes all of it)."""
    source = bound.tensors[staged.source]
    S = torch.empty([bound.extents[v] for v in staged.variables], dtype=source.dtype, device=bound.device)
    tensors = {**bound.tensors, staged.name: S}
    parts = []
    for stmt in (staged.gather, staged.main):
        names = {access.name for access, _ in stmt.walk()}
        parts.append(bind(stmt, {n: t for n, t in tensors.items() if n in names}))
    return parts[0], parts[1]


def facts_in(bound: Bound, sorted_indices: frozenset[str], unique_indices: frozenset[str]) -> dict:
    """The declared facts about index tensors that `bound`'s statement still reads."""
    names = set(bound.index_names)
    return {"sorted_indices": sorted_indices & names, "unique_indices": unique_indices & names}


class _StagedLaunch:
    """A staged statement's two prepared launches, repeated: the gather into a new staged
    tensor, then the product. Not pinned and not batched (those take single launches)."""

    composite = True

    def __init__(self, gather, main, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.gather, self.main = gather, main
        self.name, self.shape, self.dtype, self.device = name, shape, dtype, device

    @property
    def config(self):
        return self.main.config

    @property
    def launched(self) -> bool:
        return self.main.launched

    def run(self, tensors, out: torch.Tensor, autotune: bool | None = None) -> torch.Tensor:
        S = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.gather.run(tensors, S, autotune)
        return self.main.run({**tensors, self.name: S}, out, autotune)

    def pin(self, fixed) -> None:
        return None


def declared_key(names) -> object:
    """A declaration of index tensor names (sorted_indices, unique_indices) as part of a
    prepared call's key: a set, list or one name given for the documented frozenset finds
    the same prepared call (an unhashable key would send every call down the full path);
    anything else is left for the full path to report."""
    if isinstance(names, str):
        return frozenset((names,))
    if isinstance(names, (set, list, tuple)):
        try:
            return frozenset(names)
        except TypeError:
            return names
    return names


def facts_key(facts: Mapping) -> tuple:
    """A call's declared facts (`sorted_indices`, `unique_indices` in a facts dict) as the
    tail of its prepared call's key, as `insum()` keys its own (`declared_key`)."""
    return (declared_key(facts.get("sorted_indices", frozenset())), declared_key(facts.get("unique_indices", frozenset())))


def call_signature(tensors: dict) -> tuple | None:
    """What a repeated call must share with the prepared one: per tensor its name, dtype,
    shape, strides, device and requires_grad (None for anything but plain tensors: fake and
    functional tensors while tracing, non-tensors, which the full path reports)."""
    signature = []
    try:
        for name, t in tensors.items():
            if type(t) not in PLAIN_TENSORS or t.is_neg():  # (a negative-bit view: the full path refuses it)
                return None
            signature.append((name, t.dtype, t.shape, t.stride(), t.device, t.requires_grad))
    except RuntimeError:  # sparse CSR/CSC and nested tensors have no strides or sizes: the full path reports them
        return None
    return tuple(signature)


class Prepared:
    """An eager call that ran once, ready to repeat on tensors of its signature.

    It holds the binding without tensors and, for the generated kernel, the launch the
    kernel prepared for the signature; a repeated call allocates the output if it was not
    given, checks indices if asked, and launches.
    """

    __slots__ = (
        "bound", "out_name", "launcher", "device_check", "autotune", "env", "aligned", "requires_grad", "inputs",
        "lengths",
    )

    def __init__(
        self, bound: Bound, launcher, device_check: bool, autotune: bool | None, aligned: tuple | None, lengths: tuple
    ):
        self.bound = bound.with_tensors({})
        self.lengths = lengths  # (key in `lengths=`, the binding's name, its order read?), per declared length
        self.out_name = bound.output_name
        self.inputs = bound.value_names + bound.index_names
        self.launcher = launcher  # None: the torch lowering
        self.device_check = device_check
        self.autotune = autotune
        self.env = snapshot()
        self.aligned = aligned  # value tensors' 16-byte alignment when the kernel depends on it
        self.requires_grad = any(t.requires_grad for t in bound.tensors.values())

    def __call__(self, tensors: dict, lengths: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        if self.lengths and lengths is not None:  # (a pinned call holds them under their names)
            tensors = with_lengths(tensors, lengths, self.lengths)
        out = tensors.get(self.out_name)
        bound = self.bound
        if out is None:
            # An overwriting launch fills what its kernel leaves unwritten itself (`zero_fill`).
            out = (torch.empty if self.launcher is not None and not bound.stmt.accumulate else torch.zeros)(
                bound.out_shape, dtype=bound.out_dtype, device=bound.device)
        if self.launcher is None:
            return run_reference(bound.with_tensors(tensors), out)
        if self.device_check:
            _check_indices(bound.with_tensors(tensors), out, device_check=True)
        return self.launcher.run(tensors, out, self.autotune)


_PREPARED: BoundedCache[tuple, Prepared] = BoundedCache()  # (text, options, call signature) -> call


def _lengths_signature(lengths: Mapping | None) -> tuple | None:
    """The declared lengths' part of a call signature: () for none, None for anything but
    plain tensors (the full path reports it)."""
    return tensor_signature(lengths) if lengths else ()


def prepared(expr: str, options: tuple, tensors: dict, lengths: Mapping | None = None) -> Prepared | None:
    """The prepared call for `expr` with these options, tensors and declared lengths, or None
    when the full path must run (nothing prepared, or something it depends on changed).
    Raises the full path's error for an output that shares memory with an input."""
    signature = call_signature(tensors)
    extra = _lengths_signature(lengths)
    if signature is None or extra is None:
        return None
    if extra:
        signature += extra
    try:
        call = _PREPARED.get((expr, options, signature))
    except TypeError:  # an unhashable option value: the full path reports it
        return None
    if call is None or call.env != snapshot():
        return None
    if call.requires_grad and torch.is_grad_enabled():
        return None
    if call.aligned is not None and call.aligned != _alignment(call.bound.value_names, tensors):
        return None
    check_aliasing(call.bound.stmt, call.inputs, tensors)
    return call


def _alignment(names, tensors) -> tuple[bool, ...]:
    """Whether each named tensor starts 16-byte aligned (what descriptor kernels depend on)."""
    return tuple([tensors[n].data_ptr() % 16 == 0 for n in names])


def prepare(
    expr: str,
    options: tuple,
    bound: Bound,
    tensors: dict,
    *,
    lengths: Mapping | None = None,
    declared: Lengths = (),
    backend: Backend = "auto",
    precision: Precision = "tf32",
    autotune: bool | None = None,
    check_indices: bool | None = None,
    sorted_indices: frozenset[str] = frozenset(),
    unique_indices: frozenset[str] = frozenset(),
) -> None:
    """Keep what the call that just ran on `bound` decided, for `prepared` to find (only for
    plain tensors, and only after the call succeeded: its checks have passed). tensors: the
    call's own (`bound` also holds the tensors of its declared lengths)."""
    signature = call_signature(tensors)
    extra = _lengths_signature(lengths)
    if signature is None or extra is None or bound.signature is None:
        return
    if extra:
        signature += extra
    launcher, aligned = None, None
    if not (backend == "torch" or (backend == "auto" and bound.device.type != "cuda")):
        from .runtime import descriptors_supported

        try:
            launcher = _prepared_launch(bound, precision, sorted_indices, unique_indices, declared)
        except UnsupportedStatement:
            pass  # it fell back to the torch lowering (backend "auto"), as it will again
        else:
            if launcher.config is None and launcher.launched:
                return  # not run yet (nothing to repeat)
            if descriptors_supported(bound.device):
                aligned = _alignment(bound.value_names, bound.tensors)
    try:
        # A repeat passes a length's order only where the kernel reads it (`Plan.ordered`).
        read = {order for _, order in launcher.kernel.plan.ordered} if declared and launcher is not None else set()
        names = tuple((key, name, order in read) for key, (_, name, _, order) in zip(lengths or {}, declared))
        _PREPARED[(expr, options, signature)] = Prepared(bound, launcher, _checking(check_indices), autotune, aligned, names)
    except TypeError:
        return


def _prepared_launch(bound: Bound, precision, sorted_indices, unique_indices, lengths: Lengths):
    """The launch a call on `bound` ran (prepared per signature by its kernel), or for a
    staged statement its two launches as one `_StagedLaunch`, for a widened one its launch
    in widened rows (`insum.widening`)."""
    from .runtime import kernel_for

    staged = staging_for(bound, lengths)
    if staged is None:
        widening = widening_for(bound, lengths)
        key = _widening_key(bound, precision, (sorted_indices, unique_indices, lengths))
        if widening is not None and (widening_forced() or (key is not None and _WIDENED.get(key, False))):
            inner, _ = widened_bound(widening, bound, values=False)
            launch = _prepared_launch(inner, precision, sorted_indices, unique_indices, lengths)
            return WidenedLaunch(widening, launch, bound.stmt.accumulate, bound.output_name)
        kernel = kernel_for(
            bound, precision=precision, sorted_indices=sorted_indices, unique_indices=unique_indices, lengths=lengths
        )
        return kernel.prepared(bound)
    parts = []
    for part in staged_bounds(staged, bound):
        facts = facts_in(part, sorted_indices, unique_indices)
        parts.append(_prepared_launch(part, precision, facts["sorted_indices"], facts["unique_indices"], ()))
    source = bound.tensors[staged.source]
    shape = tuple(bound.extents[v] for v in staged.variables)
    return _StagedLaunch(parts[0], parts[1], staged.name, shape, source.dtype, bound.device)


def run_and_prepare(
    expr: str,
    key: tuple,
    bound: Bound,
    tensors: dict,
    lengths: Mapping | None,
    sorted_indices: frozenset[str],
    unique_indices: frozenset[str],
    **options,
) -> torch.Tensor:
    """The full path of a direct call, bound already: check the facts, attach the declared
    lengths, run into the given (or a new) output, and keep the call for `prepared` under
    `key`. Shared by `insum()` and the operators' implementations (`insum.library`)."""
    facts = sorted_facts(bound, sorted_indices) if sorted_indices else frozenset()
    unique = sorted_facts(bound, unique_indices, "unique_indices") if unique_indices else frozenset()
    declared = ()
    if lengths:
        bound, declared = length_facts(bound, lengths)
    out = run(bound, bound.output(), sorted_indices=facts, unique_indices=unique, lengths=declared, **options)
    prepare(expr, key, bound, tensors, lengths=lengths, declared=declared, sorted_indices=facts, unique_indices=unique,
            **options)
    return out


class PreparedBatch:
    """Several prepared calls that run as one launch (`runtime.BatchLaunch`).

    Keyed by the statements, the options, which tensor each name is (by position among the
    distinct tensors of the calls) and the distinct tensors' signatures, so that a tensor
    shared by the calls (a format's B and C) is looked at once.
    """

    __slots__ = ("launch", "outputs", "out_names", "env", "requires_grad", "aligned")

    def __init__(
        self, launch, outputs: tuple[int, ...], out_names: tuple[str, ...], requires_grad: bool, aligned: tuple = ()
    ):
        self.launch = launch
        self.outputs = outputs  # positions of the outputs among the distinct tensors
        self.out_names = out_names
        self.env = snapshot()
        self.requires_grad = requires_grad
        # (position of the call, its Prepared) for each part whose kernel loads through
        # tensor descriptors: they need the value tensors' alignment it was compiled for.
        self.aligned = aligned

    @property
    def covers(self) -> bool:
        """Whether the launch writes every element of its outputs (`runtime.BatchLaunch`)."""
        return self.launch.covers

    def __call__(self, calls) -> list[torch.Tensor]:
        outs = [call[1][name] for call, name in zip(calls, self.out_names)]
        self.launch.run([(call[1], out) for call, out in zip(calls, outs)])
        return outs


_BATCHED: BoundedCache[tuple, PreparedBatch] = BoundedCache()


def _batch_key(calls, options: tuple) -> tuple[tuple, list] | None:
    """(key, distinct tensors) of several calls, None for anything but plain tensors."""
    seen: dict[int, int] = {}
    distinct: list = []
    structure: list = []
    for call in calls:
        tensors = call[1]
        positions = []
        for t in tensors.values():
            position = seen.get(id(t))
            if position is None:
                if not keyable(t):
                    return None
                position = seen[id(t)] = len(distinct)
                distinct.append(t)
            positions.append(position)
        # (facts as insum() keys its own: a set or list of names finds the same batch)
        structure.append((call[0], tuple(tensors), tuple(positions), facts_key(call[2]) if len(call) > 2 else ()))
    signature = tuple([(t.dtype, t.shape, t.stride(), t.device, t.requires_grad) for t in distinct])
    return (tuple(structure), options, signature), distinct


def prepared_batch(calls, options: tuple) -> PreparedBatch | None:
    """The one-launch form of `calls` (each an (expr, tensors) pair run with `options`), or
    None when they must run one by one (not prepared, or something they depend on changed,
    or an output shares memory with an input: each call then reports it, or runs in order)."""
    found = _batch_key(calls, options)
    if found is None:
        return None
    key, distinct = found
    try:
        batch = _BATCHED.get(key)
    except TypeError:
        return None
    if batch is None or batch.env != snapshot():
        return None
    if batch.requires_grad and torch.is_grad_enabled():
        return None
    for position, call in batch.aligned:
        if call.aligned != _alignment(call.bound.value_names, calls[position][1]):
            return None
    written = set()
    for position in batch.outputs:
        out = distinct[position]
        if out.numel():
            written.add(out.untyped_storage().data_ptr())
    for position, t in enumerate(distinct):
        if position not in batch.outputs and t.numel() and t.untyped_storage().data_ptr() in written:
            return None
    return batch


def prepare_batch(calls, options: tuple) -> None:
    """After `calls` ran one by one through `insum()`, keep their one-launch form where every
    call ran the generated kernel, adding into its given output atomically, with no index
    check on the device (one call too under a covering claim: its `=` launch needs no fill)."""
    from .runtime import batch_launch  # loaded already: the calls ran the generated kernel

    found = _batch_key(calls, options)
    if found is None or (len(calls) < 2 and not options[-1]):
        return
    key, distinct = found
    parts, outputs, out_names, aligned = [], set(), [], []
    backend, precision, autotune, check_indices, disjoint, covering = options
    for expr, tensors, *facts in calls:
        facts = facts[0] if facts else {}
        one = (backend, precision, autotune, check_indices, *facts_key(facts))
        call = _PREPARED.get((expr, one, call_signature(tensors)))
        if call is None or call.launcher is None or call.device_check or call.out_name not in tensors:
            return
        if getattr(call.launcher, "composite", False):  # several launches: not one part of a batch
            return
        parts.append(call.launcher)
        out_names.append(call.out_name)
        if call.aligned is not None:
            aligned.append((len(parts) - 1, call))
        outputs.add(next(i for i, t in enumerate(distinct) if t is tensors[call.out_name]))
    # One launch runs the calls' programs in any order: none may read another's output (the
    # repeated call's storage check covers distinct tensors that share memory, this the same one).
    read = {id(t) for (_, tensors, *_), out in zip(calls, out_names) for name, t in tensors.items() if name != out}
    if any(id(distinct[position]) in read for position in outputs):
        return
    try:
        launch = batch_launch(parts, disjoint, covering)
    except UnsupportedStatement:
        return
    requires_grad = any(t.requires_grad for t in distinct)
    try:
        _BATCHED[key] = PreparedBatch(launch, tuple(sorted(outputs)), tuple(out_names), requires_grad, tuple(aligned))
    except TypeError:
        return


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DATA_PTR = torch.Tensor.data_ptr


class Pinned:
    """Prepared calls (one `insum()`, or several as one `insum_many()` launch) whose tensors,
    but for a few `varying` names, are the same objects on every call: a format's packed
    tensors, with B and C varying.

    The repeated call (`prepared`, `prepared_batch`) looks at every tensor on every call;
    here a pinned tensor is looked at once, when the calls are pinned, and the kernels read
    views of them taken then: an in-place change of a packed tensor's shape or strides
    (`resize_`, `as_strided_`) cannot make a kernel read outside the memory checked then.
    Per call `ready` checks what can still change: the environment switches, gradients
    (`requires_grad_` works in place), and the pinned tensors' memory (`.data =`, `set_` or a
    growing `resize_` move it: their pointers are compared); `run` checks the varying
    tensors' alignment where a kernel depends on it. Values updated in place are read by
    the next call (data, not signature). Not checked, the caller's part: the varying tensors'
    signature (the caller keys its pin on it), and aliasing (the caller allocates the
    outputs for each call, so nothing else shares their memory).
    """

    __slots__ = ("launch", "parts", "fixed", "pointers", "env", "aligned", "arguments")

    def __init__(self, launch, calls, varying: frozenset[str], aligned: tuple):
        self.launch = launch  # a Prepared (one call) or a PreparedBatch
        fixed: dict[int, torch.Tensor] = {}
        parts = []
        with torch.no_grad():
            for call in calls:
                part = {}
                for name, t in call[1].items():
                    if name not in varying:
                        fixed[id(t)] = t
                        part[name] = t.as_strided(t.shape, t.stride())
                parts.append(part)
        self.parts = tuple(parts)  # per call, views of its pinned tensors by name
        self.fixed = tuple(fixed.values())
        self.pointers = tuple(map(_DATA_PTR, self.fixed))
        self.env = launch.env
        # Per call whose kernel depends on alignment: its varying value tensors' names and
        # the alignment it was prepared for (the pinned ones' was checked when prepared, and
        # `moved` sees their memory move).
        checks = []
        for _, call in aligned:
            names = call.bound.value_names
            checks.append((tuple(n for n in names if n in varying), tuple(ok for n, ok in zip(names, call.aligned) if n in varying)))
        self.aligned = tuple(checks)
        # The argument list with the pinned tensors in place (None: the Prepared call runs on
        # the tensors by name, as where the torch lowering runs or indices are checked).
        if type(launch) is PreparedBatch:
            self.arguments = launch.launch.pin(self.parts)
        elif launch.launcher is not None and not launch.device_check:
            self.arguments = launch.launcher.pin(self.parts[0])
        else:
            self.arguments = None

    @property
    def covers(self) -> bool:
        """Whether the pinned launch writes every element of its outputs, so that they may be
        allocated uninitialised (a batch under a covering claim: `runtime.BatchLaunch`)."""
        return type(self.launch) is PreparedBatch and self.launch.covers

    def ready(self, *inputs: torch.Tensor) -> bool:
        """Whether the pinned calls may run now, with varying `inputs` (for gradients)."""
        if snapshot() != self.env:
            return False
        if torch.is_grad_enabled() and (any(map(_REQUIRES_GRAD, self.fixed)) or any(map(_REQUIRES_GRAD, inputs))):
            return False
        return not self.moved()

    def moved(self) -> bool:
        """Whether the memory under a pinned tensor moved (its views then read the old memory)."""
        return tuple(map(_DATA_PTR, self.fixed)) != self.pointers

    def run(self, varying: dict[str, torch.Tensor]) -> bool:
        """Run the calls with the `varying` tensors (after `ready`); False, having run
        nothing, when a varying tensor is aligned otherwise than the kernels were chosen for."""
        for names, expected in self.aligned:
            if _alignment(names, varying) != expected:
                return False
        launch, arguments = self.launch, self.arguments
        if arguments is None:
            launch({**self.parts[0], **varying})
        elif type(launch) is Prepared:
            launch.launcher.run(arguments(varying), varying[launch.out_name], launch.autotune)
        else:
            launch.launch.run(arguments(varying))
        return True


#: How many times a caller that repeats calls (a format's SpMM plan and gradient call sites,
#: a tensor product's statements) runs them through the full path trying to `pin` them: a
#: call that did not pin by then (its tensors change, a gradient is recorded) stays unpinned.
PIN_TRIES = 2


def pin(
    calls,
    *,
    varying: frozenset[str],
    backend: Backend = "auto",
    precision: Precision = "tf32",
    autotune: bool | None = None,
    check_indices: bool | None = None,
    disjoint: bool = False,
    covering: int | None = None,
) -> Pinned | None:
    """The calls that just ran through `insum()` (one) or `insum_many()` (several) with these
    options, pinned to their tensors but the `varying` ones, which must name the outputs
    (given, allocated anew for each call); None where they would not repeat (nothing
    prepared, gradients, torch.compile). Checks everything the repeat checks, once. A call's
    facts are its `sorted_indices` / `unique_indices` and, for one call, `lengths` (its
    declared lengths' tensors are then pinned too). disjoint, covering: as for `insum_many`."""
    if torch.compiler.is_compiling():
        return None
    head = (backend, precision, autotune, check_indices)
    if len(calls) == 1 and not covering:
        expr, tensors, *facts = calls[0]
        facts = facts[0] if facts else {}
        key = (*head, *facts_key(facts))
        lengths = facts.get("lengths")
        try:
            launch = prepared(expr, key, tensors, lengths)
        except InsumError:
            return None
        if launch is None or launch.out_name not in varying:
            return None
        if launch.lengths:  # the declared lengths' tensors, pinned under the binding's names
            calls = [(expr, with_lengths(tensors, lengths, launch.lengths))]
        aligned = ((0, launch),) if launch.aligned is not None else ()
        return Pinned(launch, calls, varying, aligned)
    batch = prepared_batch(calls, (*head, disjoint, covering))
    if batch is None or not varying.issuperset(batch.out_names):
        return None
    return Pinned(batch, calls, varying, batch.aligned)
