"""Block-ELL, N:M and the unstructured formats on shapes the suites do not time:
rectangular (an LLM MLP's 4096 x 11008 and 11008 x 4096 weights), sizes that are not
multiples of the block or the tile, rows that are not 16 elements apart, SparseLinear layers
of those shapes, and point-cloud convolutions at channel counts that are not multiples of 16.

    python -m benchmarks.explore.shapes [--out DIR] [--budget 480] [--only PARTS] [--profile]

The suites time squares (4096^3, 8192^3) drawn one way; users' weights are neither. Each
point is packed the way a user would (`BlockGroupCOO.from_dense(group_size="row")`,
`NM.from_dense` with the vector lengths the N:M study offers), checked against a float64
product, and timed with do_bench medians beside cuBLAS on the same dense matrix, zeros
included, and TorchBSR where the shape allows. Also the first call's wall time (packing
excluded: compile and tune), which is what a new shape costs. A shape that runs far below
the square points of REPORT.md at the same sparsity points at a tuning or layout path that
does not generalise. Parts (`--only`, comma-separated):

  block         Block-ELL at rectangular and odd shapes, against cuBLAS and TorchBSR;
  nm            N:M 2:4, 2:8, 1:8 at the same shapes (the fastest of three vector lengths);
  layer         SparseLinear forward and forward + backward against nn.Linear;
  strides       the same products with operands stored in rows 16 elements apart or not;
  unstructured  ELL, GroupCOO, CELL and `auto` with their packed tensors as packed and in
                aligned rows;
  padding       Block-ELL where K is not a whole number of blocks (B padded on every call);
  channels      a submanifold SparseConv3d at 24 to 128 channels;
  scatter       products whose output rows are scattered with atomics (grouped
                BlockGroupCOO, GroupCOO) into N columns, 16 elements apart or not;
  graphs        `formats.auto` against cuSPARSE on power-law graphs, float32 then fp16;
  widen         products into rows that are not a whole vector wide (N = 1001, 1002; odd
                channel counts), with and without widening (`insum.widening`; the variants
                are WIDEN_VARIANTS), from small to large, beside cuBLAS; fp16 (or --dtype)
                and float32 rows; with --data, a GNN layer's A @ X on Cora and Citeseer at
                their feature counts (1433, 3703) beside cuSPARSE.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time

import torch

from insum.formats import CELL, ELL, NM, BlockGroupCOO, GroupCOO, auto, power_law_matrix
from insum.formats.base import aligned_rows
from insum.nn import SparseLinear

from ..common import (
    graphed_ms,
    host_us_per_call,
    median_ms,
    print_python_profile,
    relative_error,
    rotating,
)
from .tensorcore import write_rows

#: (M, K, N) of C = A @ B with A (M x K) sparse: rows of an MLP's weights, odd sizes.
BLOCK_SHAPES = (
    (11008, 4096, 4096),
    (4096, 11008, 4096),
    (4096, 4096, 1000),
    (3000, 5000, 2048),
    (4096, 4096, 1001),
)
BLOCK_POINTS = ((32, 0.9), (64, 0.9), (64, 0.5), (128, 0.75))
NM_SHAPES = ((11008, 4096, 4096), (4096, 11008, 4096), (3000, 5000, 2048))
NM_PATTERNS = ((2, 4), (2, 8), (1, 8))
#: (in, out, batch) of SparseLinear layers: x (batch x in) -> (batch x out).
LAYERS = ((4096, 11008, 4096), (11008, 4096, 4096), (4096, 4096, 1000))
DEVICE = "cuda"
PROFILE = False  # --profile: the layers' host work under cProfile (the strides part)
LABEL = ""  # --label: which tree an A/B's row comes from (explore/ab_products.sh MODULE=...)
DEADLINE = math.inf  # perf_counter() past which a long part stops between rows (--budget)
CASES: tuple[str, ...] = ()  # --cases: the widen part's cases whose names contain one of these
DATA: str | None = None  # --data: the shared data folder (the widen part's citation graphs)


def block_random(rows: int, cols: int, block: int, s: float, dtype, gen) -> torch.Tensor:
    """A rows x cols matrix whose block x block tiles (the last ones cut) are zero with probability s."""
    keep = (
        torch.rand(math.ceil(rows / block), math.ceil(cols / block), device=DEVICE, generator=gen)
        >= s
    )
    keep[0, 0] = True
    mask = keep.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return torch.randn(rows, cols, device=DEVICE, generator=gen).to(dtype) * mask


def first_call_s(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def timed_product(A: torch.Tensor, expected_of, fmts: dict, N: int, gen) -> tuple[dict, list]:
    """Times each packing in `fmts` and cuBLAS on the same B operands; the fastest packing kept.
    Returns the row and the B operands."""
    M, K = A.shape
    Bs = [torch.randn(K, N, device=DEVICE, generator=gen).to(A.dtype) for _ in range(2)]
    row: dict = {}
    best = None
    for label, fmt in fmts.items():
        compile_s = first_call_s(lambda f=fmt: f.spmm(Bs[0]))
        err = relative_error(fmt.spmm(Bs[0]), expected_of(fmt, Bs[0]))
        ms = median_ms(rotating(lambda B, f=fmt: f.spmm(B), [(B,) for B in Bs]))
        row[f"{label}_ms"] = round(ms, 4)
        if best is None or ms < best[0]:
            best = (ms, label, err, compile_s)
    row.update(
        insum_ms=round(best[0], 4), packing=best[1], err=best[2], first_call_s=round(best[3], 2)
    )
    row["cublas_ms"] = round(median_ms(rotating(lambda B: A @ B, [(B,) for B in Bs])), 4)
    row["vs_cublas"] = round(row["cublas_ms"] / best[0], 3)
    return row, Bs


def block_points(gen, dtype, rows: list) -> None:
    for M, K, N in BLOCK_SHAPES:
        for block, s in BLOCK_POINTS:
            report(block_point(gen, dtype, M, K, N, block, s), rows)


def block_point(gen, dtype, M: int, K: int, N: int, block: int, s: float) -> dict:
    from torch.sparse._triton_ops import bsr_dense_mm

    A = block_random(M, K, block, s, dtype, gen)
    fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row")
    kept = float((A.view(-1) != 0).float().mean())
    row = dict(
        kind="block", shape=f"{M}x{K}x{N}", block=block, sparsity=s, ideal=round(1 / kept, 2)
    )
    timed, Bs = timed_product(A, lambda f, B: A.double() @ B.double(), {"row": fmt}, N, gen)
    row |= timed
    if M % block == 0 and K % block == 0 and N % 16 == 0:  # (bsr_dense_mm asks N % 16 == 0)
        bsr = A.to_sparse_bsr((block, block))
        row["torchbsr_ms"] = round(
            median_ms(rotating(lambda B: bsr_dense_mm(bsr, B), [(B,) for B in Bs])), 4
        )
        row["vs_torchbsr"] = round(row["torchbsr_ms"] / row["insum_ms"], 3)
    row["of_ideal"] = round(row["vs_cublas"] / row["ideal"], 3)
    return row


def nm_points(gen, dtype, rows: list) -> None:
    for M, K, N in NM_SHAPES:
        A = torch.randn(M, K, device=DEVICE, generator=gen).to(dtype)
        for n, m in NM_PATTERNS:
            fmts = {f"L{L}": NM.from_dense(A, n=n, m=m, vector_len=L) for L in (32, 128, 256)}
            row = dict(kind="nm", shape=f"{M}x{K}x{N}", pattern=f"{n}:{m}", ideal=m / n)
            row |= timed_product(A, lambda f, B: f.to_dense().double() @ B.double(), fmts, N, gen)[0]
            row["of_ideal"] = round(row["vs_cublas"] / row["ideal"], 3)
            report(row, rows)


def layer_points(gen, dtype, rows: list) -> None:
    for fan_in, fan_out, batch in LAYERS:
        report(layer_point(gen, dtype, fan_in, fan_out, batch), rows)


def layer_point(gen, dtype, fan_in: int, fan_out: int, batch: int) -> dict:
    """A 90% 32 x 32 Block-ELL SparseLinear against nn.Linear: forward, forward + backward."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(fan_in, fan_out, device=DEVICE, dtype=dtype)
    layer = SparseLinear.from_linear(
        dense, "BlockGroupCOO", sparsity=0.9, block=(32, 32), group_size="row"
    )
    weight = layer.to_dense().double()
    x = torch.randn(batch, fan_in, device=DEVICE, dtype=dtype, generator=gen, requires_grad=True)
    gy = torch.randn(batch, fan_out, device=DEVICE, dtype=dtype, generator=gen)
    row = dict(kind="layer", shape=f"{fan_in}->{fan_out} batch {batch}", block=32, sparsity=0.9)
    row["first_call_s"] = round(first_call_s(lambda: layer(x).backward(gy)), 2)
    expected = x.detach().double() @ weight.t() + dense.bias.detach().double()
    row["err"] = relative_error(layer(x).detach(), expected)
    x.grad = None
    layer(x).backward(gy)
    row["dx_err"] = relative_error(x.grad, gy.double() @ weight)
    row["insum_fwd_ms"] = round(median_ms(lambda: layer(x)), 4)
    row["dense_fwd_ms"] = round(median_ms(lambda: dense(x)), 4)
    row["insum_step_ms"] = round(median_ms(lambda: layer(x).backward(gy)), 4)
    row["dense_step_ms"] = round(median_ms(lambda: dense(x).backward(gy)), 4)
    row["insum_step_host_us"] = round(host_us_per_call(lambda: layer(x).backward(gy), calls=200), 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x).backward(gy)
        torch.cuda.synchronize()
    row["step_kernels_us"] = {e.key[:50]: round(e.device_time_total / 5, 1) for e in prof.key_averages()
                              if e.device_time_total > 0}
    row["fwd_vs_dense"] = round(row["dense_fwd_ms"] / row["insum_fwd_ms"], 3)
    row["step_vs_dense"] = round(row["dense_step_ms"] / row["insum_step_ms"], 3)
    return row


