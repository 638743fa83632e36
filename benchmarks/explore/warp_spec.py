"""Triton's Hopper warp specialization on the generated block products, before building it:

    python -m benchmarks.explore.warp_spec [--out DIR]

Why: Block-ELL's programs run few K steps (3-40 blocks a block row), so each program's
pipeline fill and epilogue weigh as much as its loop. Triton >= 3.5 can split a
`tl.range(..., warp_specialize=True)` loop into producer warps (tensor-descriptor loads)
and consumer warps (wgmma). This takes the tuned generated kernel of
`C[p,m,n] = AV[p,q,m,k]*B[AK[p,q],k,n]` with declared lengths, rewrites its loop header
only, and times both with the same tile configuration (and the rewritten one at 4 and 8
warps and 2-4 stages), each checked against a float64 product, beside cuBLAS.
"""

from __future__ import annotations

import torch

from insum.bind import bind
from insum.execute import length_facts
from insum.parser import parse
from insum.runtime import _load, cache_dir, kernel_for

from .tensorcore import block_ell, block_problem, run_points, say, time_variants

EXPR = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"
LOOP = "for step in range(0, len_q * steps_k):"

#: (size, block, s) of the Block-ELL products, in the order they run.
POINTS = [(4096, 64, 0.9), (4096, 128, 0.5), (4096, 128, 0.9), (4096, 32, 0.9), (8192, 64, 0.9)]


def case(size: int, block: int, s: float, rows: list) -> None:
    dtype = torch.float16
    Bs, t_cublas, A, keep, expected = block_problem(size, block, s, dtype)
    nb = size // block
    packed = block_ell(keep, A, block)
    counts = keep.sum(1).to(torch.int32)
    C = torch.empty(nb, block, size, device="cuda", dtype=dtype)
    Bv = [B.view(nb, block, size) for B in Bs]
    point = f"{size}^3 b{block} s={s}"
    say(f"{point}: cuBLAS {t_cublas * 1e3:.1f} us")
    bound, declared = length_facts(bind(parse(EXPR), {**packed, "B": Bv[0], "C": C}), {"q[p]": counts})
    kernel = kernel_for(bound, lengths=declared)
    kernel.launch(bound, C)  # tunes
    prepared = kernel.prepared(bound)
    base = dict(prepared.config)
    if LOOP not in kernel.source:
        say(f"  loop header not found; plan {kernel.plan}")
        return
    source = kernel.source.replace(LOOP, "for step in tl.range(0, len_q * steps_k, warp_specialize=True):")
    try:
        fn = _load(cache_dir() / "kernels" / f"insum_{kernel.digest}_ws.py", source, kernel.digest + "_ws")
    except Exception as e:
        say(f"  warp-specialized source does not load: {e!r}")
        return
    variants = [("generated", kernel.fn, base)]
    for warps in (4, 8):
        for stages in (2, 3, 4):
            variants.append((f"ws {warps}w {stages}st", fn, {**base, "num_warps": warps, "num_stages": stages}))
    variants.append(("ws tuned config", fn, base))
    time_variants(point, variants, prepared, bound, Bv, C, lambda out: out.reshape(size, size), expected, t_cublas,
                  rows)


def main() -> None:
    run_points("warp_spec", POINTS, case)

if __name__ == "__main__":
    main()
