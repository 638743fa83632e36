"""Sparse formats: exact packing round trips and SpMM against the dense product.

Runs on the CPU through the reference lowering (backend "auto" picks it there). Every
format is checked on the same gallery of awkward matrices (empty rows, no nonzeros, one
nonzero, fully dense, skewed rows, sizes that are not multiples of any block) with
several parameter choices and both index dtypes.
"""

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import insum
from insum.errors import InsumError, InsumShapeError, InsumTypeError
from insum.formats import (
    CELL,
    COO,
    ELL,
    FORMATS,
    NM,
    BlockGroupCOO,
    GroupCOO,
    SparseFormat,
    format_class,
    power_law_matrix,
)
from insum.formats.base import HALF_FAN_IN, accumulation_dtype, default_group_size


def _random(rows, cols, density, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(rows, cols, generator=g, dtype=dtype)
    return A * (torch.rand(rows, cols, generator=g) < density)


def _with_empty_rows():
    A = _random(37, 29, 0.3, 0)
    A[[0, 5, 6, 20, 36]] = 0  # empty rows, including the first and the last
    return A


def _single():
    A = torch.zeros(13, 17, dtype=torch.float64)
    A[7, 11] = 2.5
    return A


def _skewed():
    # A few rows hold most nonzeros: one full row, one half row, many with 0-2 entries.
    A = power_law_matrix(70, 45, 5.0, alpha=1.5, seed=3, dtype=torch.float64).to_dense()
    A[10] = torch.linspace(1, 2, 45, dtype=torch.float64)
    return A


MATRICES = {
    "empty-rows": _with_empty_rows,
    "no-nonzeros": lambda: torch.zeros(6, 9, dtype=torch.float64),
    "single": _single,
    "dense": lambda: _random(9, 11, 1.1, 1),
    "skewed": _skewed,
    "tall-thin": lambda: _random(50, 3, 0.5, 2),
}

CONFIGS = [
    (COO, {}),
    (GroupCOO, {}),  # the paper's rule
    (GroupCOO, {"group_size": 1}),  # degenerates to COO
    (GroupCOO, {"group_size": 3}),  # not a power of two
    (GroupCOO, {"group_size": 64}),  # longer than any row: ELL-like
    (ELL, {}),
    (BlockGroupCOO, {}),  # 16 x 16 blocks, sizes padded
    (BlockGroupCOO, {"block": (4, 8), "group_size": 2}),
    (BlockGroupCOO, {"block": 1}),
    (BlockGroupCOO, {"block": (5, 3), "group_size": 1}),
    (BlockGroupCOO, {"group_size": "row"}),  # Block-ELL
    (BlockGroupCOO, {"block": (4, 3), "group_size": "row"}),
    (CELL, {}),  # widths by the cost model
    (CELL, {"partitions": 3}),
    (CELL, {"max_width": 2}),  # heavy folding
    (CELL, {"partitions": 2, "max_width": 1, "dense_cols": 8}),
]


def _config_id(config):
    cls, params = config
    return cls.__name__ + "".join(f"-{k}={v}" for k, v in params.items())


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
@pytest.mark.parametrize("matrix", MATRICES)
def test_round_trip_and_spmm(matrix, config, index_dtype):
    A = MATRICES[matrix]()
    cls, params = config
    fmt = cls.from_dense(A, index_dtype=index_dtype, **params)
    assert torch.equal(fmt.to_dense(), A)
    assert fmt.nnz == int((A != 0).sum())
    for name, t in fmt.tensors.items():
        if not t.is_floating_point():
            assert t.dtype == index_dtype, name
    B = torch.randn(A.shape[1], 5, dtype=torch.float64)
    torch.testing.assert_close(fmt @ B, A @ B, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_padding_is_zero_valued_with_valid_indices(config):
    A = _skewed()
    cls, params = config
    fmt = cls.from_dense(A, **params)
    for name, t in fmt.tensors.items():
        if not t.is_floating_point() and t.numel():
            assert int(t.min()) >= 0, name
    if isinstance(fmt, BlockGroupCOO):
        bm, bk = fmt.block
        assert int(fmt.AK.max()) < -(-A.shape[1] // bk)
        if "AM" in fmt.tensors:
            assert int(fmt.AM.max()) < -(-A.shape[0] // bm)
        else:  # Block-ELL: one group per block row
            assert fmt.AK.shape[0] == -(-A.shape[0] // bm)
    else:
        for name, t in fmt.tensors.items():
            if name.startswith(("AK", "CI")):
                assert int(t.max()) < A.shape[1], name
            if name.startswith(("AM", "RI")):
                assert int(t.max()) < A.shape[0], name
    assert 0.0 <= fmt.padding_ratio < 1.0
    stored = sum(t.numel() for n, t in fmt.tensors.items() if t.is_floating_point())
    assert fmt.padding_ratio == pytest.approx(1 - fmt.nnz / stored)


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("cls", [COO, GroupCOO, ELL, BlockGroupCOO, CELL], ids=lambda c: c.__name__)
@pytest.mark.parametrize("layout", ["coo", "coo-uncoalesced", "csr", "csc", "bsr"])
def test_from_torch_layouts(cls, layout):
    A = _random(24, 20, 0.3, 4)
    if layout == "coo":
        t = A.to_sparse()
    elif layout == "coo-uncoalesced":
        # Duplicates are summed, as torch does when coalescing.
        idx = A.nonzero().T
        vals = A[idx[0], idx[1]]
        t = torch.sparse_coo_tensor(
            torch.cat([idx, idx], 1), torch.cat([vals / 2, vals / 2]), A.shape
        )
    elif layout == "csr":
        t = A.to_sparse_csr()
    elif layout == "csc":
        t = A.to_sparse_csc()
    else:
        t = A.to_sparse_bsr((4, 5))
    torch.testing.assert_close(cls.from_torch(t).to_dense(), A, rtol=0, atol=1e-15)


def test_from_torch_bsr_keeps_its_blocksize():
    A = _random(24, 20, 0.3, 5)
    fmt = BlockGroupCOO.from_torch(A.to_sparse_bsr((4, 5)))
    assert fmt.block == (4, 5)
    assert BlockGroupCOO.from_torch(A.to_sparse_bsr((4, 5)), block=2).block == (2, 2)


def test_csr_with_explicit_zero_and_int32_indices():
    crow = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    col = torch.tensor([1, 0, 2], dtype=torch.int32)  # unsorted within row 0
    vals = torch.tensor([1.0, 0.0, 3.0])
    t = torch.sparse_csr_tensor(crow, col, vals, (3, 3))
    fmt = GroupCOO.from_torch(t, group_size=2)
    assert fmt.nnz == 3  # the stored zero counts as an entry
    torch.testing.assert_close(fmt.to_dense(), t.to_dense())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cls", [COO, GroupCOO, ELL, BlockGroupCOO, CELL], ids=lambda c: c.__name__)
def test_value_dtypes(cls, dtype):
    A = _random(33, 21, 0.3, 6, dtype=torch.float32).to(dtype)
    fmt = cls.from_dense(A)
    assert fmt.dtype == dtype and fmt.to_dense().dtype == dtype
    assert torch.equal(fmt.to_dense(), A)
    B = torch.randn(21, 8).to(dtype)
    C = fmt @ B
    assert C.dtype == dtype
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(C.float(), A.float() @ B.float(), rtol=tol, atol=tol)
    # Mixed operands promote: a half matrix times a float32 B gives float32.
    assert (fmt @ torch.randn(21, 2)).dtype == torch.promote_types(dtype, torch.float32)


def test_vector_operand_and_backends():
    A = _with_empty_rows()
    fmt = GroupCOO.from_dense(A)
    x = torch.randn(29, dtype=torch.float64)
    torch.testing.assert_close(fmt @ x, A @ x)
    B = torch.randn(29, 4, dtype=torch.float64)
    torch.testing.assert_close(fmt.spmm(B, backend="torch"), A @ B)


def test_zero_width_operands():
    A = _with_empty_rows()
    assert (COO.from_dense(A) @ torch.zeros(29, 0, dtype=torch.float64)).shape == (37, 0)
    empty = ELL.from_dense(torch.zeros(0, 4))
    assert empty.to_dense().shape == (0, 4)
    assert (empty @ torch.ones(4, 3)).shape == (0, 3)


def test_spmm_runs_the_expression_through_insum():
    A = _random(20, 12, 0.4, 7)
    fmt = GroupCOO.from_dense(A, group_size=2)
    B = torch.randn(12, 3, dtype=torch.float64)
    C = torch.zeros(20, 3, dtype=torch.float64)
    insum.insum(fmt.expression, C=C, B=B, **fmt.tensors)
    torch.testing.assert_close(C, A @ B)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda A: GroupCOO.from_dense(A, group_size=0), "group_size"),
        (lambda A: GroupCOO.from_dense(A, group_size="big"), "group_size"),
        (lambda A: GroupCOO.from_dense(A, group_size=2.0), "group_size"),
        (lambda A: BlockGroupCOO.from_dense(A, block=(16, 16), pad=False), "does not divide"),
        (lambda A: BlockGroupCOO.from_dense(A, block=0), "block"),
        (lambda A: BlockGroupCOO.from_dense(A, block=(2, 2, 2)), "block"),
        (lambda A: BlockGroupCOO.from_dense(A, group_size=-1), "group_size"),
        (lambda A: BlockGroupCOO.from_dense(A, group_size="rows"), "'row' or 'tune'"),
        (lambda A: CELL.from_dense(A, max_width=3), "power of two"),
        (lambda A: CELL.from_dense(A, partitions=0), "partitions"),
        (lambda A: CELL.from_dense(A, partitions=30), "partitions"),
        (lambda A: CELL.from_dense(A, search="random"), "binary"),
        (lambda A: COO.from_dense(A, index_dtype=torch.int16), "index_dtype"),
        (lambda A: COO.from_dense(A, colour="red"), "colour"),
        (lambda A: NM.from_dense(A, 3, 2, 1), "n=3 > m=2"),
        (lambda A: NM.from_dense(A, 0, 4, 1), "n must be"),
        (lambda A: NM.from_dense(A, 2, 4, 0), "vector_len"),
        (lambda A: COO.from_dense(A.to_sparse()), "from_torch"),
        (lambda A: COO.from_torch(A), "from_dense"),
        (lambda A: COO.from_dense(A[None]), "shape"),
        (lambda A: COO.from_dense(A.long()), "dtype"),
        (lambda A: format_class("csr5"), "groupcoo"),
        (lambda A: COO.from_dense(A) @ torch.randn(28, 3, dtype=torch.float64), "29 columns"),
        (lambda A: COO.from_dense(A) @ torch.randn(29, 3).long(), "dtype"),
    ],
)
def test_invalid_parameters_raise_insum_error(build, message):
    A = _with_empty_rows()
    with pytest.raises(InsumError) as info:
        build(A)
    assert message in str(info.value)


def test_error_classes():
    A = _with_empty_rows()
    with pytest.raises(InsumShapeError):
        COO.from_dense(A) @ torch.randn(3, 3, dtype=torch.float64)
    K = A.shape[1]  # a batched B whose first dimension is K: the message named a K-to-K "mismatch"
    with pytest.raises(InsumShapeError, match=r"takes a \(K, N\) matrix or a \(K,\) vector; B has shape"):
        COO.from_dense(A) @ torch.randn(K, K, 2, dtype=torch.float64)
    with pytest.raises(InsumTypeError):
        COO.from_dense(A.int())
    assert issubclass(InsumError, ValueError)


# --------------------------------------------------------------------------- interface


def test_registry_and_public_names():
    assert set(FORMATS) == {"coo", "groupcoo", "ell", "blockgroupcoo", "cell", "nm"}
    assert format_class("GroupCOO") is GroupCOO
    assert all(issubclass(c, SparseFormat) and c.expression for c in FORMATS.values())
    assert insum.formats.GroupCOO is GroupCOO
    import insum.formats as formats

    assert set(formats.__all__) >= {
        "COO",
        "GroupCOO",
        "ELL",
        "BlockGroupCOO",
        "CELL",
        "NM",
        "FORMATS",
        "load_mtx",
        "load_smtx",
    }


def test_expressions_parse():
    for cls in FORMATS.values():
        insum.parse(cls.expression)


def test_repr_nbytes_to():
    A = _with_empty_rows()
    fmt = GroupCOO.from_dense(A, group_size=4)
    text = repr(fmt)
    assert "GroupCOO" in text and "shape=(37, 29)" in text and f"nnz={fmt.nnz}" in text
    assert "group_size=4" in text
    assert fmt.nbytes == sum(t.numel() * t.element_size() for t in fmt.tensors.values())
    moved = fmt.to("cpu")
    assert moved is not fmt and moved.device == torch.device("cpu")
    assert torch.equal(moved.to_dense(), A)
    meta = fmt.to("meta")
    assert (
        all(t.device.type == "meta" for t in meta.tensors.values()) and meta.device.type == "meta"
    )
    assert fmt.device.type == "cpu"  # the original is untouched
    with pytest.raises(InsumTypeError, match="meta"):
        meta @ torch.randn(29, 2, dtype=torch.float64)
    for cls, params in CONFIGS:
        assert cls.__name__ in repr(cls.from_dense(A, **params))


def test_tensor_shapes_match_the_design():
    A = _with_empty_rows()
    M, K = A.shape
    g = GroupCOO.from_dense(A, group_size=4)
    G = g.AM.shape[0]
    assert g.AK.shape == (G, 4) == g.AV.shape
    assert bool((g.AM[1:] >= g.AM[:-1]).all())  # groups are sorted by row
    e = ELL.from_dense(A)
    assert e.AK.shape == (M, int((A != 0).sum(1).max()))
    b = BlockGroupCOO.from_dense(A, block=(8, 4), group_size=2)
    assert b.AV.shape == (b.AM.shape[0], 2, 8, 4) and b.padded_shape == (40, 32)
    c = COO.from_dense(A)
    assert c.AM.shape == c.AK.shape == c.AV.shape == (int((A != 0).sum()),)


def test_default_group_size_rule():
    # sqrt(nnz / non-empty rows), rounded to a power of two, capped at the longest row.
    assert default_group_size(torch.tensor([16, 16, 0, 16])) == 4
    assert default_group_size(torch.tensor([64] * 10)) == 8
    assert default_group_size(torch.tensor([100, 1, 1, 1])) == 4  # sqrt(103/4) ~ 5 -> 4
    assert default_group_size(torch.tensor([1, 1, 1])) == 1
    assert default_group_size(torch.tensor([3, 3])) == 2  # sqrt 3 -> 2
    assert default_group_size(torch.tensor([0, 0])) == 1
    A = torch.ones(8, 64)
    assert GroupCOO.from_dense(A).group_size == 8


def test_group_size_tune_measures_neighbours():
    A = _skewed()
    fmt = GroupCOO.from_dense(A, group_size="tune", tune_cols=8)
    times = fmt.params["tuned_seconds"]
    g0 = default_group_size((A != 0).sum(1))
    assert set(times) <= {max(1, g0 // 2), g0, 2 * g0} and g0 in times
    assert fmt.group_size == min(times, key=times.get)
    assert torch.equal(fmt.to_dense(), A)
    assert "tuned" in repr(fmt)


def test_block_group_coo_pads_transparently():
    A = _random(19, 23, 0.5, 8)
    fmt = BlockGroupCOO.from_dense(A, block=(4, 8))
    assert fmt.padded_shape == (20, 24)
    B = torch.randn(23, 6, dtype=torch.float64)
    C = fmt @ B
    assert C.shape == (19, 6)
    torch.testing.assert_close(C, A @ B)
    assert BlockGroupCOO.from_dense(A[:16, :16], block=(4, 8), pad=False).padded_shape == (16, 16)


def test_block_group_coo_groups_along_block_rows():
    A = torch.zeros(8, 8)
    A[0:2, 0:2] = 1  # block (0, 0)
    A[0:2, 4:6] = 2  # block (0, 2)
    A[6, 7] = 3  # block (3, 3)
    fmt = BlockGroupCOO.from_dense(A, block=2, group_size=2)
    assert fmt.AM.tolist() == [0, 3]
    assert fmt.AK.tolist() == [[0, 2], [3, 3]]
    assert fmt.params["blocks"] == 3
    assert torch.equal(fmt.AV[1, 1], torch.zeros(2, 2))  # a padded block


# --------------------------------------------------------------------------- CELL


def test_cell_buckets_are_powers_of_two_and_fold_long_rows():
    A = torch.zeros(6, 40)
    A[0, :37] = 1.0  # a long row
    A[1, :3] = 2.0  # width 4
    A[2, 5] = 3.0  # width 1
    A[3, :5] = 4.0  # width 8
    fmt = CELL.from_dense(A, max_width=8)
    assert fmt.widths == [1, 4, 8]
    assert fmt.RI_8.tolist() == [0, 0, 0, 0, 0, 3]  # row 0 folded into ceil(37/8) rows
    # (the covering layout: the empty rows 4 and 5 are zero rows of width 1)
    assert fmt.buckets == [(0, 1, 3), (0, 4, 1), (0, 8, 6)] and fmt.RI_1.tolist() == [2, 4, 5]
    assert fmt.covering_block == 16
    assert torch.equal(fmt.to_dense(), A)
    torch.testing.assert_close(fmt @ torch.eye(40), A)
    plain = CELL.from_dense(A, max_width=8, cover=False)
    assert plain.buckets == [(0, 1, 1), (0, 4, 1), (0, 8, 6)] and plain.covering_block is None


def test_cell_one_statement_per_width_across_partitions():
    A = _skewed()
    fmt = CELL.from_dense(A, partitions=3)
    assert len(fmt.statements()) == len(fmt.widths) == len({w for _, w, _ in fmt.buckets})
    assert len(fmt.buckets) >= len(fmt.widths)
    assert {p for p, _, _ in fmt.buckets} <= {0, 1, 2}
    assert len(fmt.params["max_widths"]) == 3


def test_cell_cost_model_folds_a_lone_long_row():
    # 1000 rows of 2 nonzeros and one row of 1000: keeping a 1024-wide bucket for one row
    # costs more (its own distinct columns and padding) than folding it into width 2.
    g = torch.Generator().manual_seed(0)
    A = torch.zeros(1001, 1200)
    A[torch.arange(1000).repeat_interleave(2), torch.randint(0, 1200, (2000,), generator=g)] = 1.0
    A[1000, :1000] = 1.0
    fmt = CELL.from_dense(A, dense_cols=128)
    assert fmt.params["max_widths"][0] < 1024
    assert torch.equal(fmt.to_dense(), A)
    # The paper's binary search assumes a unimodal cost and stops at the 1024 local minimum.
    assert CELL.from_dense(A, dense_cols=128, search="binary").params["max_widths"] == [1024]


def test_cell_searches_match_plain_loops():
    # Reimplement LiteForm's Algorithm 3 and the exhaustive scan with plain loops.
    from insum.formats.base import coords_of
    from insum.formats.cell import _scan_widths, _search_widths, _Segments

    A = power_law_matrix(400, 300, 9.0, alpha=1.2, seed=11)
    for partitions in (1, 3):
        seg = _Segments(coords_of(A), partitions)
        chosen = _search_widths(seg, 64).tolist()
        scanned = _scan_widths(seg, 64).tolist()
        for p in range(partitions):

            def cost(e, p=p, seg=seg, partitions=partitions):
                caps = torch.zeros(partitions, dtype=torch.int64)
                caps[p] = e
                return float(seg.cost(caps, 64)[p])

            lo, hi = 0, int(seg.natural_exp()[p])
            while lo < hi:
                mid = (lo + hi) // 2
                if cost(mid) > cost(mid + 1):
                    lo = mid + 1
                else:
                    hi = mid
            assert chosen[p] == lo
            top = int(seg.natural_exp()[p])
            costs = [cost(e) for e in range(top + 1)]
            assert scanned[p] == max(e for e in range(top + 1) if costs[e] == min(costs))


def test_cell_cost_is_liteform_eq7():
    # Rows of 3 and 4 nonzeros share the width-4 bucket: I1 = 2 rows, 5 distinct columns,
    # so 2 * I1 * W + |set(CI)| * J + I1 * J = 2*2*4 + 5*J + 2*J.
    from insum.formats.cell import cell_cost

    A = torch.zeros(2, 8)
    A[0, [0, 1, 2]] = 1
    A[1, [0, 1, 5, 6]] = 1
    assert cell_cost(A, max_width=4, dense_cols=10) == [2 * 2 * 4 + 5 * 10 + 2 * 10]
    # Max width 2 folds both rows in two: I1 = 4 rows of width 2, still 5 distinct columns.
    assert cell_cost(A, max_width=2, dense_cols=10) == [2 * 4 * 2 + 5 * 10 + 4 * 10]


# --------------------------------------------------------------------------- N:M


def _nm_matrix(R, K, n, m, L, seed):
    """An exactly N:M matrix (vectors of L rows); windows may keep fewer than n."""
    g = torch.Generator().manual_seed(seed)
    RB, KW = -(-R // L), -(-K // m)
    score = torch.rand(RB, KW, m, generator=g)
    score[..., :] += (torch.arange(KW * m).view(1, KW, m) >= K) * 10  # never keep padding
    keep = torch.zeros(RB, KW, m, dtype=torch.bool)
    keep.scatter_(2, torch.topk(-score, n, dim=2).indices, True)
    mask = keep.reshape(RB, KW * m)[:, :K].repeat_interleave(L, 0)[:R]
    A = torch.randn(R, K, generator=g, dtype=torch.float64) * mask
    return A, mask


@pytest.mark.parametrize(
    "R, K, n, m, L",
    [
        (16, 32, 2, 4, 1),  # the 2:4 tensor-core pattern
        (32, 64, 2, 4, 16),
        (37, 29, 2, 4, 4),  # sizes that are not multiples: padded
        (24, 40, 1, 8, 8),
        (20, 30, 3, 5, 2),
        (8, 12, 4, 4, 4),  # N = M: dense
        (5, 3, 1, 4, 16),  # smaller than one window and one vector
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_nm_round_trip_and_spmm(R, K, n, m, L, index_dtype):
    A, mask = _nm_matrix(R, K, n, m, L, seed=R * K)
    B = torch.randn(K, 7, dtype=torch.float64)
    for fmt in (
        NM.from_dense(A, n, m, L, index_dtype=index_dtype),
        NM.from_mask(A, mask, n, m, L, index_dtype=index_dtype),
        NM.from_torch(A.to_sparse_csr(), n=n, m=m, vector_len=L, index_dtype=index_dtype),
    ):
        RB, U = -(-R // L), -(-K // m) * n
        assert fmt.AK.shape == (RB, U) and fmt.AV.shape == (RB, L, U)
        assert fmt.AK.dtype == index_dtype and int(fmt.AK.max()) < K
        assert torch.equal(fmt.to_dense(), A)
        torch.testing.assert_close(fmt @ B, A @ B, rtol=1e-12, atol=1e-12)


def _prune_reference(A, n, m, L):
    """Magnitude pruning with plain loops: per row block and window keep the n largest norms."""
    R, K = A.shape
    out = torch.zeros_like(A)
    for r0 in range(0, R, L):
        for k0 in range(0, K, m):
            block = A[r0 : r0 + L, k0 : k0 + m]
            norms = block.norm(dim=0)
            keep = torch.argsort(norms, descending=True, stable=True)[:n]
            out[r0 : r0 + L, k0 + keep] = block[:, keep]
    return out


@pytest.mark.parametrize("n, m, L", [(2, 4, 1), (2, 4, 4), (1, 3, 2), (5, 8, 3)])
def test_nm_from_dense_prunes_by_magnitude(n, m, L):
    A = torch.randn(21, 26, dtype=torch.float64)
    fmt = NM.from_dense(A, n, m, L)
    torch.testing.assert_close(fmt.to_dense(), _prune_reference(A, n, m, L), rtol=0, atol=0)
    B = torch.randn(26, 3, dtype=torch.float64)
    torch.testing.assert_close(fmt @ B, fmt.to_dense() @ B)
    assert fmt.params == {"n": n, "m": m, "vector_len": L}


def test_nm_from_mask_names_the_bad_window():
    A = torch.randn(8, 8)
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[:, [0, 1]] = True
    mask[5, 6] = True  # row block 1 (rows 4..7), window 1 (columns 4..7): one vector
    mask[4, 2] = True  # row block 1, window 0: a third vector
    with pytest.raises(
        InsumError, match=r"row block 1 \(rows 4\..7\), columns 0\..3 keeps 3 vectors"
    ):
        NM.from_mask(A, mask, 2, 4, 4)
    with pytest.raises(InsumShapeError, match="mask has shape"):
        NM.from_mask(A, mask[:3], 2, 4, 4)


def test_nm_vector_mask_and_partial_vectors():
    A = torch.randn(8, 8, dtype=torch.float64)
    vmask = torch.zeros(2, 8, dtype=torch.bool)  # per vector: (R/L, K)
    vmask[0, [1, 3]] = True
    vmask[1, [4, 5]] = True
    fmt = NM.from_mask(A, vmask, 2, 4, 4)
    expected = A * vmask.repeat_interleave(4, 0)
    assert torch.equal(fmt.to_dense(), expected)
    assert fmt.nnz == 16 and fmt.padding_ratio == pytest.approx(0.5)
    # An element mask that keeps part of a vector zeroes the other elements.
    emask = torch.zeros(8, 8, dtype=torch.bool)
    emask[0, 0] = True
    assert torch.equal(NM.from_mask(A, emask, 1, 4, 4).to_dense(), A * emask)


# --------------------------------------------------------------------------- scale, imports


def test_packing_a_million_nonzeros_is_fast():
    A = power_law_matrix(200_000, 100_000, 5.0, alpha=0.6, seed=0)
    assert A._nnz() > 900_000
    builds = [
        lambda: COO.from_torch(A),
        lambda: GroupCOO.from_torch(A),
        lambda: ELL.from_torch(power_law_matrix(100_000, 50_000, 10.0, alpha=0.0, seed=1)),
        lambda: BlockGroupCOO.from_torch(A, block=(4, 4)),
        lambda: CELL.from_torch(A),
        lambda: CELL.from_torch(A, partitions=4),
        lambda: NM.from_dense(torch.randn(1024, 2048), 2, 4, 16),
    ]
    for build in builds:
        start = time.perf_counter()
        fmt = build()
        elapsed = time.perf_counter() - start
        assert fmt.nnz > 900_000
        assert elapsed < 30, f"{type(fmt).__name__} packing took {elapsed:.1f} s"


def test_formats_never_import_codegen_or_runtime():
    root = Path(insum.__file__).parent / "formats"
    for path in root.glob("*.py"):
        text = path.read_text()
        for banned in ("codegen", "runtime", "triton"):
            assert f"import {banned}" not in text and f".{banned} import" not in text, (
                path.name,
                banned,
            )
            assert f"from {banned}" not in text and f"insum.{banned}" not in text, (
                path.name,
                banned,
            )
    # `import insum` may load triton through torch itself (torch._dynamo does): only what
    # importing and using the formats adds on top of it counts.
    code = (
        "import sys, torch, insum\n"
        "before = set(sys.modules)\n"
        "import insum.formats as F\n"
        "A = torch.eye(4)\n"
        "for cls in F.FORMATS.values():\n"
        "    cls.from_dense(A) if cls is not F.NM else cls.from_dense(A, 1, 2, 1)\n"
        "banned = ('insum.codegen', 'insum.runtime', 'triton')\n"
        "bad = [m for m in set(sys.modules) - before if m.startswith(banned)]\n"
        "bad += [m for m in sys.modules if m.startswith(banned[:2])]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "module",
    ["base", "coo", "groupcoo", "ell", "blockgroupcoo", "cell", "nm", "io", "synthetic", "opcount"],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"insum.formats.{module}"))
    assert result.failed == 0


# --------------------------------------------------------------------------- fan-in


def test_fan_in_is_the_most_groups_in_one_output_row():
    A = torch.zeros(6, 40)
    A[0, :37] = 1.0
    A[2, :5] = 2.0
    A[4, 3] = 3.0
    assert COO.from_dense(A).params["fan_in"] == 37
    assert GroupCOO.from_dense(A, group_size=4).params["fan_in"] == 10  # ceil(37 / 4)
    rule = GroupCOO.from_dense(A)
    assert rule.params["fan_in"] == -(-37 // rule.group_size)
    # Block row 0 holds 10 blocks of 2x4 (columns 0..39): groups of 2 give 5.
    assert BlockGroupCOO.from_dense(A, block=(2, 4), group_size=2).params["fan_in"] == 5
    assert BlockGroupCOO.from_dense(A, block=(2, 4), group_size="row").params["fan_in"] == 1
    assert GroupCOO.from_dense(torch.zeros(3, 4)).params["fan_in"] == 0


def test_accumulation_dtype_by_fan_in():
    assert accumulation_dtype(torch.float16, HALF_FAN_IN) == torch.float16
    assert accumulation_dtype(torch.bfloat16, HALF_FAN_IN + 1) == torch.float32
    assert accumulation_dtype(torch.float16, None) == torch.float32  # unknown: the safe side
    assert accumulation_dtype(torch.float32, 10**6) == torch.float32


def test_half_output_with_many_contributions_is_accumulated_in_float32():
    """4096 contributions into one fp16 row: added in fp16 they would lose ~1e-2."""
    g = torch.Generator().manual_seed(0)
    A = (torch.rand(2, 4096, generator=g) + 0.5).to(torch.float16)
    B = (torch.rand(4096, 3, generator=g) + 0.5).to(torch.float16)
    fmt = GroupCOO.from_dense(A, group_size=1)
    assert fmt.params["fan_in"] == 4096
    got = fmt.spmm(B, backend="torch")
    assert got.dtype == torch.float16
    expected = A.double() @ B.double()
    assert ((got.double() - expected).norm() / expected.norm()) < 1e-3


def test_nm_operand_gives_the_gathered_rows_contiguous():
    """N:M gathers rows of B: a transposed operand (a layer's x^T) is copied to contiguous
    rows once (insum's transposing statement), a contiguous one passes as it is, and the
    product is the same."""
    fmt = NM.from_dense(torch.randn(32, 24), n=2, m=4, vector_len=8)
    x = torch.randn(5, 24, dtype=torch.float64)
    copied = fmt.operand(x.t())
    assert copied.is_contiguous() and copied.data_ptr() != x.data_ptr() and torch.equal(copied, x.t())
    x = x.float()
    B = x.t().contiguous()
    assert fmt.operand(B) is B
    torch.testing.assert_close(fmt.spmm(x.t(), backend="torch"), fmt.to_dense() @ x.t())


def test_a_format_moved_to_cpu_0_multiplies():
    """Found by fuzzing: `.to("cpu:0")` recorded cpu:0 while its tensors report cpu, and no
    product then accepted a CPU operand."""
    A = _with_empty_rows()
    fmt = ELL.from_dense(A).to("cpu:0")
    B = torch.randn(A.shape[1], 3, dtype=torch.float64)
    assert fmt.device == torch.device("cpu")
    torch.testing.assert_close(fmt.spmm(B, backend="torch"), A @ B)


@pytest.mark.parametrize("avg", [float("nan"), float("inf"), -1.0])
def test_power_law_matrix_refuses_a_mean_that_is_not_a_finite_count(avg):
    """Found by fuzzing: a NaN mean passed the `< 0` check and built an empty matrix."""
    with pytest.raises(InsumError, match="finite"):
        power_law_matrix(10, 10, avg)


def test_block_ell_gradient_tables_follow_an_edited_index():
    """Found by fuzzing: Block-ELL kept the stored blocks' column list (a copy of AK) and its
    grouped gradient tables across an in-place edit of AK, so the values' gradient used the
    old columns. They are kept per version of the index tensors now."""
    from insum.nn import sparse_linear

    gen = torch.Generator().manual_seed(5)
    A = torch.zeros(8, 16, dtype=torch.float64)
    for r, c in ((0, 0), (0, 2), (1, 1), (2, 3), (3, 0), (3, 4)):
        A[2 * r: 2 * r + 2, 2 * c: 2 * c + 2] = torch.randn(2, 2, dtype=torch.float64, generator=gen)
    fmt = BlockGroupCOO.from_dense(A, block=(2, 2), group_size="row")
    fmt.AV.requires_grad_(True)
    x = torch.randn(3, 16, dtype=torch.float64, generator=gen)
    sparse_linear(x, fmt, backend="torch").sum().backward()
    with torch.no_grad():
        fmt.AK.copy_((fmt.AK + 2) % 8)  # every block two block columns on
    fmt.AV.grad = None
    sparse_linear(x, fmt, backend="torch").sum().backward()
    fresh = copy.deepcopy(fmt)
    fresh.AV.grad = None
    sparse_linear(x, fresh, backend="torch").sum().backward()
    torch.testing.assert_close(fmt.AV.grad, fresh.AV.grad)
