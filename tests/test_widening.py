"""Products whose output rows are not a whole vector wide, run in widened rows
(`insum.widening`): which statements and layouts qualify, and the products against float64
(the copies in, the buffer's first columns out, `+=` starting from the output's values),
through the full path, the repeated (prepared) path and a format's pinned SpMM."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE  # before insum: the interpreter on CPU-only machines

from insum import explain, insum
from insum import widening as widening_module
from insum.bind import bind
from insum.execute import length_facts
from insum.formats import ELL, BlockGroupCOO, GroupCOO
from insum.parser import parse
from insum.runtime import PinnedCall
from insum.widening import ROW_ELEMENTS, widening_for

SPMM = "C[AM[p],n] += AV[p,q]*B[AK[p,q],n]"
ROWS = "C[m,n] = AV[m,q]*B[AK[m,q],n]"
TOL = 1e-6 if DEVICE == "cpu" else 2e-3  # (fp32 products run as TF32 on the GPU)
HALF_TOL = 2e-3


@pytest.fixture
def widen(monkeypatch):
    """Widening on at every size (the interpreter's tests are small)."""
    monkeypatch.setenv("INSUM_WIDEN", "1")
    monkeypatch.setattr(widening_module, "WIDEN_MIN_BYTES", 0)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


def spmm_tensors(n: int, dtype=torch.float16, index_dtype=torch.int32, groups: int = 6, width: int = 5,
                 rows: int = 9, k: int = 11, seed: int = 0) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return {
        "AM": torch.randint(0, rows, (groups,), generator=gen, device=DEVICE).to(index_dtype),
        "AK": torch.randint(0, k, (groups, width), generator=gen, device=DEVICE).to(index_dtype),
        "AV": torch.randn(groups, width, generator=gen, device=DEVICE).to(dtype),
        "B": torch.randn(k, n, generator=gen, device=DEVICE).to(dtype),
    }


def spmm_expected(t: dict, rows: int = 9) -> torch.Tensor:
    C = torch.zeros(rows, t["B"].shape[1], dtype=torch.float64, device=DEVICE)
    products = t["AV"].double()[:, :, None] * t["B"].double()[t["AK"].long()]
    return C.index_add_(0, t["AM"].long(), products.sum(1))


def bound_of(stmt: str, **tensors):
    return bind(parse(stmt), tensors)


def spmm_bound(t: dict, C: torch.Tensor | None = None):
    n = t["B"].shape[1]
    return bound_of(SPMM, C=torch.zeros(9, n, dtype=t["B"].dtype, device=DEVICE) if C is None else C, **t)


# ------------------------------------------------------------------ which statements widen


def test_odd_half_rows_widen_to_a_multiple_of_16(widen):
    t = spmm_tensors(37)
    found = widening_for(spmm_bound(t))
    assert (found.variable, found.extent, found.width, found.names) == ("n", 37, 48, ("B",))
    assert found.width % ROW_ELEMENTS == 0
    assert "37 -> 48" in str(found)


@pytest.mark.parametrize("n, dtype", [(40, torch.float16), (48, torch.float16), (36, torch.float32)])
def test_rows_of_a_16_byte_vector_stay(widen, n, dtype):
    t = spmm_tensors(n, dtype)
    assert widening_for(spmm_bound(t)) is None


@pytest.mark.parametrize("n, dtype", [(42, torch.float16), (44, torch.float16), (37, torch.float32)])
def test_rows_of_4_or_8_byte_vectors_widen(widen, n, dtype):
    t = spmm_tensors(n, dtype)
    assert widening_for(spmm_bound(t)).width == 48


def test_a_given_output_in_wide_enough_rows_still_widens_for_its_inputs(widen):
    t = spmm_tensors(37)
    C = torch.zeros(9, 48, dtype=torch.float16, device=DEVICE)[:, :37]
    assert widening_for(spmm_bound(t, C)).names == ("B",)


def test_statements_that_cannot_widen(widen):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    h = torch.float16
    A = torch.randn(9, 37, generator=gen, device=DEVICE).to(h)
    x = torch.randn(37, generator=gen, device=DEVICE).to(h)
    # the last output index reduced elsewhere, or not a plain variable
    assert widening_for(bound_of("y[m] = A[m,k]*x[k]", A=A, x=x)) is None
    # the variable indexes an index tensor
    AI = torch.randint(0, 37, (9, 37), generator=gen, device=DEVICE, dtype=torch.int32)
    assert widening_for(bound_of("C[m,n] = A[m,AI[m,n]]", A=A, AI=AI)) is None
    # a tensor read where the variable does not index it
    S = torch.randn(37, 37, generator=gen, device=DEVICE).to(h)
    assert widening_for(bound_of("C[m,n] = S[m,n]*S[n,m]", S=S)) is None
    # the variable on another than the last dimension
    T = torch.randn(37, 9, generator=gen, device=DEVICE).to(h)
    assert widening_for(bound_of("C[m,n] = T[n,m]", T=T)) is None
    # an output whose last dimension is not contiguous
    t = spmm_tensors(37)
    C = torch.zeros(37, 9, dtype=h, device=DEVICE).t()
    assert widening_for(spmm_bound(t, C)) is None


@pytest.mark.parametrize("n, widens", [(1, False), (10, False), (11, True), (17, False), (23, True), (33, True)])
def test_narrow_extents_widen_only_within_the_ratio(widen, n, widens):
    """1 -> 16 columns (an SpMV) is 16 times the work; 33 -> 48 is 1.45 times."""
    assert (widening_for(spmm_bound(spmm_tensors(n))) is not None) == widens


def test_off_small_or_indexed_by_a_declared_length(monkeypatch):
    t = spmm_tensors(37)
    bound = spmm_bound(t)
    monkeypatch.setenv("INSUM_WIDEN", "0")
    assert widening_for(bound) is None
    monkeypatch.setenv("INSUM_WIDEN", "1")
    assert widening_for(bound) is None  # 12 x 37 and 9 x 37 halves: under WIDEN_MIN_BYTES
    monkeypatch.setattr(widening_module, "WIDEN_MIN_BYTES", 0)
    assert widening_for(bound) is not None
    # a length that depends on the widened variable
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    A = torch.randn(9, 6, 37, generator=gen, device=DEVICE).half()
    lengths = {"q[n]": torch.full((37,), 3, dtype=torch.int32, device=DEVICE)}
    with_lengths, declared = length_facts(bound_of("C[m,n] = A[m,q,n]", A=A), lengths)
    assert widening_for(with_lengths, declared) is None


def test_unset_switch_widens_cuda_tensors_only(monkeypatch):
    monkeypatch.delenv("INSUM_WIDEN", raising=False)
    monkeypatch.setattr(widening_module, "WIDEN_MIN_BYTES", 0)
    found = widening_for(spmm_bound(spmm_tensors(37)))
    assert (found is not None) == (DEVICE == "cuda")


@pytest.mark.parametrize("spelling", ["1", "true", "on", "yes"])
def test_every_on_spelling_forces_widening(monkeypatch, spelling):
    """Found by fuzzing: INSUM_WIDEN=true/on/yes enabled widening (explain showed it) but did
    not force it, unlike 1: the README reads all four as on."""
    monkeypatch.setenv("INSUM_WIDEN", spelling)
    assert widening_module.widening_forced()
    monkeypatch.setenv("INSUM_WIDEN", "0")
    assert not widening_module.widening_forced()


def test_widened_product_with_index_checks(widen):
    """Found by fuzzing: check_indices=True on a widened product raised a bare TypeError (the
    widened binding's signature holds plain ints, which the lengths' check indexed)."""
    t = spmm_tensors(37)
    C = torch.zeros(9, 37, dtype=torch.float16, device=DEVICE)
    insum(SPMM, C=C, backend="triton", check_indices=True, **t)
    assert rel_err(C, spmm_expected(t)) < HALF_TOL


# ------------------------------------------------------------------ products


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [37, 11, 41])
def test_scattered_product_widened_matches_float64(widen, n, index_dtype):
    t = spmm_tensors(n, index_dtype=index_dtype)
    for seed in range(3):  # the full path, then the prepared repeat, on fresh values
        t["B"] = spmm_tensors(n, seed=seed + 10)["B"]
        C = torch.full((9, n), float("nan"), dtype=torch.float16, device=DEVICE)
        C.zero_()
        out = insum(SPMM, C=C, backend="triton", **t)
        assert out is C
        assert rel_err(C, spmm_expected(t)) < HALF_TOL


