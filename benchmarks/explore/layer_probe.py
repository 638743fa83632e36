"""Where a FullyConnectedTensorProduct forward spends its time beyond its statement (CUDA).

    python -m benchmarks.explore.layer_probe [--L 1] [--C 16] [--batch 10000]

The H200 run of 2026-11-23 (`benchmarks/results/h200/session3/tp.log`) timed the layer's
forward at 0.146 ms (L=1, C=16, batch 10,000, tf32) where its statement alone, on the same
gathered operands, took 0.038 ms. This prints, for the same point: the layer's forward and
the statement by `do_bench` (device-side median, L2 flushed), the host's wall time per call
for each (many calls, one synchronisation), and the kernels one layer call launches with
their device times (torch.profiler), so that host-bound and device-bound parts separate.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from insum import insum
from insum.nn import FullyConnectedTensorProduct

from ..common import median_ms


def _chain(mul: int, lmax: int) -> str:
    return "+".join(f"{mul}x{degree}{'e' if degree % 2 == 0 else 'o'}" for degree in range(lmax + 1))


def _host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--L", type=int, default=1)
    parser.add_argument("--C", type=int, default=16)
    parser.add_argument("--batch", type=int, default=10_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    irreps = _chain(args.C, args.L)
    layer = FullyConnectedTensorProduct(irreps, _chain(1, args.L), irreps).cuda()
    x1 = torch.randn(args.batch, layer.irreps_in1.dim, device="cuda")
    x2 = torch.randn(args.batch, layer.irreps_in2.dim, device="cuda")
    tensors = layer.statement_tensors(x1, x2)
    rows = {
        "layer forward": lambda: layer(x1, x2),
        "statement": lambda: insum(layer.statement, precision=layer.precision, lengths={"q[p]": layer.CGL}, **tensors),
    }
    with torch.no_grad():
        print(f"FCTP {irreps} x {_chain(1, args.L)}, batch {args.batch}, precision {layer.precision}, output {layer.output}")
        for name, fn in rows.items():
            fn()
            print(f"  {name:<14} do_bench {median_ms(fn) * 1e3:8.1f} us   host {_host_us(fn):8.1f} us/call")
        layer(x1, x2)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                layer(x1, x2)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
