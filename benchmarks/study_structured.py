"""Structured SpMM: BlockGroupCOO `fmt @ B` against dense cuBLAS (`A @ B` on the same matrix,
zeros included) and TorchBSR (`torch.sparse._triton_ops.bsr_dense_mm`).

Square problems (4096^3 and 8192^3), fp16 and bf16, square blocks of 16, 32, 64 and 128, zero
blocks drawn uniformly at random with probability s. At every point the group-size
candidates (the paper's rule; one group per block row, as `group_size="row"` where the
format offers it, else the widest row's block count) are packed, checked and timed, and
the fastest is kept. Blocks narrower than a Hopper warp-group tile (16 and 32 rows, under
`NARROW`) also get `group_size="row", coarsen="tune", tune_cols=size`: the format's tuner
merges 2 or 4 neighbouring block rows where that times faster on B of the product's width
(issue 11's coarsening; at 8192^3, 32 x 32, s = 0.5 it took 1859 -> 1650 µs,
`session15/call6`), a candidate only where it chose r > 1. Then the kept product and its
anchors are timed a second time and each keeps the lower of its two do_bench medians
(`rounds_ms` in the rows): a product of a few tens of µs is timed with the host's load in it
where its launch falls behind do_bench's L2 flush. Curves run in priority order (fp16 4096^3
first) until the budget is spent; the report derives the sparsity where insum overtakes dense.
"""

from __future__ import annotations

import inspect

import torch

from insum.codegen.schedule import NARROW
from insum.formats import BlockGroupCOO

from .common import block_sparse, dtype_name, relative_error, rotations_for
from .context import Context

S_SMALL = (0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.95, 0.99)
S_LARGE = (0.25, 0.5, 0.75, 0.9, 0.99)
S_QUICK = (0.25, 0.5, 0.75, 0.9, 0.99)
S_BIG_BLOCKS = (0.5, 0.75, 0.9)


def plan(ctx: Context) -> list[tuple]:
    """(dtype, size, block, sparsities) curves in priority order."""
    if ctx.smoke:
        return [(torch.float16, 64, 16, (0.5, 0.9))]
    fp16, bf16 = torch.float16, torch.bfloat16
    if ctx.quick:
        curves = [(fp16, 4096, b, S_QUICK) for b in (32, 16, 64)]
        curves += [(bf16, 4096, 32, S_QUICK), (fp16, 8192, 32, (0.5, 0.9, 0.99))]
        return curves
    curves = []
    for size, sparsities in ((4096, S_SMALL), (8192, S_LARGE)):
        for dtype in (fp16, bf16):
            curves += [(dtype, size, b, sparsities) for b in (32, 16, 64)]
    # 128 x 128 blocks (the MegaBlocks/stk regime, issue 11's "90% of ideal from s = 0.5"), last.
    curves += [(dtype, size, 128, S_BIG_BLOCKS) for size in (4096, 8192) for dtype in (fp16, bf16)]
    return curves


def coarsening_supported() -> bool:
    """Whether BlockGroupCOO packs with coarsen= (an older checkout, for an A/B, does not)."""
    return "coarsen" in inspect.signature(BlockGroupCOO._pack).parameters


def row_groups_supported(device) -> bool:
    """Whether BlockGroupCOO accepts group_size="row" (one group per block row)."""
    try:
        BlockGroupCOO.from_dense(torch.eye(32, device=device), block=(16, 16), group_size="row")
        return True
    except Exception:
        return False


def run(ctx: Context) -> list[dict]:
    gen = torch.Generator(device=ctx.device).manual_seed(2)
    by_row = row_groups_supported(ctx.device)
    ctx.note("group-size candidates: the paper's rule and " + (
        'group_size="row" (one group per block row)' if by_row else
        "the longest block row's block count (group_size=\"row\" is not available in this checkout)"))
    bsr_dense_mm = ctx.cuda_anchor("TorchBSR", "torch.sparse._triton_ops", "bsr_dense_mm")
    for dtype, size, block, sparsities in plan(ctx):
        for s in sparsities:
            if ctx.over_budget(f"points ({dtype_name(dtype)} {size}^3)"):
                continue
            try:
                point(ctx, dtype, size, block, s, gen, by_row, bsr_dense_mm)
            except Exception as e:
                ctx.fail(dict(set=f"{dtype_name(dtype)} {size}^3 block {block} vs cuBLAS", case=f"s={s}",
                              dtype=dtype_name(dtype), size=size, block=block, sparsity=s, ideal=1 / (1 - s)), e)
    return ctx.rows


