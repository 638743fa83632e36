"""insum.distributed and insum.nn.DistributedSparseLinear.

The partitioning is checked in this process. The collectives run in 2 gloo processes on
the CPU, spawned once for the module: each process runs every check in CHECKS (in the
same order, so their collectives pair up) and reports one line per check, which the
tests below read. A hang fails: gloo's timeout and the spawn's deadline are both short.
Every distributed result is compared with the one-process product and a float64 dense one.
With two GPUs, GPU_CHECKS run the same way in 2 NCCL processes (`-m gpu`; skipped here).
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from insum.distributed import partition_rows, spmm
from insum.errors import InsumError, InsumShapeError, InsumTypeError
from insum.formats import GroupCOO, power_law_matrix
from insum.formats.grouping import HALF_FAN_IN
from insum.formats.opcount import count_ops
from insum.nn import DistributedSparseLinear, SparseLinear

WORLD = 2
SPAWN_DEADLINE_S = 120  # the whole spawn; it takes ~15 s
GLOO_TIMEOUT_S = 30  # a collective whose partner died fails after this


def skewed(n: int, avg: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    return power_law_matrix(n, n, avg, alpha=1.2, seed=seed, dtype=dtype)


# --------------------------------------------------------------------------- one process


def rebuilt_rows(p, n):
    """A part's rows of A from its two passes: the halo pass's columns are the received rows."""
    out = torch.zeros(len(p.rows), n, dtype=p.dtype)
    out[:, p.rows.start : p.rows.stop] = p.local.to_dense()
    out[:, p.halo_rows] += p.halo.to_dense()
    return out


def test_parts_cover_the_rows_and_rebuild_A():
    A = skewed(53, 4.0, seed=3)
    dense = A.to_dense()
    parts = partition_rows(A, 3)
    assert [p.rows.start for p in parts] == [0, parts[0].rows.stop, parts[1].rows.stop]
    assert parts[-1].rows.stop == 53
    assert sum(p.nnz for p in parts) == A._nnz()
    for p in parts:
        assert isinstance(p.rows, range)
        torch.testing.assert_close(rebuilt_rows(p, 53), dense[p.rows.start : p.rows.stop], rtol=0, atol=0)
        assert not any(p.rows.start <= r < p.rows.stop for r in p.halo_rows.tolist())


def test_what_one_rank_sends_is_what_the_other_receives():
    parts = partition_rows(skewed(40, 3.0, seed=5), 3, "rows", index_dtype=torch.int64)
    for p in parts:
        assert p.local.index_dtype == torch.int64
        for s, wanted in enumerate(p.remote_rows):
            q = parts[s]
            start = sum(q.send_counts[: p.rank])
            sent = q.send_rows[start : start + q.send_counts[p.rank]] + q.rows.start
            assert torch.equal(sent, wanted)
        assert p.recv_counts[p.rank] == 0 and p.send_counts[p.rank] == 0


def test_balance_by_nonzeros_evens_out_a_skewed_matrix():
    A = skewed(400, 8.0, seed=1)
    by_nnz = [p.nnz for p in partition_rows(A, 2, "nnz")]
    by_rows = [p.nnz for p in partition_rows(A, 2, "rows")]
    assert max(by_nnz) - min(by_nnz) <= max(by_rows) - min(by_rows)
    assert max(by_nnz) - min(by_nnz) <= A.crow_indices().diff().max()  # one row's worth
    assert [len(p.rows) for p in partition_rows(A, 2, "rows")] == [200, 200]


def test_a_single_rank_part_matches_the_full_partition():
    A = skewed(30, 3.0, seed=2)
    (alone,) = partition_rows(A, 3, rank=1)
    full = partition_rows(A, 3)[1]
    assert alone.rows == full.rows and torch.equal(alone.halo_rows, full.halo_rows)
    assert torch.equal(alone.send_rows, full.send_rows) and alone.send_counts == full.send_counts


def test_more_ranks_than_rows_leaves_ranks_empty():
    parts = partition_rows(torch.eye(2), 3)
    assert sum(len(p.rows) for p in parts) == 2
    assert any(len(p.rows) == 0 and p.nnz == 0 for p in parts)


def test_the_default_packs_each_block_by_formats_auto():
    A = skewed(300, 12.0, seed=4)
    dense = A.to_dense()
    for p in partition_rows(A, 2):
        assert p.local.shape == (len(p.rows), len(p.rows))
        assert p.halo.shape == (len(p.rows), p.halo_rows.numel()) and p.halo.nnz > 0
        assert p.nnz == int((dense[p.rows.start : p.rows.stop] != 0).sum())
        assert p.fan_in == p.local.fan_in + p.halo.fan_in
        torch.testing.assert_close(rebuilt_rows(p, 300), dense[p.rows.start : p.rows.stop], rtol=0, atol=0)


def test_a_named_format_packs_both_blocks_with_its_parameters():
    A = skewed(40, 3.0, seed=4)
    for fmt, params in (("GroupCOO", {"group_size": 2}), ("COO", {})):
        for p in partition_rows(A, 2, format=fmt, **params):
            assert type(p.local).__name__ == type(p.halo).__name__ == fmt
            assert p.halo.shape[1] == p.halo_rows.numel()
            torch.testing.assert_close(rebuilt_rows(p, 40), A.to_dense()[p.rows.start : p.rows.stop])
    (fixed,) = partition_rows(A, 2, rank=1, format="GroupCOO", group_size=8)
    assert fixed.local.group_size == fixed.halo.group_size == 8


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: partition_rows(torch.ones(3, 4), 2), InsumShapeError, "square"),
        (lambda: partition_rows(torch.eye(3), 0), InsumError, "world_size"),
        (lambda: partition_rows(torch.eye(3), 2, "edges"), InsumError, "balance"),
        (lambda: partition_rows(torch.eye(3), 2, rank=2), InsumError, "rank"),
        (lambda: partition_rows(torch.eye(3), 2, format="CSR5"), InsumError, "unknown format"),
        (lambda: partition_rows(torch.eye(3), 2, group_sise=2), InsumError, "group_sise"),
        (lambda: partition_rows(torch.eye(3), 2, format="COO", group_size=2), InsumError, "group_size"),
        (lambda: partition_rows(torch.eye(3), 2, format="GroupCOO", group_size=0), InsumError, "group_size"),
        (lambda: spmm(partition_rows(torch.eye(3), 1)[0], torch.ones(3, 2)), InsumError, "process group"),
        # Found by fuzzing: N:M failed inside with a message about a renumbered block's window,
        # and a format of None raised AttributeError.
        (lambda: partition_rows(torch.eye(8), 2, format="NM", n=2, m=4, vector_len=1), InsumError,
         "cannot pack N:M"),
        (lambda: partition_rows(torch.eye(3), 2, format=None), InsumTypeError, "format's name"),
    ],
)
def test_input_errors_name_the_problem(call, error, words):
    with pytest.raises(error, match=words):
        call()


# --------------------------------------------------------------------------- two processes

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _row_slice(part):
    return slice(part.rows.start, part.rows.stop)


def _spmm_against_one_process(rank, A, N, fmt="auto", balance="nnz", grad=True, **params):
    """spmm on this rank's part vs the one-process format product and float64 (values, grads)."""
    dtype = A.dtype
    (part,) = partition_rows(A, WORLD, balance, rank=rank, format=fmt, **params)
    gen = torch.Generator().manual_seed(7)
    B = torch.randn(N, A.shape[0], generator=gen, dtype=torch.float64).t()  # column-major
    G = torch.randn(A.shape[0], N, generator=gen, dtype=torch.float64)
    rows = _row_slice(part)
    B_local = B[rows].to(dtype).requires_grad_(grad)
    C = spmm(part, B_local)
    dense = A.to_dense().double()
    want = (dense @ B.to(dtype).double())[rows]
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 3e-2)
    assert C.dtype == dtype and C.shape == (len(part.rows), N)
    torch.testing.assert_close(C.double(), want, rtol=tol, atol=tol)
    one_process = GroupCOO.from_torch(A) @ B.to(dtype)
    torch.testing.assert_close(C, one_process[rows], rtol=tol, atol=tol)
    if grad:
        (C.double() * G[rows]).sum().backward()
        want_grad = (dense.t() @ G)[rows]
        torch.testing.assert_close(B_local.grad.double(), want_grad, rtol=tol, atol=tol)
    return part


