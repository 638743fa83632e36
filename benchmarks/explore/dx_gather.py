"""SparseLinear's x gradient on the transposed pattern: the blocks read through TS (as
today) against the blocks gathered and transposed first, so that the product has the
forward's form.

    python -m benchmarks.explore.dx_gather [--width 4096] [--batch 4096]

Today `DX[c, k, n] = WT[TS[c, q], m, k] * DY[TR[c, q], m, n]` (WT: the values with a zero
block appended) reads each block through an index and transposed (K = m is its slow
dimension): pointer loads, where the forward `C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]`
loads contiguous boxes. The alternative gathers the blocks in the transposed pattern's
order, transposed, with one index_select over a transposed view (WG[c, q, k, m], padding
gathering the zero block), then runs `DX[c, k, n] = WG[c, q, k, m] * DY[TR[c, q], m, n]`,
the forward's form (`transposed.BLOCK_GATHERED`, what `input_gradient` runs since session 12). Both are timed as
a user's backward calls them (do_bench medians, L2 flushed), checked against each other and
a float64 product, beside the forward.
"""

from __future__ import annotations

import argparse

import torch

from insum import insum
from insum.formats import transposed
from insum.nn import SparseLinear

from ..common import median_ms, relative_error


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    linear = torch.nn.Linear(args.width, args.width).cuda().half()
    layer = SparseLinear.from_linear(linear, "BlockGroupCOO", sparsity=0.9, block=(32, 32), group_size="row")
    fmt = layer.weight
    pattern = {n: getattr(layer, "grad_" + n) for n in layer._pattern_names}
    dy = torch.randn(args.batch, args.width, device="cuda", dtype=torch.float16)
    x = torch.randn(args.batch, args.width, device="cuda", dtype=torch.float16)
    dC = fmt.output_view(dy.t())
    WT = transposed.with_zero_slot(fmt.AV.reshape(-1, *fmt.block))
    C, g = pattern["TS"].shape
    bm, bk = fmt.block

    def today():  # BLOCK_ROW, as before session 12
        return insum(transposed.BLOCK_ROW, WT=WT, DY=dC, TS=pattern["TS"], TR=pattern["TR"],
                     lengths={"q[c]": pattern["TL"]})

    def gathered():  # what input_gradient runs now
        return fmt.input_gradient(pattern, dC, "auto", "tf32")

    def gather_only():
        return WT.transpose(1, 2).index_select(0, pattern["TS"].reshape(-1)).view(C, g, bk, bm)

    expected = (dy.double() @ layer.to_dense().double())
    for name, fn in (("today", today), ("gathered", gathered)):
        err = relative_error(fmt.from_operand(fn()).t(), expected)
        print(f"{name:10s} err {err:.1e}", flush=True)
    rows = {"forward (fmt.spmm)": lambda: fmt.spmm(x.t()), "x grad today": today, "x grad gathered": gathered,
            "  of which the gather": gather_only}
    for fn in rows.values():  # compile and tune outside do_bench's estimate of the call's time
        fn()
        fn()
    torch.cuda.synchronize()
    for _ in range(2):
        for name, fn in rows.items():
            print(f"{name:24s} {median_ms(fn) * 1e3:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
