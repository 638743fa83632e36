"""Row coarsening of Block-ELL (`BlockGroupCOO.from_dense(..., coarsen=r | "tune")`) on
patterns whose neighbouring block rows do or do not share block columns.

    python -m benchmarks.explore.coarsen [--out DIR] [--budget 420] [--sizes 4096,8192] [--block 32]

Coarsening merges r neighbouring block rows into one (r * b)-tall block over the union of
their block columns, with explicit zero blocks: each slab of B the kernel loads serves r
times the rows, for the union's extra multiply-adds. On uniformly random blocks the union
grows almost r-fold, so it lost there (tensorcore_notes.md); rows that share columns
(pairs or fours of rows pruned together, as structured pruning of neighbouring output
channels leaves them) should gain. Patterns, at block density 1 - s per block row:

  random   every block kept independently;
  pairs    a mask drawn per pair of block rows, each row keeping each of its pair's blocks
           with probability 0.9 (the union ~1.1x a row's blocks);
  fours    the same over four block rows.

Per point: the generated Block-ELL kernel for r = 1, 2, 4 (one bare launch each, the tuner's
tiles, rotating two B operands, checked against a float64 product), what coarsen="tune"
chose and the SpMM times it measured, beside cuBLAS and TorchBSR (the fine block) in the
same process.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from insum.formats import BlockGroupCOO
from insum.runtime import BareLaunch, kernel_for

from ..common import median_ms, relative_error, rotating
from .grid_order import product_binding
from .tensorcore import write_rows

PATTERNS = ("random", "pairs", "fours")
SPARSITIES = (0.9, 0.75)


def say(line: str) -> None:
    print(line, flush=True)


def block_mask(pattern: str, rows: int, cols: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """Kept blocks (rows x cols, bool) of one pattern at about `density` per block row."""
    if pattern == "random":
        return torch.rand(rows, cols, device="cuda", generator=gen) < density
    share = {"pairs": 2, "fours": 4}[pattern]
    keep_each = 0.9
    union = torch.rand(rows // share, cols, device="cuda", generator=gen) < density / keep_each
    return union.repeat_interleave(share, 0) & (torch.rand(rows, cols, device="cuda", generator=gen) < keep_each)


def bare_time(fmt: BlockGroupCOO, Bs: list, expected: torch.Tensor) -> tuple[float, float, dict]:
    """(ms, relative error, the tuner's config) of the format's product, one bare launch."""
    C, operands, bound, declared = product_binding(fmt, Bs)
    kernel = kernel_for(bound, lengths=declared)
    kernel.launch(bound, C)  # compiles and tunes
    prepared = kernel.prepared(bound)
    launches = [BareLaunch(kernel.fn, prepared.grid, prepared.config,
                           tuple(prepared.args(bound.with_tensors({**bound.tensors, "B": B}).tensors, C)))
                for B in operands]
    C.fill_(float("nan"))
    launches[0]()
    err = relative_error(fmt.result(C), expected)
    return median_ms(rotating(lambda f: f(), [(f,) for f in launches])), err, dict(prepared.config)


def run_point(size: int, block: int, pattern: str, s: float, rows: list) -> None:
    from torch.sparse._triton_ops import bsr_dense_mm

    gen = torch.Generator(device="cuda").manual_seed(size + block + int(s * 100))
    Bs = [torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
    D = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen)
    t_cublas = median_ms(rotating(lambda B: D @ B, [(B,) for B in Bs]))
    keep = block_mask(pattern, size // block, size // block, 1 - s, gen)
    cells = keep.repeat_interleave(block, 0).repeat_interleave(block, 1)
    A = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) * cells
    expected = A.double() @ Bs[0].double()
    bsr = A.to_sparse_bsr((block, block))
    t_bsr = median_ms(rotating(lambda B: bsr_dense_mm(bsr, B), [(B,) for B in Bs]))
    density = float(keep.float().mean())
    say(f"{size}^3 b{block} {pattern} s={s} (kept {density:.3f}): cuBLAS {t_cublas * 1e3:.1f} us, "
        f"TorchBSR {t_bsr * 1e3:.1f} us")
    ideal = 1 / max(density, 1e-9)
    for r in (1, 2, 4):
        fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row", coarsen=r)
        ms, err, config = bare_time(fmt, Bs, expected)
        work = fmt.params["blocks"] * r / max(int(keep.sum()), 1)
        ok = err <= 1e-2
        rows.append(dict(size=size, block=block, pattern=pattern, s=s, r=r, ms=ms, err=err, ok=ok, work=work,
                         config=config, cublas_ms=t_cublas, torchbsr_ms=t_bsr, vs_cublas=t_cublas / ms,
                         vs_torchbsr=t_bsr / ms, ideal=ideal))
        say(f"  coarsen={r}  {ms * 1e3:8.1f} us  x{t_cublas / ms:.2f} cuBLAS ({t_cublas / ms / ideal:.0%} of ideal)"
            f"  x{t_bsr / ms:.2f} TorchBSR  work x{work:.2f}  err {err:.1e} {'ok' if ok else 'FAIL'}")
    start = time.time()
    tuned = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row", coarsen="tune", tune_cols=size)
    chosen = tuned.params.get("coarsen", 1)
    measured = {r: round(t * 1e6, 1) for r, t in tuned.params["coarsen_seconds"].items()}
    rows.append(dict(size=size, block=block, pattern=pattern, s=s, tuned=chosen, tune_us=measured,
                     tune_seconds=time.time() - start))
    say(f"  coarsen='tune' chose r={chosen} (its SpMM timings, us: {measured}; {time.time() - start:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget", type=float, default=420.0)
    parser.add_argument("--sizes", default="4096,8192")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--sparsities", default=",".join(str(s) for s in SPARSITIES))
    args = parser.parse_args()
    start = time.time()
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    rows: list = []
    for size in (int(x) for x in args.sizes.split(",")):
        for s in (float(x) for x in args.sparsities.split(",")):
            for pattern in args.patterns.split(","):
                if time.time() - start > args.budget:
                    say(f"budget spent: skipped {size}^3 {pattern} s={s}")
                    continue
                run_point(size, args.block, pattern, s, rows)
                write_rows(args.out, "coarsen", rows)


if __name__ == "__main__":
    main()