@check
def spmm_fp32_int32(rank):
    part = _spmm_against_one_process(rank, skewed(37, 3.0, seed=11), 5)
    assert part.local.index_dtype == torch.int32 and sum(part.recv_counts) > 0


@check
def spmm_follows_values_and_pattern_edited_between_steps(rank):
    # Found by fuzzing: the backward kept the values (COO, GroupCOO) and the transposed
    # pattern its first call made, so after `part.local.AV.mul_(2)` or an in-place edit of an
    # index tensor the forward was right and B's gradient the old A's, silently.
    A = skewed(24, 3.0, seed=41)
    gen = torch.Generator().manual_seed(42)
    for fmt, params in (("GroupCOO", {"group_size": 2}), ("COO", {"cover": False}), ("ELL", {})):
        (part,) = partition_rows(A, WORLD, rank=rank, format=fmt, **params)
        rows = _row_slice(part)
        for step in range(3):
            B = torch.randn(24, 3, generator=gen, dtype=torch.float64)
            G = torch.randn(24, 3, generator=gen, dtype=torch.float64)
            B_local = B[rows].to(A.dtype).requires_grad_()
            spmm(part, B_local).backward(G[rows].to(A.dtype))
            # This rank's rows of A as the parts hold them now, as dense columns of the whole.
            local = torch.zeros(len(part.rows), 24, dtype=torch.float64)
            local[:, rows] = part.local.to_dense().double()
            if part.halo.shape[1]:
                local[:, part.halo_rows.long()] = part.halo.to_dense().double()
            # B's gradient needs every rank's A^T dC: gather the local blocks' transposes.
            pieces = [torch.zeros(24, 24, dtype=torch.float64) for _ in range(WORLD)]
            full = torch.zeros(24, 24, dtype=torch.float64)
            full[rows] = local
            dist.all_gather(pieces, full)
            dense = sum(pieces)
            torch.testing.assert_close(B_local.grad.double(), (dense.t() @ G)[rows], rtol=1e-5, atol=1e-5)
            with torch.no_grad():
                part.local.AV.mul_(2)  # the values edited in place
                if step == 1:  # and the pattern: the stored entries' columns reversed per row
                    AK = part.local.AK
                    AK.copy_(AK.flip(-1))


