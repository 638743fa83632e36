"""The torch.library operators: opcheck, torch.compile(fullgraph=True) without graph breaks
or recompiles, dynamic nnz, in-place mutation, and `fmt @ B` under compile (CPU: the torch
lowering runs inside the operators; aot_eager keeps the tests fast)."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch
from statements import build, case
from torch._dynamo.testing import CompileCounterWithBackend
from torch.library import opcheck

from insum import execute, insum
from insum.formats import CELL, COO, ELL, NM, BlockGroupCOO, GroupCOO
from insum.parser import parse

SPMM = "C[AM[p],n] += AV[p,q]*B[AK[p,q],n]"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Without duck sizing, two sizes that happen to be equal (nnz and a width, say) are not
    # assumed equal, so a recompile count measures the sizes that matter, not coincidences.
    torch._dynamo.reset()
    config = torch.fx.experimental._config
    with config.patch(use_duck_shape=False) if hasattr(config, "use_duck_shape") else nullcontext():
        yield
    torch._dynamo.reset()


def spmm_inputs(groups: int, *, seed: int = 0, rows: int = 6, cols: int = 5, width: int = 3):
    g = torch.Generator().manual_seed(seed)
    return {
        "AM": torch.randint(0, rows, (groups,), generator=g),
        "AK": torch.randint(0, 4, (groups, width), generator=g),
        "AV": torch.randn(groups, width, generator=g),
        "B": torch.randn(4, cols, generator=g),
    }


def split(tensors: dict[str, torch.Tensor]):
    return list(tensors), list(tensors.values())


# ---------------------------------------------------------------- opcheck


@pytest.mark.parametrize("case_id", ["group_coo_spmm", "coo_spmm_overwrite", "dot", "block_group_coo"])
def test_opcheck_in_place(case_id):
    c = case(case_id)
    tensors = build(c, seed=0)
    out = tensors.pop(c.output)
    names, values = split(tensors)
    opcheck(torch.ops.insum.insum_.default, (c.stmt, out, names, values, "torch", "tf32"))


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case_id", ["group_coo_spmm", "coo_spmm_overwrite", "ell_spmm", "dot"])
def test_opcheck_functional(case_id, requires_grad):
    c = case(case_id)
    tensors = build(c, seed=0, dtype=torch.float64)
    out = tensors.pop(c.output)
    for t in tensors.values():
        if t.is_floating_point():
            t.requires_grad_(requires_grad)
    names, values = split(tensors)
    if c.stmt.split("=")[0].endswith("+"):
        args = (c.stmt, out, names, values, None, None, "torch", "ieee")  # += into a copy of out
    else:
        args = (c.stmt, None, names, values, list(out.shape), out.dtype, "torch", "ieee")
    opcheck(torch.ops.insum.insum.default, args)
    if not c.needs_out:  # the output allocated by the operator itself
        opcheck(torch.ops.insum.insum.default, (c.stmt, None, names, values, None, None, "torch", "ieee"))


@pytest.mark.skipif(not INTERPRET, reason="the generated kernels need TRITON_INTERPRET=1 on the CPU")
def test_opcheck_generated_kernel():
    tensors = spmm_inputs(4)
    names, values = split(tensors)
    opcheck(torch.ops.insum.insum_.default, (SPMM, torch.zeros(6, 5), names, values, "triton", "ieee"))
    opcheck(
        torch.ops.insum.insum.default,
        (SPMM, torch.zeros(6, 5), names, values, None, None, "triton", "ieee"),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_in_place_is_declared_as_a_mutation():
    schema = torch.ops.insum.insum_.default._schema
    assert schema.is_mutable
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == ["out"]
    assert not torch.ops.insum.insum.default._schema.is_mutable


# ---------------------------------------------------------------- torch.compile


def test_compile_in_place_fullgraph_and_no_recompile_on_new_values():
    def f(C, tensors):
        insum(SPMM, C=C, backend="torch", **tensors)
        return C * 2

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for seed in range(3):
        tensors = spmm_inputs(4, seed=seed)
        C, C_eager = torch.randn(6, 5), None
        C_eager = C.clone()
        got = compiled(C, tensors)
        want = f(C_eager, tensors)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(C, C_eager)  # the passed output was updated in place
    assert counter.frame_count == 1


def test_compile_allocated_output_dynamic_nnz_compiles_once():
    def f(tensors):
        return insum("C[p, n] += AV[p, q] * B[AK[p, q], n]", backend="torch", **tensors).relu()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for groups in (3, 7, 12):
        tensors = spmm_inputs(groups)
        del tensors["AM"]
        torch.testing.assert_close(compiled(tensors), f(tensors))
    assert counter.frame_count == 1


def test_compile_mark_dynamic_nnz():
    def f(C, tensors):
        return insum(SPMM, C=C, backend="torch", **tensors).sum(1)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for groups in (3, 7, 12):
        tensors = spmm_inputs(groups)
        for name in ("AM", "AK", "AV"):
            torch._dynamo.mark_dynamic(tensors[name], 0)
        torch.testing.assert_close(compiled(torch.zeros(6, 5), tensors), f(torch.zeros(6, 5), tensors))
    assert counter.frame_count == 1


def test_compile_backward_matches_eager():
    def f(AV, B, rest):
        C = torch.zeros(6, 5)
        return insum(SPMM, C=C, AV=AV, B=B, backend="torch", **rest).square().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for groups in (3, 9):
        tensors = spmm_inputs(groups)
        grads = []
        for fn in (compiled, f):
            AV = tensors["AV"].clone().requires_grad_(True)
            B = tensors["B"].clone().requires_grad_(True)
            fn(AV, B, {"AM": tensors["AM"], "AK": tensors["AK"]}).backward()
            grads.append((AV.grad, B.grad))
        torch.testing.assert_close(grads[0], grads[1])
    assert counter.frame_count == 1


def test_compile_passes_facts_and_lengths_to_the_kernel(monkeypatch):
    """Under torch.compile (forward and backward) the operators hand sorted_indices,
    unique_indices and the declared lengths to the executor, as the direct call does; the
    gradient statements run without them and give the same gradients as eager."""
    seen, run = [], execute.run

    def recording_run(bound, out, **options):
        seen.append((str(bound.stmt), options["sorted_indices"], options["unique_indices"], options["lengths"]))
        return run(bound, out, **options)

    monkeypatch.setattr(execute, "run", recording_run)
    tensors = spmm_inputs(5)
    AL = torch.tensor([3, 0, 1, 2, 3])
    AM = torch.arange(5)  # distinct and sorted rows

    def f(C, AV, B):
        insum(SPMM, C=C, AV=AV, B=B, AM=AM, AK=tensors["AK"], sorted_indices={"AM"}, unique_indices={"AM"},
              lengths={"q[p]": AL}, backend="torch")
        return C.square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (compiled, f):
        execute._PREPARED.clear()  # each forward through the full path (a repeat skips `run`)
        AV = tensors["AV"].clone().requires_grad_(True)
        B = tensors["B"].clone().requires_grad_(True)
        fn(torch.zeros(6, 5), AV, B).backward()
        grads.append((AV.grad, B.grad))
    torch.testing.assert_close(grads[0], grads[1])
    statement = str(parse(SPMM))
    forward = [entry for entry in seen if entry[0] == statement]
    assert len(forward) == 2  # compiled and eager
    for _, sorted_, unique, lengths in forward:
        assert sorted_ == unique == frozenset({"AM"})
        assert [(var, index) for var, _, index, *_ in lengths] == [("q", ("p",))]
    gradients = [entry for entry in seen if entry[0] != statement]
    assert gradients and all(entry[1:] == (frozenset(), frozenset(), ()) for entry in gradients)


def test_operators_repeat_a_prepared_call(monkeypatch):
    """A compiled graph calls the operators every step: a call like an earlier one (text,
    options, tensor signatures) goes straight to its prepared launch, not through bind and
    `run` again, and still reads the new tensors."""
    calls, run = [], execute.run

    def counting_run(bound, out, **options):
        calls.append(str(bound.stmt))
        return run(bound, out, **options)

    monkeypatch.setattr(execute, "run", counting_run)
    execute._PREPARED.clear()
    compiled = torch.compile(lambda C, AV, B, AM, AK: insum(SPMM, C=C, AV=AV, B=B, AM=AM, AK=AK, backend="torch"),
                             backend="aot_eager", fullgraph=True)
    for seed in range(3):
        t = spmm_inputs(5, seed=seed)
        expected = torch.zeros(6, 5).index_add_(0, t["AM"], (t["AV"][:, :, None] * t["B"][t["AK"]]).sum(1))
        torch.testing.assert_close(compiled(torch.zeros(6, 5), **t), expected)
    assert len(calls) == 1


def test_opcheck_with_declared_lengths():
    """A declared length travels among the tensors under "lengths:q[p]"."""
    tensors = spmm_inputs(4)
    names, values = split(tensors)
    names.append("lengths:q[p]")
    values.append(torch.tensor([3, 0, 2, 1]))
    opcheck(torch.ops.insum.insum.default, (SPMM, None, names, values, [6, 5], None, "torch", "ieee", None, None,
                                            ["AM"], None))


FORMATS = [
    (GroupCOO, {"group_size": 2}),
    (COO, {}),
    (ELL, {}),
    (BlockGroupCOO, {"block": (2, 2)}),
    (NM, {"vector_len": 2}),
    (CELL, {"max_width": 2}),
]


@pytest.mark.parametrize("fmt_cls, params", FORMATS, ids=[f.__name__ for f, _ in FORMATS])
def test_compile_format_spmm_with_changing_nnz(fmt_cls, params):
    def f(fmt, B):
        return fmt.spmm(B) * 2

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    structures = set()
    for density in (0.3, 0.6, 0.9):
        A = torch.randn(10, 8, generator=g) * (torch.rand(10, 8, generator=g) < density)
        fmt = fmt_cls.from_dense(A, **params)
        structures.add(tuple(fmt.tensors))
        B = torch.randn(8, 3, generator=g)
        torch.testing.assert_close(compiled(fmt, B), fmt.to_dense() @ B * 2, rtol=1e-5, atol=1e-5)
    # CELL runs one statement per bucket width: a new set of widths is a new graph.
    assert counter.frame_count == len(structures)


def test_compile_format_matmul_operator():
    compiled = torch.compile(lambda fmt, B: (fmt @ B) * 2, backend="aot_eager", fullgraph=True)
    A = torch.randn(10, 8) * (torch.rand(10, 8) < 0.5)
    B = torch.randn(8, 3)
    torch.testing.assert_close(compiled(GroupCOO.from_dense(A), B), A @ B * 2)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_dense_times_format_is_not_taken_for_format_times_dense(fullgraph):
    """Found by fuzzing: dynamo handed `B @ fmt` and `fmt @ B` over alike (as
    `Tensor.matmul(B, fmt)`), so a compiled `B @ fmt` silently computed fmt @ B where both
    shapes fit. `fmt @ B` now arrives as `Tensor.__rmatmul__` (`_reflected_matmul_in_dynamo`)
    and `B @ fmt` raises, as it does eagerly."""
    torch._dynamo.reset()
    A = torch.randn(6, 6) * (torch.rand(6, 6) < 0.5)
    B = torch.randn(6, 6)
    fmt = GroupCOO.from_dense(A)
    right = torch.compile(lambda B: fmt @ B, backend="eager", fullgraph=fullgraph)
    torch.testing.assert_close(right(B), A @ B)
    for left in (lambda B: B @ fmt, lambda B: B.matmul(fmt)):
        with pytest.raises(Exception, match="not supported|unsupported operand|Observed exception"):
            torch.compile(left, backend="eager", fullgraph=fullgraph)(B)
    with pytest.raises(TypeError):
        B @ fmt
