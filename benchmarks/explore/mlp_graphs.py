"""Why the pruned MLP compiled with CUDA graphs (mode="reduce-overhead") runs slower than
the same eager step captured with `make_graphed_callables`: the inductor counters (CUDA
graph skips and their reasons, printed as perf hints), and a profile of one compiled step's
host ops (a graph replay is one `cudaGraphLaunch`; kernels launched outside one show as
`cuLaunchKernel` / `cudaLaunchKernel`).

    python -m benchmarks.explore.mlp_graphs [--width 4096] [--fmt Block-ELL]
"""

from __future__ import annotations

import argparse
import copy

import torch

from ..common import median_ms
from .mlp_step import build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--fmt", default="Block-ELL")
    args = parser.parse_args()
    torch._logging.set_logs(perf_hints=True)
    x = torch.randn(args.width, args.width, device="cuda", dtype=torch.half)
    gy = torch.randn_like(x)
    for fmt in (None, args.fmt):
        model = build(args.width, fmt)
        params = list(model.parameters())
        name = fmt or "dense"
        graphed = torch.cuda.make_graphed_callables(copy.deepcopy(model), (x.clone(),))
        reduced = torch.compile(model, mode="reduce-overhead", fullgraph=True)

        def reduced_step(reduced=reduced):
            torch.compiler.cudagraph_mark_step_begin()
            reduced(x).backward(gy)

        def graphed_step(graphed=graphed):
            graphed(x).backward(gy)

        from torch._dynamo.utils import counters

        counters.clear()
        for _ in range(4):
            reduced_step()
        torch.cuda.synchronize()
        print(f"{name}: inductor counters {dict(counters['inductor'])}", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                reduced_step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22)
        print(f"{name}: profile of 3 reduce-overhead steps\n{table}", flush=True)
        for p in params:
            p.grad = None
        graphed_step()
        t_reduced = median_ms(reduced_step)
        t_graphed = median_ms(graphed_step)
        print(f"{name}: reduce-overhead step {t_reduced:.3f} ms, make_graphed_callables step {t_graphed:.3f} ms",
              flush=True)


if __name__ == "__main__":
    main()
