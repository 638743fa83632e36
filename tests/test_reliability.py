"""Issue 15: no silent wrong answers, no memory corruption, one error type.

One test (or table row) per failure the issue lists, each of which failed before its fix;
the statements of items 1 and 2 are the issue's repros verbatim. The generated kernels run
in the interpreter here (TRITON_INTERPRET=1) and compiled on a GPU.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from statements import CASES, build, clone, tolerance

import insum
from insum import (
    InsumError,
    InsumIndexError,
    InsumShapeError,
    InsumSyntaxError,
    InsumTypeError,
    UnsupportedStatement,
)
from insum.formats import CELL, COO, ELL, NM, BlockGroupCOO, GroupCOO
from insum.formats import auto as formats_auto

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_kernels = pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------- 1. affine addressing


@needs_kernels
def test_affine_gather_index_is_parenthesised():
    out = insum.insum(
        "O[i] += A[i + j, 0] * E[j]",
        A=torch.arange(20.).reshape(5, 4).to(DEVICE), E=torch.ones(2, device=DEVICE), O=torch.zeros(4, device=DEVICE),
        backend="triton",
    )
    assert out.tolist() == [4.0, 12.0, 20.0, 28.0]


@needs_kernels
def test_affine_scatter_index_is_parenthesised():
    A1 = torch.tensor([1.0, 2.0, 3.0, 4.0], device=DEVICE)
    E = torch.tensor([10.0, 100.0], device=DEVICE)
    out = torch.zeros(5, 3, device=DEVICE)
    insum.insum("O[i + j, 0] += A1[i] * E[j]", A1=A1, E=E, O=out, backend="triton")
    expected = torch.zeros(5, 3)
    for i in range(4):
        for j in range(2):
            expected[i + j, 0] += A1[i].item() * E[j].item()
    assert torch.equal(out.cpu(), expected)


@needs_kernels
def test_every_compound_index_is_parenthesised_in_the_source():
    tensors = {"A": torch.zeros(5, 4, device=DEVICE), "E": torch.ones(2, device=DEVICE), "O": torch.zeros(4, device=DEVICE)}
    source = insum.explain("O[i] += A[i + j, 0] * E[j]", **tensors)
    (pointer,) = [line for line in source.splitlines() if "A_ptr +" in line]
    assert re.search(r"\(offs_\w+(\[.*?\])? \+ \w+(\[.*?\])?\) \* stride_A_0", pointer), pointer


@pytest.mark.parametrize("stmt", ["O[0] += X[2, i + j] * Y[j] * Z[i]", "O[i + j, 1] += X[i] * Y[j]", "O[] += X[3]"])
def test_wide_addressing_of_compound_and_literal_indices_parses(stmt):
    import dataclasses

    from insum.bind import bind
    from insum.codegen import emit, schedule
    from insum.parser import parse
    from insum.runtime import spec_for

    tensors = {"X": torch.ones(4, 6), "Y": torch.ones(3), "Z": torch.ones(4), "O": torch.zeros(2)}
    if stmt.startswith("O[] "):
        tensors = {"X": torch.ones(4), "O": torch.zeros(())}
    elif stmt.startswith("O[i"):
        tensors = {"X": torch.ones(4), "Y": torch.ones(3), "O": torch.zeros(6, 2)}
    spec = spec_for(bind(parse(stmt), tensors))
    spec = dataclasses.replace(spec, wide=frozenset(tensors))  # as for tensors past 2**31 elements
    source = emit(schedule(spec)).text
    compile(source, "<insum>", "exec")  # `(2).to(tl.int64)`, never `2.to(...)`
    assert ".to(tl.int64)" in source


# ------------------------------------------------------------- 2. statements without variables


@needs_kernels
@pytest.mark.parametrize(
    "stmt, tensors, expected",
    [
        ("O[] += S[] * T[]", {"S": torch.tensor(2.0), "T": torch.tensor(3.0), "O": torch.tensor(1.0)}, 7.0),
        ("O[1] = 0.5", {"O": torch.full((3,), 9.0)}, [0.0, 0.5, 0.0]),
        ("O[0] += X[2]", {"X": torch.tensor([1.0, 2.0, 3.0]), "O": torch.tensor([1.0, 1.0])}, [4.0, 1.0]),
    ],
    ids=["scalars", "literal_only", "literal_indices"],
)
def test_statement_without_variables(stmt, tensors, expected):
    tensors = {n: t.to(DEVICE) for n, t in tensors.items()}
    out = insum.insum(stmt, backend="triton", **tensors)
    assert out.cpu().tolist() == expected
    assert "def insum_kernel(" in insum.explain(stmt, **tensors)  # explain works after it


def test_a_kernel_that_does_not_load_leaves_no_module(tmp_path):
    from insum.runtime import _load

    with pytest.raises(UnsupportedStatement, match="does not load"):
        _load(tmp_path / "broken.py", "def insum_kernel(:\n", "0123456789abcdef")
    assert "insum_generated_0123456789abcdef" not in sys.modules


# ------------------------------------------------------------- 3. a variable without extent


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_cancelled_variable_is_an_error(backend):
    with pytest.raises(InsumSyntaxError, match="variable 'i' cancels out"):
        insum.insum("O[0] += A[i - i]", A=torch.ones(3), O=torch.zeros(2), backend=backend)


# ------------------------------------------------------------- 4. bf16 on the interpreter


@needs_kernels
def test_bf16_dense_matmul():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(32, 32, generator=g).bfloat16().to(DEVICE)
    B = torch.randn(32, 32, generator=g).bfloat16().to(DEVICE)
    C = insum.insum("C[m,n] += A[m,k]*B[k,n]", A=A, B=B, backend="triton")
    ref = A.double() @ B.double()
    assert ((C.double() - ref).norm() / ref.norm()).item() < 1e-2


@needs_kernels
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bf16_curated_statements(c):
    tensors = build(c, seed=3, dtype=torch.bfloat16, device=DEVICE)
    expected = insum.insum(c.stmt, backend="torch", **clone(tensors))
    actual = insum.insum(c.stmt, backend="triton", **clone(tensors))
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("fmt", ["BlockGroupCOO", "NM"])
def test_bf16_formats(fmt):
    g = torch.Generator().manual_seed(1)
    A = torch.randn(64, 64, generator=g) * (torch.rand(64, 64, generator=g) < 0.3)
    B = torch.randn(64, 16, generator=g).bfloat16().to(DEVICE)
    A = A.bfloat16().to(DEVICE)  # bf16 values and B: a bf16 tl.dot
    packed = BlockGroupCOO.from_dense(A, block=(16, 16)) if fmt == "BlockGroupCOO" else NM.from_dense(A)
    C = packed.spmm(B, backend="triton")
    ref = packed.to_dense().double() @ B.double()
    assert ((C.double() - ref).norm() / ref.norm()).item() < 2e-2


@needs_kernels
def test_bf16_sparse_linear_block_group_coo():
    from insum.nn import SparseLinear

    torch.manual_seed(0)
    layer = SparseLinear(64, 48, format="BlockGroupCOO", sparsity=0.5, backend="triton", device=DEVICE)
    layer = layer.to(torch.bfloat16)
    x = torch.randn(20, 64, device=DEVICE).bfloat16()
    with torch.no_grad():
        y = layer(x)
        ref = x.double() @ layer.to_dense().double().T + layer.bias.double()
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-2


# ------------------------------------------------------------- 5. out-of-range indices


def _spmm_inputs():
    B = torch.randn(6, 3, device=DEVICE)
    return B, torch.tensor([0, 5, 2], device=DEVICE)


@needs_kernels
@pytest.mark.parametrize("bad, where", [(6, "B dimension 0"), (10**6, "B dimension 0")], ids=["rows", "huge"])
def test_bad_gather_index_raises_with_check(bad, where):
    if CUDA:
        pytest.skip("on CUDA a bad index is a device-side assert (benchmarks.study_index_check)")
    B, AK = _spmm_inputs()
    AK[1] = bad
    C = torch.full((3, 3), 7.0)
    with pytest.raises(InsumIndexError, match=f"AK holds {bad}, out of range for {where}"):
        insum.insum("C[p,n] += B[AK[p],n]", B=B, AK=AK, C=C, backend="triton", check_indices=True)
    assert torch.equal(C, torch.full((3, 3), 7.0))  # nothing written


@needs_kernels
def test_bad_scatter_index_raises_with_env(monkeypatch):
    if CUDA:
        pytest.skip("on CUDA a bad index is a device-side assert (benchmarks.study_index_check)")
    monkeypatch.setenv("INSUM_CHECK_INDICES", "1")
    AM = torch.tensor([0, 1, 4])
    with pytest.raises(InsumIndexError, match="AM holds 4, out of range for C dimension 0"):
        insum.insum("C[AM[p],n] += X[p,n]", X=torch.ones(3, 2), AM=AM, C=torch.zeros(4, 2), backend="triton")


@needs_kernels
def test_negative_declared_length_raises_with_check():
    """A negative declared length ran as zero, silently: with the index check it raises (and
    a length above its extent is clamped, as documented)."""
    if CUDA:
        pytest.skip("on CUDA a bad index is a device-side assert (benchmarks.study_index_check)")
    AV, AK, B = torch.randn(4, 3), torch.randint(0, 6, (4, 3)), torch.randn(6, 2)
    stmt = "C[p,n] += AV[p,q]*B[AK[p,q],n]"
    with pytest.raises(InsumIndexError, match="a declared length holds -1, out of range for lengths of 'q'"):
        insum.insum(stmt, AV=AV, AK=AK, B=B, lengths={"q[p]": torch.tensor([1, -1, 3, 2])}, backend="triton",
                    check_indices=True)
    clamped = insum.insum(stmt, AV=AV, AK=AK, B=B, lengths={"q[p]": torch.tensor([9, 3, 3, 3])}, backend="triton",
                          check_indices=True)
    torch.testing.assert_close(clamped, insum.insum(stmt, AV=AV, AK=AK, B=B, backend="torch"))


@needs_kernels
@pytest.mark.parametrize(
    "stmt, tensors, message",
    [
        ("O[i] += A[i + j, 0] * E[j]", {"A": torch.ones(4, 4), "E": torch.ones(2), "O": torch.zeros(4)},
         "index 4 out of range for A dimension 0"),
        ("O[0] += X[3]", {"X": torch.ones(3), "O": torch.zeros(1)}, "index 3 out of range for X dimension 0"),
        ("O[i + 1] += X[i]", {"X": torch.ones(3), "O": torch.zeros(3)}, "index 3 out of range for O dimension 0"),
    ],
    ids=["affine", "literal", "affine_output"],
)
def test_indices_the_statement_decides_are_always_checked(stmt, tensors, message):
    tensors = {n: t.to(DEVICE) for n, t in tensors.items()}
    with pytest.raises(InsumIndexError, match=re.escape(message)):
        insum.insum(stmt, backend="triton", **tensors)


@needs_kernels
@pytest.mark.parametrize(
    "stmt, AK, ok",
    [
        ("C[p] += B[AK[p]*2 + 1, 0]", [0, 2], True),  # 2*2 + 1 = 5 < 6
        ("C[p] += B[AK[p]*2 + 1, 0]", [0, 3], False),  # 7
        ("C[p] += B[AK[p] + p, 0]", [5, 4, 3], True),  # shares p: evaluated exactly (max 5)
        ("C[p] += B[AK[p] + p, 0]", [5, 5, 3], False),  # 6
        ("C[p] += B[AK[AK[p]], 0]", [2, 0, 1], True),
        ("C[p] += B[-AK[p] + 5, 0]", [0, 5], True),
        ("C[p] += B[-AK[p] + 5, 0]", [6, 0], False),
    ],
)
def test_check_is_exact(stmt, AK, ok):
    B = torch.randn(6, 2, device=DEVICE)
    AK = torch.tensor(AK, device=DEVICE)
    if CUDA and not ok:
        pytest.skip("a device-side assert ends the CUDA context")
    if ok:
        insum.insum(stmt, B=B, AK=AK, backend="triton", check_indices=True)
    else:
        with pytest.raises(InsumIndexError):
            insum.insum(stmt, B=B, AK=AK, backend="triton", check_indices=True)


# ------------------------------------------------------------- 6. kernel reuse across extents


@needs_kernels
def test_compiled_kernel_accepts_other_extents():
    stmt = "C[AM[p], n] += AV[p, q] * B[AK[p, q], n]"
    g = torch.Generator().manual_seed(0)

    def tensors(groups):
        return {
            "AM": torch.randint(0, 70, (groups,), generator=g).to(DEVICE),
            "AK": torch.randint(0, 50, (groups, 3), generator=g).to(DEVICE),
            "AV": torch.randn(groups, 3, generator=g).half().to(DEVICE),
            "B": torch.randn(50, 70, generator=g).half().to(DEVICE),
            "C": torch.zeros(70, 70, device=DEVICE),
        }

    kernel = insum.compile(stmt, **tensors(40))  # narrow: p below 64
    big = tensors(64)
    expected = insum.insum(stmt, backend="torch", **clone(big))
    actual = kernel(**clone(big))
    torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)


@needs_kernels
def test_compiled_kernel_names_the_dtype_that_differs():
    A, B = torch.randn(4, 3, device=DEVICE), torch.randn(3, 5, device=DEVICE)
    kernel = insum.compile("C[m,n] += A[m,k]*B[k,n]", A=A, B=B)
    with pytest.raises(InsumTypeError, match="B is fp64, compiled for fp32"):
        kernel(A=A, B=B.double())


# ------------------------------------------------------------- 8. caches hold no tensors


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_no_cache_keeps_inputs_alive(backend):
    W = torch.randn(8, 8, device=DEVICE)
    for _ in range(2):  # the second call takes the cached binding and launcher
        X = torch.randn(100, 8, device=DEVICE)
        ref = weakref.ref(X)
        out = insum.insum("O[i,n] = X[i,k]*W[k,n]", X=X, W=W, backend=backend)
        out_ref = weakref.ref(out)
        del X, out
        gc.collect()
        assert ref() is None and out_ref() is None


@needs_kernels
def test_compiled_kernel_keeps_no_inputs_alive():
    W = torch.randn(8, 8, device=DEVICE)
    X = torch.randn(100, 8, device=DEVICE)
    kernel = insum.compile("O[i,n] = X[i,k]*W[k,n]", X=X, W=W)
    kernel(X=X, W=W)
    ref = weakref.ref(X)
    del X
    gc.collect()
    assert ref() is None


# ------------------------------------------------------------- 9. autotune per call


@needs_kernels
def test_autotune_per_call_reaches_the_first_launch(monkeypatch):
    from insum.runtime import Kernel

    seen = []
    original = Kernel._first_config

    def spy(self, bucket, args, launcher, device, autotune):
        seen.append(autotune)
        return original(self, bucket, args, launcher, device, autotune)

    monkeypatch.setattr(Kernel, "_first_config", spy)
    X = torch.randn(37, 11, device=DEVICE)  # a size no other test uses: a new launch
    insum.insum("O[i] = X[i,k]*0.25", X=X, backend="triton", autotune=False)
    assert seen == [False]
    assert insum.compile("O[i] = X[i,k]*0.5", X=X, autotune=False).autotune is False


def test_autotune_setting_is_read_per_call(monkeypatch):
    from insum.runtime import _tuning_enabled

    monkeypatch.setenv("INSUM_AUTOTUNE", "1")
    assert _tuning_enabled(None) and not _tuning_enabled(False)
    monkeypatch.setenv("INSUM_AUTOTUNE", "0")
    assert not _tuning_enabled(None) and _tuning_enabled(True)


# ------------------------------------------------------------- 7, 10. one error type, the right message


def _meta(*shape):
    return torch.empty(*shape, device="meta")


BAD_INPUTS = [
    # (id, call, error type, message pattern)
    ("syntax", lambda: insum.insum("C[p] + A[p]", A=torch.ones(2)), InsumSyntaxError, "expected '\\+=' or '='"),
    ("missing_tensor", lambda: insum.insum("C[i] += A[i]*B[i]", A=torch.ones(2)), InsumError, "missing tensor.*B"),
    ("unused_tensor", lambda: insum.insum("C[i] += A[i]", A=torch.ones(2), Z=torch.ones(2)), InsumError, "unused tensor.*Z"),
    ("float_index", lambda: insum.insum("C[i] += A[I[i]]", A=torch.ones(2), I=torch.zeros(2)), InsumTypeError,
     "index tensor I has dtype torch.float32"),
    ("int_factor", lambda: insum.insum("C[i] += A[i]", A=torch.ones(2, dtype=torch.int64)), InsumTypeError,
     "tensor A has dtype torch.int64"),
    ("rank", lambda: insum.insum("C[i] += A[i, j]", A=torch.ones(2)), InsumShapeError, "A has rank 1"),
    ("extent", lambda: insum.insum("C[i] += A[i]*B[i]", A=torch.ones(2), B=torch.ones(3)), InsumShapeError,
     "extent of variable 'i' is 2 from A dimension 0 but 3 from B"),
    ("cancelled_variable", lambda: insum.insum("O[0] += A[i - i]", A=torch.ones(2), O=torch.zeros(1)),
     InsumSyntaxError, "variable 'i' cancels out"),
    ("stride0_output_torch", lambda: insum.insum("O[i, j] = A[i]", A=torch.ones(3), O=torch.zeros(1, 2).expand(3, 2),
     backend="torch"), InsumShapeError, "the output O has stride 0 in dimension 0"),
    ("stride0_output_auto", lambda: insum.insum("O[i] += A[i, j]", A=torch.ones(3, 2), O=torch.zeros(1).expand(3)),
     InsumShapeError, "the output O has stride 0"),
    ("overlapping_output", lambda: insum.insum("C[i, j] += A[i, j]", A=torch.ones(3, 2),
     C=torch.zeros(4).as_strided((3, 2), (1, 1))), InsumShapeError, "has elements that share memory"),
    ("overlapping_output_torch", lambda: insum.insum("C[i, j] = A[i, j]", A=torch.ones(3, 2),
     C=torch.zeros(4).as_strided((3, 2), (1, 1)), backend="torch"), InsumShapeError, "share memory"),
    ("meta_tensors", lambda: insum.insum("C[i] += A[I[i]]", A=_meta(3), I=torch.empty(2, dtype=torch.int64, device="meta"),
     backend="torch"), InsumTypeError, "meta device"),
    ("index_out_of_range_torch", lambda: insum.insum("C[i] += A[I[i]]", A=torch.ones(3), I=torch.tensor([0, 3]),
     backend="torch"), InsumIndexError, "index 3 out of range for A dimension 0 of size 3"),
    ("tensor_named_backend", lambda: insum.insum("C[i] += backend[i]", backend=torch.ones(2)), InsumError,
     "'backend' is an option of insum\\(\\)"),
    ("tensor_named_precision", lambda: insum.insum("C[i] += precision[i] * A[i]", precision=torch.ones(2), A=torch.ones(2)),
     InsumError, "'precision' is an option"),
    ("option_name_in_statement", lambda: insum.insum("C[i] += autotune[i]", A=torch.ones(2)), InsumError,
     "tensor name 'autotune' in 'C\\[i\\] \\+= autotune\\[i\\]' is an option"),
    ("unknown_backend", lambda: insum.insum("C[i] += A[i]", A=torch.ones(2), backend="cuda"), InsumError,
     "unknown backend 'cuda'"),
    ("bad_autotune", lambda: insum.insum("C[i] += A[i]", A=torch.ones(2), autotune="yes"), InsumError,
     "autotune must be True, False or None"),
    # Found by fuzzing: tensors passed as lengths/facts failed in the cached-call lookup
    # ("Boolean value of Tensor is ambiguous") or were ignored; a tensor named like an option
    # in insum_many clashed with the keyword.
    ("lengths_a_tensor", lambda: insum.insum("C[m] += A[m, q]", A=torch.ones(2, 3), lengths=torch.tensor([1, 2])),
     InsumTypeError, "lengths is a dict"),
    ("lengths_pairs", lambda: insum.insum("C[m] += A[m, q]", A=torch.ones(2, 3), lengths=[("q[m]", torch.ones(2))]),
     InsumTypeError, "lengths is a dict"),
    ("facts_a_tensor", lambda: insum.insum("C[m] += A[I[m]]", A=torch.ones(2), I=torch.zeros(2, dtype=torch.long),
                                           sorted_indices=torch.zeros(2)), InsumTypeError, "sorted_indices names"),
    ("many_option_named_tensor", lambda: insum.insum_many([("C[m] += backend[m]", dict(C=torch.zeros(2),
                                                                                      backend=torch.ones(2)))]),
     InsumError, "tensor named 'backend'"),
    ("auto_bad_measure", lambda: formats_auto(torch.eye(3), measure="no"),
     InsumTypeError, "measure must be True, False or None"),
    ("nm_unknown_keyword", lambda: NM.from_dense(torch.randn(4, 8), bogus=3), InsumError,
     "unknown parameter\\(s\\) 'bogus' for NM.from_dense"),
    ("groupcoo_unknown_keyword", lambda: GroupCOO.from_dense(torch.randn(4, 8), bogus=3), InsumError,
     "unknown parameter\\(s\\) 'bogus' for GroupCOO"),
    ("int_dense_operand", lambda: GroupCOO.from_dense(torch.randn(4, 8)) @ torch.ones(8, 3, dtype=torch.int64),
     InsumTypeError, "the dense operand B of GroupCOO @ B has dtype torch.int64"),
]


@pytest.mark.parametrize("call, error, message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_table(call, error, message):
    with pytest.raises(error, match=message) as info:
        call()
    assert isinstance(info.value, InsumError)


def test_unsupported_statement_is_exported_and_an_insum_error():
    from insum.runtime import UnsupportedStatement as from_runtime

    assert insum.UnsupportedStatement is from_runtime and issubclass(insum.UnsupportedStatement, InsumError)
    assert "UnsupportedStatement" in insum.__all__


def test_cell_packs_a_matrix_without_rows():
    fmt = CELL.from_dense(torch.zeros(0, 10))
    assert fmt.shape == (0, 10)
    assert (fmt @ torch.ones(10, 3)).shape == (0, 3)


@pytest.mark.skipif(CUDA, reason="CUDA present")
def test_kernel_on_cpu_without_the_interpreter(monkeypatch):
    A, B = torch.randn(4, 3), torch.randn(3, 5)
    kernel = insum.compile("C[m,n] += A[m,k]*B[k,n]", A=A, B=B)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UnsupportedStatement, match="needs a CUDA device or TRITON_INTERPRET=1"):
        kernel(A=A, B=B)


_LATE_INTERPRET = """
import os, torch, insum
os.environ["TRITON_INTERPRET"] = "1"
try:
    insum.insum("C[m] += A[m,k]", A=torch.ones(3, 2), backend="triton")
