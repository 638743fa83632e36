"""What insum's kernel-map build costs in torch ops and host syncs, counted on the CPU: the
forward build (map + one-launch tiles, what SparseConv3d's forward reads on a GPU) and the
training extras (transposed map and its tiles, pair groups), on a voxelised room.

    python -m benchmarks.map_overhead [--voxels 3000] [--out DIR]
    TRITON_INTERPRET=1 python -m benchmarks.map_overhead   # also the CUDA path (its Triton kernels)

On a GPU every counted op is at least one kernel launch (a few host microseconds each) and
every sync stalls the host until the device has drained its queue, so at 100k-1M voxels
these counts, not bandwidth, set the build time. Counted by `insum.formats.opcount.count_ops`
(non-view aten ops; syncs: `.item()`, `tolist`, `nonzero`, `unique`, boolean masks,
`repeat_interleave` without `output_size`, `torch.tensor` uploads, ...), each Triton launch
of the build as one op. On the CPU the build takes its torch ops; under TRITON_INTERPRET=1
the cases are also counted with the kernels that CUDA takes (`kernel_map._use_kernels`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

import insum.nn.kernel_map as kernel_map
from insum.formats.opcount import count_ops
from insum.nn.kernel_map import build_kernel_map


@contextlib.contextmanager
def _build_path(kernels: bool, counter=None):
    """The build with its Triton kernels or its torch ops; each launch counted as one op
    (the interpreter's own tensor work inside it not counted)."""
    if not hasattr(kernel_map, "_launch"):  # a build without kernels (an older tree, for before/after)
        yield
        return
    chosen, launch = kernel_map._use_kernels, kernel_map._launch

    def counted_launch(kernel, grid, *args, **kwargs):
        if counter is not None:
            counter.ops += 1
            counter.names[f"triton:{kernel.fn.__name__}"] += 1
        with _disable_current_modes():
            launch(kernel, grid, *args, **kwargs)

    kernel_map._use_kernels, kernel_map._launch = (lambda device: kernels), counted_launch
    try:
        yield
    finally:
        kernel_map._use_kernels, kernel_map._launch = chosen, launch


def count(step, kernels: bool) -> dict:
    """Ops and syncs of one call of `step` (after a warm-up call)."""
    with _build_path(kernels):
        step()
    counter = count_ops()
    with _build_path(kernels, counter), counter:
        step()
    return {"ops": counter.ops, "syncs": counter.syncs, "by_op": dict(sorted(counter.names.items())),
            "by_sync": dict(sorted(counter.sync_names.items()))}


def cases(coords: torch.Tensor, tile: int = 128):
    """(name, step): each step builds its map from scratch (no cached packing)."""
    def build_only():
        build_kernel_map(coords)

    def forward():
        build_kernel_map(coords).tiles_whole(tile)

    def forward_layer():  # what SparseConv3d's first forward reads: + the pairs count (form="auto"), output rows
        km = build_kernel_map(coords)
        km.pairs, km.tiles_whole(tile), km.tiles(tile).output_rows()

    def train():
        km = build_kernel_map(coords)
        km.tiles_whole(tile), km.transpose().tiles_whole(tile), km.pair_groups()

    return [("build_kernel_map", build_only), ("map + tiles_whole (map_fwd)", forward),
            ("+ pairs, output rows (layer forward)", forward_layer),
            ("+ transposed tiles, pair groups (map_train)", train)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--voxels", type=int, default=3000, help="target voxels of the room scene")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)
    from benchmarks.study_conv import room_scene

    coords = room_scene(args.voxels, seed=args.voxels, device=torch.device("cpu"))
    rows = []
    print(f"room scene: {coords.shape[0]} voxels (CPU counts; on a GPU every op is at least one launch)")
    print(f"{'path':<14} {'case':<44} {'ops':>4} {'syncs':>5}  syncs by kind | ops")
    paths = [("torch ops", False)] + ([("triton (CUDA)", True)] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    for path, kernels in paths:
        for name, step in cases(coords):
            row = {"case": name, "path": path, "voxels": coords.shape[0], **count(step, kernels)}
            rows.append(row)
            syncs = " ".join(f"{k}x{v}" for k, v in row["by_sync"].items()) or "-"
            ops = " ".join(f"{k}x{v}" if v > 1 else k for k, v in row["by_op"].items())
            print(f"{path:<14} {name:<44} {row['ops']:>4} {row['syncs']:>5}  {syncs} | {ops}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "map_overhead.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
