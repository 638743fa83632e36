"""Fusion ablation: the generated kernel (gather, multiply, scatter in one launch) against the
same statement lowered to torch operations by `insum.reference` (advanced-indexing gathers,
one einsum, index_put with accumulation), under `torch.compile` (default mode, static
shapes) and eager.

Statements: GroupCOO SpMM, BlockGroupCOO SpMM (the paper's ablation: 4096^3, 32x32
blocks, 90% block sparsity), SDDMM, point-cloud convolution, embedding lookup, segment
sum. Each result is checked against the float64 product or the float64 lowering.
"""

from __future__ import annotations

import torch

from insum import insum
from insum.formats import BlockGroupCOO, GroupCOO, power_law_matrix

from .common import block_sparse, dtype_name, relative_error
from .context import Context
from .lowering import Lowering, lowered_spmm
from .study_unstructured import traffic

ANCHORS = ("torch.compile", "torch eager")


def sizes(ctx: Context) -> dict:
    if ctx.smoke:
        return dict(rows=256, sddmm_rows=256, avg=4, N=16, bsize=64, block=16, s=0.5, K=16, points=64, offsets=3, pairs=32, ch=16,
                    table=256, lookups=64, dim=16, segments=8)
    if ctx.quick:
        return dict(rows=65536, sddmm_rows=32768, avg=16, N=128, bsize=4096, block=32, s=0.9, K=64, points=50000, offsets=27,
                    pairs=20000, ch=64, table=1 << 18, lookups=1 << 18, dim=128, segments=4096)
    return dict(rows=262144, sddmm_rows=65536, avg=16, N=128, bsize=4096, block=32, s=0.9, K=64, points=200000, offsets=27,
                pairs=50000, ch=64, table=1 << 20, lookups=1 << 20, dim=128, segments=10000)


def run(ctx: Context) -> list[dict]:
    z = sizes(ctx)
    gen = torch.Generator(device=ctx.device).manual_seed(4)
    dev = ctx.device
    builders = (spmm_groupcoo, spmm_blockgroupcoo, sddmm, pointcloud_conv, embedding, segment_sum)
    for build in builders:
        if ctx.over_budget("statements"):
            continue
        try:
            measure(ctx, build(ctx, z, gen, dev))
        except Exception as e:
            ctx.fail(dict(set="fusion vs torch.compile", case=build.__name__), e)
    return ctx.rows


def measure(ctx: Context, case: dict) -> None:
    """Check and time the generated kernel, then each anchor on the same rotated inputs."""
    inputs = case["inputs"]
    got = case["ours"](*inputs[0])
    err = relative_error(got, case["expected"])
    t_insum = ctx.bench(case["ours"], inputs)
    base = dict(case=case["name"], expr=case["expr"], dtype=case["dtype"], insum_ms=t_insum, err=err,
                bytes=case["bytes"], flops=case["flops"], shapes=case.get("shapes", ""))
    anchors = ANCHORS if not ctx.smoke or case["name"] == "GroupCOO SpMM" else ("torch eager",)
    for anchor in anchors:
        fn = case["anchors"][anchor]
        try:
            anchor_err = relative_error(fn(*inputs[0]), case["expected"])
            t_anchor = ctx.bench(fn, inputs)
        except Exception as e:
            ctx.note(f"{anchor} on {case['name']}: {type(e).__name__}: {str(e)[:200]}")
            continue
        ctx.add(dict(base, set=f"fusion vs {anchor}", anchor=anchor, anchor_ms=t_anchor, anchor_err=anchor_err))


def _statement_case(ctx, name, expr, dtype, fixed, rotated, out_shape, out_dtype, flops, moved, shapes=""):
    """A case for a bare statement: `rotated` is a list of dicts (one per input set)."""
    out_name = expr.split("[")[0].strip()
    names = tuple(sorted(set(fixed) | set(rotated[0]))) + (out_name,)
    lowering = Lowering(expr, names, dynamic=False)
    device = ctx.device

    def ours(tensors):
        out = torch.zeros(out_shape, dtype=out_dtype, device=device)
        return insum(expr, backend=ctx.backend, **{out_name: out}, **fixed, **tensors)

    def lowered(run):
        def call(tensors):
            out = torch.zeros(out_shape, dtype=out_dtype, device=device)
            return run(**{out_name: out}, **fixed, **tensors)

        return call

    # The oracle: the lowering itself in float64.
    wide = {k: (v.double() if v.is_floating_point() else v) for k, v in {**fixed, **rotated[0]}.items()}
    expected = Lowering(expr, names).eager(**{out_name: torch.zeros(out_shape, dtype=torch.float64, device=device)}, **wide)
    return dict(
        name=name, expr=expr, dtype=dtype_name(dtype), inputs=[(t,) for t in rotated], ours=ours, expected=expected,
        anchors={"torch.compile": lowered(lowering.compiled), "torch eager": lowered(lowering.eager)},
        flops=flops, bytes=moved, shapes=shapes,
    )