except insum.UnsupportedStatement as e:
    print("UNSUPPORTED", e)
"""


@pytest.mark.skipif(CUDA, reason="CUDA present: the interpreter would not be asked for")
def test_interpreter_set_after_import_has_a_clear_message():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _LATE_INTERPRET], capture_output=True, text=True, env=env, timeout=120)
    assert "UNSUPPORTED TRITON_INTERPRET is '1' now, but triton was imported without it" in run.stdout, run.stderr


def test_readme_syntax_error_sample_is_the_real_message():
    readme = (ROOT / "README.md").read_text()
    sample = re.search(r"```\n\s*(insum\.errors\.InsumSyntaxError: .*?)\n\s*```", readme, re.S).group(1)
    with pytest.raises(InsumSyntaxError) as info:
        insum.parse("C[p] + A[p]")
    shown = f"insum.errors.InsumSyntaxError: {info.value}"
    assert [line.strip() for line in sample.splitlines()] == [line.strip() for line in shown.splitlines()]


# ------------------------------------------------------------- 5. formats: in range by construction


@pytest.mark.parametrize("name", ["COO", "GroupCOO", "ELL", "BlockGroupCOO", "NM"])
def test_packed_formats_pass_the_index_check(name):
    from insum import formats
    from insum.bind import bind
    from insum.bounds import check_indices
    from insum.formats.base import overwrite
    from insum.parser import parse

    g = torch.Generator().manual_seed(2)
    A = torch.randn(45, 38, generator=g) * (torch.rand(45, 38, generator=g) < 0.2)
    fmt = getattr(formats, name).from_dense(A)
    B = torch.randn(38, 5, generator=g)
    out = torch.empty(45, 5)
    tensors = {**fmt.tensors, "B": B, "C": out}
    if name in ("BlockGroupCOO", "NM"):  # blocked views of B and C: let the format build them
        seen = []
        monkey = pytest.MonkeyPatch()
        monkey.setattr("insum.formats.base.insum", lambda expr, **kw: seen.append((expr, kw)) or kw.get("C"))
        try:
            fmt.spmm(B, backend="torch")
        finally:
            monkey.undo()
        expr, kw = seen[0]
        from insum.api import OPTIONS

        tensors = {k: v for k, v in kw.items() if k not in OPTIONS}
    else:
        expr = overwrite(fmt.expression)
    bound = bind(parse(expr), tensors)
    check_indices(bound, bound.output(), device_check=True)  # raises InsumIndexError if not


def test_formats_skip_the_check_and_raw_calls_take_it(monkeypatch):
    import insum.bounds

    calls = []
    monkeypatch.setattr(insum.bounds, "_check_range", lambda *a, **k: calls.append(a[3]))
    monkeypatch.setenv("INSUM_CHECK_INDICES", "1")
    if not (CUDA or INTERPRET):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    fmt = GroupCOO.from_dense(torch.randn(6, 5).to(DEVICE))
    fmt.spmm(torch.randn(5, 3, device=DEVICE), backend="triton")
    assert calls == []
    insum.insum(fmt.expression, backend="triton", B=torch.randn(5, 3, device=DEVICE),
                C=torch.zeros(6, 3, device=DEVICE), **fmt.tensors)
    assert sorted(calls) == ["AK", "AM"]


# ------------------------------------------------------------- found by fuzzing (session 20)


@needs_kernels
def test_interleaved_output_strides_are_accepted():
    """Strides that interleave without sharing an element (as_strided (3, 2), (2, 3)) pass
    the overlap check, which counts addresses when the stride order cannot prove it."""
    base = torch.full((8,), float("nan"), device=DEVICE)
    C = base.as_strided((3, 2), (2, 3))
    A = torch.randn(3, 2, device=DEVICE)
    insum.insum("C[i, j] = A[i, j]", A=A, C=C)
    torch.testing.assert_close(C, A)
    assert torch.isnan(base[[1, 6]]).all()  # the addresses C does not cover stay untouched


@needs_kernels
def test_compiled_kernel_checks_affine_ranges():
    """A kernel from `insum.compile`, called on other extents, checks what the extents decide
    as `insum()` does (it read B[4] of a 4-element B before)."""
    k = insum.compile("C[i] = B[i + 1]", B=torch.randn(4, device=DEVICE), C=torch.zeros(3, device=DEVICE))
    B = torch.randn(4, device=DEVICE)
    torch.testing.assert_close(k(B=B, C=torch.zeros(3, device=DEVICE)), B[1:])
    with pytest.raises(InsumIndexError, match="index 4 out of range for B dimension 0"):
        k(B=B, C=torch.zeros(4, device=DEVICE))


@needs_kernels
@pytest.mark.parametrize("expr", ["C[i, n] = A[i, n]", "C[m, n] = A[m, k] * X[k, n]", "C[m, n] += A[m, k] * X[k, n]",
                                  "C[I[m], n] += A[m, k] * X[k, n]"])
def test_float64_factors_into_bf16(expr):
    """A float64 accumulator stored into a bf16 output goes through float32 (as torch rounds
    float64 to bf16); the interpreter's direct conversion wrote the float64 bits as tiny
    numbers. (The interpreter truncates float32 to bf16: within one bf16 step here.)"""
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(6, 5, dtype=torch.float64, generator=gen).to(DEVICE)
    X = torch.randn(5, 5, dtype=torch.float64, generator=gen).to(DEVICE)
    rows = torch.tensor([0, 2, 2, 1, 0, 3], device=DEVICE)
    tensors = {"A": A, "X": X, "I": rows}
    tensors = {n: t for n, t in tensors.items() if f"{n}[" in expr}
    start = torch.randn(4 if "I[" in expr else 6, 5, generator=gen).to(DEVICE)
    C = start.to(torch.bfloat16)
    expected = insum.insum(expr, backend="torch", C=C.double(), **tensors)
    insum.insum(expr, backend="triton", C=C, **tensors)
    torch.testing.assert_close(C.double(), expected, rtol=2e-2, atol=2e-2)


@needs_kernels
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_padding_past_declared_lengths_gets_no_gradient(backend):
    """Block-ELL's `fmt.spmm` differentiated through the format: the padding slots past AL,
    which the forward skips, had gradients (the derived statements run without the lengths),
    so an update made them nonzero and `to_dense()` disagreed with the product."""
    torch.manual_seed(0)
    A = torch.zeros(32, 16, device=DEVICE)
    A[16:] = torch.randn(16, 16, device=DEVICE)  # block row 0 empty: its one slot is padding
    fmt = BlockGroupCOO.from_dense(A, group_size="row")
    fmt.AV.requires_grad_()
    B = torch.randn(16, 3, device=DEVICE)
    y = fmt.spmm(B, backend=backend)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert fmt.AV.grad[0].abs().max() == 0
    tf32 = dict(rtol=1e-2, atol=1e-2)  # (fp32 products run in tf32 by default on a GPU)
    torch.testing.assert_close(fmt.AV.grad[1, 0], dy[16:] @ B.t(), **tf32)
    with torch.no_grad():
        fmt.AV.sub_(0.1 * fmt.AV.grad)
    torch.testing.assert_close(fmt.spmm(B, backend=backend), fmt.to_dense() @ B, **tf32)


@needs_kernels
def test_declared_lengths_zero_the_gradient_in_the_factors_own_order():
    """The length `q[p]` masks a factor indexed [q, p] (its dimensions in the other order)."""
    gen = torch.Generator().manual_seed(1)
    AV = torch.randn(3, 4, generator=gen).to(DEVICE).requires_grad_()  # AV[q, p]
    AK = torch.randint(0, 5, (3, 4), generator=gen).to(DEVICE)
    B = torch.randn(5, 2, generator=gen).to(DEVICE)
    AL = torch.tensor([3, 0, 1, 2], device=DEVICE)
    C = insum.insum("C[p, n] += AV[q, p] * B[AK[q, p], n]", AV=AV, AK=AK, B=B, C=torch.zeros(4, 2, device=DEVICE),
                    lengths={"q[p]": AL})
    dC = torch.randn(4, 2, generator=gen).to(DEVICE)
    C.backward(dC)
    past = torch.arange(3, device=DEVICE)[:, None] >= AL[None, :]
    assert (AV.grad[past] == 0).all()
    expected = (dC[None, :, :] * B[AK]).sum(-1)
    torch.testing.assert_close(AV.grad[~past], expected[~past], rtol=1e-2, atol=1e-2)


@needs_kernels
def test_layer_with_an_empty_cell_weight():
    """A CELL with no nonzeros packs no tensors: the layer read its dtype and device from
    them (a bare StopIteration); they are kept with the format's description now."""
    from insum.nn import SparseLinear

    layer = SparseLinear(21, 19, format="CELL", sparsity=1.0).to(DEVICE)
    x = torch.randn(5, 21, device=DEVICE, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, layer.bias.expand(5, 19))
    y.sum().backward()
    assert x.grad.abs().max() == 0
    assert layer.double()(x.double()).dtype == torch.float64
    bare = SparseLinear.from_dense(torch.zeros(4, 3, device=DEVICE), None, "CELL")
    assert (bare(torch.randn(2, 3, device=DEVICE)) == 0).all()