def point(ctx, dtype, size, block, s, gen, by_row, bsr_dense_mm) -> None:
    A, keep = block_sparse(size, block, s, dtype, gen, ctx.device)
    r = rotations_for(size * size * A.element_size())
    Bs = [torch.randn(size, size, device=ctx.device, generator=gen).to(dtype) for _ in range(r)]
    inputs = [(B,) for B in Bs]
    expected = A.double() @ Bs[0].double()
    kept = float(keep.float().mean())
    widest = int(keep.sum(1).max())
    candidates = [(None, 1), ("row" if by_row else widest, 1)]
    if by_row and block < NARROW and coarsening_supported():
        candidates.append(("row", "tune"))
    best, times = None, {}
    for g, coarsen in candidates:
        extra = {} if coarsen == 1 else {"coarsen": coarsen, "tune_cols": size}  # (tuned at the product's N)
        fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size=g, **extra)
        r = fmt.params.get("coarsen", 1)
        if coarsen != 1 and r == 1:
            continue  # the tuner kept the fine blocks: the "row" candidate already timed
        label = f"{'row' if g == 'row' else 'rule' if g is None else 'widest'} g={fmt.group_size}"
        if r != 1:
            label = f"row coarsen={r} g={fmt.group_size}"
        elif any(k.endswith(f" g={fmt.group_size}") for k in times) and g != "row":
            continue  # the same grouping as a candidate already timed
        err = relative_error(fmt.spmm(Bs[0], backend=ctx.backend), expected)
        t = ctx.bench(lambda B, f=fmt: f.spmm(B, backend=ctx.backend), inputs)
        times[label] = round(t, 5)
        if best is None or t < best[0]:
            best = (t, fmt, err, g if r == 1 else f"row coarsen={r}")
    t_insum, fmt, err, g = best
    size_b = A.element_size()
    used_cols = int(keep.any(0).sum())
    moved = int(keep.sum()) * block * block * size_b + used_cols * block * size * size_b + size * size * size_b
    base = dict(
        case=f"{dtype_name(dtype)} {size}^3 b{block} s={s}", dtype=dtype_name(dtype), size=size, block=block,
        sparsity=s, actual_sparsity=round(1 - kept, 4), ideal=1 / kept, group_size=fmt.group_size,
        group_rule="paper" if g is None else str(g), group_times_ms=times, insum_ms=t_insum, err=err,
        bytes=moved, flops=2.0 * size**3 * kept,
    )
    dense_err = relative_error(A @ Bs[0], expected)
    timed = {"cuBLAS": (lambda B: A @ B, dense_err)}
    if bsr_dense_mm is not None:
        try:
            bsr = A.to_sparse_bsr((block, block))
            timed["TorchBSR"] = (lambda B: bsr_dense_mm(bsr, B), relative_error(bsr_dense_mm(bsr, Bs[0]), expected))
        except Exception as e:
            ctx.note(f"TorchBSR {dtype_name(dtype)} {size}^3 block {block} s={s}: {type(e).__name__}: {str(e)[:160]}")
    # Two rounds, the second after every other product here ran: a short product's do_bench
    # median moves with the host's load (its launches can fall behind the flush), so each
    # product, insum's and the anchors' alike, keeps the lower of its two medians.
    first = {name: ctx.bench(fn, inputs) for name, (fn, _) in timed.items()}
    rounds = {"insum": [t_insum, ctx.bench(lambda B: fmt.spmm(B, backend=ctx.backend), inputs)]}
    for name, (fn, _) in timed.items():
        rounds[name] = [first[name], ctx.bench(fn, inputs)]
    base["insum_ms"] = min(rounds["insum"])
    for name, (_, anchor_err) in timed.items():
        ctx.add(dict(base, set=f"{dtype_name(dtype)} {size}^3 block {block} vs {name}", anchor=name,
                     anchor_ms=min(rounds[name]), anchor_err=anchor_err,
                     rounds_ms={"insum": rounds["insum"], "anchor": rounds[name]}))
