"""The torch reference lowering against independent oracles.

Two oracles, neither of which shares code with `insum.reference`:
  * `dense_loop`: a plain Python loop over every assignment of the index variables, in
    float64 numpy; it reads the statement's IR but nothing else of insum;
  * per-format numpy formulas (densify the sparse operand with `np.add.at`, then `@`).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from statements import CASES, build, case, clone, strided, tolerance

from insum import InsumError, insum, parse
from insum.dtypes import compute_dtype
from insum.ir import Access, Literal, Var

ALL_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
IDS = [c.id for c in CASES]


def numpy_of(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """float64 / int64 numpy copies (low-precision values are converted exactly)."""
    return {
        name: t.detach().cpu().to(torch.float64 if t.is_floating_point() else torch.int64).numpy().copy()
        for name, t in tensors.items()
    }


def dense_loop(text: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Evaluate a statement by brute force: one Python iteration per variable assignment."""
    stmt = parse(text)
    arrays = numpy_of(tensors)
    extents: dict[str, int] = {}

    def learn(access: Access):
        if access.name not in arrays:
            return
        for dim, index in enumerate(access.indices):
            if index.variable is not None:
                extents.setdefault(index.variable, arrays[access.name].shape[dim])
            for inner in index.indirect_accesses():
                learn(inner)

    for access in (stmt.output, *stmt.accesses()):
        learn(access)

    def position(access: Access, env: dict[str, int]) -> tuple[int, ...]:
        out = []
        for index in access.indices:
            value = index.const
            for term in index.terms:
                atom = env[term.atom.name] if isinstance(term.atom, Var) else arrays[term.atom.name][position(term.atom, env)]
                value += term.coef * int(atom)
            out.append(value)
        return tuple(out)

    name = stmt.output.name
    if name in arrays:
        out = arrays[name]
    else:
        out = np.zeros([extents[i.variable] for i in stmt.output.indices])
    if not stmt.accumulate:
        out[...] = 0.0
    variables = stmt.variables()
    for values in itertools.product(*(range(extents[v]) for v in variables)):
        env = dict(zip(variables, values))
        product = 1.0
        for factor in stmt.factors:
            product *= factor.value if isinstance(factor, Literal) else arrays[factor.name][position(factor, env)]
        out[position(stmt.output, env)] += product
    return torch.from_numpy(out)


def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected.double(), **tolerance(dtype))


