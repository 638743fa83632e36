"""Autograd by derivation: the derived gradient statements, gradcheck on the torch lowering
for every curated statement, and the generated kernels' gradients against the lowering's."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from statements import CASES, build, case

import insum.api as api
import insum.library as library
from insum import InsumError, insum
from insum.autograd import derive, tensor_names

SPMM = "C[AM[p],n] += AV[p,q]*B[AK[p,q],n]"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def lines(derivation) -> list[str]:
    return str(derivation).splitlines()


# ---------------------------------------------------------------- derivation on the IR


def test_spmm_gradients_swap_gathers_and_scatters():
    assert lines(derive(SPMM)) == [
        "dAV[p, q] += dC[AM[p], n] * B[AK[p, q], n]",
        "dB[AK[p, q], n] += AV[p, q] * dC[AM[p], n]",
        "dC: the output gradient itself (+=)",
    ]


def test_index_tensors_get_no_gradient():
    d = derive(SPMM)
    assert set(d.gradients) == {"AV", "B"}
    with pytest.raises(InsumError, match="AK is an index tensor"):
        derive(SPMM, wrt="AK")
    with pytest.raises(InsumError, match="does not read a tensor named X"):
        derive(SPMM, wrt="X")


def test_overwrite_has_no_output_passthrough():
    d = derive("C[m, n] = A[m, k] * B[k, n]")
    assert not d.passthrough
    with pytest.raises(InsumError, match="overwrites C"):
        derive("C[m, n] = A[m, k] * B[k, n]", wrt="C")
    derive("C[m, n] += A[m, k] * B[k, n]", wrt="C")  # `+=`: the incoming C is differentiable


def test_factor_twice_gets_one_statement_per_appearance():
    d = derive(case("shift").stmt)
    assert [str(s) for s in d.gradients["X"]] == [
        "dX[i + 1] += dD[i] * X[i + 2] * W[i]",
        "dX[i + 2] += X[i + 1] * dD[i] * W[i]",
    ]


def test_literals_scalars_and_repeated_variables_are_kept():
    d = derive(case("scalar_factor").stmt)
    assert [str(s) for s in d.gradients["s"]] == ["ds[] += dC[m, n] * A[m, n] * 3"]
    assert [str(s) for s in derive(case("diagonal").stmt).gradients["A"]] == ["dA[i, i] += dO[i]"]
    assert [str(s) for s in derive("S = X[i] * Y[i]").gradients["X"]] == ["dX[i] += dS[] * Y[i]"]


def test_gradient_names_avoid_the_statement_tensors():
    d = derive("C[i] += dC[i] * A[i]")
    assert d.output_grad not in ("C", "dC", "A") and d.grad_names["dC"] not in ("C", "dC", "A")
    assert set(tensor_names(d.gradients["A"][0])) == {d.output_grad, "dC"}


# ---------------------------------------------------------------- gradcheck (torch lowering)


def _differentiable(c, tensors):
    """The value tensors and, for `+=` into a given output, the incoming output."""
    names = [n for n, t in tensors.items() if t.is_floating_point() and n != c.output]
    if c.stmt.split("=")[0].endswith("+"):
        names.append(c.output)
    return names


#: gradcheck's reverse-mode check, and its forward-mode one (tangents against finite
#: differences: before the tangent statements, the eager path dropped every tangent).
GRADCHECKS = {
    "reverse": {},
    "forward": dict(check_forward_ad=True, check_backward_ad=False, check_undefined_grad=False,
                    check_batched_grad=False),
}


@pytest.mark.parametrize("mode", list(GRADCHECKS))
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_gradcheck_every_statement(c, mode):
    tensors = build(c, seed=0, dtype=torch.float64)
    names = _differentiable(c, tensors)

    def f(*values):
        given = dict(tensors)
        given.update(zip(names, values))
        given[c.output] = given[c.output].clone()  # a fresh output per call (+= into a copy)
        return insum(c.stmt, backend="torch", **given)

    inputs = tuple(tensors[n].clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True, **GRADCHECKS[mode])


def test_gradcheck_with_allocated_output_and_second_order():
    tensors = build(case("group_coo_spmm"), seed=1, dtype=torch.float64)
    C0 = tensors.pop("C")
    AV = tensors.pop("AV").requires_grad_(True)
    B = tensors.pop("B").requires_grad_(True)

    def f(AV, B):
        return insum(SPMM, C=C0.clone(), AV=AV, B=B, backend="torch", **tensors)

    assert torch.autograd.gradcheck(f, (AV, B))
    assert torch.autograd.gradgradcheck(f, (AV, B), fast_mode=True)
    ell = build(case("ell_spmm"), seed=1, dtype=torch.float64, with_output=False)
    AV = ell.pop("AV").requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda AV: insum(case("ell_spmm").stmt, AV=AV, backend="torch", **ell), (AV,)
    )


def test_eager_gradients_skip_the_operator_layers(monkeypatch):
    """An eager differentiable call runs as a plain autograd Function (`_EagerInsum`: no
    `torch.library` autograd wrapper on the host path), and its backward calls the gradient
    statements' implementation directly; gradients equal the torch lowering's."""
    tensors = build(case("group_coo_spmm"), seed=2, dtype=torch.float64)
    C0 = tensors.pop("C")
    AV = tensors.pop("AV").requires_grad_(True)
    B = tensors.pop("B").requires_grad_(True)
    operator_calls = []
    real = library.torch.ops.insum.insum

    class Counting:
        def __call__(self, *args, **kwargs):
            operator_calls.append(args[0])
            return real(*args, **kwargs)

    monkeypatch.setattr(library.torch.ops.insum, "insum", Counting())
    dy = torch.randn(C0.shape, dtype=torch.float64)
    results = {}
    for backend in ("torch", "triton") if INTERPRET else ("torch",):
        AV.grad = B.grad = None
        y = insum(SPMM, C=C0.clone(), AV=AV, B=B, backend=backend, **tensors)
        y.backward(dy)
        results[backend] = (AV.grad.clone(), B.grad.clone())
        fresh = insum("O[p] = X[AM[p], k] * Y[AK[p], k]", backend=backend, **{
            "X": torch.randn(5, 3, dtype=torch.float64, requires_grad=True), "Y": torch.randn(4, 3, dtype=torch.float64),
            "AM": torch.tensor([0, 4, 2]), "AK": torch.tensor([1, 3, 3])})
        assert type(fresh.grad_fn).__name__ == "_EagerInsumBackward"
    assert operator_calls == []
    AVd, Bd = AV.detach().requires_grad_(True), B.detach().requires_grad_(True)
    reference = C0.clone()
    reference.index_add_(0, tensors["AM"].long(), (AVd[:, :, None] * Bd[tensors["AK"].long()]).sum(1))
    reference.backward(dy)
    for grads in results.values():
        torch.testing.assert_close(grads[0], AVd.grad)
        torch.testing.assert_close(grads[1], Bd.grad)


def test_only_requested_gradients_are_computed(monkeypatch):
    tensors = build(case("group_coo_spmm"), seed=0)
    AV = tensors.pop("AV").requires_grad_(True)
    ran = []
    real = library._gradient

    def spy(derivation, name, *args):
        ran.append(name)
        return real(derivation, name, *args)

    monkeypatch.setattr(library, "_gradient", spy)
    y = insum(SPMM, AV=AV, backend="torch", **tensors)
    (grad,) = torch.autograd.grad(y.sum(), AV)
    assert ran == ["AV"] and grad.shape == AV.shape


def test_half_precision_gradients_keep_their_dtypes():
    tensors = build(case("group_coo_spmm"), seed=0, dtype=torch.float16)
    tensors["C"] = tensors["C"].float()  # a float32 output of half-precision factors
    AV = tensors.pop("AV").requires_grad_(True)
    B = tensors.pop("B").requires_grad_(True)
    y = insum(SPMM, AV=AV, B=B, backend="torch", **tensors)
    y.sum().backward()
    assert y.dtype == torch.float32 and AV.grad.dtype == B.grad.dtype == torch.float16


def test_eager_call_without_gradients_skips_the_dispatcher(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("went through the custom operator")

    monkeypatch.setattr(api, "call", fail)
    tensors = build(case("group_coo_spmm"), seed=0)
    insum(SPMM, backend="torch", **tensors)
    tensors["AV"].requires_grad_(True)
    with torch.no_grad():
        insum(SPMM, backend="torch", **tensors)
    with pytest.raises(AssertionError, match="custom operator"):
        insum(SPMM, backend="torch", **tensors)


def test_in_place_accumulation_is_recorded():
    tensors = build(case("group_coo_spmm"), seed=0)
    C = tensors["C"]
    before = C.clone()
    tensors["AV"].requires_grad_(True)
    result = insum(SPMM, backend="torch", **tensors)
    assert result is C and result.grad_fn is not None and not torch.equal(C, before)
    with pytest.raises(InsumError, match="shares memory"):
        insum(SPMM, **{**tensors, "C": tensors["B"]})


# ---------------------------------------------------------------- generated kernels


@pytest.mark.skipif(not INTERPRET, reason="the generated kernels need TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_triton_gradients_match_the_lowering(c):
    tensors = build(c, seed=0, dtype=torch.float32)
    names = _differentiable(c, tensors)
    results = {}
    for backend in ("torch", "triton"):
        inputs = {n: tensors[n].clone().requires_grad_(True) for n in names}
        given = {**tensors, **inputs}
        given[c.output] = given[c.output].clone()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="insum: falling back")  # no fallback
            y = insum(c.stmt, backend=backend, **given)
        seed = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        results[backend] = torch.autograd.grad(y, list(inputs.values()), seed)
    for name, got, want in zip(names, results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors: the generated kernel needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_triton_tangents_match_the_lowering(c):
    tensors = build(c, seed=0, dtype=torch.float32)
    names = _differentiable(c, tensors)
    gen = torch.Generator().manual_seed(2)
    tangents = {n: torch.randn(tensors[n].shape, generator=gen) for n in names}
    results = {}
    for backend in ("torch", "triton"):
        given = {n: t.clone() for n, t in tensors.items()}
        with fwAD.dual_level():
            for n in names:
                given[n] = fwAD.make_dual(given[n], tangents[n].clone())  # (C's: updated in place)
            y = insum(c.stmt, backend=backend, **given)
            primal, tangent = fwAD.unpack_dual(y)
            results[backend] = (primal.clone(), tangent.clone())
            assert y is given[c.output] or c.output not in tensors
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_forward_mode_updates_a_plain_output_in_place_with_its_tangent():
    A, B = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    tA = torch.randn(4, 3, dtype=torch.float64)
    C = torch.ones(4, 5, dtype=torch.float64)
    with fwAD.dual_level():
        out = insum("C[m, n] += A[m, k] * B[k, n]", A=fwAD.make_dual(A, tA), B=B, C=C, backend="torch")
        primal, tangent = fwAD.unpack_dual(C)
        assert out is C
        torch.testing.assert_close(primal, 1 + A @ B)
        torch.testing.assert_close(tangent, tA @ B)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hessian_vector_product_forward_over_reverse(backend):
    """Found by fuzzing: a Hessian-vector product (forward mode over a backward) ran the
    backward on primals and gave zero. The operators carry tangents through (`jvp`, and the
    gradient statements on tensors with tangents)."""
    if backend == "triton" and not INTERPRET:
        pytest.skip("CPU tensors: the generated kernel needs TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(0)
    A, x, v = (torch.randn(*s, dtype=torch.float64, generator=gen) for s in ((5, 5), (5,), (5,)))

    def hvp(f):
        with fwAD.dual_level():
            xd = fwAD.make_dual(x.clone().requires_grad_(True), v)
            (g,) = torch.autograd.grad(f(xd), xd)
            return fwAD.unpack_dual(g).tangent

    want = hvp(lambda xd: xd @ A @ xd)
    got = hvp(lambda xd: insum("S[] = X[i] * A[i, j] * X[j]", X=xd, A=A, backend=backend))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(want, (A + A.t()) @ v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_mode_with_lengths_and_an_added_term(backend):
    """Found by fuzzing: the added term's tangent statement was given the product's lengths,
    whose variable it lacks, and raised. A tangent past a length is padding's: not read, on
    either backend (as a gradient there is zero)."""
    if backend == "triton" and not INTERPRET:
        pytest.skip("CPU tensors: the generated kernel needs TRITON_INTERPRET=1")
    AL, AK = torch.tensor([1, 2]), torch.tensor([[0, 0], [1, 0]])
    AV = torch.tensor([[1.0, 0.0], [2.0, 3.0]], dtype=torch.float64)
    B, D = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    tAV, tD = torch.randn(2, 2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    with fwAD.dual_level():
        C = insum("C[p, n] = AV[p, q] * B[AK[p, q], n] + D[p]", AV=fwAD.make_dual(AV, tAV), AK=AK, B=B,
                  D=fwAD.make_dual(D, tD), lengths={"q[p]": AL}, backend=backend)
        primal, tangent = fwAD.unpack_dual(C)
    kept = torch.arange(2) < AL[:, None]  # AV[0, 1] lies past row 0's length
    dense = torch.zeros(2, 2, dtype=torch.float64).index_put_((torch.arange(2)[:, None].expand(2, 2), AK), AV * kept,
                                                               accumulate=True)
    tdense = torch.zeros(2, 2, dtype=torch.float64).index_put_((torch.arange(2)[:, None].expand(2, 2), AK),
                                                                tAV * kept, accumulate=True)
    torch.testing.assert_close(primal, dense @ B + D[:, None])
    torch.testing.assert_close(tangent, tdense @ B + tD[:, None])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_factor_read_twice_gets_no_gradient_past_its_lengths(backend):
    """Found by fuzzing: a tensor read by two factors kept its gradient past the declared
    lengths (the zeroing gave up on more than one appearance), so a step grew its padding.
    Each appearance's part is zeroed where that appearance skips."""
    if backend == "triton" and not INTERPRET:
        pytest.skip("CPU tensors: the generated kernel needs TRITON_INTERPRET=1")
    AL = torch.tensor([1, 3])
    AV = torch.tensor([[2.0, 0.0, 0.0], [1.0, 2.0, 3.0]], dtype=torch.float64, requires_grad=True)
    lengths = {"q[p]": AL, "r[p]": AL}
    insum("O[p] = AV[p, q] * AV[p, r]", AV=AV, lengths=lengths, backend=backend).sum().backward()
    torch.testing.assert_close(AV.grad, torch.tensor([[4.0, 0.0, 0.0], [12.0, 12.0, 12.0]], dtype=torch.float64))
    AV.grad = None  # one appearance under a length, one not: only the first's part is zeroed
    W = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    insum("O[p] = AV[p, q] * W[p, q] * AV[p, r]", AV=AV, W=W, lengths={"q[p]": AL}, backend=backend).sum().backward()
    kept = (torch.arange(3) < AL[:, None]).double()
    Av = AV.detach()
    want = (W * kept) * Av.sum(1, keepdim=True) + (Av * W * kept).sum(1, keepdim=True)
    torch.testing.assert_close(AV.grad, want)


