"""Block-ELL's per-step index load, hoisted: does the scalar `AK[p, q]` load in the loop
stall the product?

    python -m benchmarks.explore.index_preload [--out DIR]

Nsight Compute on the 64 x 64 product at 4096^3, s = 0.9 (`ncu_products.sh`, session 15
call5) puts 42% of the warps' stall cycles on waiting for L1TEX (global) loads: the
kernel's only global loads are the program's order and length and, in every K step, the
block's column `AK[p, q]` that the B slab's descriptor load takes as its coordinate. This
rewrites the tuned generated kernel so that the program loads its whole row of AK once
before the loop (one vector load, masked at the row's length) and each step takes its
column from registers (a masked sum), then times both with the same tiles and a few
pipeline depths, each checked against a float64 product, beside cuBLAS.
"""

from __future__ import annotations

import torch

from insum.arith import next_power_of_2
from insum.bind import bind
from insum.execute import length_facts
from insum.parser import parse
from insum.runtime import _load, cache_dir, kernel_for

from .tensorcore import block_ell, block_problem, run_points, say, time_variants

EXPR = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"
LOOP = "    for step in range(0, len_q * steps_k):\n"
INDEX = "AK_val = tl.load(AK_ptr + i_p * stride_AK_0 + i_q * stride_AK_1)"


def preloaded(source: str, width: int) -> str | None:
    """The source with AK's row loaded before the loop (None where the lines differ)."""
    if LOOP not in source or INDEX not in source:
        return None
    hoist = (f"    q_all = tl.arange(0, {width})\n"
             "    AK_row = tl.load(AK_ptr + i_p * stride_AK_0 + q_all * stride_AK_1, mask=q_all < len_q, other=0)\n")
    source = source.replace(LOOP, hoist + LOOP)
    return source.replace(INDEX, "AK_val = tl.sum(tl.where(q_all == i_q, AK_row, 0), axis=0)")

#: (size, block, s) of the Block-ELL products, in the order they run.
POINTS = [(4096, 64, 0.9), (4096, 128, 0.9), (4096, 32, 0.9), (4096, 64, 0.75), (8192, 64, 0.9)]


def case(size: int, block: int, s: float, rows: list) -> None:
    Bs, t_cublas, A, keep, expected = block_problem(size, block, s)
    nb = size // block
    packed = block_ell(keep, A, block)
    counts = keep.sum(1).to(torch.int32)
    C = torch.empty(nb, block, size, device="cuda", dtype=torch.float16)
    Bv = [B.view(nb, block, size) for B in Bs]
    point = f"{size}^3 b{block} s={s}"
    bound, declared = length_facts(bind(parse(EXPR), {**packed, "B": Bv[0], "C": C}), {"q[p]": counts})
    kernel = kernel_for(bound, lengths=declared)
    kernel.launch(bound, C)  # tunes
    prepared = kernel.prepared(bound)
    base = dict(prepared.config)
    width = next_power_of_2(packed["AK"].shape[1])
    source = preloaded(kernel.source, width)
    say(f"{point}: cuBLAS {t_cublas * 1e3:.1f} us, row width {packed['AK'].shape[1]}, tuned {base}")
    if source is None:
        say("  index load not found in the generated source")
        return
    fn = _load(cache_dir() / "kernels" / f"insum_{kernel.digest}_pre.py", source, kernel.digest + "_pre")
    variants = [("generated", kernel.fn, base), ("preloaded", fn, base)]
    for stages in (3, 4):
        if stages != base["num_stages"]:
            variants += [(f"generated {stages}st", kernel.fn, {**base, "num_stages": stages}),
                         (f"preloaded {stages}st", fn, {**base, "num_stages": stages})]
    for _ in range(2):  # two rounds, alternating
        time_variants(point, variants, prepared, bound, Bv, C, lambda out: out.reshape(size, size), expected,
                      t_cublas, rows)


def main() -> None:
    run_points("index_preload", POINTS, case)

if __name__ == "__main__":
    main()
