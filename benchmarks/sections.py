"""The report's section per study: its introduction, summary, figures and tables, as data
(SECTIONS) plus the few study-specific tables that are not one line per row (PIVOTS)."""

from __future__ import annotations

import math
from collections import defaultdict

from .common import geomean, good
from .tables import check, field, fmt_ms, fmt_pct, fmt_ratio, markdown_table, median, natural, table

__all__ = ["SECTIONS", "crossovers", "section", "set_table"]


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


def _figure(figures, key, caption):
    return [f"![{caption}](figures/{figures[key]})", ""] if key in figures else []


def set_table(rows: list[dict]) -> list[str]:
    """Geomean, range and roofline fraction per set, in natural order of the set names."""
    groups = defaultdict(list)
    for r in rows:
        groups[r["set"]].append(r)
    body = []
    for name, members in sorted(groups.items(), key=lambda kv: natural(kv[0])):
        ok = good(members)
        ratios = [r["ratio"] for r in ok]
        fracs = [r["roof_frac"] for r in ok if r.get("roof_frac") is not None]
        failed = len(members) - len([r for r in members if r.get("ok")])
        body.append([
            name, len(members), fmt_ratio(geomean(ratios)) if ratios else "n/a",
            f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "n/a",
            fmt_pct(median(fracs)) if fracs else "n/a", f"**{failed}**" if failed else "0",
        ])
    return markdown_table(["set", "configs", "geomean ratio", "range", "median roofline fraction", "failed checks"], body)


COMMON = [("insum", field("insum_ms", fmt_ms)), ("anchor time", field("anchor_ms", fmt_ms)), ("ratio", field("ratio", fmt_ratio))]

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
              "offers `group_size=\"row\"`) and, for 16- and 32-row blocks, Block-ELL with "
              "`coarsen=\"tune\"` (the format's tuner merging 2 or 4 neighbouring block rows, with explicit "
              "zero blocks, where that times faster at the product's width; `row coarsen=r`, kept where it "
              "chose r > 1). Ideal speed-up over dense: 1/(1−s).",
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
                 ("of ideal", lambda r: fmt_pct(r["ratio"] / r["ideal"]) if r.get("anchor") == "cuBLAS" and r.get("ratio") else ""),
                 ("roofline", field("roof_frac", fmt_pct)), ("check", check)],
    ),
    "gemm": dict(
        intro="The plain statement `C[m,n] = A[m,k]*B[k,n]` and the same with B's rows gathered through a "
              "random permutation, `C[m,n] = A[m,k]*B[I[k],n]` (staged by default: the gather as a copy, then "
              "the dense product), against cuBLAS `A @ B` and, gathered, against torch's `A @ B[I]`.",
        sets=True,
        caption="Every point:",
        columns=[("dtype", field("dtype")), ("statement", field("kind")), ("size", field("size")),
                 ("anchor", field("anchor")), *COMMON, ("roofline", field("roof_frac", fmt_pct)), ("check", check)],
    ),
    "fusion": dict(
        intro="One statement each, the generated kernel (one fused launch) against the same statement "
              "lowered to torch operations by `insum.reference` (gathers, one einsum, index_put), "
              "eager and under `torch.compile` (default mode, static shapes).",
        sets=True,
        figures=[("fusion", "fusion ablation")],
        columns=[("statement", lambda r: f"`{r.get('expr', '')}`"), ("case", field("case")), ("dtype", field("dtype")),
                 ("anchor", field("anchor")), *COMMON, ("roofline", field("roof_frac", fmt_pct)), ("check", check)],
    ),
    "costs": dict(
        intro="First call (compile + autotune + run) in a fresh process with empty insum, Triton and "
              "inductor caches, then in a second process with those disk caches warm, against "
              "`torch.compile` of the lowering in the same processes; packing time per format against "
              "torch's own conversion; host time per cached call against a bare launch of the same "
              "compiled Triton kernel (wall clock over many calls, one sync at the end).",
        columns=[("set", field("set")), ("case", field("case")), ("insum", field("insum_ms", fmt_ms)),
                 ("anchor", field("anchor")), ("anchor time", field("anchor_ms", fmt_ms)), ("ratio", field("ratio", fmt_ratio)),
                 ("check", check)],
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
                  f"{fmt_ratio(geomean(best.values()))} over {len(best)} matrices.", ""]
    if not main:
        return lines
    formats = list(dict.fromkeys(r["format"] for r in main))
    by_case = defaultdict(dict)
    for r in main:
        by_case[r["case"]][r["format"]] = r

    def cell(f, case_rows):
        r = case_rows.get(f)
        return "—" if r is None else f"{fmt_ratio(r['ratio'])} ({fmt_ms(r['insum_ms'])})" + ("" if r["ok"] else " **FAILED**")

    first = {case: next(iter(fmts.values())) for case, fmts in by_case.items()}
    columns = [("matrix", lambda c: c[0]), ("shape", lambda c: "×".join(map(str, first[c[0]]["shape"]))),
               ("nnz", lambda c: first[c[0]]["nnz"]), ("cuSPARSE", lambda c: fmt_ms(first[c[0]]["anchor_ms"])),
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
               ("group", lambda r: f"{r.get('group_rule', '')} {r.get('group_size')}"), ("insum", field("insum_ms", fmt_ms)),
               ("cuBLAS", field("anchor_ms", fmt_ms)), ("vs cuBLAS", field("ratio", fmt_ratio)), ("ideal", lambda r: f"{r['ideal']:.1f}×"),
               ("of ideal", lambda r: fmt_pct(r["ratio"] / r["ideal"]) if r.get("ratio") else "n/a"),
               ("TorchBSR", b(lambda x: fmt_ms(x["anchor_ms"]))), ("vs TorchBSR", b(lambda x: fmt_ratio(x["ratio"]))),
               ("roofline", field("roof_frac", fmt_pct)), ("check", lambda r: "ok" if r["ok"] else "**FAILED**")]
    return ["", "Every point:", ""] + table(dense, columns)


#: Study-specific tables that are not one line per row.
PIVOTS = {
    "unstructured": _unstructured_per_matrix,
    "structured:before": _structured_crossovers,
    "structured": _structured_points,
}
