"""Host time of a repeated tensor-core product's launch, with its tensor maps kept
(`insum.direct._TensorMaps`) and encoded on every launch by Triton (INSUM_KEEP_TENSOR_MAPS=0),
alternating in one process; with each product's do_bench median and graphed device time.

    python -m benchmarks.explore.launch_host [--profile]

Issue time: the least over 7 runs of 50 calls queued without a sync (the host's load moves
single runs by 2x). When it exceeds do_bench's L2 flush plus the kernel, do_bench's median
includes host gaps; the graphed time (a CUDA graph of 20 calls) has none.
"""

from __future__ import annotations

import argparse
import os

import torch

from insum.formats import NM, BlockGroupCOO

from ..common import (
    block_sparse,
    graphed_ms,
    median_ms,
    print_python_profile,
    relative_error,
    rotating,
)
from .layer_host import issue_us

MODES = {"kept": "1", "encoded": "0"}  # INSUM_KEEP_TENSOR_MAPS


def products() -> list[tuple[str, object, list, torch.Tensor]]:
    """(name, fmt, Bs, A) for the points the report's short products sit at."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    points = []
    for size, block, s in [(4096, 32, 0.9), (4096, 64, 0.9), (4096, 128, 0.9), (4096, 64, 0.99)]:
        A, _ = block_sparse(size, block, s, torch.float16, gen, "cuda")
        fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row")
        points.append((f"Block-ELL {size}^3 b{block} s={s}", fmt, A))
    A = torch.randn(4096, 4096, device="cuda", dtype=torch.float16, generator=gen)
    fmt = NM.from_dense(A, n=1, m=8, vector_len=128)
    points.append(("N:M 1:8 4096^3", fmt, fmt.to_dense()))
    Bs = [torch.randn(4096, 4096, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
    return [(name, fmt, Bs, A) for name, fmt, A in points]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="cProfile the kept-map calls of the first point")
    args = parser.parse_args()
    rows = []
    for name, fmt, Bs, A in products():
        err = relative_error(fmt @ Bs[0], A.double() @ Bs[0].double())
        line = {"name": name, "err": err}
        for mode, value in MODES.items():
            os.environ["INSUM_KEEP_TENSOR_MAPS"] = value
            line[f"issue {mode}"] = issue_us(lambda f=fmt, B=Bs[0]: f @ B, calls=50, repeats=7)[0]
            line[f"do_bench {mode}"] = median_ms(rotating(lambda B, f=fmt: f @ B, [(B,) for B in Bs])) * 1e3
        os.environ["INSUM_KEEP_TENSOR_MAPS"] = "1"
        line["graphed"] = graphed_ms(lambda f=fmt, B=Bs[0]: f @ B) * 1e3
        rows.append(line)
        print(f"{name:28s} err {err:.1e}  " + "  ".join(f"{k} {v:7.1f}" for k, v in line.items()
                                                        if k not in ("name", "err")), flush=True)
    print("\nus per call          | host issue kept / encoded | do_bench kept / encoded | graphed")
    for line in rows:
        print(f"{line['name']:28s} | {line['issue kept']:6.1f} / {line['issue encoded']:6.1f} | "
              f"{line['do_bench kept']:6.1f} / {line['do_bench encoded']:6.1f} | {line['graphed']:6.1f}")
    if args.profile:
        name, fmt, Bs, _ = products()[2]
        print(f"\ncProfile, {name}, maps kept:")
        print_python_profile(lambda: fmt @ Bs[0], calls=300)


if __name__ == "__main__":
    main()
