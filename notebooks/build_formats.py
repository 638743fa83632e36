"""Write notebooks/formats.ipynb from notebooks/formats.py and execute it (outputs saved).

    .venv/bin/python notebooks/build_formats.py                  # build, execute, save
    .venv/bin/python notebooks/build_formats.py --no-execute     # cells only, no outputs
    .venv/bin/python notebooks/build_formats.py --results DIR    # speed plots from DIR

formats.py is in the percent format: `# %%` opens a code cell, `# %% [markdown]` a markdown
cell (its lines are `# ` comments); text before the first marker is the file's own
docstring and is left out. The markdown cell marked `# %% [markdown] results-status` is
filled here with what benchmarks/results/h200 (or --results) holds at build time.

Needs nbformat, nbclient and ipykernel (plus matplotlib) in the running Python:
`.venv/bin/pip install nbformat nbclient ipykernel matplotlib`. The kernel runs with the
notebook's folder as its working directory, TRITON_INTERPRET=1, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from nbcells import execute, new_notebook, parse_cells, write

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SOURCE = HERE / "formats.py"
TARGET = HERE / "formats.ipynb"
STUDIES = ("unstructured", "structured", "nm", "fusion", "costs")


def results_status(folder: Path) -> str:
    """Markdown naming the result files found (read, not summarised: the plots do that)."""
    shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            env = data.get("env", {})
            found.append(
                f"- `{path.name}`: {len(data['rows'])} rows, status {data.get('status')}, "
                f"{env.get('device', 'unknown device')}, {env.get('date', 'undated')}"
            )
    if not found:
        return (
            f"**No benchmark results yet.** When this notebook was built, `{shown}` held no "
            f"study JSON file ({', '.join(s + '.json' for s in STUDIES)}), so there are no speed "
            "plots below: nothing is measured on this CPU and no numbers are made up. After the "
            "H200 suite (`bash benchmarks/gpu_suite.sh`) has written them, rebuild with `python notebooks/build_formats.py`."
        )
    return f"When this notebook was built, `{shown}` held:\n\n" + "\n".join(found)


def build(results: Path):
    """The notebook's cells, without outputs."""
    cells = []
    for kind, tag, source in parse_cells(SOURCE.read_text()):
        if kind == "markdown":
            cells.append((kind, results_status(results) if tag == "results-status" else source))
        elif source.strip():
            cells.append((kind, source))
    nb = new_notebook(cells)
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="write the cells without outputs")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "h200",
                        help="folder of the benchmark JSON files (default benchmarks/results/h200)")
    parser.add_argument("--out", type=Path, default=TARGET, help="the notebook to write")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    results = args.results.resolve()
    nb = build(results)
    if not args.no_execute:
        os.environ["INSUM_RESULTS"] = str(results)
        execute(nb, HERE, args.timeout)
    write(nb, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
