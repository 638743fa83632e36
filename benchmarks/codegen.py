"""The code generator on a CUDA GPU: GroupCOO and BlockGroupCOO SpMM against their anchors,
and the host overhead of a cached insum() call.

    python -m benchmarks.codegen [--data DIR] [--out FILE]

GroupCOO SpMM (fp32, N = 128) on DLMC matrices runs against cuSPARSE (torch CSR @ dense);
BlockGroupCOO SpMM (fp16, 4096^3, 32x32 blocks) against dense cuBLAS and TorchBSR
(torch.sparse._triton_ops.bsr_dense_mm). Each result is checked against a reference.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import insum
from insum.formats import BlockGroupCOO, GroupCOO, load_smtx

from .common import (
    bare_launcher,
    block_sparse,
    ceilings,
    host_us_per_call,
    median_ms,
    relative_error,
    rotating,
)

N_COLS = 128


def groupcoo_vs_cusparse(data: Path, limit: int, roof: dict) -> list[dict]:
    files = sorted(data.glob("dlmc/*/magnitude_pruning/*/*.smtx.gz"))
    step = max(1, len(files) // limit)
    rows = []
    for path in files[::step][:limit]:
        csr = load_smtx(path).cuda()
        fmt = GroupCOO.from_torch(csr)
        K = csr.shape[1]
        Bs = [torch.randn(K, N_COLS, device="cuda") for _ in range(4)]
        expected = (csr.to_dense().double() @ Bs[0].double())
        got = fmt @ Bs[0]
        err = relative_error(got, expected)
        t_insum = median_ms(rotating(lambda B, f=fmt: f @ B, [(B,) for B in Bs]))
        t_cusparse = median_ms(rotating(lambda B, a=csr: a @ B, [(B,) for B in Bs]))
        nnz = csr._nnz()
        moved = nnz * 8 + csr.shape[0] * N_COLS * 4 + min(nnz, K) * N_COLS * 4  # ideal bytes
        rows.append(dict(
            matrix=f"{path.parts[-4]}/{path.parts[-2]}/{path.name[:-8]}", shape=tuple(csr.shape), nnz=nnz,
            g=fmt.group_size, err=err, insum_ms=t_insum, cusparse_ms=t_cusparse,
            speedup=t_cusparse / t_insum, frac_bw=moved / (t_insum * 1e-3) / (roof["bandwidth_GBs"] * 1e9),
        ))
        print(f"groupcoo {rows[-1]['matrix']:60s} {csr.shape} nnz={nnz:7d} g={fmt.group_size:3d} "
              f"err={err:.1e} insum={t_insum*1e3:8.1f}us cusparse={t_cusparse*1e3:8.1f}us "
              f"x{t_cusparse / t_insum:.2f}", flush=True)
    return rows


def blockgroupcoo_vs_dense(size: int, sparsities, roof: dict) -> list[dict]:
    from torch.sparse._triton_ops import bsr_dense_mm

    block = 32
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for s in sparsities:
        A, keep = block_sparse(size, block, s, torch.float16, gen, "cuda")
        Bs = [torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
        bsr = A.to_sparse_bsr((block, block))
        expected = A.float() @ Bs[0].float()
        # The paper's group size, its power-of-two neighbours up to one group per block row
        # (fewer atomics, more padding); keep the fastest, as group_size="tune" would.
        widest = int(keep.sum(1).max())
        best = None
        for group_size in dict.fromkeys([None, 4, 8, 16, 32, widest]):
            if group_size is not None and group_size > widest:
                continue
            fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size=group_size)
            err = relative_error(fmt @ Bs[0], expected)
            t = median_ms(rotating(lambda B, f=fmt: f @ B, [(B,) for B in Bs]))
            print(f"  s={s} group_size={fmt.group_size}: {t:.3f} ms, err {err:.1e}", flush=True)
            if best is None or t < best[0]:
                best = (t, fmt, err)
        t_insum, fmt, err = best
        err_bsr = relative_error(bsr_dense_mm(bsr, Bs[0]), expected)
        t_dense = median_ms(rotating(lambda B, a=A: a @ B, [(B,) for B in Bs]))
        t_bsr = median_ms(rotating(lambda B, a=bsr: bsr_dense_mm(a, B), [(B,) for B in Bs]))
        flops = 2 * size**3 * keep.float().mean().item()
        rows.append(dict(sparsity=s, g=fmt.group_size, err=err, err_bsr=err_bsr, insum_ms=t_insum,
                         dense_ms=t_dense, bsr_ms=t_bsr, vs_dense=t_dense / t_insum, ideal=1 / (1 - s),
                         vs_bsr=t_bsr / t_insum, frac_tc=flops / (t_insum * 1e-3) / (roof["fp16_tflops"] * 1e12)))
        r = rows[-1]
        print(f"blockgroupcoo s={s:.2f} g={r['g']} err={err:.1e} insum={t_insum:.3f}ms dense={t_dense:.3f}ms "
              f"bsr={t_bsr:.3f}ms  vs dense x{r['vs_dense']:.2f} (ideal {r['ideal']:.0f}) vs bsr x{r['vs_bsr']:.2f} "
              f"tc-frac={r['frac_tc']:.2f}", flush=True)
    return rows


def host_overhead() -> dict:
    """Per-call time of a cached insum() on a tiny problem against a bare Triton launch."""
    A = (torch.rand(256, 256, device="cuda") < 0.05) * torch.randn(256, 256, device="cuda")
    fmt = GroupCOO.from_dense(A)
    B = torch.randn(256, 32, device="cuda")
    C = torch.zeros(256, 32, device="cuda")
    tensors = dict(fmt.tensors, B=B, C=C)
    expr = fmt.expression
    insum.insum(expr, **tensors)  # compiles, tunes and prepares the launch
    bare = host_us_per_call(bare_launcher(expr, tensors))
    full = host_us_per_call(lambda: insum.insum(expr, **tensors))
    print(f"host overhead: bare launch {bare:.1f}us/call, insum() {full:.1f}us/call, extra {full - bare:.1f}us")
    return dict(bare_us=bare, insum_us=full, extra_us=full - bare)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path(".data"))
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    roof = ceilings()
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{__import__('triton').__version__}; measured {roof['bandwidth_GBs']:.0f} GB/s, "
          f"{roof['fp16_tflops']:.0f} fp16 TFLOP/s", flush=True)
    overhead = host_overhead()
    blocks = blockgroupcoo_vs_dense(args.size, [0.5, 0.9, 0.99], roof)
    groups = groupcoo_vs_cusparse(args.data, args.limit, roof)
    geo = math.exp(sum(math.log(r["speedup"]) for r in groups) / len(groups))
    print("\n== summary ==")
    print(f"GroupCOO fp32 N=128 vs cuSPARSE: geomean x{geo:.2f} over {len(groups)} DLMC matrices; "
          f"worst err {max(r['err'] for r in groups):.1e}")
    for r in blocks:
        print(f"BlockGroupCOO fp16 {args.size}^3 s={r['sparsity']}: x{r['vs_dense']:.2f} vs cuBLAS "
              f"(ideal {r['ideal']:.0f}), x{r['vs_bsr']:.2f} vs TorchBSR, {r['frac_tc']:.0%} of tensor-core peak")
    print(f"host overhead: +{overhead['extra_us']:.1f}us over a bare launch ({overhead['insum_us']:.1f} vs {overhead['bare_us']:.1f})")


if __name__ == "__main__":
    main()
