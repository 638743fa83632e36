"""Outputs whose rows are not a whole vector wide, run in rows padded to one.

Triton vectorises a tile's loads, stores and atomics along the last dimension only where it
can prove that rows start a vector apart and that the mask over a row keeps a vector's lanes
alike: strides and extent divisible by 16 elements, or by the multiples a kernel states
(`runtime.stride_multiples`, `extent_multiples`: vectors of 4 bytes or more). Rows of fp16
an odd number of elements wide (N = 1001; a graph's 1433 features) get neither: the kernel
loads B one element at a time, outside the asynchronous copies' pipeline, and adds into C
with scalar atomics. H200, fp16, session 17: grouped BlockGroupCOO 4096^2 into 1001 columns
171 µs against 46 µs into 1002; GroupCOO 8192^2 490 µs against 231 µs into 1000.

Where the output's last index is a plain variable that indexes nothing but the last
dimension of the tensors it appears in, every output element of that variable's value v
reads only elements of value v. The product can then run with the variable widened to a
multiple of ROW_ELEMENTS: the tensors it indexes are copied into rows that wide, the
output is computed in such rows and its first columns copied back. The extra columns reach
only the output's extra columns, which are dropped.

The copies cost a pass over each widened tensor (two over the output, three for `+=`), a
launch each and host time, which a fast product does not win back: H200, fp16, into 1001
columns (session 18, `explore/shapes --only widen`), GroupCOO g=32 8192^2 489 -> 269 µs,
ELL 391 -> 264, grouped BlockGroupCOO 4096^2 172 -> 61, but Block-ELL 4096^2 64x64 32 -> 43
µs and a GroupCOO 1024^2 37 -> 55 µs. So the runtime considers only rows aligned to fewer
than WIDEN_BELOW_BYTES whose tensors hold WIDEN_MIN_BYTES or more and whose widening adds
at most WIDEN_MAX_RATIO times the work, and where the product runs compiled on a GPU with
tuning on it times both runs on the signature's first call (after tuning each) and keeps the
faster (`execute.run`); untimed (tuning off, a CUDA graph's capture) it keeps the plain run,
and so do `insum_many`'s statements (`plain_rows`). `INSUM_WIDEN=0` never widens;
`INSUM_WIDEN=1` widens every product that qualifies, untimed, on CPU tensors too (the
interpreter's tests).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from .bind import Bound
from .settings import flag

__all__ = [
    "ROW_ELEMENTS", "WIDEN_BELOW_BYTES", "WIDEN_MIN_BYTES", "WIDEN_MAX_RATIO", "Widening", "widening_for", "widening_forced",
    "widened_bound", "widened_tensors", "run_widened", "WidenedLaunch", "plain_rows",
]

#: Widened rows are a multiple of this many elements: Triton specialises an extent or a
#: stride divisible by 16 without being told.
ROW_ELEMENTS = 16
#: Rows aligned to fewer bytes than this are considered: a 16-byte vector is the widest
#: load, store and atomic (8 fp16); below 4 bytes (odd fp16 or bf16 widths) no load of a row
#: joins the cp.async pipeline at all. H200 (session 18): GroupCOO 8192^2 into 1002 fp16
#: columns (4-byte rows) 300 -> 272 µs, into 1001 float32 columns 504 -> 458 µs; the timed
#: choice kept the plain run wherever widening did not pay.
WIDEN_BELOW_BYTES = 16
#: The least bytes (the widened inputs and the output together) worth the copies' launches.
WIDEN_MIN_BYTES = 1 << 20
#: The most the widening may multiply the work by: a narrow extent (an SpMV's 1 column)
#: would not win back 16 times the work, and its first call would compile a second kernel
#: to find out.
WIDEN_MAX_RATIO = 1.5


@dataclass(frozen=True)
class Widening:
    """Run `variable` (extent `extent`) as `width` columns; `names`: the inputs it indexes."""

    variable: str
    extent: int
    width: int
    names: tuple[str, ...]

    def __str__(self) -> str:
        inputs = f"{', '.join(self.names)} copied, " if self.names else ""
        return f"{self.variable}: {self.extent} -> {self.width} columns ({inputs}the output through a buffer)"


def _row_bytes(shape, strides, element_size: int) -> int:
    """The bytes every row start of a tensor and its row's width are a multiple of (at most 16)."""
    common = shape[-1]
    for size, stride in zip(shape[:-1], strides[:-1]):
        if size > 1:
            common = math.gcd(common, stride)
    return min(element_size * (common & -common), 16) if common else 16


_PLAIN_ROWS: ContextVar[bool] = ContextVar("insum_plain_rows", default=False)


@contextlib.contextmanager
def plain_rows() -> Iterator[None]:
    """Within it no product widens: `insum_many`'s first calls, whose statements its repeats
    run as one batched launch (a widened statement, several launches, would run apart)."""
    token = _PLAIN_ROWS.set(True)
    try:
        yield
    finally:
        _PLAIN_ROWS.reset(token)


def _enabled(device: torch.device) -> bool:
    return flag("INSUM_WIDEN", default=device.type == "cuda")


def widening_forced() -> bool:
    """INSUM_WIDEN on (1, true, yes, on): widen every product that qualifies, untimed."""
    return flag("INSUM_WIDEN", default=False)


