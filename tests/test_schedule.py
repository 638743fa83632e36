"""Schedule choices: single ownership of scattered outputs (`unique_indices`, affine
indices) and the ranking of candidate plans by the cost model.

Ownership: a scatter whose output coordinates determine every output-side variable stores
without atomics; the kernel's results equal the torch lowering on poisoned outputs, for
`+=` and `=`, int32 and int64 indices; a statement without the proof keeps its atomics.
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import (  # before insum: the interpreter on CPU-only machines
    CUDA,
    DEVICE,
    KERNEL_MARK,
)

import insum
from insum.bind import bind
from insum.errors import InsumError
from insum.formats import CELL
from insum.parser import parse
from insum.runtime import kernel_for

pytestmark = KERNEL_MARK


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


@pytest.mark.parametrize("extra_rows", [0, 3])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_permuting_unique_index_skips_the_zero_fill(extra_rows, index_dtype):
    """`O[R[t, m], c] = ...` with R declared unique: as many values as O's rows are a
    permutation (every row written once, no zero fill); fewer leave rows to zero."""
    stmt = "O[R[t, m], c] = X[t, m, j] * W[j, c]"
    g = torch.Generator().manual_seed(11)
    T, M, J, C = 3, 5, 4, 6
    tensors = {
        "O": torch.full((T * M + extra_rows, C), float("nan")),
        "R": torch.randperm(T * M + extra_rows, generator=g)[: T * M].view(T, M).to(index_dtype),
        "X": torch.randn(T, M, J, generator=g), "W": torch.randn(J, C, generator=g),
    }
    tensors = {k: v.to(DEVICE) for k, v in tensors.items()}
    expected = insum.insum(stmt, backend="torch", **{k: v.clone() for k, v in tensors.items()} | {"O": torch.zeros_like(tensors["O"])})
    actual = insum.insum(stmt, backend="triton", precision="ieee", unique_indices={"R"}, **tensors)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    bound = bind(parse(stmt), tensors)
    launcher = kernel_for(bound, "ieee", unique_indices=frozenset({"R"})).prepared(bound)
    assert launcher.kernel.plan.output == "store" and launcher.zero_fill == (extra_rows > 0)


def test_unique_indices_names_an_index_tensor():
    tensors, _ = _tensors(OWNED[0], torch.Generator().manual_seed(5), torch.int64)
    with pytest.raises(InsumError, match="unique_indices names 'AV'"):
        insum.insum(OWNED[0], backend="triton", unique_indices={"AV"}, **tensors)


def test_explain_says_owned():
    tensors, unique = _tensors(OWNED[3], torch.Generator().manual_seed(6), torch.int64)
    text = insum.explain(OWNED[3], unique_indices=unique, **{k: v.to(DEVICE) for k, v in tensors.items()})
    assert "one writer per element: plain stores" in text


@pytest.mark.parametrize("params", [{}, {"max_width": 2}, {"max_width": 4}, {"partitions": 2}], ids=str)
def test_cell_declares_unique_rows_only_where_true(params):
    """CELL's RI holds each row once below the widest bucket (one partition): checked on
    the packed data, and the SpMM still equals the dense product."""
    g = torch.Generator().manual_seed(7)
    A = torch.randn(40, 30, generator=g) * (torch.rand(40, 30, generator=g) < 0.15)
    A[3, :20] = 1.0  # one long row: folded at small caps
    fmt = CELL.from_dense(A.to(DEVICE), **params)
    declared = 0
    for _, tensors in fmt.statements():
        if "RI" in fmt.unique_in(tensors):
            declared += 1
            assert tensors["RI"].unique().numel() == tensors["RI"].numel()
    assert declared >= (1 if params.get("partitions", 1) == 1 else 0)
    if params.get("partitions", 1) > 1:
        assert declared == 0
    B = torch.randn(30, 6, generator=g)
    out = fmt.spmm(B.to(DEVICE), backend="triton", precision="ieee")
    torch.testing.assert_close(out.cpu(), A @ B, rtol=1e-4, atol=1e-4)


# -- ranking candidate plans ----------------------------------------------------------------


def _meta(dtype=torch.float32, **shapes) -> dict:
    """Meta tensors (shapes only): index tensors are the names in INDEX."""
    return {n: torch.empty(s, dtype=torch.int32 if n in INDEX else dtype, device="meta") for n, s in shapes.items()}


INDEX = {"AM", "AK", "CGI", "CGJ", "ZI", "XI", "CI", "I"}
CG_ORDERS = {  # the same product, output indices in two orders
    "bur": ("T[b, u, r] = CGV[r, q] * X[b, u, CGI[r, q]] * Y[b, CGJ[r, q]]", lambda b, u, r: (b, u, r)),
    "rbu": ("T[r, b, u] = CGV[r, q] * X[b, u, CGI[r, q]] * Y[b, CGJ[r, q]]", lambda b, u, r: (r, b, u)),
}


def _cg_tensors(order: str, b: int, u: int, r: int, q: int, dtype=torch.float32, meta=True, seed=0) -> dict:
    shape = CG_ORDERS[order][1](b, u, r)
    if meta:
        return _meta(dtype, T=shape, CGV=(r, q), CGI=(r, q), CGJ=(r, q), X=(b, u, 5), Y=(b, 3))
    g = torch.Generator().manual_seed(seed)
    return {
        "T": torch.full(shape, float("nan")),
        "CGV": torch.randn(r, q, generator=g), "CGI": torch.randint(0, 5, (r, q), generator=g).int(),
        "CGJ": torch.randint(0, 3, (r, q), generator=g).int(),
        "X": torch.randn(b, u, 5, generator=g), "Y": torch.randn(b, 3, generator=g),
    }


def _plan_for(stmt: str, tensors: dict, **facts):
    from insum.codegen import schedule
    from insum.runtime import spec_for

    return schedule(spec_for(bind(parse(stmt), tensors), **facts))


@pytest.mark.parametrize("order", CG_ORDERS)
def test_batch_goes_on_a_tile_in_both_index_orders(order):
    """`T[b, u, r]` used to tile (u, r) with one program per batch element; written
    `T[r, b, u]` it tiled (b, u). Ranked, both put the batch on the tall M tile (in
    `T[b, u, r]` stacked with r, the output's fastest dimension: M = (b, r))."""
    plan = _plan_for(CG_ORDERS[order][0], _cg_tensors(order, b=4096, u=32, r=9, q=4))
    assert plan.kind == "reduce"
    assert "b" in plan.axis_vars("M") and plan.axis_var("K") == "q" and plan.axis_var("N") == "u"
    assert plan.axis_vars("M") == (("b", "r") if order == "bur" else ("b",))


@pytest.mark.parametrize("order", CG_ORDERS)
def test_ranked_plan_runs_correctly_at_small_sizes(order):
    """The plan chosen at batch 4096, run in the interpreter on a batch of 10 (small
    problems keep the conventional plan: launch-bound, see LAUNCH_COST)."""
    import dataclasses

    from insum.runtime import Kernel, spec_for

    stmt = CG_ORDERS[order][0]
    big = _plan_for(stmt, _cg_tensors(order, b=4096, u=32, r=9, q=4))
    tensors = {k: v.to(DEVICE) for k, v in _cg_tensors(order, b=10, u=6, r=5, q=3, meta=False).items()}
    expected = insum.insum(stmt, backend="torch", **{k: v.clone() for k, v in tensors.items()})
    bound = bind(parse(stmt), tensors)
    spec = spec_for(bound, "ieee")
    actual = Kernel(spec, dataclasses.replace(big, spec=spec)).launch(bound, bound.output())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


NESTED = "Z[b, ZI[w, k]] = CV[k, q] * X[b, XI[u, CI[k, q]]] * W[u, w]"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_nested_index_tensors_reduce_over_channels(dtype):
    """e3nn's layout through nested index tensors: K carries the channels u (32), not the
    4 padded CG entries q, which become the scalar loop; with 16-bit dots the batch, not
    the 32 output channels, fills the 64-row M tile."""
    tensors = _meta(dtype, Z=(4096, 32 * 9), ZI=(32, 9), CV=(9, 4), CI=(9, 4), XI=(32, 5), X=(4096, 160), W=(32, 32))
    plan = _plan_for(NESTED, tensors, unique_indices=frozenset({"ZI"}))
    assert plan.kind == "dot" and plan.axis_var("K") == "u" and plan.loops == ("q",)
    assert {plan.axis_var("M"), plan.axis_var("N")} == {"b", "w"}
    if dtype == torch.float16:
        assert plan.axis_var("M") == "b"
    assert plan.output == "store"


# The GPU-tuned defaults: (statement, shapes, dtype, (M, K, N), grid, loops). Changing one
# needs a measured reason (benchmarks/explore/tensorcore.py); these pin them.
PINNED = [
    ("C[m, n] = A[m, k] * B[k, n]", {"A": (4096, 4096), "B": (4096, 4096)}, torch.float16,
     ("m", "k", "n"), (), ()),
    ("C[m, n] = A[m, k] * B[I[k], n]", {"A": (4096, 4096), "B": (4096, 4096), "I": (4096,)}, torch.float16,
     ("m", "k", "n"), (), ()),
    ("C[AM[p], n] += AV[p, q] * B[AK[p, q], n]",
     {"C": (65536, 128), "AM": (200000,), "AV": (200000, 8), "AK": (200000, 8), "B": (65536, 128)}, torch.float32,
     ("p", "q", "n"), (), ()),
    ("C[AM[p], n] += AV[p, q] * B[AK[p, q], n]",
     {"C": (4000, 32), "AM": (9000,), "AV": (9000, 32), "AK": (9000, 32), "B": (4000, 32)}, torch.float16,
     ("p", "q", "n"), (), ()),
    ("C[p, m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]",  # BlockGroupCOO, one group per row, 32 x 32
     {"C": (128, 32, 4096), "AV": (128, 13, 32, 32), "AK": (128, 13), "B": (128, 32, 4096)}, torch.float16,
     ("n", "k", "m"), ("p",), ("q",)),
    ("C[p, m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]",  # 64 x 64
     {"C": (64, 64, 4096), "AV": (64, 7, 64, 64), "AK": (64, 7), "B": (64, 64, 4096)}, torch.float16,
     ("m", "k", "n"), ("p",), ("q",)),
    ("C[p, m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]",  # fp32: no narrow rule
     {"C": (128, 32, 4096), "AV": (128, 13, 32, 32), "AK": (128, 13), "B": (128, 32, 4096)}, torch.float32,
     ("m", "k", "n"), ("p",), ("q",)),
    ("C[AM[p], m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]",
     {"C": (128, 32, 4096), "AM": (300,), "AV": (300, 4, 32, 32), "AK": (300, 4), "B": (128, 32, 4096)},
     torch.float16, ("n", "k", "m"), ("p",), ("q",)),
    ("C[rb, l, n] += AV[rb, l, u] * B[AK[rb, u], n]",  # N:M 2:4, 32-row vectors
     {"C": (256, 32, 8192), "AV": (256, 32, 4096), "AK": (256, 4096), "B": (8192, 8192)}, torch.float16,
     ("n", "u", "l"), ("rb",), ()),
    ("C[rb, l, n] += AV[rb, l, u] * B[AK[rb, u], n]",  # 1:8, 64-row vectors
     {"C": (128, 64, 8192), "AV": (128, 64, 1024), "AK": (128, 1024), "B": (8192, 8192)}, torch.float16,
     ("l", "u", "n"), ("rb",), ()),
]


PINNED_IDS = ["gemm", "gathered_gemm", "groupcoo", "groupcoo_fp16", "blockrow32", "blockrow64", "blockrow32_fp32",
              "blockgroupcoo", "nm_2of4", "nm_1of8"]


@pytest.mark.parametrize("stmt, shapes, dtype, axes, grid, loops", PINNED, ids=PINNED_IDS)
def test_tuned_families_keep_their_plan(stmt, shapes, dtype, axes, grid, loops):
    plan = _plan_for(stmt, _meta(dtype, **shapes))
    assert (plan.axis_var("M"), plan.axis_var("K"), plan.axis_var("N")) == axes
    assert (plan.grid, plan.loops) == (grid, loops)


def test_explain_prints_ranked_candidates():
    tensors = _cg_tensors("bur", b=10, u=6, r=5, q=3, meta=False)
    text = insum.explain(CG_ORDERS["bur"][0], **{k: v.to(DEVICE) for k, v in tensors.items()})
    head = text.split("candidates (cost model")[1].split("plan:")[0]
    rows = [line for line in head.splitlines()[1:] if line.strip()]
    plain = [r for r in rows if "M=(" not in r]
    assert len(plain) == 6 and sum("(conventional)" in r for r in rows) == 1  # 3 x 2 tilings of (b, u, r)
    assert any("M=(" in r for r in rows)  # and stacked variants of the short M axes
    costs = [float(r.split("cost ")[1].split()[0]) for r in rows]
    assert costs == sorted(costs)


# -- declared lengths: padded entries skipped ---------------------------------------------------

LENGTH_CASES = {
    # ELL: q on K, the row m tiled: each row's lanes past its length are masked
    "ell": ("C[m, n] += AV[m, q] * B[AK[m, q], n]", "q[m]"),
    # BlockGroupCOO, one group per block row: p on the grid, q the scalar loop
    "block_row": ("C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]", "q[p]"),
    # a batched GEMM whose reduction length differs per batch: K = q bounded per program
    "batched": ("O[p, m, n] = X[p, m, q] * Y[p, q, n]", "q[p]"),
}


def _padded(case: str, g: torch.Generator, index_dtype: torch.dtype, fill: float) -> tuple[dict, torch.Tensor]:
    """Inputs whose entries past each row's length hold `fill` (0: the formats' padding),
    and the lengths (an empty row, a full row, a length above the extent: clamped)."""
    if case == "ell":
        M, Q, K, N = 13, 6, 9, 5
        lengths = torch.randint(0, Q + 1, (M,), generator=g)
        lengths[0], lengths[1] = 0, Q
        t = {"C": torch.randn(M, N, generator=g), "AV": torch.randn(M, Q, generator=g),
             "AK": torch.randint(0, K, (M, Q), generator=g), "B": torch.randn(K, N, generator=g)}
        pad = torch.arange(Q)[None, :] >= lengths[:, None]
        t["AV"][pad], t["AK"][pad] = fill, 0
        lengths[1] = Q + 3  # a full row declared longer than the extent
    elif case == "block_row":
        P, Q, bm, KB, N = 4, 5, 8, 6, 7
        lengths = torch.tensor([0, 5, 2, 3])
        t = {"AV": torch.randn(P, Q, bm, bm, generator=g), "AK": torch.randint(0, KB, (P, Q), generator=g),
             "B": torch.randn(KB, bm, N, generator=g)}
        pad = torch.arange(Q)[None, :] >= lengths[:, None]
        t["AV"][pad], t["AK"][pad] = fill, 0
    else:
        P, M, Q, N = 3, 5, 11, 6
        lengths = torch.tensor([11, 0, 4])
        t = {"X": torch.randn(P, M, Q, generator=g), "Y": torch.randn(P, Q, N, generator=g)}
        t["X"][2, :, 4:] = fill
        t["X"][1] = fill
    t = {k: v.to(index_dtype) if k == "AK" else v for k, v in t.items()}
    return t, lengths.to(index_dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("case", LENGTH_CASES)
def test_declared_lengths_skip_padded_entries(case, index_dtype):
    """Padding filled with NaN: only a kernel that skips it matches the lowering of the
    zero-padded inputs."""
    if CUDA and case == "batched":
        pytest.skip("a K tile loaded through a tensor descriptor is read whole: NaN padding shows")
    stmt, key = LENGTH_CASES[case]
    zero, lengths = _padded(case, torch.Generator().manual_seed(8), index_dtype, 0.0)
    poisoned, _ = _padded(case, torch.Generator().manual_seed(8), index_dtype, float("nan"))
    expected = insum.insum(stmt, backend="torch", **{k: v.to(DEVICE) for k, v in zero.items()})
    actual = insum.insum(stmt, backend="triton", precision="ieee", lengths={key: lengths.to(DEVICE)},
                         **{k: v.to(DEVICE) for k, v in poisoned.items()})
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    # Without the declaration the kernel reads the padding.
    unskipped = insum.insum(stmt, backend="triton", precision="ieee", **{k: v.to(DEVICE) for k, v in poisoned.items()})
    assert unskipped.isnan().any()


def test_lengths_appear_in_the_plan_and_source():
    stmt, key = LENGTH_CASES["block_row"]
    t, lengths = _padded("block_row", torch.Generator().manual_seed(9), torch.int32, 0.0)
    source = insum.explain(stmt, precision="ieee", lengths={key: lengths.to(DEVICE)},
                           **{k: v.to(DEVICE) for k, v in t.items()})
    assert "length: q < LEN_q[p]" in source
    assert "for step in range(0, len_q * steps_k):" in source
    assert "program order: p longest first" in source
    assert "i_p = tl.load(ORDER_LEN_q_ptr + i_p * stride_ORDER_LEN_q_0)" in source


def test_longest_first_order_is_kept_per_tensor_version():
    """The programs' order (`execute.longest_first`): positions by decreasing length, stable;
    sorted once per tensor, again after an in-place change."""
    from insum.execute import longest_first

    lengths = torch.tensor([1, 5, 3, 5], dtype=torch.int32)
    first = longest_first(lengths)
    assert first.tolist() == [1, 3, 2, 0] and first.dtype == torch.int32
    assert longest_first(lengths) is first
    lengths[0] = 9
    assert longest_first(lengths).tolist() == [0, 1, 3, 2]


@pytest.mark.parametrize(
    "key, tensor, error",
    [
        ("q", torch.zeros(13, dtype=torch.int64), "not of the form"),
        ("m[q]", torch.zeros(6, dtype=torch.int64), "not a reduced variable"),
        ("q[q]", torch.zeros(6, dtype=torch.int64), "output-side variables"),
        ("q[m]", torch.zeros(12, dtype=torch.int64), "shape"),
        ("q[m]", torch.zeros(13), "int32 or int64"),
    ],
)
def test_lengths_are_checked(key, tensor, error):
    stmt = LENGTH_CASES["ell"][0]
    t, _ = _padded("ell", torch.Generator().manual_seed(10), torch.int64, 0.0)
    with pytest.raises(InsumError, match=error):
        insum.insum(stmt, backend="triton", lengths={key: tensor}, **t)


# -- several variables on one tile axis (M stacked) ---------------------------------------------

STACK = "O[b, q, n] {op} X[b, q, k] * W[k, n]"


def test_short_rows_stack_onto_one_tall_tile():
    """48 batches of 16 rows each: every M variable alone is short for a 64-row fp16 MMA
    tile; M = (b, q) fills 128-row tiles with a quarter of the programs."""
    plan = _plan_for(STACK.format(op="="), _meta(torch.float16, X=(48, 16, 512), W=(512, 4096), O=(48, 16, 4096)))
    assert plan.axis_vars("M") == ("b", "q") and plan.axis_var("N") == "n" and plan.grid == ()
    assert plan.boxes == () and not plan.persistent  # a stacked axis is no descriptor box
    assert "M=(b, q)" in str(plan)


@pytest.mark.parametrize("op", ["=", "+="])
def test_stacked_plan_runs_correctly_at_small_sizes(op):
    """The stacked plan, run on extents whose product is no multiple of the tile."""
    import dataclasses

    from insum.codegen import configs_for, prune_configs
    from insum.runtime import Kernel, spec_for

    stmt = STACK.format(op=op)
    big = _plan_for(stmt, _meta(torch.float16, X=(48, 16, 512), W=(512, 4096), O=(48, 16, 4096)))
    g = torch.Generator().manual_seed(11)
    tensors = {"X": torch.randn(5, 6, 7, generator=g), "W": torch.randn(7, 9, generator=g),
               "O": torch.randn(5, 6, 9, generator=g) if op == "+=" else torch.full((5, 6, 9), float("nan"))}
    tensors = {k: v.to(DEVICE) for k, v in tensors.items()}
    expected = insum.insum(stmt, backend="torch", **{k: v.clone() for k, v in tensors.items()})
    bound = bind(parse(stmt), tensors)
    spec = spec_for(bound, "ieee")
    plan = dataclasses.replace(big, spec=spec, dot_dtype="fp32")  # float32 inputs: ieee dot
    actual = Kernel(spec, plan).launch(bound, bound.output())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    # Tiles are clamped to the stacked extent (5 x 6 = 30 rows: 32), not to q's 6.
    pruned = prune_configs(plan, configs_for(plan), bound.extents)
    assert max(c["BLOCK_M"] for c in pruned) == 32


# -- program order: small grid variables before a large tile ------------------------------------

UVU = "Z[b, p, u] = CGV[p, q] * Y[b, CGJ[p, q]] * X[b, CGI[p, q], u] * W[b, PR[p], u]"


def _uvu_meta(b: int) -> dict:
    tensors = _meta(Z=(b, 71, 128), CGV=(71, 8), Y=(b, 16), X=(b, 9, 128), W=(b, 17, 128), CGJ=(71, 8), CGI=(71, 8))
    return tensors | {"PR": torch.empty(71, dtype=torch.int32, device="meta")}


def test_small_grid_variable_walks_before_a_large_tile():
    """With the edges b on M and the 71 output components p on the grid, the programs of one
    edge tile (which read the same rows of X, Y and W) come one after another: p is split
    off the program id first. A large grid variable (b, in the chosen plan) stays last."""
    from insum.codegen import emit
    from insum.codegen.schedule import plan_of, rank
    from insum.runtime import spec_for

    spec = spec_for(bind(parse(UVU), _uvu_meta(16384)))
    chosen = _plan_for(UVU, _uvu_meta(16384))
    assert chosen.grid == ("b",) and not chosen.grid_first
    by_b = plan_of(spec, next(c for c in rank(spec) if dict(c.tiles) == {"M": "b", "K": "q", "N": "u"} and not c.stacked))
    assert by_b.grid == ("p",) and by_b.grid_first and "program order: p fastest" in str(by_b)
    lines = emit(by_b).text.splitlines()
    first = next(i for i, line in enumerate(lines) if "i_p = pid % size_p" in line)
    assert first < next(i for i, line in enumerate(lines) if "pid_u = pid" in line)


def _uvu_spec(b: int, lengths: bool):
    """The channel-wise product's spec at b edges, its rows' entry counts declared or not."""
    from insum.execute import length_facts
    from insum.runtime import spec_for

    bound = bind(parse(UVU), _uvu_meta(b))
    declared = ()
    if lengths:
        bound, declared = length_facts(bound, {"q[p]": torch.empty(71, dtype=torch.int32, device="meta")})
    return spec_for(bound, lengths=declared)


def test_declared_lengths_put_the_rows_on_the_grid():
    """With each component's entry count declared (MACE: 215 real entries in 71 x 8 slots),
    a program that holds one component p stops at its own count, while a tile of p rows
    runs to its longest row: the edges go on M and p on the grid (walked first). Without the
    declaration the two plans cost the same and the conventional one (M = p) stays."""
    from insum.codegen import schedule

    plan = schedule(_uvu_spec(16384, lengths=True))
    assert plan.tiles == (("M", "b"), ("K", "q"), ("N", "u")) and plan.grid == ("p",) and plan.grid_first
    assert plan.lengths == (("q", "LEN_q", ("p",), "ORDER_LEN_q"),)
    assert plan.ordered == (("p", "ORDER_LEN_q"),)  # the components with the most entries first
    assert schedule(_uvu_spec(16384, lengths=False)).grid == ("b",)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_rows_on_the_grid_plan_skips_padding_at_small_sizes(index_dtype):
    """The plan chosen for 16384 edges with declared lengths, run on 11 edges (no multiple
    of a tile) into a poisoned output, the padded entries NaN (an empty row, a full row):
    only a kernel that stops at each row's length matches the lowering of zero padding."""
    import dataclasses

    from insum.codegen import schedule
    from insum.execute import length_facts
    from insum.runtime import Kernel, spec_for

    big = schedule(_uvu_spec(16384, lengths=True))
    g = torch.Generator().manual_seed(13)
    b, p, q, u = 11, 5, 4, 6
    counts = torch.tensor([0, 4, 1, 3, 2])
    pad = torch.arange(q)[None, :] >= counts[:, None]
    tensors = {
        "Z": torch.full((b, p, u), float("nan")), "CGV": torch.randn(p, q, generator=g).masked_fill(pad, 0.0),
        "Y": torch.randn(b, 4, generator=g), "X": torch.randn(b, 3, u, generator=g), "W": torch.randn(b, 2, u, generator=g),
        "CGJ": torch.randint(0, 4, (p, q), generator=g).to(index_dtype),
        "CGI": torch.randint(0, 3, (p, q), generator=g).to(index_dtype), "PR": torch.randint(0, 2, (p,), generator=g).to(index_dtype),
    }
    tensors = {k: v.to(DEVICE) for k, v in tensors.items()}
    expected = insum.insum(UVU, backend="torch", **{k: v.clone() for k, v in tensors.items()})
    tensors["CGV"] = tensors["CGV"].masked_fill(pad.to(DEVICE), float("nan"))
    bound, declared = length_facts(bind(parse(UVU), tensors), {"q[p]": counts.to(index_dtype).to(DEVICE)})
    spec = spec_for(bound, "ieee", lengths=declared)
    actual = Kernel(spec, dataclasses.replace(big, spec=spec)).launch(bound, bound.output())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_grid_first_plan_runs_correctly_at_small_sizes(index_dtype):
    """The grid-first plan chosen for 16384 edges, run on 11 edges (not a multiple of any
    tile) into a poisoned output, against the torch lowering."""
    import dataclasses

    from insum.codegen.schedule import plan_of, rank
    from insum.runtime import Kernel, spec_for

    big_spec = spec_for(bind(parse(UVU), _uvu_meta(16384)))
    big = plan_of(big_spec, next(c for c in rank(big_spec) if dict(c.tiles) == {"M": "b", "K": "q", "N": "u"} and not c.stacked))
    g = torch.Generator().manual_seed(12)
    b, p, q, u = 11, 5, 3, 6
    tensors = {
        "Z": torch.full((b, p, u), float("nan")), "CGV": torch.randn(p, q, generator=g), "Y": torch.randn(b, 4, generator=g),
        "X": torch.randn(b, 3, u, generator=g), "W": torch.randn(b, 2, u, generator=g),
        "CGJ": torch.randint(0, 4, (p, q), generator=g).to(index_dtype),
        "CGI": torch.randint(0, 3, (p, q), generator=g).to(index_dtype), "PR": torch.randint(0, 2, (p,), generator=g).to(index_dtype),
    }
    tensors = {k: v.to(DEVICE) for k, v in tensors.items()}
    expected = insum.insum(UVU, backend="torch", **{k: v.clone() for k, v in tensors.items()})
    bound = bind(parse(UVU), tensors)
    spec = spec_for(bound, "ieee")
    actual = Kernel(spec, dataclasses.replace(big, spec=spec)).launch(bound, bound.output())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
