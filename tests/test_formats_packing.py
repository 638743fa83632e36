"""Packing cost and the paths behind it: host syncs and launched ops per packer, inputs that
break the CSR invariants, both ways of finding nonzero blocks, and Block-ELL.

The op and sync bounds guard the GPU packing time on any machine: `count_ops` treats every
tensor as if it lived on a GPU (see insum/formats/opcount.py). They may fail on purpose
when a change adds syncs or launches; raise a bound only with a reason.
"""

import pytest
import torch

import insum
from insum.formats import CELL, COO, ELL, BlockGroupCOO, GroupCOO, power_law_matrix
from insum.formats import blockgroupcoo as blockgroupcoo_module
from insum.formats.opcount import count_ops


def _csr(rows=600, cols=500, avg=12.0, seed=0):
    return power_law_matrix(rows, cols, avg, alpha=1.0, seed=seed, dtype=torch.float32)


# (format, params, most ops): one host sync each, the read of the padded sizes. Each counts
# the range check of the CSR tensor's columns (one aminmax, read in the sync; BlockGroupCOO
# and CELL clamp the columns too, since their device work indexes by them before the sync).
BUDGET = [
    (COO, {}, 12),  # each packer also reads its fan-in (groups per output row) in the sync
    (GroupCOO, {}, 30),
    (GroupCOO, {"group_size": 8}, 27),
    (ELL, {}, 19),
    (BlockGroupCOO, {}, 45),
    (BlockGroupCOO, {"group_size": 2}, 43),
    (BlockGroupCOO, {"group_size": "row"}, 35),
    # CELL: +65 for the covering layout's next fit (a scan over the fold counts' runs) and
    # summary, before the sync (this matrix's hub rows fold too often for the layout;
    # `test_covering_cell_packs_in_one_sync` takes it).
    (CELL, {}, 144),
    (CELL, {"partitions": 3}, 85),
    (CELL, {"max_width": 8}, 139),
]


@pytest.mark.parametrize(
    "cls, params, most_ops", BUDGET, ids=lambda x: getattr(x, "__name__", str(x))
)
def test_packing_from_csr_syncs_once(cls, params, most_ops):
    A = _csr()
    with count_ops() as counted:
        fmt = cls.from_torch(A, **params)
    assert counted.syncs <= 1, counted
    assert counted.ops <= most_ops, counted
    assert torch.equal(fmt.to_dense(), A.to_dense())


def test_covering_cell_packs_in_one_sync():
    """CELL's covering layout (no row folded more than 16 times): ~30 more ops than the plain
    layout's after the sync (the bucket rows' positions), still one sync."""
    A = power_law_matrix(600, 500, 12.0, alpha=0.3, seed=0, dtype=torch.float32)
    with count_ops() as counted:
        fmt = CELL.from_torch(A)
    assert fmt.covering_block == 16
    assert counted.syncs <= 1, counted
    assert counted.ops <= 175, counted
    assert torch.equal(fmt.to_dense(), A.to_dense())


def test_binary_search_is_sync_free_too():
    A = _csr()
    with count_ops() as counted:
        CELL.from_torch(A, partitions=2, search="binary")
    assert counted.syncs <= 1, counted


def test_count_ops_sees_syncs():
    x = torch.arange(10)
    with count_ops() as counted:
        x.tolist()
        x[x > 3]
        torch.repeat_interleave(x)
        torch.repeat_interleave(x, output_size=45)  # sized by the caller: no sync
        torch.unique(x)
        x.sum().item()
    assert counted.syncs == 5, counted
    assert torch.Tensor.tolist is not None and x[:2].tolist() == [0, 1]  # restored


