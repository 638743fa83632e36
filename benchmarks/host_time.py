"""Host time per cached call: what `insum()` and `fmt @ B` cost the host around a launch.

    python -m benchmarks.host_time [--calls 2000] [--repeats 5] [--label TEXT] [--log FILE]

On the CPU (run it with TRITON_INTERPRET=1) the kernel launch itself is stubbed: every
cached kernel's JIT function is replaced by a no-op (and so is the compiled kernel that a
direct launch calls), so what is measured is insum's own work per call, the part that a
GPU host pays on top of Triton's launch. "stub launch" is the stubbed launch alone, as
insum prepared it. "SparseLinear forward" is a GroupCOO layer's forward (grad enabled, its
parameters require grad) on a batch of N, "forward+backward" adds its backward (the transposed
pattern's input gradient and the values' derived gradient, accumulated into .grad). "CELL" packs
its covering layout (one launch of stores into `torch.empty`), "CELL cover=False" the plain
one (the same launch adding into a zero-filled C). "GroupCOO short rows" and "COO short rows"
pack a matrix of rows of 0 to 6 entries (their covering layout: one launch of stores into
`torch.empty`), "... cover=False" the same matrix plainly (a zero fill, then the launch); the
skewed matrix's hub row keeps "GroupCOO" and "COO" plain. "Block-ELL" packs the skewed
matrix in 16 x 16 blocks, one group per block row (B and C reach its kernel through views); its
statement with declared lengths also runs as `insum()` and as the `insum::insum_` operator that
a torch.compile graph calls. The formats run through `fmt.spmm(B, backend="triton")` there, since
`fmt @ B` takes the torch lowering on the CPU.

On CUDA nothing is stubbed: beside the same rows it times the bare JIT launch of the
cached kernel (`Kernel.launcher(bound)`, no insum around it), the same prepared launch
through insum's direct path alone (`insum.direct`, which skips the JIT's binding), and
cuSPARSE (`torch` CSR @ B), all in one process. The target (issue 10): `insum()` and `fmt @ B` within 10 µs of the bare
launch.

Each row: the median and the minimum over `repeats` runs of `calls` calls (after a warm-up),
in µs per call; the rows take turns, so that a loaded host slows them alike. On CUDA the
clock is the wall clock; stubbed on the CPU it is the thread's CPU time (a shared host's
other processes then count less).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch

import insum
from insum import runtime
from insum.bind import bind
from insum.formats import CELL, COO, ELL, BlockGroupCOO, GroupCOO
from insum.nn import SparseLinear
from insum.parser import parse

__all__ = ["cases", "launch_paths", "measure", "main"]

M, K, N = 128, 96, 16  # small: the interpreter runs each case once to warm up
GROUPCOO = "C[AM[p],n] += AV[p,q]*B[AK[p,q],n]"
DENSE = "C[m,n] = A[m,k]*B[k,n]"


def skewed_matrix(device) -> torch.Tensor:
    """An M x K matrix with power-law row lengths (one row of K entries, many of 1-4, a few
    empty), so that CELL packs several bucket widths."""
    gen = torch.Generator().manual_seed(7)
    lengths = (K / (torch.arange(M) + 1.0) ** 0.9).long().clamp(max=K)
    lengths[M // 3 : M // 3 + 4] = 0
    A = torch.zeros(M, K)
    for row, n in enumerate(lengths.tolist()):
        cols = torch.randperm(K, generator=gen)[:n]
        A[row, cols] = torch.randn(n, generator=gen)
    return A.to(device)


def short_rows_matrix(device) -> torch.Tensor:
    """An M x K matrix of rows of 0 to 6 entries: GroupCOO and COO pack it in their covering
    layout (every row within one aligned block of 16 groups), the skewed one's hub row cannot."""
    gen = torch.Generator().manual_seed(5)
    A = torch.zeros(M, K)
    for row, n in enumerate(torch.randint(0, 7, (M,), generator=gen).tolist()):
        A[row, torch.randperm(K, generator=gen)[:n]] = torch.randn(n, generator=gen)
    return A.to(device)


