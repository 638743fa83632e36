"""Shared measuring helpers: median timings, rotated inputs, hardware ceilings, errors,
dtype names, the environment header. The study context is in `context.py`, the torch
lowering anchor in `lowering.py`.
"""

from __future__ import annotations

import datetime
import math
import platform
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from insum.dtypes import DTYPE_NAMES, VALUE_DTYPES
from insum.formats import GroupCOO
from insum.formats.base import SparseFormat
from insum.formats.tuning import median_wall_time

#: Short name ("fp16") -> value dtype: insum.dtypes' names, read back.
DTYPES = {DTYPE_NAMES[d]: d for d in VALUE_DTYPES}

_DO_BENCH = None  # triton.testing.do_bench as imported, before any patching


def _do_bench():
    global _DO_BENCH
    if _DO_BENCH is None:
        import triton.testing

        _DO_BENCH = triton.testing.do_bench
    return _DO_BENCH


#: Every device's results sit in their own folder, so that runs on two GPUs sit side by side.
RESULTS = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    """A short folder name for the current device: `torch.cuda.get_device_name()` reduced to
    its model token ("NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100"); "cpu"
    without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    tokens = re.split(r"[^a-z0-9]+", torch.cuda.get_device_name().lower().replace("nvidia", ""))
    tokens = [t for t in tokens if t]
    return next((t for t in tokens if any(c.isdigit() for c in t)), "-".join(tokens) or "cuda")


def results_dir(device: str | None = None) -> Path:
    """benchmarks/results/<device>/ (the current device by default)."""
    return RESULTS / (device or device_name())


def median_ms(fn, rotations: int = 1, *, warmup: int = 25, rep: int = 100) -> float:
    """do_bench median in milliseconds (warm-up excluded; do_bench also flushes L2 per rep)."""
    return _do_bench()(fn, warmup=warmup, rep=rep, return_mode="median")


def graphed_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """Device milliseconds per call of `fn`: `calls` calls captured as one CUDA graph, the
    median of its replays (do_bench) divided by `calls` (no host time, no L2 flush between)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay) / calls


