"""Merge the studies' JSON files into REPORT.md and PNG plots, per device folder.

    python -m benchmarks.report                      # every benchmarks/results/<device>/
    python -m benchmarks.report [--results DIR] [--out DIR] [--no-plots]

Every figure in the report is a ratio of an anchor's median time to insum's, both measured
in the same run (`ratio > 1`: insum is faster). Geomeans are taken over the configurations
whose result passed its check; the targets of issue 6 are evaluated here, not in tests.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from .common import RESULTS, geomean, good
from .plots import make_plots
from .sections import crossovers, section
from .tables import (
    error_text,
    field,
    fmt_pct,
    markdown_table,
    median,
    table,
)

STUDY_ORDER = ("unstructured", "structured", "nm", "gemm", "fusion", "costs")
TITLES = {
    "unstructured": "Unstructured SpMM",
    "structured": "Structured SpMM (BlockGroupCOO)",
    "nm": "N:M SpMM",
    "gemm": "Dense and gathered GEMM",
    "fusion": "Fusion ablation",
    "costs": "Costs",
}


def load(folder: Path) -> dict[str, dict]:
    """Every <study>.json in the folder, by study name."""
    results = {}
    for name in STUDY_ORDER:
        path = folder / f"{name}.json"
        if path.exists():
            try:
                results[name] = json.loads(path.read_text())
            except ValueError as e:
                print(f"skipping {path}: {e}")
    return results


# --------------------------------------------------------------------------- targets


def _target(name, goal, rows, value_of, threshold, fmt="x{:.2f}", detail=""):
    values = [value_of(r) for r in good(rows)]
    failed = sum(not r.get("ok") for r in rows)
    if not values:
        return dict(target=name, goal=goal, measured="no data", status="not measured", n=0, detail=detail)
    g = geomean(values)
    worst = min(values)
    status = "met" if g >= threshold else "missed"
    extra = f"{len(values)} configs, worst " + fmt.format(worst) + (f", {failed} failed checks excluded" if failed else "")
    return dict(target=name, goal=goal, measured=fmt.format(g), status=status, n=len(values),
                detail=(detail + "; " if detail else "") + extra, value=g)


def _ratio(r):
    return r["ratio"]


def _of_ideal(r):
    return r["ratio"] / r["ideal"]


#: Issue 6's targets: (name, goal, study, which rows, the value per row, threshold, format).
TARGETS = [
    ("Unstructured SpMM fp32 N=128 vs cuSPARSE (GroupCOO)", "geomean >= 1.5x", "unstructured",
     lambda r: r["set"] == "GroupCOO fp32 N=128 vs cuSPARSE", _ratio, 1.5, "x{:.2f}"),
    ("BlockGroupCOO vs dense at s >= 0.5, fraction of ideal 1/(1-s)", "geomean >= 70%", "structured",
     lambda r: r["anchor"] == "cuBLAS" and r["sparsity"] >= 0.5, _of_ideal, 0.7, "{:.0%}"),
    ("BlockGroupCOO faster than dense from s = 0.25", "geomean >= 1x", "structured",
     lambda r: r["anchor"] == "cuBLAS" and r["sparsity"] >= 0.25, _ratio, 1.0, "x{:.2f}"),
    ("BlockGroupCOO faster than TorchBSR everywhere", "geomean >= 1x (worst shown)", "structured",
     lambda r: r["anchor"] == "TorchBSR", _ratio, 1.0, "x{:.2f}"),
    *[(f"N:M vs dense at {s:.1%} sparsity, fraction of ideal M/N", "geomean >= 80%", "nm",
       lambda r, s=s: r["anchor"] == "cuBLAS" and abs(r["sparsity"] - s) < 1e-6, _of_ideal, 0.8, "{:.0%}")
      for s in (0.75, 0.875)],
    ("N:M 2:4 vs cuSPARSELt", "geomean >= 1x", "nm", lambda r: r["anchor"] == "cuSPARSELt", _ratio, 1.0, "x{:.2f}"),
    ("Fusion: generated kernel vs torch.compile of the lowering", "geomean >= 2x", "fusion",
     lambda r: r["anchor"] == "torch.compile", _ratio, 2.0, "x{:.2f}"),
]


def _block_point(r: dict, size: int, block: int, s: float) -> bool:
    return r.get("size") == size and r.get("block") == block and abs(r.get("sparsity", -1) - s) < 1e-6


#: Issue 11's targets, per point (the worst point decides): (name, goal text, study, which
#: rows, the value per row, the threshold, format). fp16 and bf16 rows both count.
ISSUE11 = [
    ("generated dense GEMM vs cuBLAS (4096^3, 8192^3)", ">= 0.9x", "gemm",
     lambda r: r["anchor"] == "cuBLAS" and r.get("kind") == "dense", _ratio, 0.9, "x{:.2f}"),
    ("gathered GEMM (B[I[k], n]) vs cuBLAS (4096^3, 8192^3)", ">= 0.8x", "gemm",
     lambda r: r["anchor"] == "cuBLAS" and r.get("kind") == "gathered", _ratio, 0.8, "x{:.2f}"),
    *[(f"BlockGroupCOO {b}x{b} s = 0.9 vs cuBLAS ({size}^3)", f">= {goal}x", "structured",
       lambda r, size=size, b=b: r["anchor"] == "cuBLAS" and _block_point(r, size, b, 0.9), _ratio, goal, "x{:.2f}")
      for b, goal in ((32, 2.5), (64, 4.0)) for size in (4096, 8192)],
    ("BlockGroupCOO 128x128 s >= 0.5, fraction of ideal 1/(1-s)", ">= 90%", "structured",
     lambda r: r["anchor"] == "cuBLAS" and r.get("block") == 128 and r.get("sparsity", 0) >= 0.5, _of_ideal, 0.9, "{:.0%}"),
    ("BlockGroupCOO vs TorchBSR (blocks 32, 64, 128, every point)", ">= 1.5x", "structured",
     lambda r: r["anchor"] == "TorchBSR" and r.get("block") in (32, 64, 128), _ratio, 1.5, "x{:.2f}"),
    *[(f"N:M {p} ({s:.1%}) vs cuBLAS, fraction of ideal M/N (4096^3, 8192^3)", ">= 60%", "nm",
       lambda r, p=p: r["anchor"] == "cuBLAS" and r.get("pattern") == p and r.get("size") in (4096, 8192) and r.get("dtype") != "fp32",
       _of_ideal, 0.6, "{:.0%}") for p, s in (("2:8", 0.75), ("1:8", 0.875))],
    ("N:M 2:4 vs cuBLAS (8192^3)", ">= 1.3x", "nm",
     lambda r: r["anchor"] == "cuBLAS" and r.get("pattern") == "2:4" and r.get("size") == 8192 and r.get("dtype") != "fp32",
     _ratio, 1.3, "x{:.2f}"),
]


#: Issue 11's crossover targets: per block size, the sparsity from which BlockGroupCOO must
#: beat cuBLAS on every measured curve (fp16 and bf16, 4096^3 and 8192^3; `crossovers`).
CROSSOVER_GOALS = ((32, 0.6), (64, 0.5))


def crossover_targets(results: dict) -> list[dict]:
    """Met when every curve of the block size crosses at or below the goal; the table shows
    the latest crossover (a curve that never crosses is missed)."""
    curves = crossovers(results.get("structured", {}).get("rows", []))
    out = []
    for block, goal in CROSSOVER_GOALS:
        name = f"BlockGroupCOO {block}x{block} crossover with cuBLAS (fp16, bf16; 4096^3, 8192^3)"
        mine = [c for c in curves if c["block"] == block and c["size"] in (4096, 8192)]
        if not mine:
            out.append(dict(target=name, goal=f"s <= {goal}", measured="no data", status="not measured", detail=""))
            continue
        latest = [c["crossover"] for c in mine]
        reached = [v for v in latest if v is not None]
        worst = "not reached" if len(reached) < len(latest) else f"s = {max(reached):.2f}"
        met = len(reached) == len(latest) and max(reached) <= goal
        detail = "; ".join(f"{c['dtype']} {c['size']}^3 {c['text'].split(' (')[0]}" for c in mine)
        out.append(dict(target=name, goal=f"s <= {goal}", measured=worst, status="met" if met else "missed", detail=detail))
    return out


def issue11_targets(results: dict) -> list[dict]:
    """Issue 11's targets on the rows present: met when every selected point reaches the goal
    (the worst point is what the table shows, the geomean beside it)."""
    out = []
    for name, goal, study, keep, value_of, threshold, fmt in ISSUE11:
        rows = [r for r in good([r for r in results.get(study, {}).get("rows", []) if keep(r)])]
        if not rows:
            out.append(dict(target=name, goal=goal, measured="no data", status="not measured", detail=""))
            continue
        values = [value_of(r) for r in rows]
        worst = min(values)
        out.append(dict(target=name, goal=goal, measured=fmt.format(worst),
                        status="met" if worst >= threshold else "missed",
                        detail=f"{len(values)} points, geomean " + fmt.format(geomean(values))))
    return out


#: The MLP step's target (issue 11): the pruned model against dense, per way of running it;
#: (column of torch_mlp.json's rows, what it is, whether it is one of the issue's targets).
MLP_MODEL = "Block-ELL 90% 32x32 (row groups)"
MLP_RUNS = [
    ("eager_step", "eager", True),
    ("compiled_step", "compiled (torch.compile, default mode)", True),
    ("graphed_step", "replayed as CUDA graphs (make_graphed_callables)", False),
    ("compiled_graphs_step", "compiled with CUDA graphs (mode=\"reduce-overhead\")", False),
]


def mlp_targets(mlp: dict | None) -> list[dict]:
    """The SparseLinear MLP step against dense (torch_checks' MLP table, torch_mlp.json): the
    issue's targets (eager, compiled) and, beside them, the step without host time."""
    rows = {r.get("model"): r for r in (mlp or {}).get("bench", [])}
    dense, model = rows.get("dense (cuBLAS)"), rows.get(MLP_MODEL)
    out = []
    for key, how, target in MLP_RUNS:
        name = f"SparseLinear MLP step ({MLP_MODEL}) vs dense, {how}"
        goal = ">= 2.0x" if target else "(not a target)"
        if not dense or not model or key not in dense or key not in model:
            out.append(dict(target=name, goal=goal, measured="no data", status="not measured", detail=""))
            continue
        ratio = dense[key] / model[key]
        status = ("met" if ratio >= 2.0 else "missed") if target else "shown"
        out.append(dict(target=name, goal=goal, measured=f"x{ratio:.2f}", status=status,
                        detail=f"{model[key]:.3f} ms against {dense[key]:.3f} ms"))
    return out


def targets(results: dict) -> list[dict]:
    """Issue 6's targets, evaluated on the rows present."""
    out = []
    for name, goal, study, keep, value_of, threshold, fmt in TARGETS:
        rows = [r for r in results.get(study, {}).get("rows", []) if keep(r)]
        out.append(_target(name, goal, rows, value_of, threshold, fmt=fmt))
    return out


def summary_lines(results: dict) -> list[str]:
    """The short table printed last by the runner and by this module."""
    lines = [f"{'study':13s} {'rows':>5s} {'failed':>6s} {'status':9s} {'elapsed':>8s}  roofline fraction (median / max)"]
    for name in STUDY_ORDER:
        if name not in results:
            continue
        res = results[name]
        rows = res.get("rows", [])
        fracs = [r["roof_frac"] for r in rows if r.get("roof_frac") is not None]
        roof = f"{median(fracs):.0%} / {max(fracs):.0%}" if fracs else "n/a"
        failed = sum(not r.get("ok") for r in rows)
        lines.append(f"{name:13s} {len(rows):5d} {failed:6d} {res.get('status', '?'):9s} {res.get('elapsed_s', 0):7.0f}s  {roof}"
                     + ("   <<< FAILED CHECKS" if failed else ""))
    lines.append("")
    for t in targets(results):
        if t["status"] != "not measured":
            lines.append(f"{t['status']:>6s}  {t['target']}: {t['measured']} (goal {t['goal']})")
    for c in crossovers(results.get("structured", {}).get("rows", [])):
        lines.append(f"crossover {c['dtype']} {c['size']}^3 block {c['block']}: {c['text']}")
    return lines


# --------------------------------------------------------------------------- markdown


def write_report(results: dict, out: Path, plots: bool = True, mlp: dict | None = None) -> Path:
    """Write REPORT.md (and figures/ when matplotlib is there); returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    figures = make_plots(results, out / "figures") if plots else {}
    if plots and figures is None:
        figures, plot_note = {}, "matplotlib is not installed here: no plots (tables only)."
    else:
        plot_note = "" if plots else "Plots skipped (--no-plots)."
    lines = ["# insum benchmark report", ""]
    lines += [
        "Generated by `python -m benchmarks.report` from the JSON files that `python -m benchmarks` "
        "(or `bash benchmarks/gpu_suite.sh`) writes. Every number is a ratio **anchor median time / "
        "insum median time**, both measured in the same run (> 1: insum is faster). Times are "
        "`triton.testing.do_bench` medians (warm-up excluded; do_bench flushes the L2 before every "
        "repetition; the host time per call is measured apart, under Costs) with the dense operand "
        "rotated among several copies. A product of a few tens of µs can be timed with host gaps in it "
        "(its launch falling behind the flush on a loaded host), so the structured and N:M studies time "
        "every product, insum's and the anchors', in two rounds and keep the lower median of each. Each "
        "measured configuration "
        "is checked against a float64 product (relative error ≤ 1e-3 for fp32, ≤ 1e-2 for fp16/bf16); "
        "geomeans use only configurations that passed. Roofline fraction: max(bytes / measured copy "
        "bandwidth, flops / measured tensor-core rate) divided by insum's time, with the fewest bytes a "
        "kernel must move (each input once, the output once).",
        "",
    ]
    if plot_note:
        lines += [f"_{plot_note}_", ""]
    lines += ["## Runs", ""]
    lines += table(
        [{"study": name, **r} for name, r in results.items()],
        [("study", field("study")), *[(k, lambda r, k=k: r["env"][k]) for k in ("date", "device", "torch", "triton")],
         ("mode", field("mode")), ("configs", lambda r: len(r.get("rows", []))),
         ("failed checks", lambda r: sum(not x.get("ok") for x in r.get("rows", []))),
         ("timing", lambda r: "two rounds" if any("rounds_ms" in x for x in r.get("rows", [])) else "one round"),
         ("time / budget", lambda r: f"{r.get('elapsed_s', 0):.0f} s / {r.get('budget_s', 0):.0f} s"), ("status", field("status"))],
    )
    lines += ["", "Measured ceilings (each run measures its own, before its studies):", ""]
    seen = {}
    for name, r in results.items():
        c = r.get("ceilings", {})
        key = (r["env"]["date"], r["env"]["device"])
        seen.setdefault(key, (c, []))[1].append(name)
    lines += markdown_table(
        ["run", "studies", "copy bandwidth (read + write)", "fp16 tensor-core rate", "tf32 tensor-core rate"],
        [[f"{d} {dev}", ", ".join(names), f"{c.get('bandwidth_GBs', 0):.0f} GB/s", f"{c.get('fp16_tflops', 0):.0f} TFLOP/s",
          f"{c.get('tf32_tflops', 0):.0f} TFLOP/s"] for (d, dev), (c, names) in seen.items()],
    )
    lines += ["", "## Targets (issue 6; geomean over each set)", ""]
    lines += table(targets(results), [("target", field("target")), ("goal", field("goal")), ("measured", field("measured")),
                                      ("status", lambda t: f"**{t['status']}**"), ("detail", field("detail"))])
    lines += ["", "## Targets (issue 11, tensor-core path; the worst point decides)", ""]
    lines += table(issue11_targets(results) + crossover_targets(results) + mlp_targets(mlp), [("target", field("target")), ("goal", field("goal")),
                                              ("worst point", field("measured")),
                                              ("status", lambda t: f"**{t['status']}**"), ("detail", field("detail"))])
    failed = [r for res in results.values() for r in res.get("rows", []) if not r.get("ok")]
    if failed:
        lines += ["", f"## ⚠ FAILED CHECKS: {len(failed)} configurations", ""]
        lines += ["These results disagree with the float64 reference beyond the tolerance; their times are excluded.", ""]
        lines += table(failed[:60], [("study", field("study")), ("set", field("set")), ("case", field("case")),
                                     ("relative error", error_text), ("tolerance", lambda r: r.get("tol", ""))])
    bad_anchor = [r for res in results.values() for r in res.get("rows", []) if r.get("anchor_ok") is False]
    if bad_anchor:
        lines += ["", f"Anchors whose own result missed the tolerance: {len(bad_anchor)} "
                  f"({', '.join(sorted({r['anchor'] for r in bad_anchor}))})."]
    lines += ["", "## Roofline view", ""]
    roof_rows = []
    for name, r in results.items():
        ok = [x for x in good(r.get("rows", [])) if x.get("roof_frac") is not None]
        if not ok:
            continue
        fracs = [x["roof_frac"] for x in ok]
        bounds = defaultdict(int)
        for x in ok:
            bounds[x.get("bound")] += 1
        best = max(ok, key=lambda x: x["roof_frac"])
        roof_rows.append([TITLES[name], len(ok), fmt_pct(median(fracs)), fmt_pct(max(fracs)),
                          ", ".join(f"{k}-bound {v}" for k, v in bounds.items()), f"{best['set']} / {best.get('case')}"])
    lines += markdown_table(["study", "configs", "median fraction of limit", "best", "limit", "best configuration"], roof_rows)
    for name in STUDY_ORDER:
        if name in results:
            lines += ["", f"## {TITLES[name]}", ""]
            lines += section(name, results[name], figures)
            notes = results[name].get("notes", [])
            if notes:
                lines += ["", "Notes from the run:", ""] + [f"- {n}" for n in notes]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=None,
                        help="folder of <study>.json (default: every device folder under benchmarks/results)")
    parser.add_argument("--out", type=Path, default=None, help="folder for REPORT.md and figures/ (default: --results)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    folders = [args.results] if args.results else sorted(p for p in RESULTS.iterdir() if p.is_dir())
    written = 0
    for folder in folders:
        results = load(folder)
        if not results:
            print(f"no <study>.json in {folder}")
            continue
        mlp_path = folder / "torch_mlp.json"
        mlp = json.loads(mlp_path.read_text()) if mlp_path.exists() else None
        path = write_report(results, args.out or folder, plots=not args.no_plots, mlp=mlp)
        written += 1
        print(f"wrote {path}")
        for line in summary_lines(results):
            print(line)
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
