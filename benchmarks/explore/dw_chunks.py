"""Block-ELL's weight gradient, one program per chunk of J stored blocks of a block row
instead of one per stored block: the output gradient's rows of that block row are read once
for J blocks (the per-block statement reads them again for every block: 2 x 256 KB per
32 x 32 block at batch 4096, about 0.84 GB of L2 traffic per 4096 x 4096 layer at s = 0.9).

    python -m benchmarks.explore.dw_chunks [--width 4096] [--batch 4096] [--chunks 2,4,8]

The chunked statement stacks j on M beside k (`M=(j, k)`: J blocks' rows of x side by side,
the dC tile shared), written transposed into a transposed view of the gradient; a chunk's
slots past its row's count write a scratch block. Times: do_bench medians (ms) of the
per-block statement (`BlockGroupCOO.value_gradient`) and of the chunked one per J, checked
against each other.

Measured (H200, `session8/call5/dw_chunks*.log`): 32 x 32 blocks at s = 0.9, per block 178 us,
chunks of J = 2 / 4 / 8 187 / 181 / 174 us (0.95-1.02x) although they read 0.64 / 0.54 / 0.49
GB from L2 against 0.85; 64 x 64 blocks 159 against 172 us (J = 4). L2 traffic is not what
limits the weight gradient (4.8 TB/s of L2 reads at 32 x 32, 2.7 at 64 x 64): it is the
64 short K steps per program (32 x 32 x 64 tiles), so the per-block statement stays.
"""

from __future__ import annotations

import argparse

import torch

from insum import insum
from insum.formats import BlockGroupCOO

CHUNKED = "dWt[F[r, j], k, m] = B[RK[r, j], k, n] * dC[RP[r], m, n]"


def chunk_tables(fmt: BlockGroupCOO, J: int) -> dict[str, torch.Tensor]:
    """RP[r] (block row), RK[r, j] (block column) and F[r, j] (slot of AV viewed flat, or the
    scratch slot G * g past the row's count) of every chunk of J stored blocks."""
    AK, AL = fmt.AK.long(), fmt.AL.long()
    G, g = AK.shape
    per_row = (AL + J - 1) // J
    R = int(per_row.sum())
    RP = torch.repeat_interleave(torch.arange(G, device=AK.device), per_row, output_size=R)
    first = torch.cumsum(per_row, 0) - per_row
    q = (torch.arange(R, device=AK.device) - first[RP])[:, None] * J + torch.arange(J, device=AK.device)
    valid = q < AL[RP][:, None]
    F = torch.where(valid, RP[:, None] * g + q, G * g)
    RK = torch.where(valid, AK[RP[:, None], q.clamp(max=g - 1)], 0)
    itype = fmt.AK.dtype
    return {"RP": RP.to(itype), "RK": RK.to(itype), "F": F.to(itype)}


def chunked_gradient(fmt: BlockGroupCOO, tables: dict[str, torch.Tensor], dC, B) -> torch.Tensor:
    G, g, bm, bk = fmt.AV.shape
    dW = torch.empty(G * g + 1, bm, bk, dtype=dC.dtype, device=dC.device)
    # F repeats only the scratch slot, whose racing stores are thrown away: declared unique.
    insum(CHUNKED, dWt=dW.transpose(1, 2), B=B, dC=dC, unique_indices={"F"}, **tables)
    return dW[: G * g].view(G, g, bm, bk)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--chunks", default="2,4,8")
    args = parser.parse_args()
    from triton.testing import do_bench

    torch.manual_seed(0)
    width, bs = args.width, args.block
    keep = torch.rand(width // bs, width // bs, device="cuda") >= args.sparsity
    W = torch.randn(width, width, device="cuda", dtype=torch.float16)
    W *= keep.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
    fmt = BlockGroupCOO.from_dense(W, block=bs, group_size="row")
    x = torch.randn(args.batch, width, device="cuda", dtype=torch.float16)
    dy = torch.randn(args.batch, width, device="cuda", dtype=torch.float16)
    B, dC = fmt.operand(x.t()), fmt.output_view(dy.t())
    G, g = fmt.AK.shape
    print(f"{width} x {width}, s = {args.sparsity}, {bs} x {bs} blocks: {fmt.params['blocks']} stored in {G} rows "
          f"of width {g}; batch {args.batch}")

    def stored():
        return fmt.value_gradient("AV", dC, B, "triton", "tf32")

    expected = stored().float()
    base = do_bench(stored, warmup=25, rep=200)
    bytes_l2 = fmt.params["blocks"] * 2 * bs * args.batch * 2
    print(f"per block: {base * 1e3:8.1f} us  (L2 reads {bytes_l2 / 1e9:.2f} GB: {bytes_l2 / base / 1e9:.2f} TB/s)")
    for J in (int(j) for j in args.chunks.split(",")):
        tables = chunk_tables(fmt, J)
        got = chunked_gradient(fmt, tables, dC, B).float()
        err = float((got - expected).norm() / expected.norm())
        ms = do_bench(lambda tables=tables: chunked_gradient(fmt, tables, dC, B), warmup=25, rep=200)
        R = tables["RP"].numel()
        reads = (R + fmt.params["blocks"]) * bs * args.batch * 2
        print(f"J = {J}: {ms * 1e3:8.1f} us  x {base / ms:.2f}  ({R} chunks, L2 reads {reads / 1e9:.2f} GB), err {err:.1e}")


if __name__ == "__main__":
    main()
