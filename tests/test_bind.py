"""Binding: extents, roles, dtypes and every error a statement and its tensors can raise.

Binding needs shapes, dtypes and devices only, so most tests here use meta tensors."""

from __future__ import annotations

import pytest
import torch
from statements import CASES, build

from insum import InsumError, InsumShapeError, InsumTypeError, parse
from insum.bind import bind


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def idx(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return meta(*shape, dtype=dtype)


GROUP_COO = "C[AM[p], n] += AV[p, q] * B[AK[p, q], n]"


def group_coo(**changes) -> dict[str, torch.Tensor]:
    """Meta tensors for GroupCOO SpMM: G=6 groups of 3, C 7 x 5, B 9 x 5."""
    tensors = {"C": meta(7, 5), "AM": idx(6), "AK": idx(6, 3), "AV": meta(6, 3), "B": meta(9, 5)}
    tensors.update(changes)
    return {k: v for k, v in tensors.items() if v is not None}


# ---------------------------------------------------------------- what binding infers


def test_group_coo_extents_roles_and_names():
    bound = bind(parse(GROUP_COO), group_coo())
    assert dict(bound.extents) == {"p": 6, "q": 3, "n": 5}
    assert dict(bound.roles) == {"p": "scattered", "n": "output", "q": "reduced"}
    assert bound.variables("reduced") == ("q",)
    assert set(bound.index_names) == {"AM", "AK"}
    assert bound.value_names == ("AV", "B")
    assert bound.out_shape == (7, 5) and bound.out_dtype == torch.float32
    assert bound.output_name == "C" and bound.device.type == "meta"


def test_roles_of_block_affine_output():
    stmt = parse("C[AM[p]*4 + m, n] += AV[p, q, m, k] * B[AK[p, q]*4 + k, n]")
    tensors = {"C": meta(12, 5), "AM": idx(5), "AK": idx(5, 3), "AV": meta(5, 3, 4, 4), "B": meta(16, 5)}
    bound = bind(stmt, tensors)
    assert dict(bound.extents) == {"p": 5, "m": 4, "n": 5, "q": 3, "k": 4}
    # m appears in the output only inside an affine index: scattered, not owned.
    assert dict(bound.roles) == {"p": "scattered", "m": "scattered", "n": "output", "q": "reduced", "k": "reduced"}


def test_sddmm_and_embedding_roles():
    sddmm = bind(parse("O[p] += X[AM[p], k] * Y[AK[p], k]"), {"AM": idx(11), "AK": idx(11), "X": meta(7, 6), "Y": meta(9, 6)})
    assert dict(sddmm.roles) == {"p": "output", "k": "reduced"} and sddmm.out_shape == (11,)
    emb = bind(parse("E[i, d] += W[I[i], d]"), {"I": idx(10, dtype=torch.int32), "W": meta(7, 6)})
    assert dict(emb.roles) == {"i": "output", "d": "output"} and emb.out_shape == (10, 6)
    assert emb.index_names == ("I",) and emb.value_names == ("W",)


def test_extent_from_the_output_only():
    bound = bind(parse("Y[i] += X[i + 3 - t] * K[t]"), {"Y": meta(10), "X": meta(13), "K": meta(4)})
    assert dict(bound.extents) == {"i": 10, "t": 4}


def test_scalar_output_and_scalar_factor():
    bound = bind(parse("S = s * X[i] * Y[i]"), {"s": meta(), "X": meta(11), "Y": meta(11)})
    assert bound.out_shape == () and bound.roles["i"] == "reduced"


@pytest.mark.parametrize(
    "dtypes, expected",
    [
        ((torch.float16, torch.float16), torch.float16),
        ((torch.bfloat16, torch.bfloat16), torch.bfloat16),
        ((torch.float16, torch.bfloat16), torch.float32),
        ((torch.float16, torch.float32), torch.float32),
        ((torch.bfloat16, torch.float64), torch.float64),
    ],
)
def test_allocated_output_dtype_is_promoted(dtypes, expected):
    a, b = dtypes
    bound = bind(parse("C[m, n] += A[m, k] * B[k, n]"), {"A": meta(3, 4, dtype=a), "B": meta(4, 2, dtype=b)})
    assert bound.out_dtype == expected and bound.out_shape == (3, 2)


def test_passed_output_keeps_its_dtype():
    bound = bind(parse("C[m, n] += A[m, k] * B[k, n]"), {"C": meta(3, 2, dtype=torch.float64), "A": meta(3, 4, dtype=torch.float16), "B": meta(4, 2, dtype=torch.float16)})
    assert bound.out_dtype == torch.float64


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_needs_out_flag_matches_binding(case):
    """The curated cases say truly whether the output must be passed."""
    tensors = build(case)
    stmt = parse(case.stmt)
    bound = bind(stmt, tensors)
    assert bound.out_shape == tuple(tensors[case.output].shape)
    inputs = {k: v for k, v in tensors.items() if k != case.output}
    if case.needs_out:
        with pytest.raises(InsumError, match=f"pass {case.output}|pass the output"):
            bind(stmt, inputs)
    else:
        assert bind(stmt, inputs).out_shape == bound.out_shape


# ---------------------------------------------------------------- errors


def _raises(cls, text: str, tensors: dict, *fragments: str) -> str:
    with pytest.raises(cls) as info:
        bind(parse(text), tensors)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_unknown_tensor():
    _raises(InsumError, GROUP_COO, group_coo(X=meta(3)), "unknown or unused", "X")


def test_missing_tensor():
    _raises(InsumError, GROUP_COO, group_coo(B=None), "missing", "B")


def test_missing_index_tensor():
    _raises(InsumError, GROUP_COO, group_coo(AK=None), "missing", "AK")


def test_rank_mismatch_of_a_factor():
    _raises(InsumShapeError, GROUP_COO, group_coo(B=meta(9, 5, 1)), "B", "rank 3", "(9, 5, 1)", "2 indices")


def test_rank_mismatch_of_an_index_tensor():
    _raises(InsumShapeError, GROUP_COO, group_coo(AK=idx(18)), "AK", "rank 1", "2 indices")


def test_rank_mismatch_of_the_output():
    _raises(InsumShapeError, GROUP_COO, group_coo(C=meta(7, 5, 2)), "C", "rank 3", "2 indices")


def test_rank_mismatch_of_a_scalar():
    _raises(InsumShapeError, "S = s * X[i]", {"s": meta(1), "X": meta(4)}, "s", "rank 1", "0 indices")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool, torch.uint8, torch.int16])