def _messy_csr(seed, int32=False):
    """A CSR tensor torch accepts without checking: unsorted columns, duplicates, zeros."""
    g = torch.Generator().manual_seed(seed)
    M, K = 23, 19
    counts = torch.randint(0, 9, (M,), generator=g)
    counts[[0, 7, 22]] = 0
    crow = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    cols = torch.randint(0, K, (int(crow[-1]),), generator=g)
    vals = torch.randn(cols.numel(), generator=g, dtype=torch.float64)
    vals[::7] = 0
    if int32:
        crow, cols = crow.int(), cols.int()
    return torch.sparse_csr_tensor(crow, cols, vals, (M, K))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "cls, params",
    [(COO, {}), (GroupCOO, {}), (GroupCOO, {"group_size": 3}), (ELL, {}), (BlockGroupCOO, {})]
    + [(BlockGroupCOO, {"block": 4, "group_size": "row"}), (CELL, {}), (CELL, {"partitions": 3})],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_unsorted_or_duplicated_csr_packs_like_its_coalesced_matrix(cls, params, seed):
    t = _messy_csr(seed, int32=bool(seed))
    # (to_sparse_coo() would trust the CSR invariants and mark the result coalesced)
    rows = torch.repeat_interleave(t.crow_indices().long().diff())
    indices = torch.stack([rows, t.col_indices().long()])
    coalesced = torch.sparse_coo_tensor(indices, t.values(), t.shape).coalesce()
    assert coalesced._nnz() < t._nnz()  # duplicates were summed
    fmt, expected = cls.from_torch(t, **params), cls.from_torch(coalesced, **params)
    assert fmt.nnz == expected.nnz == coalesced._nnz()
    assert fmt.tensors.keys() == expected.tensors.keys()
    for name, tensor in expected.tensors.items():
        assert torch.equal(fmt.tensors[name], tensor), name
    assert fmt.params == expected.params


