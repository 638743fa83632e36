"""GroupCOO's and COO's covering layout against their plain layout: device time, host time,
padding, checked.

    python -m benchmarks.explore.groupcoo_cover [--files 1] [--cols 128] [--dtypes fp32] [--data .data]
    TRITON_INTERPRET=1 python -m benchmarks.explore.groupcoo_cover --ops    # CPU: what each product issues
    python -m benchmarks.explore.groupcoo_cover --padding [--data ../shared/data]   # CPU: DLMC padding

The covering layout (`GroupCOO.from_torch(A)` / `COO.from_torch(A)` where `covering_block` is
set) keeps every row's groups, empty rows' one all-zero group too, inside one aligned block of
16 groups, so that the repeated product is one launch of stores into `torch.empty`;
`cover=False` is the plain layout (the same segment kernel into a zero-filled C). Side by side
in one run, per matrix (the host-time benchmark's short-rows matrix, the largest DLMC matrices
that cover, a power-law graph whose hub rows keep the plain layout, and a graph of equal row
lengths that covers without padding): the groups of each layout, the device time of one product (a CUDA graph of 20
products, so that host time does not count), the host time per call, and the error against
a float64 product.

`--ops` counts what each of the first products of the short-rows matrix issues, per layout:
the ops that fill memory (a kernel launch each on a GPU) and the generated-kernel launches.
`--padding` counts, over the DLMC matrices, which cover and how many groups (device work:
one gather of g rows of B each) the layout adds.
"""

from __future__ import annotations

import argparse
import glob
import statistics
from pathlib import Path

import torch

from insum.formats import COO, GroupCOO, power_law_matrix
from insum.formats.io import load_smtx

from ..common import DTYPES, host_us_per_call, median_ms
from ..host_time import short_rows_matrix
from .cell_cover import _graph_ms, count_products

FORMATS = (GroupCOO, COO)


def _groups(fmt) -> int:
    return int(fmt.AM.shape[0])


def _matrices(data: Path, count: int) -> list[tuple[str, torch.Tensor]]:
    """The host-time short-rows matrix, the `count` largest DLMC matrices whose GroupCOO covers
    C, a power-law graph (hub rows: plain) and a graph of equal row lengths (covers, no padding)."""
    out = [("host_time short rows 128x96", short_rows_matrix(torch.device("cpu")).to_sparse_csr())]
    paths = sorted(glob.glob(str(data / "dlmc" / "**" / "*.smtx*"), recursive=True), key=lambda p: -Path(p).stat().st_size)
    found = 0
    for path in paths:
        if found >= count:
            break
        A = load_smtx(path)
        if GroupCOO.from_torch(A).covering_block is not None:
            out.append((f"{Path(path).parent.name}/{Path(path).name.split('.')[0]}", A))
            found += 1
    out.append(("power law 65536 rows deg 12 a=1.0", power_law_matrix(65536, 65536, 12.0, alpha=1.0, seed=0)))
    out.append(("uniform 65536 rows deg 8", power_law_matrix(65536, 65536, 8.0, alpha=0.0, seed=0)))
    return out


def count_ops(products: int = 4) -> None:
    """Fill ops and kernel launches of each of the first `products` products, per layout."""
    A = short_rows_matrix(torch.device("cpu"))
    layouts = []
    for fmt_cls in FORMATS:
        for cover in (False, True):
            fmt = fmt_cls.from_dense(A, cover=cover)
            layouts.append((f"{fmt_cls.__name__} cover={cover} (covering_block={fmt.covering_block})", fmt))
    count_products(A, layouts, products)


def count_padding(data: Path) -> None:
    """Per format, over the DLMC matrices: how many cover, and the groups the layout adds."""
    paths = sorted(glob.glob(str(data / "dlmc" / "**" / "*.smtx*"), recursive=True))
    for fmt_cls in FORMATS:
        extra, hubs, bound = [], 0, 0
        for path in paths:
            A = load_smtx(path)
            fmt = fmt_cls.from_torch(A)
            if fmt.covering_block is not None:
                extra.append(_groups(fmt) / _groups(fmt_cls.from_torch(A, cover=False)) - 1)
            elif fmt.fan_in is not None and fmt.fan_in > 16:
                hubs += 1
            else:
                bound += 1
        shown = f"extra groups median {statistics.median(extra):.1%}, max {max(extra):.1%}" if extra else ""
        print(f"{fmt_cls.__name__}: {len(extra)} of {len(paths)} DLMC matrices cover; {hubs} have a row over 16 "
              f"groups, {bound} would pad more than M slots; {shown}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1, help="DLMC matrices (the largest that cover)")
    parser.add_argument("--cols", type=int, default=128)
    parser.add_argument("--data", type=Path, default=Path(".data"), help="a copy of ../shared/data")
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--ops", action="store_true", help="count fill ops and launches per product (CPU)")
    parser.add_argument("--padding", action="store_true", help="count the DLMC matrices that cover, and their padding")
    args = parser.parse_args(argv)
    if not args.data.exists():
        args.data = Path(__file__).resolve().parents[3] / "shared" / "data"
    if args.ops:
        count_ops()
        return
    if args.padding:
        count_padding(args.data)
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (device and host time of the two layouts)")
    gen = torch.Generator().manual_seed(0)
    print(f"GroupCOO/COO covering vs plain layout, N={args.cols}; device us per product (CUDA graph), host us per call")
    print(f"{'format':8s} {'matrix':40s} {'dtype':5s} {'groups cover/plain':>19s} {'device cover':>12s} {'plain':>8s} "
          f"{'host cover':>10s} {'plain':>8s}  max rel err")
    for name, A in _matrices(args.data, args.files):
        for dtype in [DTYPES[name] for name in args.dtypes.split(",")]:
            values = torch.randn(A._nnz(), generator=gen)
            csr = torch.sparse_csr_tensor(A.crow_indices(), A.col_indices(), values, A.shape).to(dtype).cuda()
            B = torch.randn(A.shape[1], args.cols, generator=gen).to(dtype).cuda()
            expected = csr.to(torch.float64) @ B.double()
            for fmt_cls in FORMATS:
                layouts = (fmt_cls.from_torch(csr), fmt_cls.from_torch(csr, cover=False))
                errors, row = [], []
                for fmt in layouts:
                    for _ in range(3):  # one by one, pinned, then the pinned launch
                        C = fmt @ B
                    errors.append(((C.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item())
                for fmt in layouts:
                    try:
                        row.append(_graph_ms(lambda f=fmt, B=B: f @ B) * 1e3)
                    except RuntimeError as error:  # not capturable: do_bench (host time may then count)
                        print(f"  (no CUDA graph: {error!r:.80}; do_bench instead)")
                        row.append(median_ms(lambda f=fmt, B=B: f @ B) * 1e3)
                for fmt in layouts:
                    row.append(host_us_per_call(lambda f=fmt, B=B: f @ B, calls=1000))
                covers = layouts[0].covering_block is not None
                groups = f"{_groups(layouts[0])}/{_groups(layouts[1])}" + ("" if covers else " (no)")
                print(f"{fmt_cls.__name__:8s} {name[:40]:40s} {str(dtype)[6:]:5s} {groups:>19s} {row[0]:12.2f} "
                      f"{row[1]:8.2f} {row[2]:10.2f} {row[3]:8.2f}  {max(errors):.1e}", flush=True)


if __name__ == "__main__":
    main()
