"""N:M SpMM: vector-wise N:M (`NM.from_dense`, magnitude pruning) `fmt @ B` against dense
cuBLAS on the unpruned shape and, at 2:4, cuSPARSELt (`to_sparse_semi_structured` of the
same pruned matrix; fp16 and bf16 only).

The square shapes of the NM-SpMM paper's Llama-like sweep, 512^3 to 4096^3, fp16 and fp32
(then 8192^3 in fp16 and 4096^3-8192^3 in bf16 at 2:4, 2:8 and 1:8, issue 11's points)
(TF32 allowed for the dense fp32 anchor, as insum's fp32 `tl.dot` uses TF32), sparsity
50% (2:4, 4:8), 62.5% (3:8), 75% (2:8) and 87.5% (1:8). The vector length L (rows that
share one index row) is a format parameter: each candidate is packed, checked and timed,
and the fastest is kept; it and cuBLAS are then timed a second time and each keeps its
lower do_bench median (`rounds_ms`; the 2:4 anchors twice in a row). Ideal speed-up over
dense: M/N.
"""

from __future__ import annotations

import torch

from insum.dtypes import HALF_DTYPES
from insum.formats import NM

from .common import dtype_name, relative_error, rotations_for
from .context import Context

SIZES = (512, 1024, 2048, 4096)


def plan(ctx: Context) -> list[tuple]:
    """(dtype, (n, m), sizes) in priority order: the targets (fp16, 2:4, 2:8, 1:8) first."""
    if ctx.smoke:
        return [(torch.float16, (2, 4), (64,)), (torch.float32, (1, 8), (64,))]
    sizes = (1024, 4096) if ctx.quick else SIZES
    fp16, fp32 = torch.float16, torch.float32
    jobs = [(fp16, p, sizes) for p in ((2, 4), (2, 8), (1, 8))]
    jobs += [(fp16, p, sizes) for p in ((4, 8), (3, 8))]
    jobs += [(fp32, p, sizes) for p in ((2, 8), (1, 8), (2, 4), (4, 8), (3, 8))]
    if not ctx.quick:  # issue 11's points: 8192^3, and bf16 at both sizes
        jobs += [(fp16, p, (8192,)) for p in ((2, 4), (2, 8), (1, 8))]
        jobs += [(torch.bfloat16, p, (4096, 8192)) for p in ((2, 4), (2, 8), (1, 8))]
    return jobs


def vector_lengths(ctx: Context, size: int) -> tuple[int, ...]:
    if ctx.smoke:
        return (16,)
    # 256-row vectors: a 1:8 product ran 7% faster than with 128 (explore/config_sweep, session9/call7).
    return (64,) if ctx.quick else (32, 128, 256) if size >= 4096 else (32, 128)


def run(ctx: Context) -> list[dict]:
    gen = torch.Generator(device=ctx.device).manual_seed(3)
    to_sparse_semi_structured = ctx.cuda_anchor("cuSPARSELt", "torch.sparse", "to_sparse_semi_structured")
    dense_cache: dict = {}
    for dtype, (n, m), sizes in plan(ctx):
        for size in sizes:
            if ctx.over_budget(f"configs ({dtype_name(dtype)} {n}:{m})"):
                continue
            try:
                config(ctx, dtype, n, m, size, gen, dense_cache, to_sparse_semi_structured)
            except Exception as e:
                ctx.fail(dict(set=f"{dtype_name(dtype)} {n}:{m} vs cuBLAS", case=f"{size}^3", dtype=dtype_name(dtype),
                              pattern=f"{n}:{m}", size=size, sparsity=1 - n / m, ideal=m / n), e)
    return ctx.rows


