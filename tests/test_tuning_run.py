"""How a new launch is tuned (`insum.runtime.Kernel._autotune`): every candidate runs into a
scratch output (`_Launcher.tuning_args`), each is timed by CUDA-graph replays
(`graphed_bench`), and the chosen one then runs once on the caller's output.

On the CPU the tuner is a stand-in that runs every candidate several times the way
`triton.autotune` does, so a `+=` statement shows whether the caller's output was added into
more than once. On CUDA `graphed_bench` times real launches and falls back to `do_bench`
where a capture fails.
"""

from __future__ import annotations

import os

import pytest
import torch

import insum
from insum import runtime
from insum.bind import bind
from insum.parser import parse

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if CUDA else "cpu"


class _Tuner:
    """Stands in for `triton.autotune(...)(fn)`: `[grid](*args)` runs every candidate three
    times on `args` and keeps the last as the best."""

    made: list = []

    def __init__(self, configs, fn, options):
        self.configs, self.fn, self.options = configs, fn, options
        self.best_config = None
        _Tuner.made.append(self)

    def __getitem__(self, grid):
        def run(*args):
            names = list(self.fn.arg_names)
            for config in self.configs:
                nargs = {**dict(zip(names, args)), **config.kwargs}
                if config.pre_hook:
                    config.pre_hook(nargs)
                for _ in range(3):
                    self.fn[grid](*args, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
            self.best_config = self.configs[-1]

        return run


@pytest.fixture
def stand_in_tuner(monkeypatch):
    import triton

    _Tuner.made = []
    monkeypatch.setattr(triton, "autotune", lambda configs, key, **options: lambda fn: _Tuner(configs, fn, options))
    real, original = runtime._interpreting, runtime.Kernel._first_config

    def first_config(self, *args):  # tuned as on a GPU (the interpreter takes the largest tile)
        runtime._interpreting = lambda: False
        try:
            return original(self, *args)
        finally:
            runtime._interpreting = real

    monkeypatch.setattr(runtime.Kernel, "_first_config", first_config)
    monkeypatch.setenv("INSUM_AUTOTUNE", "1")
    monkeypatch.setattr(runtime.Kernel, "_disk_config", lambda self, bucket, device: None)
    monkeypatch.setattr(runtime.Kernel, "_save_disk_config", lambda self, bucket, device, config: None)
    return _Tuner.made


@pytest.mark.skipif(not INTERPRET or CUDA, reason="the stand-in tuner runs the kernels in the interpreter")
@pytest.mark.parametrize("n", [17, 40])
def test_tuning_adds_into_the_callers_output_once(stand_in_tuner, n):
    """`+=` through a tuned first launch: every candidate ran three times, into scratch; the
    caller's output holds its start plus one product."""
    gen = torch.Generator().manual_seed(n)
    A, B = torch.randn(33, 29, generator=gen), torch.randn(29, n, generator=gen)
    C = torch.randn(33, n, generator=gen)
    start = C.clone()
    insum.insum("C[m, n] += A[m, k] * B[k, n]", C=C, A=A, B=B, backend="triton")
    assert len(stand_in_tuner) == 1, "the launch was not tuned"
    tuner = stand_in_tuner[0]
    assert len(tuner.configs) > 1
    assert tuner.options == {"do_bench": runtime.graphed_bench}  # no restore_value: scratch instead
    torch.testing.assert_close(C.double(), start.double() + A.double() @ B.double(), rtol=1e-5, atol=1e-4)


def test_tuning_args_put_a_scratch_output_in_the_outputs_place():
    gen = torch.Generator().manual_seed(3)
    tensors = {"A": torch.randn(12, 7, generator=gen), "B": torch.randn(7, 9, generator=gen)}
    out = torch.randn(9, 12, generator=gen).t()  # a transposed output: its strides kept
    bound = bind(parse("C[m, n] = A[m, k] * B[k, n]"), {**tensors, "C": out})
    kernel = runtime.Kernel(runtime.spec_for(bound))
    launcher = runtime._Launcher(kernel, bound)
    args = launcher.args(bound.tensors, out, config={})
    tuned = launcher.tuning_args(args)
    outputs = [p for p, name in launcher.pointers if name == launcher.out_name]
    assert outputs
    for position, (given, made) in enumerate(zip(args, tuned)):
        if position in outputs:
            assert made is not out and made.shape == out.shape and made.stride() == out.stride()
            assert made.dtype == out.dtype and made.data_ptr() != out.data_ptr()
        else:
            assert made is given


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="times CUDA launches")
def test_graphed_bench_times_launches_and_falls_back():
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    times = runtime.graphed_bench(lambda: torch.mul(x, 2.0, out=y), (0.5, 0.2, 0.8))
    assert len(times) == 3 and all(t > 0 for t in times) and times[1] <= times[0] <= times[2]
    synced = runtime.graphed_bench(lambda: (torch.mul(x, 2.0, out=y), torch.cuda.synchronize()), (0.5, 0.2, 0.8))
    assert len(synced) == 3 and all(t > 0 for t in synced)  # no capture with a sync inside: do_bench's times


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="tunes on CUDA")
def test_cuda_tuned_accumulation_adds_once():
    gen = torch.Generator(device="cuda").manual_seed(4)
    A = torch.randn(301, 77, device="cuda", generator=gen)
    B = torch.randn(77, 53, device="cuda", generator=gen)
    C = torch.randn(301, 53, device="cuda", generator=gen)
    start = C.clone()
    insum.insum("C[m, n] += A[m, k] * B[k, n]", C=C, A=A, B=B, backend="triton", autotune=True)
    product = A.double() @ B.double()
    # (tf32 products: a relative error near 1e-3 of the product; adding it twice would be 1)
    error = float((C.double() - start.double() - product).norm() / product.norm())
    assert error < 5e-3, error
