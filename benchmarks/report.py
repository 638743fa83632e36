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
import math
from collections import defaultdict
from pathlib import Path

from .common import RESULTS, geomean, good
from .plots import make_plots

STUDY_ORDER = ("unstructured", "structured", "nm", "fusion", "costs")
TITLES = {
    "unstructured": "Unstructured SpMM",
    "structured": "Structured SpMM (BlockGroupCOO)",
    "nm": "N:M SpMM",
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


def targets(results: dict) -> list[dict]:
    """Issue 6's targets, evaluated on the rows present."""
    out = []
    for name, goal, study, keep, value_of, threshold, fmt in TARGETS:
        rows = [r for r in results.get(study, {}).get("rows", []) if keep(r)]
        out.append(_target(name, goal, rows, value_of, threshold, fmt=fmt))
    return out


def crossovers(rows: list[dict]) -> list[dict]:
    """Per (dtype, size, block): the sparsity from which BlockGroupCOO beats dense cuBLAS.

    The smallest measured s from which every larger measured s is faster, interpolated in
    log(ratio) against the point before it.
    """
    curves = defaultdict(list)
    for r in good(rows):
        if r["anchor"] == "cuBLAS":
            curves[(r["dtype"], r["size"], r["block"])].append((r["sparsity"], r["ratio"]))
    out = []
    for (dtype, size, block), points in sorted(curves.items()):
        points.sort()
        at = None
        for i in range(len(points)):
            if all(ratio >= 1 for _, ratio in points[i:]):
                at = i
                break
        if at is None:
            where = f"not reached (x{points[-1][1]:.2f} at s={points[-1][0]})"
            value = None
        elif at == 0:
            where = f"<= {points[0][0]} (x{points[0][1]:.2f})"
            value = points[0][0]
        else:
            (s0, r0), (s1, r1) = points[at - 1], points[at]
            t = -math.log(r0) / (math.log(r1) - math.log(r0)) if r1 != r0 else 1.0
            value = s0 + t * (s1 - s0)
            where = f"{value:.2f} (x{r0:.2f} at {s0}, x{r1:.2f} at {s1})"
        out.append(dict(dtype=dtype, size=size, block=block, crossover=value, text=where, points=len(points)))
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
        roof = f"{_median(fracs):.0%} / {max(fracs):.0%}" if fracs else "n/a"
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


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


# --------------------------------------------------------------------------- markdown


def _ms(v):
    if v is None:
        return "n/a"
    if v >= 1000:
        return f"{v / 1e3:.1f} s"
    return f"{v * 1e3:.1f} µs" if v < 1 else f"{v:.3f} ms"


def _x(v):
    return "n/a" if v is None else f"{v:.2f}×"


def _pct(v):
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.0%}"


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _natural(text: str) -> list:
    """Sort key that orders 'N=32' before 'N=128'."""
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def set_table(rows: list[dict]) -> list[str]:
    """Geomean, range and roofline fraction per set, in natural order of the set names."""
    groups = defaultdict(list)
    for r in rows:
        groups[r["set"]].append(r)
    body = []
    for name, members in sorted(groups.items(), key=lambda kv: _natural(kv[0])):
        ok = good(members)
        ratios = [r["ratio"] for r in ok]
        fracs = [r["roof_frac"] for r in ok if r.get("roof_frac") is not None]
        failed = len(members) - len([r for r in members if r.get("ok")])
        body.append([
            name, len(members), _x(geomean(ratios)) if ratios else "n/a",
            f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "n/a",
            _pct(_median(fracs)) if fracs else "n/a", f"**{failed}**" if failed else "0",
        ])
    return _table(["set", "configs", "geomean ratio", "range", "median roofline fraction", "failed checks"], body)


def write_report(results: dict, out: Path, plots: bool = True) -> Path:
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
        "repetition, so they are device times: the host time per call is measured apart, under Costs) "
        "with the dense operand rotated among several copies. Each measured configuration "
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
         ("time / budget", lambda r: f"{r.get('elapsed_s', 0):.0f} s / {r.get('budget_s', 0):.0f} s"), ("status", field("status"))],
    )
    lines += ["", "Measured ceilings (each run measures its own, before its studies):", ""]
    seen = {}
    for name, r in results.items():
        c = r.get("ceilings", {})
        key = (r["env"]["date"], r["env"]["device"])
        seen.setdefault(key, (c, []))[1].append(name)
    lines += _table(
        ["run", "studies", "copy bandwidth (read + write)", "fp16 tensor-core rate", "tf32 tensor-core rate"],
        [[f"{d} {dev}", ", ".join(names), f"{c.get('bandwidth_GBs', 0):.0f} GB/s", f"{c.get('fp16_tflops', 0):.0f} TFLOP/s",
          f"{c.get('tf32_tflops', 0):.0f} TFLOP/s"] for (d, dev), (c, names) in seen.items()],
    )
    lines += ["", "## Targets (issue 6; geomean over each set)", ""]
    lines += table(targets(results), [("target", field("target")), ("goal", field("goal")), ("measured", field("measured")),
                                      ("status", lambda t: f"**{t['status']}**"), ("detail", field("detail"))])
    failed = [r for res in results.values() for r in res.get("rows", []) if not r.get("ok")]
    if failed:
        lines += ["", f"## ⚠ FAILED CHECKS: {len(failed)} configurations", ""]
        lines += ["These results disagree with the float64 reference beyond the tolerance; their times are excluded.", ""]
        lines += table(failed[:60], [("study", field("study")), ("set", field("set")), ("case", field("case")),
                                     ("relative error", _error_text), ("tolerance", lambda r: r.get("tol", ""))])
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
        roof_rows.append([TITLES[name], len(ok), _pct(_median(fracs)), _pct(max(fracs)),
                          ", ".join(f"{k}-bound {v}" for k, v in bounds.items()), f"{best['set']} / {best.get('case')}"])
    lines += _table(["study", "configs", "median fraction of limit", "best", "limit", "best configuration"], roof_rows)
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


