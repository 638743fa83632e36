"""Tile configurations beyond the tuner's table, for the products issue 11 still misses:

    python -m benchmarks.explore.config_sweep [--out DIR] [--budget 420] [--cases nm,block,big-blocks]
        [--tiles "N=256,512;K=32,64"]

N:M 1:8 at 4096^3 reaches ~50% of its ideal and Block-ELL 32x32 at s = 0.9 ~2.1x cuBLAS.
Both run few K steps per program (8 and ~13), where pipeline depth, warps and a second
program per SM decide how much of a program's fill and epilogue overlap another's loop.
This compiles each product's generated kernel once and times it, with one bare launch per
call (`BareLaunch`), under the tuner's choice and under a grid of configurations (N tile,
K tile, warps, stages), each checked against a float64 product, beside cuBLAS; N:M also
with 256-row vectors (an M tile of 256, which the default 32/128 candidates cannot have).
The best rows say whether the tuning table misses configurations that win.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time

import torch

from insum.codegen.tune import prune_configs
from insum.formats import NM, BlockGroupCOO

from ..common import block_sparse, median_ms, rotating
from .tensorcore import bare_launches, check_and_time, format_product, write_rows


def say(line: str) -> None:
    print(line, flush=True)


def cases(size: int, gen: torch.Generator, which: str):
    """(label, format, the dense matrix it holds) per product swept: "nm" (1:8 with 128- and
    256-row vectors, 2:8), "block" (Block-ELL 32x32 s = 0.9) or "big-blocks" (64x64 s = 0.9,
    128x128 s = 0.5)."""
    dtype = torch.float16
    if which == "nm":
        A = torch.randn(size, size, device="cuda", generator=gen).to(dtype)
        for L in (128, 256):
            fmt = NM.from_dense(A, n=1, m=8, vector_len=L)
            yield f"N:M 1:8 L={L} {size}^3", fmt, fmt.to_dense()
        fmt = NM.from_dense(A, n=2, m=8, vector_len=128)
        yield f"N:M 2:8 L=128 {size}^3", fmt, fmt.to_dense()
    points = {"block": ((32, 0.9),), "big-blocks": ((64, 0.9), (128, 0.5))}.get(which, ())
    for block, s in points:
        dense, _ = block_sparse(size, block, s, dtype, gen, "cuda")
        fmt = BlockGroupCOO.from_dense(dense, block=(block, block), group_size="row")
        yield f"Block-ELL {block}x{block} s={s} {size}^3", fmt, dense


#: The swept tile sizes per axis (`--tiles` replaces some).
TILES = {"M": (64, 128, 256), "K": (32, 64, 128), "N": (64, 128, 256)}


def grid(plan, extents: dict, tiles: dict = TILES) -> list[dict]:
    """The swept configurations: tiles 64-256 (K 32-128), warps 4/8, stages 2-5, clamped to
    the extents (a 32 x 32 block's k and m stay 32) and without duplicates. A tile of more
    than 128 x 256 elements runs with 8 warps only (its accumulator alone would take 256
    registers a thread in 4)."""
    axes = [a for a, _ in plan.tiles]
    out = []
    for sizes in itertools.product(*(tiles[a] for a in axes)):
        area = math.prod(s for a, s in zip(axes, sizes) if a != "K")
        for warps, stages in itertools.product((4, 8), (2, 3, 4, 5)):
            if area > 128 * 256 or (area > 64 * 256 and warps == 4):
                continue
            config = {f"BLOCK_{a}": s for a, s in zip(axes, sizes)}
            if plan.grouped:
                config["GROUP_M"] = 8
            out.append({**config, "num_warps": warps, "num_stages": stages})
    return prune_configs(plan, out, extents)


def sweep(label, fmt, dense, size, rows, deadline, tiles: dict = TILES) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    Bs = [torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
    D = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen)
    t_cublas = median_ms(rotating(lambda B: D @ B, [(B,) for B in Bs]))
    expected = dense.double() @ Bs[0].double()
    kernel, bound, prepared, C, operands = format_product(fmt, Bs)
    chosen = dict(prepared.config)
    say(f"{label}: cuBLAS {t_cublas * 1e3:.1f} us; plan {kernel.plan.tiles}; tuner's choice {chosen}")
    timed = []
    for config in [chosen] + [c for c in grid(kernel.plan, dict(bound.extents), tiles) if c != chosen]:
        if time.time() > deadline:
            say("  deadline reached")
            break
        try:
            err, ms = check_and_time(bare_launches(kernel.fn, prepared, bound, config, operands, C), C, fmt.result,
                                     expected)
        except Exception as e:
            say(f"  {config} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        if not err <= 1e-2:
            say(f"  {config} wrong: err {err:.1e}")
            continue
        timed.append((ms, config))
        rows.append(dict(case=label, config=config, ms=ms, err=err, vs_cublas=t_cublas / ms, tuned=config == chosen))
    prepared.set_config(chosen)
    if timed:
        tuned_ms = timed[0][0]
        for ms, config in sorted(timed, key=lambda t: t[0])[:5]:
            say(f"  {ms * 1e3:7.1f} us x{t_cublas / ms:.2f} cuBLAS ({tuned_ms / ms:.2f}x the tuner's) {config}")
        say(f"  tuner's choice {tuned_ms * 1e3:.1f} us x{t_cublas / tuned_ms:.2f}; {len(timed)} configurations ran")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget", type=float, default=420.0)
    parser.add_argument("--cases", default="nm,block", help="nm, block, big-blocks (comma-separated)")
    parser.add_argument("--tiles", default="", help='tile sizes per axis replacing the defaults, e.g. "N=256,512;K=32,64"')
    args = parser.parse_args()
    tiles = dict(TILES)
    for part in filter(None, args.tiles.split(";")):
        axis, sizes = part.split("=")
        tiles[axis.strip()] = tuple(int(v) for v in sizes.split(","))
    start = time.time()
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    rows: list = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    all_cases = [c for which in args.cases.split(",") for c in cases(4096, gen, which)]
    for i, (label, fmt, dense) in enumerate(all_cases):
        share = (args.budget - (time.time() - start)) / (len(all_cases) - i)
        sweep(label, fmt, dense, 4096, rows, time.time() + share, tiles)
        write_rows(args.out, "config_sweep", rows)


if __name__ == "__main__":
    main()
