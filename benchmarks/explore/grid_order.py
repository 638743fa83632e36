"""Program order of a block product: block rows outermost, or in the rows of grouped order.

    python -m benchmarks.explore.grid_order [--out DIR] [--budget 420] [--sizes 4096,8192]

Why: Block-ELL's `C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]` reads B through AK, so
every block row reads ~(1 - s) of B's block rows. With p outermost (grouping only the M and
N tiles of one block row), a wave of programs covers a few block rows, each streaming its
own slabs of B over all N tiles; at 8192^3 with 32 x 32 blocks at s = 0.9 that is ~3.4 GB
from HBM for a 128 MB B, about the measured time at 4.8 TB/s. `Plan.grid_joins` puts p
inside the grouped order instead (in the rows where M is the block's rows, in the columns
where the narrow-block orientation makes M the dense columns): a wave covers many block
rows for a few tiles of B.

For each point this compiles the generated kernel with p outside and with p inside, under
the tile configuration the tuner chose (with p inside and `tune.group_rows`' group), and
times one bare launch each (rotating two B operands) for several GROUP_M, checked against a
float64 product, beside cuBLAS and TorchBSR in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from insum.bind import bind
from insum.codegen.schedule import plan_of, rank
from insum.execute import length_facts
from insum.formats import NM, BlockGroupCOO
from insum.parser import parse
from insum.runtime import BareLaunch, Kernel, kernel_for

from ..common import median_ms, relative_error, rotating
from .tensorcore import block_problem, write_rows

POINTS = [(32, 0.9), (64, 0.9), (128, 0.9), (32, 0.75), (64, 0.5), (128, 0.5), (32, 0.5)]
GROUPS = (1, 4, 16, 64, 256)


def say(line: str) -> None:
    print(line, flush=True)


def run_point(size: int, block: int, s: float, rows: list) -> None:
    from torch.sparse._triton_ops import bsr_dense_mm

    Bs, t_cublas, A, _, expected = block_problem(size, block, s)
    fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row")
    bsr = A.to_sparse_bsr((block, block))
    t_bsr = median_ms(rotating(lambda B: bsr_dense_mm(bsr, B), [(B,) for B in Bs]))
    compare(f"{size}^3 b{block} s={s}", fmt, Bs, expected, t_cublas, {"TorchBSR": t_bsr}, rows, 1 / (1 - s))


def run_nm(size: int, n: int, m: int, vector_len: int, rows: list) -> None:
    Bs, t_cublas, A, _, _ = block_problem(size, 128, 0.0)
    fmt = NM.from_dense(A, n=n, m=m, vector_len=vector_len)
    expected = fmt.to_dense().double() @ Bs[0].double()
    compare(f"{size}^3 N:M {n}:{m} L={vector_len}", fmt, Bs, expected, t_cublas, {}, rows, m / n)


def product_binding(fmt, Bs: list) -> tuple:
    """(C, B's operand views, the bound `=` statement, its declared lengths) of a
    single-statement format's product with each B of `Bs`."""
    (expr, tensors), = fmt.statements()
    C = torch.empty(fmt.output_shape(Bs[0].shape[1]), device="cuda", dtype=Bs[0].dtype)
    operands = [fmt.operand(B) for B in Bs]
    bound = bind(parse(expr.replace("+=", "=")), {**tensors, "B": operands[0], "C": C})
    declared = ()
    if fmt.declared_lengths():
        bound, declared = length_facts(bound, fmt.declared_lengths())
    return C, operands, bound, declared


def compare(point: str, fmt, Bs, expected, t_cublas: float, anchors: dict, rows: list, ideal: float) -> None:
    """The product's kernel with the grid outside and inside the grouped order, one bare
    launch each under the tuner's tiles, beside cuBLAS and the anchors (ms)."""
    say(f"{point}: cuBLAS {t_cublas * 1e3:.1f} us" + "".join(f", {k} {v * 1e3:.1f} us" for k, v in anchors.items()))
    C, operands, bound, declared = product_binding(fmt, Bs)
    tuned = kernel_for(bound, lengths=declared)
    tuned.launch(bound, C)
    config = dict(tuned.prepared(bound).config)
    joins = tuned.plan.grid_joins
    say(f"  plan {tuned.plan.tiles}, grid joins {joins!r}, tuner's config {config}")
    variants = [("p outside", "", 8), (f"p in {joins}, group_rows", joins, config["GROUP_M"])]
    variants += [(f"p in {joins}, GROUP_M={g}", joins, g) for g in GROUPS if joins and g != config["GROUP_M"]]
    runs = [(label, Kernel(tuned.spec, plan=dataclasses.replace(tuned.plan, grid_joins=joined)), {**config, "GROUP_M": group})
            for label, joined, group in variants]
    flipped = _flipped(tuned)
    if flipped is not None:  # the other orientation, tuned as a user's first call would
        flipped.launch(bound, C)
        flipped_config = dict(flipped.prepared(bound).config)
        say(f"  flipped plan {flipped.plan.tiles}, grid joins {flipped.plan.grid_joins!r}, tuner's config {flipped_config}")
        runs.append((f"flipped, p in {flipped.plan.grid_joins}", flipped, flipped_config))
    for label, kernel, chosen in runs:
        prepared = kernel.prepared(bound)
        prepared.set_config(chosen)
        launches = [BareLaunch(kernel.fn, prepared.grid, chosen,
                               tuple(prepared.args(bound.with_tensors({**bound.tensors, "B": B}).tensors, C)))
                    for B in operands]
        C.fill_(float("nan"))
        launches[0]()
        err = relative_error(fmt.result(C), expected)
        ms = median_ms(rotating(lambda f: f(), [(f,) for f in launches]))
        ok = err <= 1e-2
        rows.append(dict(point=point, label=label, config=chosen, ms=ms, err=err, ok=ok, vs_cublas=t_cublas / ms,
                         ideal=ideal, **{f"vs_{k}": v / ms for k, v in anchors.items()}))
        say(f"  {label:30s} {ms * 1e3:8.1f} us  x{t_cublas / ms:.2f} cuBLAS ({t_cublas / ms / ideal:.0%} of ideal)"
            + "".join(f"  x{v / ms:.2f} {k}" for k, v in anchors.items()) + f"  err {err:.1e} {'ok' if ok else 'FAIL'}")


def _flipped(kernel: Kernel) -> Kernel | None:
    """The kernel of the same statement with its M and N tiles swapped (the other dot
    orientation), if the cost model ranks one."""
    tiles = dict(kernel.plan.tiles)
    want = {"M": tiles.get("N"), "K": tiles.get("K"), "N": tiles.get("M")}
    for candidate in rank(kernel.spec):
        if candidate.kind == "dot" and dict(candidate.tiles) == want and candidate.grid == kernel.plan.grid:
            return Kernel(kernel.spec, plan=plan_of(kernel.spec, candidate))
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget", type=float, default=420.0)
    parser.add_argument("--sizes", default="8192,4096")
    parser.add_argument("--points", default="", help="Block-ELL points block:s, comma-separated (default: POINTS)")
    parser.add_argument("--nm", default="", help="N:M points n:m:L, comma-separated (e.g. 2:4:128,1:8:128)")
    args = parser.parse_args()
    start = time.time()
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    rows: list = []
    for size in (int(s) for s in args.sizes.split(",")):
        for nm in filter(None, args.nm.split(",")):
            run_nm(size, *(int(x) for x in nm.split(":")), rows)
            write_rows(args.out, "grid_order", rows)
        points = [(int(b), float(x)) for b, x in (p.split(":") for p in args.points.split(","))] if args.points else POINTS
        for block, s in points if not args.nm else ():
            if time.time() - start > args.budget:
                say("budget reached")
                break
            run_point(size, block, s, rows)
            write_rows(args.out, "grid_order", rows)


if __name__ == "__main__":
    main()