def test_accumulating_product_starts_from_the_outputs_values(widen):
    t = spmm_tensors(37)
    start = torch.randn(9, 37, device=DEVICE).half()
    for _ in range(2):
        C = start.clone()
        insum(SPMM, C=C, backend="triton", **t)
        assert rel_err(C, spmm_expected(t) + start.double()) < HALF_TOL


def test_allocated_output_and_non_contiguous_input(widen):
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    AV = torch.randn(9, 4, generator=gen, device=DEVICE).half()
    AK = torch.randint(0, 13, (9, 4), generator=gen, device=DEVICE, dtype=torch.int32)
    wide = torch.randn(13, 60, generator=gen, device=DEVICE).half()
    B = wide[:, 3:36]  # 33 columns in rows 60 apart, starting off a vector
    expected = (AV.double()[:, :, None] * B.double()[AK.long()]).sum(1)
    for _ in range(2):
        C = insum(ROWS, AV=AV, AK=AK, B=B, backend="triton")
        assert C.shape == (9, 33) and C.is_contiguous()
        assert rel_err(C, expected) < HALF_TOL


def test_explain_shows_the_widened_kernel(widen):
    t = spmm_tensors(37)
    text = explain(SPMM, C=torch.zeros(9, 37, dtype=torch.float16, device=DEVICE), **t)
    assert "widening (insum.widening" in text and "n: 37 -> 48 columns (B copied" in text
    assert text.count("def insum_kernel") == 2  # as it is, and widened
    assert "atomic" in text.split("widened:")[1]


