"""How fast is cuBLAS on the dense product with the same work as a sparse one?

    python -m benchmarks.explore.dense_equivalent [--quick]

Issue 11 asks block-sparse and N:M products for a fraction of the ideal speed-up 1/(1-s)
over the full dense product. That ideal assumes a product keeps its efficiency when its
reduction shrinks: a 4096^3 product at s = 0.75 does the work of a dense 4096 x 1024 x 4096
one. This measures, for each missed point, cuBLAS on that compacted dense product (M x K(1-s)
x N, contiguous operands, the same flops and the same output) beside the sparse product and
the full dense one, in one process:

- `compact / full`: the speed-up cuBLAS itself gets from the shorter reduction, against the
  ideal; where it is well under the ideal, so is any kernel that does the same tiles.
- `insum vs compact`: insum against cuBLAS on the same work (> 1: insum faster).
- the memory floor: each operand read once and C written once at the measured copy bandwidth.

Times are do_bench medians (L2 flushed, host in the loop) and graphed replays (device only);
every sparse product is checked against a float64 product.
"""

from __future__ import annotations

import argparse

import torch

from insum.formats import NM, BlockGroupCOO

from ..common import _copy_bandwidth, block_sparse, graphed_ms, median_ms, relative_error, rotating

BLOCK_POINTS = [(4096, 128, 0.5), (4096, 128, 0.75), (4096, 128, 0.9), (8192, 128, 0.5), (8192, 128, 0.75),
                (8192, 128, 0.9), (4096, 64, 0.9), (4096, 32, 0.6), (4096, 32, 0.9)]
NM_POINTS = [(4096, 1, 8), (8192, 1, 8), (4096, 2, 8)]


def timed(fn_of_b, Bs) -> tuple[float, float]:
    """(do_bench median, graphed) in microseconds, B rotated for the median."""
    median = median_ms(rotating(fn_of_b, [(B,) for B in Bs])) * 1e3
    graphed = graphed_ms(lambda: fn_of_b(Bs[0])) * 1e3
    return median, graphed


def balanced_block_sparse(size: int, block: int, s: float, dtype, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """As `block_sparse`, with round((1 - s) * size / block) kept blocks in every block row."""
    nb = size // block
    kept = max(1, round((1 - s) * nb))
    columns = torch.rand(nb, nb, device=device, generator=gen).argsort(1)[:, :kept]
    keep = torch.zeros(nb, nb, dtype=torch.bool, device=device).scatter_(1, columns, True)
    mask = keep.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return torch.randn(size, size, device=device, generator=gen).to(dtype) * mask, keep


def compact_dense(size: int, kept: float, dtype, gen) -> tuple[int, float, float]:
    """cuBLAS on size x K' x size with K' = kept * size (a multiple of 64): (K', median, graphed)."""
    k = max(64, int(round(kept * size / 64)) * 64)
    A = torch.randn(size, k, device="cuda", generator=gen).to(dtype)
    Bs = [torch.randn(k, size, device="cuda", generator=gen).to(dtype) for _ in range(2)]
    median, graphed = timed(lambda B: A @ B, Bs)
    return k, median, graphed


def report(name, size, kept, ideal, stored_bytes, t_insum, t_full, t_compact, k, bandwidth, err) -> None:
    floor = (stored_bytes + 2 * size * size * 2) / bandwidth * 1e6
    flops = 2.0 * size * size * size * kept
    print(f"{name:26s} K'={k:5d} ideal {ideal:5.2f}x | insum {t_insum[0]:8.1f} / {t_insum[1]:8.1f} us"
          f" ({flops / t_insum[1] / 1e6:5.0f} TFLOP/s graphed) | cuBLAS full {t_full[0]:8.1f} / {t_full[1]:8.1f}"
          f" | compact {t_compact[0]:8.1f} / {t_compact[1]:8.1f} ({flops / t_compact[1] / 1e6:5.0f} TFLOP/s)"
          f" | compact/full {t_full[0] / t_compact[0]:5.2f}x = {t_full[0] / t_compact[0] / ideal:4.0%} of ideal"
          f" | insum vs compact {t_compact[0] / t_insum[0]:4.2f}x / {t_compact[1] / t_insum[1]:4.2f}x graphed"
          f" | insum of ideal {t_full[0] / t_insum[0] / ideal:4.0%} | floor {floor:6.1f} us | err {err:.1e}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the 4096^3 points only")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--balanced", action="store_true",
                        help="every block row keeps the same number of blocks (isolates the rows' imbalance)")
    parser.add_argument("--blocks", default=None, help="block points size:block:s,... (default: the missed ones)")
    parser.add_argument("--no-nm", action="store_true", help="skip the N:M points")
    args = parser.parse_args()
    points = BLOCK_POINTS if args.blocks is None else [
        (int(a), int(b), float(c)) for a, b, c in (p.split(":") for p in args.blocks.split(","))]
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(23)
    bandwidth = _copy_bandwidth(2**30) * 1e9
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; times: do_bench median / graphed, in us", flush=True)
    full: dict[int, tuple[float, float]] = {}

    def full_dense(size):
        if size not in full:
            A = torch.randn(size, size, device="cuda", generator=gen).to(dtype)
            Bs = [torch.randn(size, size, device="cuda", generator=gen).to(dtype) for _ in range(2)]
            full[size] = timed(lambda B: A @ B, Bs)
        return full[size]

    for size, block, s in points:
        if args.quick and size > 4096:
            continue
        A, keep = (balanced_block_sparse if args.balanced else block_sparse)(size, block, s, dtype, gen, "cuda")
        kept = float(keep.float().mean())
        Bs = [torch.randn(size, size, device="cuda", generator=gen).to(dtype) for _ in range(2)]
        fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row")
        err = relative_error(fmt @ Bs[0], A.double() @ Bs[0].double())
        t_insum = timed(lambda B, f=fmt: f @ B, Bs)
        k, *t_compact = compact_dense(size, kept, dtype, gen)
        stored = int(keep.sum()) * block * block * A.element_size()
        report(f"{size}^3 {block}x{block} s={s}", size, kept, 1 / kept, stored, t_insum, full_dense(size),
               t_compact, k, bandwidth, err)
        del A, Bs, fmt
    for size, n, m in [] if args.no_nm else NM_POINTS:
        if args.quick and size > 4096:
            continue
        A = torch.randn(size, size, device="cuda", generator=gen).to(dtype)
        Bs = [torch.randn(size, size, device="cuda", generator=gen).to(dtype) for _ in range(2)]
        best = None
        for length in (128, 256):
            fmt = NM.from_dense(A, n=n, m=m, vector_len=length)
            t = timed(lambda B, f=fmt: f.spmm(B), Bs)
            if best is None or t[0] < best[0][0]:
                best = (t, fmt, length)
        t_insum, fmt, length = best
        err = relative_error(fmt.spmm(Bs[0]), fmt.to_dense().double() @ Bs[0].double())
        k, *t_compact = compact_dense(size, n / m, dtype, gen)
        stored = size * size * n // m * A.element_size()
        report(f"{size}^3 N:M {n}:{m} L={length}", size, n / m, m / n, stored, t_insum, full_dense(size), t_compact,
               k, bandwidth, err)
        del A, Bs, fmt


if __name__ == "__main__":
    main()