@needs_kernels
@pytest.mark.parametrize("name", ["COO", "GroupCOO", "ELL", "BlockGroupCOO"])
def test_empty_format_products_stay_in_the_graph(name):
    """A product over no entries was a fresh zeros tensor cut off from B's and the values'
    graphs: a loss on it alone could not backward, and B.grad stayed None."""
    from insum import formats

    fmt = getattr(formats, name).from_dense(torch.zeros(32, 16, device=DEVICE))
    for t in fmt.tensors.values():
        if t.is_floating_point():
            t.requires_grad_()
    B = torch.randn(16, 3, device=DEVICE, requires_grad=True)
    y = fmt.spmm(B, backend="triton")
    assert y.requires_grad and (y == 0).all()
    y.sum().backward()
    assert (B.grad == 0).all()
    assert all((t.grad == 0).all() for t in fmt.tensors.values() if t.is_floating_point())


@needs_kernels
@pytest.mark.parametrize("name", ["ELL", "NM"])
def test_layer_with_an_all_zero_weight_trains_no_padding(name):
    """An all-zero weight's product reads nothing; its padding slots (ELL's, N:M's) got the
    gradient of a product that read them, and an update made the layer's `to_dense()`
    disagree with its forward."""
    from insum.nn import SparseLinear

    layer = SparseLinear.from_dense(torch.zeros(4, 8, device=DEVICE), None, name, backend="triton")
    x = torch.randn(2, 8, device=DEVICE, requires_grad=True)
    layer(x).sum().backward()
    for p in layer.parameters():
        assert (p.grad == 0).all()
    assert (x.grad == 0).all()


