"""Gathered loads from a tensor whose contiguous dimension is not its last (x^T, as a layer
passes its input): `KernelSpec.unit_dims`, and the load laid out with that dimension fastest
(`tl.trans` of a tile built the other way round), checked against float64 products.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from kernel_env import DEVICE, KERNEL_MARK  # before insum: the interpreter on CPU-only machines

import insum
from insum.bind import bind
from insum.formats import NM, BlockGroupCOO
from insum.parser import parse
from insum.runtime import _unit_dim, kernel_for

pytestmark = KERNEL_MARK
GOLDEN = Path(__file__).parent / "golden"


def test_unit_dim_of_layouts():
    x = torch.empty(6, 10)
    assert _unit_dim(x) is None  # row-major: the usual layout
    assert _unit_dim(x.t()) == 0
    assert _unit_dim(x.t().reshape(2, 5, 6)) == 1  # a block view of x^T, as BlockGroupCOO.operand makes
    assert _unit_dim(torch.empty(6, 1)) is None  # one column: nothing to coalesce
    assert _unit_dim(x[:, ::2]) is None  # no dimension of stride 1
    assert _unit_dim(torch.empty(5)) is None


def _nm(index_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(48, 72, generator=g)  # 3 row blocks of 16, K = 72 (not a power of two)
    return NM.from_dense(W.to(DEVICE), n=2, m=4, vector_len=16, index_dtype=index_dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_nm_product_on_a_transposed_operand(index_dtype):
    fmt = _nm(index_dtype)
    x = torch.randn(37, 72, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected = fmt.to_dense().double().cpu() @ x.t().double().cpu()
    for B in (x.t(), x.t().contiguous()):
        got = fmt.spmm(B, backend="triton", precision="ieee")
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-5)


def _source(fmt, B) -> str:
    (expr, tensors), = fmt.statements()
    bound = bind(parse(expr.replace("+=", "=")), {**tensors, "B": fmt.operand(B),
                                                   "C": torch.empty(fmt.output_shape(B.shape[1]), device=DEVICE)})
    return kernel_for(bound, precision="ieee").source


def test_the_gathered_rows_of_a_transposed_operand_load_along_the_gather():
    fmt = _nm(torch.int32)
    x = torch.randn(37, 72).to(DEVICE)
    transposed, plain = _source(fmt, x.t()), _source(fmt, x.t().contiguous())
    assert "tl.trans(tl.load(B_ptr + AK_val[None, :]" in transposed
    assert "tl.trans" not in plain
    path = GOLDEN / "nm_transposed_operand.py"
    if os.environ.get("INSUM_UPDATE_GOLDEN"):
        path.write_text(transposed)
    assert transposed == path.read_text()


def test_a_direct_index_on_the_contiguous_dimension_keeps_its_layout():
    """Block-ELL on x^T: B's contiguous dimension (k, within a block) is indexed directly,
    which the compiler sees; only its block index is gathered."""
    W = torch.zeros(32, 48)
    W[:16, 16:32] = 1.0
    W[16:, :16] = 2.0
    fmt = BlockGroupCOO.from_dense(W.to(DEVICE), block=16, group_size="row")
    x = torch.randn(20, 48).to(DEVICE)
    assert "tl.trans" not in _source(fmt, x.t())
    torch.testing.assert_close(fmt.spmm(x.t(), backend="triton", precision="ieee").cpu(), W @ x.t().cpu(),
                               rtol=1e-5, atol=1e-5)


def test_a_scalar_gather_on_a_transposed_table():
    """`E[i, n] = W[R[i], n]` with W column-major: the gathered rows load along the gather,
    with masks on both axes (sizes not powers of two)."""
    g = torch.Generator().manual_seed(3)
    W = torch.randn(9, 50, generator=g).t()  # (50, 9), stride (1, 50)
    rows = torch.randint(0, 50, (23,), generator=g, dtype=torch.int32)
    assert "W_val = tl.trans(tl.load(" in insum.explain("E[i, n] = W[R[i], n]", W=W, R=rows)
    out = insum.insum("E[i, n] = W[R[i], n]", W=W.to(DEVICE), R=rows.to(DEVICE), backend="triton")
    torch.testing.assert_close(out.cpu(), W[rows.long()])