# ---------------------------------------------------------------- every curated case


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_case_against_dense_loop(c, index_dtype):
    tensors = build(c, seed=1, index_dtype=index_dtype, dtype=torch.float64)
    expected = dense_loop(c.stmt, tensors)
    out = tensors[c.output]
    actual = insum(c.stmt, backend="torch", **tensors)
    assert actual is out
    check(actual, expected, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_case_dtypes(c, dtype):
    tensors = build(c, seed=2, index_dtype=torch.int32, dtype=dtype)
    expected = dense_loop(c.stmt, tensors)
    check(insum(c.stmt, backend="torch", **tensors), expected, dtype)


@pytest.mark.parametrize("c", [c for c in CASES if not c.needs_out], ids=[c.id for c in CASES if not c.needs_out])
def test_case_with_allocated_output(c):
    tensors = build(c, seed=3, dtype=torch.float64, with_output=False)
    actual = insum(c.stmt, backend="torch", **tensors)
    check(actual, dense_loop(c.stmt, tensors), torch.float64)


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_case_with_strided_operands_and_output(c):
    tensors = build(c, seed=4, dtype=torch.float64)
    expected = dense_loop(c.stmt, tensors)
    views = {name: strided(t) for name, t in tensors.items()}
    for t in views.values():
        assert t.numel() <= 1 or not t.is_contiguous()
    out = views[c.output]
    actual = insum(c.stmt, backend="torch", **views)
    assert actual is out and not (out.numel() > 1 and out.is_contiguous())
    check(actual, expected, torch.float64)


def test_cases_build_random_outputs():
    for c in CASES:
        out = build(c)[c.output]
        assert out.numel() == 0 or bool((out != 0).all()), c.id


# ---------------------------------------------------------------- per-format numpy oracles


def _coo(a):
    dense = np.zeros((a["C"].shape[0], a["B"].shape[0]))
    np.add.at(dense, (a["AM"], a["AK"]), a["AV"])
    return a["C"] + dense @ a["B"]


def _group_coo(a):
    dense = np.zeros((a["C"].shape[0], a["B"].shape[0]))
    np.add.at(dense, (a["AM"][:, None], a["AK"]), a["AV"])
    return a["C"] + dense @ a["B"]


def _ell(a):
    dense = np.zeros((a["C"].shape[0], a["B"].shape[0]))
    np.add.at(dense, (np.arange(a["AK"].shape[0])[:, None], a["AK"]), a["AV"])
    return a["C"] + dense @ a["B"]


def _block_affine(block):
    def oracle(a):
        dense = np.zeros((a["C"].shape[0], a["B"].shape[0]))
        for p, q in np.ndindex(*a["AK"].shape):
            r, c = a["AM"][p] * block, a["AK"][p, q] * block
            dense[r : r + block, c : c + block] += a["AV"][p, q]
        return a["C"] + dense @ a["B"]

    return oracle


def _block_group_coo(a):
    mb, bm, _ = a["C"].shape
    kb, bk, n = a["B"].shape
    dense = np.zeros((mb, bm, kb, bk))
    np.add.at(dense, (a["AM"][:, None], slice(None), a["AK"]), a["AV"])
    return a["C"] + np.einsum("iakb,kbn->ian", dense, a["B"])


def _sddmm(a):
    return a["O"] + (a["X"][a["AM"]] * a["Y"][a["AK"]]).sum(axis=1)


def _segment_sum(a):
    out = a["S"].copy()
    np.add.at(out, a["SEG"], a["X"])
    return out


def _four_factors(a):
    k, i, j = a["Z"].shape[2], a["X"].shape[2], a["Y"].shape[2]
    dense = np.zeros((k, i, j))
    np.add.at(dense, (a["CK"][:, None], a["CI"], a["CJ"]), a["CV"])
    return a["Z"] + np.einsum("kij,bui,bvj,uvw->bwk", dense, a["X"], a["Y"], a["W"])


def _point_conv(a):
    out = a["O"].copy()
    for w in range(a["W"].shape[0]):
        np.add.at(out, a["MO"][w], a["X"][a["MI"][w]] @ a["W"][w])
    return out


def _conv1d(a):
    taps, length = a["K"].shape[0], a["Y"].shape[0]
    return a["Y"] + np.array([sum(a["X"][i + 3 - t] * a["K"][t] for t in range(taps)) for i in range(length)])


def _affine_sum_gather(a):
    return a["O"] + np.array([sum(a["A"][i + j, 0] * e for j, e in enumerate(a["E"])) for i in range(len(a["O"]))])


def _affine_sum_scatter(a):
    out = a["O"].copy()
    for i, x in enumerate(a["A1"]):
        for j, e in enumerate(a["E"]):
            out[i + j, 0] += x * e
    return out


def _no_variables(a):
    out = a["O"].copy()
    out[1] += a["S"] * a["X"][2, 1] * 0.5
    return out


NUMPY_ORACLES = {
    "coo_spmm": _coo,
    "coo_spmm_overwrite": lambda a: _coo({**a, "C": np.zeros_like(a["C"])}),
    "coo_spmm_one_based": lambda a: _coo({**a, "AM": a["AM"] - 1, "AK": a["AK"] - 1}),
    "coo_spmm_empty": lambda a: a["C"],
    "group_coo_spmm": _group_coo,
    "group_coo_spmm_overwrite": lambda a: _group_coo({**a, "C": np.zeros_like(a["C"])}),
    "ell_spmm": _ell,
    "block_spmm_affine": _block_affine(4),
    "block_spmm_left_coef": _block_affine(3),
    "block_group_coo": _block_group_coo,
    "nm_spmm": lambda a: a["C"] + np.einsum("rlu,run->rln", a["AV"], a["B"][a["AK"]]),
    "sddmm": _sddmm,
    "sddmm_scaled": lambda a: a["AV"] * (a["X"][a["AM"]] * a["Y"][a["AK"]]).sum(axis=1),
    "embedding": lambda a: a["E"] + a["W"][a["I"]],
    "double_gather": lambda a: a["E"] + a["W"][a["V"][a["I"]]],
    "segment_sum": _segment_sum,
    "four_factors": _four_factors,
    "point_conv": _point_conv,
    "dense_matmul": lambda a: a["A"] @ a["B"],
    "transposed_out": lambda a: a["C"] + (a["A"] @ a["B"]).T,
    "literal_factors": lambda a: a["C"] + 0.5 * -2 * 1.5e-1 * (a["A"] @ a["B"]),
    "outer": lambda a: a["C"] + np.outer(a["X"], a["Y"]),
    "dot": lambda a: np.array(a["X"] @ a["Y"]),
    "dot_brackets": lambda a: a["S"] + a["X"] @ a["Y"],
    "scalar_factor": lambda a: a["C"] + 3 * a["s"] * a["A"],
    "int_literal_index": lambda a: a["O"] + a["X"][1] * a["X2"][2],
    "conv1d": _conv1d,
    "shift": lambda a: a["D"] + a["X"][1:-1] * a["X"][2:] * a["W"],
    "diagonal": lambda a: a["O"] + np.diag(a["A"]),
    "affine_sum_gather": _affine_sum_gather,
    "affine_sum_scatter": _affine_sum_scatter,
    "no_variables": _no_variables,
}


def test_every_case_has_a_numpy_oracle():
    assert set(NUMPY_ORACLES) == set(IDS)


@pytest.mark.parametrize("case_id", IDS)
def test_case_against_numpy(case_id):
    c = case(case_id)
    tensors = build(c, seed=5, dtype=torch.float64)
    expected = torch.from_numpy(np.asarray(NUMPY_ORACLES[case_id](numpy_of(tensors)), dtype=np.float64))
    check(insum(c.stmt, backend="torch", **tensors), expected, torch.float64)


# ---------------------------------------------------------------- semantics, one at a time


def test_coo_duplicate_coordinates_add_up():
    C = torch.zeros(3, 2, dtype=torch.float64)
    AM = torch.tensor([1, 1, 1, 0])
    AK = torch.tensor([2, 2, 0, 2])
    AV = torch.tensor([1.0, 10.0, 100.0, 1000.0], dtype=torch.float64)
    B = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    insum("C[AM[p], n] += AV[p] * B[AK[p], n]", C=C, AM=AM, AK=AK, AV=AV, B=B, backend="torch")
    expected = torch.tensor([[5000.0, 6000.0], [11 * 5 + 100 * 1, 11 * 6 + 100 * 2], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(C, expected)


def test_group_coo_padding_adds_nothing():
    c = case("group_coo_spmm")
    tensors = build(c, seed=6, dtype=torch.float64)
    padded = tensors["AV"] == 0
    assert bool(padded.any()), "the case should contain padded slots"
    assert bool((tensors["AK"][padded] == 0).all())
    # The same matrix as plain COO without the padded slots.
    before, real = tensors["C"].clone(), ~padded
    coo = {
        "C": before.clone(),
        "AM": tensors["AM"][:, None].expand_as(real)[real],
        "AK": tensors["AK"][real],
        "AV": tensors["AV"][real],
        "B": tensors["B"],
    }
    expected = insum("C[AM[p], n] += AV[p] * B[AK[p], n]", **coo)
    torch.testing.assert_close(insum(c.stmt, **tensors), expected)
    torch.testing.assert_close(expected, torch.from_numpy(_coo(numpy_of(coo | {"C": before}))))


@pytest.mark.parametrize("stmt_op", ["+=", "="])
def test_overwrite_zeroes_untouched_rows_accumulate_keeps_them(stmt_op):
    C = torch.full((5, 3), 7.0)
    AM = torch.tensor([1, 3, 1])
    AV = torch.tensor([1.0, 2.0, 3.0])
    B = torch.arange(9.0).view(3, 3)
    AK = torch.tensor([0, 2, 2])
    insum(f"C[AM[p], n] {stmt_op} AV[p] * B[AK[p], n]", C=C, AM=AM, AK=AK, AV=AV, B=B)
    untouched = C[[0, 2, 4]]
    base = 7.0 if stmt_op == "+=" else 0.0
    assert bool((untouched == base).all())
    torch.testing.assert_close(C[1], base + 1.0 * B[0] + 3.0 * B[2])
    torch.testing.assert_close(C[3], base + 2.0 * B[2])


def test_overwrite_direct_output():
    C = torch.full((2, 2), 7.0)
    insum("C[m, n] = A[m, k] * B[k, n]", C=C, A=torch.eye(2), B=torch.ones(2, 2))
    torch.testing.assert_close(C, torch.ones(2, 2))


@pytest.mark.parametrize("op", ["+=", "="])
def test_empty_extents(op):
    C = torch.randn(4, 3)
    before = C.clone()
    empty = torch.zeros(0, dtype=torch.int64)
    insum(f"C[AM[p], n] {op} AV[p] * B[AK[p], n]", C=C, AM=empty, AK=empty, AV=torch.zeros(0), B=torch.randn(6, 3))
    torch.testing.assert_close(C, before if op == "+=" else torch.zeros(4, 3))


def test_empty_allocated_output():
    E = insum("E[i, d] += W[I[i], d]", I=torch.zeros(0, dtype=torch.int32), W=torch.randn(5, 3))
    assert E.shape == (0, 3)
    S = insum("S = X[i] * Y[i]", X=torch.zeros(0), Y=torch.zeros(0))
    assert S.shape == () and float(S) == 0.0


def test_empty_reduction_gives_zero():
    C = insum("C[m, n] += A[m, k] * B[k, n]", A=torch.zeros(3, 0), B=torch.zeros(0, 2))
    torch.testing.assert_close(C, torch.zeros(3, 2))


def test_literal_factors():
    X = torch.arange(1.0, 5.0, dtype=torch.float64)
    Y = insum("Y[i] = 2 * X[i] * -0.5e1 * .25", X=X)
    torch.testing.assert_close(Y, X * 2 * -5 * 0.25)
    Z = insum("Z[i] += 3", Z=torch.ones(3))
    torch.testing.assert_close(Z, torch.full((3,), 4.0))


def test_repeated_index_tensor():
    # One index tensor used in the output and a factor.
    C = torch.zeros(4, 2, dtype=torch.float64)
    AM = torch.tensor([0, 3, 3])
    B = torch.arange(8.0, dtype=torch.float64).view(4, 2)
    insum("C[AM[p], n] += B[AM[p], n]", C=C, AM=AM, B=B)
    torch.testing.assert_close(C, torch.tensor([[0.0, 1.0], [0, 0], [0, 0], [12.0, 14.0]], dtype=torch.float64))


def test_half_precision_accumulates_in_float32():
    assert compute_dtype(torch.float16) == torch.float32 and compute_dtype(torch.bfloat16) == torch.float32
    assert compute_dtype(torch.float64) == torch.float64
    X = torch.ones(3000, dtype=torch.float16)
    S = insum("S = X[i]", X=X)
    assert S.dtype == torch.float16 and float(S) == 3000.0


# ---------------------------------------------------------------- indices out of range


def _coo_inputs():
    return {
        "C": torch.randn(4, 3),
        "AM": torch.tensor([0, 3, 1]),
        "AK": torch.tensor([4, 0, 2]),
        "AV": torch.randn(3),
        "B": torch.randn(5, 3),
    }


@pytest.mark.parametrize("op", ["+=", "="])
@pytest.mark.parametrize(
    "name, bad, fragment",
    [
        ("AK", [5, 0, 2], "index 5 out of range for B dimension 0 of size 5"),
        ("AK", [0, -1, 2], "index -1 out of range for B dimension 0 of size 5"),
        ("AM", [0, 4, 1], "index 4 out of range for C dimension 0 of size 4"),
        ("AM", [-3, 0, 1], "index -3 out of range for C dimension 0 of size 4"),
    ],
    ids=["gather_high", "gather_negative", "scatter_high", "scatter_negative"],
)
def test_out_of_range_index_raises_and_leaves_output_alone(name, bad, fragment, op):
    tensors = _coo_inputs()
    tensors[name] = torch.tensor(bad, dtype=torch.int32)
    before = tensors["C"].clone()
    with pytest.raises(InsumError, match=fragment):
        insum(f"C[AM[p], n] {op} AV[p] * B[AK[p], n]", backend="torch", **tensors)
    torch.testing.assert_close(tensors["C"], before)


def test_out_of_range_affine_index():
    c = case("block_spmm_affine")
    tensors = build(c)
    tensors["AM"][0] = tensors["C"].shape[0] // 4  # the block row just past the end
    with pytest.raises(InsumError, match="out of range for C dimension 0"):
        insum(c.stmt, backend="torch", **tensors)


def test_out_of_range_nested_index():
    with pytest.raises(InsumError, match="index 7 out of range for V dimension 0 of size 7"):
        insum("E[i, d] += W[V[I[i]], d]", I=torch.tensor([1, 7]), V=torch.arange(7), W=torch.randn(7, 2))


def test_out_of_range_literal_index():
    with pytest.raises(InsumError, match="index 3 out of range for X dimension 0 of size 3"):
        insum("O[n] += X[3, n]", X=torch.randn(3, 2))


def test_reference_leaves_inputs_alone():
    c = case("point_conv")
    tensors = build(c)
    inputs = clone({k: v for k, v in tensors.items() if k != c.output})
    insum(c.stmt, backend="torch", **tensors)
    for name, t in inputs.items():
        assert torch.equal(tensors[name], t), name
