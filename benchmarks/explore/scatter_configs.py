"""Every tile candidate of an unstructured format's product, at output widths 16 elements
apart or not, in fp16 or fp32.

    python -m benchmarks.explore.scatter_configs [--out DIR] [--widths 1000,1008,1024]
        [--format GroupCOO:32] [--dtype float16] [--size 8192]

GroupCOO g = 32 on a uniform 8192^2 matrix (100 entries a row, fp16) ran 1.35 ms into 1008 or
1024 columns and 0.23 ms into 1000 (`explore/shapes --only scatter`, session 17, H200): the
same generated code (explore/ptx), so the difference lies in the tuner's choice or in the
memory system. This runs the product `fmt @ B` runs (its statement, facts and output dtype),
prints the tuner's choice and its time, then times every candidate of the tuning table with
one bare launch per call, each checked against a float64 product. `--format ELL` (or
`GroupCOO:8`) with `--widths 128` and each dtype asks why forced fp16 ELL and GroupCOO g = 8
ran ~4x slower than fp32 on that matrix (session 16).
"""

from __future__ import annotations

import argparse

import torch

from insum.bind import bind
from insum.codegen.tune import configs_for, prune_configs
from insum.formats import ELL, GroupCOO
from insum.formats.base import _SpmmPlan
from insum.parser import parse
from insum.runtime import kernel_for

from ..common import median_ms, relative_error
from .tensorcore import say, write_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--widths", default="1000,1008,1024")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--format", default="GroupCOO:32", help="ELL, or GroupCOO:g")
    parser.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    size, dtype = args.size, getattr(torch, args.dtype)
    U = (torch.rand(size, size, device="cuda", generator=gen) < 100 / size).to(dtype)
    name, _, group = args.format.partition(":")
    fmt = ELL.from_dense(U) if name == "ELL" else GroupCOO.from_dense(U, group_size=int(group))
    rows = []
    for N in (int(n) for n in args.widths.split(",")):
        B = torch.randn(size, N, device="cuda", generator=gen).to(dtype)
        expected = U.double() @ B.double()
        spmm_ms = median_ms(lambda B=B: fmt @ B)
        plan = _SpmmPlan(fmt, B, False, "auto", "tf32")
        C, calls = plan._calls(fmt, B, None)
        (statement, tensors, facts), = calls
        bound = bind(parse(statement), tensors)
        kernel = kernel_for(bound, **facts)
        launcher = kernel.prepared(bound)
        kernel.launch(bound, C)
        tuned = dict(launcher.config)
        say(f"{args.format} {args.dtype} N={N} {statement} C {C.dtype} ({kernel.plan.output}): fmt @ B {spmm_ms * 1e3:.1f} us, tuned {tuned}")
        for config in prune_configs(kernel.plan, configs_for(kernel.plan), launcher.extents):
            launcher.set_config(config)
            launch = launcher.direct
            arguments = launcher.args(bound.tensors, C)
            C.zero_()
            launch(kernel.fn, arguments)
            err = relative_error(fmt.result(C), expected)
            ms = median_ms(lambda launch=launch, fn=kernel.fn, arguments=arguments: launch(fn, arguments))
            mark = " <- tuned" if config == tuned else ""
            say(f"  {ms * 1e3:8.1f} us  err {err:.1e}  {config}{mark}")
            rows.append(dict(format=args.format, dtype=args.dtype, N=N, config=config, ms=ms, err=err, tuned=config == tuned, spmm_ms=spmm_ms))
        launcher.set_config(tuned)
    if args.out:
        write_rows(args.out, "scatter_configs", rows)


if __name__ == "__main__":
    main()