@pytest.mark.parametrize("fmt_of, scatters", [
    (lambda A: GroupCOO.from_dense(A, group_size=4), True),
    (lambda A: ELL.from_dense(A), False),
    (lambda A: BlockGroupCOO.from_dense(A, block=(16, 16), group_size="row"), False),
    (lambda A: BlockGroupCOO.from_dense(A, block=(16, 16), group_size=2), True),
], ids=["GroupCOO", "ELL", "Block-ELL", "grouped BlockGroupCOO"])
def test_formats_spmm_widened_repeatedly(widen, monkeypatch, fmt_of, scatters):
    runs = []
    widened_run = widening_module.WidenedLaunch.run
    monkeypatch.setattr(widening_module.WidenedLaunch, "run",
                        lambda self, tensors, *a: runs.append(type(tensors)) or widened_run(self, tensors, *a))
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    A = torch.randn(48, 64, generator=gen, device=DEVICE)
    A = (A * (torch.rand(3, 4, generator=gen, device=DEVICE) < 0.5).repeat_interleave(16, 0).repeat_interleave(16, 1))
    A = A.half()
    fmt = fmt_of(A)
    for seed in range(4):  # the first calls, then the pinned repeats
        B = torch.randn(64, 27, generator=torch.Generator(device=DEVICE).manual_seed(seed), device=DEVICE).half()
        C = fmt.spmm(B, backend="triton")
        assert C.shape == (48, 27)
        assert rel_err(C, A.double() @ B.double()) < HALF_TOL
    assert len(runs) >= 2  # the repeats ran the prepared launch in widened rows,
    # pinned to the format's tensors (B and C vary); not where a float32 buffer stands in for
    # a half-precision scattered output (the interpreter's: it has no half atomics)
    assert (PinnedCall in runs) == (DEVICE == "cuda" or not scatters)


def test_widened_and_plain_runs_agree(monkeypatch):
    t = spmm_tensors(37)
    monkeypatch.setenv("INSUM_WIDEN", "0")
    plain = insum(SPMM, C=torch.zeros(9, 37, dtype=torch.float16, device=DEVICE), backend="triton", **t)
    monkeypatch.setenv("INSUM_WIDEN", "1")
    monkeypatch.setattr(widening_module, "WIDEN_MIN_BYTES", 0)
    widened = insum(SPMM, C=torch.zeros(9, 37, dtype=torch.float16, device=DEVICE), backend="triton", **t)
    assert torch.allclose(widened.float(), plain.float(), atol=2e-3, rtol=2e-3)


# ------------------------------------------------------------------ the timed choice


