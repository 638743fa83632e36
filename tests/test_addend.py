"""The added term `product + D[...]`: the generated kernel adds D to each output element once,
in its epilogue, against a float64 product computed by hand (and the torch lowering), with
its gradient derived. Small sizes, non-powers of two; on a CUDA machine the same tests run
compiled (fp32, and fp16 where the half kernels run)."""

from __future__ import annotations

import pytest
import torch
from kernel_env import (  # before insum: the interpreter on CPU-only machines
    CUDA,
    DEVICE,
    KERNEL_MARK,
)

import insum
from insum.formats import BlockGroupCOO

pytestmark = KERNEL_MARK
DTYPES = [torch.float32, torch.float16] if CUDA else [torch.float32]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _close(actual, expected, dtype):
    err = (actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)
    assert err < TOL[dtype], f"relative error {err:.2e}"


M, K, N = 37, 20, 19


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "statement, shape, added",
    [
        ("C[m, n] = A[m, k] * B[k, n] + D[m]", (M,), lambda D: D[:, None]),
        ("C[m, n] = A[m, k] * B[k, n] + D[n]", (N,), lambda D: D[None, :]),
        ("C[m, n] = A[m, k] * B[k, n] + D[n, m]", (N, M), lambda D: D.t()),
        ("C[m, n] = A[m, k] * B[k, n] + D", (), lambda D: D),
    ],
    ids=["rows", "columns", "transposed", "scalar"],
)
def test_added_term_matches_the_float64_product(statement, shape, added, dtype):
    A, B = _randn(M, K, dtype=dtype, seed=1), _randn(K, N, dtype=dtype, seed=2)
    D = _randn(*shape, dtype=dtype, seed=3)
    C = torch.full((M, N), float("nan"), device=DEVICE, dtype=dtype)  # poisoned: `=` overwrites it
    out = insum.insum(statement, C=C, A=A, B=B, D=D, backend="triton", precision="ieee")
    expected = A.double() @ B.double() + added(D.double())
    _close(out, expected, dtype)
    _close(insum.insum(statement, A=A, B=B, D=D, backend="torch"), expected, dtype)


def test_accumulating_statement_adds_product_and_term_to_the_output():
    M, K, N = 9, 7, 33
    A, B, D = _randn(M, K, seed=4), _randn(K, N, seed=5), _randn(M, seed=6)
    C = _randn(M, N, seed=7)
    expected = C.double() + 0.5 * (A.double() @ B.double()) + D.double()[:, None]
    out = insum.insum("C[m, n] += 0.5 * A[m, k] * B[k, n] + D[m]", C=C.clone(), A=A, B=B, D=D, backend="triton",
                      precision="ieee")
    _close(out, expected, torch.float32)


def test_non_contiguous_term_and_empty_output():
    A, B = _randn(6, 5, seed=8), _randn(5, 4, seed=9)
    D = _randn(4, 6, seed=10).t()  # (6, 4) seen through strides
    out = insum.insum("C[m, n] = A[m, k] * B[k, n] + D[m, n]", A=A, B=B, D=D, backend="triton", precision="ieee")
    _close(out, A.double() @ B.double() + D.double(), torch.float32)
    empty = insum.insum("C[m, n] = A[m, k] * B[k, n] + D[m]", A=A[:0], B=B, D=D[:0, 0], backend="triton")
    assert empty.shape == (0, 4)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_block_ell_product_with_a_bias_per_row(index_dtype):
    """The Block-ELL SpMM with its rows' bias as the added term (`D[p, m]`: the bias viewed by
    block row), declared lengths skipping the padding (poisoned with NaN)."""
    torch.manual_seed(11)
    keep = torch.rand(8, 6) < 0.4
    keep[3] = False  # an empty block row: its output is the bias alone
    W = torch.randn(64, 48) * keep.repeat_interleave(8, 0).repeat_interleave(8, 1)
    fmt = BlockGroupCOO.from_dense(W, block=(8, 8), group_size="row", index_dtype=index_dtype).to(DEVICE)
    counts = fmt.declared_lengths()["q[p]"].cpu()
    with torch.no_grad():
        fmt.AV[torch.arange(fmt.AV.shape[1]) >= counts[:, None]] = float("nan")
    X, bias = _randn(48, 10, seed=12), _randn(64, seed=13)
    statement = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n] + D[p, m]"
    out = insum.insum(statement, B=fmt.operand(X), D=bias.view(8, 8), lengths=fmt.declared_lengths(),
                      backend="triton", precision="ieee", **fmt.tensors)
    _close(fmt.result(out), W.to(DEVICE).double() @ X.double() + bias.double()[:, None], torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradient_of_the_added_term(backend):
    """dD sums dC over the output variables D lacks; A's and B's gradients ignore D."""
    A = _randn(6, 5, seed=14).double().requires_grad_()
    B = _randn(5, 4, seed=15).double().requires_grad_()
    D = _randn(6, seed=16).double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda A, B, D: insum.insum("C[m, n] = A[m, k] * B[k, n] + D[m]", A=A, B=B, D=D, backend=backend), (A, B, D)
    )


def test_explain_shows_the_term_loaded_once_in_the_epilogue():
    A, B, D = _randn(16, 8, seed=17), _randn(8, 12, seed=18), _randn(16, seed=19)
    text = str(insum.explain("C[m, n] = A[m, k] * B[k, n] + D[m]", A=A, B=B, D=D))
    loads = [line for line in text.splitlines() if "tl.load(D_ptr" in line]
    assert len(loads) == 1
    assert any(line.strip().startswith("acc += D_val") for line in text.splitlines())
