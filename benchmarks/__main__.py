"""The benchmark suite: `python -m benchmarks [--studies a,b] [--quick] [--smoke] [--data DIR] [--out DIR]`.

Each study (benchmarks/study_<name>.py) exposes `run(ctx)`, which measures its
configurations in priority order, checks every result against a float64 reference and
records rows through `ctx.add` (insum time, anchor time, ratio, error, roofline fraction).
Rows land in `<out>/<study>.json` as they are measured. A study stops, noting what it
skipped, when its time budget is spent, so that one device call stays under its limit.
`python -m benchmarks.report` merges the JSON files into REPORT.md and plots.

    python -m benchmarks --studies unstructured,costs     # one device call
    python -m benchmarks --smoke                          # tiny sizes; CPU: Triton interpreter
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

STUDIES = ("unstructured", "structured", "nm", "gemm", "fusion", "costs")
# Seconds per study on the H200 at --budget-scale 1 (the full sizes need more: the studies
# measure in priority order and note what the budget left out).
BUDGETS = {"unstructured": 180, "structured": 180, "nm": 130, "gemm": 90, "fusion": 90, "costs": 140}
SMOKE_BUDGETS = {"unstructured": 10, "structured": 4, "nm": 4, "gemm": 4, "fusion": 10, "costs": 20}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--studies", default=",".join(STUDIES), help=f"comma-separated, from {', '.join(STUDIES)}")
    parser.add_argument("--quick", action="store_true", help="fewer matrices, sizes and sparsities")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton interpreter); checks the plumbing")
    parser.add_argument("--data", type=Path, default=Path(".data"), help="a copy of ../shared/data")
    parser.add_argument("--out", type=Path, default=None,
                        help="where <study>.json and REPORT.md go (default benchmarks/results/<device>; build/bench-smoke with --smoke)")
    parser.add_argument("--copy-to", type=Path, default=None, help="a second folder for the JSON files ($OUT)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every study's time budget")
    parser.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole run (studies share it)")
    parser.add_argument("--full-autotune", action="store_true", help="do not shorten triton.autotune's measurements")
    parser.add_argument("--no-report", action="store_true", help="do not rewrite REPORT.md in --out at the end")
    args = parser.parse_args(argv)
    if args.out is None:
        from .common import results_dir

        args.out = Path("build/bench-smoke") if args.smoke else results_dir()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [s.strip() for s in args.studies.split(",") if s.strip()]
    if names == ["all"]:
        names = list(STUDIES)
    unknown = [n for n in names if n not in STUDIES]
    if unknown:
        print(f"unknown studies {unknown}; choose from {', '.join(STUDIES)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        if not args.smoke:
            print("no CUDA device: only --smoke runs here (the Triton interpreter on tiny sizes)", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # read when the generated kernels are loaded
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*beta.*")
    warnings.filterwarnings("ignore", message=".*semi-structured.*")
    from .common import ceilings, cpu_ceilings, environment, free_memory, shorten_autotune
    from .context import Context
    from .lowering import allow_many_recompiles

    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    roof = ceilings() if device.type == "cuda" else cpu_ceilings()
    print(
        f"insum benchmarks on {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
        f"measured {roof['bandwidth_GBs']:.0f} GB/s copy, {roof['fp16_tflops']:.0f} fp16 / "
        f"{roof['tf32_tflops']:.0f} tf32 TFLOP/s; studies {', '.join(names)}"
        + (" (smoke)" if args.smoke else " (quick)" if args.quick else ""),
        flush=True,
    )
    allow_many_recompiles()
    undo = shorten_autotune() if device.type == "cuda" and not args.full_autotune else None
    deadline = start + args.deadline
    results = {}
    try:
        for name in names:
            remaining = deadline - time.perf_counter()
            full = SMOKE_BUDGETS[name] if args.smoke else BUDGETS[name] * (0.5 if args.quick else 1.0)
            budget = min(full * args.budget_scale, remaining)
            ctx = Context(
                study=name, device=device, quick=args.quick or args.smoke, smoke=args.smoke,
                data=args.data, out=args.out, roof=roof, env=env, budget_s=budget,
                backend="auto" if device.type == "cuda" else "triton", copy_to=args.copy_to,
                warmup_ms=5 if args.quick or args.smoke else 10, rep_ms=20 if args.quick or args.smoke else 40,
            )
            if remaining < 5:
                ctx.note(f"not run: the run's deadline of {args.deadline:.0f} s was reached")
                ctx.save("skipped")
                results[name] = ctx
                continue
            print(f"\n== {name} (budget {budget:.0f} s) ==", flush=True)
            status = "complete"
            try:
                importlib.import_module(f"benchmarks.study_{name}").run(ctx)
            except Exception as e:  # one study's crash must not lose the others
                traceback.print_exc()
                ctx.note(f"study crashed: {type(e).__name__}: {e}")
                status = "crashed"
            if ctx.skipped:
                status = "partial" if status == "complete" else status
                ctx.note("budget spent; skipped " + ", ".join(f"{n} {w}" for w, n in ctx.skipped.items()))
            ctx.save(status)
            results[name] = ctx
            print(f"== {name}: {len(ctx.rows)} rows in {ctx.elapsed():.0f} s ({status}) ==", flush=True)
            free_memory()
    finally:
        if undo is not None:
            undo()
    from .report import load, summary_lines, write_report

    if not args.no_report:
        print(f"\nwrote {write_report(load(args.out), args.out)} (with every <study>.json in {args.out})")
    print("\n== summary ==")
    for line in summary_lines({n: c.result() for n, c in results.items()}):
        print(line)
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)
    failed = sum(not r["ok"] for c in results.values() for r in c.rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