def test_function_transforms_are_refused_by_name():
    """Found by fuzzing: torch.func's transforms failed inside the launch path with torch's
    internal errors (storage of a wrapped tensor; a Function's setup_context). insum names
    the limitation instead."""
    from insum.formats import ELL

    A, B = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    fmt = ELL.from_dense(A)

    def f(a):
        return insum("C[m, n] = A[m, k] * B[k, n]", A=a, B=B, backend="torch")

    for transform in (lambda: torch.vmap(f)(torch.randn(2, 4, 3, dtype=torch.float64)),
                      lambda: torch.func.jvp(f, (A,), (A,)),
                      lambda: torch.func.grad(lambda a: f(a).sum())(A),
                      lambda: torch.func.jacrev(f)(A),
                      lambda: torch.vmap(lambda b: fmt @ b)(torch.randn(2, 3, 5, dtype=torch.float64))):
        with pytest.raises(InsumError, match="torch.func transforms"):
            transform()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_mode_through_formats_after_their_plans_are_pinned(backend):
    """Found by fuzzing: `fmt @ B` dropped B's tangent once its plan was pinned (the pinned
    launch reads the primal's memory). A format's product on tangents is A @ tB + tA @ B
    (+ the bias's), each an ordinary product."""
    if backend == "triton" and not INTERPRET:
        pytest.skip("CPU tensors: the generated kernel needs TRITON_INTERPRET=1")
    from insum.formats import COO, ELL, BlockGroupCOO

    gen = torch.Generator().manual_seed(3)
    A = torch.randn(8, 6, dtype=torch.float64, generator=gen)
    A[A.abs() < 0.7] = 0
    B, tB = (torch.randn(6, 3, dtype=torch.float64, generator=gen) for _ in range(2))
    bias, tbias = (torch.randn(8, dtype=torch.float64, generator=gen) for _ in range(2))
    for fmt in (COO.from_dense(A), ELL.from_dense(A), BlockGroupCOO.from_dense(A, block=(2, 2), group_size="row")):
        held = fmt.to_dense()
        for _ in range(2):  # plain products: the plan is pinned by the repeat
            fmt.spmm(B, bias=bias, backend=backend)
        with fwAD.dual_level():
            C = fmt.spmm(fwAD.make_dual(B, tB), bias=fwAD.make_dual(bias, tbias), backend=backend)
            primal, tangent = fwAD.unpack_dual(C)
        torch.testing.assert_close(primal, held @ B + bias[:, None])
        torch.testing.assert_close(tangent, held @ tB + tbias[:, None])
        values = {n: t for n, t in fmt.tensors.items() if t.is_floating_point()}
        # (no tangent in padding slots: past a declared length the kernel does not read them)
        tvalues = {n: torch.randn(t.shape, dtype=t.dtype, generator=gen) * (t != 0) for n, t in values.items()}
        with fwAD.dual_level():
            dual = fmt._over({n: fwAD.make_dual(t, tvalues[n]) for n, t in values.items()})
            tangent = fwAD.unpack_dual(dual.spmm(B, backend=backend)).tangent
        torch.testing.assert_close(tangent, fmt._over(tvalues).to_dense() @ B)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_reverse_over_forward(backend):
    """Found by fuzzing: the gradient of a tangent lost its dependence on the primals on the
    triton backend (the tangent statements ran outside autograd)."""
    if backend == "triton" and not INTERPRET:
        pytest.skip("CPU tensors: the generated kernel needs TRITON_INTERPRET=1")
    x0 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    v = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    x = x0.clone().requires_grad_(True)
    with fwAD.dual_level():
        z = insum("z[] = x[k] * x[k]", x=fwAD.make_dual(x, v), backend=backend)
        (g,) = torch.autograd.grad(fwAD.unpack_dual(z * z).tangent, x)
    torch.testing.assert_close(g, 8 * (x0 @ v) * x0 + 4 * (x0 @ x0) * v)