@check
def spmm_reused_buffers_no_syncs(rank):
    # Long rows, GroupCOO with g = 4. Two calls on one part: the buffers it keeps are reused, and once the
    # first backward has kept the transposed patterns, a call syncs the host nowhere (on
    # the generated kernels: the torch lowering, the CPU's, reads sizes back itself).
    triton = os.environ.get("TRITON_INTERPRET") == "1"
    backend = "triton" if triton else "torch"
    A = skewed(40, 12.0, seed=25)
    (part,) = partition_rows(A, WORLD, rank=rank, format="GroupCOO", group_size=4)
    dense = A.to_dense().double()
    gen = torch.Generator().manual_seed(26)
    rows = _row_slice(part)
    buffers = []
    for call in range(2):
        B = torch.randn(40, 3, generator=gen)
        B_local = B[rows].clone().requires_grad_()
        with count_ops() as counted:
            C = spmm(part, B_local, backend=backend, precision="ieee")
            C.backward(torch.ones_like(C))
        torch.testing.assert_close(C.double(), (dense @ B.double())[rows], rtol=1e-5, atol=1e-5)
        want = dense.t() @ torch.ones(40, 3, dtype=torch.float64)
        torch.testing.assert_close(B_local.grad.double(), want[rows], rtol=1e-5, atol=1e-5)
        buffers.append({k: v.data_ptr() for k, v in part.workspace.items() if isinstance(v, torch.Tensor)})
        if call and triton:
            assert counted.syncs == 0, counted
    assert buffers[0] == buffers[1]  # the same buffers (and kept values) in the second call
    assert {key[0] for key in buffers[1]} >= {"forward", "backward"}


@check
def spmm_groupcoo_blocks_separately(rank):
    part = _spmm_against_one_process(rank, skewed(37, 3.0, seed=11), 5, fmt="GroupCOO")
    assert isinstance(part.local, GroupCOO) and isinstance(part.halo, GroupCOO)