def cases(device: torch.device, formats_out: dict | None = None) -> dict[str, Callable[[], object]]:
    """name -> a no-argument call, for the tensors of one small problem on `device`
    (`formats_out`, if given, receives the format objects and B, for `launch_paths`)."""
    cuda = device.type == "cuda"
    backend = "auto" if cuda else "triton"
    gen = torch.Generator().manual_seed(3)
    A = skewed_matrix(device)
    B = torch.randn(K, N, generator=gen).to(device)
    group = GroupCOO.from_dense(A)
    tensors = dict(group.tensors, B=B, C=torch.zeros(M, N, device=device))
    dense_A = torch.randn(M, K, generator=gen).to(device)
    formats = {"GroupCOO": group, "ELL": ELL.from_dense(A), "CELL": CELL.from_dense(A), "COO": COO.from_dense(A)}
    # Block-ELL (16 x 16 blocks, whole blocks of M and K: B and C through views, no padding copy).
    formats["Block-ELL"] = BlockGroupCOO.from_dense(A, block=(16, 16), group_size="row")
    if "cover" in inspect.signature(CELL._pack).parameters:  # (an older tree, for an A/B, has no plain layout to ask for)
        formats["CELL cover=False"] = CELL.from_dense(A, cover=False)
    # GroupCOO and COO on short rows (their covering layout by default) beside the same matrix
    # packed plainly (an older tree, for an A/B, packs it plainly by default and has no cover=).
    short = short_rows_matrix(device)
    for cls in (GroupCOO, COO):
        formats[f"{cls.__name__} short rows"] = cls.from_dense(short)
        if "cover" in inspect.signature(cls._pack).parameters:
            formats[f"{cls.__name__} short rows cover=False"] = cls.from_dense(short, cover=False)
    if formats_out is not None:
        formats_out.update(formats, B=B)
    rows: dict[str, Callable[[], object]] = {
        "insum() GroupCOO +=, C given": lambda: insum.insum(GROUPCOO, backend=backend, **tensors),
        "insum() dense =, C allocated": lambda: insum.insum(DENSE, backend=backend, A=dense_A, B=B),
    }
    # Block-ELL's statement with its declared lengths, as insum() and as the operator a
    # torch.compile graph calls (its lengths among the tensors), into a given C.
    ell = formats["Block-ELL"]
    (ell_expr, ell_tensors), = ell.statements()
    ell_expr = ell_expr.replace("+=", "=")
    ell_C = torch.empty(ell.output_shape(N), device=device)
    ell_B, ell_lengths = ell.operand(B), ell.declared_lengths()
    rows["insum() Block-ELL, declared lengths"] = lambda: insum.insum(
        ell_expr, backend=backend, check_indices=False, lengths=ell_lengths, C=ell_C, B=ell_B, **ell_tensors)
    if hasattr(torch.ops.insum, "insum_"):
        names = ["B", *ell_tensors, *(f"lengths:{k}" for k in ell_lengths)]
        values = [ell_B, *ell_tensors.values(), *ell_lengths.values()]
        rows["insum::insum_ operator, Block-ELL"] = lambda: torch.ops.insum.insum_(
            ell_expr, ell_C, names, values, backend, "tf32", None, False)
    for name, fmt in formats.items():
        if cuda:
            rows[f"{name} @ B"] = lambda f=fmt: f @ B
        else:
            rows[f"{name}.spmm(B)"] = lambda f=fmt: f.spmm(B, backend="triton")
    layer = SparseLinear.from_format(group, torch.zeros(M, device=device), backend=backend)
    x, dy = torch.randn(N, K, generator=gen).to(device), torch.randn(N, M, generator=gen).to(device)
    rows["SparseLinear forward"] = lambda: layer(x)
    rows["SparseLinear forward+backward"] = lambda: layer(x).backward(dy)
    # The launch insum() prepared for the first row, alone (built when first called, so
    # that on the CPU it picks up the stub).
    rows["bare JIT launch" if cuda else "stub launch"] = _bare_launch(GROUPCOO, tensors)
    if cuda:
        rows["bare direct launch"] = _direct_launch(GROUPCOO, tensors)
        # What a hand-written accumulating SpMM pays: its zero-filled output, then the launch.
        bare = rows["bare JIT launch"]
        rows["torch.zeros + bare JIT launch"] = lambda: (torch.zeros(M, N, device=device), bare())
        csr = A.to_sparse_csr()
        rows["torch CSR @ B"] = lambda: csr @ B
    return rows


