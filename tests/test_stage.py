"""Staged gathers (`insum.codegen.stage`): which factor is staged, and that a staged statement
computes what the fused one does.

The decision is tested at real sizes on the IR alone; the staged runs shrink the thresholds
so that small tensors qualify, and compare against a float64 product on poisoned outputs."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, KERNEL_MARK  # before insum: the interpreter on CPU-only machines

import insum
from insum import execute
from insum.codegen import stage
from insum.parser import parse

GATHERED = "C[m, n] = A[m, k] * B[I[k], n]"


def _staging(expr: str, **extents: int):
    return stage.staging(parse(expr), extents)


def test_a_much_reused_gathered_operand_is_staged():
    staged = _staging(GATHERED, m=4096, n=4096, k=4096)
    assert staged is not None
    assert str(staged.gather) == "B_staged[k, n] = B[I[k], n]"
    assert str(staged.main) == "C[m, n] = A[m, k] * B_staged[k, n]"
    assert (staged.name, staged.variables, staged.source, staged.reuse) == ("B_staged", ("k", "n"), "B", 4096)


@pytest.mark.parametrize(
    "expr, extents",
    [
        (GATHERED, dict(m=1024, n=4096, k=4096)),  # too little reuse
        (GATHERED, dict(m=8192, n=16, k=16)),  # too small to pay for a launch
        ("C[m, n] = B[I[k], n]", dict(m=8192, n=4096, k=4096)),  # a lone gather is a copy already
        ("O[v, co] = X[NB[v, w], ci] * W[w, ci, co]", dict(v=200000, w=27, ci=128, co=128)),  # conv: reuse co
        ("C[m, n] += AV[m, q] * B[AK[m, q], n]", dict(m=8192, q=64, n=4096)),  # ELL: no reuse
        ("C[m, n] = A[m, k] * B[k, n]", dict(m=8192, n=4096, k=4096)),  # nothing gathered
    ],
)
def test_other_statements_keep_their_gathers(expr, extents):
    assert _staging(expr, **extents) is None


def test_staged_name_is_fresh_and_the_most_reused_factor_wins():
    staged = _staging("C[m, n] = B_staged[J[m], k] * B[I[k], n]", m=8192, n=2048, k=4096)
    assert staged is not None and staged.name == "B_staged_" and staged.source == "B"
    assert staged.reuse == 8192  # B's elements: m; B_staged's: n = 2048


@pytest.fixture
def small_thresholds(monkeypatch):
    monkeypatch.setattr(stage, "STAGE_REUSE", 8)
    monkeypatch.setattr(stage, "STAGE_MIN_ELEMENTS", 1)


def _case(seed: int, index_dtype=torch.int64, M=40, K=24, N=20, rows=30, transposed_B=False):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(M, K, generator=g)
    B = torch.randn(N, rows, generator=g).t() if transposed_B else torch.randn(rows, N, generator=g)
    idx = torch.randint(0, rows, (K,), generator=g).to(index_dtype)
    to = dict(device=DEVICE)
    return A.to(**to), B.to(**to), idx.to(**to)


def _expected(A, B, idx):
    return A.double() @ B.double()[idx.long()]


@KERNEL_MARK
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("transposed_B", [False, True])
def test_staged_product_matches_and_repeats(small_thresholds, index_dtype, transposed_B):
    execute._PREPARED.clear()
    A, B, idx = _case(0, index_dtype, transposed_B=transposed_B)
    C = torch.full((40, 20), float("nan"), device=DEVICE)
    out = insum.insum(GATHERED, A=A, B=B, I=idx, C=C, backend="triton", precision="ieee")
    assert out is C
    torch.testing.assert_close(out.double(), _expected(A, B, idx), rtol=1e-4, atol=1e-4)
    launches = [call.launcher for call in execute._PREPARED.values()]
    assert [type(launch).__name__ for launch in launches] == ["_StagedLaunch"]
    A, B2, idx = _case(1, index_dtype, transposed_B=transposed_B)  # the repeat: new values
    B.copy_(B2)
    out = insum.insum(GATHERED, A=A, B=B, I=idx, backend="triton", precision="ieee")
    torch.testing.assert_close(out.double(), _expected(A, B, idx), rtol=1e-4, atol=1e-4)


@KERNEL_MARK
def test_staged_accumulation_adds_to_the_given_output(small_thresholds):
    A, B, idx = _case(2)
    C = torch.randn(40, 20, device=DEVICE)
    expected = C.double() + _expected(A, B, idx)
    insum.insum("C[m, n] += A[m, k] * B[I[k], n]", A=A, B=B, I=idx, C=C, backend="triton", precision="ieee")
    torch.testing.assert_close(C.double(), expected, rtol=1e-4, atol=1e-4)


@KERNEL_MARK
def test_stage_switch_and_declared_lengths_keep_the_gather_fused(small_thresholds, monkeypatch):
    A, B, idx = _case(3)
    monkeypatch.setenv("INSUM_STAGE", "0")
    assert "staged" not in insum.explain(GATHERED, A=A, B=B, I=idx)
    execute._PREPARED.clear()
    out = insum.insum(GATHERED, A=A, B=B, I=idx, backend="triton", precision="ieee")
    torch.testing.assert_close(out.double(), _expected(A, B, idx), rtol=1e-4, atol=1e-4)
    assert [type(c.launcher).__name__ for c in execute._PREPARED.values()] == ["_Launcher"]
    monkeypatch.delenv("INSUM_STAGE")
    text = insum.explain(GATHERED, A=A, B=B, I=idx)
    assert "staged" in text and "gather: B_staged[k, n] = B[I[k], n]" in text
    assert "product: C[m, n] = A[m, k] * B_staged[k, n]" in text
    # A statement with declared lengths stays one kernel (the copy would read the padding).
    AV, AK = torch.randn(40, 6, device=DEVICE), torch.randint(0, 30, (40, 6), device=DEVICE)
    counts = torch.randint(0, 7, (40,), device=DEVICE, dtype=torch.int32)
    text = insum.explain("C[m, n] = AV[m, q] * B[AK[m, q], n] * A[m, k]", AV=AV, AK=AK, B=B, A=A,
                         lengths={"q[m]": counts})
    assert "staged" not in text


@KERNEL_MARK
def test_staged_gradients_match(small_thresholds):
    A, B, idx = _case(4, M=24, K=16, N=12, rows=20)
    A.requires_grad_(True)
    B.requires_grad_(True)
    out = insum.insum(GATHERED, A=A, B=B, I=idx, backend="triton", precision="ieee")
    dC = torch.randn_like(out)
    out.backward(dC)
    Ad, Bd = A.detach().double().requires_grad_(True), B.detach().double().requires_grad_(True)
    (Ad @ Bd[idx.long()]).backward(dC.double())
    torch.testing.assert_close(A.grad.double(), Ad.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(B.grad.double(), Bd.grad, rtol=1e-4, atol=1e-4)