@check
def spmm_coo_int64_balanced_by_rows(rank):
    part = _spmm_against_one_process(
        rank, skewed(29, 2.5, seed=12), 3, fmt="COO", balance="rows", index_dtype=torch.int64
    )
    assert part.local.index_dtype == torch.int64


@check
def spmm_ell_fp64(rank):
    _spmm_against_one_process(rank, skewed(24, 3.0, seed=13, dtype=torch.float64), 4, fmt="ELL")


@check
def spmm_formats_of_several_statements(rank):
    # CELL (one statement per bucket) and BlockGroupCOO add the halo product in a second
    # pass and take their gradient through autograd.
    _spmm_against_one_process(rank, skewed(26, 3.0, seed=23), 3, fmt="CELL")
    _spmm_against_one_process(rank, skewed(26, 3.0, seed=24), 3, fmt="BlockGroupCOO", block=(2, 2))


@check
def spmm_bf16(rank):
    _spmm_against_one_process(rank, skewed(33, 3.0, seed=14, dtype=torch.bfloat16), 6)


@check
def spmm_fp16_one_column(rank):
    A = skewed(31, 3.0, seed=15, dtype=torch.float16)
    part = _spmm_against_one_process(rank, A, 1)  # few groups a row: accumulated in fp16 in place
    assert part.fan_in <= HALF_FAN_IN
    part = _spmm_against_one_process(rank, A, 1, fmt="GroupCOO", group_size=1)  # rank 0: 30 groups in a row, float32
    assert (part.fan_in > HALF_FAN_IN) == (rank == 0)


@check
def spmm_rank_without_rows(rank):
    A = torch.tensor([[2.0]]).to_sparse_csr()  # 1 x 1: one rank gets no rows
    part = _spmm_against_one_process(rank, A, 3, balance="rows")  # the first takes it
    assert len(part.rows) == (1 if rank == 0 else 0)
    part = _spmm_against_one_process(rank, A, 3, balance="nnz")  # the last takes it
    assert len(part.rows) == (0 if rank == 0 else 1)


@check
def spmm_block_diagonal_has_no_halo(rank):
    gen = torch.Generator().manual_seed(16)
    A = torch.block_diag(torch.randn(6, 6, generator=gen), torch.randn(5, 5, generator=gen))
    A[A.abs() < 0.6] = 0
    part = _spmm_against_one_process(rank, A.to_sparse_csr(), 4, balance="rows")
    assert sum(part.recv_counts) == 0 and sum(part.send_counts) == 0 and part.halo.nnz == 0


@check
def spmm_generated_kernel(rank):
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "skipped: needs TRITON_INTERPRET=1 on the CPU"
    A = skewed(20, 3.0, seed=17)
    (part,) = partition_rows(A, WORLD, rank=rank)
    B = torch.randn(20, 4, generator=torch.Generator().manual_seed(3))
    B_local = B[_row_slice(part)].clone().requires_grad_()
    C = spmm(part, B_local, backend="triton", precision="ieee")
    torch.testing.assert_close(C, (A.to_dense() @ B)[_row_slice(part)], rtol=1e-5, atol=1e-5)
    C.sum().backward()
    want = A.to_dense().t() @ torch.ones(20, 4)
    torch.testing.assert_close(B_local.grad, want[_row_slice(part)], rtol=1e-5, atol=1e-5)


