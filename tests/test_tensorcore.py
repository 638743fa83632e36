"""The tensor-core dot path: tensor-descriptor (TMA) selection, grouped program order and
a K axis folded over several variables.

Descriptor plans are checked as plans and source (the selection from shapes, strides and
alignment, on CPU tensors), and run: the launch makes the descriptors on the host, which the
interpreter runs too once descriptors are offered (on a GPU the Hopper TMA path); grouped
order and folded K run in the interpreter (or compiled on a GPU) against a float64 product.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from kernel_env import (  # before insum: the interpreter on CPU-only machines
    CUDA,
    DEVICE,
    KERNEL_MARK,
)

import insum
from insum.bind import bind
from insum.codegen import emit, schedule, tune
from insum.codegen.schedule import box_layout
from insum.parser import parse
from insum.runtime import spec_for

pytestmark = KERNEL_MARK
GOLDEN = Path(__file__).parent / "golden"
DENSE = "C[m, n] = A[m, k] * B[k, n]"
GATHERED = "C[m, n] = A[m, k] * B[I[k], n]"
BLOCK_ROW = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"


def _plan(expr: str, descriptors: bool = True, fold_k: bool = False, **tensors):
    return schedule(spec_for(bind(parse(expr), tensors), descriptors=descriptors), fold_k=fold_k)


def _half(*shape):
    return torch.randn(*shape).half()


def _block_row(G=3, g=5, bm=64, bk=64, KB=4, N=48, dtype=torch.float16, index_dtype=torch.int32, device="cpu"):
    gen = torch.Generator().manual_seed(G * 100 + g)
    return {
        "AV": torch.randn(G, g, bm, bk, generator=gen).to(device, dtype),
        "AK": torch.randint(0, KB, (G, g), generator=gen).to(device, index_dtype),
        "B": torch.randn(KB, bk, N, generator=gen).to(device, dtype),
        "C": torch.full((G, bm, N), float("nan"), dtype=dtype, device=device),
    }


# -- which tensors may back a descriptor ------------------------------------------------------


@pytest.mark.parametrize(
    "shape, strides, itemsize, address, fits",
    [
        ((64, 32), (32, 1), 2, 4096, True),
        ((4, 32, 32), (1024, 32, 1), 4, 0, True),
        ((64, 32), (32, 1), 2, 4098, False),  # start not 16-byte aligned
        ((64, 31), (31, 1), 2, 0, False),  # row stride 62 bytes
        ((32, 64), (1, 32), 2, 0, False),  # transposed view: last dimension not contiguous
        ((64,), (1,), 2, 0, False),  # one dimension: no descriptor
        ((2,) * 6, (32, 16, 8, 4, 2, 1), 8, 0, False),  # six dimensions
        ((4, 8), (0, 1), 2, 0, False),  # expanded (stride 0)
    ],
)
def test_box_layout(shape, strides, itemsize, address, fits):
    assert box_layout(shape, strides, itemsize, address) is fits


def test_descriptors_chosen_for_box_operands_only():
    A, B, C = _half(64, 32), _half(32, 48), _half(64, 48)
    plan = _plan(DENSE, A=A, B=B, C=C)
    assert plan.boxes == (0, 1) and plan.grouped
    source = emit(plan)
    assert [a[:2] for a in source.args if a[0] == "desc"] == [("desc", "A"), ("desc", "B")]
    assert source.text.count("_desc.load(") == 2 and "tl.load(A_ptr" not in source.text
    assert "tl.make_tensor_descriptor" not in source.text  # made on the host, passed in
    assert [a for a in source.args if a[0] == "ptr"] == [("ptr", "C")]  # boxes take no pointer
    # The gathered B is no box (Hopper has no TMA gather); A still is.
    gathered = _plan(GATHERED, A=A, B=B, C=C, I=torch.arange(32, dtype=torch.int32))
    assert gathered.boxes == (0,)
    assert [a[1] for a in emit(gathered).args if a[0] in ("ptr", "desc")] == ["C", "B", "I", "A"]
    # Layouts a descriptor cannot take fall back to pointers, operand by operand.
    assert _plan(DENSE, A=_half(32, 64).t(), B=B, C=C).boxes == (1,)
    assert _plan(DENSE, A=_half(64 * 32 + 1)[1:].view(64, 32), B=B, C=C).boxes == (1,)
    assert _plan(DENSE, A=_half(64, 31), B=_half(31, 48), C=C).boxes == (1,)  # A: rows of 62 bytes
    # No descriptors where the device has none: the interpreter, a CPU, INSUM_TMA=0.
    assert _plan(DENSE, descriptors=False, A=A, B=B, C=C).boxes == ()
    assert spec_for(bind(parse(DENSE), dict(A=A, B=B, C=C))).boxes == frozenset() or CUDA


def test_descriptor_at_a_gathered_row_and_transposed():
    """A block row of B at the row AK[p, q] is a box with a 1 for the gathered dimension; in the
    swapped orientation (32-row blocks: the dense columns on M) both operands are held in the
    other order than the dot's: loaded as boxes, then transposed."""
    wide = _plan(BLOCK_ROW, **_block_row(bm=64, bk=64))
    assert wide.boxes == (0, 1) and not wide.folded and not wide.persistent  # a scalar loop: q
    source = emit(wide)
    assert "B_desc.load([(AK_val).to(tl.int32), start_k, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)" in source.text
    # B's first dimension is scalar-indexed: the host bounds it by B's own size, one row wide
    assert ("desc", "B", ((None, None), ("k", "K"), ("n", "N"))) in source.args
    swapped = _plan(BLOCK_ROW, **_block_row(bm=32, bk=64, N=128))
    assert swapped.axis_var("M") == "n" and swapped.boxes == (0, 1)
    text = emit(swapped).text
    assert "B_val = tl.trans(B_desc.load([(AK_val).to(tl.int32), start_k, pid_n * BLOCK_M]).reshape(BLOCK_K, BLOCK_M))" in text
    assert "AV_val = tl.trans(AV_desc.load([i_p, i_q, pid_m * BLOCK_N, start_k]).reshape(BLOCK_N, BLOCK_K))" in text
    nt = _plan("C[m, n] = A[m, k] * B[n, k]", A=_half(64, 32), B=_half(48, 32), C=_half(64, 48))
    assert nt.boxes == (0, 1) and "tl.trans(B_desc.load(" in emit(nt).text  # B holds (n, k)


