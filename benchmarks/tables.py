"""Markdown for the report: cell formats and the one table function, driven by columns
(a header and a function of the row each)."""

from __future__ import annotations

import math
import re

__all__ = ["check", "error_text", "field", "fmt_ms", "fmt_pct", "fmt_ratio", "markdown_table", "median", "natural", "table"]


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def fmt_ms(v):
    if v is None:
        return "n/a"
    if v >= 1000:
        return f"{v / 1e3:.1f} s"
    return f"{v * 1e3:.1f} µs" if v < 1 else f"{v:.3f} ms"


def fmt_ratio(v):
    return "n/a" if v is None else f"{v:.2f}×"


def fmt_pct(v):
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.0%}"


def markdown_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def natural(text: str) -> list:
    """Sort key that orders 'N=32' before 'N=128'."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def check(row) -> str:
    return "ok" if row.get("ok") else "**FAILED**"


def error_text(row) -> str:
    if row.get("error"):
        return "raised " + row["error"].replace("|", "/")[:200]
    return "NaN" if row.get("err") is None else f"{row['err']:.2e}"


def field(key: str, show=str):
    """A column's cell: row[key] shown by `show` (None passes through to it)."""
    return lambda r: show(r.get(key))


def table(rows: list[dict], columns: list[tuple[str, object]]) -> list[str]:
    """The one table of the report: a header per column, a line per row, each cell its
    column's function of the row."""
    return markdown_table([header for header, _ in columns], [[cell(r) for _, cell in columns] for r in rows])
