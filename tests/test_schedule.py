"""Schedule choices: single ownership of scattered outputs (`unique_indices`, affine
indices) and the ranking of candidate plans by the cost model.

Ownership: a scatter whose output coordinates determine every output-side variable stores
without atomics; the kernel's results equal the torch lowering on poisoned outputs, for
`+=` and `=`, int32 and int64 indices; a statement without the proof keeps its atomics.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("INSUM_AUTOTUNE", "0")

import insum  # noqa: E402
from insum.bind import bind  # noqa: E402
from insum.errors import InsumError  # noqa: E402
from insum.formats import CELL  # noqa: E402
from insum.parser import parse  # noqa: E402
from insum.runtime import kernel_for  # noqa: E402

pytestmark = pytest.mark.gpu if CUDA else pytest.mark.interpreter
DEVICE = "cuda" if CUDA else "cpu"


def _distinct(g: torch.Generator, high: int, *shape: int, index_dtype=torch.int64) -> torch.Tensor:
    """`prod(shape)` distinct values below `high`, in random order."""
    count = 1
    for s in shape:
        count *= s
    return torch.randperm(high, generator=g)[:count].reshape(shape).to(index_dtype)


def _tensors(stmt: str, g: torch.Generator, index_dtype: torch.dtype) -> tuple[dict, frozenset[str]]:
    """Inputs for the ownership statements below, and the index tensors that are unique."""
    if stmt.startswith("C[AM[p], n]"):  # GroupCOO-like, one group per row, rows 0..10
        return {
            "C": torch.randn(11, 5, generator=g),
            "AM": _distinct(g, 11, 7, index_dtype=index_dtype),
            "AV": torch.randn(7, 3, generator=g),
            "AK": torch.randint(0, 9, (7, 3), generator=g).to(index_dtype),
            "B": torch.randn(9, 5, generator=g),
        }, frozenset({"AM"})
    if stmt.startswith("C[AM[p]*4"):  # blocks of 4 rows on an unblocked output
        return {
            "C": torch.randn(6 * 4, 3, generator=g),
            "AM": _distinct(g, 6, 5, index_dtype=index_dtype),
            "AV": torch.randn(5, 2, 4, 4, generator=g),
            "AK": torch.randint(0, 3, (5, 2), generator=g).to(index_dtype),
            "B": torch.randn(3 * 4, 3, generator=g),
        }, frozenset({"AM"})
    if stmt.startswith("Z[b, ZI"):  # e3nn layout: nested index tensors, Z[b, ZI[w, k]]
        return {
            "Z": torch.randn(3, 30, generator=g),
            "ZI": _distinct(g, 30, 4, 5, index_dtype=index_dtype),
            "CV": torch.randn(5, 2, generator=g),
            "CI": torch.randint(0, 3, (5, 2), generator=g).to(index_dtype),
            "XI": torch.randint(0, 7, (6, 3), generator=g).to(index_dtype),
            "X": torch.randn(3, 7, generator=g),
            "W": torch.randn(6, 4, generator=g),
        }, frozenset({"ZI"})
    if stmt.startswith("O[2*i"):  # an injective affine index
        return {"O": torch.randn(2 * 9 + 1, 4, generator=g), "A": torch.randn(9, 6, generator=g),
                "B": torch.randn(6, 4, generator=g)}, frozenset()
    raise KeyError(stmt)


OWNED = [
    "C[AM[p], n] += AV[p, q] * B[AK[p, q], n]",
    "C[AM[p], n] = AV[p, q] * B[AK[p, q], n]",
    "C[AM[p]*4 + m, n] += AV[p, q, m, k] * B[AK[p, q]*4 + k, n]",
    "Z[b, ZI[w, k]] = CV[k, q] * X[b, XI[u, CI[k, q]]] * W[u, w]",
    "Z[b, ZI[w, k]] += CV[k, q] * X[b, XI[u, CI[k, q]]] * W[u, w]",
    "O[2*i + 1, n] = A[i, k] * B[k, n]",
]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("stmt", OWNED)
def test_owned_scatter_stores_and_matches_reference(stmt, index_dtype):
    g = torch.Generator().manual_seed(3)
    tensors, unique = _tensors(stmt, g, index_dtype)
    tensors = {k: v.to(DEVICE) for k, v in tensors.items()}
    out = parse(stmt).output.name
    expected = insum.insum(stmt, backend="torch", **{k: v.clone() for k, v in tensors.items()})
    given = {k: v.clone() for k, v in tensors.items()}
    if not parse(stmt).accumulate:
        given[out].fill_(float("nan"))  # `=`: rows no program reaches must become zero
    actual = insum.insum(stmt, backend="triton", precision="ieee", unique_indices=unique, **given)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    kernel = kernel_for(bind(parse(stmt), given), "ieee", unique_indices=unique)
    assert kernel.plan.output == "store"
    assert "atomic" not in kernel.source


@pytest.mark.parametrize("stmt", OWNED[:5])
def test_undeclared_index_keeps_atomics(stmt):
    """Without the declaration the same statements cannot prove one writer."""
    tensors, _ = _tensors(stmt, torch.Generator().manual_seed(4), torch.int64)
    kernel = kernel_for(bind(parse(stmt), {k: v.to(DEVICE) for k, v in tensors.items()}))
    assert kernel.plan.output == "atomic"
    assert "tl.atomic_add" in kernel.source


@pytest.mark.parametrize(
    "stmt, shapes, unique",
    [
        # two unit terms collide: O[1] is i=1, j=0 and i=0, j=1
        ("O[i + j, n] += A[i, n] * E[j]", {"O": (9, 3), "A": (5, 3), "E": (4,)}, frozenset()),
        # m's 4 values overlap the next block of 2 rows
        ("C[AM[p]*2 + m, n] += A[p, m, n]", {"C": (20, 3), "AM": (5,), "A": (5, 4, 3)}, frozenset({"AM"})),
        # the unique tensor is not the scattered one
        ("C[AM[p], n] += A[p, n] * B[AK[p], n]", {"C": (9, 3), "AM": (5,), "AK": (5,), "A": (5, 3), "B": (7, 3)},
         frozenset({"AK"})),
    ],
)
def test_unproven_scatter_keeps_atomics(stmt, shapes, unique):
    from insum.codegen import schedule
    from insum.runtime import spec_for

    tensors = {n: torch.zeros(s, dtype=torch.int64 if n.startswith("A") and n != "A" else torch.float32, device="meta")
               for n, s in shapes.items()}
    spec = spec_for(bind(parse(stmt), tensors), unique_indices=unique)
    assert schedule(spec).output == "atomic"


def test_unique_indices_names_an_index_tensor():
    tensors, _ = _tensors(OWNED[0], torch.Generator().manual_seed(5), torch.int64)
    with pytest.raises(InsumError, match="unique_indices names 'AV'"):
        insum.insum(OWNED[0], backend="triton", unique_indices={"AV"}, **tensors)


def test_explain_says_owned():
    tensors, unique = _tensors(OWNED[3], torch.Generator().manual_seed(6), torch.int64)
    text = insum.explain(OWNED[3], unique_indices=unique, **tensors)
    assert "one writer per element: plain stores" in text


@pytest.mark.parametrize("params", [{}, {"max_width": 2}, {"max_width": 4}, {"partitions": 2}], ids=str)
def test_cell_declares_unique_rows_only_where_true(params):
    """CELL's RI holds each row once below the widest bucket (one partition): checked on
    the packed data, and the SpMM still equals the dense product."""
    g = torch.Generator().manual_seed(7)
    A = torch.randn(40, 30, generator=g) * (torch.rand(40, 30, generator=g) < 0.15)
    A[3, :20] = 1.0  # one long row: folded at small caps
    fmt = CELL.from_dense(A, **params)
    declared = 0
    for _, tensors in fmt.statements():
        if "RI" in fmt.unique_in(tensors):
            declared += 1
            assert tensors["RI"].unique().numel() == tensors["RI"].numel()
    assert declared >= (1 if params.get("partitions", 1) == 1 else 0)
    if params.get("partitions", 1) > 1:
        assert declared == 0
    B = torch.randn(30, 6, generator=g)
    torch.testing.assert_close(fmt.spmm(B, backend="triton"), A @ B, rtol=1e-4, atol=1e-4)
