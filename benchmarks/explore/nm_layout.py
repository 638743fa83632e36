"""Formats that gather rows of B, on a column-major B (a layer's x^T): as given, and through
`SparseFormat.operand`'s transposing copy.

    python -m benchmarks.explore.nm_layout [--width 4096] [--batch 4096]

`C[rb, l, n] += AV[rb, l, u] * B[AK[rb, u], n]` (N:M; GroupCOO and ELL alike) gathers rows
of B. A SparseLinear multiplies x^T, whose rows are x's columns (a width apart): the MLP
table's N:M forward measured ~3x its kernel on a contiguous B. Per format (N:M 2:4, GroupCOO
and ELL at 90% unstructured, Block-ELL 90% 32 x 32 beside them, whose own view gathers
whole blocks): `fmt.spmm` on x^T without the copy (the base operand patched to return B as
given, as before session 12), with it, and on a contiguous x^T made beforehand (not timed); the copy alone, as torch's
`.contiguous()` and as insum's generated kernel (`insum.formats.base.TRANSPOSE`). Times are
the device clock of `insum.formats.tuning.device_seconds` (events behind a device-side
sleep: no host time).
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from insum import insum
from insum.formats import ELL, NM, BlockGroupCOO, GroupCOO
from insum.formats.base import SparseFormat
from insum.formats.tuning import device_seconds

from ..common import relative_error

TRANSPOSE = "T[k, n] = X[n, k]"  # as insum.formats.base.TRANSPOSE


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    W = torch.randn(args.width, args.width, device="cuda", dtype=torch.float16)
    x = torch.randn(args.batch, args.width, device="cuda", dtype=torch.float16)
    device = x.device
    xt = x.t().contiguous()
    unstructured = W * (torch.rand(args.width, args.width, device="cuda") < 0.1)
    blocks = (torch.rand(args.width // 32, args.width // 32, device="cuda") < 0.1)
    packers = {
        "NM 2:4 L=128": lambda: NM.from_dense(W, n=2, m=4, vector_len=128),
        "GroupCOO 90%": lambda: GroupCOO.from_dense(unstructured),
        "ELL 90%": lambda: ELL.from_dense(unstructured),
        "Block-ELL 90% 32x32": lambda: BlockGroupCOO.from_dense(
            W * blocks.repeat_interleave(32, 0).repeat_interleave(32, 1), block=32, group_size="row"),
    }
    for name, pack in packers.items():
        # A format object per variant: each keeps its own prepared products (`spmm`'s plans).
        plain, copying, contiguous = pack(), pack(), pack()
        expected = plain.to_dense().double() @ x.t().double()
        rows = {
            "fmt.spmm(x^T), no copy": lambda fmt=plain: _without_copy(fmt, x.t()),
            "fmt.spmm(x^T), operand's copy": lambda fmt=copying: fmt.spmm(x.t()),
            "fmt.spmm(contiguous x^T)": lambda fmt=contiguous: fmt.spmm(xt),
            "  torch's .contiguous()": lambda: x.t().contiguous(),
            "  insum's transpose copy": lambda: insum(TRANSPOSE, X=x),
        }
        for label, fn in rows.items():
            if label.startswith("  insum"):
                assert torch.equal(fn(), x.t())
            elif not label.startswith("  "):
                print(f"{name:20s} {label:32s} err {relative_error(fn(), expected):.1e}", flush=True)
        for label, fn in rows.items():
            print(f"{name:20s} {label:32s} {device_seconds(fn, device) * 1e6:8.1f} us", flush=True)


def _without_copy(fmt, B: torch.Tensor) -> torch.Tensor:
    """`fmt.spmm(B)` with the base `SparseFormat.operand` taking B as given (no copy), as
    before session 12; Block-ELL keeps its own operand view."""
    with mock.patch.object(SparseFormat, "operand", lambda self, B: B):
        return fmt.spmm(B)


if __name__ == "__main__":
    main()
