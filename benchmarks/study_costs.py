"""Costs: first-call compile + autotune time, host time per cached call, packing time.

- First call in a fresh process (`python -m benchmarks.study_costs --child`) with empty
  insum, Triton and inductor caches, then in a second process with those caches warm:
  insum's first `fmt @ B` (compile + autotune + run, default autotune settings) against
  the first call of `torch.compile` of the same statement's torch lowering.
- Host time per cached call (tiny GroupCOO SpMM, wall clock over many calls, one sync at
  the end): `insum()` against a bare launch of the same compiled Triton kernel (insum's
  kernel object, arguments prepared once), and `fmt @ B` against `torch` CSR @ B.
- Packing: each format from a CSR matrix against `to_sparse_csr()` of the same matrix
  (from dense where it fits, else from COO); BlockGroupCOO against `to_sparse_bsr`, N:M
  against `to_sparse_semi_structured`. Median of three wall-clock runs after a warm-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import insum
from insum.formats import CELL, COO, ELL, NM, BlockGroupCOO, GroupCOO, load_smtx, power_law_matrix

from .common import (
    bare_launcher,
    block_sparse,
    host_case,
    host_us_per_call,
    padded_slots,
    relative_error,
)
from .context import Context
from .lowering import lowered_spmm

ROOT = Path(__file__).resolve().parents[1]


def run(ctx: Context) -> list[dict]:
    # The child processes take most of the budget; the two short parts may overrun it a little.
    for part, slack in ((first_calls, 0.0), (host_overhead, 30.0), (packing, 30.0)):
        if ctx.over_budget(part.__name__.replace("_", " "), slack):
            continue
        try:
            part(ctx)
        except Exception as e:
            ctx.fail(dict(set=part.__name__.replace("_", " "), case="-", dtype="fp32"), e)
    return ctx.rows


# --------------------------------------------------------------------------- host overhead


def host_overhead(ctx: Context) -> None:
    A, fmt, tensors = host_case(ctx.device)
    csr, B, C, expr = A.to_sparse_csr(), tensors["B"], tensors["C"], fmt.expression
    expected = A.double() @ B.double()
    err = relative_error(insum.insum(expr, backend=ctx.backend, **tensors), expected)
    n = 2 if ctx.smoke else 2000
    t_insum = host_us_per_call(lambda: insum.insum(expr, backend=ctx.backend, **tensors), n, ctx.sync)
    base = dict(set="host time per cached call", dtype="fp32", err=err, calls=n, shapes="256x256, 5% dense, N=32")
    try:
        bare = bare_launcher(expr, tensors)
        C.zero_()
        bare()
        bare_err = relative_error(C, expected)
        t_bare = host_us_per_call(bare, n, ctx.sync)
        ctx.add(dict(base, case="insum() vs bare Triton launch", anchor="bare launch", insum_ms=t_insum / 1e3,
                     anchor_ms=t_bare / 1e3, anchor_err=bare_err, extra_us=t_insum - t_bare))
    except Exception as e:
        ctx.note(f"bare launch unavailable ({type(e).__name__}: {e}); insum() alone: {t_insum:.1f} us/call")
    t_fmt = host_us_per_call(lambda: fmt.spmm(B, backend=ctx.backend), n, ctx.sync)
    t_csr = host_us_per_call(lambda: csr @ B, n, ctx.sync)
    ctx.add(dict(base, case="fmt @ B vs torch CSR @ B", anchor="CSR @ B call", insum_ms=t_fmt / 1e3,
                 anchor_ms=t_csr / 1e3, err=relative_error(fmt.spmm(B, backend=ctx.backend), expected),
                 anchor_err=relative_error(csr @ B, expected)))


# --------------------------------------------------------------------------- packing


def wall_ms(ctx: Context, fn, reps: int = 3) -> float:
    """Median wall-clock ms of fn after one warm-up (packing synchronises with the host)."""
    fn()
    times = []
    for _ in range(reps):
        ctx.sync()
        start = time.perf_counter()
        fn()
        ctx.sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def packing_matrices(ctx: Context) -> list[tuple[str, object]]:
    if ctx.smoke:
        return [("power-law 256^2 avg 4", lambda: power_law_matrix(256, 256, 4, seed=0))]
    out = []
    files = sorted(ctx.data.glob("dlmc/*/magnitude_pruning/*/*.smtx.gz"), key=lambda p: p.stat().st_size)
    if files:
        path = files[-1]
        out.append((f"{path.parts[-4]}/{path.parts[-2]}/{path.name[:-8]}", lambda p=path: load_smtx(p)))
    graph = ctx.data / "graphs" / "pubmed.mtx.gz"
    if graph.exists() and not ctx.quick:
        from insum.formats import load_mtx

        out.append(("pubmed", lambda: load_mtx(graph)))
    rows = 65536 if ctx.quick else 262144
    out.append((f"power-law {rows}^2 avg 16", lambda: power_law_matrix(rows, rows, 16, seed=0, device=ctx.device)))
    return out


def packing(ctx: Context) -> None:
    dev = ctx.device
    reps = 1 if ctx.smoke else 3
    for name, load in packing_matrices(ctx):
        if ctx.over_budget("packing matrices", slack=30.0):
            continue
        csr = load().to(dev)
        fits = csr.shape[0] * csr.shape[1] <= (1 << 28)
        dense = csr.to_dense() if fits else None
        source = dense if fits else csr.to_sparse_coo()
        anchor = "to_sparse_csr (from dense)" if fits else "to_sparse_csr (from COO)"
        t_anchor = wall_ms(ctx, lambda s=source: s.to_sparse_csr(), reps)
        probe = torch.randn(csr.shape[1], 8, device=dev)
        expected = csr.to(torch.float64) @ probe.double()
        for fmt_cls in (COO, GroupCOO, ELL, CELL):
            if padded_slots(fmt_cls, csr) > (1 << 26):  # ELL on a power-law graph
                continue
            t = wall_ms(ctx, lambda c=csr, f=fmt_cls: f.from_torch(c), reps)
            fmt = fmt_cls.from_torch(csr)
            err = relative_error(fmt.to_dense(), dense) if fits else relative_error(fmt.spmm(probe, backend=ctx.backend), expected)
            ctx.add(dict(set="packing from CSR", case=f"{fmt_cls.__name__}: {name}", dtype="fp32", anchor=anchor,
                         anchor_ms=t_anchor, insum_ms=t, err=err, nnz=csr._nnz(), tol=1e-6 if fits else 1e-3))
        del dense, source
    if ctx.over_budget("packing (structured)", slack=30.0):
        return
    size = 64 if ctx.smoke else 4096
    block = 16 if ctx.smoke else 32
    gen = torch.Generator(device=dev).manual_seed(8)

    A, _ = block_sparse(size, block, 0.9, torch.float16, gen, dev)
    t_bsr = wall_ms(ctx, lambda: A.to_sparse_bsr((block, block)), reps)
    t = wall_ms(ctx, lambda: BlockGroupCOO.from_dense(A, block=(block, block)), reps)
    err = relative_error(BlockGroupCOO.from_dense(A, block=(block, block)).to_dense(), A)
    ctx.add(dict(set="packing from dense", case=f"BlockGroupCOO {size}^2 fp16 s=0.9 b{block}", dtype="fp16",
                 anchor="to_sparse_bsr", anchor_ms=t_bsr, insum_ms=t, err=err, tol=1e-6))
    W = torch.randn(size, size, device=dev, generator=gen).half()
    L = 16 if ctx.smoke else 64
    fmt = NM.from_dense(W, n=2, m=4, vector_len=L)
    pruned = fmt.to_dense()
    kept = float((pruned != 0).float().mean())
    err = relative_error(pruned, W * (pruned != 0)) if abs(kept - 0.5) < 1e-3 else float("nan")
    t = wall_ms(ctx, lambda: NM.from_dense(W, n=2, m=4, vector_len=L), reps)
    try:
        if not ctx.cuda:
            raise RuntimeError("needs CUDA")
        from torch.sparse import to_sparse_semi_structured

        t_lt, anchor = wall_ms(ctx, lambda: to_sparse_semi_structured(pruned), reps), "to_sparse_semi_structured"
    except Exception as e:
        ctx.note(f"to_sparse_semi_structured unavailable ({type(e).__name__}: {e}); N:M packing anchored on to_sparse_csr")
        t_lt, anchor = wall_ms(ctx, lambda: pruned.to_sparse_csr(), reps), "to_sparse_csr (from dense)"
    ctx.add(dict(set="packing from dense", case=f"N:M 2:4 L={L} {size}^2 fp16", dtype="fp16", anchor=anchor,
                 anchor_ms=t_lt, insum_ms=t, err=err, tol=1e-6))


# --------------------------------------------------------------------------- first calls


def first_calls(ctx: Context) -> None:
    """Two child processes over the same fresh cache folders: cold, then warm."""
    folder = Path(tempfile.mkdtemp(prefix="insum-costs-"))
    env = dict(os.environ)
    env.update(INSUM_CACHE_DIR=str(folder / "insum"), TRITON_CACHE_DIR=str(folder / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"), INSUM_AUTOTUNE="1", PYTHONUNBUFFERED="1")
    if not ctx.cuda:
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "benchmarks.study_costs", "--child"] + (["--smoke"] if ctx.smoke else [])
    labels = ("cold process",) if ctx.smoke else ("cold process", "warm disk cache")
    for label in labels:
        # The cold child gets most of the budget, the warm one what is left, each a floor;
        # about 30 s stay for the host-overhead and packing parts.
        reserve = 30.0 + (40.0 if label == "cold process" else 0.0)
        timeout = max(90.0 if label == "cold process" else 45.0, ctx.time_left() - reserve)
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            ctx.note(f"first call, {label}: the child process exceeded {timeout:.0f} s")
            return
        wall = time.perf_counter() - start
        found = [line for line in done.stdout.splitlines() if line.startswith("COSTS_JSON ")]
        if done.returncode != 0 or not found:
            ctx.note(f"first call, {label}: child failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
            return
        result = json.loads(found[-1][len("COSTS_JSON "):])
        for case in result["cases"]:
            ctx.add(dict(
                set=f"first call, {label}", case=case["name"], dtype=case["dtype"], anchor=f"torch.compile ({label})",
                insum_ms=case["first_ms"], anchor_ms=case.get("compile_first_ms"), err=case["err"],
                anchor_err=case.get("compile_err"), steady_ms=case["second_ms"],
                compile_steady_ms=case.get("compile_second_ms"), process_s=round(wall, 2),
            ))


def child_cases(smoke: bool, device) -> list[dict]:
    """The statements whose first call is timed: a reduce plan and a tl.dot plan."""
    gen = torch.Generator(device=device).manual_seed(9)
    rows = 256 if smoke else 65536
    csr = power_law_matrix(rows, rows, 4 if smoke else 16, seed=0, device=device)
    B = torch.randn(rows, 16 if smoke else 128, device=device, generator=gen)
    cases = [dict(name=f"GroupCOO SpMM fp32 ({rows}^2, {csr._nnz()} nnz, N={B.shape[1]})", dtype="fp32",
                  fmt=GroupCOO.from_torch(csr), B=B, expected=csr.to(torch.float64) @ B.double())]

    size, block = (64, 16) if smoke else (4096, 32)
    A, _ = block_sparse(size, block, 0.9, torch.float16, gen, device)
    B = torch.randn(size, size, device=device, generator=gen).half()
    cases.append(dict(name=f"BlockGroupCOO SpMM fp16 ({size}^3, {block}x{block}, s=0.9)", dtype="fp16",
                      fmt=BlockGroupCOO.from_dense(A, block=(block, block)), B=B, expected=A.double() @ B.double()))
    return cases


def child(smoke: bool) -> None:
    """One process: time the first and second call of each case, print one JSON line."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "auto" if device.type == "cuda" else "triton"

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    torch.zeros(1, device=device).sum().item()  # the CUDA context is not the compiler's cost
    out = []
    for case in child_cases(smoke, device):
        fmt, B = case.pop("fmt"), case.pop("B")
        expected = case.pop("expected")
        timings = {}
        runs = [("", lambda f=fmt, b=B: f.spmm(b, backend=backend))]
        if not smoke:  # torch.compile of the lowering: the anchor (too slow for the smoke run)
            lowered = lowered_spmm(fmt, B.dtype, compiled=True, dynamic=False)
            runs.append(("compile_", lambda f=lowered, b=B: f(b)))
        for key, fn in runs:
            sync()
            start = time.perf_counter()
            got = fn()
            sync()
            timings[f"{key}first_ms"] = (time.perf_counter() - start) * 1e3
            timings[f"{key}err"] = relative_error(got, expected)
            start = time.perf_counter()
            fn()
            sync()
            timings[f"{key}second_ms"] = (time.perf_counter() - start) * 1e3
        out.append(dict(case, **timings))
    print("COSTS_JSON " + json.dumps({"cases": out}), flush=True)


if __name__ == "__main__":
    if "--child" in sys.argv:
        child("--smoke" in sys.argv)
    else:
        raise SystemExit("run with: python -m benchmarks --studies costs")