def test_forward_mode_reads_facts_as_insum_does():
    """Found by fuzzing: a fact given as one name (a str) was split into letters for the
    tangent statements (`unique_indices="IJ"` claimed I unique: lost contributions), and None
    raised."""
    rows, IJ = torch.tensor([0, 1, 0, 1, 0, 1]), torch.arange(6)
    V, tV, B = torch.ones(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64), torch.ones(6, 2, dtype=torch.float64)
    for facts in ({"unique_indices": "IJ"}, {"sorted_indices": None}):
        with fwAD.dual_level():
            C = insum("C[I[p], n] += V[p] * B[IJ[p], n]", C=torch.zeros(2, 2, dtype=torch.float64), I=rows, IJ=IJ,
                      V=fwAD.make_dual(V, tV), B=B, backend="triton" if INTERPRET else "torch", **facts)
            primal, tangent = fwAD.unpack_dual(C)
        torch.testing.assert_close(tangent, torch.full((2, 2), 3.0, dtype=torch.float64))
        torch.testing.assert_close(primal, torch.full((2, 2), 3.0, dtype=torch.float64))


def test_hessian_vector_product_ignores_tangents_past_lengths():
    """Found by fuzzing: a tangent in a padding slot (past its length) leaked into the
    gradient statements' tangents; the forward does not read it, nor do they now."""
    AV, AK, AL = torch.tensor([[2.0, 0.0]], dtype=torch.float64), torch.tensor([[1, 0]]), torch.tensor([1])
    B = torch.tensor([[1.0], [3.0]], dtype=torch.float64, requires_grad=True)
    with fwAD.dual_level():
        AVd = fwAD.make_dual(AV, torch.tensor([[0.0, 1.0]], dtype=torch.float64))
        C = insum("C[p, n] = AV[p, q] * B[AK[p, q], n]", AV=AVd, AK=AK, B=B, lengths={"q[p]": AL}, backend="torch")
        (gB,) = torch.autograd.grad(C.sum(), B)
        assert not fwAD.unpack_dual(C).tangent.any()
        assert not fwAD.unpack_dual(gB).tangent.any()


