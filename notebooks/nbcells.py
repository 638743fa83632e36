"""What the notebook builders share: cells in the percent format, the notebook made of
them, and its execution on the CPU (outputs saved).

The builders run as scripts (`python notebooks/build_*.py`), so this module sits beside
them on the path. nbformat and nbclient are imported only where a notebook is made.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["execute", "new_notebook", "parse_cells", "write"]


def parse_cells(text: str) -> list[tuple[str, str, str]]:
    """(kind, tag, source) for every cell of a percent-format text: `# %%` opens a code cell,
    `# %% [markdown] TAG` a markdown cell whose lines are `# ` comments."""
    cells: list[tuple[str, str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            marker = line[4:].strip()
            kind = "markdown" if marker.startswith("[markdown]") else "code"
            tag = marker[len("[markdown]") :].strip() if kind == "markdown" else marker
            cells.append((kind, tag, []))
        elif cells:
            kind, _, body = cells[-1]
            if kind == "markdown":
                body.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
            else:
                body.append(line)
    return [(kind, tag, "\n".join(body).strip("\n")) for kind, tag, body in cells]


def new_notebook(cells: Iterable[tuple[str, str]]) -> Any:
    """A Python 3 notebook of (kind, source) cells, kind "markdown" or "code"."""
    import nbformat

    made = [
        nbformat.v4.new_markdown_cell(source) if kind == "markdown" else nbformat.v4.new_code_cell(source)
        for kind, source in cells
    ]
    nb = nbformat.v4.new_notebook(cells=made)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def execute(nb: Any, folder: Path, timeout: int = 600) -> None:
    """Run every cell in a kernel whose working directory is `folder`, on the CPU (the
    Triton interpreter), keeping the outputs; the execution timestamps are dropped."""
    from nbclient import NotebookClient

    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    print(f"executed in {time.perf_counter() - start:.1f} s")
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)


def write(nb: Any, out: Path) -> None:
    """Validate `nb` and write it to `out`."""
    import nbformat

    nbformat.validate(nb)
    out.write_text(nbformat.writes(nb) + "\n")
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
