"""What the insum.nn layers do per call besides their statements: torch ops, bytes allocated,
statement launches, host time, for SparseConv3d and the tensor products, forward and
forward+backward. Runs on the CPU (statements through the torch backend, their work not
counted) or on a GPU (statements through the generated kernels, plus a profile of the layer
at the study's sizes: which kernels besides insum's take the time).

    python -m benchmarks.layer_overhead [--out DIR] [--profile]

Counting: a TorchDispatchMode sees every aten op the layer runs outside its insum statements
(view and metadata ops are counted apart); "allocated" sums the bytes of op outputs whose
storage is new (not an input's); a statement counts as one launch (stubbed: not run), and
the output it allocates (when the caller passed none) counts as allocated. The conv layer
runs its generated-kernel path (backend="triton", stubbed), as on a GPU. Host time: least wall time
of a call with every statement replaced by a no-op that returns its output unfilled.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import insum.nn.conv as conv_module
import insum.nn.tensor_product as tp_module
from insum import insum as real_insum
from insum.nn import FullyConnectedTensorProduct, TensorProduct, build_kernel_map
from insum.nn.conv import sparse_conv3d
from insum.parser import parse

_VIEWS = {"view", "_unsafe_view", "reshape", "slice", "select", "t", "transpose", "expand", "as_strided", "detach",
          "alias", "unsqueeze", "squeeze", "permute", "split", "unbind", "lift_fresh", "_reshape_alias", "unflatten"}


class _Count(TorchDispatchMode):
    """Aten ops and newly allocated bytes outside the statements (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.views = 0
        self.allocated = 0
        self.launches = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = func.overloadpacket.__name__
        if name in _VIEWS:
            self.views += 1
            return out
        self.ops[name] += 1
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)) if t.numel()}
        for t in _tensors(out):
            if t.numel() and t.untyped_storage().data_ptr() not in inputs:
                self.allocated += t.untyped_storage().nbytes()
        return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


@contextlib.contextmanager
def _statements(counter: _Count | None, stub: bool):
    """insum() inside the layers: counted as one launch each; stubbed (no work) when `stub`."""

    def call(expr, /, **kwargs):
        output = parse(expr).output.name
        given = output in kwargs
        if counter is not None:
            counter.paused = True
        try:
            if stub:
                out = kwargs[output] if given else _stub_output(expr, kwargs)
            else:
                out = real_insum(expr, **kwargs)
        finally:
            if counter is not None:
                counter.paused = False
        if counter is not None:
            counter.launches += 1
            if not given:
                counter.allocated += out.untyped_storage().nbytes()
        return out

    saved = conv_module.insum, tp_module.insum
    conv_module.insum = tp_module.insum = call
    try:
        yield
    finally:
        conv_module.insum, tp_module.insum = saved


def _stub_output(expr: str, kwargs: dict) -> torch.Tensor:
    from insum.bind import bind

    options = {"backend", "precision", "autotune", "check_indices", "sorted_indices", "unique_indices", "lengths"}
    bound = bind(parse(expr), {k: v for k, v in kwargs.items() if k not in options})
    first = next(v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.dtype.is_floating_point)
    return first.new_empty(bound.out_shape, dtype=bound.out_dtype)


def count(step) -> dict:
    """Ops, views, bytes allocated and launches of one call of `step` (after a warm-up call),
    the statements stubbed (their work is not counted; the outputs they allocate are)."""
    with _statements(None, stub=True):
        step()
    counter = _Count()
    with _statements(counter, stub=True), counter:
        step()
    return {"ops": sum(counter.ops.values()), "views": counter.views, "allocated_bytes": counter.allocated,
            "launches": counter.launches, "by_op": dict(sorted(counter.ops.items()))}