def _check(row) -> str:
    return "ok" if row.get("ok") else "**FAILED**"


def _error_text(row) -> str:
    if row.get("error"):
        return "raised " + row["error"].replace("|", "/")[:200]
    return "NaN" if row.get("err") is None else f"{row['err']:.2e}"


def _figure(figures, key, caption):
    return [f"![{caption}](figures/{figures[key]})", ""] if key in figures else []


def field(key: str, show=str):
    """A column's cell: row[key] shown by `show` (None passes through to it)."""
    return lambda r: show(r.get(key))


def table(rows: list[dict], columns: list[tuple[str, object]]) -> list[str]:
    """The one table of the report: a header per column, a line per row, each cell its
    column's function of the row."""
    return _table([header for header, _ in columns], [[cell(r) for _, cell in columns] for r in rows])


COMMON = [("insum", field("insum_ms", _ms)), ("anchor time", field("anchor_ms", _ms)), ("ratio", field("ratio", _x))]

#: Per study: its introduction, whether a per-set summary opens it, its figures, and the
#: caption and columns of its table of every row (a study may add its own pivot below).
SECTIONS = {
    "unstructured": dict(
        intro="GroupCOO, ELL and CELL `fmt @ B` (the generated kernel) against cuSPARSE (`torch` CSR @ dense) "
              "and against the torch reference lowering of the same statement (eager, and under "
              "`torch.compile` with dynamic shapes, one compilation for every matrix; bounds checks off). Matrices: DLMC pruned weights (a spread of the "
              "subset in ../shared/data), the Planetoid citation graphs, generated power-law graphs.",
        sets=True,
        figures=[("unstructured_bars", "fp32 N=128 per matrix"), ("unstructured_scatter", "ratio vs nonzeros")],
    ),
    "structured": dict(
        intro="BlockGroupCOO `fmt @ B` against dense cuBLAS (`A @ B`) and TorchBSR "
              "(`torch.sparse._triton_ops.bsr_dense_mm`) on square matrices with uniformly random "
              "zero blocks. For each point the faster of the group-size candidates is kept: the paper's rule "
              "(`rule`) or one group per block row (`row`, Block-ELL without atomics where the format "
              "offers `group_size=\"row\"`). Ideal speed-up over dense: 1/(1−s).",
        sets=True,
        figures=[("structured", "speed-up over dense vs sparsity")],
    ),
    "nm": dict(
        intro="Vector-wise N:M (`NM.from_dense`, magnitude pruning, best vector length of the candidates) "
              "against dense cuBLAS on the unpruned shape (fp32: TF32 allowed on both sides) and, at 2:4 "
              "in fp16, cuSPARSELt (`torch.sparse.to_sparse_semi_structured` of the same pruned matrix). "
              "Ideal speed-up over dense: M/N.",
        sets=True,
        figures=[("nm", "N:M fraction of ideal")],
        caption="Every configuration:",
        columns=[("dtype", field("dtype")), ("N:M", field("pattern")),
                 ("sparsity", lambda r: f"{r.get('sparsity', 0):.1%}"), ("size", field("size")),
                 ("L", field("vector_len")), ("anchor", field("anchor")), *COMMON,
                 ("of ideal", lambda r: _pct(r["ratio"] / r["ideal"]) if r.get("anchor") == "cuBLAS" and r.get("ratio") else ""),
                 ("roofline", field("roof_frac", _pct)), ("check", _check)],
    ),
    "fusion": dict(
        intro="One statement each, the generated kernel (one fused launch) against the same statement "
              "lowered to torch operations by `insum.reference` (gathers, one einsum, index_put), "
              "eager and under `torch.compile` (default mode, static shapes).",
        sets=True,
        figures=[("fusion", "fusion ablation")],
        columns=[("statement", lambda r: f"`{r.get('expr', '')}`"), ("case", field("case")), ("dtype", field("dtype")),
                 ("anchor", field("anchor")), *COMMON, ("roofline", field("roof_frac", _pct)), ("check", _check)],
    ),
    "costs": dict(
        intro="First call (compile + autotune + run) in a fresh process with empty insum, Triton and "
              "inductor caches, then in a second process with those disk caches warm, against "
              "`torch.compile` of the lowering in the same processes; packing time per format against "
              "torch's own conversion; host time per cached call against a bare launch of the same "
              "compiled Triton kernel (wall clock over many calls, one sync at the end).",
        columns=[("set", field("set")), ("case", field("case")), ("insum", field("insum_ms", _ms)),
                 ("anchor", field("anchor")), ("anchor time", field("anchor_ms", _ms)), ("ratio", field("ratio", _x)),
                 ("check", _check)],
    ),
}


