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

__all__ = ["time_spmm", "tune", "tuning_operand"]


def time_spmm(fmt: SparseFormat, B: torch.Tensor, backend: str, reps: int = 5) -> float:
    """Median seconds of `fmt.spmm(B)` on the current device, after one warm-up run."""

    def sync() -> None:
        if B.device.type == "cuda":
            torch.cuda.synchronize(B.device)

    fmt.spmm(B, backend=backend)  # compiles and autotunes on the first call
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fmt.spmm(B, backend=backend)
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


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
