"""N:M's product on a column-major B (a layer's x^T) against the same B made contiguous first.

    python -m benchmarks.explore.nm_layout [--width 4096] [--batch 4096]

`C[rb, l, n] += AV[rb, l, u] * B[AK[rb, u], n]` gathers rows of B. A SparseLinear multiplies
x^T, whose rows are x's columns (stride = the width): each gathered row's elements then lie
a width apart, and the MLP table's N:M forward measured ~3x its kernel on a contiguous B.
This times `fmt.spmm` on x^T as the layer passes it, on x^T copied contiguous (the copy
included and alone; and the transposing copy as insum's generated kernel), and Block-ELL beside it, with the device clock of
`insum.formats.tuning.device_seconds` (events behind a device-side sleep: no host time).
"""

from __future__ import annotations

import argparse

import torch

from insum import insum
from insum.formats import NM, BlockGroupCOO
from insum.formats.tuning import device_seconds

from ..common import relative_error

TRANSPOSE = "T[k, n] = X[n, k]"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    W = torch.randn(args.width, args.width, device="cuda", dtype=torch.float16)
    x = torch.randn(args.batch, args.width, device="cuda", dtype=torch.float16)
    device = x.device
    for name, fmt in (("NM 2:4 L=128", NM.from_dense(W, n=2, m=4, vector_len=128)),
                      ("Block-ELL 90% 32x32", BlockGroupCOO.from_dense(
                          W * (torch.rand(args.width // 32, args.width // 32, device="cuda") < 0.1)
                          .repeat_interleave(32, 0).repeat_interleave(32, 1), block=32, group_size="row"))):
        expected = fmt.to_dense().double() @ x.t().double()
        rows = {
            "x^T as the layer passes it": lambda fmt=fmt: fmt.spmm(x.t()),
            "x^T made contiguous, then": lambda fmt=fmt: fmt.spmm(x.t().contiguous()),
            "  the copy alone": lambda: x.t().contiguous(),
            "  insum's transpose copy": lambda: insum(TRANSPOSE, X=x),
        }
        for label, fn in rows.items():
            if label.startswith("  insum"):
                assert torch.equal(fn(), x.t())
            elif not label.startswith("  "):
                print(f"{name:20s} {label:28s} err {relative_error(fn(), expected):.1e}", flush=True)
        for label, fn in rows.items():
            print(f"{name:20s} {label:28s} {device_seconds(fn, device) * 1e6:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