def stride_points(gen, dtype, rows: list) -> None:
    """The same products with operands whose rows start 16 elements apart or not: Triton
    specialises a stride on divisibility by 16 only, and vectorises loads and stores by it."""
    M = K = 4096
    A = block_random(M, K, 64, 0.9, dtype, gen)
    fmt = BlockGroupCOO.from_dense(A, block=(64, 64), group_size="row")
    for N, aligned_b in ((1024, False), (1008, False), (1000, False), (1000, True)):
        B = torch.randn(K, N, device=DEVICE, generator=gen).to(dtype)
        B = aligned_rows(B) if aligned_b else B
        err = relative_error(fmt.spmm(B), A.double() @ B.double())
        ms = median_ms(lambda B=B: fmt.spmm(B))
        report(dict(kind="strides", case="Block-ELL 64x64 s=0.9 4096x4096xN", N=N, B_stride=B.stride(0),
                    err=err, insum_ms=round(ms, 4)), rows)
    A = torch.randn(3000, 5000, device=DEVICE, generator=gen).to(dtype)
    B = torch.randn(5000, 2048, device=DEVICE, generator=gen).to(dtype)
    for n, m in ((2, 4), (1, 8)):
        fmt = NM.from_dense(A, n=n, m=m, vector_len=128)
        padded = copy.copy(fmt)
        padded._tensors = dict(fmt._tensors, AV=aligned_rows(fmt.AV), AK=aligned_rows(fmt.AK))
        expected = fmt.to_dense().double() @ B.double()
        for label, f in (("as packed", fmt), ("aligned rows", padded)):
            err = relative_error(f.spmm(B), expected)
            ms = median_ms(lambda f=f: f.spmm(B))
            report(dict(kind="strides", case=f"N:M {n}:{m} 3000x5000x2048 AV {label}", AV_stride=f.AV.stride(1),
                        err=err, insum_ms=round(ms, 4)), rows)
    for batch in (1024, 1008, 1000):
        torch.manual_seed(0)
        dense = torch.nn.Linear(4096, 4096, device=DEVICE, dtype=dtype)
        layer = SparseLinear.from_linear(dense, "BlockGroupCOO", sparsity=0.9, block=(32, 32), group_size="row")
        x = torch.randn(batch, 4096, device=DEVICE, dtype=dtype, generator=gen)
        with torch.no_grad():
            layer(x)
            ms = median_ms(lambda layer=layer, x=x: layer(x))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    layer(x)
                torch.cuda.synchronize()
            kernels = {e.key[:60]: round(e.device_time_total / 5, 1) for e in prof.key_averages() if e.device_time_total > 0}
            host = host_us_per_call(lambda layer=layer, x=x: layer(x), calls=500)
            report(dict(kind="strides", case=f"layer 4096->4096 batch {batch} forward", insum_ms=round(ms, 4),
                        host_us=round(host, 1), kernels_us=kernels), rows)
            if PROFILE:
                print_python_profile(lambda layer=layer, x=x: layer(x), 300, limit=14)