@needs_kernels
def test_convolution_gradient_over_repeated_sites_raises():
    """Repeated sites all read the first copy's row (the forward, as documented); the input
    gradient's transpose cannot hold several outputs per (input, offset) and gave wrong
    gradients ([1, 1] where [101, 0] was right): it raises now."""
    from insum.nn import SparseConv3d

    for form in ("tiles", "pairs"):
        conv = SparseConv3d(1, 1, kernel_size=1, form=form, backend="triton", precision="ieee").to(DEVICE)
        with torch.no_grad():
            conv.weight.fill_(1.0)
        x = torch.tensor([[1.0], [10.0]], device=DEVICE, requires_grad=True)
        out, _ = conv(x, torch.tensor([[0, 0, 0], [0, 0, 0]], device=DEVICE))
        assert out.flatten().tolist() == [1.0, 1.0]
        with pytest.raises(InsumError, match="the sites repeat"):
            out.backward(torch.tensor([[1.0], [100.0]], device=DEVICE))


def test_convolution_sizes_must_be_positive():
    from insum.nn import SparseConv3d

    with pytest.raises(InsumError, match="SparseConv3d: kernel_size must be an integer >= 1, got 0"):
        SparseConv3d(5, 4, kernel_size=0)


# ------------------------------------------------------------- found by fuzzing (session 21)


