"""BlockGroupCOO's block products under each tile configuration, beside cuBLAS and TorchBSR.

    python -m benchmarks.explore.block_configs [--budget 240] [--out DIR]

Why: a block row at s = 0.9 has few nonzero blocks (13 K steps for 32-wide blocks at 4096),
so a program's pipeline fill and its epilogue are a large share of its time. The tuner's
dot table is made for dense GEMMs (3-5 stages: one program per SM when a stage is large);
TorchBSR's tuned kernels (the A100 table in torch.sparse._triton_ops_meta, e.g. 64 x 64
blocks at 8192: N tile 256, 4 warps, 2 stages) keep two programs on an SM so that one's
fill overlaps the other's loop, and beat the generated kernel at 8192^3 (REPORT: 3.98x cuBLAS
against 2.75x). This times the generated kernel of `C[p,m,n] = AV[p,q,m,k]*B[AK[p,q],k,n]`
(one group per block row, padded) under every candidate of the tuner's table and the same
candidates at 2 stages, one bare launch each (`Kernel.launcher`), checked against a float64
product, and TorchBSR under its default and under the explicit 2-stage meta, in one process.
The best rows per case say whether the tuner's table misses the configurations that win.

`--lengths` times instead, per case, `insum()` of the same statement with and without the
block rows' lengths declared (`lengths={"q[p]": AL}`: a program stops after its own block
row's blocks; the padding to the longest block row is skipped), both tuned as a user gets
them, beside cuBLAS and TorchBSR: what declaring the lengths in BlockGroupCOO would gain.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from insum.bind import bind
from insum.codegen.tune import configs_for, prune_configs
from insum.parser import parse
from insum.runtime import BareLaunch, Kernel, spec_for

from ..common import median_ms, relative_error, rotating
from .tensorcore import block_ell, block_problem

EXPR = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"
CASES = [  # (size, block, sparsity)
    (4096, 64, 0.9), (4096, 32, 0.9), (8192, 64, 0.9), (4096, 128, 0.5), (4096, 128, 0.9),
    (4096, 64, 0.5), (4096, 32, 0.75), (8192, 32, 0.9),
]


def candidates(kernel: Kernel, extents: dict) -> list[dict]:
    table = prune_configs(kernel.plan, configs_for(kernel.plan), extents)
    two = [{**c, "num_stages": 2} for c in table]
    seen, out = set(), []
    for config in table + two:
        key = tuple(sorted(config.items()))
        if key not in seen:
            seen.add(key)
            out.append(config)
    return out


def run_case(size: int, block: int, s: float, rows: list, say, lengths_only: bool = False) -> None:
    from torch.sparse._triton_ops import bsr_dense_mm

    dtype = torch.float16
    Bs, t_cublas, A, keep, expected = block_problem(size, block, s, dtype)
    point = f"{size}^3 b{block} s={s}"
    say(f"{point}: cuBLAS {t_cublas * 1e3:.1f} us, {int(keep.sum(1).max())} blocks in the longest block row")

    def keep_row(label, fn, check, config=None):
        try:
            err = relative_error(check().reshape(expected.shape), expected)
            ms = median_ms(fn)
        except Exception as e:
            say(f"  {label:34s} FAILED {type(e).__name__}: {str(e)[:160]}")
            return None
        ok = err <= 1e-2
        rows.append(dict(point=point, label=label, config=config, ms=ms, err=err, ok=ok, vs_cublas=t_cublas / ms))
        say(f"  {label:34s} {ms * 1e3:8.1f} us  x{t_cublas / ms:.2f} cuBLAS  err {err:.1e} {'ok' if ok else 'FAIL'}")
        return ms

    bsr = A.to_sparse_bsr((block, block))
    keep_row("TorchBSR default", rotating(lambda B: bsr_dense_mm(bsr, B), [(B,) for B in Bs]),
             lambda: bsr_dense_mm(bsr, Bs[0]))
    meta = dict(SPLIT_N=max(1, size // 256), GROUP_SIZE_ROW=2, num_stages=2, num_warps=4)
    keep_row("TorchBSR N256 4w 2st", rotating(lambda B: bsr_dense_mm(bsr, B, meta=meta), [(B,) for B in Bs]),
             lambda: bsr_dense_mm(bsr, Bs[0], meta=meta))

    nb = size // block
    packed = block_ell(keep, A, block)
    C = torch.empty(nb, block, size, device="cuda", dtype=dtype)
    Bv = [B.view(nb, block, size) for B in Bs]
    tensors = {**packed, "B": Bv[0], "C": C}
    if lengths_only:
        import insum

        AL = keep.sum(1).to(torch.int32)
        say(f"  blocks per block row: mean {float(AL.float().mean()):.1f}, longest {int(AL.max())}")
        for label, extra in (("insum() padded", {}), ("insum() lengths declared", {"lengths": {"q[p]": AL}})):
            def call(B, extra=extra):
                return insum.insum(EXPR, AV=packed["AV"], AK=packed["AK"], B=B, C=C, **extra)

            def check(extra=extra):
                C.fill_(float("nan"))
                return call(Bv[0], extra).clone()

            keep_row(label, rotating(call, [(B,) for B in Bv]), check)
        return
    stmt = parse(EXPR)
    bound = bind(stmt, tensors)
    kernel = Kernel(spec_for(bound))
    kernel.launch(bound, C)  # tunes over the table: the default's choice
    prepared = kernel.prepared(bound)
    default = dict(prepared.config)
    say(f"  plan M={kernel.plan.axis_var('M')} N={kernel.plan.axis_var('N')} descriptors={len(kernel.plan.boxes)};"
        f" tuner's choice {default}")
    timed = []
    for config in candidates(kernel, dict(bound.extents)):
        prepared.set_config(config)
        launches = [BareLaunch(kernel.fn, prepared.grid, config, tuple(prepared.args(bind(stmt, {**tensors, "B": B}).tensors, C)))
                    for B in Bv]

        def check(launch=launches[0]):
            C.fill_(float("nan"))
            launch()
            return C.clone()

        label = "insum " + " ".join(f"{k[6:] if k.startswith('BLOCK_') else k[4:]}={v}" for k, v in config.items()
                                    if k != "GROUP_M")
        ms = keep_row(label + (" *" if config == default else ""), rotating(lambda f: f(), [(f,) for f in launches]),
                      check, config)
        if ms:
            timed.append((ms, config))
    if timed:
        best_ms, best = min(timed, key=lambda t: t[0])
        default_ms = next((ms for ms, c in timed if c == default), None)
        say(f"  best {best} {best_ms * 1e3:.1f} us (x{t_cublas / best_ms:.2f} cuBLAS); tuner's choice "
            f"{default_ms * 1e3 if default_ms else float('nan'):.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=240.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--lengths", action="store_true", help="insum() with and without declared lengths")
    args = parser.parse_args()
    start, rows = time.time(), []

    def say(line: str) -> None:
        print(line, flush=True)

    say(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    for size, block, s in CASES:
        if time.time() - start > args.budget:
            say(f"budget spent before {size}^3 b{block} s={s}")
            break
        run_case(size, block, s, rows, say, args.lengths)
        os.makedirs(args.out, exist_ok=True)
        name = "block_lengths.json" if args.lengths else "block_configs.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
