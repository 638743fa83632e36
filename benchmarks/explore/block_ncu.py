"""One BlockGroupCOO Block-ELL product (fp16, 4096^3, random blocks), or with --nm one
vector-wise N:M product, for Nsight Compute.

    python -m benchmarks.explore.block_ncu --block 32 --sparsity 0.9          # tunes, fills the disk cache
    ncu --clock-control none --kernel-name regex:insum --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis python -m benchmarks.explore.block_ncu --block 32 --sparsity 0.9

The first run tunes the kernel (its configuration lands in INSUM_CACHE_DIR); the second, under
ncu, reads it from there, so its first `insum` kernel is the tuned product. It prints the
bytes the product must move through L2 (each stored block's B slab once per block row and
N tile is read from L2 whatever the tiling: every block row reads its own slabs), to set
beside ncu's L2 throughput: the question is whether the product is L2-bandwidth bound.
With `--nm 1:8 --vector-len 256` it packs the same dense matrix as N:M instead and prints the
bytes its kernel reads through L2 (each program's gathered B rows and its values' tile).
"""

from __future__ import annotations

import argparse

import torch

from insum.formats import NM, BlockGroupCOO

from ..common import block_sparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--nm", default=None, help='an N:M pattern ("1:8") instead of blocks')
    parser.add_argument("--vector-len", type=int, default=256)
    args = parser.parse_args()
    size, block = args.size, args.block
    gen = torch.Generator(device="cuda").manual_seed(size + block)
    if args.nm:
        n, m = (int(v) for v in args.nm.split(":"))
        A = torch.randn(size, size, device="cuda", generator=gen).half()
        B = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen)
        fmt = NM.from_dense(A, n=n, m=m, vector_len=args.vector_len)
        C = fmt @ B
        torch.cuda.synchronize()
        dense = fmt.to_dense().double()
        err = float((C.double() - dense @ B.double()).norm() / (dense @ B.double()).norm())
        kept = size * size * n // m * 2  # the values, fp16
        print(f"N:M {args.nm} L={args.vector_len}: values {kept / 1e6:.0f} MB, gathered B rows "
              f"{kept * size // args.vector_len / 1e6:.0f} MB per N-wide sweep of every vector, err {err:.1e}")
        return
    A, keep = block_sparse(size, block, args.sparsity, torch.float16, gen, "cuda")
    B = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen)
    fmt = BlockGroupCOO.from_dense(A, block=block, group_size="row")
    C = fmt @ B
    torch.cuda.synchronize()
    err = float((C.double() - A.double() @ B.double()).norm() / (A.double() @ B.double()).norm())
    blocks = int(keep.sum())
    slab = block * size * 2  # one block's B rows, all N columns, fp16
    print(f"b{block} s={args.sparsity}: {blocks} blocks, B slabs {blocks * slab / 1e6:.0f} MB through L2, "
          f"C {size * size * 2 / 1e6:.0f} MB written, err {err:.1e}")


if __name__ == "__main__":
    main()