def uniform_csr(rows: int, cols: int, per_row: float, gen) -> torch.Tensor:
    mask = torch.rand(rows, cols, device=DEVICE, generator=gen) < per_row / cols
    return (torch.randn(rows, cols, device=DEVICE, generator=gen) * mask).to_sparse_csr()


def unstructured_points(gen, dtype, rows: list) -> None:
    """Unstructured formats with their packed tensors as packed and stored in aligned rows
    (`aligned_rows` on every tensor of two or more dimensions): what aligning would gain
    them, on rows whose packed width is any number."""
    matrices = {
        "power-law 20000 x 20000, 13 a row": lambda: power_law_matrix(20000, 20000, 13, seed=1).to(DEVICE),
        "uniform 8192 x 8192, 100 a row": lambda: uniform_csr(8192, 8192, 100, gen),
        "uniform 16384 x 16384, 7 a row": lambda: uniform_csr(16384, 16384, 7, gen),
    }
    for name, make in matrices.items():
        csr = make().to(torch.float32)
        for value_dtype in (torch.float32, dtype):
            A = csr.to(value_dtype)
            B = torch.randn(A.shape[1], 128, device=DEVICE, generator=gen).to(value_dtype)
            expected = A.to(torch.float64) @ B.double()
            packings = {"auto": lambda A=A: auto(A, n_cols=128), "ELL": lambda A=A: ELL.from_torch(A),
                        "GroupCOO": lambda A=A: GroupCOO.from_torch(A), "CELL": lambda A=A: CELL.from_torch(A)}
            for label, pack in packings.items():
                try:
                    fmt = pack()
                except Exception as e:  # a packing that does not fit is a result
                    report(dict(kind="unstructured", matrix=name, packing=label, failed=f"{type(e).__name__}: {e}"[:200]), rows)
                    continue
                aligned = copy.copy(fmt)
                aligned._tensors = {k: aligned_rows(v) for k, v in fmt._tensors.items()}
                row = dict(kind="unstructured", matrix=name, dtype=str(value_dtype)[6:], packing=label, chosen=repr(fmt)[:160],
                           strides={k: v.stride() for k, v in fmt._tensors.items() if v.dim() > 1})
                for variant, f in (("packed", fmt), ("aligned", aligned)):
                    row[f"{variant}_err"] = relative_error(f @ B, expected)
                    row[f"{variant}_ms"] = round(median_ms(lambda f=f, B=B: f @ B), 4)
                row["gain"] = round(row["packed_ms"] / row["aligned_ms"], 3)
                # Device time alone (CUDA-graph replays) and the host's issue time: a product of
                # a few tens of µs is timed by whichever is longer.
                row["packed_graphed_ms"] = round(graphed_ms(lambda fmt=fmt, B=B: fmt @ B), 4)
                row["packed_host_us"] = round(host_us_per_call(lambda fmt=fmt, B=B: fmt @ B, calls=300), 1)
                report(row, rows)