def test_persistent_only_where_every_operand_is_a_descriptor():
    A, B, C = _half(64, 32), _half(32, 48), _half(64, 48)
    assert _plan(DENSE, A=A, B=B, C=C).persistent
    assert "for task in tl.range(tl.program_id(0)" in emit(_plan(DENSE, A=A, B=B, C=C)).text
    assert not _plan(DENSE, descriptors=False, A=A, B=B, C=C).persistent
    assert not _plan(GATHERED, A=A, B=B, C=C, I=torch.arange(32, dtype=torch.int32)).persistent


def test_golden_descriptor_sources():
    """Dense GEMM through descriptors and a folded block row; INSUM_UPDATE_GOLDEN=1 rewrites."""
    sources = {
        "dense_descriptors": emit(_plan(DENSE, A=_half(64, 32), B=_half(32, 48), C=_half(64, 48))).text,
        "block_row_folded": emit(_plan(BLOCK_ROW, fold_k=True, **_block_row(bm=32, bk=32))).text,
    }
    for name, text in sources.items():
        path = GOLDEN / f"{name}.py"
        if os.environ.get("INSUM_UPDATE_GOLDEN"):
            path.write_text(text)
        assert text == path.read_text()


# -- grouped program order -------------------------------------------------------------------


def test_grouped_order_covers_every_tile(monkeypatch):
    """5 x 4 tiles in groups of 2 row tiles (the last group short): every element written once."""
    monkeypatch.setattr(tune, "_DOT", [(16, 16, 16, 1, 1)])
    monkeypatch.setattr(tune, "GROUP_M", 2)
    gen = torch.Generator().manual_seed(5)
    A = torch.randn(70, 40, generator=gen, dtype=torch.float64).float().to(DEVICE)
    B = torch.randn(40, 50, generator=gen, dtype=torch.float64).float().to(DEVICE)
    x = torch.randn(3, generator=gen).to(DEVICE)  # a grid variable outside the tiles
    C = torch.full((3, 70, 50), float("nan"), device=DEVICE)
    out = insum.insum("C[b, m, n] = x[b] * A[m, k] * B[k, n]", backend="triton", precision="ieee", A=A, B=B, x=x, C=C)
    expected = x.double()[:, None, None] * (A.double() @ B.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


# -- several variables on K ------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize(
    "G, g, bm, bk, KB, N",
    [(3, 5, 16, 16, 4, 48), (2, 3, 32, 32, 3, 20), (1, 1, 16, 16, 1, 16), (2, 0, 16, 16, 2, 16)],
    ids=["blocks16", "blocks32-odd-N", "one-block", "empty-rows"],
)
def test_folded_k_matches_float64(G, g, bm, bk, KB, N, index_dtype):
    """Block rows with the block loop folded onto K: K = (q, k), several blocks per dot."""
    from insum.runtime import Kernel

    t = _block_row(G, g, bm, bk, KB, N, index_dtype=index_dtype, device=DEVICE)
    bound = bind(parse(BLOCK_ROW), t)
    spec = spec_for(bound)
    plan = schedule(spec, fold_k=True)
    assert plan.folded == ("q",) and plan.loops == () and "K=(q, k)" in str(plan)
    out = Kernel(spec, plan).launch(bound, t["C"])
    expected = torch.einsum("pqmk,pqkn->pmn", t["AV"].double(), t["B"].double()[t["AK"].long()])
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=2e-2)


