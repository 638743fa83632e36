"""Schedule choices (issue 11, item 5): single ownership and ranked plans, A/B on one GPU.

    python -m benchmarks.explore.schedule [--smoke] [--out DIR]

Each section runs two kernels of this branch on the same inputs, in one process, checked
against a float64 torch lowering (relative error <= 1e-2 in fp16, 1e-4 in fp32), timed with
do_bench medians (the launch as `insum()` makes it: zero fill and float32 scratch included):

  owned     a scatter through an index declared unique: `atomic` (no declaration: one
            tl.atomic_add per element, a float32 scratch buffer for fp16 outputs without
            native atomics) against `store` (unique_indices: plain stores, no scratch).
            CELL's statement for one width, and e3nn's layout `Z[b, ZI[w, k]]`.
  ranked    the conventional tiling (innermost output variable on N, ...) against the
            cost model's choice: `T[b, u, r]` (used to leave the batch on the grid) and the
            nested-index e3nn statement (used to reduce over the padded CG entries on K),
            and `O[b, q, n] = X[b, q, k] * W[k, n]` with 48 x 16 short rows (ranked:
            M = (b, q) stacked, 128-row fp16 tiles; conventional: M = n, N = q, grid b).

  lengths   ELL's statement on a power-law matrix with every row padded to the longest:
            `padded` (no declaration: every slot loaded) against `lengths` (`lengths={"q[m]":
            row counts}`: each tile's loop stops at its longest row, lanes past a row's own
            length masked).

What to look for: `store` at or below `atomic` everywhere (it removes work); `ranked` below
`conventional` for both statements (the model's claim: at least 1/KEEP = 1.25x). A row
where the ranked plan is slower means a cost-model weight is wrong: report the row.
`lengths` far below `padded` (the K steps it removes: `--padding` counts them on the CPU).
--smoke runs every variant once on tiny sizes (CPU interpreter included) without timing.
--padding only counts, on the host, the K steps and loaded slots a declared length removes
from ELL on 65536-row power-law matrices (no kernel runs).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

if not torch.cuda.is_available():  # the smoke run: the interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from insum.bind import bind  # noqa: E402
from insum.codegen.schedule import plan_of, rank  # noqa: E402
from insum.execute import length_facts  # noqa: E402
from insum.formats import power_law_matrix  # noqa: E402
from insum.parser import parse  # noqa: E402
from insum.reference import run_reference  # noqa: E402
from insum.runtime import Kernel, spec_for  # noqa: E402

from ..common import median_ms, relative_error  # noqa: E402

ROWS: list[dict] = []


def _kernel(stmt: str, tensors: dict, candidate=None, lengths=None, **facts):
    bound = bind(parse(stmt), tensors)
    if lengths is not None:
        bound, facts["lengths"] = length_facts(bound, {"q[m]": lengths})
    spec = spec_for(bound, "tf32", **facts)
    plan = plan_of(spec, candidate(rank(spec))) if candidate else None
    return Kernel(spec, plan), bound


def _conventional(candidates):
    return next(c for c in candidates if c.conventional)


def _run(section: str, label: str, stmt: str, tensors: dict, smoke: bool, candidate=None, **facts) -> None:
    kernel, bound = _kernel(stmt, tensors, candidate, **facts)
    facts.pop("lengths", None)
    out_name = bound.output_name
    expected_bound = bind(parse(stmt), {k: (v.double() if v.is_floating_point() else v) for k, v in tensors.items()})
    expected = run_reference(expected_bound, expected_bound.output().zero_())
    out = torch.zeros_like(tensors[out_name])  # fresh per variant: `+=` accumulates over the timing runs

    def call():
        return kernel.launch(bound, out)

    err = relative_error(call(), expected)
    tolerance = 1e-2 if out.dtype != torch.float32 else 1e-4
    plan = kernel.plan
    row = dict(section=section, label=label, stmt=stmt, dtype=str(out.dtype), error=err, output=plan.output,
               tiles=dict(plan.tiles), grid=plan.grid, loops=plan.loops)
    if not err <= tolerance:
        row["failed"] = True
    elif not smoke:
        row["ms"] = median_ms(call)
    ROWS.append(row)
    print(f"{section:7s} {label:13s} {row['dtype']:14s} err {err:.1e}  {row.get('ms', float('nan')):8.4f} ms  "
          f"{plan.output:6s} { {a: plan.axis_vars(a) for a, _ in plan.tiles} } grid {plan.grid} loops {plan.loops}"
          + ("  FAILED" if row.get("failed") else ""), flush=True)


def _cell(rows: int, width: int, n: int, dtype, device, gen) -> dict:
    RI = torch.randperm(rows * 2, generator=gen)[:rows].sort().values.int()
    return {
        "C": torch.zeros(rows * 2, n, dtype=dtype),
        "RI": RI,
        "V": torch.randn(rows, width, generator=gen).to(dtype),
        "CI": torch.randint(0, rows * 2, (rows, width), generator=gen).int(),
        "B": torch.randn(rows * 2, n, generator=gen).to(dtype),
    } | {"_device": device}


def _nested(b: int, mul: int, dim: int, q: int, dtype, device, gen) -> dict:
    return {
        "Z": torch.zeros(b, mul * dim, dtype=dtype),
        "ZI": torch.randperm(mul * dim, generator=gen).reshape(mul, dim).int(),
        "CV": torch.randn(dim, q, generator=gen).to(dtype),
        "CI": torch.randint(0, 5, (dim, q), generator=gen).int(),
        "XI": torch.randint(0, mul * 5, (mul, 5), generator=gen).int(),
        "X": torch.randn(b, mul * 5, generator=gen).to(dtype),
        "W": torch.randn(mul, mul, generator=gen).to(dtype) / mul**0.5,
    } | {"_device": device}


def _cg(b: int, u: int, r: int, q: int, dtype, device, gen) -> dict:
    return {
        "T": torch.zeros(b, u, r, dtype=dtype),
        "CGV": torch.randn(r, q, generator=gen).to(dtype),
        "CGI": torch.randint(0, 5, (r, q), generator=gen).int(),
        "CGJ": torch.randint(0, 3, (r, q), generator=gen).int(),
        "X": torch.randn(b, u, 5, generator=gen).to(dtype),
        "Y": torch.randn(b, 3, generator=gen).to(dtype),
    } | {"_device": device}


def _ell(rows: int, avg: float, alpha: float, n: int, dtype, device) -> tuple[dict, torch.Tensor]:
    """ELL tensors of a power-law matrix (rows padded to the longest) and its row lengths."""
    A = power_law_matrix(rows, rows, avg, alpha=alpha, seed=1)
    counts = (A.crow_indices()[1:] - A.crow_indices()[:-1]).long()
    width = max(int(counts.max()), 1)
    AV = torch.zeros(rows, width)
    AK = torch.zeros(rows, width, dtype=torch.int32)
    slot = torch.arange(width)[None, :] < counts[:, None]
    AV[slot] = A.values().float()
    AK[slot] = A.col_indices().int()
    gen = torch.Generator().manual_seed(2)
    tensors = {"C": torch.zeros(rows, n, dtype=dtype), "AV": AV.to(dtype), "AK": AK,
               "B": torch.randn(rows, n, generator=gen).to(dtype)}
    return {k: v.to(device) for k, v in tensors.items()}, counts.int().to(device)


def padding_counts() -> None:
    """K steps and loaded (row, slot) lanes of ELL's reduce plan with and without lengths."""
    for alpha in (0.5, 1.0):
        A = power_law_matrix(65536, 65536, 16, alpha=alpha, seed=0)
        counts = (A.crow_indices()[1:] - A.crow_indices()[:-1]).long()
        width, rows = int(counts.max()), counts.numel()
        for block_m, block_k in ((16, 8), (64, 8)):
            longest = counts[: rows // block_m * block_m].view(-1, block_m).max(1).values
            before = (rows // block_m) * -(-width // block_k)
            after = int(((longest + block_k - 1) // block_k).sum())
            print(f"alpha {alpha}: W={width}, BLOCK_M={block_m}, BLOCK_K={block_k}: K steps {before} -> {after} "
                  f"({after / before:.2%}); (row, slot) lanes loaded {rows * width} -> {int(counts.sum())}")


def _on(tensors: dict) -> dict:
    device = tensors.pop("_device")
    return {k: v.to(device) for k, v in tensors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no timing (runs in the interpreter)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--padding", action="store_true", help="count what declared lengths remove; no kernels")
    args = parser.parse_args()
    if args.padding:
        padding_counts()
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    small = args.smoke
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.float16]

    cell = "C[RI[r], n] += V[r, w] * B[CI[r, w], n]"
    nested = "Z[b, ZI[w, k]] = CV[k, q] * X[b, XI[u, CI[k, q]]] * W[u, w]"
    for dtype in dtypes:
        t = _on(_cell(40, 4, 8, dtype, device, gen) if small else _cell(200_000, 8, 128, dtype, device, gen))
        _run("owned", "atomic", cell, t, small)
        _run("owned", "store", cell, t, small, unique_indices=frozenset({"RI"}))
        t = _on(_nested(6, 4, 3, 2, dtype, device, gen) if small else _nested(8192, 64, 9, 4, dtype, device, gen))
        _run("owned", "atomic", nested, t, small)
        _run("owned", "store", nested, t, small, unique_indices=frozenset({"ZI"}))

    # The ranked sections force the chosen and the conventional plans, whatever the sizes.
    cg = "T[b, u, r] = CGV[r, q] * X[b, u, CGI[r, q]] * Y[b, CGJ[r, q]]"
    for dtype in dtypes:
        t = _on(_cg(10, 6, 5, 3, dtype, device, gen) if small else _cg(16384, 32, 9, 4, dtype, device, gen))
        _run("ranked", "conventional", cg, t, small, candidate=_conventional)
        _run("ranked", "ranked", cg, t, small, candidate=lambda cs: cs[0])
        t = _on(_nested(6, 4, 3, 2, dtype, device, gen) if small else _nested(8192, 64, 9, 4, dtype, device, gen))
        unique = frozenset({"ZI"})
        _run("ranked", "conventional", nested, t, small, candidate=_conventional, unique_indices=unique)
        _run("ranked", "ranked", nested, t, small, candidate=lambda cs: cs[0], unique_indices=unique)

    stack = "O[b, q, n] = X[b, q, k] * W[k, n]"
    for dtype in dtypes:
        shape = (5, 6, 7, 9) if small else (48, 16, 512, 4096)
        t = {"X": torch.randn(shape[:3], generator=gen).to(dtype), "W": torch.randn(shape[2:], generator=gen).to(dtype),
             "O": torch.zeros(shape[0], shape[1], shape[3], dtype=dtype)}
        t = {k: v.to(device) for k, v in t.items()}
        _run("ranked", "conventional", stack, t, small, candidate=_conventional)
        _run("ranked", "ranked", stack, t, small, candidate=lambda cs: cs[0])

    ell = "C[m, n] += AV[m, q] * B[AK[m, q], n]"
    for dtype in dtypes:
        t, counts = _ell(300, 4, 0.5, 8, dtype, device) if small else _ell(16384, 16, 0.5, 128, dtype, device)
        _run("lengths", "padded", ell, t, small)
        _run("lengths", "lengths", ell, t, small, lengths=counts)

    if args.out:
        with open(args.out, "w") as f:
            json.dump(ROWS, f, indent=1, default=str)
    failed = [r for r in ROWS if r.get("failed")]
    if failed:
        raise SystemExit(f"{len(failed)} variants disagree with the float64 lowering")


if __name__ == "__main__":
    main()