def test_index_tensor_must_be_int32_or_int64(dtype):
    _raises(InsumTypeError, GROUP_COO, group_coo(AK=idx(6, 3, dtype=dtype)), "AK", str(dtype), "int32")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_value_tensor_must_be_float(dtype):
    _raises(InsumTypeError, GROUP_COO, group_coo(AV=meta(6, 3, dtype=dtype)), "AV", str(dtype))


def test_output_must_be_float():
    _raises(InsumTypeError, GROUP_COO, group_coo(C=meta(7, 5, dtype=torch.int64)), "C", "torch.int64")


def test_not_a_tensor():
    _raises(InsumTypeError, GROUP_COO, group_coo(B=[[1.0] * 5] * 9), "B", "torch.Tensor", "list")


def test_tensor_used_as_index_and_factor():
    _raises(InsumTypeError, "C[AM[p], n] += AM[p] * B[AM[p], n]", {"C": meta(7, 5), "AM": idx(6), "B": meta(9, 5)}, "AM", "both")


def test_extent_conflict_between_factors_names_both_sides():
    message = _raises(InsumShapeError, GROUP_COO, group_coo(AV=meta(6, 4)), "'q'", "AK dimension 1", "AV dimension 1", "3", "4")
    assert "3" in message and "4" in message


def test_extent_conflict_with_the_output():
    _raises(InsumShapeError, GROUP_COO, group_coo(C=meta(7, 4)), "'n'", "B dimension 1", "C dimension 1", "5", "4")


def test_extent_conflict_inside_an_index():
    _raises(InsumShapeError, GROUP_COO, group_coo(AM=idx(5)), "'p'", "AM dimension 0", "5", "6")


def test_extent_conflict_within_one_tensor():
    _raises(InsumShapeError, "O[i] += A[i, i]", {"A": meta(3, 4)}, "'i'", "A dimension 0", "A dimension 1", "3", "4")


def test_output_aliasing_by_name():
    _raises(InsumError, "C[AM[p], n] += AV[p] * C[AK[p], n]", {"C": meta(7, 5), "AM": idx(6), "AK": idx(6), "AV": meta(6)}, "output C", "input")


def test_output_aliasing_as_an_index():
    _raises(InsumError, "C[i] += X[C[i]]", {"X": meta(4)}, "output C", "input")


def test_output_aliasing_by_memory():
    B = torch.randn(9, 5)
    tensors = {"C": B[:7], "AM": torch.zeros(6, dtype=torch.int64), "AK": torch.zeros(6, 3, dtype=torch.int64), "AV": torch.randn(6, 3), "B": B}
    _raises(InsumError, GROUP_COO, tensors, "output C", "shares memory", "B")