def test_format_forward_mode_reads_no_tangent_past_its_lengths():
    """Found by fuzzing: Block-ELL's values' tangent in its padding blocks (past each block
    row's count) entered the tangent on the torch backend; it is not read, as the kernel
    stops at the lengths."""
    from insum.formats import BlockGroupCOO

    A = torch.zeros(4, 6, dtype=torch.float64)
    A[0:2, 0:2], A[2:4, 0:2], A[2:4, 4:6] = 1.0, 2.0, 3.0  # block rows of 1 and 2 blocks: row 0 pads
    fmt = BlockGroupCOO.from_dense(A, block=(2, 2), group_size="row")
    lengths = fmt.declared_lengths()
    assert lengths is not None
    (counts,) = lengths.values()
    padding = (torch.arange(fmt.AV.shape[1]) >= counts[:, None])[:, :, None, None].expand_as(fmt.AV)
    assert padding.any()
    B = torch.randn(6, 3, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fmt._over({"AV": fwAD.make_dual(fmt.AV, padding.double())})
        tangent = fwAD.unpack_dual(dual.spmm(B, backend="torch")).tangent
    assert not tangent.any()


def test_hessian_vector_product_through_a_format_keeps_its_cross_terms():
    """Found by fuzzing: with gradients recorded, a format's tangent taken from products of
    primals cut the tangents out of the backward's graph (the gradient of the values lost
    B's tangent). There the statements run through insum()'s operators, which carry them."""
    from insum.formats import COO

    gen = torch.Generator().manual_seed(8)
    fmt = COO.from_dense(torch.randn(3, 4, dtype=torch.float64, generator=gen))
    B, tB = torch.randn(4, 2, dtype=torch.float64, generator=gen), torch.randn(4, 2, dtype=torch.float64, generator=gen)

    def grads(eps):
        av, b = fmt.AV.clone().requires_grad_(True), (B + eps * tB).requires_grad_(True)
        return torch.autograd.grad((fmt._over({"AV": av}).spmm(b, backend="torch") ** 2).sum(), (av, b))

    want = [(a - b) / 2e-5 for a, b in zip(grads(1e-5), grads(-1e-5))]
    av, b = fmt.AV.clone().requires_grad_(True), B.clone().requires_grad_(True)
    with fwAD.dual_level():
        y = fmt._over({"AV": av}).spmm(fwAD.make_dual(b, tB), backend="torch")
        got = [fwAD.unpack_dual(g).tangent for g in torch.autograd.grad((y ** 2).sum(), (av, b))]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_half_precision_gradient_scatter_accumulates_in_float32():
    """Every entry gathers row 0 of B, so dB[0] sums 4096 contributions: in fp16 they
    would lose ~5%; accumulated in float32 and rounded once they stay under 1e-3."""
    g = torch.Generator().manual_seed(0)
    P, N = 4096, 3
    AV = (torch.rand(P, generator=g) + 0.5).to(torch.float16)
    AK = torch.zeros(P, dtype=torch.int64)
    AM = torch.randint(0, 7, (P,), generator=g)
    B = (torch.rand(5, N, generator=g) + 0.5).to(torch.float16).requires_grad_(True)
    C = insum("C[AM[p],n] += AV[p]*B[AK[p],n]", C=torch.zeros(7, N, dtype=torch.float16),
              AM=AM, AV=AV, AK=AK, B=B, backend="torch")
    dC = (torch.rand(7, N, generator=g) + 0.5).to(torch.float16)
    (dB,) = torch.autograd.grad(C, [B], dC)
    expected = torch.zeros(5, N, dtype=torch.float64)
    expected[0] = (AV.double()[:, None] * dC.double()[AM]).sum(0)
    assert dB.dtype == torch.float16
    assert ((dB.double() - expected).norm() / expected.norm()) < 1e-3
