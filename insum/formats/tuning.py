"""group_size="tune": time the candidate packings with real SpMMs and keep the fastest."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .coords import Coords, check_positive_int

if TYPE_CHECKING:
    from .base import SparseFormat

__all__ = ["median_wall_time", "time_spmm", "tune", "tuning_operand"]


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


def time_spmm(fmt: SparseFormat, B: torch.Tensor, backend: str, reps: int = 5) -> float:
    """Median seconds of `fmt.spmm(B)` on B's device, after one warm-up run."""
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