def _outside_inputs() -> dict[str, torch.Tensor]:
    """Torch sparse tensors with an index outside their shape (torch checks them only on request)."""
    return {
        "coo-col": torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 1000]]), torch.tensor([1.0, 2.0]), (2, 4)),
        "coo-row": torch.sparse_coo_tensor(torch.tensor([[0, 7], [1, 1]]), torch.tensor([1.0, 2.0]), (2, 4)),
        "coo-negative": torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, -1]]), torch.tensor([1.0, 2.0]), (2, 4),
                                                check_invariants=False),
        "csr-col": torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([1, 9]), torch.tensor([1.0, 2.0]),
                                           (2, 4)),
    }


@pytest.mark.parametrize("name", ["coo-col", "coo-row", "coo-negative", "csr-col"])
@pytest.mark.parametrize("cls, params", [
    (COO, {}), (ELL, {}), (GroupCOO, {}), (CELL, {}), (NM, dict(n=1, m=2, vector_len=1)),
    (BlockGroupCOO, dict(block=(1, 2))), (BlockGroupCOO, dict(block=(1, 2), group_size="row")),
], ids=["COO", "ELL", "GroupCOO", "CELL", "NM", "BlockGroupCOO", "BlockELL"])
def test_sparse_tensor_with_an_index_outside_its_shape_raises(cls, params, name):
    """A torch sparse tensor with a column past K was packed as it was, and the product (which
    trusts packed indices) read B out of bounds; a row past M was dropped, or raised a bare
    IndexError. Packing now raises, from the packer's one sync."""
    with pytest.raises(InsumShapeError, match=r"index outside its shape \(2, 4\)"):
        cls.from_torch(_outside_inputs()[name], **params)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_format_pickles_after_its_products(backend):
    """A format that had run a product could not be pickled or `torch.save`d (its plans hold
    launchers, and a BoundedCache did not unpickle); a copy now drops what products built."""
    import io
    import pickle

    if backend == "triton" and not (CUDA or INTERPRET):
        pytest.skip("no generated kernels here")
    A = torch.tensor([[1.0, 0, 2], [0, 3, 0]], device=DEVICE)
    B = torch.randn(3, 4, device=DEVICE)
    fmt = ELL.from_dense(A)
    fmt.spmm(B, backend=backend)
    fmt.spmm(B, backend=backend)  # (pinned)
    copy = pickle.loads(pickle.dumps(fmt))
    assert "_spmm_plans" not in copy.__dict__
    torch.testing.assert_close(copy.spmm(B, backend=backend), A @ B)
    buffer = io.BytesIO()
    torch.save(fmt, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False).spmm(B, backend=backend), A @ B)