def test_fold_only_when_asked_and_a_loop_remains():
    assert not _plan(BLOCK_ROW, **_block_row(bm=32, bk=32)).folded  # measured slower: not the default
    assert _plan(BLOCK_ROW, fold_k=True, **_block_row(bm=64, bk=64)).boxes == ()  # steps cross blocks
    assert not _plan(DENSE, fold_k=True, A=_half(64, 32), B=_half(32, 48), C=_half(64, 48)).folded


# -- persistent programs ---------------------------------------------------------------------


@pytest.mark.parametrize("case", ["dense", "batched", "block_row_folded"])
def test_persistent_programs_cover_every_tile(monkeypatch, case):
    """One program per SM (per CPU core in the interpreter) strides over all tiles."""
    import dataclasses

    from insum.runtime import Kernel

    monkeypatch.setattr(tune, "_DOT", [(16, 16, 16, 1, 1)])
    if case == "dense":
        gen = torch.Generator().manual_seed(9)
        t = {"A": torch.randn(70, 40, generator=gen).to(DEVICE), "B": torch.randn(40, 50, generator=gen).to(DEVICE),
             "C": torch.full((70, 50), float("nan"), device=DEVICE)}
        expr, expected = DENSE, t["A"].double() @ t["B"].double()
    elif case == "batched":  # a grid variable outside the tiles: programs stride over (b, tiles)
        gen = torch.Generator().manual_seed(10)
        t = {"A": torch.randn(3, 40, 24, generator=gen).to(DEVICE), "B": torch.randn(3, 24, 36, generator=gen).to(DEVICE),
             "C": torch.full((3, 40, 36), float("nan"), device=DEVICE)}
        expr, expected = "C[b, m, n] = A[b, m, k] * B[b, k, n]", t["A"].double() @ t["B"].double()
    else:
        t = _block_row(3, 5, 16, 16, 4, 48, device=DEVICE)
        expr = BLOCK_ROW
        expected = torch.einsum("pqmk,pqkn->pmn", t["AV"].double(), t["B"].double()[t["AK"].long()])
    bound = bind(parse(expr), t)
    spec = spec_for(bound, descriptors=False)
    kernel = Kernel(spec, dataclasses.replace(schedule(spec, fold_k=case != "dense"), persistent=True))
    assert "tl.range(tl.program_id(0)" in kernel.source and "flatten=True" in kernel.source
    out = kernel.launch(bound, t["C"])
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=2e-2)


# -- descriptors made on the host ------------------------------------------------------------


@pytest.fixture
def offered_descriptors(monkeypatch):
    """Descriptors offered wherever a layout fits (the interpreter runs host-made ones), with
    fresh kernel and prepared-call caches so that no earlier pointer-only launch is reused."""
    from insum import execute, runtime
    from insum.cache import BoundedCache

    monkeypatch.setattr(runtime, "descriptors_supported", lambda device: True)
    monkeypatch.setattr(runtime, "_BY_SIGNATURE", BoundedCache())
    monkeypatch.setattr(runtime, "_KERNELS", BoundedCache())
    monkeypatch.setattr(execute, "_PREPARED", BoundedCache())
    monkeypatch.setattr(tune, "_DOT", [(16, 16, 16, 1, 1)])


