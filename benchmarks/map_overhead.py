"""What insum's kernel-map build costs in torch ops and host syncs, counted on the CPU: the
forward build (map + one-launch tiles, what SparseConv3d's forward reads on a GPU) and the
training extras (transposed map and its tiles, pair groups), on a voxelised room.

    python -m benchmarks.map_overhead [--voxels 3000] [--out DIR]
    TRITON_INTERPRET=1 python -m benchmarks.map_overhead   # also the CUDA path (its Triton kernels)

On a GPU every counted op is at least one kernel launch (a few host microseconds each) and
every sync stalls the host until the device has drained its queue, so at 100k-1M voxels
these counts, not bandwidth, set the build time. Counted by a TorchDispatchMode: aten ops
(view and metadata ops apart), and as host syncs the ops whose result or output size the
host must read: `_local_scalar_dense` (`.item()`, `int(t)`), `Tensor.tolist`, `nonzero`,
`unique`, `masked_select`, boolean-mask indexing and `repeat_interleave` without
`output_size`. Triton kernels launched by the build count as one op each. On the CPU the
build takes its torch lookup; under TRITON_INTERPRET=1 the cases are also counted with the
lookup kernel that CUDA takes (`kernel_map._use_kernels` switched on).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.layer_overhead import _VIEWS
from insum.nn.kernel_map import build_kernel_map

_SYNCS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}


class _Count(TorchDispatchMode):
    """Aten ops and host syncs (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.views = 0
        self.paused = False  # inside a Triton launch (the interpreter's own tensor work)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _VIEWS:
            self.views += 1
        else:
            self.ops[name] += 1
        if name in _SYNCS:
            self.syncs[name] += 1
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()
        ):
            self.syncs[f"{name}[bool mask]"] += 1
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.syncs[name] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _counting_tolist_and_kernels(counter: _Count):
    """Tensor.tolist (no aten op) as a sync; the build's Triton launches as ops."""
    import insum.nn.kernel_map as kernel_map

    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counter.syncs["tolist"] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    launch = getattr(kernel_map, "_launch", None)
    if launch is not None:
        def counted_launch(kernel, grid, *args, **kwargs):
            counter.ops[f"triton:{kernel.fn.__name__}"] += 1
            counter.paused = True
            try:
                return launch(kernel, grid, *args, **kwargs)
            finally:
                counter.paused = False

        kernel_map._launch = counted_launch
    try:
        yield
    finally:
        torch.Tensor.tolist = tolist
        if launch is not None:
            kernel_map._launch = launch


@contextlib.contextmanager
def _lookup_path(fused: bool):
    import insum.nn.kernel_map as kernel_map

    chosen = kernel_map._use_kernels
    kernel_map._use_kernels = lambda device: fused
    try:
        yield
    finally:
        kernel_map._use_kernels = chosen


def count(step) -> dict:
    """Ops, syncs and views of one call of `step` (after a warm-up call)."""
    step()
    counter = _Count()
    with _counting_tolist_and_kernels(counter), counter:
        step()
    return {"ops": sum(counter.ops.values()), "syncs": sum(counter.syncs.values()), "views": counter.views,
            "by_op": dict(sorted(counter.ops.items())), "by_sync": dict(sorted(counter.syncs.items()))}


def cases(coords: torch.Tensor, tile: int = 128):
    """(name, step): each step builds its map from scratch (no cached packing)."""
    def forward():
        build_kernel_map(coords).tiles_whole(tile)

    def forward_layer():  # what SparseConv3d's first forward reads: + the pairs count (form="auto"), output rows
        km = build_kernel_map(coords)
        km.pairs, km.tiles_whole(tile), km.tiles(tile).output_rows()

    def build_only():
        build_kernel_map(coords)

    def train():
        km = build_kernel_map(coords)
        km.tiles_whole(tile), km.transpose().tiles_whole(tile), km.pair_groups()

    return [("build_kernel_map", build_only), ("map + tiles_whole (map_fwd)", forward),
            ("+ pairs, output rows (layer forward)", forward_layer), ("+ transposed tiles, pair groups (map_train)", train)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--voxels", type=int, default=3000, help="target voxels of the room scene")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)
    from benchmarks.study_conv import room_scene

    coords = room_scene(args.voxels, seed=args.voxels, device=torch.device("cpu"))
    rows = []
    print(f"room scene: {coords.shape[0]} voxels (CPU counts; on a GPU every op is at least one launch)")
    print(f"{'case':<52} {'ops':>4} {'syncs':>5} {'views':>5}  syncs by kind | ops")
    paths = [("torch lookup", False)] + ([("triton kernels (the CUDA path)", True)] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    for path, fused in paths:
        for name, step in cases(coords):
            with _lookup_path(fused):
                row = {"case": name, "path": path, "voxels": coords.shape[0], **count(step)}
            rows.append(row)
            syncs = " ".join(f"{k}x{v}" for k, v in row["by_sync"].items()) or "-"
            ops = " ".join(f"{k}x{v}" if v > 1 else k for k, v in row["by_op"].items())
            print(f"{path + ': ' + name:<52} {row['ops']:>4} {row['syncs']:>5} {row['views']:>5}  {syncs} | {ops}",
                  flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "map_overhead.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
