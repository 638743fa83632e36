"""`python -m insum demo`: the format `formats.auto` picks, against cuSPARSE, checked.

On a real matrix (the largest DLMC pruned weight in ../shared/data, or a generated one when
the folder is absent) and on a power-law graph: `formats.auto` packs the matrix, `fmt @ B`
runs the generated kernel, the result is checked against a float64 dense product, and the
time is printed beside torch.sparse CSR @ dense (cuSPARSE). With `--all-formats`, a table of
every format on the graph follows. On a CPU-only machine the kernels' torch lowering runs
at small sizes: the checks hold, but speed needs a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

__all__ = ["main", "demo", "auto_demo"]


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


DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _real_matrix(data: Path, device: torch.device, seed: int) -> tuple[str, torch.Tensor]:
    """The largest DLMC matrix in `data` (a generated stand-in when there is none)."""
    from insum.formats import load_smtx, power_law_matrix

    files = sorted(data.glob("dlmc/*/*/*/*.smtx.gz"), key=lambda p: (p.stat().st_size, str(p)))
    if files and device.type == "cuda":
        path = files[-1]
        return f"DLMC {'/'.join(path.parts[-4:])[:-8]}", load_smtx(path, seed=seed).to(device)
    if files:  # the CPU lowering: the smallest, so that the check stays quick
        path = files[0]
        return f"DLMC {'/'.join(path.parts[-4:])[:-8]}", load_smtx(path, seed=seed).to(device)
    return "generated 2048x512 (no ../shared/data)", power_law_matrix(2048, 512, 48, alpha=0.3, seed=seed).to(device)


def auto_demo(rows: int, n: int, avg_nnz: float, seed: int = 0, data: Path = DATA) -> list[dict]:
    """formats.auto on a real matrix and a power-law graph, against cuSPARSE; returns the rows."""
    from insum.formats import auto, power_law_matrix

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        print("insum demo on cpu: no GPU here, so the generated kernels' torch lowering runs; the "
              "results are checked, but speed needs a GPU.\n")
    graph = power_law_matrix(rows, rows, avg_nnz, seed=seed).to(device)
    matrices = [_real_matrix(data, device, seed), (f"power-law graph {rows}x{rows}, avg {avg_nnz:g}", graph)]
    out, failures = [], []
    for name, csr in matrices:
        B = torch.randn(csr.shape[1], n, generator=torch.Generator().manual_seed(seed + 1)).to(device)
        fmt = auto(csr, n_cols=n)
        expected = csr.to(torch.float64) @ B.double() if device.type == "cuda" else csr.to_dense().double() @ B.double()
        err = float(((fmt @ B).double() - expected).norm() / expected.norm().clamp_min(1e-30))
        print(f"{name}: {csr.shape[0]}x{csr.shape[1]}, {csr._nnz()} nonzeros, B with {n} columns, float32")
        print(f"  chosen: {fmt!r}")
        print(f"  why:    {fmt.chosen_because}")
        check = f"rel. error {err:.1e} {'ok' if err < 1e-3 else 'FAILED'}"
        t = t_csr = float("nan")
        if device.type == "cuda":
            t = _time_ms(lambda f=fmt, b=B: f @ b, device, repeats=3)
            t_csr = _time_ms(lambda a=csr, b=B: a @ b, device, repeats=3)
            print(f"  insum {t * 1e3:8.1f} us   cuSPARSE (torch CSR @ dense) {t_csr * 1e3:8.1f} us   "
                  f"speed-up {t_csr / t:.2f}x   {check}\n")
        else:
            print(f"  {check}; time: needs a GPU\n")
        out.append(dict(matrix=name, format=type(fmt).__name__, insum_ms=t, cusparse_ms=t_csr, error=err))
        if not err < 1e-3:
            failures.append(name)
    if failures:
        raise SystemExit(f"demo: results disagree with the dense product for {', '.join(failures)}")
    return out


def demo(rows: int, cols: int, n: int, avg_nnz: float, seed: int = 0) -> list[dict]:
    """Every format on one power-law matrix; returns its rows. Raises if any format disagrees
    with the dense product."""
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
    run = sub.add_parser("demo", help="formats.auto against cuSPARSE on a real matrix and a graph")
    gpu = torch.cuda.is_available()
    run.add_argument("--rows", type=int, default=65536 if gpu else 1024, help="rows of the power-law graph")
    run.add_argument("--n", type=int, default=128 if gpu else 32, help="columns of the dense operand")
    run.add_argument("--avg-nnz", type=float, default=16.0 if gpu else 8.0, help="average degree of the graph")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--data", type=Path, default=DATA, help="the shared data folder (DLMC matrices)")
    run.add_argument("--all-formats", action="store_true", help="then every format on the graph")
    args = parser.parse_args(argv)
    if args.command == "demo":
        auto_demo(args.rows, args.n, args.avg_nnz, args.seed, args.data)
        if args.all_formats:
            demo(args.rows, args.rows, args.n, args.avg_nnz, args.seed)


if __name__ == "__main__":
    main(sys.argv[1:])