def padding_points(gen, dtype, rows: list) -> None:
    """Block-ELL on sizes that are not whole blocks against the same product rounded up to
    whole blocks (32 and 128): the format pads B's rows to whole blocks on every call."""
    for M, K, N in ((3000, 5000, 2048), (3008, 5024, 2048), (3072, 5120, 2048)):
        for block in (32, 64):
            A = block_random(M, K, block, 0.9, dtype, gen)
            fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row")
            B = torch.randn(K, N, device=DEVICE, generator=gen).to(dtype)
            row = dict(kind="padding", shape=f"{M}x{K}x{N}", block=block, sparsity=0.9)
            row["err"] = relative_error(fmt.spmm(B), A.double() @ B.double())
            row["insum_ms"] = round(median_ms(lambda fmt=fmt, B=B: fmt.spmm(B)), 4)
            row["insum_graphed_ms"] = round(graphed_ms(lambda fmt=fmt, B=B: fmt.spmm(B)), 4)
            row["operand_ms"] = round(median_ms(lambda fmt=fmt, B=B: fmt.operand(B)), 4)
            row["cublas_ms"] = round(median_ms(lambda A=A, B=B: A @ B), 4)
            row["vs_cublas"] = round(row["cublas_ms"] / row["insum_ms"], 3)
            report(row, rows)


