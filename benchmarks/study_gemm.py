"""Dense-class GEMMs through insum: the plain statement `C[m,n] = A[m,k]*B[k,n]` and the same
with B's rows gathered, `C[m,n] = A[m,k]*B[I[k],n]` (I a random permutation of K), against
cuBLAS `A @ B` on the same sizes, and the gathered one also against torch's own way of
writing it, `A @ B[I]` (an `index_select` and cuBLAS).

Square problems, 4096^3 and 8192^3, fp16 and bf16 (issue 11's points). The gathered
statement runs as insum runs it by default: staged (`insum.codegen.stage`: the gather as a
copy, then the dense product) where each gathered row is reused by 2048 or more rows.
"""

from __future__ import annotations

import torch

from insum import insum

from .common import dtype_name, relative_error, rotations_for
from .context import Context

DENSE = "C[m, n] = A[m, k] * B[k, n]"
GATHERED = "C[m, n] = A[m, k] * B[I[k], n]"


def plan(ctx: Context) -> list[tuple]:
    """(dtype, size) in priority order."""
    if ctx.smoke:
        return [(torch.float16, 64)]
    if ctx.quick:
        return [(torch.float16, 4096), (torch.bfloat16, 4096)]
    return [(d, s) for s in (4096, 8192) for d in (torch.float16, torch.bfloat16)]


def run(ctx: Context) -> list[dict]:
    gen = torch.Generator(device=ctx.device).manual_seed(5)
    for dtype, size in plan(ctx):
        if ctx.over_budget(f"points ({dtype_name(dtype)} {size}^3)"):
            continue
        try:
            point(ctx, dtype, size, gen)
        except Exception as e:
            ctx.fail(dict(set=f"{dtype_name(dtype)} GEMM vs cuBLAS", case=f"{size}^3", dtype=dtype_name(dtype),
                          size=size), e)
    return ctx.rows


def point(ctx: Context, dtype: torch.dtype, size: int, gen: torch.Generator) -> None:
    A = torch.randn(size, size, device=ctx.device, generator=gen).to(dtype)
    r = rotations_for(size * size * A.element_size())
    Bs = [torch.randn(size, size, device=ctx.device, generator=gen).to(dtype) for _ in range(r)]
    inputs = [(B,) for B in Bs]
    index = torch.randperm(size, device=ctx.device, generator=gen).to(torch.int32)
    C = torch.empty(size, size, device=ctx.device, dtype=dtype)
    name = dtype_name(dtype)
    es = A.element_size()
    t_cublas = ctx.bench(lambda B: A @ B, inputs)
    cublas_err = relative_error(A @ Bs[0], A.double() @ Bs[0].double())
    base = dict(dtype=name, size=size, flops=2.0 * size**3, bytes=3 * size * size * es)
    for kind, expr, extra, reference in (
        ("dense", DENSE, {}, lambda B: B),
        ("gathered", GATHERED, {"I": index}, lambda B: B[index.long()]),
    ):
        expected = A.double() @ reference(Bs[0]).double()

        def product(B, expr=expr, extra=extra):
            return insum(expr, A=A, B=B, C=C, backend=ctx.backend, **extra)

        C.fill_(float("nan"))
        err = relative_error(product(Bs[0]), expected)
        t = ctx.bench(product, inputs)
        row = dict(base, case=f"{name} {kind} {size}^3", kind=kind, insum_ms=t, err=err)
        ctx.add(dict(row, set=f"{name} {kind} GEMM vs cuBLAS", anchor="cuBLAS", anchor_ms=t_cublas,
                     anchor_err=cublas_err))
        if kind == "gathered":
            gathered_err = relative_error(A @ Bs[0].index_select(0, index), expected)
            t_torch = ctx.bench(lambda B: A @ B.index_select(0, index), inputs)
            ctx.add(dict(row, set=f"{name} gathered GEMM vs torch A @ B[I]", anchor="torch A @ B[I]",
                         anchor_ms=t_torch, anchor_err=gathered_err))
