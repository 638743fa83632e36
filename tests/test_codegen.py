"""The generated Triton kernels against the torch reference lowering.

On a CPU-only machine the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by
`make test` and by kernel_env.py); on a CUDA machine the same tests run compiled, in fp32, fp16 and bf16.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from kernel_env import (  # before insum: the interpreter on CPU-only machines
    CUDA,
    DEVICE,
    KERNEL_MARK,
)
from statements import CASES, build, case, clone, strided, tolerance

import insum
from insum import runtime
from insum.bind import bind
from insum.codegen import emit, schedule
from insum.parser import parse
from insum.runtime import Kernel, kernel_for, spec_for

pytestmark = KERNEL_MARK
# The interpreter has no bf16 and its fp16 atomics fail: half precision is tested on the GPU.
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if CUDA else [torch.float32]
GOLDEN = Path(__file__).parent / "golden"


def _run_both(c, tensors, precision="ieee"):
    expected = insum.insum(c.stmt, backend="torch", **clone(tensors))
    poisoned = clone(tensors)
    actual = insum.insum(c.stmt, backend="triton", precision=precision, **poisoned)
    return actual, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_kernel_matches_reference(c, index_dtype, dtype):
    tensors = build(c, seed=1, index_dtype=index_dtype, dtype=dtype, device=DEVICE)
    actual, expected = _run_both(c, tensors)
    torch.testing.assert_close(actual, expected, **tolerance(dtype))


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_kernel_non_contiguous_operands(c):
    tensors = build(c, seed=2, device=DEVICE)
    tensors = {name: strided(t) for name, t in tensors.items()}
    actual, expected = _run_both(c, tensors)
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("stmt_id", ["group_coo_spmm", "dense_matmul", "embedding", "sddmm"])
def test_kernel_allocates_output(stmt_id):
    c = case(stmt_id)
    if c.needs_out:
        pytest.skip("output must be passed")
    tensors = build(c, seed=3, device=DEVICE, with_output=False)
    expected = insum.insum(c.stmt, backend="torch", **tensors)
    actual = insum.insum(c.stmt, backend="triton", precision="ieee", **tensors)
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


def test_overwrite_poisoned_output_is_fully_written():
    c = case("dense_matmul")
    tensors = build(c, seed=4, device=DEVICE)
    tensors[c.output].fill_(float("nan"))
    actual, expected = _run_both(c, tensors)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


def test_default_tf32_precision_is_close():
    c = case("block_group_coo")
    tensors = build(c, seed=5, device=DEVICE)
    actual, expected = _run_both(c, tensors, precision="tf32")
    assert ((actual - expected).norm() / expected.norm()) < 1e-2


def test_larger_than_one_tile(monkeypatch):
    """Extents above every tile size exercise the program-id split, masks and loop.

    With tuning on (on a GPU), the scatter must be right on the first, tuning call: trials
    restore the output between configurations."""
    monkeypatch.setenv("INSUM_AUTOTUNE", "1")
    monkeypatch.setenv("INSUM_CACHE_DIR", str(Path(__import__("tempfile").mkdtemp())))
    g = torch.Generator().manual_seed(6)
    G, width, M, K, N = 150, 37, 70, 90, 131
    t = {
        "C": torch.randn(M, N, generator=g),
        "AM": torch.randint(0, M, (G,), generator=g, dtype=torch.int32),
        "AK": torch.randint(0, K, (G, width), generator=g, dtype=torch.int32),
        "AV": torch.randn(G, width, generator=g),
        "B": torch.randn(K, N, generator=g),
    }
    t = {k: v.to(DEVICE) for k, v in t.items()}
    expected = insum.insum("C[AM[p],n] += AV[p,q]*B[AK[p,q],n]", backend="torch", **clone(t))
    actual = insum.insum("C[AM[p],n] += AV[p,q]*B[AK[p,q],n]", backend="triton", **clone(t))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)


def test_repeated_signature_reuses_the_binding_and_launch():
    """A second call with new tensors of the same signature skips the checks, not the work."""
    c = case("group_coo_spmm")
    first = build(c, seed=7, device=DEVICE)
    insum.insum(c.stmt, backend="triton", **clone(first))
    second = build(c, seed=8, device=DEVICE)
    bound = bind(parse(c.stmt), second)
    assert bound.signature is not None and bound.tensors["B"] is second["B"]
    actual, expected = _run_both(c, second)
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))
    # Same shapes, other strides: a different signature, so a fresh launch.
    third = {name: strided(t) for name, t in build(c, seed=9, device=DEVICE).items()}
    actual, expected = _run_both(c, third)
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


def test_repeated_signature_still_rejects_aliased_output():
    c = case("dense_matmul")
    tensors = build(c, seed=10, device=DEVICE)
    insum.insum(c.stmt, backend="triton", **clone(tensors))
    aliased = clone(tensors)
    aliased[c.output] = aliased["A"][:, : tensors[c.output].shape[1]]  # a view of the input A
    with pytest.raises(insum.InsumError, match="shares memory"):
        insum.insum(c.stmt, backend="triton", **aliased)


@pytest.mark.parametrize("op", ["+=", "="])
def test_half_precision_scatter_into_strided_output(op):
    """fp16 scatters: native half atomics (GPU) or a float32 buffer (interpreter), into a
    transposed output."""
    g = torch.Generator().manual_seed(11)
    G, width, M, K, N = 23, 5, 19, 13, 21
    t = {
        "C": torch.randn(N, M, generator=g).to(torch.float16).t(),
        "AM": torch.randint(0, M, (G,), generator=g, dtype=torch.int32),
        "AK": torch.randint(0, K, (G, width), generator=g, dtype=torch.int32),
        "AV": torch.randn(G, width, generator=g).to(torch.float16),
        "B": torch.randn(K, N, generator=g).to(torch.float16),
    }
    t = {k: v.to(DEVICE) for k, v in t.items()}
    stmt = f"C[AM[p],n] {op} AV[p,q]*B[AK[p,q],n]"
    expected = insum.insum(stmt, backend="torch", **clone(t))
    actual = insum.insum(stmt, backend="triton", **clone(t))
    torch.testing.assert_close(actual, expected, **tolerance(torch.float16))


# ------------------------------------------------------------------ the generated source


def _kernel(stmt_id: str, dtype=torch.float32) -> Kernel:
    c = case(stmt_id)
    bound = bind(parse(c.stmt), build(c, dtype=dtype, device=DEVICE))
    return kernel_for(bound)


def test_block_group_coo_has_one_dot_and_no_reshape():
    source = _kernel("block_group_coo").source
    assert source.count("tl.dot(") == 1
    for forbidden in ("tl.reshape", "tl.trans", "tl.view", ".T", "permute"):
        assert forbidden not in source


@pytest.mark.parametrize("dtype, dense_on_m", [(torch.float16, True), (torch.bfloat16, True), (torch.float32, False)], ids=str)
def test_narrow_block_rows_go_on_n(dtype, dense_on_m):
    """32-row blocks cannot fill a 64-row tensor-core tile: 16-bit kernels put the dense
    columns (n) on M and the block rows (m) on N."""
    meta = {"device": "meta"}
    tensors = {
        "C": torch.empty(16, 32, 256, dtype=dtype, **meta),
        "AM": torch.empty(40, dtype=torch.int32, **meta),
        "AV": torch.empty(40, 4, 32, 32, dtype=dtype, **meta),
        "AK": torch.empty(40, 4, dtype=torch.int32, **meta),
        "B": torch.empty(16, 32, 256, dtype=dtype, **meta),
    }
    spec = spec_for(bind(parse("C[AM[p], m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]"), tensors))
    assert "m" in spec.narrow and "n" not in spec.narrow
    plan = schedule(spec)
    assert plan.kind == "dot"
    assert (plan.axis_var("M"), plan.axis_var("N")) == (("n", "m") if dense_on_m else ("m", "n"))
    source = emit(plan).text
    assert source.count("tl.dot(") == 1 and "tl.trans" not in source and "reshape" not in source


def test_narrow_orientation_runs_correctly():
    """The swapped orientation (n on M) on a 16-bit-free path: force it through the plan."""
    import dataclasses

    c = case("block_group_coo")
    tensors = build(c, seed=12, device=DEVICE)
    bound = bind(parse(c.stmt), tensors)
    spec = spec_for(bound, "ieee")
    plan = schedule(spec)
    m, k, n = plan.axis_var("M"), plan.axis_var("K"), plan.axis_var("N")
    swapped = dataclasses.replace(plan, tiles=(("M", n), ("K", k), ("N", m)), left=plan.right, right=plan.left)
    expected = insum.insum(c.stmt, backend="torch", **clone(tensors))
    poisoned = clone(tensors)
    bound = bind(parse(c.stmt), poisoned)
    actual = Kernel(spec, swapped).launch(bound, bound.output())
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("stmt_id", ["ell_spmm", "dense_matmul", "sddmm", "embedding", "transposed_out"])
def test_single_owner_outputs_emit_no_atomics(stmt_id):
    kernel = _kernel(stmt_id)
    assert kernel.plan.output == "store"
    assert "atomic" not in kernel.source


@pytest.mark.parametrize("stmt_id", ["coo_spmm", "group_coo_spmm", "segment_sum", "point_conv"])
def test_scatters_emit_atomics(stmt_id):
    kernel = _kernel(stmt_id)
    assert kernel.plan.output == "atomic"
    assert "tl.atomic_add" in kernel.source


@pytest.mark.parametrize(
    "stmt_id, kind",
    [("block_group_coo", "dot"), ("point_conv", "dot"), ("nm_spmm", "dot"), ("four_factors", "dot"),
     ("group_coo_spmm", "reduce"), ("sddmm", "reduce"), ("ell_spmm", "reduce")],
)
def test_plan_kind(stmt_id, kind):
    assert _kernel(stmt_id).plan.kind == kind


def test_kernel_cache_reuses_kernel():
    assert _kernel("group_coo_spmm") is _kernel("group_coo_spmm")
    assert _kernel("group_coo_spmm") is not _kernel("group_coo_spmm", dtype=torch.float64)


def test_wide_tensors_use_int64_addressing():
    big = torch.empty(2**31 + 10, device="meta")
    small = torch.empty(2**31 + 10, dtype=torch.int32, device="meta")
    bound = bind(parse("E[i] += W[I[i]]"), {"W": big, "I": small})
    spec = spec_for(bound)
    assert spec.wide == {"W", "I", "E"}
    assert ".to(tl.int64)" in emit(schedule(spec)).text
    narrow = spec_for(bind(parse("E[i] += W[I[i]]"), {"W": torch.ones(4), "I": torch.zeros(3, dtype=torch.int32)}))
    assert ".to(tl.int64)" not in emit(schedule(narrow)).text


def test_source_is_deterministic():
    spec = _kernel("group_coo_spmm").spec
    assert emit(schedule(spec)).text == emit(schedule(spec)).text


@pytest.mark.parametrize("stmt_id", ["group_coo_spmm", "block_group_coo", "sddmm", "four_factors"])
def test_golden_source(stmt_id):
    """The generated source for canonical statements; INSUM_UPDATE_GOLDEN=1 rewrites them."""
    text = _kernel(stmt_id).source
    path = GOLDEN / f"{stmt_id}.py"
    if os.environ.get("INSUM_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_compile_api_and_explain():
    c = case("group_coo_spmm")
    tensors = build(c, seed=7, device=DEVICE)
    kernel = insum.compile(c.stmt, **tensors)
    assert "@triton.jit" in kernel.source and kernel.plan.kind == "reduce"
    expected = insum.insum(c.stmt, backend="torch", **clone(tensors))
    torch.testing.assert_close(kernel(**clone(tensors)), expected, **tolerance(torch.float32))
    text = insum.explain(c.stmt, **tensors)
    assert "plan:" in text and "tl.atomic_add" in text
    with pytest.raises(insum.InsumError, match="dtypes"):
        kernel(**{k: (v.double() if v.is_floating_point() else v) for k, v in tensors.items()})


def test_compiled_kernel_refuses_what_it_cannot_do():
    """Found by fuzzing: a compiled kernel called on a tensor that requires grad returned a
    result with no gradient (a loss over it silently lost the product's term); on meta
    tensors it failed inside torch. Both raise insum's errors now."""
    import torch.autograd.forward_ad as fwAD

    c = case("group_coo_spmm")  # (no tl.dot: float32 exactly, as the lowering)
    tensors = build(c, seed=7, device=DEVICE)
    kernel = insum.compile(c.stmt, **tensors)
    needs = {**clone(tensors), "AV": tensors["AV"].clone().requires_grad_(True)}
    with pytest.raises(insum.InsumError, match="not differentiable"):
        kernel(**needs)
    with torch.no_grad():
        torch.testing.assert_close(kernel(**needs), insum.insum(c.stmt, backend="torch", **clone(tensors)),
                                   **tolerance(torch.float32))
    with fwAD.dual_level(), pytest.raises(insum.InsumError, match="tangent"):
        kernel(**{**clone(tensors), "AV": fwAD.make_dual(tensors["AV"], torch.ones_like(tensors["AV"]))})
    with pytest.raises(insum.InsumTypeError, match="meta"):
        kernel(**{k: v.to("meta") for k, v in tensors.items()})


def test_tuning_results_persist_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("INSUM_CACHE_DIR", str(tmp_path))
    spec = _kernel("dense_matmul").spec
    kernel = Kernel(spec)
    assert kernel.path.exists() and kernel.path.parent == tmp_path / "kernels"
    config = {"BLOCK_M": 32, "BLOCK_K": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    kernel._save_disk_config((32, 16, 64), torch.device(DEVICE), config)
    again = Kernel(spec)  # a new kernel object, as in a second process
    assert again._disk_config((32, 16, 64), torch.device(DEVICE)) == config
    assert again._disk_config((64, 16, 64), torch.device(DEVICE)) is None


def test_disk_tuning_is_kept_per_dtype(tmp_path, monkeypatch):
    """Kernels of other dtypes may share one source (its file and its table on disk); a tile
    tuned for float32 is not read back for float16."""
    monkeypatch.setenv("INSUM_CACHE_DIR", str(tmp_path))
    stmt = "C[m,n] = AV[m,q]*B[AK[m,q],n]"

    def kernel_of(dtype):
        tensors = {"AV": torch.randn(8, 3, dtype=dtype), "AK": torch.randint(0, 8, (8, 3)),
                   "B": torch.randn(8, 16, dtype=dtype), "C": torch.empty(8, 16, dtype=dtype)}
        return Kernel(spec_for(bind(parse(stmt), tensors)))

    single, half = kernel_of(torch.float32), kernel_of(torch.float16)
    assert single.path == half.path  # one source, one table
    config = {"BLOCK_M": 8, "BLOCK_K": 4, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    single._save_disk_config((8, 4, 16), torch.device(DEVICE), config)
    assert kernel_of(torch.float32)._disk_config((8, 4, 16), torch.device(DEVICE)) == config
    assert half._disk_config((8, 4, 16), torch.device(DEVICE)) is None


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    if CUDA:
        pytest.skip("CUDA present")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    c = case("dense_matmul")
    with pytest.raises(insum.InsumError, match="CUDA"):
        insum.insum(c.stmt, backend="triton", **build(c))


def test_generated_names_do_not_clash_with_user_names():
    t = {"acc": torch.randn(5), "pid": torch.randn(5), "offs": torch.randn(5, 3)}
    stmt = "out[ptr] += acc[ptr] * pid[ptr] * offs[ptr, j]"
    expected = insum.insum(stmt, backend="torch", **t)
    actual = insum.insum(stmt, backend="triton", **{k: v.to(DEVICE) for k, v in t.items()})
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-6)
    assert re.search(r"\boffs_ptr_?\b", _source_of(stmt, t))


def _source_of(stmt, tensors):
    return kernel_for(bind(parse(stmt), {k: v.to(DEVICE) for k, v in tensors.items()})).source


def test_literal_factors_whose_product_overflows_compile():
    # Their product folds to inf on the host: the source printed `inf`, a name Triton lacks.
    A = torch.tensor([1.0, -2.0], dtype=torch.float64)
    stmt = "C[i] += A[i] * 1e300 * 1e300"
    expected = insum.insum(stmt, backend="torch", A=A)
    actual = insum.insum(stmt, backend="triton", A=A.to(DEVICE))
    assert expected.tolist() == actual.cpu().tolist() == [float("inf"), float("-inf")]
    assert 'float("inf")' in _source_of(stmt, {"A": A})


def test_a_cache_folder_that_takes_no_file(tmp_path, monkeypatch):
    """Found by fuzzing: an INSUM_CACHE_DIR that cannot be written (read-only, a file) made
    every first call of a statement fail with a bare OSError; a tuning table holding JSON
    that is not a table failed its lookup; `~` was not expanded. The kernels now go to a
    folder of the process's own (with a warning), the odd table reads as empty."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("INSUM_CACHE_DIR", str(blocker))
    stmt = "C[i] += 0.8125 * A[i] * B[I[i]]"  # (a statement of this test's own: no kernel to reuse)
    tensors = {"A": torch.randn(7, device=DEVICE), "B": torch.randn(5, device=DEVICE),
               "I": torch.tensor([4, 0, 1, 1, 3, 2, 0], device=DEVICE)}
    with pytest.warns(UserWarning, match="cannot be written"):
        runtime._private_cache.cache_clear()
        got = insum.insum(stmt, backend="triton", **tensors)
    torch.testing.assert_close(got, 0.8125 * tensors["A"] * tensors["B"][tensors["I"]])
    monkeypatch.setenv("INSUM_CACHE_DIR", str(tmp_path / "cache"))
    kernel = Kernel(_kernel("dense_matmul").spec)
    for odd in ("[]", "null", '{"x": 1}'):
        kernel._disk_path().write_text(odd)
        assert kernel._disk_config((32, 16, 64), torch.device(DEVICE)) is None
    config = {"BLOCK_M": 32, "BLOCK_K": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    kernel._save_disk_config((32, 16, 64), torch.device(DEVICE), config)
    assert kernel._disk_config((32, 16, 64), torch.device(DEVICE)) == config
    monkeypatch.setenv("INSUM_CACHE_DIR", "~/insum-cache")
    assert runtime.cache_dir() == Path.home() / "insum-cache"
