"""Unstructured SpMM: GroupCOO, ELL and CELL `fmt @ B` against cuSPARSE (torch CSR @ dense)
and the torch reference lowering of the same statement, eager and under torch.compile.

Matrices: a spread of DLMC pruned weights, the citation graphs, and generated power-law
graphs up to about 10M nonzeros. fp32 and fp16, N in {32, 64, 128, 256}. Configurations
run in priority order (the fp32 N=128 target set first) until the budget is spent:

  1. fp32, N=128, GroupCOO        vs cuSPARSE, lowering eager, lowering compiled
  2. fp32, N=128, ELL and CELL    vs cuSPARSE, lowering eager
  3. fp16, N=128, every format    vs cuSPARSE
  4. GroupCOO, N = 32, 64, 256, fp32 and fp16, vs cuSPARSE (a subset of the matrices)
  5. ELL and CELL likewise
  6. the remaining lowering anchors (compiled for ELL and CELL, eager in fp16)

Every result is checked against the float64 product of the same (rounded) matrix.
"""

from __future__ import annotations

import torch

from insum.formats import CELL, ELL, GroupCOO, load_mtx, load_smtx, power_law_matrix

from .common import dtype_name, padded_slots, relative_error, rotations_for
from .context import Context
from .lowering import lowered_spmm

FORMATS = {"GroupCOO": GroupCOO, "ELL": ELL, "CELL": CELL}
#: A format that pads rows toward the longest (ELL) is skipped above this many slots.
MAX_SLOTS = 1 << 26