def test_output_aliasing_a_view_of_an_index_tensor_memory():
    buffer = torch.zeros(7 * 5 + 6)
    tensors = {"C": buffer[:35].view(7, 5), "AM": torch.zeros(6, dtype=torch.int64), "AK": torch.zeros(6, 3, dtype=torch.int64), "AV": buffer[35:].view(6, 1).expand(6, 3), "B": torch.randn(9, 5)}
    _raises(InsumError, GROUP_COO, tensors, "output C", "shares memory", "AV")


def test_separate_tensors_do_not_alias():
    tensors = {"C": torch.zeros(7, 5), "AM": torch.zeros(6, dtype=torch.int64), "AK": torch.zeros(6, 3, dtype=torch.int64), "AV": torch.randn(6, 3), "B": torch.randn(9, 5)}
    bind(parse(GROUP_COO), tensors)


def test_uninferable_extent():
    _raises(InsumShapeError, "C[k] += X[2*i]", {"C": meta(3), "X": meta(8)}, "'i'", "cannot infer")


def test_uninferable_extent_asks_for_the_output():
    _raises(InsumShapeError, "Y[i] += X[i + 3 - t] * K[t]", {"X": meta(13), "K": meta(4)}, "'i'", "pass the output")


@pytest.mark.parametrize(
    "text, tensors",
    [
        (GROUP_COO, {"AM": idx(6), "AK": idx(6, 3), "AV": meta(6, 3), "B": meta(9, 5)}),
        ("S[SEG[i], d] += X[i, d]", {"SEG": idx(11), "X": meta(11, 6)}),
        ("C[AM[p]*4 + m, n] += AV[p, m] * B[p, n]", {"AM": idx(5), "AV": meta(5, 4), "B": meta(5, 3)}),
        ("C[0, n] += B[n]", {"B": meta(3)}),
    ],
    ids=["indirect", "scatter_only", "affine", "literal"],
)
def test_output_shape_that_does_not_follow_must_be_passed(text, tensors):
    out = parse(text).output.name
    _raises(InsumError, text, tensors, f"pass {out}=", "does not follow")


def test_devices_must_agree():
    tensors = {"C": torch.zeros(7, 5), "AM": torch.zeros(6, dtype=torch.int64), "AK": torch.zeros(6, 3, dtype=torch.int64), "AV": torch.randn(6, 3), "B": meta(9, 5)}
    _raises(InsumTypeError, GROUP_COO, tensors, "different devices", "B on meta", "C on cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_devices_must_agree_cuda():
    tensors = {"C": torch.zeros(7, 5), "AM": torch.zeros(6, dtype=torch.int64), "AK": torch.zeros(6, 3, dtype=torch.int64), "AV": torch.randn(6, 3), "B": torch.randn(9, 5, device="cuda")}
    _raises(InsumTypeError, GROUP_COO, tensors, "different devices", "B on cuda")


def test_every_error_is_a_value_error():
    for cls in (InsumError, InsumShapeError, InsumTypeError):
        assert issubclass(cls, InsumError) and issubclass(cls, ValueError)


def test_per_tensor_cache_holds_values_per_object_and_drops_them_with_it():
    """`PerTensor` (the lengths' orders and counts kept per tensor): a value per tensor
    object, not per equal tensor; gone when its tensor dies, also where a new tensor reuses
    the dead one's id()."""
    import gc

    from insum.bind import PerTensor, kept_per_version

    cache = PerTensor()
    a, b = torch.zeros(3), torch.zeros(3)
    cache[a] = "a"
    assert cache.get(a) == "a" and cache.get(b) is None
    cache[b] = "b"
    cache[a] = "a2"  # replaced: the old entry's reference no longer drops the new one
    assert (cache.get(a), cache.get(b), len(cache)) == ("a2", "b", 2)
    del a
    gc.collect()
    assert len(cache) == 1 and cache.get(b) == "b"
    calls = []
    counts = torch.tensor([3, 1, 2])
    first = kept_per_version(cache, counts, (), lambda: calls.append(1) or counts.argsort())
    assert kept_per_version(cache, counts, (), lambda: calls.append(1)) is first and len(calls) == 1
    counts[0] = 0  # an in-place change: computed again
    assert kept_per_version(cache, counts, (), lambda: calls.append(1) or "new") == "new" and len(calls) == 2


def test_sparse_layout_tensors_are_refused_by_name():
    """Found by fuzzing: a torch sparse tensor given as a factor failed inside torch (an
    aten op or a storage access without a sparse kernel)."""
    A = torch.randn(3, 4).to_sparse()
    for layout in (A, A.to_sparse_csr()):
        with pytest.raises(InsumTypeError, match="layout torch.sparse.*insum.formats"):
            bind(parse("C[m, n] += A[m, k] * B[k, n]"), {"A": layout, "B": torch.randn(4, 5)})