_LOADED = [(ELL, {}), (COO, {}), (GroupCOO, {"group_size": 2}), (CELL, {}), (NM, {"n": 2, "m": 4, "vector_len": 2}),
           (BlockGroupCOO, {"block": (2, 4)}), (BlockGroupCOO, {"block": (2, 4), "group_size": "row"})]


@pytest.mark.parametrize("bad", [10**6, -1])
@pytest.mark.parametrize("cls, params", _LOADED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_loaded_format_with_an_index_out_of_range_is_refused(cls, params, bad):
    """Found by fuzzing: a format read back from a file was taken as it was, and its products
    (which run without an index check) read and wrote out of bounds on the generated kernel
    (heap corruption in the interpreter). Reading one back now checks every index tensor
    against what it indexes, naming the tensor; a good file still loads."""
    import io

    gen = torch.Generator().manual_seed(5)
    A = (torch.randn(8, 12, generator=gen) * (torch.rand(8, 12, generator=gen) < 0.5)).to(DEVICE)
    B = torch.randn(12, 3, generator=gen).to(DEVICE)
    buffer = io.BytesIO()  # (on CUDA too: read back on the host, not a device assert that loses the context)
    torch.save(cls.from_dense(A, **params), buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    torch.testing.assert_close(loaded.spmm(B, backend="torch"), loaded.to_dense() @ B)
    for name, tensor in cls.from_dense(A, **params).packed_tensors.items():
        if tensor.is_floating_point() or not tensor.numel():
            continue
        fmt = cls.from_dense(A, **params)
        fmt.packed_tensors[name].view(-1)[0] = bad  # (a corrupted file's)
        buffer = io.BytesIO()
        torch.save(fmt, buffer)
        with pytest.raises(InsumIndexError, match="out of range"):
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


def test_a_layer_refuses_a_state_dict_with_an_index_out_of_range():
    """A corrupted state_dict's index raised bare torch errors from the transposed pattern's
    build, after the layer had taken the tensors; now it is refused first, naming the tensor,
    and the layer keeps its weight."""
    from insum.nn import SparseLinear

    W = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]])
    layer = SparseLinear.from_dense(W, None, "GroupCOO", backend="torch")
    state = layer.state_dict()
    with pytest.raises(RuntimeError, match=r"AK holds 102, out of range.*keeps its weight"):
        layer.load_state_dict({**state, "AK": state["AK"] + 100})
    torch.testing.assert_close(layer(torch.eye(3)), W.t())