def config(ctx, dtype, n, m, size, gen, dense_cache, to_sparse_semi_structured) -> None:
    A = torch.randn(size, size, device=ctx.device, generator=gen).to(dtype)
    r = rotations_for(size * size * A.element_size())
    Bs = [torch.randn(size, size, device=ctx.device, generator=gen).to(dtype) for _ in range(r)]
    inputs = [(B,) for B in Bs]
    best, times = None, {}
    for L in vector_lengths(ctx, size):
        fmt = NM.from_dense(A, n=n, m=m, vector_len=L)
        pruned = fmt.to_dense()
        expected = pruned.double() @ Bs[0].double()
        err = relative_error(fmt.spmm(Bs[0], backend=ctx.backend), expected)
        t = ctx.bench(lambda B, f=fmt: f.spmm(B, backend=ctx.backend), inputs)
        times[L] = round(t, 5)
        if best is None or t < best[0]:
            best = (t, fmt, err, L, pruned, expected)
    t_insum, fmt, err, L, pruned, expected = best
    es = A.element_size()
    kept_cols = size * n // m
    moved = size * kept_cols * es + (size // L) * kept_cols * 4 + size * size * es + size * size * es
    base = dict(
        case=f"{dtype_name(dtype)} {n}:{m} {size}^3", dtype=dtype_name(dtype), pattern=f"{n}:{m}", n=n, m=m,
        size=size, sparsity=1 - n / m, ideal=m / n, vector_len=L, vector_len_times_ms=times,
        insum_ms=t_insum, err=err, bytes=moved, flops=2.0 * size**3 * n / m,
    )
    key = (dtype, size)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # as insum's fp32 tl.dot
    try:
        if key not in dense_cache:
            dense_err = relative_error(A @ Bs[0], A.double() @ Bs[0].double())
            dense_cache[key] = (ctx.bench(lambda B: A @ B, inputs), dense_err)
        # A second round of both (as the structured study): a short product's do_bench median
        # carries the host's load; each keeps its lower median (cuBLAS's over every round of
        # this shape).
        t_dense, dense_err = dense_cache[key]
        second = (ctx.bench(lambda B, f=fmt: f.spmm(B, backend=ctx.backend), inputs), ctx.bench(lambda B: A @ B, inputs))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    dense_cache[key] = (min(t_dense, second[1]), dense_err)
    base["insum_ms"] = min(t_insum, second[0])
    ctx.add(dict(base, set=f"{dtype_name(dtype)} {n}:{m} vs cuBLAS", anchor="cuBLAS",
                 anchor_ms=dense_cache[key][0], anchor_err=dense_err,
                 rounds_ms={"insum": [t_insum, second[0]], "anchor": [t_dense, second[1]]}))
    if (n, m) == (2, 4) and to_sparse_semi_structured is not None:
        if dtype not in HALF_DTYPES:
            note = f"cuSPARSELt: no {dtype_name(dtype)} support in torch's semi-structured sparsity"
            if note not in ctx.notes:
                ctx.note(note)
            return
        from torch.sparse import SparseSemiStructuredTensor

        label = f"{dtype_name(dtype)} {size}^3"
        kind = _two_four_anchor(ctx, base, "cuSPARSELt", label, to_sparse_semi_structured, pruned, Bs, expected, inputs)
        if kind is not None and "CUSPARSELT" not in kind.upper():  # torch falls back to CUTLASS
            ctx.note(f"to_sparse_semi_structured gave {kind}, not cuSPARSELt")
        # torch's other 2:4 kernel (CUTLASS): a second view of the same hardware feature,
        # without cuSPARSELt's per-call setup.
        forced = SparseSemiStructuredTensor._FORCE_CUTLASS
        try:
            SparseSemiStructuredTensor._FORCE_CUTLASS = True
            _two_four_anchor(ctx, base, "CUTLASS 2:4", label, to_sparse_semi_structured, pruned, Bs, expected, inputs)
        finally:
            SparseSemiStructuredTensor._FORCE_CUTLASS = forced


def _two_four_anchor(ctx, base, anchor, label, to_sparse_semi_structured, pruned, Bs, expected, inputs) -> str | None:
    """Time torch's 2:4 matmul of `pruned` as `anchor`; the implementation's class name, or
    None (with a note) when torch cannot run it here."""
    try:
        sparse = to_sparse_semi_structured(pruned)
        err = relative_error(sparse @ Bs[0], expected)
        rounds = [ctx.bench(lambda B: sparse @ B, inputs) for _ in range(2)]  # (the lower median, as insum's)
        t = min(rounds)
    except Exception as e:
        ctx.note(f"{anchor} {label}: {type(e).__name__}: {str(e)[:160]}")
        return None
    kind = type(sparse).__name__
    ctx.add(dict(base, set=f"{base['dtype']} 2:4 vs {anchor}", anchor=anchor, anchor_ms=t, anchor_err=err,
                 anchor_impl=kind, rounds_ms={"anchor": rounds}))
    return kind
