"""`formats.auto` against cuSPARSE, the A/B of each scatter strategy, and the host overhead.

One GPU run, side by side, every result checked against a float64 product:

1. auto vs cuSPARSE (torch CSR @ dense): every DLMC matrix in the data folder, the
   citation graphs and power-law graphs of 65k, 262k and 1M rows; fp32 N=128 on every
   matrix, fp16 N=128 on the graphs and every second DLMC matrix, N = 32, 64, 256 on the
   graphs and every sixth DLMC matrix (in that order, as the budget allows).
2. A/B at fp32 N=128 on the graphs and a few DLMC matrices: GroupCOO (paper's group size,
   g=1, g=8) and CELL with the scatter reduced per segment (their sorted row index
   declared) or one atomic per group (declaration withheld); the segment kernel with
   atomics only (the `+=` statement through `insum()`); ELL.
3. Host time per cached call: insum() and fmt @ B against a bare Triton launch of the same
   kernel, and torch CSR @ B.

    python -m benchmarks.unstructured_auto [--data ../.data] [--budget 320] [--out DIR] [--jobs float16:128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import insum
from insum.formats import CELL, ELL, GroupCOO, auto, load_mtx, load_smtx, power_law_matrix

from .common import (
    bare_launcher,
    geomean,
    host_case,
    host_us_per_call,
    median_ms,
    padded_slots,
    relative_error,
    rotating,
    shorten_autotune,
)
from .context import TOLERANCE


def bench_ms(fn, Bs) -> float:
    """do_bench median of fn(B), B rotating over Bs (short: 5 ms warm-up, 25 ms)."""
    return median_ms(rotating(fn, [(B,) for B in Bs]), warmup=5, rep=25)


def matrices(data: Path, device) -> list[tuple[str, str, object]]:
    out = []
    for path in sorted(data.glob("dlmc/*/*/*/*.smtx.gz")):
        name = f"{path.parts[-4]}/{path.parts[-2]}/{path.name[:-8]}"
        out.append((name, "dlmc", lambda p=path: load_smtx(p)))
    for g in ("cora", "citeseer", "pubmed"):
        path = data / "graphs" / f"{g}.mtx.gz"
        if path.exists():
            out.append((g, "graph", lambda p=path: load_mtx(p)))
    for rows, avg in ((65536, 16), (262144, 16), (1 << 20, 10)):
        out.append((f"power-law {rows} avg {avg}", "power-law",
                    lambda r=rows, a=avg: power_law_matrix(r, r, a, seed=0, device=device)))
    return out


def cast(csr: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.sparse_csr_tensor(csr.crow_indices(), csr.col_indices(), csr.values().to(dtype), csr.shape,
                                   check_invariants=False)


class Run:
    def __init__(self, args):
        self.start = time.time()
        self.budget = args.budget
        self.out = Path(args.out)
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.log = open(self.out / "unstructured_auto.log", "w")

    def left(self) -> float:
        return self.budget - (time.time() - self.start)

    def say(self, text: str) -> None:
        print(text, file=self.log, flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.say("NOTE " + text)


def measure_auto(run: Run, name, kind, csr, dtype, N, gen) -> None:
    K = csr.shape[1]
    Bs = [torch.randn(K, N, device=csr.device, generator=gen).to(dtype) for _ in range(3)]
    expected = cast(csr, torch.float64) @ Bs[0].double()
    t_csr = bench_ms(lambda B: csr @ B, Bs)
    err_csr = relative_error(csr @ Bs[0], expected)
    t0 = time.time()
    fmt = auto(csr, n_cols=N)
    choose_s = time.time() - t0
    got = fmt @ Bs[0]
    err = relative_error(got, expected)
    t = bench_ms(lambda B: fmt @ B, Bs)
    row = dict(case=name, kind=kind, dtype=str(dtype)[6:], N=N, shape=list(csr.shape), nnz=csr._nnz(),
               cusparse_ms=t_csr, auto_ms=t, ratio=t_csr / t, err=err, cusparse_err=err_csr,
               ok=bool(err <= TOLERANCE[dtype]), chosen=repr(fmt), why=fmt.chosen_because or "", choose_s=choose_s)
    run.rows.append(row)
    run.say(json.dumps(row))


def ab(run: Run, name, csr, gen) -> list[dict]:
    """fp32 N=128: each strategy on the same matrix."""
    N = 128
    Bs = [torch.randn(csr.shape[1], N, device=csr.device, generator=gen) for _ in range(3)]
    expected = cast(csr, torch.float64) @ Bs[0].double()
    out = dict(case=name, nnz=csr._nnz(), cusparse_ms=bench_ms(lambda B: csr @ B, Bs))
    variants = [
        ("GroupCOO rule", lambda: GroupCOO.from_torch(csr)),
        ("GroupCOO g=1", lambda: GroupCOO.from_torch(csr, group_size=1)),
        ("GroupCOO g=8", lambda: GroupCOO.from_torch(csr, group_size=8)),
        ("CELL", lambda: CELL.from_torch(csr)),
    ]
    for label, make in variants:
        fmt = make()
        cls = type(fmt)
        for strategy in ("segment", "atomic"):
            saved = cls.sorted_indices
            if strategy == "atomic":
                cls.sorted_indices = frozenset()  # withhold the declaration: one atomic per group
            try:
                err = relative_error(fmt @ Bs[0], expected)
                out[f"{label} {strategy}"] = (bench_ms(lambda B, f=fmt: f @ B, Bs), err)
            finally:
                if strategy == "atomic":
                    cls.sorted_indices = saved
        if fmt.single_statement and fmt.sorted_indices:  # GroupCOO
            # Segments written by atomics only (the `+=` statement into zeros) against the
            # `=` statement above, which stores the segments that lie inside one tile.
            def accumulate(B, f=fmt):
                C = torch.zeros(f.shape[0], B.shape[1], device=B.device)
                return insum.insum(f.expression, sorted_indices=set(f.sorted_indices), C=C, B=B, **f.tensors)

            err = relative_error(accumulate(Bs[0]), expected)
            out[f"{label} segment atomics only"] = (bench_ms(accumulate, Bs), err)
    if padded_slots(ELL, csr) <= 1 << 26:
        fmt = ELL.from_torch(csr)
        out["ELL"] = (bench_ms(lambda B: fmt @ B, Bs), relative_error(fmt @ Bs[0], expected))
    run.say("AB " + json.dumps(out))
    return out


def host_overhead(run: Run) -> dict:
    A, fmt, tensors = host_case("cuda")
    csr, B, expr = A.to_sparse_csr(), tensors["B"], fmt.expression
    insum.insum(expr, **tensors)
    out = {}
    fmt @ B
    out["insum()"] = host_us_per_call(lambda: insum.insum(expr, **tensors), 3000)
    try:
        out["bare launch"] = host_us_per_call(bare_launcher(expr, tensors), 3000)
    except Exception as e:
        run.note(f"bare launch unavailable: {type(e).__name__}: {e}")
    out["fmt @ B"] = host_us_per_call(lambda: fmt @ B, 3000)
    out["CSR @ B"] = host_us_per_call(lambda: csr @ B, 3000)
    err = relative_error(fmt @ B, A.double() @ B.double())
    out["fmt @ B rel. error"] = err
    run.say("HOST " + json.dumps(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / ".data"))
    parser.add_argument("--budget", type=float, default=320.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--jobs", default=None,
                        help="only these auto-vs-cuSPARSE jobs, e.g. float16:128 (no A/B, no host rows)")
    args = parser.parse_args()
    run = Run(args)
    dev = torch.device("cuda")
    shorten_autotune(warmup=3, rep=10)
    gen = torch.Generator(device=dev).manual_seed(1)
    mats = matrices(Path(args.data), dev)
    loaded: dict = {}

    def get(name, load, dtype):
        if name not in loaded:
            loaded[name] = load().to(dev)
        base = loaded[name]
        return base if dtype == torch.float32 else cast(base, dtype)

    host = host_overhead(run)
    dlmc = [m for m in mats if m[1] == "dlmc"]
    others = [m for m in mats if m[1] != "dlmc"]
    sweep = others + dlmc[::6]
    jobs = [(torch.float32, 128, others + dlmc), (torch.float16, 128, others + dlmc[::2])]
    jobs += [(dt, n, sweep) for n in (32, 64, 256) for dt in (torch.float32, torch.float16)]
    ab_rows = []
    ab_set = others + dlmc[::12]

    def measure_jobs(jobs, reserve_s: float) -> None:
        """auto vs cuSPARSE for every (dtype, N, matrices) job, leaving reserve_s of the budget."""
        for dtype, N, todo in jobs:
            for name, kind, load in todo:
                if run.left() < reserve_s:
                    run.note(f"budget: skipped the rest of {dtype} N={N} from {name}")
                    break
                try:
                    measure_auto(run, name, kind, get(name, load, dtype), dtype, N, gen)
                except Exception as e:
                    run.note(f"{name} {dtype} N={N}: {type(e).__name__}: {str(e)[:200]}")

    if args.jobs:  # a re-measurement of some jobs alone
        wanted = {(getattr(torch, d), int(n)) for d, n in (job.split(":") for job in args.jobs.split(","))}
        measure_jobs([job for job in jobs if (job[0], job[1]) in wanted], 10)
        summary(run, host, [])
        return
    measure_jobs(jobs[:2], 110)
    for name, _kind, load in ab_set:
        if run.left() < 60:
            run.note(f"budget: skipped the rest of the A/B from {name}")
            break
        try:
            ab_rows.append(ab(run, name, get(name, load, torch.float32), gen))
        except Exception as e:
            run.note(f"A/B {name}: {type(e).__name__}: {str(e)[:200]}")
    measure_jobs(jobs[2:], 10)
    summary(run, host, ab_rows)


def summary(run: Run, host: dict, ab_rows: list[dict]) -> None:
    lines = [f"device: {torch.cuda.get_device_name()} torch {torch.__version__}", ""]
    lines.append("auto vs cuSPARSE (ratio = cuSPARSE time / auto time; checked rows only)")
    lines.append("dtype N   | set       | n   | geomean | min  (worst matrix) | failed checks")
    for dtype in ("float32", "float16"):
        for N in (32, 64, 128, 256):
            for label, kinds in (("all", ("dlmc", "graph", "power-law")), ("power-law", ("power-law",))):
                rows = [r for r in run.rows if r["dtype"] == dtype and r["N"] == N and r["kind"] in kinds]
                if not rows:
                    continue
                ok = [r for r in rows if r["ok"]]
                worst = min(ok, key=lambda r: r["ratio"]) if ok else None
                lines.append(
                    f"{dtype} {N:<3} | {label:<9} | {len(rows):<3} | {geomean(r['ratio'] for r in ok):6.2f}x | "
                    + (f"{worst['ratio']:.2f}x ({worst['case']})" if worst else "-")
                    + f" | {len(rows) - len(ok)}"
                )
    lines.append("")
    lines.append("graphs and power-law, each (fp32 / fp16, N=128): ratio, auto choice")
    for r in run.rows:
        if r["kind"] != "dlmc" and r["N"] == 128:
            lines.append(f"  {r['case']:<28} {r['dtype']} {r['ratio']:.2f}x  {r['auto_ms'] * 1e3:.1f}us vs "
                         f"{r['cusparse_ms'] * 1e3:.1f}us  {r['why'][6:90]}")
    chosen: dict = {}
    for r in run.rows:
        if r["N"] == 128 and r["dtype"] == "float32":
            key = r["chosen"].split("(")[0] + (" g=" + r["chosen"].split("group_size=")[1].split(",")[0] if "group_size" in r["chosen"] else "")
            chosen[key] = chosen.get(key, 0) + 1
    lines.append(f"fp32 N=128 choices: {chosen}")
    lines.append("")
    lines.append("A/B fp32 N=128 (speed-up over cuSPARSE; segment = sorted index declared, atomic = withheld)")
    if ab_rows:
        labels = [k for k in ab_rows[0] if k not in ("case", "nnz", "cusparse_ms")]
        lines.append("  " + " | ".join(labels))
        for label in labels:
            vals = [r["cusparse_ms"] / r[label][0] for r in ab_rows if label in r and r[label][1] <= 1e-3]
            lines.append(f"  {label:<22} geomean {geomean(vals):.2f}x over {len(vals)}")
        for r in ab_rows:
            if "/" not in r["case"]:
                lines.append(f"  {r['case']:<28} " + "  ".join(
                    f"{k.replace('GroupCOO ', 'G')}={r['cusparse_ms'] / v[0]:.2f}" for k, v in r.items()
                    if isinstance(v, tuple)))
    lines.append("")
    lines.append("host us per cached call: " + ", ".join(f"{k} {v:.3g}" for k, v in host.items()))
    if "bare launch" in host:
        lines.append(f"  over bare launch: insum() +{host['insum()'] - host['bare launch']:.1f} us, "
                     f"fmt @ B +{host['fmt @ B'] - host['bare launch']:.1f} us")
    lines += [f"NOTE {n}" for n in run.notes[-8:]]
    text = "\n".join(lines)
    run.say(text)
    (run.out / "unstructured_auto.json").write_text(json.dumps(dict(rows=run.rows, ab=ab_rows, host=host,
                                                                    notes=run.notes), default=str))
    print(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