def channel_points(gen, dtype, rows: list) -> None:
    """A submanifold SparseConv3d (k = 3) on one scene at channel counts whose rows are, or
    are not, 16 elements apart: the gathered rows of X are pointer loads, vectorised by the
    stride's specialisation (divisible by 16 or not)."""
    from benchmarks.study_conv import room_scene
    from insum.nn import SparseConv3d

    coords = room_scene(150_000, seed=3, device=DEVICE)[:, 1:] + 4
    for channels in (24, 32, 40, 48, 96, 98, 100, 112, 120, 128):
        torch.manual_seed(0)
        conv = SparseConv3d(channels, channels, 3).to(DEVICE, dtype)
        x = torch.randn(coords.shape[0], channels, device=DEVICE, generator=gen).to(dtype)
        conv(x, coords)
        ms = median_ms(lambda conv=conv, x=x: conv(x, coords))
        pairs = conv.kernel_map(coords).pairs
        report(dict(kind="channels", voxels=coords.shape[0], channels=channels, insum_ms=round(ms, 4),
                    us_per_channel2=round(ms * 1e3 / channels**2, 5), pairs=pairs), rows)


def scatter_points(gen, dtype, rows: list) -> None:
    """Products that add their output rows atomically, at widths whose rows are 16 elements
    apart (1008, 1024) or 8 (1000), 2 (1002), 1 (1001): fp16 atomics add 8 elements at once
    only into rows the kernel knows to be 16-byte aligned."""
    A = block_random(4096, 4096, 32, 0.9, dtype, gen)
    blocks = BlockGroupCOO.from_dense(A, block=(32, 32))
    U = (torch.rand(8192, 8192, device=DEVICE, generator=gen) < 100 / 8192).to(dtype)
    unstructured = GroupCOO.from_dense(U, group_size=32)
    for name, dense, fmt in (("grouped BlockGroupCOO 32x32 s=0.9", A, blocks), ("GroupCOO g=32", U, unstructured)):
        for N in (1000, 1001, 1002, 1008, 1024):
            B = torch.randn(dense.shape[1], N, device=DEVICE, generator=gen).to(dtype)
            row = dict(kind="scatter", format=name, shape=f"{dense.shape[0]}x{dense.shape[1]}x{N}")
            row["err"] = relative_error(fmt @ B, dense.double() @ B.double())
            row["insum_ms"] = round(median_ms(lambda fmt=fmt, B=B: fmt @ B), 4)
            row["cublas_ms"] = round(median_ms(lambda A=dense, B=B: A @ B), 4)
            report(row, rows)


