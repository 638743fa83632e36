"""group_size="tune" and coarsen="tune" (and `formats.auto`): time the candidate packings
with real SpMMs and keep the fastest."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .coords import Coords, check_positive_int

if TYPE_CHECKING:
    from .base import SparseFormat

__all__ = ["device_seconds", "median_wall_time", "time_spmm", "tune", "tuning_operand"]

#: A device-side sleep (~2 ms) queued before the timed calls: it covers the host's queueing
#: of them, so that the events around the calls time the GPU's work.
HOST_COVER_CYCLES = 4_000_000


def median_wall_time(fn: Callable[[], object], reps: int, device: torch.device | None = None) -> float:
    """Median seconds of `fn()` over `reps` calls after one warm-up call (which compiles and
    tunes what a first call does); on a CUDA `device`, synchronised around each call."""

    def sync() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def device_seconds(fn: Callable[[], object], device: torch.device, reps: int = 10, rounds: int = 3) -> float:
    """Median device seconds per `fn()` on a CUDA device over `rounds` batches of `reps`
    calls, after two warm-up calls (the first compiles and tunes).

    Each batch is queued behind a device-side sleep, so that the events around it time the
    GPU's work and not the host's: small SpMMs are host-bound, and timing them by the wall
    clock (a sync per call) ranks candidates by their Python overhead and launch latency,
    which measured 50 us over the kernels' 50-70 us at 4096^3 on the H200 and picked the
    slower packing at two of twelve points (benchmarks/explore/coarsen.py, session 12)."""
    fn()
    fn()
    times = []
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(rounds):
            torch.cuda.synchronize()
            torch.cuda._sleep(HOST_COVER_CYCLES)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / reps)
    return sorted(times)[len(times) // 2]


def time_spmm(fmt: SparseFormat, B: torch.Tensor, backend: str = "auto", reps: int = 5) -> float:
    """Seconds per `fmt.spmm(B)` on B's device: the GPU's time on CUDA (`device_seconds`),
    else the median wall time after one warm-up run."""
    if B.device.type == "cuda":
        return device_seconds(lambda: fmt.spmm(B, backend=backend), B.device)
    return median_wall_time(lambda: fmt.spmm(B, backend=backend), reps, B.device)


def tuning_operand(coords: Coords, tune_cols: int) -> torch.Tensor:
    """The dense B that `group_size="tune"` times SpMMs with: seeded, so tuning repeats."""
    generator = torch.Generator(device=coords.device).manual_seed(0)
    return torch.randn(
        coords.shape[1],
        check_positive_int("tune_cols", tune_cols),
        generator=generator,
        dtype=coords.dtype,
        device=coords.device,
    )


def tune(
    candidates: list[int], build: Callable[[int], SparseFormat], B: torch.Tensor, backend: str
) -> tuple[SparseFormat, dict[int, float]]:
    """Build the format for each candidate, time its SpMM, and keep the fastest."""
    best, best_time, times = None, math.inf, {}
    for candidate in candidates:
        fmt = build(candidate)
        times[candidate] = time_spmm(fmt, B, backend)
        if times[candidate] < best_time:
            best, best_time = fmt, times[candidate]
    return best, times
