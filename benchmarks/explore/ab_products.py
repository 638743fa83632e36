"""The tensor-core products a user calls, timed beside cuBLAS: for an A/B of two trees in
separate processes (`ab_products.sh`), each tuned as a user's first call tunes it.

    python -m benchmarks.explore.ab_products [--label new] [--quick]

Block-ELL (`BlockGroupCOO(group_size="row")`) at 32, 64 and 128-wide blocks, N:M 2:8 and
1:8, the dense and gathered GEMMs (`insum()`), fp16, each checked against a float64
product; one line per point: insum's median, cuBLAS's, their ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from insum import insum
from insum.formats import NM, BlockGroupCOO

from ..common import block_sparse, graphed_ms, median_ms, relative_error, rotating

BLOCKS = [(4096, 32, 0.9), (4096, 64, 0.9), (4096, 64, 0.5), (4096, 128, 0.9), (4096, 128, 0.5),
          (8192, 64, 0.9), (8192, 128, 0.9), (8192, 128, 0.5)]
NMS = [(4096, 2, 8), (4096, 1, 8), (8192, 1, 8)]
GEMMS = [4096, 8192]
HOST = False  # --host


def point(label: str, name: str, fn, Bs: list, expected: torch.Tensor, t_dense: float) -> None:
    err = relative_error(fn(Bs[0]), expected)
    ms = median_ms(rotating(fn, [(B,) for B in Bs]))
    line = f"{label:5s} {name:28s} {ms * 1e3:8.1f} us  cuBLAS {t_dense * 1e3:8.1f} us  {t_dense / ms:5.2f}x  err {err:.1e}"
    if HOST:  # the host's issue time per call (no sync between calls) and the device's (a CUDA graph of 20 calls)
        issues = []
        for _ in range(7):  # the least of 7 runs of 30 calls: the host's load moves single runs by 2x
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(30):
                fn(Bs[0])
            issues.append((time.perf_counter() - start) / 30)
        issue = min(issues)
        torch.cuda.synchronize()
        device = graphed_ms(lambda: fn(Bs[0]))
        line += f"  host {issue * 1e6:6.1f} us  graphed {device * 1e3:6.1f} us"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="")
    parser.add_argument("--quick", action="store_true", help="4096 points only")
    parser.add_argument("--host", action="store_true", help="also host issue time and graphed device time per call")
    args = parser.parse_args()
    global HOST
    HOST = args.host
    dense_ms: dict[int, float] = {}

    def operands(size: int, seed: int):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        Bs = [torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
        if size not in dense_ms:
            D = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen)
            dense_ms[size] = median_ms(rotating(lambda B: D @ B, [(B,) for B in Bs]))
        return gen, Bs

    for size in GEMMS if not args.quick else GEMMS[:1]:
        gen, Bs = operands(size, size)
        A = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen)
        rows = torch.randperm(size, device="cuda", generator=gen).to(torch.int32)
        expected = A.double() @ Bs[0].double()
        point(args.label, f"dense {size}^3", lambda B, A=A: insum("C[m, n] = A[m, k] * B[k, n]", A=A, B=B), Bs,
              expected, dense_ms[size])
        point(args.label, f"gathered {size}^3", lambda B, A=A, rows=rows: insum("C[m, n] = A[m, k] * B[I[k], n]", A=A,
              B=B, I=rows), Bs, A.double() @ Bs[0].double()[rows.long()], dense_ms[size])
    for size, block, s in BLOCKS:
        if args.quick and size > 4096:
            continue
        gen, Bs = operands(size, size + block)
        A, _ = block_sparse(size, block, s, torch.float16, gen, "cuda")
        fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row")
        point(args.label, f"Block-ELL {size}^3 b{block} s={s}", lambda B, f=fmt: f @ B, Bs, A.double() @ Bs[0].double(),
              dense_ms[size])
    for size, n, m in NMS:
        if args.quick and size > 4096:
            continue
        gen, Bs = operands(size, size + 7 * n + m)
        A = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen)
        fmt = NM.from_dense(A, n=n, m=m, vector_len=128)
        point(args.label, f"N:M {n}:{m} {size}^3", lambda B, f=fmt: f @ B, Bs, fmt.to_dense().double() @ Bs[0].double(),
              dense_ms[size])
    from insum import runtime

    launches = [(k, launch) for k in runtime._KERNELS.values() for launch in k._launchers.values()
                if getattr(launch, "config", None)]
    off = {str(k.spec.stmt): launch.direct.why_not for k, launch in launches if launch.direct.why_not}
    print(f"{args.label:5s} direct launches off: {off or 'none'}", flush=True)
    for k, launch in launches:  # the tuner's choices
        extents = ",".join(f"{v}={e}" for v, e in launch.extents.items())
        print(f"{args.label:5s} tuned {k.spec.stmt}  [{extents}]  {launch.config}", flush=True)


if __name__ == "__main__":
    main()