def graph_points(gen, dtype, rows: list) -> None:
    """`formats.auto` against cuSPARSE on power-law graphs (average degree 16), float32 first
    and then `dtype` in one process, as a user converting a model would: kernels of both dtypes
    can share one source (and its disk table of tuned tiles)."""
    for n in (65536, 262144):
        csr = power_law_matrix(n, n, 16, seed=0, device=DEVICE)
        for value_dtype in (torch.float32, dtype):
            A = csr.to(value_dtype)
            B = torch.randn(n, 128, device=DEVICE, generator=gen).to(value_dtype)
            fmt = auto(A, n_cols=128)
            row = dict(kind="graphs", matrix=f"power-law {n}^2, 16 a row", dtype=str(value_dtype)[6:],
                       chosen=repr(fmt)[:120])
            row["err"] = relative_error(fmt @ B, A.to(torch.float64) @ B.double())
            row["auto_ms"] = round(median_ms(lambda fmt=fmt, B=B: fmt @ B), 4)
            row["auto_graphed_ms"] = round(graphed_ms(lambda fmt=fmt, B=B: fmt @ B), 4)
            row["cusparse_ms"] = round(median_ms(lambda A=A, B=B: A @ B), 4)
            row["vs_cusparse"] = round(row["cusparse_ms"] / row["auto_ms"], 3)
            report(row, rows)


#: The widening variants a `widen` row times, alternated in one process: (label, INSUM_WIDEN,
#: WIDEN_BELOW_BYTES, WIDEN_MIN_BYTES; None: the default). "timed" is the default (each
#: product timed as it is and widened on its first call), "timed4" the same for rows under 4
#: bytes of alignment only (odd fp16 widths), "forced" widens whatever qualifies. Each
#: variant's INSUM_WIDEN value differs, so that no call prepared under one repeats under
#: another. (Session 18's call1-call7 ran "rule"/"all" and then "timed16": that is "timed" now.)
WIDEN_VARIANTS = (("off", "0", None, None), ("timed", None, None, None), ("timed4", "4", 4, None),
                  ("forced", "1", None, None))


def _widen_variant(value, below, least) -> None:
    from insum import widening

    if value is None:
        os.environ.pop("INSUM_WIDEN", None)
    else:
        os.environ["INSUM_WIDEN"] = value
    widening.WIDEN_BELOW_BYTES = below if below is not None else _WIDEN_DEFAULTS[0]
    widening.WIDEN_MIN_BYTES = least if least is not None else _WIDEN_DEFAULTS[1]


def _widen_cases(gen, dtype):
    """(name, packed format, its dense matrix, K, widths N) per case."""
    cases = []
    A = block_random(4096, 4096, 32, 0.9, dtype, gen)
    grouped = BlockGroupCOO.from_dense(A, block=(32, 32))
    cases.append(("grouped BlockGroupCOO 4096^2 32x32 s=0.9", grouped, A, 4096, (1000, 1001, 1002)))
    A64 = block_random(4096, 4096, 64, 0.9, dtype, gen)
    cases.append(("Block-ELL 4096^2 64x64 s=0.9", BlockGroupCOO.from_dense(A64, block=(64, 64), group_size="row"),
                  A64, 4096, (1000, 1001, 1002)))
    U = (torch.rand(8192, 8192, device=DEVICE, generator=gen) < 100 / 8192).to(dtype)
    cases.append(("GroupCOO g=32 8192^2 100 a row", GroupCOO.from_dense(U, group_size=32), U, 8192, (1000, 1001, 1002)))
    cases.append(("ELL 8192^2 100 a row", ELL.from_dense(U), U, 8192, (1001,)))
    N2 = torch.randn(4096, 4096, device=DEVICE, generator=gen).to(dtype)
    nm = NM.from_dense(N2, n=2, m=8, vector_len=128)
    cases.append(("N:M 2:8 4096^2", nm, nm.to_dense(), 4096, (1001,)))
    S = (torch.rand(1024, 1024, device=DEVICE, generator=gen) < 16 / 1024).to(dtype)
    cases.append(("GroupCOO 1024^2 16 a row (small)", GroupCOO.from_dense(S), S, 1024, (33, 101, 1001)))
    Ab = block_random(512, 512, 32, 0.75, dtype, gen)
    cases.append(("grouped BlockGroupCOO 512^2 32x32 s=0.75 (small)", BlockGroupCOO.from_dense(Ab, block=(32, 32)),
                  Ab, 512, (101, 1001)))
    return cases


_WIDEN_DEFAULTS: tuple = ()


