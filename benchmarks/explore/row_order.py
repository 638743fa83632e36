"""Does the order of Block-ELL's block rows matter? The same block-sparse matrix with its
block rows as drawn, sorted longest first and shortest first.

    python -m benchmarks.explore.row_order

Each block row's programs run its own block count (declared lengths), so rows of 2 and 13
blocks make programs of very different lengths. The generated kernel already takes its
block rows longest first (`ORDER_LEN_q`: the plan's "p longest first"), so the input order
should not matter; this checks it (session 14, call 4: within 1-3% at every point, the
noise). Same work in all three orders (the rows are permuted, so is C): the graphed device
time (a CUDA graph of 20 calls) and the do_bench median, beside cuBLAS, each checked against
a float64 product; last, each launch's extents, grid and tile configuration.
"""

from __future__ import annotations

import torch

from insum.formats import BlockGroupCOO

from ..common import block_sparse, graphed_ms, median_ms, relative_error, rotating

POINTS = [(4096, 64, 0.9), (4096, 32, 0.9), (4096, 128, 0.9), (4096, 64, 0.75), (8192, 64, 0.9)]


def permuted(A: torch.Tensor, keep: torch.Tensor, block: int, descending: bool) -> torch.Tensor:
    """A with its block rows ordered by their kept-block count."""
    order = torch.sort(keep.sum(1), descending=descending, stable=True).indices
    rows = (order[:, None] * block + torch.arange(block, device=A.device)).reshape(-1)
    return A[rows]


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(11)
    print(f"{'point':24s} {'order':10s} {'graphed us':>10s} {'do_bench us':>11s} {'cuBLAS us':>9s} {'ratio':>6s}")
    for size, block, s in POINTS:
        A, keep = block_sparse(size, block, s, torch.float16, gen, "cuda")
        Bs = [torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
        dense = median_ms(rotating(lambda B, A=A: A @ B, [(B,) for B in Bs])) * 1e3
        lengths = keep.sum(1)
        name = f"{size}^3 b{block} s={s}"
        print(f"{name:24s} rows: {lengths.numel()}, blocks per row {float(lengths.float().mean()):.1f} mean, "
              f"{int(lengths.min())}..{int(lengths.max())}", flush=True)
        for order, matrix in (("as drawn", A), ("longest", permuted(A, keep, block, True)),
                              ("shortest", permuted(A, keep, block, False))):
            fmt = BlockGroupCOO.from_dense(matrix, block=(block, block), group_size="row")
            err = relative_error(fmt @ Bs[0], matrix.double() @ Bs[0].double())
            t = median_ms(rotating(lambda B, f=fmt: f @ B, [(B,) for B in Bs])) * 1e3
            graphed = graphed_ms(lambda f=fmt, B=Bs[0]: f @ B) * 1e3
            print(f"{name:24s} {order:10s} {graphed:10.1f} {t:11.1f} {dense:9.1f} {dense / t:5.2f}x  err {err:.1e}",
                  flush=True)
    from insum import runtime

    for kernel in runtime._KERNELS.values():
        for launch in kernel._launchers.values():
            if getattr(launch, "config", None):
                print(f"{kernel.spec.stmt}  extents {launch.extents}  grid {launch.grid}  config {launch.config}")


if __name__ == "__main__":
    main()
