"""Whether INSUM_WIDEN's value changes the host path of a product that is not widened: a
Block-ELL 4096^2 (64 x 64 blocks, s = 0.9) product into 1000 fp16 columns (16-byte rows:
never widened) under the switch's values in turn, each on a fresh format object, with its
repeats' pinned state, issue time per call and do_bench median; then a cProfile of the
repeats under INSUM_WIDEN=1.

    python -m benchmarks.explore.widen_probe

Session 18's `explore/shapes --only widen` saw that product's median move between the
variants (19.5 against 30.5 µs, device time 14.9 µs in each); this run (`session18/call5`)
found every repeat pinned and the same host time under each value.
"""

from __future__ import annotations

import os

import torch

from insum.formats import BlockGroupCOO

from ..common import host_us_per_call, median_ms, print_python_profile
from .shapes import _without_plans, block_random


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    A = block_random(4096, 4096, 64, 0.9, torch.float16, gen)
    base = BlockGroupCOO.from_dense(A, block=(64, 64), group_size="row")
    B = torch.randn(4096, 1000, device="cuda", dtype=torch.float16)
    for value in ("0", None, "1", "0", None):
        if value is None:
            os.environ.pop("INSUM_WIDEN", None)
        else:
            os.environ["INSUM_WIDEN"] = value
        f = _without_plans(base)
        for _ in range(5):
            f @ B
        plans = list(f.__dict__.get("_spmm_plans", {}).values())
        pinned = [type(p.pinned).__name__ if p.pinned is not None else None for p in plans]
        host = host_us_per_call(lambda f=f: f @ B, calls=500)
        median = median_ms(lambda f=f: f @ B) * 1e3
        print(f"INSUM_WIDEN={value}: pinned {pinned}, tries {[p.tries for p in plans]}, "
              f"issue {host:.1f} us a call, median {median:.1f} us", flush=True)
    os.environ["INSUM_WIDEN"] = "1"
    f = _without_plans(base)
    for _ in range(5):
        f @ B
    print_python_profile(lambda: f @ B, 300, limit=18)


if __name__ == "__main__":
    main()
