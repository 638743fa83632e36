"""Shared measuring helpers: median timings, rotated inputs, hardware ceilings, errors, the
study context (device, time budget, result rows) and the torch lowering used as an anchor.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Relative-error thresholds against a float64 product, by the value dtype of the inputs.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float64: 1e-9}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

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


def cpu_median_ms(fn, reps: int = 3) -> float:
    """Median wall time of `fn` on the host after one warm-up call (the CPU smoke path)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


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
    (call insum() with these tensors first). Reads runtime internals: raises when those
    have changed shape, and the caller notes it."""
    # TODO(core hook): a public launcher on Kernel (e.g. `Kernel.launcher(tensors)`) instead of
    # bind + runtime.kernel_for + Kernel._launchers.
    from insum.bind import bind
    from insum.parser import parse
    from insum.runtime import kernel_for

    bound = bind(parse(expr), tensors)
    kernel = kernel_for(bound)
    launcher = kernel._launchers[bound.signature]
    args = launcher.args(bound.tensors, bound.tensors[bound.output_name])
    fn, grid, config = kernel.fn, launcher.grid, launcher.config
    return lambda: fn[grid](*args, **config)


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
    """Make triton.autotune (which insum's runtime uses) measure each candidate for `rep` ms
    instead of 100, so that the many shape buckets of a sweep fit the time budget. Returns
    the function that undoes it. The costs study measures the unshortened default.
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


# --------------------------------------------------------------------------- the context


@dataclass
class Context:
    """What a study needs: device, sizes mode, timing settings, its time budget, its rows.

    `add(row)` completes a row (ratio, tolerance, check, roofline) and rewrites the study's
    JSON file at once, so that a run cut short still leaves every finished measurement.
    """

    study: str
    device: torch.device
    quick: bool
    smoke: bool
    data: Path
    out: Path
    roof: dict
    env: dict
    budget_s: float
    backend: str = "auto"
    copy_to: Path | None = None
    warmup_ms: int = 10
    rep_ms: int = 40
    started: float = field(default_factory=time.perf_counter)
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    status: str = "running"
    finished: float | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    def time_left(self) -> float:
        return self.budget_s - self.elapsed()

    def over_budget(self, what: str, slack: float = 0.0) -> bool:
        """True (and the skip counted under `what`) once the budget (plus `slack` s) is spent."""
        if self.time_left() + slack > 0:
            return False
        self.skipped[what] = self.skipped.get(what, 0) + 1
        return True

    def note(self, text: str) -> None:
        print(f"  note: {text}", flush=True)
        self.notes.append(text)

    def bench(self, fn, inputs: list | None = None) -> float:
        """Median ms of fn (called with each input set in turn when `inputs` is given)."""
        step = rotating(fn, inputs) if inputs is not None else fn
        if self.cuda:
            return median_ms(step, warmup=self.warmup_ms, rep=self.rep_ms)
        return cpu_median_ms(step, reps=1 if self.smoke else 5)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def roofline(self, ms: float, nbytes: float, flops: float, dtype: torch.dtype) -> tuple[float, str]:
        """Fraction of the limit reached: max(bytes / bandwidth, flops / rate) over the time."""
        rate = self.roof["tf32_tflops"] if dtype == torch.float32 else self.roof["fp16_tflops"]
        t_mem = nbytes / (self.roof["bandwidth_GBs"] * 1e9)
        t_flop = flops / (rate * 1e12)
        floor = max(t_mem, t_flop)
        return (floor / (ms * 1e-3) if ms and ms > 0 else float("nan")), ("memory" if t_mem >= t_flop else "compute")

    def add(self, row: dict) -> dict:
        """Complete a row and record it; prints one line and flags a failed check loudly."""
        dtype = DTYPES.get(row.get("dtype", ""), torch.float32)
        row.setdefault("tol", TOLERANCE[dtype])
        anchor_ms, insum_ms = row.get("anchor_ms"), row.get("insum_ms")
        if row.get("ratio") is None:
            ok_times = anchor_ms and insum_ms and anchor_ms > 0 and insum_ms > 0
            row["ratio"] = anchor_ms / insum_ms if ok_times else None
        err = row.get("err")
        row["ok"] = err is not None and math.isfinite(err) and err <= row["tol"]
        anchor_err = row.get("anchor_err")
        if anchor_err is not None:
            row["anchor_ok"] = math.isfinite(anchor_err) and anchor_err <= row.get("anchor_tol", row["tol"])
        if row.get("bytes") is not None and insum_ms:
            row["roof_frac"], row["bound"] = self.roofline(insum_ms, row["bytes"], row.get("flops", 0), dtype)
        row = {"study": self.study, **row}
        self.rows.append(row)
        ratio = row["ratio"]
        flag = "" if row["ok"] else "   <<< CHECK FAILED"
        if anchor_err is not None and not row["anchor_ok"]:
            flag += "   (anchor check failed)"
        line = (
            f"  {row['set'][:46]:46s} {str(row.get('case', ''))[:36]:36s} insum {_fmt_ms(insum_ms)}"
            f" | {row['anchor'][:16]:>16s} {_fmt_ms(anchor_ms)} "
            + (f"x{ratio:5.2f}" if ratio else "  n/a ")
            + (f"  err {err:.1e}" if err is not None else "  err n/a")
        )
        print(line + flag, flush=True)
        self.save()
        return row

    def fail(self, row: dict, error: BaseException) -> None:
        """Record a configuration whose insum run raised: a failed check, loudly."""
        message = f"{type(error).__name__}: {str(error)[:300]}"
        print(f"  <<< FAILED {row.get('set')} {row.get('case')}: {message}", flush=True)
        self.rows.append({"study": self.study, "anchor": "-", "anchor_ms": None, "insum_ms": None, "ratio": None,
                          "err": None, "ok": False, "error": message, **row})
        self.save()

    def result(self) -> dict:
        return {
            "study": self.study,
            "status": self.status,
            "env": self.env,
            "ceilings": self.roof,
            "mode": "smoke" if self.smoke else "quick" if self.quick else "full",
            "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed(), 1),
            "notes": self.notes,
            "skipped": self.skipped,
            "rows": self.rows,
        }

    def save(self, status: str | None = None) -> None:
        """Rewrite <out>/<study>.json (and the copy); `status` once the study ends."""
        if status is not None:
            self.status = status
            self.finished = time.perf_counter()
        text = json.dumps(_finite(self.result()), indent=1, default=_json_default)
        for folder in filter(None, (self.out, self.copy_to)):
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{self.study}.json.tmp"
            tmp.write_text(text)
            os.replace(tmp, folder / f"{self.study}.json")


def _fmt_ms(ms) -> str:
    if ms is None:
        return "     n/a"
    return f"{ms * 1e3:7.1f}us" if ms < 1 else f"{ms:7.3f}ms"


def _finite(value):
    """NaN and infinities become None, so that the files are strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value):
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, torch.Size):
        return list(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- torch lowering


def _walk(access):  # TODO(core hook): Statement.walk()
    stack = [access]
    while stack:
        node = stack.pop(0)
        yield node
        for index in node.indices:
            stack.extend(index.indirect_accesses())


class Lowering:
    """A statement's torch reference lowering (`insum.reference.run_reference`) as a plain
    function of its tensors, eager or under `torch.compile`.

    Parsing and binding happen once, outside the function; the extents are read from the
    tensors' shapes inside it, so one compiled function serves every shape (dynamic after
    the first recompile). The lowering's index bounds checks are switched off while it
    runs: they are validation (and a host sync each), not part of the computation.
    """

    _compiled_cache: dict = {}

    def __init__(self, expr: str, names: tuple[str, ...], dynamic: bool | None = None):
        from insum.parser import parse

        self.dynamic = dynamic  # torch.compile's: None recompiles dynamic on a second shape
        self.expr = expr
        self.stmt = parse(expr)
        self.names = tuple(names)
        dims: dict[str, tuple[str, int]] = {}
        for top in (self.stmt.output, *self.stmt.accesses()):
            for access in _walk(top):
                for d, index in enumerate(access.indices):
                    if index.variable is not None:
                        dims.setdefault(index.variable, (access.name, d))
        self.dims = dims
        self.out_name = self.stmt.output.name

    def _run(self, *values):
        # TODO(core hook): run_reference on a statement and tensors without a Bound (this
        # builds a stand-in, _BoundView, for what run_reference reads).
        from insum import reference

        tensors = dict(zip(self.names, values))
        view = _BoundView(self.stmt, {v: tensors[n].shape[d] for v, (n, d) in self.dims.items()}, tensors)
        return reference.run_reference(view, tensors[self.out_name])

    def eager(self, **tensors):
        return self._call(self._run, tensors)

    def compiled(self, **tensors):
        key = (self.expr, self.names, self.dynamic)
        fn = Lowering._compiled_cache.get(key)
        if fn is None:
            fn = Lowering._compiled_cache[key] = torch.compile(self._run, dynamic=self.dynamic)
        return self._call(fn, tensors)

    def _call(self, fn, tensors):
        # TODO(core hook): run_reference(..., check_bounds=False) instead of patching
        # reference._check_bounds.
        from insum import reference

        checked = reference._check_bounds
        reference._check_bounds = _no_check
        try:
            return fn(*(tensors[n] for n in self.names))
        finally:
            reference._check_bounds = checked


def _no_check(*args) -> None:
    return None


class _BoundView:
    """What run_reference reads from a Bound: the statement, extents, tensors, device."""

    def __init__(self, stmt, extents, tensors):
        self.stmt = stmt
        self.extents = extents
        self.tensors = tensors
        self.device = next(iter(tensors.values())).device


def allow_many_recompiles() -> None:
    """One compiled lowering per statement serves many shapes: raise dynamo's limits."""
    import torch._dynamo

    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))


def lowered_spmm(fmt, B_dtype: torch.dtype, compiled: bool, dynamic: bool | None = None):
    """`fmt @ B` through the torch lowering of the format's statement(s): a callable of B.

    Asks the format for its statements and views (`operand`, `output_shape`, `result`), so
    that the anchor computes what `fmt @ B` computes with the generated kernel swapped out;
    it accumulates from zeros with `+=`, half precision in float32.
    `dynamic` goes to torch.compile (True: one compilation for many matrices).
    """
    acc = torch.float32 if B_dtype in (torch.float16, torch.bfloat16) else B_dtype
    run = "compiled" if compiled else "eager"
    parts = [
        (getattr(Lowering(expr, tuple(sorted(tensors)) + ("B", "C"), dynamic=dynamic), run), tensors)
        for expr, tensors in fmt.statements()
    ]

    def spmm(B):
        C = torch.zeros(fmt.output_shape(B.shape[1]), dtype=acc, device=B.device)
        operand = fmt.operand(B)
        for call, tensors in parts:
            call(C=C, B=operand, **tensors)
        return fmt.result(C).to(B_dtype)

    return spmm


def log(text: str) -> None:
    print(text, flush=True)


def python() -> str:
    return sys.executable
