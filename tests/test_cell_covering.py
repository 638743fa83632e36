"""CELL without a zero fill (issue 10, host time): the covering layout and its one launch.

The packer gives every row (empty ones as zero rows of width 1) one bucket, and keeps a
folded row's bucket rows inside one aligned block of 16 (`insum.formats.cell._covering_rows`);
the repeated product then runs the buckets' `=` kernels as one launch into a `torch.empty`
output. Checked in the interpreter at small sizes against a float64 dense product, with the
output allocation poisoned (NaN) and the fill ops counted, on empty rows, an all-empty
matrix, one row, rows folded past every bucket, non-power-of-two sizes, int32 and int64
indices; and the layout's invariants on the packed tensors alone.
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import CUDA  # before insum: the interpreter on CPU-only machines
from torch.utils._python_dispatch import TorchDispatchMode

from insum import runtime
from insum.formats import CELL
from insum.formats.cell import ROW_BLOCK

#: The tests on CPU tensors in the interpreter (the last test repeats the product on CUDA).
cpu = pytest.mark.skipif(CUDA, reason="CPU tensors in the interpreter; test_cuda_covering_product_... repeats on CUDA")
pytestmark = pytest.mark.gpu if CUDA else pytest.mark.interpreter

_FILLS = {"zeros", "zero_", "fill_", "new_zeros", "full", "zeros_like", "full_like"}


class _PoisonedOutputs(TorchDispatchMode):
    """Fills every new float tensor of the output's shape with NaN (what an uninitialised
    allocation may hold), and counts the ops that fill memory."""

    def __init__(self, shape: tuple[int, int]):
        super().__init__()
        self.shape = shape
        self.fills: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _FILLS:
            self.fills.append(name)
        elif name in ("empty", "empty_strided") and out.is_floating_point() and tuple(out.shape) == self.shape:
            out.fill_(float("nan"))
        return out


def _matrix(M: int, K: int, lengths: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    A = torch.zeros(M, K)
    for row, n in enumerate(lengths):
        A[row, torch.randperm(K, generator=gen)[:n]] = torch.randn(n, generator=gen)
    return A


# (name, matrix, CELL parameters): every case covers C.
CASES = [
    # empty rows, odd lengths, rows folded past the widest bucket (width 4; one 7 times)
    ("empty-rows-folded", _matrix(21, 27, [0, 1, 2, 3, 5, 0, 7, 26, 0, 4, 1, 9, 2, 0, 3, 6, 1, 0, 2, 11, 0], 1),
     {"max_width": 4, "index_dtype": torch.int32}),
    ("cost-model-int64", _matrix(19, 13, [0, 1, 2, 3, 5, 7, 13] * 2 + [0, 2, 4, 1, 6], 2), {"index_dtype": torch.int64}),
    ("one-row", _matrix(1, 10, [7], 3), {"max_width": 2}),
    ("width-1-widest", _matrix(9, 7, [0, 3, 1, 0, 7, 2, 0, 1, 5], 4), {"max_width": 1}),
]


def _product(fmt: CELL, A: torch.Tensor, gen: torch.Generator, N: int = 5) -> None:
    B = torch.randn(A.shape[1], N, generator=gen)
    torch.testing.assert_close(fmt.spmm(B, backend="triton").double(), A.double() @ B.double(), rtol=1e-5, atol=1e-5)


@cpu
@pytest.mark.parametrize("name, A, params", CASES, ids=[c[0] for c in CASES])
def test_repeated_product_fills_nothing_and_matches_a_dense_product(name, A, params, monkeypatch):
    fmt = CELL.from_dense(A, **params)
    assert fmt.covering_block == ROW_BLOCK
    gen = torch.Generator().manual_seed(5)
    N = 5
    first = _PoisonedOutputs((A.shape[0], N))
    with first:
        _product(fmt, A, gen, N)  # one by one into zeros, prepares the batch
    assert first.fills  # the first product zero-fills C
    _product(fmt, A, gen, N)  # pins the batch
    launches = []
    real = runtime.BatchLaunch.run
    monkeypatch.setattr(runtime.BatchLaunch, "run", lambda self, calls: launches.append(self.covers) or real(self, calls))
    for _ in range(2):
        poisoned = _PoisonedOutputs((A.shape[0], N))
        with poisoned:
            _product(fmt, A, gen, N)
        assert poisoned.fills == []
    assert launches == [True, True]  # one covering launch per product


@cpu
def test_an_all_empty_matrix_multiplies_to_zeros():
    A = torch.zeros(6, 5)
    fmt = CELL.from_dense(A)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        _product(fmt, A, gen)


@cpu
def test_rows_folded_past_the_block_keep_the_zero_fill():
    """A row of more than 16 folds cannot stay in one block: the plain layout, C zero-filled."""
    lengths = [0, 40, 3, 1, 0, 2, 5, 1, 1, 0, 2, 3]
    A = _matrix(12, 40, lengths, 7)
    fmt = CELL.from_dense(A, max_width=2)  # row 1: 20 folds
    assert fmt.covering_block is None
    assert fmt.RI_1.numel() + fmt.RI_2.numel() == sum(-(-n // 2) for n in lengths)  # no padding, no empty rows
    gen = torch.Generator().manual_seed(8)
    for _ in range(4):
        _product(fmt, A, gen)


@cpu
@pytest.mark.parametrize("seed", range(6))
def test_covering_layout_invariants(seed):
    """Every row in exactly one bucket; equal rows adjacent; a row's bucket rows within one
    aligned block of ROW_BLOCK; the product's entries exactly the matrix's (no kernels run)."""
    gen = torch.Generator().manual_seed(seed)
    M, K = 50 + seed, 33
    lengths = (K / (torch.arange(M) + 1.0) ** 0.8).long()[torch.randperm(M, generator=gen)]
    lengths[torch.randperm(M, generator=gen)[:7]] = 0
    A = _matrix(M, K, lengths.tolist(), seed)
    fmt = CELL.from_dense(A, max_width=(4, 8, 4, None, 8, 2)[seed])
    assert fmt.covering_block == ROW_BLOCK
    assert torch.equal(fmt.to_dense(), A)
    seen = torch.cat([torch.unique(getattr(fmt, f"RI_{w}")) for w in fmt.widths])
    assert torch.equal(torch.sort(seen).values, torch.arange(M))  # each row in one bucket
    for w in fmt.widths:
        rows = getattr(fmt, f"RI_{w}").long()
        starts = torch.ones_like(rows, dtype=torch.bool)
        starts[1:] = rows[1:] != rows[:-1]
        assert torch.unique(rows).numel() == int(starts.sum())  # equal rows adjacent
        run = torch.cumsum(starts, 0) - 1
        first = torch.zeros(int(starts.sum()), dtype=torch.long).scatter_reduce_(
            0, run, torch.arange(rows.numel()), "amin", include_self=False)
        last = torch.zeros_like(first).scatter_reduce_(0, run, torch.arange(rows.numel()), "amax", include_self=False)
        assert torch.equal(first // ROW_BLOCK, last // ROW_BLOCK)  # inside one aligned block


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the compiled batch kernel and its direct launch")
def test_cuda_covering_product_runs_direct_into_an_unfilled_output(monkeypatch):
    """fmt @ B on CUDA: pinned, one direct covering launch, C from torch.empty (poisoned with
    NaN here), matching a float64 product; float32 and float16 values."""
    from insum import execute

    gen = torch.Generator().manual_seed(9)
    M, K = 300, 96
    lengths = (K / (torch.arange(M) + 1.0) ** 0.9).long().clamp(max=K)
    lengths[M // 3 : M // 3 + 5] = 0
    A = _matrix(M, K, lengths.tolist(), 9)
    real_empty = torch.empty

    def poisoned(*shape, **kwargs):
        out = real_empty(*shape, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    for dtype in (torch.float32, torch.float16):
        fmt = CELL.from_dense(A.to(dtype).cuda(), max_width=8)
        assert fmt.covering_block == ROW_BLOCK
        for i in range(5):
            B = torch.randn(K, 64, generator=gen).to(dtype).cuda()
            if i >= 3:
                monkeypatch.setattr(torch, "empty", poisoned)
            C = fmt @ B
            monkeypatch.setattr(torch, "empty", real_empty)
            expected = A.to(dtype).double().cuda() @ B.double()
            torch.testing.assert_close(C.double(), expected, rtol=2e-2, atol=2e-2 * max(1.0, expected.abs().max().item()))
        plan = next(iter(fmt.__dict__["_spmm_plans"].values()))
        assert isinstance(plan.pinned, execute.Pinned) and plan.pinned.covers
        direct = plan.pinned.launch.launch.direct
        assert direct.enabled and direct.compiled, direct.why_not


def _next_fit_reference(folds: list[int]) -> list[int]:
    """The first bucket row of each row (in the order given), placed one after the other so
    that none crosses an aligned block of ROW_BLOCK: the sequential rule `_next_fit` scans."""
    positions, end = [], 0
    for f in folds:
        if end % ROW_BLOCK + f > ROW_BLOCK:
            end += ROW_BLOCK - end % ROW_BLOCK
        positions.append(end)
        end += f
    return positions


@cpu
@pytest.mark.parametrize("seed", range(4))
def test_widest_bucket_is_the_sequential_next_fit(seed):
    """The device scan places the widest bucket's rows where a sequential next fit over them
    (most folds first, then by row) does; the padding is what it skips."""
    gen = torch.Generator().manual_seed(10 + seed)
    M, K = 90, 40
    lengths = torch.randint(0, 9, (M,), generator=gen) * (torch.rand(M, generator=gen) < 0.9)
    lengths[seed : seed + 3] = torch.tensor([26, 14, 11])  # 13, 7 and 6 folds: runs that skip rows
    A = _matrix(M, K, lengths.tolist(), seed)
    fmt = CELL.from_dense(A, max_width=2)
    assert fmt.covering_block == ROW_BLOCK
    counts = (A != 0).sum(1)
    widest = [(-(-int(n) // 2), r) for r, n in enumerate(counts.tolist()) if n > 1]
    widest.sort(key=lambda item: (-item[0], item[1]))
    positions = _next_fit_reference([f for f, _ in widest])
    expected = torch.full((positions[-1] + widest[-1][0],), -1)
    for (f, row), at in zip(widest, positions):
        expected[at : at + f] = row
    got = fmt.RI_2.long()
    padding = expected < 0
    assert got.numel() == expected.numel()
    assert torch.equal(got[~padding], expected[~padding])
    # A padding bucket row repeats the row before it, and adds nothing.
    assert torch.equal(got[padding], got[torch.nonzero(padding).view(-1) - 1])
