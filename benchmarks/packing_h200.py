"""Packing time on a CUDA GPU: GroupCOO, BlockGroupCOO and CELL from CSR, side by side with
`to_sparse_csr()` of the same matrix from dense (from COO when dense does not fit), do_bench
medians.

    python -m benchmarks.packing_h200 [--data DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from insum.formats import CELL, BlockGroupCOO, GroupCOO, load_smtx, power_law_matrix

from .common import median_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path(".data"))
    args = parser.parse_args()
    files = sorted(args.data.glob("dlmc/*/magnitude_pruning/*/*.smtx.gz"))[::25]
    matrices = [(f"{p.parts[-4]}/{p.parts[-2]}/{p.name[:-8][:40]}", load_smtx(p).cuda()) for p in files]
    for rows, avg in [(65536, 16), (262144, 32)]:
        matrices.append((f"power-law {rows}x{rows} avg {avg}", power_law_matrix(rows, rows, avg, seed=0, device="cuda")))
    print(f"{'matrix':52s} {'nnz':>9s} {'to_csr ms':>9s} {'GroupCOO':>9s} {'BlockGC':>9s} {'CELL':>9s}")
    for name, csr in matrices:
        dense = csr.to_dense() if csr.shape[0] * csr.shape[1] <= 2**30 else None
        coo = csr.to_sparse_coo()
        source = dense if dense is not None else coo  # dense where it fits, else a COO tensor
        t_csr = median_ms(lambda c=source: c.to_sparse_csr())
        times = [median_ms(lambda c=csr, f=f: f.from_torch(c)) for f in (GroupCOO, BlockGroupCOO, CELL)]
        print(f"{name:52s} {csr._nnz():9d} {t_csr:9.3f} " + " ".join(f"{t:9.3f}" for t in times)
              + "   ratios " + " ".join(f"{t / t_csr:.1f}x" for t in times), flush=True)


if __name__ == "__main__":
    main()