def host_us(step, repeat: int = 200) -> float:
    """Least wall time of `step` with every statement a no-op (microseconds; the least, not
    the median: the measuring machine may be shared)."""
    times = []
    with _statements(None, stub=True):
        for _ in range(5):
            step()
        for _ in range(5):  # rounds apart in time: a busy spell of a shared CPU spans fewer of them
            for _ in range(repeat // 5):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            time.sleep(0.5)
    return min(times) * 1e6


# --------------------------------------------------------------------------- the cases


def conv_cases(device, n: int = 2000, channels: int = 32, dtype=torch.float32):
    """SparseConv3d at one small scene, both forms, with and without bias, and absent="mask";
    the generated kernel's path (backend="triton": the tiles in one launch)."""
    gen = torch.Generator().manual_seed(0)
    coords = torch.unique(torch.randint(0, 24, (n, 3), generator=gen), dim=0).to(device)
    km = build_kernel_map(coords).prepare(tile=64, mask_dtype=dtype)
    x = torch.randn(coords.shape[0], channels, generator=gen).to(device, dtype)
    w = (torch.randn(3, 3, 3, channels, channels, generator=gen) / math.sqrt(27 * channels)).to(device, dtype)
    b = torch.randn(channels, generator=gen).to(device, dtype)
    g = torch.randn(coords.shape[0], channels, generator=gen).to(device, dtype)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    for form in ("tiles", "pairs"):
        for bias, absent in ((None, "zero_row"), (b, "zero_row"), (None, "mask")):
            name = f"conv {form}{' bias' if bias is not None else ''}{' mask' if absent == 'mask' else ''}"

            def forward(form=form, bias=bias, absent=absent):
                with torch.no_grad():
                    sparse_conv3d(x, w, km, bias, form=form, tile=64, absent=absent, backend="triton")

            def train(form=form, bias=bias, absent=absent):
                xg.grad = wg.grad = None
                sparse_conv3d(xg, wg, km, bias, form=form, tile=64, absent=absent, backend="triton").backward(g)

            yield f"{name} fwd", forward
            yield f"{name} fwd+bwd", train


def tp_cases(device, batch: int = 64):
    """The fully connected product (L = 2, 8 channels) and the channel-wise MACE-like one."""
    from insum.nn.tensor_product import mace_instructions

    fctp = FullyConnectedTensorProduct("8x0e+8x1o+8x2e", "0e+1o+2e", "8x0e+8x1o+8x2e", backend="torch").to(device)
    irreps1, irreps2 = "8x0e+8x1o+8x2e", "0e+1o+2e+3o"
    irreps_out, ins = mace_instructions(irreps1, irreps2, 3)
    uvu = TensorProduct(irreps1, irreps2, irreps_out, ins, shared_weights=False, backend="torch").to(device)
    gen = torch.Generator().manual_seed(1)
    for name, layer in (("fctp", fctp), ("uvu", uvu)):
        x1 = torch.randn(batch, layer.irreps_in1.dim, generator=gen).to(device)
        x2 = torch.randn(batch, layer.irreps_in2.dim, generator=gen).to(device)
        w = None if layer.shared_weights else torch.randn(batch, layer.weight_numel, generator=gen).to(device)
        g = torch.randn(batch, layer.irreps_out.dim, generator=gen).to(device)
        grads = [t.clone().requires_grad_() for t in (x1, x2) + (() if w is None else (w,))]

        def forward(layer=layer, x1=x1, x2=x2, w=w):
            with torch.no_grad():
                layer(x1, x2, w)

        def train(layer=layer, grads=grads, g=g):
            for t in grads:
                t.grad = None
            layer.zero_grad(set_to_none=True)
            layer(*grads).backward(g)

        yield f"{name} fwd", forward
        yield f"{name} fwd+bwd", train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--profile", action="store_true", help="on a GPU: profile the layers at the study sizes")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    print(f"{'case':<26} {'ops':>4} {'views':>5} {'launches':>8} {'allocated':>12} {'host us':>8}  ops")
    for name, step in [*conv_cases(device), *tp_cases(device)]:
        row = {"case": name, **count(step), "host_us": host_us(step)}
        rows.append(row)
        ops = " ".join(f"{k}x{v}" if v > 1 else k for k, v in row["by_op"].items())
        print(f"{name:<26} {row['ops']:>4} {row['views']:>5} {row['launches']:>8} {row['allocated_bytes']:>12,} "
              f"{row['host_us']:>8.1f}  {ops}", flush=True)
    if args.profile and device.type == "cuda":
        rows.append({"case": "profile", "table": profile_layers(device)})
        print(rows[-1]["table"], flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "layer_overhead.json").write_text(json.dumps(rows, indent=1))
    return 0


def profile_layers(device) -> str:
    """The conv layer (1.2M-voxel room, fp16, 32 and 128 channels, tiled form) taken apart on
    the GPU: do_bench of the layer, of its statements alone, of each op around them alone,
    and the layer's host time per call; then a profile of 10 calls by CUDA time and by CPU
    time (a blocking runtime call, cudaFree or a synchronize, shows in the second)."""
    from benchmarks.study_conv import room_scene

    coords = room_scene(1_000_000, seed=1_000_000, device=device)
    km = build_kernel_map(coords).prepare()
    lines = []
    for c in (32, 128):
        lines += _conv_breakdown(km, c, device)
        print("\n".join(lines), flush=True)
    return "\n".join(lines)


def _conv_breakdown(km, c: int, device) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common import host_us_per_call, median_ms
    from insum.nn.conv import TILED

    tiled = km.tiles(128)
    x = torch.randn(km.n_in, c, device=device, dtype=torch.float16)
    w = torch.randn(3, 3, 3, c, c, device=device, dtype=torch.float16) / math.sqrt(27 * c)
    w3 = w.reshape(27, c, c)
    x0 = torch.cat([x, x.new_zeros(1, c)])
    y = x.new_empty(tiled.n_tiles, tiled.tile, c)

    def layer():
        sparse_conv3d(x, w, km, form="tiles")

    def statements():
        for start, end, nb, tw in tiled.buckets:
            real_insum(TILED, O=y[start:end], X=x0, NB=nb, TW=tw, W=w3, check_indices=False)

    parts = {
        "layer": layer,
        "statements": statements,
        "zero-row cat": lambda: torch.cat([x, x.new_zeros(1, c)]),
        "gather back (index_select)": lambda: torch.index_select(y.view(-1, c), 0, tiled.inverse),
        "gather back (advanced indexing)": lambda: y.view(-1, c)[tiled.inverse],
        "new_empty tiles": lambda: x.new_empty(tiled.n_tiles, tiled.tile, c),
    }
    layer()
    lines = [f"conv tiles C={c} N={km.n_in}: do_bench medians, ms"]
    for name, fn in parts.items():
        lines.append(f"  {name:<34} {median_ms(fn):8.3f}")
    lines.append(f"  layer host time per call (us)      {host_us_per_call(layer, calls=200):8.1f}")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            layer()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    lines.append(averages.table(sort_by="cuda_time_total", row_limit=12))
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=12))
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
