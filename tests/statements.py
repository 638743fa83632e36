"""The curated list of insum statements that every backend is checked on.

Each `Case` is one statement with a builder of realistic random tensors: index tensors hold
valid indices (duplicates allowed, padding uses value 0 and a valid index), value tensors are
random normal, and the output, when the case builds one, is random too (not zeros), so that
`+=` is really tested. Extents are small and not powers of two.

    from statements import CASES, build, tolerance
    for case in CASES:
        tensors = build(case, seed=0, index_dtype=torch.int32, dtype=torch.float16)
        expected = insum(case.stmt, backend="torch", **clone(tensors))
        actual = insum(case.stmt, backend="triton", **clone(tensors))
        torch.testing.assert_close(actual, expected, **tolerance(torch.float16))

`case.make(generator, index_dtype, dtype)` returns every input and the output (random
values); `case.needs_out` says whether the output must be passed (its shape does not follow
from the inputs). `build(...)` wraps `make` with a seed, a device and an option to leave
the output out. Add every statement that ever failed to this list, with a comment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "Case",
    "CASES",
    "CASE_IDS",
    "case",
    "build",
    "clone",
    "strided",
    "tolerance",
    "output_name",
]

Make = Callable[[torch.Generator, torch.dtype, torch.dtype], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Case:
    """One statement and a builder of tensors for it.

    id         a short name, used as the pytest id
    stmt       the statement text
    make       make(generator, index_dtype, dtype) -> {name: tensor}, inputs and output
    needs_out  True when the output must be passed (an indirect or affine output index,
               or an output variable whose extent only the output gives)
    note       what the case stands for
    """

    id: str
    stmt: str
    make: Make = field(repr=False)
    needs_out: bool
    note: str = ""

    @property
    def output(self) -> str:
        return output_name(self.stmt)


def output_name(stmt: str) -> str:
    """The output tensor's name: the name before the first `[`, `=` or `+=`."""
    head = stmt.split("=")[0].rstrip("+").strip()
    return head.split("[")[0].strip()


# ---------------------------------------------------------------- random tensor helpers