def widen_points(gen, dtype, rows: list) -> None:
    """Each case at each width under each of WIDEN_VARIANTS (alternated, each timed twice),
    checked against float64, beside the dense product (cuBLAS) on the same B. float32 rows
    too: its rows are 4-byte aligned at any width, so the default rule leaves them."""
    global _WIDEN_DEFAULTS
    from insum import widening

    _WIDEN_DEFAULTS = (widening.WIDEN_BELOW_BYTES, widening.WIDEN_MIN_BYTES)
    kept = os.environ.get("INSUM_WIDEN")
    try:
        for value_dtype in (dtype, torch.float32):
            for name, fmt, dense, K, widths in _widen_cases(gen, value_dtype):
                if CASES and not any(c in name for c in CASES):
                    continue
                if value_dtype == torch.float32:  # (one odd width: the rule leaves float32 rows)
                    if "small" in name:
                        continue
                    widths = (1001,)
                for N in widths:
                    if time.perf_counter() > DEADLINE:
                        print(f"skipped {name} N={N} ({str(value_dtype)[6:]}): past the budget", flush=True)
                        continue
                    Bs = [torch.randn(K, N, device=DEVICE, generator=gen).to(value_dtype) for _ in range(2)]
                    expected = dense.double() @ Bs[0].double()
                    row = dict(kind="widen", case=name, dtype=str(value_dtype)[6:], N=N)
                    _time_variants(row, fmt, Bs, expected, graphed=True)
                    row["cublas_ms"] = round(median_ms(rotating(lambda B, A=dense: A @ B, [(B,) for B in Bs])), 4)
                    report(row, rows)
        if DATA is not None:
            for graph, features in (("cora", 1433), ("citeseer", 3703)):
                if time.perf_counter() < DEADLINE and (not CASES or any(c in graph for c in CASES)):
                    report(_widen_graph(gen, dtype, graph, features), rows)
        for channels in (35, 99):
            if time.perf_counter() < DEADLINE and (not CASES or any(c in "SparseConv3d" for c in CASES)):
                report(_widen_conv(gen, dtype, channels), rows)
    finally:
        widening.WIDEN_BELOW_BYTES, widening.WIDEN_MIN_BYTES = _WIDEN_DEFAULTS
        if kept is None:
            os.environ.pop("INSUM_WIDEN", None)
        else:
            os.environ["INSUM_WIDEN"] = kept


def _widen_graph(gen, dtype, graph: str, features: int) -> dict:
    """A GNN layer's neighbour sum A @ X on a citation graph at its own feature count (odd
    widths: Cora 1433, Citeseer 3703), `formats.auto` per variant beside cuSPARSE."""
    from insum.formats import load_mtx

    A = load_mtx(os.path.join(DATA, "graphs", f"{graph}.mtx.gz")).to(DEVICE).to(dtype)
    Xs = [torch.randn(A.shape[1], features, device=DEVICE, generator=gen).to(dtype) for _ in range(2)]
    expected = A.to(torch.float64) @ Xs[0].double()
    row = dict(kind="widen", case=f"{graph} A @ X ({A.shape[0]} nodes, {A._nnz()} edges)", dtype=str(dtype)[6:],
               N=features)
    packed = auto(A, n_cols=features)
    row["chosen"] = repr(packed)[:100]
    _time_variants(row, packed, Xs, expected)
    row["cusparse_ms"] = round(median_ms(rotating(lambda X: A @ X, [(X,) for X in Xs])), 4)
    row["timed_vs_cusparse"] = round(row["cusparse_ms"] / row["timed_ms"], 3)
    return row


def _time_variants(row: dict, fmt, Bs: list, expected: torch.Tensor, graphed: bool = False) -> None:
    """`fmt @ B` under each of WIDEN_VARIANTS, alternated twice (the lesser median kept), on
    one format object per variant: a product pinned under one variant's switches does not
    repeat under another's (it would take the full path). Adds each variant's error against
    `expected` (of Bs[0]), median, device time (`graphed`) and gain over "off" to `row`."""
    fmts = {label: _without_plans(fmt) for label, *_ in WIDEN_VARIANTS}
    for _ in range(2):
        for label, value, below, least in WIDEN_VARIANTS:
            _widen_variant(value, below, least)
            f = fmts[label]
            row[f"{label}_err"] = relative_error(f @ Bs[0], expected)
            ms = median_ms(rotating(lambda B, f=f: f @ B, [(B,) for B in Bs]))
            row[f"{label}_ms"] = round(min(ms, row.get(f"{label}_ms", ms)), 4)
            if graphed and f"{label}_graphed_ms" not in row:  # device time alone
                row[f"{label}_graphed_ms"] = round(graphed_ms(lambda f=f, B=Bs[0]: f @ B), 4)
    for label, *_ in WIDEN_VARIANTS[1:]:
        row[f"{label}_gain"] = round(row["off_ms"] / row[f"{label}_ms"], 3)


