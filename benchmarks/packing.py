"""Packing time on a CUDA GPU: every packer from CSR, side by side with `to_sparse_csr()` of the
same matrix from dense (from COO when dense does not fit), do_bench medians, and each
packer's launched ops / host syncs (counted by insum.formats.opcount, once per matrix).

    python -m benchmarks.packing [--data DIR]

Packing on a GPU costs about one launch per op and a full queue drain per host sync, so the
ops/syncs table explains the times table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from insum.formats import (
    CELL,
    COO,
    ELL,
    BlockGroupCOO,
    GroupCOO,
    load_smtx,
    power_law_matrix,
)
from insum.formats.opcount import count_ops

from .common import median_ms, padded_slots

# (label, class, parameters): a packer whose row padding (the format's `row_padding_slots`)
# exceeds MAX_SLOTS is skipped.
PACKERS = [
    ("COO", COO, {}),
    ("GroupCOO", GroupCOO, {}),
    ("ELL", ELL, {}),
    ("BlockGC", BlockGroupCOO, {}),
    ("B-ELL", BlockGroupCOO, {"group_size": "row"}),
    ("CELL", CELL, {}),
]
MAX_SLOTS = 2**28


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path(".data"))
    args = parser.parse_args()
    files = sorted(args.data.glob("dlmc/*/magnitude_pruning/*/*.smtx.gz"))[::25]
    matrices = [
        (f"{p.parts[-4]}/{p.parts[-2]}/{p.name[:-8][:40]}", load_smtx(p).cuda()) for p in files
    ]
    for rows, avg in [(65536, 16), (262144, 32)]:
        matrices.append(
            (
                f"power-law {rows}x{rows} avg {avg}",
                power_law_matrix(rows, rows, avg, seed=0, device="cuda"),
            )
        )
    names = [name for name, *_ in PACKERS]
    print("times in ms (ratio to to_sparse_csr)")
    print(f"{'matrix':58s} {'nnz':>9s} {'to_csr':>7s} " + " ".join(f"{n:>15s}" for n in names))
    counts = []
    for name, csr in matrices:
        dense = csr.to_dense() if csr.shape[0] * csr.shape[1] <= 2**30 else None
        source = dense if dense is not None else csr.to_sparse_coo()
        t_csr = median_ms(lambda c=source: c.to_sparse_csr())
        cells, tallies = [], []
        for _, cls, params in PACKERS:
            if padded_slots(cls, csr, params) > MAX_SLOTS:
                cells.append(f"{'-':>15s}")
                tallies.append("-")
                continue
            t = median_ms(lambda c=csr, f=cls, p=params: f.from_torch(c, **p))
            cells.append(f"{t:7.3f} ({t / t_csr:4.1f}x)")
            with count_ops() as counted:
                cls.from_torch(csr, **params)
            tallies.append(f"{counted.ops}/{counted.syncs}")
        counts.append((name, tallies))
        print(f"{name:58s} {csr._nnz():9d} {t_csr:7.3f} " + " ".join(cells), flush=True)
    print("\nops launched / host syncs per packer (from CSR)")
    print(f"{'matrix':58s} " + " ".join(f"{n:>9s}" for n in names))
    for name, tallies in counts:
        print(f"{name:58s} " + " ".join(f"{t:>9s}" for t in tallies))


if __name__ == "__main__":
    main()