@pytest.mark.parametrize("block", [1, (2, 3), (16, 16)])
def test_block_ranks_by_sort_match_the_occupancy_map(monkeypatch, block):
    A = _csr(300, 280, 3.0, seed=4)
    by_map = BlockGroupCOO.from_torch(A, block=block)
    monkeypatch.setattr(blockgroupcoo_module, "BITMAP_CELLS", 0)
    nnz, (bm, bk) = A._nnz(), by_map.block
    sorted_path = -(-300 // bm) * -(-280 // bk) > 4 * nnz
    by_sort = BlockGroupCOO.from_torch(A, block=block)
    assert sorted_path or block == (16, 16)  # small blocks take the sort when the map is off
    for name, tensor in by_map.tensors.items():
        assert torch.equal(by_sort.tensors[name], tensor), name
    assert by_sort.params == by_map.params


# --------------------------------------------------------------------------- Block-ELL


def _blocky(M=45, K=38, seed=6):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(M, K, generator=g, dtype=torch.float64)
    A *= torch.rand(M, K, generator=g) < 0.15
    A[8:16] = 0  # block row 1 (of 8-row blocks) is empty
    A[40:] = 0  # and the last, partial one
    return A


@pytest.mark.parametrize("block", [8, (8, 5), (4, 16)])
def test_block_ell_round_trip_and_spmm(block):
    A = _blocky()
    fmt = BlockGroupCOO.from_dense(A, block=block, group_size="row")
    bm, bk = fmt.block
    MB, KB = -(-45 // bm), -(-38 // bk)
    assert "AM" not in fmt.tensors
    assert (
        fmt.expression == BlockGroupCOO.row_expression == "C[p,m,n] += AV[p,q,m,k]*B[AK[p,q],k,n]"
    )
    assert BlockGroupCOO.expression.startswith("C[AM[p]")  # the class keeps the grouped one
    tiles = (
        (
            A.new_zeros(MB * bm, KB * bk).index_put_(
                tuple(torch.meshgrid(torch.arange(45), torch.arange(38), indexing="ij")), A
            )
            != 0
        )
        .view(MB, bm, KB, bk)
        .any(3)
        .any(1)
    )
    widest = int(tiles.sum(1).max())
    assert fmt.AK.shape == (MB, widest) and fmt.AV.shape == (MB, widest, bm, bk)
    assert fmt.group_size == widest and fmt.params["blocks"] == int(tiles.sum())
    assert torch.equal(fmt.to_dense(), A)
    # Each block row's blocks in column order, padded with its first column (0 if empty).
    for r in range(MB):
        cols = tiles[r].nonzero().flatten().tolist()
        pad = cols[:1] or [0]
        assert fmt.AK[r].tolist() == cols + pad * (widest - len(cols))
        assert not fmt.AV[r, len(cols) :].any()
    B = torch.randn(38, 7, dtype=torch.float64)
    torch.testing.assert_close(fmt @ B, A @ B, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fmt.spmm(B, backend="torch"), A @ B, rtol=1e-12, atol=1e-12)
    assert fmt.padding_ratio == pytest.approx(1 - fmt.nnz / fmt.AV.numel())
    text = repr(fmt)
    assert "group_size=row" in text and f"width={widest}" in text
    moved = fmt.to("cpu")
    assert moved.expression == fmt.expression and torch.equal(moved.to_dense(), A)


def test_block_ell_statement_runs_through_insum():
    A = _blocky()
    fmt = BlockGroupCOO.from_dense(A, block=8, group_size="row")
    (Mp, Kp), B = fmt.padded_shape, torch.randn(38, 4, dtype=torch.float64)
    C = torch.zeros(Mp // 8, 8, 4, dtype=torch.float64)
    Bp = torch.cat([B, B.new_zeros(Kp - 38, 4)]).view(Kp // 8, 8, 4)
    insum.insum(fmt.expression, C=C, B=Bp, **fmt.tensors)
    torch.testing.assert_close(C.view(Mp, 4)[:45], A @ B)


def test_block_ell_edge_cases():
    empty = BlockGroupCOO.from_dense(torch.zeros(20, 9), block=4, group_size="row")
    assert empty.AK.shape == (5, 1) and not empty.AK.any() and not empty.AV.any()
    assert (empty @ torch.ones(9, 2)).abs().sum() == 0
    nothing = BlockGroupCOO.from_dense(torch.zeros(0, 9), block=4, group_size="row")
    assert nothing.AK.shape == (0, 1) and nothing.to_dense().shape == (0, 9)
    A = torch.zeros(9, 9)
    A[8, 8] = 3.0  # only the last, partial block
    fmt = BlockGroupCOO.from_dense(A, block=4, group_size="row", index_dtype=torch.int64)
    assert fmt.AK.tolist() == [[0], [0], [2]] and fmt.AK.dtype == torch.int64
    assert torch.equal(fmt.to_dense(), A)


def test_block_group_size_tune_includes_row():
    A = _blocky()
    fmt = BlockGroupCOO.from_dense(A, block=8, group_size="tune", tune_cols=4)
    times = fmt.params["tuned_seconds"]
    assert "row" in times and len(times) >= 2
    best = min(times, key=times.get)
    assert fmt.params["group_size"] == best
    assert torch.equal(fmt.to_dense(), A) and "tuned" in repr(fmt)


def test_block_group_size_tune_skips_row_when_padding_explodes():
    A = torch.zeros(512, 512)
    A[0] = 1.0  # one full block row of 64 blocks, 63 block rows of one block
    A[8::8, 0] = 1.0
    fmt = BlockGroupCOO.from_dense(A, block=8, group_size="tune", tune_cols=2)
    assert "row" not in fmt.params["tuned_seconds"]
    assert torch.equal(fmt.to_dense(), A)


def test_row_padding_slots_bounds_the_packed_slots():
    # The benchmarks skip a matrix by this bound, read before packing: it must hold after.
    csr = power_law_matrix(70, 50, 6, seed=3)
    shape, longest = tuple(csr.shape), int(csr.crow_indices().diff().max())
    assert ELL.row_padding_slots(shape, longest, {}) == ELL.from_torch(csr).AV.numel()
    params = {"block": (16, 8), "group_size": "row"}
    block_ell = BlockGroupCOO.from_torch(csr, **params)
    assert block_ell.AV.numel() <= BlockGroupCOO.row_padding_slots(shape, longest, params)
    assert GroupCOO.row_padding_slots(shape, longest, {}) == 0


def test_covering_groupcoo_packs_in_two_syncs():
    """GroupCOO's covering layout: the plain packer's sync (which reads the fan-in), then one
    more for the padded group count, only where no row has more than 16 groups; the rows'
    starts are a scan of log2(M) steps (~6 ops each) on the device."""
    A = power_law_matrix(600, 500, 6.0, alpha=0.3, seed=0, dtype=torch.float32)
    with count_ops() as counted:
        fmt = GroupCOO.from_torch(A)
    assert fmt.covering_block == 16
    assert counted.syncs <= 2, counted
    assert counted.ops <= 100, counted
    assert torch.equal(fmt.to_dense(), A.to_dense())
