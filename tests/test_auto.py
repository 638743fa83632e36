"""formats.auto: row statistics, the cost model's choices, packing from every input layout,
the cache, describe(), SparseLinear(format="auto") and the demo; on the CPU (cost-model path,
torch lowering)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from insum.__main__ import auto_demo
from insum.errors import InsumError
from insum.formats import ELL, GroupCOO, auto, power_law_matrix
from insum.formats.auto import rank, row_stats
from insum.nn import SparseLinear


def _random(rows, cols, density, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, cols, generator=g) < density) * torch.randn(rows, cols, generator=g)


def test_row_stats_match_a_direct_count():
    A = _random(37, 50, 0.2, seed=1)
    A[3] = 1.0  # one full row
    A[5] = 0.0  # one empty row
    counts = [int(c) for c in (A != 0).sum(1)]
    stats = row_stats(A.to_sparse_csr())
    assert stats.nnz == sum(counts) and stats.longest == max(counts)
    assert stats.nonempty == sum(c > 0 for c in counts)
    for g, groups in stats.groups.items():
        assert groups == sum(math.ceil(c / g) for c in counts)
    assert stats.pow2_slots == sum(1 << math.ceil(math.log2(c)) for c in counts if c)
    assert stats.widths == len({math.ceil(math.log2(c)) for c in counts if c})


def test_uniform_rows_choose_ell():
    # Every row the same length (magnitude-pruned weights): no padding and no atomics.
    A = torch.zeros(512, 512)
    g = torch.Generator().manual_seed(2)
    for r in range(512):
        A[r, torch.randperm(512, generator=g)[:20]] = 1.0
    assert rank(row_stats(A), 128)[0].format == "ELL"
    assert isinstance(auto(A, n_cols=128), ELL)


def test_skewed_rows_choose_groupcoo():
    # One row holds a quarter of the entries: ELL would pad every row to it.
    A = _random(2048, 2048, 0.004, seed=3)
    A[7] = 1.0
    ranked = rank(row_stats(A), 128)
    assert ranked[0].format == "GroupCOO"
    ell = [c for c in ranked if c.format == "ELL"]
    assert not ell or ell[0].cost_us > 5 * ranked[0].cost_us


def test_ell_is_never_chosen_when_it_would_not_fit():
    graph = power_law_matrix(1 << 14, 1 << 14, 4, seed=0)
    stats = row_stats(graph)
    assert stats.shape[0] * stats.longest > (1 << 26) or any(c.format == "ELL" for c in rank(stats, 64))
    big = stats.__class__(**{**stats.__dict__, "longest": 1 << 13})
    assert all(c.format != "ELL" for c in rank(big, 64))


@pytest.mark.parametrize("layout", ["dense", "coo", "csr", "bsr"])
def test_auto_from_every_layout_matches_dense(layout):
    A = _random(48, 40, 0.15, seed=4)
    given = {"dense": A, "coo": A.to_sparse_coo(), "csr": A.to_sparse_csr(), "bsr": A.to_sparse_bsr((8, 8))}[layout]
    fmt = auto(given, n_cols=16)
    B = torch.randn(40, 16)
    torch.testing.assert_close(fmt.spmm(B, backend="torch").double(), A.double() @ B.double(), rtol=1e-5, atol=1e-5)
    assert "auto:" in fmt.describe() and "cost model" in fmt.describe()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_auto_half_precision_and_cache(index_dtype):
    A = _random(64, 64, 0.1, seed=5 if index_dtype == torch.int32 else 6)
    first = auto(A, n_cols=32, dtype=torch.float16)
    again = auto(A.to_sparse_csr(), n_cols=32, dtype=torch.float16)
    assert first.dtype == torch.float16 and again.dtype == torch.float16
    assert type(first) is type(again) and "cached choice" in again.describe()
    B = torch.randn(64, 32)
    torch.testing.assert_close(first.to_dense().float(), A.half().float())
    torch.testing.assert_close(first.spmm(B.half(), backend="torch").float(), A.half().float() @ B.half().float(),
                               rtol=1e-2, atol=1e-2)


def test_auto_empty_matrix_and_bad_arguments():
    fmt = auto(torch.zeros(5, 7), n_cols=4)
    assert torch.equal(fmt.spmm(torch.randn(7, 4), backend="torch"), torch.zeros(5, 4))
    with pytest.raises(InsumError, match="n_cols"):
        auto(torch.eye(3), n_cols=0)
    with pytest.raises(InsumError, match="torch.Tensor"):
        auto([[1.0]])
    with pytest.raises(InsumError, match="group_sise"):
        auto(torch.eye(3), group_sise=2)


def test_sparse_linear_auto():
    torch.manual_seed(0)
    layer = SparseLinear(40, 24, format="auto", sparsity=0.8)
    x = torch.randn(6, 40)
    W = layer.weight.to_dense()
    torch.testing.assert_close(layer(x), x @ W.T + layer.bias, rtol=1e-5, atol=1e-5)
    assert isinstance(layer.weight, (ELL, GroupCOO))
    from_dense = SparseLinear.from_dense(W, None, "auto", n_cols=8)
    torch.testing.assert_close(from_dense(x), x @ W.T, rtol=1e-5, atol=1e-5)


def test_demo_on_cpu_checks_and_says_speed_needs_a_gpu(capsys, tmp_path: Path):
    rows = auto_demo(256, 8, 4.0, data=tmp_path)  # no data there: the generated stand-in
    text = capsys.readouterr().out
    assert ("speed-up" if torch.cuda.is_available() else "speed needs a GPU") in text
    assert "generated" in text
    assert len(rows) == 2 and all(r["error"] < 1e-3 for r in rows)