def _boxed_source(expr: str, **tensors) -> str:
    source = insum.compile(expr, **tensors).source
    assert "_desc.load(" in source and "tl.make_tensor_descriptor" not in source
    return source


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "tiled"])
def test_host_descriptors_dense_match_float64(offered_descriptors, monkeypatch, persistent):
    """A dense product through two host-made descriptors: sizes no tile divides (the boxes
    zero-fill past the extents), a repeated call on new operands (the prepared launch makes
    new descriptors), and the persistent and tiled program orders."""
    import dataclasses

    from insum import runtime

    if not persistent:
        monkeypatch.setattr(runtime, "schedule", lambda spec, **kw: dataclasses.replace(schedule(spec, **kw), persistent=False))
    gen = torch.Generator().manual_seed(21)
    for m, k, n in [(70, 40, 56), (70, 40, 56), (33, 17 * 8, 24)]:  # rows of 16-byte multiples
        A = torch.randn(m, k, generator=gen).half().to(DEVICE)
        B = torch.randn(k, n, generator=gen).half().to(DEVICE)
        C = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
        source = _boxed_source(DENSE, A=A, B=B, C=C)
        assert ("for task in tl.range" in source) is persistent
        insum.insum(DENSE, backend="triton", A=A, B=B, C=C)
        torch.testing.assert_close(C.double(), A.double() @ B.double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m, k, n", [(1, 8, 8), (32, 0, 16), (0, 16, 16)], ids=["one-row", "empty-k", "empty-m"])
def test_host_descriptors_edge_sizes(offered_descriptors, m, k, n):
    """One row, an empty reduction and an empty output: an empty tensor is no box (pointers)."""
    A = torch.randn(m, k).half().to(DEVICE)
    B = torch.randn(k, n).half().to(DEVICE)
    C = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
    if m and k:
        _boxed_source(DENSE, A=A, B=B, C=C)
    else:
        kernel = insum.compile(DENSE, A=A, B=B, C=C)
        assert {str(kernel.plan.stmt.factors[i].name) for i in kernel.plan.boxes} == ({"B"} if k else set())
    insum.insum(DENSE, backend="triton", A=A, B=B, C=C)
    torch.testing.assert_close(C.double(), A.double() @ B.double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_host_descriptors_block_rows_match_float64(offered_descriptors, index_dtype):
    """Block-ELL (`group_size="row"`, declared lengths) loads AV's blocks and B's block rows
    at AK's data-dependent rows through host-made descriptors (held in the other order than
    the dot's: transposed); its later products run pinned (AV's descriptor kept, B's made
    per call), the last on another B."""
    from insum.formats import BlockGroupCOO

    gen = torch.Generator().manual_seed(22)
    keep = torch.rand(5, 6, generator=gen) < 0.5
    keep[2] = False  # an empty block row
    A = (torch.randn(80, 96, generator=gen) * keep.repeat_interleave(16, 0).repeat_interleave(16, 1)).half()
    fmt = BlockGroupCOO.from_dense(A.to(DEVICE), block=(16, 16), group_size="row", index_dtype=index_dtype)
    for n in (40, 128, 128):  # M = the block rows (straight boxes), then the swapped orientation
        B = torch.randn(96, n, generator=gen).half().to(DEVICE)
        out = fmt.spmm(B, backend="triton")
        torch.testing.assert_close(out.double(), A.double().to(DEVICE) @ B.double(), rtol=1e-2, atol=1e-2)
    bound_tensors = dict(fmt.statements()[0][1], B=fmt.operand(B), C=torch.empty(fmt.output_shape(n), dtype=B.dtype))
    source = _boxed_source(fmt.expression, **{k: v.to(DEVICE) for k, v in bound_tensors.items()})
    assert "tl.trans(AV_desc.load(" in source  # 16-row blocks: the swapped orientation, transposed boxes


def test_tuner_sizes_each_candidates_descriptors(offered_descriptors):
    """The tuner runs every candidate on one argument list: its pre-hook gives the
    descriptors among them each candidate's boxes."""
    from insum.runtime import kernel_for

    A, B, C = (_half(*shape).to(DEVICE) for shape in [(70, 40), (40, 56), (70, 56)])
    bound = bind(parse(DENSE), dict(A=A, B=B, C=C))
    kernel = kernel_for(bound)
    launcher = kernel.prepared(bound)
    args = launcher.args(bound.tensors, C)
    nargs = dict(zip(kernel.param_names, args))
    hook = launcher.blocks_hook(kernel.param_names)
    hook({**nargs, "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16})
    assert nargs["A_desc"].block_shape == [64, 16] and nargs["B_desc"].block_shape == [16, 32]
    assert nargs["A_desc"].shape == [70, 40] and nargs["B_desc"].base is B
    # No layout fits a box (rows of 82 and 100 bytes): pointers only, nothing to size.
    plain = bind(parse(DENSE), {n: _half(*shape).to(DEVICE) for n, shape in zip("ABC", [(70, 41), (41, 50), (70, 50)])})
    pointers = kernel_for(plain)
    assert pointers.prepared(plain).blocks_hook(pointers.param_names) is None