@pytest.mark.parametrize("widened_ms, chosen, n", [(1.0, True, 53), (3.0, False, 55)])
def test_first_call_keeps_the_faster_run(monkeypatch, widened_ms, chosen, n):
    """Unset INSUM_WIDEN: the first call times both runs (a fake clock here: the interpreter
    has none) and keeps the faster for the signature; later calls, prepared or not, follow it
    without timing again."""
    from insum import execute

    monkeypatch.delenv("INSUM_WIDEN", raising=False)
    monkeypatch.setattr(widening_module, "WIDEN_MIN_BYTES", 0)
    monkeypatch.setattr(widening_module, "_enabled", lambda device: True)
    monkeypatch.setattr(execute, "_can_time", lambda bound, autotune: True)
    timed, runs = [], []
    monkeypatch.setattr(execute, "_time_launch", lambda fn: timed.append(fn) or (widened_ms if len(timed) == 2 else 2.0))
    widened_run = widening_module.WidenedLaunch.run
    monkeypatch.setattr(widening_module.WidenedLaunch, "run", lambda self, *a: runs.append(1) or widened_run(self, *a))
    t = spmm_tensors(n, seed=7)  # (a width of its own: choices are kept per signature)
    for _ in range(3):
        C = torch.zeros(9, n, dtype=torch.float16, device=DEVICE)
        insum(SPMM, C=C, backend="triton", **t)
        assert rel_err(C, spmm_expected(t)) < HALF_TOL
    assert len(timed) == 2  # once per signature
    # the timing ran the prepared widened launch once (to tune; the fake clock calls
    # nothing), the first call then ran through the full path, the two repeats through the
    # prepared launch: widened only if chosen
    assert len(runs) == 1 + (2 if chosen else 0)


def test_untimed_calls_keep_the_plain_run(monkeypatch):
    """Where nothing can time the two runs (tuning off, a CUDA graph's capture, the
    interpreter), the product runs as it is: the copies may cost more than they save."""
    from insum import execute

    monkeypatch.delenv("INSUM_WIDEN", raising=False)
    monkeypatch.setattr(widening_module, "WIDEN_MIN_BYTES", 0)
    monkeypatch.setattr(widening_module, "_enabled", lambda device: True)
    monkeypatch.setattr(execute, "_can_time", lambda bound, autotune: False)

    def refuse(*args):
        raise AssertionError("widened untimed")

    monkeypatch.setattr(execute, "widened_bound", refuse)
    t = spmm_tensors(57, seed=8)
    for _ in range(2):
        C = torch.zeros(9, 57, dtype=torch.float16, device=DEVICE)
        insum(SPMM, C=C, backend="triton", **t)
        assert rel_err(C, spmm_expected(t)) < HALF_TOL


def test_insum_many_keeps_plain_rows_for_its_batched_repeat(widen, monkeypatch):
    """Statements run through `insum_many` do not widen: its repeats run them as one batched
    launch, which a widened statement (several launches) could not join."""
    from insum import insum_many

    runs = []
    widened_run = widening_module.WidenedLaunch.run
    monkeypatch.setattr(widening_module.WidenedLaunch, "run", lambda self, *a: runs.append(1) or widened_run(self, *a))
    halves = spmm_tensors(37, seed=11), spmm_tensors(37, seed=12)
    for _ in range(2):
        C = torch.zeros(9, 37, dtype=torch.float16, device=DEVICE)
        calls = [(SPMM, dict(t, C=C)) for t in halves]
        insum_many(calls, backend="triton")
        assert rel_err(C, spmm_expected(halves[0]) + spmm_expected(halves[1])) < HALF_TOL
    assert not runs
    assert widening_for(spmm_bound(halves[0])) is not None  # (outside insum_many it would widen)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the index check is a device assert, which loses the context")
def test_widened_product_checks_indices(widen):
    from insum.errors import InsumIndexError

    t = spmm_tensors(37)
    t["AK"] = t["AK"].clone()
    t["AK"][0, 0] = 11  # B has 11 rows
    with pytest.raises(InsumIndexError):
        insum(SPMM, C=torch.zeros(9, 37, dtype=torch.float16, device=DEVICE), backend="triton", check_indices=True, **t)


def test_gradients_through_widened_products(widen, monkeypatch):
    """Forward and the derived backward statements run widened where they qualify (float32
    rows 37 wide: 4-byte rows); the gradients match the reference lowering's."""
    from insum import execute

    widened = []
    run_widened = execute.run_widened
    monkeypatch.setattr(execute, "run_widened", lambda w, *a: widened.append(w.variable) or run_widened(w, *a))
    t = spmm_tensors(37, dtype=torch.float32, seed=13)
    grads = {}
    for backend in ("torch", "triton"):
        AV = t["AV"].clone().requires_grad_()
        B = t["B"].clone().requires_grad_()
        out = insum(ROWS, AV=AV, AK=t["AK"], B=B, backend=backend)
        out.backward(torch.ones_like(out))
        grads[backend] = (AV.grad, B.grad)
    for got, expected in zip(grads["triton"], grads["torch"]):
        assert rel_err(got, expected.double()) < TOL
    assert widened == ["n", "n"]  # the product and B's gradient (AV's reduces over n)
