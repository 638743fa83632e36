"""Where the kernel-map build's time goes at 100k-1M voxels: torch.profiler tables (GPU
kernels and host ops) of insum's map + tiles (inference) and + transposed tiles and pair
groups (training), the wall time per call against the summed kernel time (the rest is host
time and syncs), and spconv-triton's build beside it when installed.

    python -m benchmarks.explore.profile_kmap [--sizes 120000,1200000] [--time-only]
"""

from __future__ import annotations

import argparse

import torch

from insum.formats.tuning import median_wall_time
from insum.nn.kernel_map import build_kernel_map

from ..study_conv import _spconv, _spconv_map_times, room_scene


def _wall_ms(fn) -> float:
    """Median wall milliseconds of a call, synchronised around each (host time included)."""
    return median_wall_time(fn, 20, torch.device("cuda")) * 1e3


def _profile(name: str, fn) -> None:
    from torch.profiler import ProfilerActivity, profile

    wall = _wall_ms(fn)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events) / 5
    print(f"\n== {name}: wall {wall:.3f} ms per call, GPU kernels {kernel_us / 1e3:.3f} ms per call ==")
    print(events.table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=70))


def _scene(coords: torch.Tensor, spconv, time_only: bool) -> None:
    def inference():
        build_kernel_map(coords).tiles_whole(128)

    def training():
        km = build_kernel_map(coords)
        km.tiles_whole(128), km.transpose().tiles_whole(128), km.pair_groups()

    print(f"\n#### {coords.shape[0]} voxels")
    if time_only:
        for name, fn in (("map + tiles", inference), ("training", training), ("build", lambda: build_kernel_map(coords))):
            print(f"{name}: wall {min(_wall_ms(fn) for _ in range(3)):.3f} ms per call (least of 3 medians)")
        if spconv is not None:
            print(_spconv_map_times(spconv, coords))
        return
    _profile("insum map + tiles", inference)
    _profile("insum map + tiles + transposed tiles + pair groups", training)
    _profile("insum build alone", lambda: build_kernel_map(coords))
    if spconv is not None:
        print(_spconv_map_times(spconv, coords))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="120000,1200000")
    parser.add_argument("--time-only", action="store_true", help="wall times only, no profiler tables")
    args = parser.parse_args()
    spconv, why = _spconv()
    print(f"spconv-triton: {'ok' if spconv else why}")
    for size in map(int, args.sizes.split(",")):
        _scene(room_scene(size, seed=0, device="cuda"), spconv, args.time_only)


if __name__ == "__main__":
    main()
