"""Where a pruned MLP's time goes: torch.profiler tables of one forward and one
forward+backward of the `torch_checks` MLP (3 x 4096, batch 4096, fp16, 90% 32x32 blocks).

    python -m benchmarks.explore.profile_mlp [--width 4096] [--format BlockGroupCOO] [--group-size row] [--compiled]

--compiled profiles the model under torch.compile(fullgraph=True) instead (the host time of
its custom operators and of the compiled graph's own kernels).

Before profiling, one step runs under `torch.cuda.set_sync_debug_mode("warn")`, which names
every host sync of the step (a sync stalls the host's queue: the eager step then pays its
host time on top of the kernels').
"""

from __future__ import annotations

import argparse

import torch

from insum.nn import SparseLinear

#: The layers profiled, by format: 90% 32x32 blocks, or 2:4 with 128-row vectors.
PARAMS = {"BlockGroupCOO": dict(sparsity=0.9, block=(32, 32)), "NM": dict(n=2, m=4, vector_len=128)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--format", default="BlockGroupCOO", choices=sorted(PARAMS))
    parser.add_argument("--group-size", default=None, help='BlockGroupCOO only: "row" for Block-ELL')
    parser.add_argument("--compiled", action="store_true", help="profile torch.compile(model, fullgraph=True)")
    args = parser.parse_args()
    torch.manual_seed(0)
    width = args.width
    dense = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width),
    ).cuda().half()
    params = dict(PARAMS[args.format])
    if args.group_size is not None:
        params["group_size"] = int(args.group_size) if args.group_size.isdigit() else args.group_size
    model = torch.nn.Sequential(*[
        SparseLinear.from_linear(m, args.format, **params) if isinstance(m, torch.nn.Linear) else m for m in dense
    ])
    if args.compiled:
        model = torch.compile(model, fullgraph=True)
    x = torch.randn(width, width, device="cuda", dtype=torch.float16)
    gy = torch.randn_like(x)

    def forward():
        with torch.no_grad():
            model(x)

    def step():
        model(x).backward(gy)

    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    step()
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    for name, fn in (("forward (no grad)", forward), ("forward + backward", step)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"\n== {args.format}: {name}, 5 iterations ==")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
