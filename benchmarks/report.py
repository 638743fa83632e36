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

from .common import RESULTS, geomean

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


def good(rows):
    return [r for r in rows if r.get("ok") and r.get("ratio")]


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


def targets(results: dict) -> list[dict]:
    """Issue 6's targets, evaluated on the rows present."""
    rows = {s: r.get("rows", []) for s, r in results.items()}
    out = []
    uns = rows.get("unstructured", [])
    out.append(_target(
        "Unstructured SpMM fp32 N=128 vs cuSPARSE (GroupCOO)", "geomean >= 1.5x",
        [r for r in uns if r["set"] == "GroupCOO fp32 N=128 vs cuSPARSE"], lambda r: r["ratio"], 1.5))
    st = rows.get("structured", [])
    dense = [r for r in st if r["anchor"] == "cuBLAS"]
    out.append(_target(
        "BlockGroupCOO vs dense at s >= 0.5, fraction of ideal 1/(1-s)", "geomean >= 70%",
        [r for r in dense if r["sparsity"] >= 0.5], lambda r: r["ratio"] / r["ideal"], 0.7, fmt="{:.0%}"))
    out.append(_target(
        "BlockGroupCOO faster than dense from s = 0.25", "geomean >= 1x",
        [r for r in dense if r["sparsity"] >= 0.25], lambda r: r["ratio"], 1.0))
    out.append(_target(
        "BlockGroupCOO faster than TorchBSR everywhere", "geomean >= 1x (worst shown)",
        [r for r in st if r["anchor"] == "TorchBSR"], lambda r: r["ratio"], 1.0))
    nm = rows.get("nm", [])
    for s in (0.75, 0.875):
        out.append(_target(
            f"N:M vs dense at {s:.1%} sparsity, fraction of ideal M/N", "geomean >= 80%",
            [r for r in nm if r["anchor"] == "cuBLAS" and abs(r["sparsity"] - s) < 1e-6],
            lambda r: r["ratio"] / r["ideal"], 0.8, fmt="{:.0%}"))
    out.append(_target(
        "N:M 2:4 vs cuSPARSELt", "geomean >= 1x",
        [r for r in nm if r["anchor"] == "cuSPARSELt"], lambda r: r["ratio"], 1.0))
    out.append(_target(
        "Fusion: generated kernel vs torch.compile of the lowering", "geomean >= 2x",
        [r for r in rows.get("fusion", []) if r["anchor"] == "torch.compile"], lambda r: r["ratio"], 2.0))
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
    lines += _table(
        ["study", "date", "device", "torch", "triton", "mode", "configs", "failed checks", "time / budget", "status"],
        [[name, r["env"]["date"], r["env"]["device"], r["env"]["torch"], r["env"]["triton"], r.get("mode"),
          len(r.get("rows", [])), sum(not x.get("ok") for x in r.get("rows", [])),
          f"{r.get('elapsed_s', 0):.0f} s / {r.get('budget_s', 0):.0f} s", r.get("status")]
         for name, r in results.items()],
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
    lines += _table(["target", "goal", "measured", "status", "detail"],
                    [[t["target"], t["goal"], t["measured"], f"**{t['status']}**", t["detail"]] for t in targets(results)])
    failed = [r for res in results.values() for r in res.get("rows", []) if not r.get("ok")]
    if failed:
        lines += ["", f"## ⚠ FAILED CHECKS: {len(failed)} configurations", ""]
        lines += ["These results disagree with the float64 reference beyond the tolerance; their times are excluded.", ""]
        lines += _table(["study", "set", "case", "relative error", "tolerance"],
                        [[r["study"], r["set"], r.get("case"), _error_text(r), r.get("tol", "")] for r in failed[:60]])
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
            lines += SECTIONS[name](results[name], figures)
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


def section_unstructured(res, figures):
    rows = res.get("rows", [])
    lines = ["GroupCOO, ELL and CELL `fmt @ B` (the generated kernel) against cuSPARSE (`torch` CSR @ dense) "
             "and against the torch reference lowering of the same statement (eager, and under "
             "`torch.compile` with dynamic shapes, one compilation for every matrix; bounds checks off). Matrices: DLMC pruned weights (a spread of the "
             "subset in ../shared/data), the Planetoid citation graphs, generated power-law graphs.", ""]
    lines += set_table(rows) + [""]
    lines += _figure(figures, "unstructured_bars", "fp32 N=128 per matrix")
    lines += _figure(figures, "unstructured_scatter", "ratio vs nonzeros")
    main = [r for r in rows if r.get("dtype") == "fp32" and r.get("N") == 128 and r.get("anchor") == "cuSPARSE"]
    best = defaultdict(float)
    for r in good(main):
        best[r["case"]] = max(best[r["case"]], r["ratio"])
    if best:
        lines += [f"Best of the formats per matrix (fp32, N = 128, vs cuSPARSE; not a target set): geomean "
                  f"{_x(geomean(best.values()))} over {len(best)} matrices.", ""]
    if main:
        by_case = defaultdict(dict)
        meta = {}
        for r in main:
            by_case[r["case"]][r["format"]] = r
            meta[r["case"]] = r
        lines += ["", "fp32, N = 128, per matrix (ratio vs cuSPARSE; insum time):", ""]
        body = []
        for case, fmts in by_case.items():
            m = meta[case]
            cells = []
            for f in ("GroupCOO", "ELL", "CELL"):
                r = fmts.get(f)
                cells.append("—" if r is None else f"{_x(r['ratio'])} ({_ms(r['insum_ms'])})" + ("" if r["ok"] else " **FAILED**"))
            body.append([case, "×".join(map(str, m["shape"])), m["nnz"], _ms(m["anchor_ms"]), *cells])
        lines += _table(["matrix", "shape", "nnz", "cuSPARSE", "GroupCOO", "ELL", "CELL"], body)
    return lines


def section_structured(res, figures):
    rows = res.get("rows", [])
    lines = ["BlockGroupCOO `fmt @ B` against dense cuBLAS (`A @ B`) and TorchBSR "
             "(`torch.sparse._triton_ops.bsr_dense_mm`) on square matrices with uniformly random "
             "zero blocks. For each point the faster of the group-size candidates is kept: the paper's rule "
             "(`rule`) or one group per block row (`row`, Block-ELL without atomics where the format "
             "offers `group_size=\"row\"`). Ideal speed-up over dense: 1/(1−s).", ""]
    cross = crossovers(rows)
    if cross:
        lines += ["Crossover sparsity (insum faster than dense from):", ""]
        lines += _table(["dtype", "size", "block", "crossover s", "points"],
                        [[c["dtype"], f"{c['size']}³", c["block"], c["text"], c["points"]] for c in cross]) + [""]
    lines += set_table(rows) + [""]
    lines += _figure(figures, "structured", "speed-up over dense vs sparsity")
    dense = {(r["dtype"], r["size"], r["block"], r["sparsity"]): r for r in rows if r.get("anchor") == "cuBLAS"}
    bsr = {(r["dtype"], r["size"], r["block"], r["sparsity"]): r for r in rows if r.get("anchor") == "TorchBSR"}
    body = []
    for key, r in sorted(dense.items()):
        b = bsr.get(key)
        body.append([r["dtype"], r["size"], r["block"], r["sparsity"], f"{r.get('group_rule', '')} {r.get('group_size')}",
                     _ms(r["insum_ms"]),
                     _ms(r["anchor_ms"]), _x(r["ratio"]), f"{r['ideal']:.1f}×",
                     _pct(r["ratio"] / r["ideal"]) if r.get("ratio") else "n/a",
                     _ms(b["anchor_ms"]) if b else "n/a", _x(b["ratio"]) if b else "n/a", _pct(r.get("roof_frac")),
                     "ok" if r["ok"] else "**FAILED**"])
    if body:
        lines += ["", "Every point:", ""]
        lines += _table(["dtype", "size", "block", "s", "group", "insum", "cuBLAS", "vs cuBLAS", "ideal", "of ideal",
                         "TorchBSR", "vs TorchBSR", "roofline", "check"], body)
    return lines


def section_nm(res, figures):
    rows = res.get("rows", [])
    lines = ["Vector-wise N:M (`NM.from_dense`, magnitude pruning, best vector length of the candidates) "
             "against dense cuBLAS on the unpruned shape (fp32: TF32 allowed on both sides) and, at 2:4 "
             "in fp16, cuSPARSELt (`torch.sparse.to_sparse_semi_structured` of the same pruned matrix). "
             "Ideal speed-up over dense: M/N.", ""]
    lines += set_table(rows) + [""]
    lines += _figure(figures, "nm", "N:M fraction of ideal")
    body = []
    for r in rows:
        body.append([r.get("dtype"), r.get("pattern"), f"{r.get('sparsity', 0):.1%}", r.get("size"), r.get("vector_len"),
                     r.get("anchor"), _ms(r.get("insum_ms")), _ms(r.get("anchor_ms")), _x(r.get("ratio")),
                     _pct(r["ratio"] / r["ideal"]) if r.get("anchor") == "cuBLAS" and r.get("ratio") else "",
                     _pct(r.get("roof_frac")), _check(r)])
    if body:
        lines += ["", "Every configuration:", ""]
        lines += _table(["dtype", "N:M", "sparsity", "size", "L", "anchor", "insum", "anchor time", "ratio",
                         "of ideal", "roofline", "check"], body)
    return lines


def section_fusion(res, figures):
    rows = res.get("rows", [])
    lines = ["One statement each, the generated kernel (one fused launch) against the same statement "
             "lowered to torch operations by `insum.reference` (gathers, one einsum, index_put), "
             "eager and under `torch.compile` (default mode, static shapes).", ""]
    lines += set_table(rows) + [""]
    lines += _figure(figures, "fusion", "fusion ablation")
    lines += _table(["statement", "case", "dtype", "anchor", "insum", "anchor time", "ratio", "roofline", "check"],
                    [[f"`{r.get('expr', '')}`", r.get("case"), r.get("dtype"), r.get("anchor"), _ms(r.get("insum_ms")),
                      _ms(r.get("anchor_ms")), _x(r.get("ratio")), _pct(r.get("roof_frac")), _check(r)] for r in rows])
    return lines


def section_costs(res, figures):
    rows = res.get("rows", [])
    lines = ["First call (compile + autotune + run) in a fresh process with empty insum, Triton and "
             "inductor caches, then in a second process with those disk caches warm, against "
             "`torch.compile` of the lowering in the same processes; packing time per format against "
             "torch's own conversion; host time per cached call against a bare launch of the same "
             "compiled Triton kernel (wall clock over many calls, one sync at the end).", ""]
    lines += _table(["set", "case", "insum", "anchor", "anchor time", "ratio", "check"],
                    [[r.get("set"), r.get("case"), _ms(r.get("insum_ms")), r.get("anchor"), _ms(r.get("anchor_ms")),
                      _x(r.get("ratio")), _check(r)] for r in rows])
    return lines


SECTIONS = {
    "unstructured": section_unstructured,
    "structured": section_structured,
    "nm": section_nm,
    "fusion": section_fusion,
    "costs": section_costs,
}


# --------------------------------------------------------------------------- plots


def make_plots(results: dict, folder: Path) -> dict | None:
    """PNG figures by key; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping plots")
        return None
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for key, fn in (("unstructured_bars", _plot_unstructured_bars), ("unstructured_scatter", _plot_unstructured_scatter),
                    ("structured", _plot_structured), ("nm", _plot_nm), ("fusion", _plot_fusion)):
        try:
            fig = fn(results, plt)
        except Exception as e:  # a plot must never lose the report
            print(f"plot {key} failed: {type(e).__name__}: {e}")
            continue
        if fig is None:
            continue
        name = f"{key}.png"
        fig.savefig(folder / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        made[key] = name
    return made


def _short(case: str) -> str:
    """A DLMC path as 'rn50 0.8 bottleneck_1_block_g…'; other names unchanged."""
    if "/" not in case:
        return case
    model, sparsity, name = case.split("/")[:3]
    name = name.replace("body_", "").replace("_fully_connected", "").replace("multihead_attention_", "")
    return f"{model} {sparsity} {name[:26]}"


def _log_ticks(ax) -> None:
    """Plain numbers on a log axis (0.5, 1, 2 rather than 10^0 alone)."""
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _plot_unstructured_bars(results, plt):
    rows = [r for r in good(results.get("unstructured", {}).get("rows", []))
            if r["dtype"] == "fp32" and r["N"] == 128 and r["anchor"] == "cuSPARSE"]
    if not rows:
        return None
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fmts = [f for f in ("GroupCOO", "ELL", "CELL") if any(r["format"] == f for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(cases) * len(fmts)), 4))
    width = 0.8 / len(fmts)
    for i, f in enumerate(fmts):
        vals = {r["case"]: r["ratio"] for r in rows if r["format"] == f}
        xs = [j + i * width for j, c in enumerate(cases) if c in vals]
        ax.bar(xs, [vals[c] for c in cases if c in vals], width, label=f)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.5, color="r", lw=0.8, ls="--", label="target 1.5×")
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels([_short(c) for c in cases], rotation=70, ha="right", fontsize=7)
    _log_ticks(ax)
    ax.set_ylabel("speed-up over cuSPARSE")
    ax.set_title("Unstructured SpMM, fp32, N = 128")
    ax.legend(fontsize=8)
    return fig


def _plot_unstructured_scatter(results, plt):
    rows = [r for r in good(results.get("unstructured", {}).get("rows", [])) if r["anchor"] == "cuSPARSE"]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    markers = {"GroupCOO": "o", "ELL": "s", "CELL": "^"}
    for ax, dtype in zip(axes, ("fp32", "fp16")):
        for f, m in markers.items():
            for n, color in zip((32, 64, 128, 256), ("C0", "C1", "C2", "C3")):
                sel = [r for r in rows if r["dtype"] == dtype and r["format"] == f and r["N"] == n]
                if sel:
                    ax.scatter([r["nnz"] for r in sel], [r["ratio"] for r in sel], marker=m, color=color, s=18,
                               label=f"{f} N={n}", alpha=0.8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _log_ticks(ax)
        ax.set_xlabel("nonzeros")
        ax.set_title(f"{dtype}: speed-up over cuSPARSE")
    axes[0].set_ylabel("cuSPARSE time / insum time")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
    return fig


def _plot_structured(results, plt):
    rows = good(results.get("structured", {}).get("rows", []))
    if not rows:
        return None
    panels = sorted({(r["dtype"], r["size"]) for r in rows})
    cols = min(2, len(panels))
    grid = -(-len(panels) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(6 * cols, 4.2 * grid), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (dtype, size) in zip(axes.flat, panels):
        sel = [r for r in rows if r["dtype"] == dtype and r["size"] == size]
        for block, color in zip((16, 32, 64), ("C0", "C1", "C2")):
            dense = sorted((r["sparsity"], r["ratio"]) for r in sel if r["block"] == block and r["anchor"] == "cuBLAS")
            bsr = {r["sparsity"]: r["ratio"] for r in sel if r["block"] == block and r["anchor"] == "TorchBSR"}
            if dense:
                ax.plot([s for s, _ in dense], [v for _, v in dense], "-o", color=color, ms=3, label=f"insum {block}×{block}")
                pts = [(s, v / bsr[s]) for s, v in dense if s in bsr]
                if pts:
                    ax.plot([s for s, _ in pts], [v for _, v in pts], ":x", color=color, ms=3, label=f"TorchBSR {block}×{block}")
        ss = sorted({r["sparsity"] for r in sel})
        ax.plot(ss, [1 / (1 - s) for s in ss], "k--", lw=0.8, label="ideal 1/(1−s)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        _log_ticks(ax)
        ax.set_xlabel("block sparsity s")
        ax.set_ylabel("speed-up over dense cuBLAS")
        ax.set_title(f"{dtype}, {size}³")
        ax.legend(fontsize=6)
    return fig


def _plot_nm(results, plt):
    rows = [r for r in good(results.get("nm", {}).get("rows", [])) if r["anchor"] in ("cuBLAS", "cuSPARSELt")]
    if not rows:
        return None
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        sel = [r for r in rows if r["dtype"] == dtype and r["anchor"] == "cuBLAS"]
        patterns = list(dict.fromkeys(r["pattern"] for r in sorted(sel, key=lambda r: r["sparsity"])))
        sizes = sorted({r["size"] for r in sel})
        width = 0.8 / max(len(sizes), 1)
        for i, size in enumerate(sizes):
            vals = {r["pattern"]: r["ratio"] / r["ideal"] for r in sel if r["size"] == size}
            xs = [j + i * width for j, p in enumerate(patterns) if p in vals]
            ax.bar(xs, [vals[p] for p in patterns if p in vals], width, label=f"{size}³")
        lt = {(r["size"]): r["ratio"] for r in rows if r["dtype"] == dtype and r["anchor"] == "cuSPARSELt"}
        ax.axhline(0.8, color="r", ls="--", lw=0.8, label="target 80% of ideal")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(patterns))])
        ax.set_xticklabels(patterns)
        ax.set_ylabel("(dense time / insum time) / (M/N)")
        title = f"N:M {dtype}: fraction of the ideal speed-up over dense"
        if lt:
            title += "\n2:4 vs cuSPARSELt: " + ", ".join(f"{s}³ {v:.2f}×" for s, v in sorted(lt.items()))
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    return fig


def _plot_fusion(results, plt):
    rows = good(results.get("fusion", {}).get("rows", []))
    if not rows:
        return None
    cases = list(dict.fromkeys(r["case"] for r in rows))
    anchors = list(dict.fromkeys(r["anchor"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cases)), 4))
    width = 0.8 / len(anchors)
    for i, a in enumerate(anchors):
        vals = {r["case"]: r["ratio"] for r in rows if r["anchor"] == a}
        xs = [j + i * width for j, c in enumerate(cases) if c in vals]
        ax.bar(xs, [vals[c] for c in cases if c in vals], width, label=f"vs {a}")
    ax.axhline(2.0, color="r", ls="--", lw=0.8, label="target 2× vs torch.compile")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    _log_ticks(ax)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("anchor time / insum time")
    ax.set_title("Fusion ablation: one generated kernel vs the torch lowering")
    ax.legend(fontsize=8)
    return fig


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
