"""The repeated call's fast path (issue 10, launch path): a call like an earlier one goes
straight to its prepared launch, and still behaves exactly as the full path.

Each test prepares a call, then changes one thing the full path checks (an environment
switch, aliasing, gradients, a dtype, values updated in place) and checks that the repeat
notices. The kernel path runs in the interpreter at small sizes."""

from __future__ import annotations

import pytest
import torch
from kernel_env import CUDA  # before insum: the interpreter on CPU-only machines

import insum
from insum import api, runtime
from insum.errors import InsumError, InsumIndexError, InsumTypeError
from insum.formats import CELL, COO, ELL, GroupCOO

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(CUDA, reason="CPU tensors in the interpreter; on CUDA tests/test_direct_launch.py repeats calls"),
]

GROUP = "C[AM[p],n] += AV[p,q]*B[AK[p,q],n]"
DENSE = "C[m,n] = A[m,k]*B[k,n]"


def _group_tensors(seed: int, G: int = 5, g: int = 3, M: int = 7, K: int = 6, N: int = 5):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        AM=torch.randint(0, M, (G,), generator=gen),
        AK=torch.randint(0, K, (G, g), generator=gen),
        AV=torch.randn(G, g, generator=gen),
        B=torch.randn(K, N, generator=gen),
        C=torch.randn(M, N, generator=gen),
    )


def _reference(t: dict) -> torch.Tensor:
    C = t["C"].double().clone()
    C.index_add_(0, t["AM"], (t["AV"].double().unsqueeze(2) * t["B"].double()[t["AK"]]).sum(1))
    return C


