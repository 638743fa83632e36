"""The report's figures (PNG, matplotlib when installed): one function per figure, each a
function of the merged study results."""

from __future__ import annotations

from pathlib import Path

from insum.arith import cdiv

from .common import good

__all__ = ["make_plots"]



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
    fmts = list(dict.fromkeys(r["format"] for r in rows))
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
    grid = cdiv(len(panels), cols)
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
