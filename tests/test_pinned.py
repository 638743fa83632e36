"""A format's repeated product runs pinned (`insum.execute.Pinned`): the format's own tensors
are checked once per plan, B and C per call (issue 10, launch path).

Each test pins a format's product, then changes one thing (B's values or gradients, the
format's values in place, its memory, an environment switch, an attempt to replace a
packed tensor) and checks that the next product is right, taking the pinned launch only
where it may. The kernels run in the interpreter at small sizes."""

from __future__ import annotations

import pytest
import torch
from kernel_env import CUDA  # before insum: the interpreter on CPU-only machines

from insum import api, execute, runtime
from insum.errors import InsumError
from insum.formats import CELL, COO, ELL, BlockGroupCOO, GroupCOO

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(CUDA, reason="CPU tensors in the interpreter; tests/test_direct_launch.py repeats on CUDA"),
]


def _skewed(seed: int, M: int = 19, K: int = 13) -> torch.Tensor:
    """Rows of 0..K entries (an empty row, odd lengths, a full row): CELL packs several widths."""
    gen = torch.Generator().manual_seed(seed)
    A = torch.zeros(M, K)
    for r in range(M):
        n = (0, 1, 2, 3, 5, 7)[r % 6]
        A[r, torch.randperm(K, generator=gen)[:n]] = torch.randn(n, generator=gen)
    A[M // 2] = torch.randn(K, generator=gen)
    return A


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), expected.double(), rtol=1e-5, atol=1e-5)


def _count_pinned(monkeypatch) -> list:
    """Record every pinned run, and make the calls' own entry points fail (a product that
    reaches them now did not run pinned)."""
    runs = []
    real = execute.Pinned.run
    monkeypatch.setattr(execute.Pinned, "run", lambda self, varying: runs.append(1) or real(self, varying))
    return runs


def _unpinned(monkeypatch) -> list:
    """Record every product that takes the calls' own path (insum / insum_many)."""
    from insum.formats import base

    calls = []
    for name in ("insum", "insum_many"):
        real = getattr(base, name)
        monkeypatch.setattr(base, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


def _pinned_product(cls, A, **params):
    fmt = cls.from_dense(A, **params)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):  # runs, prepares (a batch for CELL), pins
        fmt.spmm(torch.randn(A.shape[1], 4, generator=gen), backend="triton")
    return fmt, gen


@pytest.mark.parametrize(
    "cls, params",
    [(GroupCOO, {}), (ELL, {"index_dtype": torch.int32}), (COO, {}), (CELL, {}), (CELL, {"partitions": 2}),
     (BlockGroupCOO, {"block": (2, 2)})],
    ids=["GroupCOO", "ELL-int32", "COO", "CELL", "CELL-2-partitions", "BlockGroupCOO"],
)
def test_repeats_run_pinned_on_new_operands(cls, params, monkeypatch):
    A = _skewed(1, M=18, K=14)
    fmt, gen = _pinned_product(cls, A, **params)
    runs, unpinned = _count_pinned(monkeypatch), _unpinned(monkeypatch)
    for _ in range(2):
        B = torch.randn(14, 4, generator=gen)
        _close(fmt.spmm(B, backend="triton").double(), A.double() @ B.double())
    assert len(runs) == 2 and not unpinned


def test_cell_pinned_is_one_batch_launch_and_sees_values_updated_in_place(monkeypatch):
    A = _skewed(2)
    fmt, gen = _pinned_product(CELL, A)
    assert len(fmt.widths) >= 3
    launches = []
    real = runtime.BatchLaunch.run
    monkeypatch.setattr(runtime.BatchLaunch, "run", lambda self, calls: launches.append(1) or real(self, calls))
    monkeypatch.setattr(api, "insum", None)  # a statement run on its own would fail now
    B = torch.randn(13, 4, generator=gen)
    first = fmt.spmm(B, backend="triton")
    for w in fmt.widths:
        getattr(fmt, f"V_{w}").mul_(-2)  # a layer's update: data, not signature
    _close(fmt.spmm(B, backend="triton"), -2 * first)
    assert len(launches) == 2


def test_a_packed_tensor_cannot_be_replaced_and_to_drops_the_plans():
    fmt, _ = _pinned_product(GroupCOO, _skewed(3))
    with pytest.raises(InsumError, match=r"GroupCOO.AV is a packed tensor"):
        fmt.AV = torch.zeros_like(fmt.AV)
    assert "_spmm_plans" in fmt.__dict__
    moved = fmt.to("cpu")
    assert "_spmm_plans" not in moved.__dict__ and "_spmm_plans" in fmt.__dict__
    fmt.chosen_because = "a test"  # any other assignment drops the plans
    assert "_spmm_plans" not in fmt.__dict__