def test_insum_many_takes_a_generator_of_calls():
    """Found by fuzzing: the argument check spent a generator, so nothing ran and a bare
    TypeError followed."""
    C = torch.zeros(3)
    calls = [("C[i] += A[i]", dict(C=C, A=torch.ones(3))), ("C[i] += A[i]", dict(C=C, A=torch.full((3,), 2.0)))]
    insum.insum_many((c for c in calls), backend="torch")
    torch.testing.assert_close(C, torch.full((3,), 3.0))


@pytest.mark.skipif(not (CUDA or INTERPRET), reason="the generated kernel")
def test_a_length_over_tiled_rows_masks_the_loop_past_each_row():
    """Found by fuzzing: where a declared length's variable is a loop (not the K tile) over
    tiled rows, the loop ran to the tile's longest row and every shorter row read its own
    padding up to there (NaN padding came out as NaN; the README says the lanes past a row's
    length are masked). Those loads are masked now."""
    nan = float("nan")
    AV = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=DEVICE)
    W = torch.tensor([[10.0, 20.0], [nan, nan]], device=DEVICE)
    got = insum.insum("O[p] = AV[p, q] * W[p, r]", AV=AV, W=W, lengths={"r[p]": torch.tensor([2, 0], device=DEVICE)},
                      backend="triton")
    torch.testing.assert_close(got, torch.tensor([90.0, 0.0], device=DEVICE))
    AV = torch.tensor([[[1.0, 2.0]], [[3.0, nan]]], device=DEVICE)
    AK = torch.zeros(2, 1, 2, dtype=torch.int64, device=DEVICE)
    got = insum.insum("C[m, n] = AV[m, q, r] * B[AK[m, q, r], n]", AV=AV, AK=AK, B=torch.ones(1, 3, device=DEVICE),
                      lengths={"r[m]": torch.tensor([2, 1], device=DEVICE)}, backend="triton")
    torch.testing.assert_close(got, torch.full((2, 3), 3.0, device=DEVICE))


