"""Where a short block-sparse program's tensor descriptors come from: made in the kernel, or
given by the host.

    python -m benchmarks.explore.host_descriptors [--budget 240]

Why: the generated kernels make their tensor descriptors in every program
(`tl.make_tensor_descriptor`: the program writes a 128-byte tensor map to global scratch
and fences it before its first TMA load). A Block-ELL program at s = 0.9 runs only 3-13 K
steps, so that fixed cost per program weighs against its loop. A descriptor made on the
host (`triton.tools.tensor_descriptor.TensorDescriptor`) reaches the kernel as a launch
parameter, with nothing to write or fence. This times one hand-written Block-ELL kernel
(`C[p, m, n] = sum_q AV[p, q, m, k] * B[AK[p, q] * bk + k, n]`, rows stopping at their
length, longest rows first), identical but for where the descriptors of AV and B come
from (and a third variant that also stores C through a host descriptor), over the same
small set of tile configurations, beside cuBLAS and the library's own `fmt @ B` (tuned),
each checked against a float64 product.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from insum.formats import BlockGroupCOO

from ..common import block_sparse, median_ms, relative_error, rotating
from .tensorcore import block_ell

CASES = [(4096, 64, 0.9), (4096, 128, 0.9), (4096, 64, 0.75), (4096, 128, 0.5), (8192, 64, 0.9), (8192, 128, 0.9)]
CONFIGS = [(128, 4, 3), (128, 4, 4), (256, 8, 3), (256, 4, 3), (128, 8, 4)]  # (BLOCK_N, warps, stages)


@triton.jit
def _block_ell(C, AV, AK, AL, ORDER, B, N, K, ROWS, G, av_desc, b_desc, c_desc,
               BM: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr, HOST: tl.constexpr, TMA_STORE: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    p = tl.load(ORDER + pid // tiles_n)
    pid_n = pid % tiles_n
    if not HOST:
        av_desc = tl.make_tensor_descriptor(AV, shape=[ROWS, BK], strides=[BK, 1],
                                            block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(B, shape=[K, N], strides=[N, 1], block_shape=[BK, BLOCK_N])
    length = tl.load(AL + p)
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    for q in range(0, length):
        kb = tl.load(AK + p * G + q)
        a = av_desc.load([(p * G + q) * BM, 0])
        b = b_desc.load([kb * BK, pid_n * BLOCK_N])
        acc = tl.dot(a, b, acc)
    if TMA_STORE:
        c_desc.store([p * BM, pid_n * BLOCK_N], acc.to(tl.float16))
    else:
        offs_m = p * BM + tl.arange(0, BM)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(C + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.float16))


def block_rows(A: torch.Tensor, keep: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """Block-ELL of A (`tensorcore.block_ell`) with AL (blocks per row) and ORDER (rows, longest first)."""
    AL = keep.sum(1).to(torch.int32)
    return {**block_ell(keep, A, block), "AL": AL, "ORDER": torch.argsort(AL, descending=True, stable=True).to(torch.int32)}


def launch(variant: str, rows: dict, B: torch.Tensor, C: torch.Tensor, block: int, config: tuple) -> None:
    block_n, warps, stages = config
    nb, G = rows["AK"].shape
    N = B.shape[1]
    host = variant != "device"
    av = rows["AV"].view(-1, block)
    av_desc = TensorDescriptor.from_tensor(av, [block, block]) if host else av
    b_desc = TensorDescriptor.from_tensor(B, [block, block_n]) if host else B
    c_desc = TensorDescriptor.from_tensor(C, [block, block_n]) if variant == "host+store" else C
    grid = (nb * triton.cdiv(N, block_n),)
    _block_ell[grid](C, rows["AV"], rows["AK"], rows["AL"], rows["ORDER"], B, N, B.shape[0], av.shape[0], G, av_desc, b_desc, c_desc,
                     BM=block, BK=block, BLOCK_N=block_n, HOST=host, TMA_STORE=variant == "host+store",
                     num_warps=warps, num_stages=stages)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=240.0)
    args = parser.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    start = time.time()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    for size, block, s in CASES:
        if time.time() - start > args.budget:
            print(f"budget spent before {size} b{block} s={s}", flush=True)
            break
        print("\n   ".join(run_case(size, block, s)), flush=True)


def run_case(size: int, block: int, s: float) -> list[str]:
    """One point: cuBLAS, the library's product, and each variant at its best configuration."""
    gen = torch.Generator(device="cuda").manual_seed(size + block)
    Bs = [torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
    D = torch.randn(size, size, device="cuda", dtype=torch.float16, generator=gen)
    A, keep = block_sparse(size, block, s, torch.float16, gen, "cuda")
    expected = A.double() @ Bs[0].double()
    rows = block_rows(A, keep, block)
    C = torch.empty(size, size, device="cuda", dtype=torch.float16)
    t_dense = median_ms(rotating(lambda B: D @ B, [(B,) for B in Bs]))
    fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row")
    fmt @ Bs[0]
    t_lib = median_ms(rotating(lambda B: fmt @ B, [(B,) for B in Bs]))
    line = [f"{size}^3 b{block} s={s}: cuBLAS {t_dense * 1e3:.1f} us, fmt @ B {t_lib * 1e3:.1f} us "
            f"({t_dense / t_lib:.2f}x)"]
    for variant in ("device", "host", "host+store"):
        best = None
        for config in CONFIGS:
            try:
                C.fill_(float("nan"))
                launch(variant, rows, Bs[0], C, block, config)
                err = relative_error(C, expected)
                if not err < 1e-2:
                    line.append(f"{variant} {config} wrong ({err:.1e})")
                    continue
                ms = median_ms(rotating(lambda B, v=variant, c=config: launch(v, rows, B, C, block, c),
                                        [(B,) for B in Bs]))
            except Exception as e:  # noqa: BLE001 (a configuration that does not fit: skipped)
                line.append(f"{variant} {config} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            if best is None or ms < best[0]:
                best = (ms, config)
        if best:
            line.append(f"{variant} {best[0] * 1e3:.1f} us {best[1]} ({t_dense / best[0]:.2f}x)")
    return line

if __name__ == "__main__":
    main()
