"""GroupCOO's and COO's covering layout: every row, empty ones too, keeps its groups inside one
aligned block of 16, so that the repeated product stores every row into an uninitialised C.

The claim is a fact the format declares (`covering_block`) and nothing checks at run time,
so these tests poison the output the pinned launch writes and compare with a float64 dense
product: a row the launch leaves unwritten, or adds into, shows as NaN. In the interpreter on
CPU tensors; on CUDA tensors, compiled, where CUDA is present (`gpu_suite.sh gcfill`).
"""

import pytest
import torch
from kernel_env import CUDA  # before insum: the interpreter on CPU-only machines

from insum.codegen import configs_for, prune_configs
from insum.codegen.tune import SEGMENT_TILE
from insum.formats import COO, GroupCOO
from insum.formats.grouping import COVER_BLOCK, CoveringLayout
from insum.nn import SparseLinear

pytestmark = pytest.mark.gpu if CUDA else pytest.mark.interpreter
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _next_fit(per_row: list[int]) -> tuple[list[int], int]:
    """Sequential next fit: each row (an empty one as one group) at the next position from
    which it stays inside one aligned block."""
    starts, pos = [], 0
    for c in per_row:
        c = max(c, 1)
        if pos % COVER_BLOCK + c > COVER_BLOCK:
            pos += COVER_BLOCK - pos % COVER_BLOCK
        starts.append(pos)
        pos += c
    return starts, pos


