"""BlockGroupCOO's row coarsening (`coarsen=`): r neighbouring block rows merged into one
block of r * bm rows, with explicit zero blocks for the union's blocks a block row lacks.

Every packing must hold the same matrix (to_dense, and the SpMM through the generated kernel
against a float64 product);
coarsen="tune" times only the candidates within its bounds and keeps the fastest it timed.
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, KERNEL_MARK  # before insum: the interpreter on CPU-only machines

from insum.errors import InsumError
from insum.formats import BlockGroupCOO
from insum.formats import blockgroupcoo as packing
from insum.nn import SparseLinear

pytestmark = KERNEL_MARK


def _paired(block_rows: int, block_cols: int, block: int, seed: int) -> torch.Tensor:
    """A block-sparse matrix whose block rows come in pairs sharing their block columns
    (one pair differs in one block), with an empty block row pair."""
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand(block_rows // 2, block_cols, generator=g) < 0.4).repeat_interleave(2, 0)
    keep[1, 0] = ~keep[1, 0]
    keep[2:4] = False
    cells = keep.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return torch.randn(block_rows * block, block_cols * block, generator=g) * cells


def _spmm_error(fmt: BlockGroupCOO, W: torch.Tensor, columns: int = 7) -> float:
    B = torch.randn(W.shape[1], columns, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    got = fmt.spmm(B, backend="triton", precision="ieee")
    return float((got.cpu().double() - W.double() @ B.cpu().double()).abs().max())


@pytest.mark.parametrize("group_size", ["row", None, 2])
@pytest.mark.parametrize("coarsen", [1, 2, 3, 4])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_coarsened_packing_holds_the_same_matrix(group_size, coarsen, index_dtype):
    W = _paired(10, 5, 8, seed=coarsen)[:-3]  # 77 rows: not a multiple of any coarse block
    fmt = BlockGroupCOO.from_dense(W.to(DEVICE), block=8, group_size=group_size, coarsen=coarsen,
                                   index_dtype=index_dtype)
    assert fmt.block == (8 * coarsen, 8) and fmt.AK.dtype == index_dtype
    assert fmt.params.get("coarsen", 1) == coarsen
    torch.testing.assert_close(fmt.to_dense().cpu(), W)
    assert _spmm_error(fmt, W) < 1e-4


def test_pairs_merge_without_zero_blocks_and_fine_blocks_count_every_union():
    W = _paired(8, 6, 4, seed=1)
    fine = BlockGroupCOO.from_dense(W, block=4, group_size="row")
    pairs = BlockGroupCOO.from_dense(W, block=4, group_size="row", coarsen=2)
    # Pairs share their block columns but for one block: the union is half the blocks, plus one.
    assert pairs.params["blocks"] == (fine.params["blocks"] + 1) // 2
    assert "coarsen=2" in pairs.describe()


def test_empty_and_single_row_matrices():
    for W in (torch.zeros(16, 24), torch.zeros(1, 24)):
        W[:, 3] = 0.0
        fmt = BlockGroupCOO.from_dense(W.to(DEVICE), block=4, group_size="row", coarsen=2)
        assert _spmm_error(fmt, W) == 0.0
    W = torch.zeros(1, 24)
    W[0, 5] = 2.0
    fmt = BlockGroupCOO.from_dense(W.to(DEVICE), block=4, coarsen=4)
    assert fmt.block == (16, 4) and _spmm_error(fmt, W) < 1e-5


def test_tune_times_the_candidates_within_bounds_and_keeps_the_fastest(monkeypatch):
    timed = []
    real = packing.tune

    def spy(candidates, build, B, backend):
        best, times = real(candidates, build, B, backend)
        timed.append((list(candidates), best, times))
        return best, times

    monkeypatch.setattr(packing, "tune", spy)
    W = _paired(8, 6, 8, seed=2)
    fmt = BlockGroupCOO.from_dense(W.to(DEVICE), block=8, group_size="row", coarsen="tune", tune_cols=16,
                                   backend="triton")
    (candidates, best, times), = timed
    assert candidates == [1, 2, 4]  # pairs: r = 2 merges without zeros, r = 4 within twice the work
    assert fmt is best and fmt.params["coarsen_seconds"] == times
    assert times[fmt.params.get("coarsen", 1)] == min(times.values())
    torch.testing.assert_close(fmt.to_dense().cpu(), W)
    assert _spmm_error(fmt, W) < 1e-4

    # Disjoint columns in every four block rows: r = 4 would multiply four times the blocks;
    # and a coarse block taller than COARSEN_ROWS is never tried.
    disjoint = torch.zeros(8 * 8, 4 * 8)
    for row in range(8):
        disjoint[row * 8:(row + 1) * 8, (row % 4) * 8:(row % 4 + 1) * 8] = 1.0
    timed.clear()
    monkeypatch.setattr(packing, "COARSEN_ROWS", 16)
    BlockGroupCOO.from_dense(disjoint.to(DEVICE), block=8, group_size="row", coarsen="tune", tune_cols=16,
                             backend="triton")
    assert timed[0][0] == [1, 2]
    monkeypatch.setattr(packing, "COARSEN_ROWS", 128)
    timed.clear()
    BlockGroupCOO.from_dense(disjoint.to(DEVICE), block=8, group_size="row", coarsen="tune", tune_cols=16,
                             backend="triton")
    assert timed[0][0] == [1, 2]  # r = 4: 4x the fine blocks' elements, past COARSEN_WORK


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_bad_coarsening_raises(bad):
    with pytest.raises(InsumError, match="coarsen must be"):
        BlockGroupCOO.from_dense(torch.eye(16), block=4, coarsen=bad)


def test_coarsening_errors_name_the_cause():
    with pytest.raises(InsumError, match="does not divide"):
        BlockGroupCOO.from_dense(torch.eye(24), block=4, coarsen=4, pad=False)
    with pytest.raises(InsumError, match='not "tune"'):
        BlockGroupCOO.from_dense(torch.eye(16), block=4, coarsen="tune", group_size="tune")
    with pytest.raises(InsumError, match="coarsen"):
        SparseLinear.from_dense(torch.eye(16), None, "BlockGroupCOO", block=(4, 4), coarsen=2)
    with pytest.raises(InsumError, match="coarsen"):
        SparseLinear.from_format(BlockGroupCOO.from_dense(torch.eye(16), block=4, coarsen=2))
