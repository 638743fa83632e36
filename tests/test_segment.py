"""Segment reduction: a scatter through an index the caller declares sorted.

The generated kernel sums adjacent lanes of one output row with a segmented scan and writes
once per segment and tile. Checked against the torch lowering on rows of every kind: empty
rows, rows of one group, one row spanning several tiles, the last row ending a tile; with
int32 and int64 indices, `+=` and `=`, and scattered variables on either tile axis.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from kernel_env import (  # before insum: the interpreter on CPU-only machines
    DEVICE,
    KERNEL_MARK,
)

import insum
from insum.bind import bind
from insum.errors import InsumError
from insum.parser import parse
from insum.runtime import kernel_for

pytestmark = KERNEL_MARK
GOLDEN = Path(__file__).parent / "golden"
SPMM = "C[AM[p], n] += AV[p, q] * B[AK[p, q], n]"


def _groups(rows_per_group: list[int], *, k=11, width=3, n=5, m=None, seed=0, index_dtype=torch.int64):
    """GroupCOO-like tensors whose group rows are `rows_per_group` (in that order)."""
    g = torch.Generator().manual_seed(seed)
    G = len(rows_per_group)
    m = m if m is not None else max(rows_per_group, default=0) + 2  # the last rows stay empty
    return {
        "C": torch.randn(m, n, generator=g),
        "AM": torch.tensor(rows_per_group, dtype=index_dtype),
        "AK": torch.randint(0, k, (G, width), generator=g).to(index_dtype),
        "AV": torch.randn(G, width, generator=g),
        "B": torch.randn(k, n, generator=g),
    }


def _check(stmt: str, tensors: dict, sorted_indices=frozenset({"AM"}), poison: bool = False):
    tensors = {k: v.to(DEVICE) for k, v in tensors.items()}
    expected = insum.insum(stmt, backend="torch", **{k: v.clone() for k, v in tensors.items()})
    given = {k: v.clone() for k, v in tensors.items()}
    if poison:
        given["C"].fill_(float("nan"))
    actual = insum.insum(stmt, backend="triton", precision="ieee", sorted_indices=sorted_indices, **given)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    return kernel_for(bind(parse(stmt), given), "ieee", frozenset(sorted_indices))


def _skewed_rows(seed: int) -> list[int]:
    """Sorted group rows: empty rows, single groups, and row 3 taking 300 of ~600 groups
    (more than the largest tile, 256 groups), so that it spans several programs."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (90,), generator=g)
    counts[3] = 300
    counts[10:14] = 0
    return torch.repeat_interleave(torch.arange(90), counts).tolist()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("op", ["+=", "="])
def test_sorted_scatter_matches_reference(index_dtype, op):
    stmt = SPMM.replace("+=", op)
    kernel = _check(stmt, _groups(_skewed_rows(1), index_dtype=index_dtype), poison=op == "=")
    assert kernel.plan.output == "segment"
    assert "tl.associative_scan" in kernel.source
    # `=`: segments inside a tile are stored, the others added atomically.
    assert ("tl.store(out_ptrs" in kernel.source) == (op == "=")


@pytest.mark.parametrize(
    "rows",
    [[0], [4, 4, 4, 4, 4], [0, 1, 2, 3, 4, 5, 6], [2, 2, 5], list(range(40)) + [40] * 9],
    ids=["one_group", "one_row", "all_distinct", "gap", "tail_row"],
)
def test_sorted_scatter_small_shapes(rows):
    _check(SPMM, _groups(rows, seed=len(rows)))


def test_unsorted_index_without_the_claim_uses_atomics():
    rows = _skewed_rows(2)
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    kernel = _check(SPMM, _groups([rows[i] for i in perm]), sorted_indices=frozenset())
    assert kernel.plan.output == "atomic"


def test_scattered_variable_on_the_n_axis():
    # A sparse matrix-vector product: p is the only output-side variable, so it is tiled on N.
    t = _groups(_skewed_rows(3))
    t["C"], t["B"] = t["C"][:, 0].contiguous(), t["B"][:, 0].contiguous()
    kernel = _check("C[AM[p]] += AV[p, q] * B[AK[p, q]]", t)
    assert kernel.plan.output == "segment" and kernel.plan.var_axis("p") == "N"


def test_segment_with_a_grid_variable():
    # A batch of SpMMs sharing the matrix: b is a grid variable, p stays tiled.
    t = _groups([0, 0, 2, 3, 3, 3] + [5] * 40 + list(range(6, 30)), n=3)
    t["B"] = torch.randn(2, t["B"].shape[0], 3)
    t["C"] = torch.randn(2, t["C"].shape[0], 3)
    _check("C[b, AM[p], n] += AV[p, q] * B[b, AK[p, q], n]", t)


def test_claim_on_an_affine_scatter_is_ignored():
    # Block rows AM[p]*2 + m are not one sorted index: the plan keeps atomics.
    g = torch.Generator().manual_seed(5)
    t = {
        "C": torch.randn(8, 3, generator=g),
        "AM": torch.tensor([0, 0, 1, 3]),
        "AV": torch.randn(4, 2, generator=g),
        "B": torch.randn(4, 3, generator=g),
        "AK": torch.tensor([0, 1, 1, 3]),
    }
    kernel = _check("C[AM[p]*2 + m, n] += AV[p, m] * B[AK[p], n]", t)
    assert kernel.plan.output == "atomic"


def test_claim_must_name_an_index_tensor():
    t = _groups([0, 1])
    with pytest.raises(InsumError, match="'AV'.*index tensors: AM, AK|'AV'.*index tensors: AK, AM"):
        insum.insum(SPMM, backend="triton", sorted_indices={"AV"}, **t)


def test_golden_source_segment():
    """INSUM_UPDATE_GOLDEN=1 rewrites it."""
    t = {k: v.to(DEVICE) for k, v in _groups([0, 0, 1]).items()}
    text = kernel_for(bind(parse(SPMM), t), "tf32", frozenset({"AM"})).source
    path = GOLDEN / "group_coo_spmm_sorted.py"
    if os.environ.get("INSUM_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_segment_tiles_stay_tall():
    # One long row splits into many groups: narrow tiles would multiply its atomics.
    from insum.codegen import configs_for, prune_configs
    from insum.codegen.tune import SEGMENT_TILE

    kernel = _check(SPMM, _groups(_skewed_rows(5)))
    extents = {"p": 5000, "q": 4, "n": 128}
    pruned = prune_configs(kernel.plan, configs_for(kernel.plan), extents)
    assert pruned and all(c["BLOCK_M"] >= SEGMENT_TILE for c in pruned)
    few = prune_configs(kernel.plan, configs_for(kernel.plan), {"p": 3, "q": 4, "n": 128})
    assert {c["BLOCK_M"] for c in few} == {4}


def test_repeated_launches_stay_correct():
    # One prepared launch serves fresh tensors of the same signature.
    for seed in range(3):
        _check(SPMM.replace("+=", "="), _groups(_skewed_rows(6), seed=seed), poison=True)


def test_explain_shows_the_segment_plan():
    t = {k: v.to(DEVICE) for k, v in _groups([0, 0, 1]).items()}
    text = insum.explain(SPMM, sorted_indices={"AM"}, **t)
    assert "output: segment" in text and "tl.associative_scan" in text
    assert "output: atomic" in insum.explain(SPMM, **t)
