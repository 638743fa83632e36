"""Block-ELL with 16- and 32-row blocks: its operands through pointers (the default) or
through host-made tensor descriptors loaded in the tensor's order and transposed for the dot.

    python -m benchmarks.explore.transposed_boxes

Why: small blocks take the swapped orientation (M = B's dense columns, N = the block's rows),
where B's block row (k, n) and AV's block (m, k) are held in the other order than the dot
wants. Descriptors made in the kernel measured slower than pointers there (1.58x against
1.67x cuBLAS at 32x32, s = 0.9, tensorcore_notes.md); descriptors made on the host save each
program its tensormap write and fence (4-13% on the 64- and 128-row blocks, ab_products).
This compiles both plans of the same statement (the default, now transposed boxes, and the
same spec with no tensor offered as a box), tunes each as a first call would, and times each
by its graphed replays and by do_bench beside cuBLAS, checked against a float64 product.
Measured (H200, session 13): 4096^3 32x32 s = 0.9 70.1 -> 66.4 us, 8192^3 32x32 s = 0.9
451 -> 406 us, 8192^3 16x16 s = 0.9 828 -> 746 us.
"""

from __future__ import annotations

import dataclasses

import torch

from insum.codegen import schedule
from insum.formats import BlockGroupCOO
from insum.runtime import Kernel, kernel_for

from ..common import block_sparse, median_ms, relative_error, rotating
from .grid_order import product_binding

CASES = [(4096, 32, 0.9), (4096, 32, 0.75), (8192, 32, 0.9), (4096, 16, 0.9), (8192, 16, 0.9)]


def main() -> None:
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for size, block, s in CASES:
        gen = torch.Generator(device="cuda").manual_seed(size + block)
        Bs = [torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
        D = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen)
        t_dense = median_ms(rotating(lambda B, D=D: D @ B, [(B,) for B in Bs]))
        A, _ = block_sparse(size, block, s, torch.float16, gen, "cuda")
        fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row")
        expected = A.double() @ Bs[0].double()
        C, operands, bound, declared = product_binding(fmt, Bs)
        default = kernel_for(bound, lengths=declared)
        spec = dataclasses.replace(default.spec, boxes=frozenset())
        line = [f"{size}^3 b{block} s={s}: cuBLAS {t_dense * 1e3:.1f} us"]
        for label, kernel in (("pointers", Kernel(spec, plan=schedule(spec))), ("default (boxes)", default)):
            bounds = [bound.with_tensors({**bound.tensors, "B": B}) for B in operands]
            C.fill_(float("nan"))
            kernel.launch(bounds[0], C)  # tunes
            err = relative_error(fmt.result(C), expected)
            ms = median_ms(rotating(lambda b, k=kernel, C=C: k.launch(b, C), [(b,) for b in bounds]))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for b in bounds * 10:
                    kernel.launch(b, C)
            graphed = median_ms(graph.replay) / (10 * len(bounds))
            config = dict(kernel.prepared(bounds[0]).config)
            line.append(f"{label}: {ms * 1e3:.1f} us ({t_dense / ms:.2f}x), graphed {graphed * 1e3:.1f} us, "
                        f"err {err:.1e}, boxes {kernel.plan.boxes}, "
                        f"tiles {kernel.plan.tiles}, {config}")
        print("\n   ".join(line), flush=True)


if __name__ == "__main__":
    main()