def test_nm_from_mask_is_its_pattern_whatever_the_values():
    """Found by fuzzing: a mask packed over zeros was an empty format (nnz counted nonzero
    values), so values filled in afterwards were never read (zeros out, silently); and an
    inf outside the mask came out as nan (A * mask), where the docs say it is zeroed."""
    mask = torch.tensor([[1, 0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    fmt = NM.from_mask(torch.zeros(2, 8), mask, n=2, m=4, vector_len=1)
    values = torch.randn(fmt.AV.shape, generator=torch.Generator().manual_seed(3))
    fmt.AV.copy_(values)
    B = torch.randn(8, 3)
    torch.testing.assert_close(fmt.spmm(B, backend="torch"), fmt.to_dense() @ B)
    assert fmt.nnz == 8 and fmt.to_dense().count_nonzero() == 8
    A = torch.tensor([[1.0, 2, 3, 4], [float("inf"), 5, 6, 7]])
    kept = NM.from_mask(A, torch.tensor([[1, 0, 0, 1], [0, 0, 0, 1]]), n=2, m=4, vector_len=2)
    torch.testing.assert_close(kept.to_dense(), torch.tensor([[1.0, 0, 0, 4], [0, 0, 0, 7]]))


def test_output_over_an_input_buffer_of_another_storage_is_refused():
    """Found by fuzzing: two tensors over one buffer through different storages (from_numpy,
    frombuffer, DLPack) passed the aliasing check, which compared storage base pointers:
    the kernel's later programs read what earlier ones had written (15 wrong elements)."""
    buf = torch.arange(4097, dtype=torch.float32)
    B, C = buf[:-1], torch.from_numpy(buf.numpy()[1:])
    with pytest.raises(InsumError, match="shares memory"):
        insum.insum("C[i] += B[i]", C=C, B=B, backend="torch")
    apart = torch.from_numpy(torch.zeros(4096).numpy())
    insum.insum("C[i] += B[i]", C=apart, B=B, backend="torch")  # (its own buffer: runs)
    torch.testing.assert_close(apart, B)


def test_torch_backend_rounds_into_the_output_once():
    """Found by fuzzing: the torch lowering multiplied float64 factors in the output's float32
    (1e8 + 1 - 1e8 gave 0) and added a half output's old value after rounding the product
    into it (-60000 + 70000 overflowed to inf); the kernel does neither."""
    A = torch.tensor([[1e8 + 1.0, -1e8]], dtype=torch.float64)
    C = torch.zeros(1)
    insum.insum("C[i] += A[i, k] * B[k]", C=C, A=A, B=torch.ones(2, dtype=torch.float64), backend="torch")
    assert C.item() == 1.0
    h = torch.float16
    C = torch.full((1, 1), -60000.0, dtype=h)
    insum.insum("C[m, n] += A[m, k] * B[k, n]", C=C, A=torch.full((1, 1), 280.0, dtype=h),
                B=torch.full((1, 1), 250.0, dtype=h), backend="torch")
    assert C.item() == 10000.0


def _negative_view(rows: int, cols: int) -> torch.Tensor:
    """A float view with the negative bit set (its memory holds the values negated)."""
    view = torch.randn(rows, cols, dtype=torch.complex64, device=DEVICE).conj().imag
    assert view.is_neg()
    return view


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_negative_bit_views_are_refused_or_resolved(backend):
    """Found by fuzzing: a negative-bit view (z.conj().imag) ran on the generated kernel, which
    reads memory, with its values negated (error 3.07), also as a repeat of a plain call of the
    same strides. insum() refuses it by name; fmt @ B takes its values."""
    if backend == "triton" and not (CUDA or INTERPRET):
        pytest.skip("no generated kernels here")
    AV, AK = torch.randn(5, 2, device=DEVICE), torch.randint(0, 4, (5, 2), device=DEVICE)
    plain = torch.randn(4, 6, device=DEVICE)[:, ::2]  # the negative view's strides, (6, 2)
    B = _negative_view(4, 3)
    assert plain.stride() == B.stride()
    stmt = "C[p, n] += AV[p, q] * B[AK[p, q], n]"
    for _ in range(2):  # (and the prepared repeat)
        insum.insum(stmt, AV=AV, AK=AK, B=plain, backend=backend)
    with pytest.raises(InsumTypeError, match="negative-bit view"):
        insum.insum(stmt, AV=AV, AK=AK, B=B, backend=backend)
    fmt = ELL.from_dense((torch.randn(5, 4) * (torch.rand(5, 4) < 0.5)).to(DEVICE))
    for _ in range(3):
        fmt.spmm(plain, backend=backend)  # (pinned by the third call)
    torch.testing.assert_close(fmt.spmm(B, backend=backend), fmt.to_dense() @ B.resolve_neg())


def test_sparse_compressed_and_nested_tensors_are_refused_by_name():
    """Found by fuzzing: CSR/CSC and nested tensors failed in the cached-call lookup with bare
    RuntimeErrors (no strides, no sizes); COO had the named error."""
    A = torch.randn(2, 2)
    for B in (torch.randn(2, 3).to_sparse_csr(), torch.randn(2, 3).to_sparse_csc(),
              torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(2, 3)])):
        with pytest.raises(InsumTypeError, match="B (has layout|is a nested tensor)"):
            insum.insum("C[p, n] += A[p, q] * B[q, n]", A=A, B=B, backend="torch")
        with pytest.raises(InsumTypeError, match="B (has layout|is a nested tensor)"):
            insum.insum_many([("C[p, n] += A[p, q] * B[q, n]", dict(A=A, B=B, C=torch.zeros(2, 3)))], backend="torch")


def test_bounded_cache_pickles():
    import pickle

    from insum.cache import BoundedCache

    cache = BoundedCache(2)
    cache["a"], cache["b"], cache["c"] = 1, 2, 3
    again = pickle.loads(pickle.dumps(cache))
    assert again == {"b": 2, "c": 3} and again.limit == 2


@pytest.mark.parametrize("cls, params", [(ELL, {}), (BlockGroupCOO, dict(block=(2, 2), group_size="row")), (COO, {})],
                         ids=["ELL", "BlockELL", "COO"])
def test_matrix_without_columns_to_dense(cls, params):
    """A matrix with K = 0 packs padding at column 0, which it does not have: to_dense raised
    a bare IndexError (the product, which reads nothing, was right)."""
    fmt = cls.from_dense(torch.zeros(5, 0), **params)
    assert torch.equal(fmt.to_dense(), torch.zeros(5, 0))
    assert torch.equal(fmt @ torch.zeros(0, 3), torch.zeros(5, 3))


def test_format_to_a_dtype_raises_clearly():
    """`fmt.to(torch.float64)` took the dtype for a device and converted the index tensors first."""
    fmt = ELL.from_dense(torch.eye(3))
    with pytest.raises(InsumTypeError, match="moves a format to a device; torch.float64 is a dtype"):
        fmt.to(torch.float64)


@pytest.mark.skipif(not CUDA, reason="the race needs a GPU's concurrent programs (the CPU case: test_host_path)")
def test_chained_insum_many_repeats_stay_right_on_the_gpu():
    """Where a call reads another's output, every repeat runs them one by one (it raced as one
    launch: off by 17 from the second call on, on an H200)."""
    M, N = 1 << 16, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    I1 = torch.randint(0, M, (M,), device="cuda", generator=gen)
    I2 = torch.randint(0, M, (M,), device="cuda", generator=gen)
    A1, A2 = torch.randn(M, device="cuda", generator=gen), torch.randn(M, device="cuda", generator=gen)
    B = torch.randn(M, N, device="cuda", generator=gen)
    stmt = "C[I[p],n] += A[p]*B[p,n]"
    first = torch.zeros(M, N, dtype=torch.float64, device="cuda").index_add_(0, I1, A1.double()[:, None] * B.double())
    second = torch.zeros(M, N, dtype=torch.float64, device="cuda").index_add_(0, I2, A2.double()[:, None] * first)
    for _ in range(3):
        C1, C2 = torch.zeros(M, N, device="cuda"), torch.zeros(M, N, device="cuda")
        insum.insum_many([(stmt, dict(C=C1, I=I1, A=A1, B=B)), (stmt, dict(C=C2, I=I2, A=A2, B=C1))],
                         backend="triton")
        torch.testing.assert_close(C2.double(), second, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_generated_kernel_writes_bump_the_version_counter():
    """Found by fuzzing: the generated kernel wrote its output behind autograd's back, so a
    tensor that autograd had saved was read at backward with its new values (a silently wrong
    gradient); torch's own in-place ops make backward raise instead, and so do insum's now:
    `insum()` (first and repeated calls), `insum_many`'s one launch and `insum.compile`."""
    stmt = "C[i, j] += A[i, k] * B[k, j]"
    A, B = torch.ones(1, 1, device=DEVICE), torch.full((1, 2), 10.0, device=DEVICE)

    def saved_then_written(write):
        C = torch.tensor([[1.0, 2.0]], device=DEVICE)
        w = torch.ones(1, 2, device=DEVICE, requires_grad=True)
        z = (C * w).sum()  # saves C
        write(C)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.backward()

    for _ in range(3):  # the first call, then the prepared repeats
        saved_then_written(lambda C: insum.insum(stmt, C=C, A=A, B=B, backend="triton"))
    for _ in range(3):
        saved_then_written(lambda C: insum.insum_many([(stmt, dict(C=C, A=A, B=B)), (stmt, dict(C=C, A=A, B=B))],
                                                      backend="triton"))
    kernel = insum.compile(stmt, C=torch.zeros(1, 2, device=DEVICE), A=A, B=B)
    saved_then_written(lambda C: kernel(C=C, A=A, B=B))
    with torch.inference_mode():  # (inference tensors keep no version counter)
        C = torch.zeros(1, 2, device=DEVICE)
        insum.insum(stmt, C=C, A=A, B=B, backend="triton")
        torch.testing.assert_close(C, torch.full((1, 2), 10.0, device=DEVICE))