@check
def spmm_input_errors(rank):
    A = skewed(12, 2.0, seed=18)
    (part,) = partition_rows(A, WORLD, rank=rank)
    n = len(part.rows)
    cases = [
        (lambda: spmm(part, torch.ones(n + 1, 2)), InsumShapeError, "B_local must hold"),
        (lambda: spmm(part, torch.ones(n)), InsumShapeError, "B_local must hold"),
        (lambda: spmm(part, torch.ones(n, 2, dtype=torch.float64)), InsumTypeError, "partition A"),
        (lambda: spmm(part, torch.ones(n, 2, dtype=torch.int32)), InsumTypeError, "int32"),
        (lambda: spmm(partition_rows(A, 3)[rank], torch.ones(n, 2)), InsumError, "of 3"),
        (lambda: spmm(partition_rows(A, WORLD)[1 - rank], torch.ones(n, 2)), InsumError, "rank"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()


def _sparse_weight(out_features, in_features, seed):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(out_features, in_features, generator=gen)
    W[torch.rand(W.shape, generator=gen) < 0.5] = 0
    return W, torch.randn(out_features, generator=gen)


@check
def linear_deepcopy_keeps_its_group(rank):
    """Found by fuzzing: deepcopy of a layer built on an explicit group (an EMA copy) failed
    to copy the process group; the copy shares it."""
    import copy

    group = dist.new_group([0, 1])
    W, b = _sparse_weight(7, 6, seed=23)
    layer = DistributedSparseLinear.from_dense(W, b, group=group)
    twin = copy.deepcopy(layer)
    assert twin.group is group and twin.local is not layer.local
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(24))
    torch.testing.assert_close(twin(x), layer(x))


@check
def linear_replicated_input_gathered_output(rank):
    W, b = _sparse_weight(7, 6, seed=19)  # 7 features: 4 on rank 0, 3 on rank 1
    layer = DistributedSparseLinear.from_dense(W, b)
    assert len(layer.out_rows) == (4 if rank == 0 else 3)
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(3, 2, 6, generator=gen).requires_grad_()
    G = torch.randn(3, 2, 7, generator=gen)
    y = layer(x)
    (y * G).sum().backward()
    full = SparseLinear.from_dense(W, b)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = full(x_ref)
    (y_ref * G).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    want_y = x.detach().double() @ W.double().t() + b.double()
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    rows = slice(layer.out_rows.start, layer.out_rows.stop)
    shard = SparseLinear.from_dense(W[rows], b[rows])
    (shard(x.detach()) * G[..., rows]).sum().backward()
    torch.testing.assert_close(layer.local.AV.grad, shard.AV.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.local.bias.grad, shard.bias.grad, rtol=1e-5, atol=1e-5)


@check
def linear_sharded_input_local_output(rank):
    W, b = _sparse_weight(5, 9, seed=21)
    layer = DistributedSparseLinear.from_dense(
        W, b, "COO", input_is_sharded=True, gather_output=False, index_dtype=torch.int64
    )
    gen = torch.Generator().manual_seed(22)
    x_all = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    G = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    rows = slice(layer.out_rows.start, layer.out_rows.stop)
    x = x_all[2 * rank : 2 * rank + 2].float().requires_grad_()
    y = layer(x)
    assert y.shape == (4, len(layer.out_rows))
    want_y = x_all.float().double() @ W[rows].double().t() + b[rows].double()
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    (y.double() * G[:, rows]).sum().backward()  # the ranks' losses add up to (y_full * G).sum()
    want = (G @ W.double())[2 * rank : 2 * rank + 2]
    torch.testing.assert_close(x.grad.double(), want, rtol=1e-5, atol=1e-5)


@check
def spmm_double_backward_raises(rank):
    """Found by fuzzing: a double backward through the exchange kept each rank's own terms and
    dropped the halo's (its all_to_all records no graph), silently; it raises now."""
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    A[torch.rand(6, 6, generator=gen) > 0.4] = 0
    B = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    (part,) = partition_rows(A.to_sparse(), 2, "rows", rank=rank, format="COO")
    local = B[part.rows.start : part.rows.stop].clone().requires_grad_()
    C = spmm(part, local, backend="torch", precision="ieee")
    (grad,) = torch.autograd.grad((C**2).sum(), local, create_graph=True)
    torch.testing.assert_close(grad, (2 * A.t() @ (A @ B))[part.rows.start : part.rows.stop])
    with pytest.raises(RuntimeError, match="differentiate twice a function that was marked with @once_differentiable"):
        grad.sum().backward()


@check
def linear_nm_from_dense_is_the_single_layer(rank):
    """Found by fuzzing: N:M prunes per vector of vector_len rows, and a rank split inside a
    vector pruned each part on its own (a weight off by 1.3 from SparseLinear's). The ranks
    split at multiples of vector_len (`row_granule`)."""
    W = torch.randn(5, 4, generator=torch.Generator().manual_seed(31), dtype=torch.float64)
    params = dict(n=1, m=2, vector_len=2)
    layer = DistributedSparseLinear.from_dense(W, None, "NM", backend="torch", **params)
    assert layer.ranges == [range(0, 4), range(4, 5)]
    single = SparseLinear.from_dense(W, None, "NM", backend="torch", **params)
    gathered = layer(torch.eye(4, dtype=torch.float64)).t()
    torch.testing.assert_close(gathered, single.to_dense())
    with pytest.raises(InsumError, match="at least one output feature \\(in runs of 8"):
        DistributedSparseLinear.from_dense(W, None, "NM", backend="torch", n=1, m=2, vector_len=8)


@check
def linear_new_layer_and_errors(rank):
    torch.manual_seed(rank)  # each rank draws its own rows
    layer = DistributedSparseLinear(8, 6, format="GroupCOO", sparsity=0.5)
    assert layer.local.weight.shape == (3, 8) and layer.local.weight.nnz == 12
    assert layer(torch.randn(5, 8)).shape == (5, 6)
    with pytest.raises(InsumError, match="at least one output feature"):
        DistributedSparseLinear(8, 1)
    with pytest.raises(InsumShapeError, match="in_features=8"):
        layer(torch.randn(5, 7))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- two GPUs (NCCL)

GPU_CHECKS = {}


def gpu_check(fn):
    GPU_CHECKS[fn.__name__] = fn
    return fn


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want).norm() / want.norm().clamp(min=1e-30))