def widening_for(bound: Bound, lengths=()) -> Widening | None:
    """How to run `bound` in widened rows (see the module's docstring), or None: not on,
    not such a statement, rows aligned enough, tensors too small. `lengths`: the declared
    lengths' facts (`execute.length_facts`); a length indexed by the variable rules it out."""
    stmt = bound.stmt
    if not stmt.output.indices or _PLAIN_ROWS.get() or not _enabled(bound.device):
        return None
    var = stmt.output.indices[-1].variable
    if var is None or bound.roles.get(var) != "output":
        return None
    extent = bound.extents[var]
    width = -(-extent // ROW_ELEMENTS) * ROW_ELEMENTS
    if width == extent or width > WIDEN_MAX_RATIO * extent:
        return None
    if any(var in index for _, _, index, _ in lengths):
        return None
    names: dict[str, None] = {}
    apart: set[str] = set()
    for access, as_index in stmt.walk():
        if var not in access.variables():
            apart.add(access.name)
            continue
        if as_index or access.indices[-1].variable != var or any(var in i.variables() for i in access.indices[:-1]):
            return None
        if access.name != stmt.output.name:
            names[access.name] = None
    if apart & set(names):  # a tensor also read where the variable does not index it
        return None
    layouts = [(t.shape, t.stride(), t.element_size()) for t in (bound.tensors[n] for n in names)]
    layouts.append((bound.out_shape, bound.output_strides(), bound.out_dtype.itemsize))
    if any(strides[-1] != 1 or 0 in shape for shape, strides, _ in layouts):
        return None
    if min(_row_bytes(*layout) for layout in layouts) >= WIDEN_BELOW_BYTES:
        return None
    if sum(math.prod(shape) * size for shape, _, size in layouts) < WIDEN_MIN_BYTES:
        return None
    return Widening(var, extent, width, tuple(names))


def _widened(t: torch.Tensor, widening: Widening, values: bool = True) -> torch.Tensor:
    """`t` in rows `widening.width` wide: copied, zeros in the extra columns (one operation:
    the host time of a call counts too), or uninitialised (`values` False)."""
    if values:
        return torch.constant_pad_nd(t, (0, widening.width - widening.extent))
    return t.new_empty(*t.shape[:-1], widening.width)


def widened_tensors(
    widening: Widening, tensors, out_shape, out_dtype: torch.dtype, device: torch.device, values: bool = True
) -> tuple[dict, torch.Tensor]:
    """`tensors` with the widened inputs in rows `widening.width` wide (copied in; without
    `values`, uninitialised), and an uninitialised buffer for an output of `out_shape` in
    such rows (`run_widened` fills it)."""
    widened = dict(tensors)
    for name in widening.names:
        widened[name] = _widened(tensors[name], widening, values)
    return widened, torch.empty(*out_shape[:-1], widening.width, dtype=out_dtype, device=device)


def widened_bound(widening: Widening, bound: Bound, values: bool = True) -> tuple[Bound, torch.Tensor]:
    """`bound` with the variable's extent widened, over the widened tensors and the output's
    buffer (given as the binding's output; uninitialised). values: the inputs copied in;
    without, uninitialised tensors of their widened layout, for what reads the binding's
    layout only (a prepared launch, `explain`)."""
    tensors, buffer = widened_tensors(widening, bound.tensors, bound.out_shape, bound.out_dtype, bound.device, values)
    tensors[bound.output_name] = buffer
    return bound.with_extent(widening.variable, widening.width, tensors), buffer


class WidenedLaunch:
    """A prepared launch (`runtime._Launcher`, for the widened signature) run on copies in
    widened rows, its output copied back. Several launches: not part of a batch. Pinned
    (`execute.Pinned`) where the widened tensors all vary per call: the inner launch's
    pinned arguments, whose varying tensors each call widens (`run`)."""

    composite = True

    def __init__(self, widening: Widening, inner, accumulate: bool, out_name: str):
        from .runtime import PinnedCall  # (loaded already: the inner launch is the runtime's)

        self.widening, self.inner, self.accumulate, self.out_name = widening, inner, accumulate, out_name
        self.pinned_call = PinnedCall

    @property
    def config(self):
        return self.inner.config

    @property
    def launched(self) -> bool:
        return self.inner.launched

    @property
    def kernel(self):
        return self.inner.kernel

    def run(self, tensors, out: torch.Tensor, autotune: bool | None = None) -> torch.Tensor:
        """Run on `tensors` (by name, or a `runtime.PinnedCall` of `pin`'s arguments) into `out`."""
        pinned = type(tensors) is self.pinned_call
        widened, buffer = widened_tensors(self.widening, tensors.varying if pinned else tensors, out.shape, out.dtype,
                                          out.device)
        if pinned:
            widened[self.out_name] = buffer
            widened = self.pinned_call(tensors.pinned, widened)
        return run_widened(self.widening, buffer, out, self.accumulate,
                           lambda: self.inner.run(widened, buffer, autotune))

    def pin(self, fixed):
        """The inner launch's pinned arguments, or None where a pinned tensor is one to widen."""
        if any(name in fixed for name in self.widening.names):
            return None
        return self.inner.pin(fixed)


def run_widened(widening: Widening, buffer: torch.Tensor, out: torch.Tensor, accumulate: bool, launch) -> torch.Tensor:
    """Run `launch()`, which computes into the widened `buffer` (starting from `out`'s values
    for a `+=` statement), and copy the buffer's first columns into `out`."""
    columns = buffer[..., : widening.extent]
    if accumulate:
        columns.copy_(out)
    launch()
    return out.copy_(columns)
