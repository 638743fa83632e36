"""Which configuration the tuner keeps for a format's product, and its time as `fmt @ B`:

    python -m benchmarks.explore.tuned_choice

Checks whether a configuration that a sweep found faster (`config_sweep`) is what the tuner
picks inside the suite's path (Block-ELL 64x64 and 32x32 at s = 0.9, 4096^3 fp16)."""

from __future__ import annotations

import torch

from insum import runtime
from insum.formats import BlockGroupCOO

from ..common import block_sparse, median_ms, rotating


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(11)
    for block in (64, 32):
        A, _ = block_sparse(4096, block, 0.9, torch.float16, gen, "cuda")
        Bs = [torch.randn(4096, 4096, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2)]
        fmt = BlockGroupCOO.from_dense(A, block=(block, block), group_size="row")
        before = set(runtime._KERNELS)
        fmt @ Bs[0]
        ms = median_ms(rotating(lambda B, f=fmt: f @ B, [(B,) for B in Bs]))
        for spec, kernel in runtime._KERNELS.items():
            if spec not in before:
                print(f"{block}x{block}: fmt @ B {ms * 1e3:.1f} us; tuned {dict(kernel.tuned)}", flush=True)


if __name__ == "__main__":
    main()
