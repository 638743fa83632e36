"""Shared measuring helpers: median timings, rotated inputs, hardware ceilings, errors."""

from __future__ import annotations

import torch


def median_ms(fn, rotations: int = 1) -> float:
    """do_bench median in milliseconds (warm-up excluded)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rotating(fn, inputs: list):
    """A no-argument callable that cycles through input sets so caches do not flatter."""
    state = {"i": 0}

    def step():
        state["i"] = (state["i"] + 1) % len(inputs)
        return fn(*inputs[state["i"]])

    return step


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30))


def ceilings() -> dict[str, float]:
    """Measured copy bandwidth (GB/s, read + write) and fp16 tensor-core rate (TFLOP/s)."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    bandwidth = 2 * x.numel() / ms / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    ms = median_ms(lambda: a @ b)
    tflops = 2 * 8192**3 / ms / 1e9
    return {"bandwidth_GBs": bandwidth, "fp16_tflops": tflops}