def matrix_list(ctx: Context) -> list[tuple[str, str, object]]:
    """(name, kind, loader) in measuring order; loaders return a float32 CSR on the device."""
    out = []
    files = sorted(ctx.data.glob("dlmc/*/magnitude_pruning/*/*.smtx.gz"))
    if ctx.smoke:
        files = sorted(files, key=lambda p: p.stat().st_size)[:1]
    else:
        limit = 6 if ctx.quick else 12
        step = max(1, len(files) // limit)
        files = files[::step][:limit]
    for path in files:
        name = f"{path.parts[-4]}/{path.parts[-2]}/{path.name[:-8]}"
        out.append((name, "dlmc", lambda p=path: load_smtx(p)))
    graphs = [] if ctx.smoke else ["cora", "pubmed"] if ctx.quick else ["cora", "citeseer", "pubmed"]
    for g in graphs:
        path = ctx.data / "graphs" / f"{g}.mtx.gz"
        if path.exists():
            out.append((g, "graph", lambda p=path: load_mtx(p)))
    if not files or not (ctx.data / "graphs").exists() and not ctx.smoke:
        ctx.note(f"data folder {ctx.data} lacks dlmc/ or graphs/: only generated matrices")
    sizes = [(256, 4)] if ctx.smoke else [(65536, 16), (1 << 20, 10)] if ctx.quick else [(65536, 16), (262144, 16), (1 << 20, 10)]
    for rows, avg in sizes:
        name = f"power-law {rows}^2 avg {avg}"
        out.append((name, "power-law", lambda r=rows, a=avg: power_law_matrix(r, r, a, seed=0, device=ctx.device)))
    return out


def plan(ctx: Context) -> list[tuple]:
    """(tier, dtype, N, formats, anchors, every matrix or the sweep subset) in priority order."""
    if ctx.smoke:
        return [
            (1, torch.float32, 32, ("GroupCOO",), ("cuSPARSE", "torch eager"), True),
            (2, torch.float32, 32, ("ELL", "CELL"), ("cuSPARSE",), True),
            (3, torch.float16, 32, ("GroupCOO",), ("cuSPARSE", "torch eager"), True),
        ]
    jobs = [
        (1, torch.float32, 128, ("GroupCOO",), ("cuSPARSE", "torch eager", "torch.compile"), True),
        (2, torch.float32, 128, ("ELL", "CELL"), ("cuSPARSE", "torch eager"), True),
        (3, torch.float16, 128, tuple(FORMATS), ("cuSPARSE",), True),
    ]
    other_n = (32, 256) if ctx.quick else (32, 64, 256)
    for tier, fmts in ((4, ("GroupCOO",)), (5, ("CELL", "ELL"))):
        for dtype in (torch.float32, torch.float16):
            jobs += [(tier, dtype, n, fmts, ("cuSPARSE",), False) for n in other_n]
    jobs.append((6, torch.float32, 128, ("ELL", "CELL"), ("torch.compile",), True))
    jobs.append((6, torch.float16, 128, tuple(FORMATS), ("torch eager",), False))
    return jobs


def sweep_subset(names: list[str]) -> list[str]:
    """The matrices of the N and dtype sweeps: every third DLMC matrix, the largest graph,
    the two largest generated ones."""
    dlmc = [n for n in names if "/" in n][::3]
    graphs = [n for n in names if "/" not in n and not n.startswith("power-law")][-1:]
    generated = [n for n in names if n.startswith("power-law")][-2:]
    return dlmc + graphs + generated


class Matrices:
    """Loaded matrices, their casts, packed formats and references, built on first use."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.loaders = {name: (kind, load) for name, kind, load in matrix_list(ctx)}
        self.csr: dict = {}
        self.packed: dict = {}

    def names(self) -> list[str]:
        return list(self.loaders)

    def get(self, name: str, dtype: torch.dtype):
        key = (name, dtype)
        if key not in self.csr:
            if (name, torch.float32) not in self.csr:
                self.csr[(name, torch.float32)] = self.loaders[name][1]().to(self.ctx.device)
            base = self.csr[(name, torch.float32)]
            self.csr[key] = base if dtype == torch.float32 else _cast(base, dtype)
        return self.csr[key]

    def pack(self, name: str, dtype: torch.dtype, fmt: str):
        key = (name, dtype, fmt)
        if key not in self.packed:
            csr = self.get(name, dtype)
            slots = padded_slots(FORMATS[fmt], csr)
            if slots > MAX_SLOTS:
                self.packed[key] = f"{fmt} skipped: rows padded to {slots} slots > {MAX_SLOTS}"
                return self.packed[key]
            self.packed[key] = FORMATS[fmt].from_torch(csr)
        return self.packed[key]


def _cast(csr: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.sparse_csr_tensor(
        csr.crow_indices(), csr.col_indices(), csr.values().to(dtype), csr.shape, check_invariants=False
    )


def traffic(csr: torch.Tensor, N: int, dtype: torch.dtype) -> tuple[float, float]:
    """Fewest bytes (A once, each used row of B once, C once) and flops of A @ B."""
    size = torch.tensor([], dtype=dtype).element_size()
    nnz = csr._nnz()
    cols_used = int(torch.unique(csr.col_indices()).numel())
    moved = nnz * (4 + size) + (csr.shape[0] + 1) * 4 + cols_used * N * size + csr.shape[0] * N * size
    return moved, 2.0 * nnz * N


def run(ctx: Context) -> list[dict]:
    mats = Matrices(ctx)
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    cusparse: dict = {}  # (matrix, dtype, N) -> (ms, err) or the reason it is unavailable
    everything = mats.names()
    subset = sweep_subset(everything)
    for tier, dtype, N, formats, anchors, every in plan(ctx):
        for name in list(everything if every else subset):
            if name not in mats.loaders:
                continue
            if ctx.over_budget(f"tier {tier} ({dtype_name(dtype)} N={N} {'/'.join(formats)})"):
                continue
            try:
                csr = mats.get(name, dtype)
            except Exception as e:  # an unreadable file: say so and go on
                ctx.note(f"{name}: cannot load ({type(e).__name__}: {e})")
                mats.loaders.pop(name)
                continue
            K = csr.shape[1]
            r = rotations_for(K * N * csr.values().element_size())
            Bs = [torch.randn(K, N, device=ctx.device, generator=gen).to(dtype) for _ in range(r)]
            expected = csr.to(torch.float64) @ Bs[0].double()  # float64 product of the same values
            entry = {"Bs": Bs, "expected": expected, "cusparse": cusparse, "key": (name, dtype, N)}
            for fmt_name in formats:
                fmt = mats.pack(name, dtype, fmt_name)
                if isinstance(fmt, str):
                    if fmt not in ctx.notes:
                        ctx.note(f"{name}: {fmt}")
                    continue
                try:
                    measure(ctx, name, mats.loaders[name][0], csr, fmt, fmt_name, dtype, N, anchors, entry)
                except Exception as e:
                    ctx.fail(dict(set=f"{fmt_name} {dtype_name(dtype)} N={N} vs {anchors[0]}", case=name,
                                  format=fmt_name, dtype=dtype_name(dtype), N=N), e)
    return ctx.rows


def measure(ctx, name, kind, csr, fmt, fmt_name, dtype, N, anchors, entry) -> None:
    """One format on one matrix: check, time, and one row per anchor."""
    Bs, expected = entry["Bs"], entry["expected"]
    got = fmt.spmm(Bs[0], backend=ctx.backend)
    err = relative_error(got, expected)
    t_insum = ctx.bench(lambda B: fmt.spmm(B, backend=ctx.backend), [(B,) for B in Bs])
    moved, flops = traffic(csr, N, dtype)
    base = dict(
        case=name, kind=kind, format=fmt_name, dtype=dtype_name(dtype), N=N,
        shape=list(csr.shape), nnz=csr._nnz(), insum_ms=t_insum, err=err, bytes=moved, flops=flops,
        padding=round(fmt.padding_ratio, 4),
        params={k: v for k, v in fmt.params.items() if k not in ("buckets", "tuned_seconds")},
    )
    for anchor in anchors:
        try:
            t_anchor, anchor_err = anchor_time(ctx, anchor, csr, fmt, dtype, entry)
        except Exception as e:  # an anchor missing here (fp16 cuSPARSE, a compile failure)
            reason = f"{anchor} {dtype_name(dtype)}: unavailable ({type(e).__name__}: {str(e)[:160]})"
            if reason not in ctx.notes:
                ctx.note(reason)
            continue
        ctx.add(dict(base, set=f"{fmt_name} {dtype_name(dtype)} N={N} vs {anchor}", anchor=anchor,
                     anchor_ms=t_anchor, anchor_err=anchor_err))


def anchor_time(ctx, anchor, csr, fmt, dtype, entry) -> tuple[float, float]:
    """(median ms, relative error) of one anchor on the entry's inputs."""
    Bs, expected = entry["Bs"], entry["expected"]
    inputs = [(B,) for B in Bs]
    if anchor == "cuSPARSE":
        known = entry["cusparse"]
        if entry["key"] not in known:
            try:
                err = relative_error(csr @ Bs[0], expected)
                known[entry["key"]] = (ctx.bench(lambda B: csr @ B, inputs), err)
            except Exception as e:
                known[entry["key"]] = e
        if isinstance(known[entry["key"]], Exception):
            raise known[entry["key"]]
        return known[entry["key"]]
    fn = lowered_spmm(fmt, dtype, compiled=anchor == "torch.compile", dynamic=True)
    err = relative_error(fn(Bs[0]), expected)
    return ctx.bench(fn, inputs), err
