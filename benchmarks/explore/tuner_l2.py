"""Does the tuner's warm-L2 timing pick what a cold-L2 benchmark would?

    python -m benchmarks.explore.tuner_l2 [--cases 64:0.9,64:0.75,32:0.6] [--size 4096]

The tuner times each candidate as CUDA-graph replays of one input set (`runtime.graphed_bench`):
B stays in the L2 between launches. The studies time `fmt @ B` with do_bench, which flushes
the L2 before every launch. For Block-ELL products at 4096^3 (B: 32 MB, the H200's L2: 50 MB)
the two can rank the candidates differently. Per case this times every candidate the tuner
considers both ways (do_bench over two rotating B operands for the cold side), checked against a
float64 product, and prints the tuner's own choice, each side's best and what each side's
best costs on the other.
"""

from __future__ import annotations

import argparse

import torch

from insum.codegen.tune import configs_for, prune_configs
from insum.formats import BlockGroupCOO
from insum.runtime import graphed_bench

from ..common import block_sparse
from .tensorcore import bare_launches, check_and_time, format_product


def run_case(size: int, block: int, s: float) -> None:
    gen = torch.Generator(device="cuda").manual_seed(size + block)
    dense, _ = block_sparse(size, block, s, torch.float16, gen, "cuda")
    fmt = BlockGroupCOO.from_dense(dense, block=(block, block), group_size="row")
    Bs = [torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
    expected = dense.double() @ Bs[0].double()
    kernel, bound, prepared, C, operands = format_product(fmt, Bs)
    chosen = dict(prepared.config)
    candidates = [prepared.fitted(c) for c in prune_configs(kernel.plan, configs_for(kernel.plan), dict(bound.extents))]
    rows = []
    for config in candidates:
        try:
            launches = bare_launches(kernel.fn, prepared, bound, config, operands, C)
            err, cold = check_and_time(launches, C, fmt.result, expected)
            warm = graphed_bench(launches[0], [0.5])[0]
        except Exception as e:  # (a configuration that does not fit fails to compile)
            print(f"  {config}: {type(e).__name__}", flush=True)
            continue
        if err <= 1e-2:
            rows.append((config, warm, cold))
    prepared.set_config(chosen)
    by_warm = min(rows, key=lambda r: r[1])
    by_cold = min(rows, key=lambda r: r[2])
    mine = next((r for r in rows if r[0] == chosen), None)

    def show(label, row):
        print(f"  {label:15s} warm {row[1] * 1e3:6.1f} us  cold {row[2] * 1e3:6.1f} us  {row[0]}", flush=True)

    print(f"Block-ELL {block}x{block} s={s} {size}^3: {len(rows)} candidates", flush=True)
    if mine:
        show("tuner's choice", mine)
    show("best warm", by_warm)
    show("best cold", by_cold)
    print(f"  cold cost of the warm pick: {by_warm[2] / by_cold[2] - 1:+.1%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="64:0.9,64:0.75,64:0.5,32:0.6")
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for case in args.cases.split(","):
        block, s = case.split(":")
        run_case(args.size, int(block), float(s))


if __name__ == "__main__":
    main()