def test_memory_moved_under_a_packed_tensor_takes_the_full_path(monkeypatch):
    A = _skewed(4)
    fmt, gen = _pinned_product(ELL, A)
    runs, unpinned = _count_pinned(monkeypatch), _unpinned(monkeypatch)
    fmt.AV.data = fmt.AV * 3  # new memory under the same tensor object
    B = torch.randn(13, 4, generator=gen)
    _close(fmt.spmm(B, backend="triton").double(), 3 * A.double() @ B.double())
    assert not runs and len(unpinned) == 1
    for _ in range(2):  # pinned anew to the new memory, then run so
        _close(fmt.spmm(B, backend="triton").double(), 3 * A.double() @ B.double())
    assert len(runs) == 1 and len(unpinned) == 2


def test_a_packed_tensor_reshaped_in_place_keeps_its_pinned_layout(monkeypatch):
    A = _skewed(5)
    fmt, gen = _pinned_product(GroupCOO, A)
    runs = _count_pinned(monkeypatch)
    AK = fmt.AK
    AK.resize_(1, AK.shape[1])  # same memory, fewer rows: the kernel reads the view pinned before
    B = torch.randn(13, 4, generator=gen)
    _close(fmt.spmm(B, backend="triton").double(), A.double() @ B.double())
    assert len(runs) == 1


def test_gradients_and_switches_take_the_full_path(monkeypatch):
    A = _skewed(6)
    fmt, gen = _pinned_product(GroupCOO, A)
    runs, unpinned = _count_pinned(monkeypatch), _unpinned(monkeypatch)
    B = torch.randn(13, 4, generator=gen, requires_grad=True)
    C = fmt.spmm(B, backend="triton")  # B requires grad: derived
    assert C.requires_grad and not runs
    C.sum().backward()
    _close(B.grad, A.sum(0, keepdim=True).t().expand(13, 4))
    fmt.AV.requires_grad_(True)  # in place
    assert fmt.spmm(B.detach(), backend="triton").requires_grad and not runs
    with torch.no_grad():
        fmt.spmm(B, backend="triton")
    assert len(runs) == 1
    fmt.AV.requires_grad_(False)
    monkeypatch.setenv("INSUM_DIRECT_LAUNCH", "0")  # another environment: the full path
    _close(fmt.spmm(B.detach(), backend="triton").double(), A.double() @ B.detach().double())
    assert len(runs) == 1 and len(unpinned) == 3


def test_pinned_arguments_equal_the_parts_arguments():
    A = _skewed(7)
    fmt, gen = _pinned_product(CELL, A)
    plan = next(iter(fmt.__dict__["_spmm_plans"].values()))
    pinned = plan.pinned
    B, C = torch.randn(13, 4, generator=gen), torch.zeros(19, 4)
    B = torch.cat([torch.zeros(1), B.reshape(-1)])[1:].view(13, 4)  # 4 bytes off 16-byte alignment
    batch = pinned.launch.launch
    expected = []
    for part, (_, tensors) in zip(batch.parts, fmt.statements()):
        expected += part.args(dict(tensors, B=B, C=C), C)
    expected += batch.ends
    call = pinned.arguments({"B": B, "C": C})
    got = call.arguments()
    assert len(got) == len(expected)
    for position, (a, b) in enumerate(zip(got, expected)):
        if isinstance(b, torch.Tensor):
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride(), position
        else:
            assert a == b, position
    assert call.alignments() == tuple(expected[i].data_ptr() & 15 for i in batch.direct.pointers)
    # The compiled launcher's list: the same, with every pointer as its device address.
    addresses = call.addresses()
    assert len(addresses) == len(expected)
    for position, (a, b) in enumerate(zip(addresses, expected)):
        assert a == (b.data_ptr() if isinstance(b, torch.Tensor) else b), position


def _vector_products(fmt, A: torch.Tensor, gen: torch.Generator) -> None:
    """Four products of `fmt` with vectors (the first two run, prepare and pin), each a vector
    of A's rows, checked."""
    for _ in range(4):
        v = torch.randn(A.shape[1], generator=gen)
        got = fmt.spmm(v, backend="triton")
        assert got.shape == (A.shape[0],)
        _close(got, A.double() @ v.double())


def test_vector_and_half_products_repeat_pinned(monkeypatch):
    A = _skewed(8)
    fmt = CELL.from_dense(A.half())  # half values and B: float32 accumulation, rounded once
    gen = torch.Generator().manual_seed(10)
    runs = _count_pinned(monkeypatch)
    for _ in range(4):
        B = torch.randn(13, 3, generator=gen).half()
        torch.testing.assert_close(fmt.spmm(B, backend="triton").double(), A.half().double() @ B.double(),
                                   rtol=1e-2, atol=1e-2)
    assert len(runs) == 2
    _vector_products(GroupCOO.from_dense(A), A, gen)
    assert len(runs) == 4