def spmm_groupcoo(ctx, z, gen, dev):
    csr = power_law_matrix(z["rows"], z["rows"], z["avg"], seed=5, device=dev)
    fmt = GroupCOO.from_torch(csr)
    Bs = [torch.randn(z["rows"], z["N"], device=dev, generator=gen) for _ in range(2)]
    moved, flops = traffic(csr, z["N"], torch.float32)
    return dict(
        name="GroupCOO SpMM", expr=fmt.expression, dtype="fp32", inputs=[(B,) for B in Bs],
        ours=lambda B: fmt.spmm(B, backend=ctx.backend), expected=csr.to(torch.float64) @ Bs[0].double(),
        anchors={a: lowered_spmm(fmt, torch.float32, compiled=a == "torch.compile", dynamic=False) for a in ANCHORS},
        flops=flops, bytes=moved, shapes=f"{z['rows']}^2, {csr._nnz()} nnz, N={z['N']}",
    )


def spmm_blockgroupcoo(ctx, z, gen, dev):
    size, block = z["bsize"], z["block"]
    A, keep = block_sparse(size, block, z["s"], torch.float16, gen, dev)
    fmt = BlockGroupCOO.from_dense(A, block=(block, block))
    Bs = [torch.randn(size, size, device=dev, generator=gen).half() for _ in range(2)]
    kept = float(keep.float().mean())
    moved = int(keep.sum()) * block * block * 2 + 2 * size * size * 2
    return dict(
        name="BlockGroupCOO SpMM", expr=fmt.expression, dtype="fp16", inputs=[(B,) for B in Bs],
        ours=lambda B: fmt.spmm(B, backend=ctx.backend), expected=A.double() @ Bs[0].double(),
        anchors={a: lowered_spmm(fmt, torch.float16, compiled=a == "torch.compile", dynamic=False) for a in ANCHORS},
        flops=2.0 * size**3 * kept, bytes=moved, shapes=f"{size}^3, block {block}, s={z['s']}, g={fmt.group_size}",
    )


def sddmm(ctx, z, gen, dev):
    csr = power_law_matrix(z["sddmm_rows"], z["sddmm_rows"], z["avg"], seed=6, device=dev)
    R = csr.shape[0]
    AM = torch.repeat_interleave(torch.arange(R, device=dev), csr.crow_indices().diff()).int()
    AK = csr.col_indices().int()
    nnz, K = AM.numel(), z["K"]
    sets = [{"X": torch.randn(R, K, device=dev, generator=gen), "Y": torch.randn(R, K, device=dev, generator=gen)}
            for _ in range(2)]
    return _statement_case(
        ctx, "SDDMM", "O[p] += X[AM[p],k]*Y[AK[p],k]", torch.float32, {"AM": AM, "AK": AK}, sets, (nnz,),
        torch.float32, 2.0 * nnz * K, nnz * 12 + 2 * R * K * 4, f"{R}^2, {nnz} nnz, K={K}")


def pointcloud_conv(ctx, z, gen, dev):
    P, W_, Q, C = z["points"], z["offsets"], z["pairs"], z["ch"]
    MI = torch.randint(0, P, (W_, Q), device=dev, generator=gen, dtype=torch.int32)
    MO = torch.randint(0, P, (W_, Q), device=dev, generator=gen, dtype=torch.int32)
    W = (torch.randn(W_, C, C, device=dev, generator=gen) / C**0.5).half()
    sets = [{"X": torch.randn(P, C, device=dev, generator=gen).half()} for _ in range(2)]
    moved = P * C * 2 + W.numel() * 2 + 2 * W_ * Q * 4 + P * C * 4
    return _statement_case(
        ctx, "point-cloud conv", "O[MO[w,p],co] += X[MI[w,p],ci]*W[w,ci,co]", torch.float16,
        {"MI": MI, "MO": MO, "W": W}, sets, (P, C), torch.float32, 2.0 * W_ * Q * C * C, moved,
        f"{P} points, {W_} offsets x {Q} pairs, {C}->{C} channels")


def embedding(ctx, z, gen, dev):
    T, n, d = z["table"], z["lookups"], z["dim"]
    W = torch.randn(T, d, device=dev, generator=gen)
    sets = [{"I": torch.randint(0, T, (n,), device=dev, generator=gen, dtype=torch.int32)} for _ in range(2)]
    return _statement_case(
        ctx, "embedding lookup", "E[i,d] += W[I[i],d]", torch.float32, {"W": W}, sets, (n, d), torch.float32,
        0.0, n * 4 + 2 * n * d * 4, f"table {T}x{d}, {n} lookups")


def segment_sum(ctx, z, gen, dev):
    n, d, S = z["lookups"], z["dim"], z["segments"]
    SEG = torch.sort(torch.randint(0, S, (n,), device=dev, generator=gen)).values.int()
    sets = [{"X": torch.randn(n, d, device=dev, generator=gen)} for _ in range(2)]
    return _statement_case(
        ctx, "segment sum", "S[SEG[i],d] += X[i,d]", torch.float32, {"SEG": SEG}, sets, (S, d), torch.float32,
        float(n * d), n * d * 4 + n * 4 + S * d * 4, f"{n}x{d} rows into {S} segments")