def _values(g: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _indices(g: torch.Generator, index_dtype: torch.dtype, high: int, *shape: int) -> torch.Tensor:
    """Uniform indices in [0, high): duplicates are likely."""
    return torch.randint(0, high, shape, generator=g).to(index_dtype)


def _padded(g, index_dtype, dtype, high: int, groups: int, width: int, *value_tail: int):
    """GroupCOO-style (AK, AV): each group has 1..width real slots, the rest padding.

    Padding slots hold index 0 (valid) and value 0, so they add nothing.
    """
    ak = _indices(g, index_dtype, high, groups, width)
    av = _values(g, dtype, groups, width, *value_tail)
    lengths = torch.randint(1, width + 1, (groups,), generator=g)
    pad = torch.arange(width)[None, :] >= lengths[:, None]  # [groups, width]
    ak[pad] = 0
    av[pad] = 0
    return ak, av


# ---------------------------------------------------------------- the cases
# Extents used below: M=7 rows, K=9 columns of A / rows of B, N=5 columns of B, nnz=13.


def _coo(g, it, dt):
    # COO SpMM with duplicate coordinates (nnz > M*K is not needed for duplicates: 13 draws
    # from 7 rows make repeated rows certain, repeated (row, col) pairs likely).
    nnz, m, k, n = 13, 7, 9, 5
    am = _indices(g, it, m, nnz)
    ak = _indices(g, it, k, nnz)
    am[1], ak[1] = am[0], ak[0]  # one guaranteed duplicate coordinate
    return {"C": _values(g, dt, m, n), "AM": am, "AK": ak, "AV": _values(g, dt, nnz), "B": _values(g, dt, k, n)}


def _coo_one_based(g, it, dt):
    tensors = _coo(g, it, dt)
    tensors["AM"] += 1
    tensors["AK"] += 1
    return tensors


def _coo_empty(g, it, dt):
    # nnz = 0: every extent of p is empty; the output must come back unchanged (+=).
    m, k, n = 7, 9, 5
    return {
        "C": _values(g, dt, m, n),
        "AM": torch.zeros(0, dtype=it),
        "AK": torch.zeros(0, dtype=it),
        "AV": _values(g, dt, 0),
        "B": _values(g, dt, k, n),
    }


def _group_coo(g, it, dt):
    # GroupCOO: G groups of g=3 slots, each group one row; rows repeat across groups.
    groups, width, m, k, n = 6, 3, 7, 9, 5
    ak, av = _padded(g, it, dt, k, groups, width)
    return {"C": _values(g, dt, m, n), "AM": _indices(g, it, m, groups), "AK": ak, "AV": av, "B": _values(g, dt, k, n)}


def _ell(g, it, dt):
    # ELL: one group per row, width W=3, padded with value 0 / index 0.
    m, width, k, n = 7, 3, 9, 5
    ak, av = _padded(g, it, dt, k, m, width)
    return {"C": _values(g, dt, m, n), "AK": ak, "AV": av, "B": _values(g, dt, k, n)}


def _block_affine(g, it, dt, block=4):
    # Block SpMM with affine indices: block rows AM[p], block columns AK[p,q], blocks of
    # block x block; C and B are the plain (unblocked) matrices.
    groups, width, mb, kb, n = 5, 3, 3, 4, 5
    ak, av = _padded(g, it, dt, kb, groups, width, block, block)
    return {
        "C": _values(g, dt, mb * block, n),
        "AM": _indices(g, it, mb, groups),
        "AK": ak,
        "AV": av,
        "B": _values(g, dt, kb * block, n),
    }


def _block_group_coo(g, it, dt):
    # BlockGroupCOO: the same blocks with C and B viewed blocked ([Mb, bm, N], [Kb, bk, N]).
    groups, width, mb, kb, bm, bk, n = 5, 3, 3, 4, 2, 3, 5
    ak, av = _padded(g, it, dt, kb, groups, width, bm, bk)
    return {
        "C": _values(g, dt, mb, bm, n),
        "AM": _indices(g, it, mb, groups),
        "AK": ak,
        "AV": av,
        "B": _values(g, dt, kb, bk, n),
    }


def _sddmm(g, it, dt):
    # SDDMM: one dot product of a row of X and a row of Y per sampled position.
    nnz, m, k, d = 11, 7, 9, 6
    return {
        "O": _values(g, dt, nnz),
        "AM": _indices(g, it, m, nnz),
        "AK": _indices(g, it, k, nnz),
        "X": _values(g, dt, m, d),
        "Y": _values(g, dt, k, d),
    }


def _sddmm_scaled(g, it, dt):
    tensors = _sddmm(g, it, dt)
    tensors["AV"] = _values(g, dt, tensors["O"].shape[0])
    return tensors


def _embedding(g, it, dt):
    # Gather only: embedding lookup of 10 tokens in a 7 x 6 table.
    tokens, vocab, d = 10, 7, 6
    return {"E": _values(g, dt, tokens, d), "I": _indices(g, it, vocab, tokens), "W": _values(g, dt, vocab, d)}


def _double_gather(g, it, dt):
    # Gather through two levels of indirection: W[V[I[i]], d].
    tokens, ids, vocab, d = 10, 8, 7, 6
    return {
        "E": _values(g, dt, tokens, d),
        "I": _indices(g, it, ids, tokens),
        "V": _indices(g, it, vocab, ids),
        "W": _values(g, dt, vocab, d),
    }


def _segment_sum(g, it, dt):
    # Scatter only: 11 rows summed into 4 segments (unsorted, some segments empty maybe).
    rows, segments, d = 11, 4, 6
    return {"S": _values(g, dt, segments, d), "SEG": _indices(g, it, segments, rows), "X": _values(g, dt, rows, d)}


def _four_factors(g, it, dt):
    # A sparse tensor product (e3nn-like): Z_bwk += sum CV * X_bu(i) * Y_bv(j) * W_uvw.
    b, w, k, p, q, u, v, i, j = 2, 3, 4, 5, 3, 3, 2, 4, 3
    return {
        "Z": _values(g, dt, b, w, k),
        "CK": _indices(g, it, k, p),
        "CV": _values(g, dt, p, q),
        "X": _values(g, dt, b, u, i),
        "CI": _indices(g, it, i, p, q),
        "Y": _values(g, dt, b, v, j),
        "CJ": _indices(g, it, j, p, q),
        "W": _values(g, dt, u, v, w),
    }


def _point_conv(g, it, dt):
    # Sparse point-cloud convolution: per kernel offset w, pairs (MI -> MO) of points.
    offsets, pairs, points_in, points_out, ci, co = 3, 5, 8, 7, 4, 6
    return {
        "O": _values(g, dt, points_out, co),
        "MO": _indices(g, it, points_out, offsets, pairs),
        "MI": _indices(g, it, points_in, offsets, pairs),
        "X": _values(g, dt, points_in, ci),
        "W": _values(g, dt, offsets, ci, co),
    }


def _dense_matmul(g, it, dt):
    m, k, n = 7, 9, 5
    return {"C": _values(g, dt, m, n), "A": _values(g, dt, m, k), "B": _values(g, dt, k, n)}


def _outer(g, it, dt):
    m, n = 7, 5
    return {"C": _values(g, dt, m, n), "X": _values(g, dt, m), "Y": _values(g, dt, n)}


def _dot(g, it, dt):
    n = 11
    return {"S": _values(g, dt), "X": _values(g, dt, n), "Y": _values(g, dt, n)}


def _scalar_factor(g, it, dt):
    m, n = 7, 5
    return {"C": _values(g, dt, m, n), "s": _values(g, dt), "A": _values(g, dt, m, n)}


def _int_literal_index(g, it, dt):
    # Integer literal indices: row 1 of X times row 2 of X2 (a fixed slice).
    r, n = 3, 5
    return {"O": _values(g, dt, n), "X": _values(g, dt, r, n), "X2": _values(g, dt, r, n)}


def _conv1d(g, it, dt):
    # 1-D correlation with an affine index `i + 3 - t`: the extent of i comes from Y only.
    length, taps = 10, 4
    return {"Y": _values(g, dt, length), "X": _values(g, dt, length + 3), "K": _values(g, dt, taps)}


def _shift(g, it, dt):
    # Shifted reads `X[i + 1]`, `X[i + 2]`; the extent of i comes from W.
    length = 9
    return {"D": _values(g, dt, length - 2), "X": _values(g, dt, length), "W": _values(g, dt, length - 2)}


def _nm(g, it, dt):
    # Vector-wise N:M: rows in blocks of L=3 share the index row AK[rb, :].
    rb, lanes, u, k, n = 3, 3, 4, 9, 5
    return {"C": _values(g, dt, rb, lanes, n), "AK": _indices(g, it, k, rb, u), "AV": _values(g, dt, rb, lanes, u), "B": _values(g, dt, k, n)}


def _diagonal(g, it, dt):
    n = 6
    return {"O": _values(g, dt, n), "A": _values(g, dt, n, n)}


def _transposed_out(g, it, dt):
    m, k, n = 7, 9, 5
    return {"C": _values(g, dt, n, m), "A": _values(g, dt, m, k), "B": _values(g, dt, k, n)}


def _affine_sum_gather(g, it, dt):
    # `A[i + j, 0]` on a matrix with 4 columns: the sum times the stride (issue 15, item 1).
    i, j = 4, 2
    return {"O": _values(g, dt, i), "A": _values(g, dt, i + j - 1, 4), "E": _values(g, dt, j)}


def _affine_sum_scatter(g, it, dt):
    # `O[i + j, 0]`: a scatter through the sum on a dimension of stride 3 (issue 15, item 1).
    i, j = 4, 2
    return {"O": _values(g, dt, i + j - 1, 3), "A1": _values(g, dt, i), "E": _values(g, dt, j)}


def _no_variables(g, it, dt):
    # Scalars and literal indices only (issue 15, item 2).
    return {"O": _values(g, dt, 3), "S": _values(g, dt), "X": _values(g, dt, 4, 2)}


CASES: list[Case] = [
    # --- sparse formats: SpMM ---
    Case("coo_spmm", "C[AM[p], n] += AV[p] * B[AK[p], n]", _coo, True,
         "COO SpMM; duplicate coordinates add up"),
    Case("coo_spmm_overwrite", "C[AM[p], n] = AV[p] * B[AK[p], n]", _coo, True,
         "`=`: rows no nonzero lands on become zero"),
    Case("coo_spmm_one_based", "C[AM[p] - 1, n] += AV[p] * B[AK[p] - 1, n]", _coo_one_based, True,
         "one-based coordinates (as read from Matrix Market): `AM[p] - 1`"),
    Case("coo_spmm_empty", "C[AM[p], n] += AV[p] * B[AK[p], n]", _coo_empty, True,
         "nnz = 0: nothing to do, C unchanged"),
    Case("group_coo_spmm", "C[AM[p], n] += AV[p, q] * B[AK[p, q], n]", _group_coo, True,
         "GroupCOO with padded slots (value 0, index 0)"),
    Case("group_coo_spmm_overwrite", "C[AM[p], n] = AV[p, q] * B[AK[p, q], n]", _group_coo, True,
         "GroupCOO with `=`"),
    Case("ell_spmm", "C[m, n] += AV[m, q] * B[AK[m, q], n]", _ell, False,
         "ELL: one padded group per row, direct output"),
    Case("block_spmm_affine", "C[AM[p]*4 + m, n] += AV[p, q, m, k] * B[AK[p, q]*4 + k, n]",
         _block_affine, True, "block SpMM on unblocked C, B via affine indices"),
    Case("block_spmm_left_coef", "C[3*AM[p] + m, n] += AV[p, q, m, k] * B[3*AK[p, q] + k, n]",
         lambda g, it, dt: _block_affine(g, it, dt, block=3), True,
         "coefficient on the left of the indirect access, block 3"),
    Case("block_group_coo", "C[AM[p], m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]",
         _block_group_coo, True, "BlockGroupCOO on blocked views of C and B"),
    Case("nm_spmm", "C[rb, l, n] += AV[rb, l, u] * B[AK[rb, u], n]", _nm, False,
         "vector-wise N:M: L rows share one index row"),
    # --- other sparse kernels ---
    Case("sddmm", "O[p] += X[AM[p], k] * Y[AK[p], k]", _sddmm, False,
         "SDDMM: gathers on both sides, reduction over k, no scatter"),
    Case("sddmm_scaled", "O[p] = AV[p] * X[AM[p], k] * Y[AK[p], k]", _sddmm_scaled, False,
         "SDDMM scaled by the sparse values, `=`"),
    Case("embedding", "E[i, d] += W[I[i], d]", _embedding, False,
         "gather only: embedding lookup"),
    Case("double_gather", "E[i, d] += W[V[I[i]], d]", _double_gather, False,
         "two levels of indirection"),
    Case("segment_sum", "S[SEG[i], d] += X[i, d]", _segment_sum, True,
         "scatter only: unsorted segment sum"),
    Case("four_factors", "Z[b, w, CK[p]] += CV[p, q] * X[b, u, CI[p, q]] * Y[b, v, CJ[p, q]] * W[u, v, w]",
         _four_factors, True, "product of four factors, three reduced variables, scatter"),
    Case("point_conv", "O[MO[w, p], co] += X[MI[w, p], ci] * W[w, ci, co]", _point_conv, True,
         "sparse point-cloud convolution: gather, matmul per offset, scatter"),
    # --- dense statements and language corners ---
    Case("dense_matmul", "C[m, n] = A[m, k] * B[k, n]", _dense_matmul, False, "plain matmul"),
    Case("transposed_out", "C[n, m] += A[m, k] * B[k, n]", _transposed_out, False,
         "output variables in another order than the inputs'"),
    Case("literal_factors", "C[m, n] += 0.5 * A[m, k] * B[k, n] * -2 * 1.5e-1", _dense_matmul, False,
         "numeric literal factors: float, negative int, exponent"),
    Case("outer", "C[m, n] += X[m] * Y[n]", _outer, False, "no reduction, broadcast product"),
    Case("dot", "S = X[i] * Y[i]", _dot, False, "scalar output written without brackets"),
    Case("dot_brackets", "S[] += X[i] * Y[i]", _dot, False, "scalar output as S[], accumulated"),
    Case("scalar_factor", "C[m, n] += s[] * A[m, n] * 3", _scalar_factor, False,
         "a scalar tensor factor times a literal"),
    Case("int_literal_index", "O[n] += X[1, n] * X2[2, n]", _int_literal_index, False,
         "integer literal indices"),
    Case("conv1d", "Y[i] += X[i + 3 - t] * K[t]", _conv1d, True,
         "affine index with a negative term; i's extent only from the output"),
    Case("shift", "D[i] += X[i + 2 - 1] * X[i + 2] * W[i]", _shift, False,
         "`i + 2 - 1` (folds to i + 1) and `i + 2`; i's extent from W"),
    Case("diagonal", "O[i] += A[i, i]", _diagonal, False, "one variable twice in one access"),
    # --- past failures (issue 15; found again by tests/test_fuzz.py) ---
    Case("affine_sum_gather", "O[i] += A[i + j, 0] * E[j]", _affine_sum_gather, True,
         "two unit terms on a strided dimension: the kernel addressed a + b*stride"),
    Case("affine_sum_scatter", "O[i + j, 0] += A1[i] * E[j]", _affine_sum_scatter, True,
         "the same in the output: the scatter wrote into row 0"),
    Case("no_variables", "O[1] += S[] * X[2, 1] * 0.5", _no_variables, True,
         "no variables: the kernel's signature had an empty extents group"),
]

CASE_IDS = [c.id for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS), "case ids must be unique"


def case(case_id: str) -> Case:
    """The case named `case_id`."""
    for c in CASES:
        if c.id == case_id:
            return c
    raise KeyError(f"no case {case_id!r}; cases: {', '.join(CASE_IDS)}")


def build(
    case: Case,
    *,
    seed: int = 0,
    index_dtype: torch.dtype = torch.int64,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_output: bool = True,
) -> dict[str, torch.Tensor]:
    """Run `case.make` with a CPU generator seeded `seed`, move the tensors to `device`.

    `with_output=False` leaves the output out (allowed only when `not case.needs_out`).
    The values are the same on every device for a given seed.
    """
    if not with_output and case.needs_out:
        raise ValueError(f"case {case.id}: the output {case.output} must be passed")
    generator = torch.Generator().manual_seed(seed)
    tensors = case.make(generator, index_dtype, dtype)
    if not with_output:
        tensors.pop(case.output)
    return {name: t.to(device) for name, t in tensors.items()}


def clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh copies, so that two runs of one case start from the same output."""
    return {name: t.clone() for name, t in tensors.items()}


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (transposed storage, or every other element)."""
    if t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if t.dim() == 1:
        wide = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
        wide[::2] = t
        return wide[::2]
    return t.clone()


_TOLERANCES = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 1e-2, "atol": 1e-2},
    torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2},
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """`rtol`/`atol` for `torch.testing.assert_close` on outputs of `dtype` (sums of ~30 terms)."""
    return dict(_TOLERANCES[dtype])