def section(name: str, res: dict, figures: dict) -> list[str]:
    """A study's section, from its entry in SECTIONS (and its pivot in PIVOTS)."""
    spec, rows = SECTIONS[name], res.get("rows", [])
    lines = [spec["intro"], ""]
    lines += PIVOTS.get(name + ":before", lambda rows: [])(rows)
    if spec.get("sets"):
        lines += set_table(rows) + [""]
    for key, caption in spec.get("figures", []):
        lines += _figure(figures, key, caption)
    lines += PIVOTS.get(name, lambda rows: [])(rows)
    if spec.get("columns") and rows:
        lines += ["", spec["caption"], ""] if spec.get("caption") else []
        lines += table(rows, spec["columns"])
    return lines


def _unstructured_per_matrix(rows) -> list[str]:
    """The best format per matrix, and fp32 N = 128 with one column per format."""
    lines = []
    main = [r for r in rows if r.get("dtype") == "fp32" and r.get("N") == 128 and r.get("anchor") == "cuSPARSE"]
    best = defaultdict(float)
    for r in good(main):
        best[r["case"]] = max(best[r["case"]], r["ratio"])
    if best:
        lines += [f"Best of the formats per matrix (fp32, N = 128, vs cuSPARSE; not a target set): geomean "
                  f"{_x(geomean(best.values()))} over {len(best)} matrices.", ""]
    if not main:
        return lines
    formats = list(dict.fromkeys(r["format"] for r in main))
    by_case = defaultdict(dict)
    for r in main:
        by_case[r["case"]][r["format"]] = r

    def cell(f, case_rows):
        r = case_rows.get(f)
        return "—" if r is None else f"{_x(r['ratio'])} ({_ms(r['insum_ms'])})" + ("" if r["ok"] else " **FAILED**")

    first = {case: next(iter(fmts.values())) for case, fmts in by_case.items()}
    columns = [("matrix", lambda c: c[0]), ("shape", lambda c: "×".join(map(str, first[c[0]]["shape"]))),
               ("nnz", lambda c: first[c[0]]["nnz"]), ("cuSPARSE", lambda c: _ms(first[c[0]]["anchor_ms"])),
               *[(f, lambda c, f=f: cell(f, c[1])) for f in formats]]
    return lines + ["", "fp32, N = 128, per matrix (ratio vs cuSPARSE; insum time):", ""] + table(list(by_case.items()), columns)


def _structured_crossovers(rows) -> list[str]:
    cross = crossovers(rows)
    if not cross:
        return []
    return ["Crossover sparsity (insum faster than dense from):", ""] + table(
        cross, [("dtype", field("dtype")), ("size", lambda c: f"{c['size']}³"), ("block", field("block")),
                ("crossover s", field("text")), ("points", field("points"))]) + [""]


def _structured_points(rows) -> list[str]:
    """Every point against cuBLAS, with TorchBSR's time for the same point beside it."""
    def key(r):
        return (r["dtype"], r["size"], r["block"], r["sparsity"])

    bsr = {key(r): r for r in rows if r.get("anchor") == "TorchBSR"}
    dense = sorted((r for r in rows if r.get("anchor") == "cuBLAS"), key=key)
    if not dense:
        return []

    def b(show):
        return lambda r: show(bsr[key(r)]) if key(r) in bsr else "n/a"

    columns = [("dtype", field("dtype")), ("size", field("size")), ("block", field("block")), ("s", field("sparsity")),
               ("group", lambda r: f"{r.get('group_rule', '')} {r.get('group_size')}"), ("insum", field("insum_ms", _ms)),
               ("cuBLAS", field("anchor_ms", _ms)), ("vs cuBLAS", field("ratio", _x)), ("ideal", lambda r: f"{r['ideal']:.1f}×"),
               ("of ideal", lambda r: _pct(r["ratio"] / r["ideal"]) if r.get("ratio") else "n/a"),
               ("TorchBSR", b(lambda x: _ms(x["anchor_ms"]))), ("vs TorchBSR", b(lambda x: _x(x["ratio"]))),
               ("roofline", field("roof_frac", _pct)), ("check", lambda r: "ok" if r["ok"] else "**FAILED**")]
    return ["", "Every point:", ""] + table(dense, columns)


#: Study-specific tables that are not one line per row.
PIVOTS = {
    "unstructured": _unstructured_per_matrix,
    "structured:before": _structured_crossovers,
    "structured": _structured_points,
}


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
        path = write_report(results, args.out or folder, plots=not args.no_plots)
        written += 1
        print(f"wrote {path}")
        for line in summary_lines(results):
            print(line)
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
