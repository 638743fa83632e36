"""Why BlockGroupCOO SpMM is as fast as it is: output strategies and dot orientations.

    python -m benchmarks.explore.blockgroupcoo [--size 4096] [--block 32]

For fp16 A (size x size, random blocks kept with probability 1 - s) times dense B, side by
side in one run: dense cuBLAS, TorchBSR, and the generated kernel with
  groups           grouped blocks, `fmt @ B` (native fp16 atomics, or a float32 output
                   when many groups share a block row)
  row              one group per block row (Block-ELL): a plain store, no atomics
  row+swapped      the same with the dense columns on the dot's M axis (n x k @ k x m), so
                   the tensor-core tile is 64..256 rows tall instead of the block's 32
  groups+swapped   grouped, swapped, native atomics
Every variant is checked against a float32 dense product.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import insum
from insum.bind import bind
from insum.formats import BlockGroupCOO
from insum.parser import parse
from insum.runtime import Kernel, spec_for

from ..common import block_sparse, ceilings, median_ms, relative_error, rotating
from .tensorcore import block_ell

GROUPED = "C[AM[p], m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]"
ROW = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"


def swapped(kernel_expr: str, tensors: dict) -> Kernel:
    """The generated kernel with its dot's M and N variables exchanged."""
    # No public hook overrides the dot's orientation: this rebuilds the plan from spec_for's spec.
    bound = bind(parse(kernel_expr), tensors)
    spec = spec_for(bound)
    plan = Kernel(spec).plan
    m, k, n = plan.axis_var("M"), plan.axis_var("K"), plan.axis_var("N")
    plan = dataclasses.replace(plan, tiles=(("M", n), ("K", k), ("N", m)), left=plan.right, right=plan.left)
    return Kernel(spec, plan)


def one_sparsity(s: float, size: int, block: int, gen: torch.Generator, roof: dict) -> tuple:
    """Every variant at one block sparsity; returns the best insum variant and the anchors."""
    from torch.sparse._triton_ops import bsr_dense_mm

    nb = size // block
    A, keep = block_sparse(size, block, s, torch.float16, gen, "cuda")
    Bs = [torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
    expected = A.float() @ Bs[0].float()
    flops = 2 * size**3 * keep.float().mean().item()
    times = {}

    def record(name, fn, check):
        err = relative_error(check().float().reshape(size, size), expected)
        t = median_ms(rotating(fn, [(B,) for B in Bs]))
        times[name] = t
        print(f"  s={s} {name:28s} {t:.4f} ms  err {err:.1e}  {flops / t / 1e9 / roof['fp16_tflops']:.0%} of tc", flush=True)

    record("dense cuBLAS", lambda B: A @ B, lambda: A @ Bs[0])
    bsr = A.to_sparse_bsr((block, block))
    record("TorchBSR", lambda B: bsr_dense_mm(bsr, B), lambda: bsr_dense_mm(bsr, Bs[0]))
    for g in (None, 8, 32):
        fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size=g)
        record(f"groups g={fmt.group_size}", lambda B, f=fmt: f @ B, lambda f=fmt: f @ Bs[0])
    ell = block_ell(keep, A, block)
    C = torch.empty(nb, block, size, device="cuda", dtype=torch.float16)

    def row_tensors(B):
        return dict(ell, B=B.view(nb, block, size), C=C)

    record(f"row w={ell['AK'].shape[1]}", lambda B: insum.insum(ROW, **row_tensors(B)),
           lambda: insum.insum(ROW, **row_tensors(Bs[0])).clone())
    row_swapped = swapped(ROW, row_tensors(Bs[0]))
    print("    swapped plan:", str(row_swapped.plan).replace("\n", "; "))

    def run_swapped(kernel, tensors):
        bound = bind(kernel.spec.stmt, tensors)
        return kernel.launch(bound, bound.output())

    record("row+swapped", lambda B: run_swapped(row_swapped, row_tensors(B)),
           lambda: run_swapped(row_swapped, row_tensors(Bs[0])).clone())
    fmt = BlockGroupCOO.from_dense(A, block=(block, block))
    Cg = torch.zeros(nb, block, size, device="cuda", dtype=torch.float16)

    def grouped_tensors(B):
        return dict(fmt.tensors, B=B.view(nb, block, size), C=Cg)

    grouped_swapped = swapped(GROUPED, grouped_tensors(Bs[0]))

    def check_grouped():
        Cg.zero_()
        return run_swapped(grouped_swapped, grouped_tensors(Bs[0])).clone()

    record(f"groups g={fmt.group_size}+swapped", lambda B: run_swapped(grouped_swapped, grouped_tensors(B)), check_grouped)
    best = min((k for k in times if k not in ("dense cuBLAS", "TorchBSR")), key=times.get)
    return s, best, times[best], times["dense cuBLAS"], times["TorchBSR"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--sparsities", default="0.5,0.9,0.99")
    args = parser.parse_args()
    roof = ceilings()
    size, block = args.size, args.block
    print(f"{torch.cuda.get_device_name()}: {roof['bandwidth_GBs']:.0f} GB/s, {roof['fp16_tflops']:.0f} fp16 TFLOP/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    summary = []
    for s in map(float, args.sparsities.split(",")):
        summary.append(one_sparsity(s, size, block, gen, roof))
    print("\n== summary: best insum variant per sparsity ==")
    for s, name, t, dense, bsr in summary:
        print(f"s={s}: {name:28s} {t:.4f} ms  x{dense / t:.2f} vs cuBLAS (ideal {1 / (1 - s):.0f})  x{bsr / t:.2f} vs TorchBSR")


if __name__ == "__main__":
    main()
