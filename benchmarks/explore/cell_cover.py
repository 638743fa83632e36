"""CELL's covering layout against its plain layout: device time, host time, checked.

    python -m benchmarks.explore.cell_cover [--files 6] [--cols 128] [--dtypes fp32,fp16] [--data .data]
    TRITON_INTERPRET=1 python -m benchmarks.explore.cell_cover --ops    # on the CPU: what each product issues

The covering layout (`CELL.from_torch(A)` where `covering_block` is set) gives every row a
bucket row and keeps folded rows inside aligned blocks, so that the repeated product is one
launch of stores into `torch.empty`; `cover=False` is the plain layout (the same buckets'
atomics and segment sums into a zero-filled C). Side by side in one run, per matrix (the
host-time benchmark's skewed matrix, then the largest DLMC matrices that cover, from
../shared/data), fp32 and fp16: the stored slots of each layout, the device time of one
product (a CUDA graph of 20 products, so that host time does not count), the host time per
call, and the error against a float64 product.

`--ops` (CPU, in the interpreter) counts instead what each of the first products of the
host-time matrix issues, per layout: the ops that fill memory (a kernel launch each on a
GPU) and the generated-kernel launches, and checks each against a float64 product.
"""

from __future__ import annotations

import argparse
import collections
import glob
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from insum import runtime
from insum.formats import CELL
from insum.formats.io import load_smtx

from ..common import DTYPES, cuda_graph, host_us_per_call, median_ms
from ..host_time import skewed_matrix


def _matrices(data: Path, count: int) -> list[tuple[str, torch.Tensor]]:
    """The host-time matrix, then the `count` largest DLMC matrices (by file size) whose CELL
    covers C."""
    out = [("host_time skewed 128x96", skewed_matrix(torch.device("cpu")).to_sparse_csr())]
    paths = sorted(glob.glob(str(data / "dlmc" / "**" / "*.smtx*"), recursive=True), key=lambda p: -Path(p).stat().st_size)
    for path in paths:
        if len(out) > count:
            break
        A = load_smtx(path)
        if CELL.from_torch(A).covering_block is not None:
            out.append((f"{Path(path).parent.name}/{Path(path).name.split('.')[0]}", A))
    return out


def _graph_ms(fn, products: int = 20, reps: int = 20) -> float:
    """Device milliseconds per product: a CUDA graph of `products` products, replayed."""
    graph, _ = cuda_graph(lambda: [fn() for _ in range(products)], warmups=1)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / products)
    return sorted(times)[len(times) // 2]


class _Counted(TorchDispatchMode):
    """Counts the aten ops that fill memory."""

    def __init__(self) -> None:
        super().__init__()
        self.fills: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("zeros", "zero_", "fill_", "new_zeros", "full", "zeros_like"):
            self.fills[name] += 1
        return func(*args, **(kwargs or {}))


def count_products(A: torch.Tensor, layouts: list[tuple[str, object]], products: int = 4) -> None:
    """Fill ops and kernel launches of each of the first `products` products of every
    (label, format) in `layouts`, all packing A, each checked against a float64 product."""
    launches: collections.Counter[str] = collections.Counter()
    originals = {cls: cls.run for cls in (runtime.BatchLaunch, runtime._Launcher)}

    def counting(cls):
        def run(self, *args, **kwargs):
            launches[cls.__name__] += 1
            return originals[cls](self, *args, **kwargs)

        return run

    try:
        for cls in originals:
            cls.run = counting(cls)
        for label, fmt in layouts:
            print(f"{label}: {fmt}")
            gen = torch.Generator().manual_seed(0)
            for product in range(products):
                B = torch.randn(A.shape[1], 16, generator=gen)
                launches.clear()
                with _Counted() as counted:
                    C = fmt.spmm(B, backend="triton")
                error = (C.double() - A.double() @ B.double()).abs().max().item()
                print(f"  product {product + 1}: fill ops {dict(counted.fills) or 0}, launches {dict(launches)}, "
                      f"max error {error:.1e}")
    finally:
        for cls, run in originals.items():
            cls.run = run


def count_ops(products: int = 4) -> None:
    """Fill ops and kernel launches of each of the first `products` products, per layout."""
    A = skewed_matrix(torch.device("cpu"))
    count_products(A, [(f"CELL cover={cover}", CELL.from_dense(A, cover=cover)) for cover in (False, True)], products)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=6, help="DLMC matrices (the largest that cover)")
    parser.add_argument("--cols", type=int, default=128)
    parser.add_argument("--data", type=Path, default=Path(".data"), help="a copy of ../shared/data")
    parser.add_argument("--dtypes", default="fp32,fp16")
    parser.add_argument("--ops", action="store_true", help="count fill ops and launches per product (CPU)")
    args = parser.parse_args(argv)
    if args.ops:
        count_ops()
        return
    if not args.data.exists():
        args.data = Path(__file__).resolve().parents[3] / "shared" / "data"
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (device and host time of the two layouts)")
    gen = torch.Generator().manual_seed(0)
    print(f"CELL covering vs plain layout, N={args.cols}; device us per product (CUDA graph), host us per call")
    print(f"{'matrix':58s} {'dtype':5s} {'slots cover/plain':>18s} {'device cover':>12s} {'plain':>8s} "
          f"{'host cover':>10s} {'plain':>8s}  max rel err")
    for name, A in _matrices(args.data, args.files):
        for dtype in [DTYPES[name] for name in args.dtypes.split(",")]:
            values = torch.randn(A._nnz(), generator=gen)
            csr = torch.sparse_csr_tensor(A.crow_indices(), A.col_indices(), values, A.shape).to(dtype).cuda()
            B = torch.randn(A.shape[1], args.cols, generator=gen).to(dtype).cuda()
            expected = csr.to(torch.float64).to_dense() @ B.double()
            row = []
            errors = []
            layouts = (CELL.from_torch(csr), CELL.from_torch(csr, cover=False))
            for fmt in layouts:
                for _ in range(3):  # one by one, pinned, then the pinned launch
                    C = fmt @ B
                errors.append(((C.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item())
            covers = layouts[0].covering_block is not None
            for fmt in layouts:
                try:
                    row.append(_graph_ms(lambda f=fmt, B=B: f @ B) * 1e3)
                except RuntimeError as error:  # not capturable: do_bench (host time may then count)
                    print(f"  (no CUDA graph: {error!r:.80}; do_bench instead)")
                    row.append(median_ms(lambda f=fmt, B=B: f @ B) * 1e3)
            for fmt in layouts:
                row.append(host_us_per_call(lambda f=fmt, B=B: f @ B, calls=1000))
            slots = f"{layouts[0].stored_values}/{layouts[1].stored_values}" + ("" if covers else " (no)")
            print(f"{name[:58]:58s} {str(dtype)[6:]:5s} {slots:>18s} {row[0]:12.2f} {row[1]:8.2f} "
                  f"{row[2]:10.2f} {row[3]:8.2f}  {max(errors):.1e}", flush=True)


if __name__ == "__main__":
    main()
