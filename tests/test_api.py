"""The public entry points on the CPU: insum() (its output contract and options) and explain()."""

from __future__ import annotations

import pytest
import torch
from statements import CASES, build, case

import insum as insum_module
from insum import InsumError, InsumShapeError, InsumSyntaxError, explain, insum
from insum.api import BACKENDS, PRECISIONS

GROUP_COO = "C[AM[p], n] += AV[p, q] * B[AK[p, q], n]"


def group_coo_inputs(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return build(case("group_coo_spmm"), seed=0, dtype=dtype)


# ---------------------------------------------------------------- the output contract


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_returns_the_passed_output_itself(c, backend):
    tensors = build(c, seed=0)
    out = tensors[c.output]
    result = insum(c.stmt, backend=backend, **tensors)
    assert result is out


def test_passed_output_is_updated_in_place():
    tensors = group_coo_inputs()
    C = tensors["C"]
    ptr, before = C.data_ptr(), C.clone()
    insum(GROUP_COO, **tensors)
    assert C.data_ptr() == ptr and not torch.equal(C, before)


def test_allocated_output_starts_from_zero():
    c = case("ell_spmm")
    tensors = build(c, seed=0, with_output=False)
    accumulated = insum(c.stmt, **tensors)
    overwritten = insum(c.stmt.replace("+=", "="), C=torch.full_like(accumulated, 5.0), **tensors)
    torch.testing.assert_close(accumulated, overwritten)
    assert accumulated.shape == (7, 5) and accumulated.dtype == torch.float32
    assert accumulated.device.type == "cpu" and accumulated.is_contiguous()


@pytest.mark.parametrize(
    "a, b, expected",
    [
        (torch.float16, torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.bfloat16, torch.float32),
        (torch.float16, torch.float32, torch.float32),
        (torch.float32, torch.float64, torch.float64),
        (torch.bfloat16, torch.float64, torch.float64),
    ],
)
def test_allocated_output_dtype_is_promoted(a, b, expected):
    A = torch.randn(3, 4).to(a)
    B = torch.randn(4, 2).to(b)
    C = insum("C[m, n] += A[m, k] * B[k, n]", A=A, B=B)
    assert C.dtype == expected
    torch.testing.assert_close(C.double(), A.double() @ B.double(), rtol=2e-2, atol=2e-2)


def test_passed_output_dtype_wins():
    A = torch.randn(3, 4, dtype=torch.float16)
    C = torch.zeros(3, dtype=torch.float64)
    assert insum("C[m] += A[m, k]", A=A, C=C).dtype == torch.float64


def test_output_that_does_not_follow_must_be_passed():
    tensors = group_coo_inputs()
    del tensors["C"]
    with pytest.raises(InsumError, match="pass C="):
        insum(GROUP_COO, **tensors)


def test_output_whose_extent_only_it_gives_must_be_passed():
    with pytest.raises(InsumShapeError, match="pass the output"):
        insum("Y[i] += X[i + 3 - t] * K[t]", X=torch.randn(13), K=torch.randn(4))


def test_auto_on_cpu_is_the_reference():
    tensors = group_coo_inputs(torch.float64)
    by_torch = insum(GROUP_COO, backend="torch", **{k: v.clone() for k, v in tensors.items()})
    by_auto = insum(GROUP_COO, **tensors)
    torch.testing.assert_close(by_auto, by_torch, rtol=0, atol=0)


def test_tensor_names_are_free():
    # `expr` is positional-only, so a tensor may be called `expr` too.
    X = torch.randn(3)
    torch.testing.assert_close(insum("out[m] += expr[m] * 2", expr=X), 2 * X)


def test_statement_is_positional():
    with pytest.raises(TypeError):
        insum(expr="C[m] += X[m]", X=torch.randn(3))


def test_errors_come_through():
    with pytest.raises(InsumSyntaxError, match="column 6"):
        insum("C[m] X[m]", X=torch.randn(3))
    with pytest.raises(InsumError, match="unknown or unused"):
        insum("C[m] += X[m]", X=torch.randn(3), Y=torch.randn(3))


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("call", [insum, explain], ids=["insum", "explain"])
def test_unknown_precision_lists_the_valid_names(call):
    with pytest.raises(InsumError) as info:
        call("C[m] += X[m]", X=torch.randn(3), precision="fp8")
    message = str(info.value)
    assert "fp8" in message and all(name in message for name in PRECISIONS)


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(InsumError) as info:
        insum("C[m] += X[m]", X=torch.randn(3), backend="cuda")
    message = str(info.value)
    assert "cuda" in message and all(name in message for name in BACKENDS)
    assert {"auto", "torch", "triton"} <= set(BACKENDS)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_is_accepted(precision):
    X = torch.randn(3)
    torch.testing.assert_close(insum("C[m] += X[m]", X=X, backend="torch", precision=precision), X)


# ---------------------------------------------------------------- explain


def test_explain_names_statement_extents_and_roles():
    text = explain(GROUP_COO, **group_coo_inputs())
    assert isinstance(text, str)
    assert GROUP_COO in text
    for line in ("p: extent 6, scattered", "q: extent 3, reduced", "n: extent 5, output"):
        assert line in text
    assert "AM" in text and "AK" in text and "[7, 5]" in text


def test_explain_works_on_shapes_alone():
    text = explain("O[p] += X[AM[p], k] * Y[AK[p], k]", AM=torch.empty(11, dtype=torch.int64, device="meta"), AK=torch.empty(11, dtype=torch.int32, device="meta"), X=torch.empty(7, 6, device="meta"), Y=torch.empty(9, 6, device="meta"))
    assert "p: extent 11, output" in text and "k: extent 6, reduced" in text


def test_explain_does_not_run_the_statement():
    tensors = group_coo_inputs()
    before = tensors["C"].clone()
    explain(GROUP_COO, **tensors)
    assert torch.equal(tensors["C"], before)


def test_explain_raises_the_same_errors():
    with pytest.raises(InsumSyntaxError):
        explain("C[m] += X[m", X=torch.randn(3))
    with pytest.raises(InsumError, match="missing"):
        explain("C[m] += X[m] * Y[m]", X=torch.randn(3))


# ---------------------------------------------------------------- the package surface


def test_public_names():
    for name in insum_module.__all__:
        if name != "compile":  # compile() loads the runtime; its own tests cover it
            assert getattr(insum_module, name) is not None
    assert issubclass(insum_module.InsumShapeError, insum_module.InsumError)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inference_tensor_output_outside_inference_mode_raises(backend):
    """Found by fuzzing: the generated kernel wrote into an inference tensor outside
    inference mode, which torch (and the torch backend) refuse; it raises on every path."""
    import os

    if backend == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CPU tensors: the generated kernel needs TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    A, B = torch.randn(4, 3, device=device), torch.randn(3, 4, device=device)
    with torch.inference_mode():
        C = torch.zeros(4, 4, device=device)
        for _ in range(2):  # the first call, then the repeat's path; both fine inside the mode
            insum("C[m, n] += A[m, k] * B[k, n]", C=C, A=A, B=B, backend=backend)
    for _ in range(2):
        with pytest.raises((InsumError, RuntimeError), match="[Ii]nference"):
            insum("C[m, n] += A[m, k] * B[k, n]", C=C, A=A, B=B, backend=backend)