def _without_plans(fmt):
    """A copy of a format object without the products it keeps (`SparseFormat.spmm`)."""
    fresh = copy.copy(fmt)
    fresh.__dict__.pop("_spmm_plans", None)
    return fresh


def _widen_conv(gen, dtype, channels: int) -> dict:
    """A submanifold SparseConv3d (k = 3, 150k voxels) at an odd channel count per variant
    (errors against the first variant's output)."""
    from benchmarks.study_conv import room_scene
    from insum.nn import SparseConv3d

    coords = room_scene(150_000, seed=3, device=DEVICE)[:, 1:] + 4
    torch.manual_seed(0)
    conv = SparseConv3d(channels, channels, 3).to(DEVICE, dtype)
    x = torch.randn(coords.shape[0], channels, device=DEVICE, generator=gen).to(dtype)
    row = dict(kind="widen", case=f"SparseConv3d {channels} channels", dtype=str(dtype)[6:], N=channels)
    reference = None
    for _ in range(2):
        for label, value, below, least in WIDEN_VARIANTS:
            _widen_variant(value, below, least)
            with torch.no_grad():
                y = conv(x, coords)[0]
                reference = y if reference is None else reference
                row[f"{label}_err"] = relative_error(y, reference.double())
                ms = median_ms(lambda: conv(x, coords))
            row[f"{label}_ms"] = round(min(ms, row.get(f"{label}_ms", ms)), 4)
    for label, *_ in WIDEN_VARIANTS[1:]:
        row[f"{label}_gain"] = round(row["off_ms"] / row[f"{label}_ms"], 3)
    return row


def report(row: dict, rows: list) -> None:
    if LABEL:
        row = {"label": LABEL, **row}
    rows.append(row)
    print({k: (f"{v:.2e}" if k.endswith("err") else v) for k, v in row.items()}, flush=True)
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="a folder for shapes.json")
    parser.add_argument(
        "--budget", type=float, default=480.0, help="seconds; later parts are skipped past it"
    )
    parser.add_argument("--only", default="block,nm,layer")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--profile", action="store_true", help="cProfile the strides part's layer forwards")
    parser.add_argument("--label", default="", help="a tag on every row (an A/B's tree)")
    parser.add_argument("--cases", default="", help="widen: only cases whose names contain one of these (commas)")
    parser.add_argument("--data", default=None, help="the shared data folder (widen: citation graphs)")
    args = parser.parse_args()
    global PROFILE, LABEL, DEADLINE, CASES, DATA
    PROFILE, LABEL, DATA = args.profile, args.label, args.data
    CASES = tuple(c for c in args.cases.split(",") if c)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    rows: list[dict] = []
    start = time.perf_counter()
    DEADLINE = start + args.budget
    parts = (("block", block_points), ("nm", nm_points), ("layer", layer_points), ("strides", stride_points),
             ("unstructured", unstructured_points), ("padding", padding_points),
             ("channels", channel_points), ("scatter", scatter_points), ("graphs", graph_points),
             ("widen", widen_points))
    for part, fn in parts:
        if part not in args.only.split(","):
            continue
        if time.perf_counter() - start > args.budget:
            print(f"skipped {part}: past the budget", flush=True)
            continue
        try:
            fn(gen, dtype, rows)
        except Exception as e:  # one part's failure is a result, the others still run
            print(f"{part} FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(kind=part, failed=f"{type(e).__name__}: {e}"[:400]))
    if args.out:
        write_rows(args.out, "shapes", rows)


if __name__ == "__main__":
    main()