def launch_paths(formats: dict) -> list[str]:
    """Which path each format's repeated product takes (pinned or not, ready or not) and each
    cached launch's (direct or the JIT, and why): where a row's host time goes on CUDA."""
    B = formats["B"]
    lines = []
    for name, fmt in formats.items():
        if name == "B":
            continue
        for plan in (fmt.__dict__.get("_spmm_plans") or {}).values():
            pinned = plan.pinned
            state = "not pinned" if pinned is None else (
                f"pinned, {'by address' if pinned.arguments is not None else 'by name'}, ready={pinned.ready(B)}, "
                f"C {'torch.empty (the launch covers it)' if getattr(pinned, 'covers', False) else 'zero-filled' if plan.zeros else 'torch.empty'}")
            lines.append(f"  {name} @ B: {state}, tries={plan.tries}")
    launches = [launcher for kernel in _kernels() for launcher in getattr(kernel, "_launchers", {}).values()]
    for launch in launches + list(getattr(runtime, "_BATCHES", {}).values()):
        direct = getattr(launch, "direct", None)
        if direct is not None:
            state = "direct" if direct.enabled else f"JIT: {direct.why_not}"
            fill = ", zero fill" if getattr(launch, "zero_fill", False) else ""
            covers = f", covers={launch.covers}" if hasattr(launch, "covers") else ""
            lines.append(f"  {type(launch).__name__} grid {direct.grid}: {state}, compiled keys {len(direct.compiled)}{fill}{covers}")
    return lines


def _direct_launch(expr: str, tensors: dict) -> Callable[[], None]:
    """The same prepared launch through insum's direct path alone (`insum.direct`)."""
    bound = bind(parse(expr), tensors)
    kernel = runtime.kernel_for(bound)
    launcher = kernel.prepared(bound)
    args = launcher.args(bound.tensors, tensors["C"])
    return lambda: launcher.direct(kernel.fn, args)


def _bare_launch(expr: str, tensors: dict) -> Callable[[], None]:
    launch = None

    def call() -> None:
        nonlocal launch
        if launch is None:
            bound = bind(parse(expr), tensors)
            launch = runtime.kernel_for(bound).launcher(bound)
        launch()

    return call


def _kernels() -> Iterator[runtime.Kernel]:
    """Every kernel insum has cached (and their re-planned siblings)."""
    seen: set[int] = set()
    stack = list(runtime._KERNELS.values()) + list(runtime._BY_SIGNATURE.values())
    while stack:
        kernel = stack.pop()
        if id(kernel) not in seen:
            seen.add(id(kernel))
            stack.extend(kernel._siblings.values())
            yield kernel


def _no_op(*args, **kwargs) -> None:
    return None


class _NoKernel:
    """Stands in for a CompiledKernel: its launcher does nothing."""

    run = staticmethod(_no_op)
    function = 0
    packed_metadata = None


class _NoLaunch:
    """Stands in for a JIT function: `fn[grid](*args, **config)` does nothing and returns
    the stand-in compiled kernel (which the direct launch then keeps and calls)."""

    def __getitem__(self, grid):
        return _launch_nothing


def _launch_nothing(*args, **kwargs) -> _NoKernel:
    return _NoKernel()


class _NoDriver:
    """Stands in for triton's active driver: device 0, stream 0 (what a CUDA driver reads
    costs more: the direct launch's device and stream queries are under-counted here)."""

    @staticmethod
    def get_current_device() -> int:
        return 0

    @staticmethod
    def get_current_stream(device: int) -> int:
        return 0