@pytest.mark.parametrize("rows", [1, 2, 7, 33, 200])
def test_layout_is_sequential_next_fit(rows):
    per_row = torch.randint(0, COVER_BLOCK + 1, (rows,), generator=torch.Generator().manual_seed(rows))
    per_row[rows // 2] = COVER_BLOCK
    layout = CoveringLayout(per_row)
    starts, total = _next_fit(per_row.tolist())
    assert layout.start.tolist() == starts and int(layout.total) == total
    row, rank = layout.groups(total)
    # Every row's groups in one aligned block; rows in order (AM non-decreasing, equal adjacent).
    assert torch.all(row.diff() >= 0)
    for r in range(rows):
        mine = (row == r).nonzero().view(-1)
        assert mine.numel() >= max(int(per_row[r]), 1)
        assert int(mine[0]) // COVER_BLOCK == (int(mine[0]) + max(int(per_row[r]), 1) - 1) // COVER_BLOCK
        assert rank[mine].tolist() == list(range(mine.numel()))


def _matrix(M, K, lengths, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    A = torch.zeros(M, K, dtype=dtype)
    for r, n in enumerate(lengths):
        A[r, torch.randperm(K, generator=gen)[:n]] = torch.randn(n, generator=gen, dtype=dtype)
    return A.to(DEVICE)


def _check_product(fmt, A, B):
    """Three products (the first, the one that pins, a pinned one), then the pinned launch
    into a NaN-filled C: each equal to the float64 dense product."""
    expected = A.double() @ B.double()
    for _ in range(3):
        C = fmt.spmm(B, backend="triton")
        torch.testing.assert_close(C.double(), expected, rtol=1e-4, atol=1e-4)
    plan = next(iter(fmt._spmm_plans.values()))
    assert plan.pinned is not None
    assert plan.pinned.covers == (fmt.covering_block is not None)
    if plan.pinned.covers:
        C = torch.full(plan.shape, float("nan"), dtype=plan.acc, device=DEVICE)
        assert plan.pinned.run({"C": C, "B": fmt.operand(B)})  # B as `spmm` gives it (its operand view)
        torch.testing.assert_close(C.double(), expected, rtol=1e-4, atol=1e-4)


# (lengths per row, group size): empty rows, one row, a row of exactly 16 groups, rows that
# skip to the next block.
COVERING = [
    ([3, 0, 5, 0, 0, 8, 1, 2, 0, 7, 4, 6, 1, 0, 3], 2),
    ([5], 2),
    ([32, 0, 3, 1, 2], 2),  # row 0: 16 groups of 2, a whole block
    ([9, 0, 4, 4, 4, 4, 4, 1], 4),
]


@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lengths, g", COVERING)
def test_covering_groupcoo_product(lengths, g, itype):
    A = _matrix(len(lengths), 40, lengths)
    fmt = GroupCOO.from_dense(A, group_size=g, index_dtype=itype)
    assert fmt.covering_block == COVER_BLOCK and fmt.AM.dtype == itype
    assert torch.equal(fmt.to_dense(), A)
    assert torch.all(fmt.AM.diff() >= 0) and set(fmt.AM.tolist()) == set(range(len(lengths)))
    B = torch.randn(7, 40, device=DEVICE).t()  # non-contiguous
    _check_product(fmt, A, B)


@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
def test_covering_coo_product(itype):
    lengths = [3, 0, 12, 0, 5, 1, 6, 0, 2, 16]  # a row of exactly 16 entries
    A = _matrix(len(lengths), 20, lengths, seed=1)
    fmt = COO.from_dense(A, index_dtype=itype)
    assert fmt.covering_block == COVER_BLOCK and fmt.nnz == sum(lengths)
    assert torch.equal(fmt.to_dense(), A)
    _check_product(fmt, A, torch.randn(20, 6, device=DEVICE))


def test_row_over_a_block_falls_back():
    """A row of 17 groups (34 entries, g = 2) cannot stay in one block: the plain layout, the
    product zero-fills C and still matches."""
    A = _matrix(4, 40, [34, 0, 3, 2])
    fmt = GroupCOO.from_dense(A, group_size=2)
    assert fmt.covering_block is None and fmt.groups == 17 + 2 + 1
    _check_product(fmt, A, torch.randn(40, 5, device=DEVICE))
    assert COO.from_dense(_matrix(3, 20, [17, 1, 0])).covering_block is None


def test_padding_over_m_slots_falls_back():
    """Rows of 9 entries: one per block of 16, 7 padding entries per row (> M in all)."""
    A = _matrix(6, 20, [9] * 6)
    assert COO.from_dense(A).covering_block is None
    assert COO.from_dense(A, cover=False).covering_block is None
    assert GroupCOO.from_dense(_matrix(6, 40, [3] * 6), group_size=1, cover=False).covering_block is None


def test_all_empty_and_half_precision():
    empty = GroupCOO.from_dense(torch.zeros(5, 4, device=DEVICE))
    assert empty.covering_block is None
    assert torch.equal(empty.spmm(torch.randn(4, 3, device=DEVICE), backend="triton"), torch.zeros(5, 3, device=DEVICE))
    A = _matrix(9, 24, [3, 0, 5, 2, 0, 1, 4, 4, 2]).half()
    fmt = GroupCOO.from_dense(A, group_size=2)
    assert fmt.covering_block == COVER_BLOCK
    B = torch.randn(24, 5, device=DEVICE).half()
    for _ in range(3):
        C = fmt.spmm(B, backend="triton")
        torch.testing.assert_close(C.double(), A.double() @ B.double(), rtol=1e-2, atol=1e-2)


def test_segment_tiles_are_multiples_of_the_block():
    """The tuner's tiles along the scattered variable of the covering product's segment plan
    are multiples of COVER_BLOCK, or span all the groups: each tile stores whole rows."""
    assert SEGMENT_TILE % COVER_BLOCK == 0  # the tuner's least segment tile holds whole blocks
    A = _matrix(40, 30, [(r * 7) % 12 for r in range(40)])
    fmt = GroupCOO.from_dense(A, group_size=2)
    assert fmt.covering_block == COVER_BLOCK
    fmt.spmm(torch.randn(30, 4, device=DEVICE), backend="triton")
    from insum import runtime

    plans = [k.plan for k in runtime._KERNELS.values() if k.plan.output == "segment" and "AM" in k.plan.spec.sorted_indices]
    assert plans
    for G in (fmt.groups, 5, 16, 48, 1000):
        for plan in plans:
            for config in prune_configs(plan, configs_for(plan), {"p": G, "q": 2, "n": 4}):
                tile = config[f"BLOCK_{plan.var_axis('p')}"]
                assert tile % COVER_BLOCK == 0 or tile >= G, (G, config)


def test_covering_layer_forward_and_backward():
    """SparseLinear on a covering GroupCOO: the forward (covering product) and the backward
    (the transposed pattern, which claims no covering) equal dense autograd."""
    A = _matrix(12, 16, [3, 0, 5, 2, 0, 1, 4, 4, 2, 7, 0, 1])
    fmt = GroupCOO.from_dense(A, group_size=2)
    assert fmt.covering_block == COVER_BLOCK
    layer = SparseLinear.from_format(fmt, torch.randn(12, device=DEVICE), backend="triton")
    x = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    dense_x = x.detach().clone().requires_grad_(True)
    dy = torch.randn(5, 12, device=DEVICE)
    layer(x).backward(dy)
    (dense_x @ A.t() + layer.bias.detach()).backward(dy)
    torch.testing.assert_close(x.grad, dense_x.grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(layer(x), x @ A.t() + layer.bias, rtol=1e-4, atol=1e-4)
