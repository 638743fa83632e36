"""One BlockGroupCOO Block-ELL product (fp16, 4096^3, random blocks), for Nsight Compute.

    python -m benchmarks.explore.block_ncu --block 32 --sparsity 0.9          # tunes, fills the disk cache
    ncu --clock-control none --kernel-name regex:insum --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis python -m benchmarks.explore.block_ncu --block 32 --sparsity 0.9

The first run tunes the kernel (its configuration lands in INSUM_CACHE_DIR); the second, under
ncu, reads it from there, so its first `insum` kernel is the tuned product. It prints the
bytes the product must move through L2 (each stored block's B slab once per block row and
N tile is read from L2 whatever the tiling: every block row reads its own slabs), to set
beside ncu's L2 throughput: the question is whether the product is L2-bandwidth bound.
"""

from __future__ import annotations

import argparse

import torch

from insum.formats import BlockGroupCOO

from ..common import block_sparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args()
    size, block = args.size, args.block
    gen = torch.Generator(device="cuda").manual_seed(size + block)
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