class _NoHooks:
    launch_enter_hook = None
    launch_exit_hook = None


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Replace the final launch of every cached kernel (and batch of kernels) by a no-op, on
    both paths: the JIT function, and the compiled kernel the direct launch calls (switched on here although
    the interpreter never takes it, so that its own host work is measured). Restored on exit."""
    # (Written to run on older trees too, without batches or direct launches, for an A/B.)
    direct = importlib.import_module("insum.direct") if importlib.util.find_spec("insum.direct") else None
    batches = list(getattr(runtime, "_BATCHES", {}).values())
    saved = [(kernel, kernel.fn) for kernel in _kernels()] + [(batch, batch.fn) for batch in batches]
    launches = [launcher for kernel, _ in saved for launcher in getattr(kernel, "_launchers", {}).values()]
    launches = [launch for launch in launches + batches if getattr(getattr(launch, "direct", None), "fits", False)]
    runtime_of = direct._triton_runtime if direct else None
    if direct:
        direct._triton_runtime = lambda: (_NoDriver, _NoHooks)
    for kernel, _ in saved:
        kernel.fn = _NoLaunch()
    for launch in launches:
        launch.direct.enabled = True
    try:
        yield
    finally:
        if direct:
            direct._triton_runtime = runtime_of
        for kernel, fn in saved:
            kernel.fn = fn
        for launch in launches:
            launch.direct.enabled = False
            launch.direct.compiled.clear()


def measure(
    rows: dict[str, Callable[[], object]], calls: int, repeats: int, sync: Callable[[], None], clock=time.perf_counter
) -> dict:
    """name -> (median, min) µs per call over `repeats` runs of `calls` calls each,
    synchronising at each end. The rows take turns within each repeat, so that load from
    other processes on the host falls on all of them alike; the minimum is the least
    disturbed run."""
    for fn in rows.values():
        for _ in range(min(calls, 50)):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            start = clock()
            for _ in range(calls):
                fn()
            sync()
            times[name].append((clock() - start) / calls * 1e6)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--label", default="", help="a line printed above the table (and logged)")
    parser.add_argument("--log", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    if not cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("no CUDA device: run with TRITON_INTERPRET=1 (the launch is then stubbed)")
    device = torch.device("cuda" if cuda else "cpu")
    formats: dict = {}
    rows = cases(device, formats)
    anchor = "bare JIT launch" if cuda else "stub launch"
    for name, fn in rows.items():  # compile (interpret) and tune every case once, for real
        if name != anchor or cuda:
            fn()
    sync = torch.cuda.synchronize if cuda else _no_op
    stub = contextlib.nullcontext() if cuda else stubbed_launches()
    with stub:
        # Stubbed, the host's own CPU time is what counts: this thread's, not the wall clock
        # (which on a shared host also counts the time other processes hold the core).
        results = measure(rows, args.calls, args.repeats, sync, time.perf_counter if cuda else time.thread_time)
    lines = []
    if args.label:
        lines.append(args.label)
    lines.append(
        f"host us per cached call on {torch.cuda.get_device_name() + ', wall' if cuda else 'CPU (launch stubbed), thread CPU time'}, "
        f"{args.repeats} x {args.calls} calls; torch {torch.__version__}, triton {_triton_version()}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    # Over the anchor: median against median, and least against least (a busy host's
    # medians wander by several µs between runs; the least disturbed runs wander less).
    lines.append(f"  {'':32s} {'median':>8s} {'min':>8s}  over {anchor}: median, min")
    for name, (median, least) in results.items():
        over = "" if name == anchor else f"  {median - results[anchor][0]:+.1f} {least - results[anchor][1]:+.1f}"
        lines.append(f"  {name:32s} {median:8.2f} {least:8.2f}{over}")
    lines.append("launch paths after the runs:")
    lines.extend(launch_paths(formats))
    text = "\n".join(lines)
    print(text, flush=True)
    if args.log:
        with open(args.log, "a") as log:
            log.write(text + "\n\n")
    return results


if __name__ == "__main__":
    main()
