"""Program order with the grid variables inside the grouped order (`Plan.grid_joins`).

A block product's block rows (the grid variable p) join the rows or the columns of the
grouped (M, N) tile order, so that programs of many block rows that read the same tiles of
B run side by side. Every order must still visit each (grid values, M tile, N tile) once:
the kernels below store every output element with `=` into a NaN-poisoned output, under
every join and group size (including groups that do not divide the row count), with one
and two grid variables, and are compared with the torch lowering.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_env import DEVICE, KERNEL_MARK  # before insum: the interpreter on CPU-only machines

import insum
import insum.runtime
from insum.bind import bind
from insum.codegen import tune
from insum.codegen.schedule import KernelSpec, _grid_joins
from insum.execute import length_facts
from insum.parser import parse
from insum.runtime import BareLaunch, Kernel, kernel_for

pytestmark = KERNEL_MARK

BLOCK_ROWS = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"
TWO_GRID = "C[b, p, m, n] = AV[b, p, q, m, k] * B[AK[p, q], k, n]"


def _tensors(stmt: str, g: torch.Generator, index_dtype=torch.int64) -> dict:
    """Block-row inputs: 5 block rows of 3 slots, 40 x 24 blocks, 7 block columns, N = 50
    (three M tiles and four N tiles of 16, none a power of two)."""
    P, Q, M, K, KB, N = 5, 3, 40, 24, 7, 50
    tensors = {
        "AK": torch.randint(0, KB, (P, Q), generator=g).to(index_dtype),
        "B": torch.randn(KB, K, N, generator=g),
    }
    if stmt == TWO_GRID:
        tensors["AV"] = torch.randn(2, P, Q, M, K, generator=g)
    else:
        tensors["AV"] = torch.randn(P, Q, M, K, generator=g)
    return {name: t.to(DEVICE) for name, t in tensors.items()}


def _run_in_order(stmt: str, tensors: dict, joins: str, group: int) -> torch.Tensor:
    """The statement's kernel under the given join and GROUP_M (16 x 16 x 16 tiles), into a
    NaN-poisoned output."""
    bound = bind(parse(stmt), tensors)
    base = kernel_for(bound, precision="ieee")
    assert base.plan.kind == "dot" and base.plan.grid_joins == "M"
    kernel = Kernel(base.spec, plan=dataclasses.replace(base.plan, grid_joins=joins))
    out = torch.full(bound.out_shape, float("nan"), device=DEVICE)
    prepared = kernel.prepared(bound)
    config = {"BLOCK_M": 16, "BLOCK_K": 16, "BLOCK_N": 16, "GROUP_M": group, "num_warps": 4, "num_stages": 2}
    BareLaunch(kernel.fn, prepared.grid_fn(config), config, tuple(prepared.args(bound.tensors, out, config)))()
    return out


@pytest.mark.parametrize(
    "stmt, joins, group",
    [(BLOCK_ROWS, j, g) for j, g in [("M", 1), ("M", 3), ("M", 64), ("N", 1), ("N", 2), ("N", 5), ("", 8)]]
    + [(TWO_GRID, "M", 3), (TWO_GRID, "N", 2)],
)
def test_every_order_writes_each_tile_once(stmt, joins, group):
    g = torch.Generator().manual_seed(3)
    tensors = _tensors(stmt, g)
    expected = insum.insum(stmt, **tensors, backend="torch")
    got = _run_in_order(stmt, tensors, joins, group)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_joined_order_is_in_the_plan_and_source():
    g = torch.Generator().manual_seed(0)
    kernel = kernel_for(bind(parse(BLOCK_ROWS), _tensors(BLOCK_ROWS, g)))
    assert kernel.plan.grid_joins == "M"
    assert "program order: groups of GROUP_M rows of (p, M tile), rows fastest" in kernel.source
    assert "rows = tiles_m * size_p" in kernel.source


@pytest.mark.parametrize(
    "stmt, tiles, grid, left, right, joins",
    [
        (BLOCK_ROWS, {"M": "m", "K": "k", "N": "n"}, ("p",), (0,), (1,), "M"),
        # The narrow-block orientation: M = the dense columns, B on the left.
        (BLOCK_ROWS, {"M": "n", "K": "k", "N": "m"}, ("p",), (1,), (0,), "N"),
        # A batch: each grid value has its own operands on both sides.
        ("C[b, m, n] = A[b, m, k] * B[b, k, n]", {"M": "m", "K": "k", "N": "n"}, ("b",), (0,), (1,), ""),
        # A shared right operand (a weight): the grid joins the rows.
        ("C[b, m, n] = A[b, m, k] * W[k, n]", {"M": "m", "K": "k", "N": "n"}, ("b",), (0,), (1,), "M"),
        # No N tile: nothing to group.
        ("C[p, m] = AV[p, q, m, k] * B[AK[p, q], k]", {"M": "m", "K": "k"}, ("p",), (0,), (1,), ""),
    ],
)
def test_grid_joins_where_one_side_is_shared(stmt, tiles, grid, left, right, joins):
    spec = KernelSpec(parse(stmt), (), ())
    assert _grid_joins(spec, tiles, grid, left, right) == joins


def test_group_rows_from_the_operands(monkeypatch):
    plan = dataclasses.make_dataclass("P", ["grid_joins", "grid"])("M", ("p",))
    plan.axis_vars = lambda axis: ("m",)
    config = {"BLOCK_M": 64, "GROUP_M": 8}
    extents = {"p": 100, "m": 128}  # 200 rows of (p, M tile)
    mb = 1 << 20
    # The right operand fits in L2: one row per group (p outside, in effect).
    assert tune.group_rows(plan, config, extents, 400 * mb, 40 * mb) == 1
    # Larger: as many rows as keep their share of the left operand (2 MB a row) in 24 MB.
    assert tune.group_rows(plan, config, extents, 400 * mb, 400 * mb) == 8
    assert tune.group_rows(plan, config, extents, 4 * mb, 400 * mb) == 256  # every row (200, rounded up)
    assert tune.group_rows(plan, config, extents, 100_000 * mb, 400 * mb) == 1
    # A device's own L2 (half of it given): a larger L2 holds more rows, and more of B.
    assert tune.group_rows(plan, config, extents, 400 * mb, 400 * mb, 48 * mb) == 16
    assert tune.group_rows(plan, config, extents, 400 * mb, 80 * mb, 48 * mb) == 1
    plan.grid_joins = "N"
    assert tune.group_rows(plan, config, extents, 400 * mb, 400 * mb) == 1
    plan.grid_joins = ""
    assert tune.group_rows(plan, config, extents, 400 * mb, 400 * mb) == 8


def test_the_launch_sizes_its_group_from_its_operands(monkeypatch):
    """The launcher's configuration carries the group `group_rows` gives for its own tensors
    (not the tuned bucket's), and the product stays right."""
    monkeypatch.setattr(tune, "L2_SHARE", 50_000)  # small tensors behave as large ones
    monkeypatch.setattr(insum.runtime, "_l2_share", lambda device: None)  # (a GPU's own L2 otherwise)
    g = torch.Generator().manual_seed(1)
    tensors = _tensors(BLOCK_ROWS, g, torch.int32)
    tensors["B"] = torch.randn(40, 24, 50, generator=g).to(DEVICE)  # 192 kB: more than twice the share
    tensors["AK"] = torch.randint(0, 40, (5, 3), generator=g).to(DEVICE, torch.int32)
    bound = bind(parse(BLOCK_ROWS), tensors)
    kernel = kernel_for(bound, precision="ieee")
    out = torch.full(bound.out_shape, float("nan"), device=DEVICE)
    kernel.launch(bound, out)
    config = kernel.prepared(bound).config
    left, right = (t.numel() * t.element_size() for t in (tensors["AV"], tensors["B"]))
    assert config["GROUP_M"] == tune.group_rows(kernel.plan, config, dict(bound.extents), left, right) > 1
    torch.testing.assert_close(out, insum.insum(BLOCK_ROWS, **tensors, backend="torch"), rtol=1e-3, atol=1e-3)


def test_padded_values_under_a_declared_length_count_as_half_read():
    """A factor padded along a declared length (AV's slots past a block row's own count are
    never read) counts LENGTH_FILL of its bytes in the group's sizing; B, reached through
    the index, and a statement without the declaration count whole."""
    g = torch.Generator().manual_seed(2)
    tensors = _tensors(BLOCK_ROWS, g, torch.int32)
    nbytes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    lengths = torch.tensor([3, 0, 2, 1, 3], dtype=torch.int32, device=DEVICE)
    for declared, fill in (({}, 1.0), ({"q[p]": lengths}, tune.LENGTH_FILL)):
        bound, facts = length_facts(bind(parse(BLOCK_ROWS), tensors), declared)
        kernel = kernel_for(bound, precision="ieee", lengths=facts)
        assert len(kernel.plan.lengths) == len(declared)
        assert tune.operand_bytes(kernel.plan, nbytes) == (int(nbytes["AV"] * fill), nbytes["B"])
        assert kernel.prepared(bound).operand_bytes == (int(nbytes["AV"] * fill), nbytes["B"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["rows", "columns"])
def test_block_ell_product_with_its_block_rows_in_the_order(monkeypatch, dtype):
    """Block-ELL's product with its block rows in the grouped order, longest first (declared
    lengths): the float64 product, with empty and full block rows. fp32: in the rows, in
    groups of several block rows (L2_SHARE made small so that they form); fp16 takes the
    narrow orientation (M = the dense columns, the block rows in the columns, one M tile a
    group)."""
    from insum.formats import BlockGroupCOO

    monkeypatch.setattr(tune, "L2_SHARE", 16_000)
    monkeypatch.setattr(insum.runtime, "_l2_share", lambda device: None)  # (a GPU's own L2 otherwise)
    groups = []
    monkeypatch.setattr(insum.runtime, "group_rows", lambda *args: groups.append(tune.group_rows(*args)) or groups[-1])
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(7, 5, generator=g) < 0.5
    keep[1], keep[4] = False, True
    W = torch.randn(7 * 16, 5 * 16, generator=g) * keep.repeat_interleave(16, 0).repeat_interleave(16, 1)
    fmt = BlockGroupCOO.from_dense(W.to(DEVICE, dtype), block=(16, 16), group_size="row")
    B = torch.randn(5 * 16, 200, generator=g).to(DEVICE, dtype)  # 64 kB in fp32: more than twice the share
    got = fmt.spmm(B, backend="triton", precision="ieee")
    expected = W.double() @ B.cpu().double()
    tolerance = {"rtol": 2e-2, "atol": 5e-2} if dtype == torch.float16 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(got.cpu().double(), expected, **tolerance)
    assert groups and (max(groups) > 1 if dtype == torch.float32 else set(groups) == {1})