def _no_full_path(monkeypatch) -> None:
    """Make the full path fail: a call that reaches it now is not a repeat."""

    def fail(*args, **kwargs):
        raise AssertionError("the full path ran")

    monkeypatch.setattr(api, "bind", fail)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_repeat_skips_the_full_path_and_computes_on_new_values(backend, monkeypatch):
    insum.insum(GROUP, backend=backend, **_group_tensors(0))
    _no_full_path(monkeypatch)
    for seed in (1, 2):  # same signature, new values
        t = _group_tensors(seed)
        expected = _reference(t)
        out = insum.insum(GROUP, backend=backend, **t)
        assert out is t["C"]
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("declared", [{"AK"}, ["AK"], ("AK",), "AK", frozenset({"AK"})])
def test_declared_names_in_any_collection_repeat(declared, monkeypatch):
    """sorted_indices / unique_indices given as a set, list, tuple or one name (the documented
    type is frozenset) still find the prepared call: an unhashable key sent every such call
    down the full path (~130 us of host time a call on an H200 host)."""
    expr = "C[p,n] += AV[p,q]*B[AK[p,q],n]"

    def tensors(seed):
        t = _group_tensors(seed, M=5)
        del t["AM"]
        t["AK"] = t["AK"].sort(1).values
        return t

    insum.insum(expr, backend="triton", sorted_indices=declared, **tensors(0))
    _no_full_path(monkeypatch)
    t = tensors(1)
    expected = t["C"].double() + (t["AV"].double().unsqueeze(2) * t["B"].double()[t["AK"]]).sum(1)
    out = insum.insum(expr, backend="triton", sorted_indices=declared, **t)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_repeat_allocates_a_fresh_output(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    A, B = torch.randn(5, 4, generator=gen), torch.randn(4, 3, generator=gen)
    first = insum.insum(DENSE, backend="triton", A=A, B=B)
    _no_full_path(monkeypatch)
    second = insum.insum(DENSE, backend="triton", A=A * 2, B=B)
    assert second.data_ptr() != first.data_ptr()
    torch.testing.assert_close(second.double(), (A * 2).double() @ B.double())


def test_other_options_or_signature_take_the_full_path(monkeypatch):
    t = _group_tensors(0, N=11)  # a signature no other test uses
    insum.insum(GROUP, backend="triton", **t)
    calls = []
    real = api.bind
    monkeypatch.setattr(api, "bind", lambda *a: calls.append(1) or real(*a))
    insum.insum(GROUP, backend="torch", **_group_tensors(1, N=11))  # another backend
    insum.insum(GROUP, backend="triton", **_group_tensors(1, G=6, N=11))  # another shape
    t32 = {k: (v.int() if k in ("AM", "AK") else v) for k, v in _group_tensors(1, N=11).items()}
    insum.insum(GROUP, backend="triton", **t32)  # another index dtype
    assert len(calls) == 3


def test_wrong_inputs_after_a_repeat_raise_the_same_errors():
    t = _group_tensors(0)
    insum.insum(GROUP, backend="triton", **t)
    with pytest.raises(InsumTypeError, match="index tensor AK has dtype torch.float32"):
        insum.insum(GROUP, backend="triton", **dict(t, AK=t["AK"].float()))
    with pytest.raises(InsumError, match="unknown backend"):
        insum.insum(GROUP, backend="cuda", **t)
    with pytest.raises(InsumError, match="missing tensor"):
        insum.insum(GROUP, backend="triton", **{k: v for k, v in t.items() if k != "AV"})


def test_aliasing_is_detected_on_a_repeat():
    gen = torch.Generator().manual_seed(4)
    A, B, C = (torch.randn(4, 4, generator=gen) for _ in range(3))
    insum.insum(DENSE, backend="triton", A=A, B=B, C=C)
    with pytest.raises(InsumError, match="shares memory with the input B"):
        insum.insum(DENSE, backend="triton", A=A, B=B, C=B)


def test_an_environment_switch_changed_between_calls_takes_effect(monkeypatch):
    t = _group_tensors(0)
    monkeypatch.delenv("INSUM_CHECK_INDICES", raising=False)
    insum.insum(GROUP, backend="triton", **t)
    bad = dict(t, AK=t["AK"].clone())
    bad["AK"][0, 0] = 99
    monkeypatch.setenv("INSUM_CHECK_INDICES", "1")
    with pytest.raises(InsumIndexError, match="AK"):
        insum.insum(GROUP, backend="triton", **bad)
    insum.insum(GROUP, backend="triton", **t)  # prepared with the check on: checks again
    with pytest.raises(InsumIndexError, match="AK"):
        insum.insum(GROUP, backend="triton", **bad)


def test_gradients_switched_on_after_a_repeat_are_derived():
    t = _group_tensors(0)
    t["AV"].requires_grad_(True)
    with torch.no_grad():  # prepared without gradients
        insum.insum(GROUP, backend="torch", **dict(t, C=t["C"].clone()))
        insum.insum(GROUP, backend="torch", **dict(t, C=t["C"].clone()))
    y = insum.insum(GROUP, backend="torch", **dict(t, C=torch.zeros(7, 5)))
    assert y.requires_grad
    y.sum().backward()
    torch.testing.assert_close(t["AV"].grad, t["B"][t["AK"]].sum(2))


FORMATS = [GroupCOO, ELL, CELL, COO]


def _matrix(seed: int, M: int = 9, K: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(M, K, generator=gen) * (torch.rand(M, K, generator=gen) < 0.4)
    A[2] = 0  # an empty row
    A[5] = torch.randn(K, generator=gen)  # a full one
    return A


@pytest.mark.parametrize("cls", FORMATS, ids=lambda c: c.__name__)
def test_format_repeat_computes_on_new_operands(cls):
    A = _matrix(0)
    fmt = cls.from_dense(A)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        B = torch.randn(7, 3, generator=gen)
        torch.testing.assert_close(fmt.spmm(B, backend="triton").double(), A.double() @ B.double())
    v = torch.randn(7, generator=gen)  # a vector: another plan
    torch.testing.assert_close(fmt.spmm(v, backend="triton").double(), A.double() @ v.double())
    Bt = torch.randn(3, 7, generator=gen).t()  # other strides
    torch.testing.assert_close(fmt.spmm(Bt, backend="triton").double(), A.double() @ Bt.double())


def test_format_repeat_sees_values_updated_in_place():
    A = _matrix(1).half()
    fmt = GroupCOO.from_dense(A)
    B = torch.randn(7, 4)
    first = fmt.spmm(B, backend="triton")  # fp16 values cast to float32 on every call
    fmt.AV.mul_(2)
    second = fmt.spmm(B, backend="triton")
    torch.testing.assert_close(second, 2 * first)


def test_format_repeat_keeps_the_checks():
    fmt = ELL.from_dense(_matrix(2))
    fmt.spmm(torch.randn(7, 3), backend="triton")
    with pytest.raises(InsumError, match="B dimension 0 has 6"):
        fmt.spmm(torch.randn(6, 3), backend="triton")
    with pytest.raises(InsumTypeError):
        fmt.spmm(torch.randint(0, 3, (7, 3)), backend="triton")
    moved = fmt.to("cpu")
    assert "_spmm_plans" not in moved.__dict__


# -- several statements in one launch (insum_many; CELL's buckets) ------------------------


def _skewed(seed: int, M: int, K: int, long_row: int | None) -> torch.Tensor:
    """Rows of 0..K entries (power-of-two and odd lengths, empty rows) and one full row."""
    gen = torch.Generator().manual_seed(seed)
    A = torch.zeros(M, K)
    for r in range(M):
        n = (0, 1, 2, 3, 5, 7, 12)[r % 7] % (K + 1)
        A[r, torch.randperm(K, generator=gen)[:n]] = torch.randn(n, generator=gen)
    if long_row is not None:
        A[long_row] = torch.randn(K, generator=gen)
    return A


@pytest.mark.parametrize(
    "M, K, partitions, index_dtype, dtype",
    [
        (37, 29, 1, torch.int64, torch.float32),  # segment reduction (sorted rows)
        (37, 29, 2, torch.int32, torch.float32),  # atomics (partitions interleave rows)
        (21, 40, 1, torch.int32, torch.float16),  # half values, float32 accumulation
    ],
)
def test_cell_buckets_run_as_one_launch(M, K, partitions, index_dtype, dtype, monkeypatch):
    A = _skewed(M + K, M, K, long_row=M // 2).to(dtype)
    fmt = CELL.from_dense(A, partitions=partitions, index_dtype=index_dtype)
    assert len(fmt.widths) >= 3
    gen = torch.Generator().manual_seed(5)
    fmt.spmm(torch.randn(K, 6, generator=gen).to(dtype), backend="triton")  # one by one, prepares
    launches = []
    real = runtime.BatchLaunch.run
    monkeypatch.setattr(runtime.BatchLaunch, "run", lambda self, calls: launches.append(1) or real(self, calls))
    monkeypatch.setattr(api, "insum", None)  # a statement run on its own would fail now
    for _ in range(2):
        B = torch.randn(K, 6, generator=gen).to(dtype)
        got = fmt.spmm(B, backend="triton")
        torch.testing.assert_close(got.double(), A.double() @ B.double(), rtol=1e-2 if dtype != torch.float32 else 1e-5,
                                   atol=1e-2 if dtype != torch.float32 else 1e-5)
    assert len(launches) == 2


def test_a_statement_reading_another_ones_output_runs_in_order():
    gen = torch.Generator().manual_seed(6)
    rows = torch.tensor([0, 2, 2, 1])
    A1, A2 = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    B = torch.randn(4, 3, generator=gen)
    stmt = "C[I[p],n] += A[p]*B[p,n]"
    for step in range(3):
        C1, C2 = torch.zeros(4, 3), torch.zeros(4, 3)
        first = (stmt, dict(C=C1, I=rows, A=A1, B=B))
        if step < 2:  # independent: one launch from the second call on
            insum.insum_many([first, (stmt, dict(C=C1, I=rows, A=A2, B=B))], backend="triton")
            expected = torch.zeros(4, 3).index_add_(0, rows, (A1 + A2).unsqueeze(1) * B)
            torch.testing.assert_close(C1, expected)
        else:  # the second reads the first's output: in order, as two insum() calls
            insum.insum_many([first, (stmt, dict(C=C2, I=rows, A=A2, B=C1))], backend="triton")
            C1_expected = torch.zeros(4, 3).index_add_(0, rows, A1.unsqueeze(1) * B)
            expected = torch.zeros(4, 3).index_add_(0, rows, A2.unsqueeze(1) * C1_expected)
            torch.testing.assert_close(C2, expected)


def test_batch_of_calls_with_facts_as_a_set_repeats_as_one_launch(monkeypatch):
    """Found by fuzzing: facts given as a set (not the frozenset the formats pass) made the
    batch's key unhashable, and every repeat ran the calls one by one."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.tensor([0, 1, 1, 3])
    stmt = "C[I[p],n] += A[p]*B[p,n]"
    A1, A2, B = torch.randn(4, generator=gen), torch.randn(4, generator=gen), torch.randn(4, 3, generator=gen)
    C = torch.zeros(4, 3)
    calls = [(stmt, dict(C=C, I=rows, A=A1, B=B), {"sorted_indices": {"I"}}),
             (stmt, dict(C=C, I=rows, A=A2, B=B), {"sorted_indices": ["I"]})]
    insum.insum_many(calls, backend="triton")  # one by one, prepares the batch
    launches = []
    real = runtime.BatchLaunch.run
    monkeypatch.setattr(runtime.BatchLaunch, "run", lambda self, calls: launches.append(1) or real(self, calls))
    insum.insum_many(calls, backend="triton")
    assert launches == [1]
    torch.testing.assert_close(C, 2 * torch.zeros(4, 3).index_add_(0, rows, (A1 + A2).unsqueeze(1) * B))


@pytest.mark.parametrize("bad, message", [
    (dict(covering="x", disjoint=True), "covering is an integer"),
    (dict(covering=0, disjoint=True), "covering is an integer"),
    (dict(covering=16), "pass disjoint=True"),
    (dict(disjoint="yes"), "disjoint is a bool"),
])
def test_insum_many_checks_its_options_before_running(bad, message):
    """Found by fuzzing: a bad `covering` raised after every statement had written its output."""
    C = torch.zeros(4, 3)
    call = ("C[I[p],n] += A[p]*B[p,n]", dict(C=C, I=torch.tensor([0, 1]), A=torch.ones(2), B=torch.ones(2, 3)))
    with pytest.raises(insum.InsumError, match=message):
        insum.insum_many([call], **bad)
    assert not C.any()


@pytest.mark.parametrize("calls, message", [
    (["C[I[p],n] += A[p]*B[p,n]"], "is \\(expr, tensors\\)"),
    ([("C[I[p],n] += A[p]*B[p,n]", [torch.ones(2)])], "are dicts"),
    ([("C[I[p],n] += A[p]*B[p,n]", {}, {"backend": "torch"})], "not backend"),
])
def test_insum_many_checks_its_calls(calls, message):
    with pytest.raises(insum.InsumError, match=message):
        insum.insum_many(calls)


def test_batch_source_has_one_part_function_per_statement():
    from insum.bind import bind
    from insum.codegen import emit_batch
    from insum.parser import parse
    from insum.runtime import spec_for

    fmt = CELL.from_dense(_skewed(1, 20, 16, long_row=3))
    kernels = []
    for expr, tensors in fmt.statements():
        bound = bind(parse(expr), dict(tensors, B=torch.zeros(16, 4), C=torch.zeros(20, 4)))
        kernels.append(runtime.Kernel(spec_for(bound, sorted_indices=frozenset({"RI"}))))
    batch = emit_batch([k.emitted for k in kernels])
    assert batch.text.count("def _segment_add") == 1
    assert batch.text.count("tl.program_id(0)") == 1
    for i in range(len(kernels)):
        assert f"def insum_part_{i}(" in batch.text and f"BLOCK_M_{i}: tl.constexpr" in batch.text
    compile(batch.text, "batch", "exec")  # valid Python


def test_repeat_with_declared_lengths(monkeypatch):
    """A call with `lengths=` repeats too: new length values are read, padding skipped."""
    stmt = "C[m,n] = AV[m,q]*B[AK[m,q],n]"

    def case(seed):
        gen = torch.Generator().manual_seed(seed)
        AL = torch.randint(0, 6, (9,), generator=gen)
        AV = torch.randn(9, 5, generator=gen) * (torch.arange(5) < AL.unsqueeze(1))  # zero padding
        AK = torch.randint(0, 7, (9, 5), generator=gen)
        B = torch.randn(7, 3, generator=gen)
        return dict(AV=AV, AK=AK, B=B), AL

    tensors, AL = case(0)
    insum.insum(stmt, backend="triton", lengths={"q[m]": AL}, **tensors)
    calls = []
    real = api.bind
    monkeypatch.setattr(api, "bind", lambda *a: calls.append(1) or real(*a))
    for seed in (1, 2):
        tensors, AL = case(seed)
        AV = tensors["AV"].clone()
        tensors["AV"][:, :] += 100 * (torch.arange(5) >= AL.unsqueeze(1))  # poison what the lengths skip
        out = insum.insum(stmt, backend="triton", lengths={"q[m]": AL}, **tensors)
        expected = (AV.double().unsqueeze(2) * tensors["B"].double()[tensors["AK"]]).sum(1)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert not calls
    insum.insum(stmt, backend="triton", lengths={"q[m]": AL.int()}, **tensors)  # another length dtype
    assert calls == [1]


def test_batch_of_descriptor_kernels_repeats_only_at_their_alignment(monkeypatch):
    """A kernel that loads through tensor descriptors (a Hopper GPU) was compiled for its value
    tensors' 16-byte alignment: a batch of such parts repeats as one launch only while every
    part's tensors keep it, as a single prepared call does. The descriptor case is simulated
    by marking the prepared calls aligned (the CPU has no descriptors)."""
    from insum import execute
    from insum.cache import BoundedCache

    monkeypatch.setattr(execute, "_PREPARED", BoundedCache())  # calls prepared by other tests stay unmarked
    monkeypatch.setattr(execute, "_BATCHED", BoundedCache())
    stmt = "C[I[p],n] += A[p]*B[p,n]"
    gen = torch.Generator().manual_seed(8)
    rows = torch.tensor([0, 2, 2, 1])
    A1, B = torch.randn(4, generator=gen), torch.randn(4, 3, generator=gen)
    shifted = torch.randn(5, generator=gen)[1:]  # same signature, 4 bytes past an aligned start
    assert shifted.data_ptr() % 16 != 0

    def calls(C, A2):
        return [(stmt, dict(C=C, I=rows, A=A1, B=B)), (stmt, dict(C=C, I=rows, A=A2, B=B))]

    A2 = torch.randn(4, generator=gen)
    for _, tensors in calls(torch.zeros(4, 3), A2):
        insum.insum(stmt, backend="triton", **tensors)  # prepares each call
    for call in execute._PREPARED.values():
        call.aligned = (True,) * len(call.bound.value_names)
    options = ("triton", "tf32", None, None, False, None)
    insum.insum_many(calls(torch.zeros(4, 3), A2), backend="triton")  # one by one, prepares the batch
    assert execute.prepared_batch(calls(torch.zeros(4, 3), A2), options) is not None
    assert execute.prepared_batch(calls(torch.zeros(4, 3), shifted), options) is None
    C = torch.zeros(4, 3)
    insum.insum_many(calls(C, shifted), backend="triton")
    torch.testing.assert_close(C, torch.zeros(4, 3).index_add_(0, rows, (A1 + shifted).unsqueeze(1) * B))


def test_batch_never_runs_a_call_that_reads_another_calls_output(monkeypatch):
    """Found by fuzzing: where one call read another's output (the same tensor), the repeated
    `insum_many` still ran them as one launch, whose programs run in any order (on an H200 every
    repeat was off by 17). Such calls keep running one by one; calls that only share inputs
    still batch."""
    from insum import execute
    from insum.cache import BoundedCache

    monkeypatch.setattr(execute, "_BATCHED", BoundedCache())
    stmt = "C[I[p],n] += A[p]*B[p,n]"
    gen = torch.Generator().manual_seed(9)
    I1, I2 = torch.randint(0, 6, (6,), generator=gen), torch.randint(0, 6, (6,), generator=gen)
    A1, A2, B = torch.randn(6, generator=gen), torch.randn(6, generator=gen), torch.randn(6, 3, generator=gen)
    options = ("triton", "tf32", None, None, False, None)

    def chained(C1, C2):  # the second call reads C1, which the first writes
        return [(stmt, dict(C=C1, I=I1, A=A1, B=B)), (stmt, dict(C=C2, I=I2, A=A2, B=C1))]

    def shared(C1, C2):
        return [(stmt, dict(C=C1, I=I1, A=A1, B=B)), (stmt, dict(C=C2, I=I2, A=A2, B=B))]

    for build in (chained, shared):
        for _ in range(3):
            C1, C2 = torch.zeros(6, 3), torch.zeros(6, 3)
            insum.insum_many(build(C1, C2), backend="triton")
            first = torch.zeros(6, 3, dtype=torch.float64).index_add_(0, I1, A1.double()[:, None] * B.double())
            second_in = first if build is chained else B.double()
            second = torch.zeros(6, 3, dtype=torch.float64).index_add_(0, I2, A2.double()[:, None] * second_in)
            torch.testing.assert_close(C1.double(), first)
            torch.testing.assert_close(C2.double(), second)
        batched = execute.prepared_batch(build(torch.zeros(6, 3), torch.zeros(6, 3)), options)
        assert (batched is None) == (build is chained)