def cuda_graph(fn: Callable[[], object], warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """`fn` captured as a CUDA graph (and what the captured call returned), after `warmups`
    runs on a side stream: compiling, tuning and allocating happen outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def print_python_profile(fn: Callable[[], object], calls: int, orders=("tottime",), limit: int = 25) -> None:
    """cProfile of `calls` calls of `fn` (host work), its top `limit` functions per order."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    for order in orders:
        pstats.Stats(profile).sort_stats(order).print_stats(limit)


def cpu_median_ms(fn, reps: int = 3) -> float:
    """Median wall time of `fn` on the host after one warm-up call (the CPU smoke path)."""
    return median_wall_time(fn, reps) * 1e3


def host_us_per_call(fn: Callable[[], object], calls: int = 2000, sync: Callable[[], None] | None = None) -> float:
    """Wall-clock microseconds per call over `calls` calls after a warm-up, synchronising
    once at each end: the host's cost per call while the device keeps up."""
    sync = sync or torch.cuda.synchronize
    for _ in range(min(calls, 50)):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def bare_launcher(expr: str, tensors: dict) -> Callable[[], None]:
    """Relaunch insum's cached kernel for `tensors` with the launch insum() prepared for them
    (`Kernel.launcher`; call insum() with these tensors first, else KeyError)."""
    from insum.bind import bind
    from insum.parser import parse
    from insum.runtime import kernel_for

    bound = bind(parse(expr), tensors)
    return kernel_for(bound).launcher(bound)


def padded_slots(fmt_cls, csr: torch.Tensor, params: dict | None = None) -> int:
    """At most how many value slots packing the CSR matrix `csr` with `fmt_cls` (and
    `params`) pads it to, by the format's `row_padding_slots` (0: no row padding)."""
    longest = int(csr.crow_indices().diff().max()) if csr.shape[0] else 0
    return fmt_cls.row_padding_slots(tuple(csr.shape), longest, params or {})


def block_sparse(size: int, block: int, s: float, dtype, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, keep): a size x size matrix whose block x block tiles are zero with probability s
    (one kept at least), and the (size/block)^2 mask of kept tiles."""
    nb = size // block
    keep = torch.rand(nb, nb, device=device, generator=gen) >= s
    if not bool(keep.any()):
        keep[0, 0] = True
    mask = keep.repeat_interleave(block, 0).repeat_interleave(block, 1)
    A = torch.randn(size, size, device=device, generator=gen).to(dtype) * mask
    return A, keep


def host_case(device) -> tuple[torch.Tensor, SparseFormat, dict[str, torch.Tensor]]:
    """The host-overhead case: (A, fmt, tensors) for a 256 x 256, 5% dense A (seed 7), its
    GroupCOO packing and the statement's tensors with B (256 x 32) and a zero C."""
    gen = torch.Generator(device=device).manual_seed(7)
    A = (torch.rand(256, 256, device=device, generator=gen) < 0.05) * torch.randn(256, 256, device=device, generator=gen)
    fmt = GroupCOO.from_dense(A)
    B = torch.randn(256, 32, device=device, generator=gen)
    return A, fmt, dict(fmt.tensors, B=B, C=torch.zeros(256, 32, device=device))


def rotating(fn, inputs: list):
    """A no-argument callable that cycles through input sets so caches do not flatter."""
    state = {"i": 0}

    def step():
        state["i"] = (state["i"] + 1) % len(inputs)
        return fn(*inputs[state["i"]])

    return step


def rotations_for(nbytes: int, budget: int = 1 << 30) -> int:
    """How many input sets to rotate: 4, fewer when one set is large (at least 2)."""
    return max(2, min(4, budget // max(nbytes, 1)))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (NaN when anything is not finite)."""
    expected = expected.double()
    actual = actual.double()
    if actual.shape != expected.shape:
        return float("nan")
    if not bool(torch.isfinite(actual).all()):
        return float("nan")
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def good(rows: list[dict]) -> list[dict]:
    """The rows whose check passed and that have a ratio (what geomeans and plots use)."""
    return [r for r in rows if r.get("ok") and r.get("ratio")]


def geomean(values) -> float:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def ceilings() -> dict[str, float]:
    """Measured copy bandwidth (GB/s, read + write), fp16 and tf32 tensor-core rates (TFLOP/s)."""
    bandwidth = _copy_bandwidth(2**30)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    ms = median_ms(lambda: a @ b)
    tflops = 2 * 8192**3 / ms / 1e9
    a, b = a.float(), b.float()
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        tf32 = 2 * 8192**3 / median_ms(lambda: a @ b) / 1e9
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    return {"bandwidth_GBs": bandwidth, "fp16_tflops": tflops, "tf32_tflops": tf32}


def _copy_bandwidth(nbytes: int) -> float:
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / median_ms(lambda: y.copy_(x)) / 1e6


def cpu_ceilings() -> dict[str, float]:
    """Rough host numbers so that the smoke run exercises the roofline plumbing."""
    x = torch.empty(2**24, dtype=torch.uint8)
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() / cpu_median_ms(lambda: y.copy_(x)) / 1e6
    a = torch.randn(512, 512)
    rate = 2 * 512**3 / cpu_median_ms(lambda: a @ a) / 1e9
    return {"bandwidth_GBs": bandwidth, "fp16_tflops": rate, "tf32_tflops": rate}


def environment(device: torch.device) -> dict:
    """Date, GPU, versions and commit: the header every result file carries."""
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        info["commit"] = "unknown"
    return info


def shorten_autotune(warmup: int = 5, rep: int = 20) -> Callable[[], None]:
    """Make `triton.testing.do_bench`, as triton.autotune calls it, measure each candidate
    for `rep` ms instead of 100, so that the many shape buckets of a sweep fit the time
    budget: the anchors' own Triton kernels, and insum's tuner where it cannot capture a
    CUDA graph (it times candidates as ~20 ms of graph replays, `insum.runtime.graphed_bench`).
    Returns the function that undoes it. The costs study measures the unshortened default.
    """
    import triton.testing

    original = _do_bench()

    def quick(fn, *args, **kwargs):
        if not args:  # the autotuner passes keywords only (quantiles=...)
            kwargs.setdefault("warmup", warmup)
            kwargs.setdefault("rep", rep)
        return original(fn, *args, **kwargs)

    triton.testing.do_bench = quick

    def undo() -> None:
        triton.testing.do_bench = original

    return undo


def dtype_name(dtype: torch.dtype) -> str:
    """The short name ("fp16") the result rows carry."""
    return DTYPE_NAMES[dtype]


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
