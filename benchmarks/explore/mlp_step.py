"""Where the pruned MLP's eager training step goes beyond its device time: the
`torch_checks` MLP (3 x 4096, batch 4096, fp16; dense against Block-ELL 90% 32x32), per
step: the host's issue time (steps queued without a sync; wall, and the process's CPU time,
which the host's other processes do not inflate), the wall time, the device time
(the step replayed as a CUDA graph), the host syncs (`set_sync_debug_mode`), and the
profiler's kernels and host ops.

    python -m benchmarks.explore.mlp_step [--width 4096] [--profile] [--compiled]

--compiled measures the same steps through torch.compile(model) (its default mode: the
compiled graphs call insum's operators, with no CUDA graphs).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import triton.testing

from insum.nn import SparseLinear

from ..common import cuda_graph, print_python_profile


def build(width: int, fmt: str | None) -> torch.nn.Sequential:
    torch.manual_seed(0)
    dense = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width),
    ).cuda().half()
    if fmt is None:
        return dense
    kw = dict(sparsity=0.9, block=(32, 32), group_size="row") if fmt == "Block-ELL" else dict(n=2, m=4, vector_len=128)
    name = "BlockGroupCOO" if fmt == "Block-ELL" else fmt
    return torch.nn.Sequential(*[
        SparseLinear.from_linear(m, name, **kw) if isinstance(m, torch.nn.Linear) else m for m in dense
    ])


def measure(name: str, model, x, gy, profile: bool) -> None:
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        model(x).backward(gy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    torch.cuda.synchronize()
    issue, wall, cpu = [], [], []
    for _ in range(5):
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(4):
            step()
        t1, c1 = time.perf_counter(), time.process_time()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) / 4 * 1e3)
        wall.append((t2 - t0) / 4 * 1e3)
        cpu.append((c1 - c0) / 4 * 1e3)
    eager = triton.testing.do_bench(step, return_mode="median")
    graphed = float("nan")
    try:
        graph, _ = cuda_graph(lambda: model(x).backward(gy))
        graphed = triton.testing.do_bench(graph.replay, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print(f"{name}: capture failed: {type(e).__name__}: {str(e)[:200]}")
    print(f"{name:21s} issue {min(issue):.3f} ms (median {sorted(issue)[2]:.3f}, cpu {min(cpu):.3f})  wall {min(wall):.3f}  "
          f"do_bench eager {eager:.3f}  graph replay {graphed:.3f}  syncs {len(syncs)}", flush=True)
    for s in syncs[:5]:
        print("   sync:", s)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof_ctx

        with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))
        print_python_profile(step, 5, orders=("tottime", "cumulative"), limit=40)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--formats", default="dense,Block-ELL")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compiled", action="store_true", help="torch.compile(model) first")
    args = parser.parse_args()
    x = torch.randn(args.width, args.width, device="cuda", dtype=torch.float16)
    gy = torch.randn_like(x)
    for fmt in args.formats.split(","):
        model = build(args.width, None if fmt == "dense" else fmt)
        if args.compiled:
            model = torch.compile(model)
        measure(fmt + (" compiled" if args.compiled else ""), model, x, gy, args.profile)


if __name__ == "__main__":
    main()
