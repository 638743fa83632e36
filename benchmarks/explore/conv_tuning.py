"""Does the tuner pick the same tile for a small convolution in every process?

    python -m benchmarks.explore.conv_tuning [--channels 24,32,48] [--voxels 150000]

The A/B runs of session 17 (`explore/shapes --only channels`, separate processes with empty
kernel caches, same code at 24, 32 and 48 channels) timed the same SparseConv3d forward
1.5-2.2x apart between processes (32 channels: 0.134 against 0.300 ms). The layer runs the
grouped pairs there (`form="auto"`, 1.7M pairs), one generated kernel. Per channel count this
times every candidate of that kernel both ways the repository times things: as the tuner
does (CUDA-graph replays of one input set, warm L2, `runtime.graphed_bench`) and as the
studies do (do_bench medians, L2 flushed), each launch checked against a float64 product,
and prints the tuner's own choice and where it ranks on each side.
"""

from __future__ import annotations

import argparse

import torch

from insum.bind import bind
from insum.codegen.tune import configs_for, prune_configs
from insum.nn import SparseConv3d
from insum.nn.conv import PAIRS, _pair_tensors, _with_zero_row
from insum.parser import parse
from insum.runtime import graphed_bench, kernel_for

from ..common import host_us_per_call, median_ms, relative_error
from ..study_conv import room_scene


def run_case(coords: torch.Tensor, channels: int) -> None:
    torch.manual_seed(0)
    conv = SparseConv3d(channels, channels, 3).to("cuda", torch.float16)
    km = conv.kernel_map(coords)
    x = _with_zero_row(torch.randn(coords.shape[0], channels, device="cuda").half())
    pairs = _pair_tensors(km, conv.tile, "zero_row", x.dtype)
    weight = conv.weight.detach().reshape(-1, channels, channels)
    # The layer first, tuning as a user's first call does; then its kernel's choice.
    layer_us = median_ms(lambda: conv(x[:-1], coords)) * 1e3
    out = torch.zeros(km.n_out, channels, device="cuda")
    bound = bind(parse(PAIRS), {"O": out, "X": x, "W": weight, **pairs})
    kernel = kernel_for(bound)
    kernel.launch(bound, out)
    launcher = kernel.prepared(bound)
    chosen = dict(launcher.config)
    print(f"{channels} channels: the layer {layer_us:.1f} us; its kernel's tuned table {dict(kernel.tuned)}", flush=True)
    # Where the layer's time goes: the host's issue time per call, and each kernel's device time.
    host_us = host_us_per_call(lambda: conv(x[:-1], coords), calls=200)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            conv(x[:-1], coords)
        torch.cuda.synchronize()
    kernels = {e.key[:60]: round(e.device_time_total / 10, 1) for e in prof.key_averages() if e.device_time_total > 0}
    print(f"  host {host_us:.1f} us a call; device per call {kernels}", flush=True)
    # The tuner again, three times, on the same arguments.
    candidates = [launcher.fitted(c) for c in prune_configs(kernel.plan, configs_for(kernel.plan), launcher.extents)]
    for _ in range(3):
        args = launcher.tuning_args(launcher.args(bound.tensors, out))
        print(f"  the tuner again: {kernel._autotune(args, launcher.grid_fn, candidates, launcher.blocks_hook(kernel.param_names))}",
              flush=True)
    X, W = x.double(), weight.double()
    PI, PO, PW = (pairs[k].long() for k in ("PI", "PO", "PW"))
    expected = torch.zeros(km.n_out, channels, dtype=torch.float64, device="cuda")
    expected.index_add_(0, PO.flatten(), torch.einsum("pqc,pcd->pqd", X[PI], W[PW]).flatten(0, 1))
    rows = []
    for config in candidates:
        launcher.set_config(config)
        launch, arguments = launcher.direct, launcher.args(bound.tensors, out)
        out.zero_()
        launch(kernel.fn, arguments)
        err = relative_error(out, expected)
        cold = median_ms(lambda launch=launch, fn=kernel.fn, arguments=arguments: launch(fn, arguments))
        warm = graphed_bench(lambda launch=launch, fn=kernel.fn, arguments=arguments: launch(fn, arguments), [0.5])[0]
        rows.append((config, warm, cold, err))
    launcher.set_config(chosen)
    by_warm = sorted(rows, key=lambda r: r[1])
    by_cold = sorted(rows, key=lambda r: r[2])
    print(f"{channels} channels, {km.pairs} pairs, {len(rows)} candidates; the layer now "
          f"{median_ms(lambda: conv(x[:-1], coords)) * 1e3:.1f} us", flush=True)
    for config, warm, cold, err in rows:
        tags = [t for t, hit in (("tuned", config == chosen), ("best warm", config == by_warm[0][0]),
                                 ("best cold", config == by_cold[0][0])) if hit]
        print(f"  warm {warm * 1e3:7.1f} us (#{by_warm.index((config, warm, cold, err)) + 1:2d})  "
              f"cold {cold * 1e3:7.1f} us (#{by_cold.index((config, warm, cold, err)) + 1:2d})  err {err:.1e}  "
              f"{config} {' '.join(tags)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--channels", default="24,32,48")
    parser.add_argument("--voxels", type=int, default=150_000)
    args = parser.parse_args()
    coords = room_scene(args.voxels, seed=3, device="cuda")[:, 1:] + 4
    for channels in args.channels.split(","):
        run_case(coords, int(channels))


if __name__ == "__main__":
    main()
