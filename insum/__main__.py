"""`python -m insum demo`: SpMM through every format, checked and timed.

Generates a sparse matrix with power-law row lengths, multiplies it by a dense matrix with
each format's one-line statement, checks each result against the dense product and prints a
table: format, time, relative error, speed against torch.sparse CSR. Small sizes on a
CPU-only machine (the torch lowering), realistic sizes on a GPU (the generated kernels).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

__all__ = ["main", "demo"]


def _time_ms(fn, device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        import triton.testing

        fn()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    from insum.formats.tuning import median_wall_time

    return median_wall_time(fn, repeats) * 1e3


def _packers(A: torch.Tensor, csr: torch.Tensor):
    from insum import formats

    yield "COO", lambda: formats.COO.from_torch(csr)
    yield "GroupCOO", lambda: formats.GroupCOO.from_torch(csr)
    yield "ELL", lambda: formats.ELL.from_torch(csr)
    yield "CELL", lambda: formats.CELL.from_torch(csr)
    yield "BlockGroupCOO 16x16", lambda: formats.BlockGroupCOO.from_dense(A, block=(16, 16))
    yield "N:M 2:4 (L=16, pruned)", lambda: formats.NM.from_dense(A, n=2, m=4, vector_len=16)


def demo(rows: int, cols: int, n: int, avg_nnz: float, seed: int = 0) -> list[dict]:
    """Run the table; returns its rows. Raises if any format disagrees with the dense product."""
    from insum.formats import power_law_matrix

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    csr = power_law_matrix(rows, cols, avg_nnz, seed=seed).to(device)
    A = csr.to_dense()
    B = torch.randn(cols, n, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    t_csr = _time_ms(lambda: csr @ B, device, repeats=5)
    print(f"insum demo on {device}: A {rows}x{cols} with {csr._nnz()} nonzeros (power-law rows), "
          f"B {cols}x{n}, float32")
    print(f"torch.sparse CSR @ dense: {t_csr:.3f} ms\n")
    header = f"{'format':26s} {'pack ms':>9s} {'spmm ms':>9s} {'rel. error':>11s} {'vs CSR':>7s}  padding"
    print(header)
    print("-" * len(header))
    table, failures = [], []
    for name, pack in _packers(A, csr):
        start = time.perf_counter()
        fmt = pack()
        pack_ms = (time.perf_counter() - start) * 1e3
        # N:M prunes: its reference is the dense product of what it kept.
        dense = fmt.to_dense() if name.startswith("N:M") else A
        expected = dense.double() @ B.double()
        result = fmt @ B
        err = float((result.double() - expected).norm() / expected.norm().clamp_min(1e-30))
        t = _time_ms(lambda f=fmt: f @ B, device, repeats=3)
        table.append(dict(format=name, pack_ms=pack_ms, spmm_ms=t, error=err, speedup=t_csr / t))
        print(f"{name:26s} {pack_ms:9.2f} {t:9.3f} {err:11.1e} {t_csr / t:6.2f}x  {fmt.padding_ratio:.1%}")
        if not err < 1e-3:
            failures.append(name)
    if failures:
        raise SystemExit(f"demo: results disagree with the dense product for {', '.join(failures)}")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m insum", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("demo", help="SpMM through every format: check and time")
    gpu = torch.cuda.is_available()
    run.add_argument("--rows", type=int, default=16384 if gpu else 1024)
    run.add_argument("--cols", type=int, default=16384 if gpu else 1024)
    run.add_argument("--n", type=int, default=128 if gpu else 32)
    run.add_argument("--avg-nnz", type=float, default=32.0 if gpu else 8.0)
    run.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args.rows, args.cols, args.n, args.avg_nnz, args.seed)


if __name__ == "__main__":
    main(sys.argv[1:])
