"""Two schedule ideas measured before building them (issue 11), in one process:

    python -m benchmarks.explore.order_stage [--out DIR]

1. *Longest block rows first.* A Block-ELL product with declared lengths runs one program
   per (block row, N tile), block rows in index order, so the longest rows may start last
   and leave the GPU's tail half idle. Packing the block rows in decreasing count and
   storing through the permutation (`C[AM[p], m, n] = ...`, AM unique) starts the
   longest first (the LPT rule). Timed against the row order, beside cuBLAS.
2. *Staging a gathered operand.* `C[m,n] = A[m,k]*B[I[k],n]` loads B's rows through
   pointers in every program (Hopper has no TMA gather); gathering once (a copy of K x N)
   and running the dense statement on tensor descriptors may cost less when every M tile
   reuses the gathered rows. First measured as `B.index_select` + the dense statement
   (session9/call1); now `insum()` itself with INSUM_STAGE=0 (fused) and 1 (staged,
   `insum.codegen.stage`, copy included), beside cuBLAS and `A @ B[I]` in torch.
"""

from __future__ import annotations

import argparse
import os

import torch

import insum

from ..common import median_ms, relative_error, rotating
from .tensorcore import block_ell, block_problem, write_rows

BLOCK_EXPR = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"
ORDERED_EXPR = "C[AM[p], m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"


def say(line: str) -> None:
    print(line, flush=True)


def order_case(size: int, block: int, s: float, dtype, rows: list) -> None:
    Bs, t_cublas, A, keep, expected = block_problem(size, block, s, dtype)
    nb = size // block
    counts = keep.sum(1).to(torch.int32)
    order = torch.argsort(counts, descending=True, stable=True)
    Bv = [B.view(nb, block, size) for B in Bs]
    C = torch.empty(nb, block, size, device="cuda", dtype=dtype)
    plain = block_ell(keep, A, block)
    A_sorted = A.view(nb, block, size)[order].reshape(size, size)
    ordered = block_ell(keep[order], A_sorted, block)
    AM = order.to(torch.int32)
    point = f"{dtype} {size}^3 b{block} s={s}"
    say(f"{point}: cuBLAS {t_cublas * 1e3:.1f} us; blocks per row mean {float(counts.float().mean()):.1f} "
        f"max {int(counts.max())}")
    variants = [
        ("row order, lengths", BLOCK_EXPR, {**plain}, {"lengths": {"q[p]": counts}}),
        ("longest first, lengths", ORDERED_EXPR, {**ordered, "AM": AM},
         {"lengths": {"q[p]": counts[order].contiguous()}, "unique_indices": {"AM"}}),
    ]
    for label, expr, tensors, options in variants:
        def call(B, expr=expr, tensors=tensors, options=options):
            return insum.insum(expr, B=B, C=C, **tensors, **options)

        C.fill_(float("nan"))
        err = relative_error(call(Bv[0]).reshape(size, size), expected)
        ms = median_ms(rotating(call, [(B,) for B in Bv]))
        rows.append(dict(study="order", point=point, label=label, ms=ms, err=err, vs_cublas=t_cublas / ms))
        say(f"  {label:26s} {ms * 1e3:8.1f} us  x{t_cublas / ms:.2f} cuBLAS  err {err:.1e}")


def stage_case(size: int, dtype, rows: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(size)
    A = torch.randn(size, size, device="cuda", dtype=dtype, generator=gen)
    Bs = [torch.randn(size, size, device="cuda", dtype=dtype, generator=gen) for _ in range(2)]
    C = torch.empty(size, size, device="cuda", dtype=dtype)
    index = torch.randperm(size, device="cuda", generator=gen).to(torch.int32)
    expected = A.double() @ Bs[0][index.long()].double()
    t_cublas = median_ms(rotating(lambda B: A @ B, [(B,) for B in Bs]))
    point = f"{dtype} {size}^3"
    say(f"{point}: cuBLAS {t_cublas * 1e3:.1f} us")

    def product(B):
        return insum.insum("C[m, n] = A[m, k] * B[I[k], n]", A=A, B=B, I=index, C=C)

    def torch_gather(B):
        return torch.matmul(A, B.index_select(0, index), out=C)

    for label, stage, fn in (("fused gather", "0", product), ("staged (default)", "1", product),
                             ("torch B[I] + cuBLAS", "1", torch_gather)):
        os.environ["INSUM_STAGE"] = stage
        C.fill_(float("nan"))
        err = relative_error(fn(Bs[0]), expected)
        ms = median_ms(rotating(fn, [(B,) for B in Bs]))
        rows.append(dict(study="stage", point=point, label=label, ms=ms, err=err, vs_cublas=t_cublas / ms))
        say(f"  {label:26s} {ms * 1e3:8.1f} us  x{t_cublas / ms:.2f} cuBLAS  err {err:.1e}")
    os.environ.pop("INSUM_STAGE")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    rows: list = []
    for dtype in (torch.float16, torch.bfloat16):
        for size in (4096, 8192):
            stage_case(size, dtype, rows)
    for size, block, s in [(4096, 32, 0.9), (4096, 64, 0.9), (8192, 64, 0.9), (8192, 32, 0.9), (4096, 32, 0.75),
                           (4096, 64, 0.5), (4096, 128, 0.5), (4096, 128, 0.9)]:
        order_case(size, block, s, torch.float16, rows)
    write_rows(args.out, "order_stage", rows)


if __name__ == "__main__":
    main()