def test_pinned_call_with_lengths_checks_only_its_varying_tensors_alignment(monkeypatch):
    """`pin` takes a call's declared lengths (their tensor pinned under the binding's name),
    and a pinned kernel that depends on its value tensors' alignment (descriptors on Hopper;
    simulated by marking the prepared call aligned) runs only while the varying tensors keep
    it: the pinned ones were checked when pinned, and `moved` sees their memory move."""
    from insum.cache import BoundedCache

    monkeypatch.setattr(execute, "_PREPARED", BoundedCache())  # calls prepared by other tests stay unmarked
    stmt = "C[m, n] = AV[m, q] * B[AK[m, q], n]"
    gen = torch.Generator().manual_seed(11)
    AV, AK = torch.randn(5, 3, generator=gen), torch.randint(0, 4, (5, 3), generator=gen)
    AL = torch.tensor([3, 1, 0, 2, 3])
    AV = AV * (torch.arange(3) < AL[:, None])  # padding: value 0
    B = torch.randn(4, 2, generator=gen)
    facts = {"lengths": {"q[m]": AL}}
    tensors = dict(C=torch.empty(5, 2), AV=AV, AK=AK, B=B)
    api.insum(stmt, backend="triton", **facts, **tensors)  # prepares the call
    (call,) = execute._PREPARED.values()
    call.aligned = (True,) * len(call.bound.value_names)
    pinned = execute.pin([(stmt, tensors, facts)], varying=frozenset({"C", "B"}), backend="triton")
    assert pinned is not None and pinned.arguments is not None
    C = torch.empty(5, 2)
    assert pinned.ready(B) and pinned.run({"C": C, "B": B})
    _close(C, (AV.unsqueeze(2) * B[AK]).sum(1))
    shifted = torch.randn(9, generator=gen)[1:].view(4, 2)  # same signature, 4 bytes past an aligned start
    assert shifted.data_ptr() % 16 != 0
    assert not pinned.run({"C": torch.empty(5, 2), "B": shifted})  # ran nothing: the full path must run


def _plan(fmt):
    return next(iter(fmt.__dict__["_spmm_plans"].values()))


@pytest.mark.parametrize("K, kept", [(16, "window"), (15, "method")], ids=["whole-blocks", "padded"])
def test_pinned_views_follow_each_operands_offset(K, kept, monkeypatch):
    """A pinned Block-ELL product views B and C as the format would (`_SpmmPlan._views`): B
    given as windows of one larger tensor at other offsets each call (the plan's key has no
    offset) is read where it lies; with K not a whole number of blocks the operand is a
    padded copy, which the format's own method makes on every call."""
    gen = torch.Generator().manual_seed(21)
    A = torch.randn(10, K, generator=gen) * (torch.rand(10, K, generator=gen) < 0.5)
    fmt = BlockGroupCOO.from_dense(A, block=(4, 4), group_size="row")
    storage = torch.randn(6 * K + 3, 5, generator=gen)
    for _ in range(3):
        fmt.spmm(storage[:K], backend="triton")
    plan = _plan(fmt)
    assert plan.pinned is not None
    operand, result = plan.views
    assert result is not None and result != ()  # C (12, 5) viewed as its first 10 rows
    assert (operand is not None) == (kept == "window")
    runs = _count_pinned(monkeypatch)
    for start in (1, K + 2, 3 * K, 5 * K + 3):
        B = storage[start:start + K]
        got = fmt.spmm(B, backend="triton")
        assert got.shape == (10, 5)
        _close(got, A.double() @ B.double())
    assert len(runs) == 4


def test_pinned_views_of_a_cast_operand_and_a_vector(monkeypatch):
    """B cast per call (a half B into a float32 format) is a new tensor each time: its view
    is made by the format's method; a vector B is viewed as one column."""
    gen = torch.Generator().manual_seed(22)
    A = torch.randn(8, 12, generator=gen) * (torch.rand(8, 12, generator=gen) < 0.5)
    fmt = BlockGroupCOO.from_dense(A, block=(4, 4), group_size="row")
    runs = _count_pinned(monkeypatch)
    for _ in range(4):
        B = torch.randn(12, 3, generator=gen).half()
        _close(fmt.spmm(B, backend="triton"), A.double() @ B.double())
    assert _plan(fmt).views[0] is None and len(runs) == 2
    _vector_products(fmt, A, gen)
    assert len(runs) == 4