@gpu_check
def cuda_spmm_generated_kernels_against_one_gpu(rank):
    """The Triton path on NCCL, each dtype, against one GPU's product and float64; the
    second call of a part syncs the host nowhere."""
    device = torch.device("cuda", rank)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)]:
        A = skewed(3001, 12.0, seed=31, dtype=dtype).to(device)
        (part,) = partition_rows(A, WORLD, rank=rank)
        gen = torch.Generator(device=device).manual_seed(32)
        B = torch.randn(3001, 48, generator=gen, device=device, dtype=dtype)
        G = torch.randn(3001, 48, generator=gen, device=device, dtype=dtype)
        rows = _row_slice(part)
        dense = A.to_dense().double()
        for call in range(2):
            B_local = B[rows].clone().requires_grad_()
            with count_ops() as counted:
                C = spmm(part, B_local, precision="ieee")
                C.backward(G[rows])
            if call:
                assert counted.syncs == 0, counted
        assert _relative_error(C, (dense @ B.double())[rows]) < tol
        one_gpu = GroupCOO.from_torch(A).spmm(B, precision="ieee")[rows]
        assert _relative_error(C, one_gpu.double()) < tol
        assert _relative_error(B_local.grad, (dense.t() @ G.double())[rows]) < tol


def _worker(rank: int, port: int, out_dir: str, gpu: bool = False) -> None:
    torch.set_num_threads(1)
    if gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=GLOO_TIMEOUT_S),
    )
    results = {}
    for name, fn in (GPU_CHECKS if gpu else CHECKS).items():
        try:
            results[name] = fn(rank) or "ok"
        except Exception:
            results[name] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _spawn(out_dir, gpu: bool) -> list[dict]:
    context = mp.start_processes(
        _worker, args=(_free_port(), str(out_dir), gpu), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the 2-process run did not finish in {SPAWN_DEADLINE_S} s (a hang?)")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each rank's result of every check, from one spawn of 2 gloo processes."""
    return _spawn(tmp_path_factory.mktemp("distributed"), gpu=False)


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    """Each rank's result of every GPU check, from one spawn of 2 NCCL processes."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    return _spawn(tmp_path_factory.mktemp("distributed_gpu"), gpu=True)


def _outcomes(results: list[dict], name: str) -> None:
    for rank, per_rank in enumerate(results):
        outcome = per_rank[name]
        if outcome.startswith("skipped"):
            pytest.skip(outcome)
        assert outcome == "ok", f"rank {rank}:\n{outcome}"


@pytest.mark.parametrize("name", list(CHECKS))
def test_two_gloo_ranks(two_ranks, name):
    _outcomes(two_ranks, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CHECKS))
def test_two_gpus(two_gpus, name):
    _outcomes(two_gpus, name)
