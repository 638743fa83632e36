"""What one SparseLinear step asks of the host, counted rather than timed (counts do not move
with the host's load): the top-level aten ops and the Python calls of a forward and of a
forward+backward, on the CPU with the launches stubbed (run it with TRITON_INTERPRET=1).

    TRITON_INTERPRET=1 python -m benchmarks.explore.layer_ops [--format BlockGroupCOO] [--width 256]

Each op costs a dispatch (4-10 µs apiece on the H200 host, `layer_host`), each Python call
a fraction of a µs; run it on an older tree (`git archive <rev> insum`) for an A/B. Formats
that gather rows of x^T (GroupCOO, NM) copy it through `insum()`'s default backend, which on
the CPU is the torch lowering: their counts include it (on the GPU it is one launch).
Block-ELL's do not (its operand is a view).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from insum.nn import SparseLinear

from ..host_time import stubbed_launches

FORMATS = {
    "BlockGroupCOO": dict(sparsity=0.9, block=(32, 32), group_size="row"),
    "GroupCOO": dict(sparsity=0.9),
    "NM": dict(n=2, m=4, vector_len=32),
}


def counts(fn, calls: int = 10) -> tuple[float, float, dict[str, int]]:
    """(aten ops, Python calls, ops by name) per call of `fn`: ops not called by another op."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    ops: dict[str, int] = {}
    for event in prof.events():
        parent = event.cpu_parent
        if event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            ops[event.name] = ops.get(event.name, 0) + 1
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    python = sum(stat[1] for stat in pstats.Stats(profiler).stats.values())  # (primitive calls)
    return sum(ops.values()) / calls, python / calls, {k: v // calls for k, v in sorted(ops.items())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="BlockGroupCOO", choices=sorted(FORMATS))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    layer = SparseLinear.from_linear(torch.nn.Linear(args.width, args.width), args.format, backend="triton",
                                     **FORMATS[args.format])
    x = torch.randn(args.batch, args.width, requires_grad=True)
    gy = torch.randn(args.batch, args.width)
    params = list(layer.parameters())

    def forward():
        for p in params:
            p.grad = None
        x.grad = None
        return layer(x)

    def step():
        forward().backward(gy)

    for _ in range(3):  # the first calls tune and pin
        step()
    with stubbed_launches():
        for _ in range(5):
            step()
        for name, fn in (("forward", forward), ("forward+backward", step)):
            ops, python, by_name = counts(fn)
            print(f"{args.format} {name}: {ops:.0f} aten ops, {python:.0f} Python calls  {by_name}")


if __name__ == "__main__":
    main()
