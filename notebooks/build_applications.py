"""Write notebooks/applications.ipynb from its two parts and execute it (outputs saved).

    .venv/bin/python notebooks/build_applications.py                # build, execute, save
    .venv/bin/python notebooks/build_applications.py --no-execute   # cells only, no outputs

The parts hold the cells: `build_applications_conv.py` (point clouds: kernel maps and their
packings as pictures, the statements, a check against a dense conv3d, the H200 speed) and
`build_applications_tp.py` (equivariant tensor products: CG tables as pictures, the
statements, a check against e3nn, the H200 speed). The kernel runs on the CPU with the
notebook's folder as its working directory and TRITON_INTERPRET=1; it needs nbformat,
nbclient, ipykernel and matplotlib (the `notebooks` extra) and e3nn (the `e3nn` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from build_applications_conv import cells as conv_cells  # noqa: E402
from build_applications_tp import CELLS as TP_CELLS  # noqa: E402
from nbcells import execute, new_notebook, write  # noqa: E402

TARGET = HERE / "applications.ipynb"
INTRO = """\
# insum applications: the paper's two other case studies as layers

Each layer's heavy lifting is one indirect Einsum: `insum.nn.SparseConv3d` (point-cloud
sparse convolution over a GPU kernel map) and `insum.nn.FullyConnectedTensorProduct` /
`TensorProduct` (O(3)-equivariant tensor products over Clebsch–Gordan tables). Everything
here runs on the CPU (kernels in the Triton interpreter); the speed tables read what the
benchmarks measured on the H200 (`benchmarks/results/h200/`)."""


def build():
    """The notebook's cells, without outputs."""
    return new_notebook([("markdown", INTRO), *conv_cells(), *TP_CELLS])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="write the cells without outputs")
    parser.add_argument("--out", type=Path, default=TARGET, help="the notebook to write")
    args = parser.parse_args(argv)
    nb = build()
    if not args.no_execute:
        execute(nb, HERE)
    write(nb, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
