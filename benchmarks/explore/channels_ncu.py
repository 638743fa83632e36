"""The conv's gathered-rows statement (`insum.nn.conv.TILED`, fp16) at one channel count, for
Nsight Compute: 120 channels ran 2.1x slower than 128 on the H200 (`explore/shapes`, session 16).

    python -m benchmarks.explore.channels_ncu --channels 120     (tunes; the choice lands in INSUM_CACHE_DIR)
    ncu --kernel-name regex:insum --launch-count 1 ... python -m benchmarks.explore.channels_ncu --channels 120
"""

from __future__ import annotations

import argparse

import torch

import insum
from insum.bind import bind
from insum.nn.conv import TILED
from insum.parser import parse
from insum.runtime import kernel_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--channels", type=int, default=120)
    args = parser.parse_args()
    c, (t, m, j, n) = args.channels, (1400, 128, 27, 180_000)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        "X": torch.randn(n, c, device="cuda", generator=gen).half(),
        "NB": torch.randint(0, n, (t, m, j), device="cuda", generator=gen, dtype=torch.int32),
        "TW": torch.randint(0, j, (t, j), device="cuda", generator=gen, dtype=torch.int32),
        "W": torch.randn(j, c, c, device="cuda", generator=gen).half(),
    }
    for _ in range(2):
        insum.insum(TILED, **tensors)
    torch.cuda.synchronize()
    kernel = kernel_for(bind(parse(TILED), tensors))
    print(c, "channels, tuned:", dict(kernel.tuned), flush=True)


if __name__ == "__main__":
    main()
