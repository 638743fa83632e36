"""Packed tensors stored with aligned rows (`formats.base.aligned_rows`): N:M's compressed
rows, K * n / m wide, start 16 elements apart in memory, and stay so through `to()`,
SparseLinear's parameters, dtype moves, state_dict and optimizer steps. Values and
products are unchanged (compiled on a GPU, else in the interpreter)."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE  # before insum: the interpreter on CPU-only machines

from insum.formats import NM
from insum.formats.base import ROW_ALIGNMENT, aligned_rows
from insum.nn import SparseLinear

TOL = 1e-6 if DEVICE == "cpu" else 2e-3  # (fp32 products run as TF32 on the GPU)


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Relative error in the Frobenius norm against a float64 reference, within TOL."""
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm()) < TOL


def rows_aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and all(s % ROW_ALIGNMENT == 0 for s in t.stride()[:-1])


def test_aligned_rows_pads_memory_not_shape():
    t = torch.randn(3, 5, 25)
    a = aligned_rows(t)
    assert a.shape == t.shape and torch.equal(a, t)
    assert a.stride() == (5 * 32, 32, 1)
    assert a.data_ptr() != t.data_ptr()


@pytest.mark.parametrize(
    "t",
    [torch.randn(4, 32), torch.randn(4, 7), torch.randn(40), torch.randn(6, 40).t(), torch.randn(4, 48)[:, :20]],
    ids=["aligned", "narrow", "vector", "transposed", "already-strided"],
)
def test_aligned_rows_leaves_what_it_cannot_or_need_not_align(t):
    assert aligned_rows(t) is t


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n, m, K", [(2, 4, 50), (1, 8, 203), (3, 8, 77)])
def test_nm_packs_aligned_rows_and_multiplies_the_same(n, m, K, index_dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(K)
    A = torch.randn(37, K, generator=gen, device=DEVICE)
    fmt = NM.from_dense(A, n=n, m=m, vector_len=8, index_dtype=index_dtype)
    width = fmt.AV.shape[-1]
    assert width > ROW_ALIGNMENT and width % ROW_ALIGNMENT  # the case the alignment is for
    assert rows_aligned(fmt.AV) and rows_aligned(fmt.AK)
    assert fmt.AK.dtype == index_dtype
    B = torch.randn(K, 19, generator=gen, device=DEVICE)
    expected = fmt.to_dense().double() @ B.double()
    assert close(fmt.spmm(B, backend="triton").double(), expected)
    # A move packs tensors densely; `to()` stores them aligned again.
    moved = fmt.to("cpu")
    assert rows_aligned(moved.AV) and rows_aligned(moved.AK) and torch.equal(moved.AV, fmt.AV.cpu())
    dense = {k: v.contiguous() for k, v in fmt.packed_tensors.items()}
    assert not rows_aligned(dense["AV"]) and all(rows_aligned(t) for t in NM.with_aligned_rows(dense).values())
    # The pruned matrix is the one dense packing keeps: the same as packed densely.
    assert torch.equal(fmt.to_dense(), NM.from_dense(A, n=n, m=m, vector_len=8).to_dense())


def nm_layer(seed: int = 0) -> SparseLinear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(50, 24, device=DEVICE)
    return SparseLinear.from_linear(linear, "NM", n=2, m=4, vector_len=8, backend="triton")


def test_sparse_linear_keeps_aligned_rows_through_moves_and_training():
    layer = nm_layer()
    assert rows_aligned(layer.AV) and rows_aligned(layer.AK)
    layer = layer.half().float()
    assert layer.AV.dtype == torch.float32 and rows_aligned(layer.AV)
    W = layer.to_dense().double()
    x = torch.randn(5, 50, device=DEVICE, requires_grad=True)
    y = layer(x)
    assert close(y.double(), x.double() @ W.t() + layer.bias.double())
    gy = torch.randn_like(y)
    y.backward(gy)
    assert close(x.grad.double(), gy.double() @ W)
    # The values' gradient: dy^T x at the kept positions, as a dense weight's gradient.
    dense_grad = gy.double().t() @ x.detach().double()
    kept = W != 0
    gradient = nm_layer(seed=1)
    with torch.no_grad():
        gradient.AV.copy_(layer.AV.grad)
        gradient.AK.copy_(layer.AK)
    assert close(gradient.to_dense().double()[kept], dense_grad[kept])
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    assert rows_aligned(layer.AV)
    fresh = nm_layer(seed=1)
    fresh.load_state_dict(layer.state_dict())
    assert rows_aligned(fresh.AV) and torch.equal(fresh.to_dense(), layer.to_dense())


def test_a_layer_adopting_a_saved_nm_weight_stores_it_in_aligned_rows():
    """load_state_dict into a layer of another format allocates the saved tensors anew."""
    saved = nm_layer()
    other = SparseLinear.from_linear(torch.nn.Linear(50, 24, device=DEVICE), "COO", sparsity=0.5, backend="triton")
    other.load_state_dict(saved.state_dict())
    assert other.format == "NM" and rows_aligned(other.AV) and rows_aligned(other.AK)
    assert torch.equal(other.to_dense(), saved.to_dense())
    x = torch.randn(3, 50, device=DEVICE)
    assert close(other(x), saved(x).detach())
