"""Host time of one SparseLinear's training step, piece by piece, on the GPU host: the
forward, the whole step, and each part of the backward run alone (views, x's gradient on
the transposed pattern, the values' gradient, the bias add and its gradient's sum), against
nn.Linear. A narrow batch keeps every kernel shorter than its host time, so that the
issue time measured (no sync between calls) is the host's.

    python -m benchmarks.explore.layer_host [--width 4096] [--batch 256] [--profile] [--torch-profile] [--device-times]

"shaped autograd.Function" passes the traced path's arguments (x, the bias, every tensor of
the format, the transposed pattern's and the gradient tables') through a Function that
launches nothing and returns gradients of the layer's shapes: the autograd machinery at that
signature; "kept-shaped" the kept path's (x, the bias, the value tensors). --torch-profile lists the host ops of the layer's steps (torch.profiler, self CPU).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

from insum.nn import SparseLinear, sparse_autograd
from insum.nn.sparse_autograd import _value_gradients

from ..common import print_python_profile


def issue_us(fn, calls: int = 50, repeats: int = 9) -> tuple[float, float]:
    """Least host time per call (µs) over `repeats` runs of `calls` calls queued without a
    sync in between (the least disturbed run: the host's load moves medians by 2x): wall
    time, and the process's CPU time (every thread's, autograd's device thread included;
    time the host's other processes take from it does not count)."""
    for _ in range(10):
        fn()
    walls, cpus = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        walls.append((time.perf_counter() - start) / calls * 1e6)
        cpus.append((time.process_time() - cpu) / calls * 1e6)
        torch.cuda.synchronize()
    return min(walls), min(cpus)


class _Empty(torch.autograd.Function):
    """Allocates its output and passes the gradient through: the autograd machinery alone."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


class _Shaped(torch.autograd.Function):
    """The layer's signature without its kernels: saves what the layer saves, returns an
    output and gradients of the layer's shapes."""

    @staticmethod
    def forward(ctx, info, x2, bias, *tensors):
        ctx.save_for_backward(x2, *tensors)
        ctx.biased = bias is not None
        return x2.new_empty(x2.shape[0], info).t().t()

    @staticmethod
    def backward(ctx, dy):
        x2, *tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads = [torch.empty_like(t) if needs[3 + i] else None for i, t in enumerate(tensors)]
        return None, torch.empty_like(x2), dy.sum(0) if ctx.biased else None, *grads


def inside_backward(y: torch.Tensor, gy: torch.Tensor, calls: int = 200) -> None:
    """How much of a retained-graph backward runs inside `_SparseLinearFunction.backward`
    (the rest: the autograd engine, the bias's and the grads' accumulation)."""
    # (the Function a layer runs outside torch.compile; an older tree, for an A/B, has one)
    function = getattr(sparse_autograd, "_KeptLinearFunction", sparse_autograd._SparseLinearFunction)
    original = function.backward
    spent = []

    def timed(ctx, dy):
        start = time.perf_counter()
        result = original(ctx, dy)
        spent.append(time.perf_counter() - start)
        return result

    function.backward = staticmethod(timed)
    try:
        for _ in range(20):
            y.backward(gy, retain_graph=True)
        torch.cuda.synchronize()
        spent.clear()
        start = time.perf_counter()
        for _ in range(calls):
            y.backward(gy, retain_graph=True)
        total = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    finally:
        function.backward = original
    print(f"{'backward, of which inside the Function':40s} {total:8.1f} us, {statistics.median(spent) * 1e6:.1f} us inside")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--profile", action="store_true", help="then cProfile 200 steps of the layer")
    parser.add_argument("--torch-profile", action="store_true", help="then torch.profiler's host ops of 50 steps")
    parser.add_argument("--profile-rows", default="", help="then cProfile 300 calls of each of these rows (comma-separated)")
    parser.add_argument("--device-times", action="store_true", help="then the device time of each piece")
    args = parser.parse_args()
    torch.manual_seed(0)
    width, batch = args.width, args.batch
    linear = torch.nn.Linear(width, width).cuda().half()
    layer = SparseLinear.from_linear(linear, "BlockGroupCOO", sparsity=0.9, block=(32, 32), group_size="row")
    x = torch.randn(batch, width, device="cuda", dtype=torch.float16, requires_grad=True)
    gy = torch.randn(batch, width, device="cuda", dtype=torch.float16)
    rows = {}
    for name, module in (("nn.Linear", linear), ("SparseLinear", layer)):
        params = list(module.parameters())

        def step(module=module, params=params):
            for p in params:
                p.grad = None
            x.grad = None
            module(x).backward(gy)

        def forward(module=module):
            with torch.no_grad():
                module(x)

        rows[f"{name} forward (no grad)"] = forward
        rows[f"{name} forward+backward"] = step
    fmt = layer.weight
    pattern = {n: getattr(layer, "grad_" + n) for n in layer._pattern_names}
    x2t, dyt = x.detach().t(), gy.t()
    B, dC = fmt.operand(x2t), fmt.output_view(dyt)
    y = layer(x)
    rows["SparseLinear forward (grad)"] = lambda: layer(x)
    rows["SparseLinear backward (retained graph)"] = lambda: y.backward(gy, retain_graph=True)
    # The floor of any Python autograd Function on this host: no kernel in either pass.
    xe = x.detach().requires_grad_()
    rows["empty autograd.Function fwd+bwd"] = lambda: _Empty.apply(xe).backward(gy)
    kept = layer._kept_call()  # (an older tree, for an A/B, keeps no call: two items)
    layer_tensors = kept[1]
    rows["shaped autograd.Function fwd+bwd"] = lambda: _Shaped.apply(width, x, layer.bias, *layer_tensors).backward(gy)
    if len(kept) > 2:
        values = kept[2].values
        rows["kept-shaped autograd.Function fwd+bwd"] = lambda: _Shaped.apply(width, x, layer.bias, *values).backward(gy)
    # The backward's parts, as it runs them (grad mode off).
    rows["views: operand + output_view"] = torch.no_grad()(lambda: (fmt.operand(x2t), fmt.output_view(dyt)))
    rows["x's gradient (input_gradient)"] = torch.no_grad()(lambda: fmt.input_gradient(pattern, dC, "auto", "tf32"))
    tables = {n: getattr(layer, "wgrad_" + n) for n in getattr(layer, "_table_names", ())}
    rows["values' gradient (_value_gradients)"] = torch.no_grad()(lambda: _value_gradients(
        fmt, layer._gradients, {"AV"}, B, dC, "auto", "tf32", tables))
    yd = y.detach()
    rows["bias add (y + b)"] = torch.no_grad()(lambda: yd + layer.bias)
    rows["bias gradient (dy.sum(0))"] = lambda: gy.sum(0)
    gy_transposed = gy.t().contiguous().t()  # dy laid out as the layer's output is (out, batch)
    rows["bias gradient, dy laid out (out, batch)"] = lambda: gy_transposed.sum(0)
    rows["bias gradient, (out, batch).sum(1)"] = lambda: gy_transposed.t().sum(1)
    bias_grad = torch.empty(width, device="cuda", dtype=torch.float16)
    rows["bias gradient, torch.sum(out=)"] = lambda: torch.sum(gy_transposed.t(), 1, out=bias_grad)
    yb = yd.detach().requires_grad_()
    rows["autograd of y + b alone"] = lambda: (yb + layer.bias).backward(gy_transposed)
    rows["fmt.spmm(x^T) (pinned)"] = torch.no_grad()(lambda: fmt.spmm(x2t))
    if "bias" in inspect.signature(fmt.spmm).parameters:  # (an older tree, for an A/B, has none)
        rows["fmt.spmm(x^T, bias=b) (pinned)"] = torch.no_grad()(lambda: fmt.spmm(x2t, bias=layer.bias))
    rows["torch.empty (4096 x 256)"] = lambda: torch.empty(width, batch, device="cuda", dtype=torch.float16)
    for name, fn in rows.items():
        wall, cpu = issue_us(fn)
        print(f"{name:40s} {wall:8.1f} us  (cpu {cpu:6.1f})", flush=True)
    if args.device_times:  # the kernels' own time (do_bench medians), per piece
        import triton.testing

        pieces = ("fmt.spmm(x^T) (pinned)", "fmt.spmm(x^T, bias=b) (pinned)", "x's gradient (input_gradient)", "values' gradient (_value_gradients)",
                  "bias add (y + b)", "bias gradient, dy laid out (out, batch)", "bias gradient (dy.sum(0))")
        for name in (p for p in pieces if p in rows):
            ms = triton.testing.do_bench(rows[name], return_mode="median")
            print(f"device {name:33s} {ms * 1e3:8.1f} us", flush=True)
    inside_backward(y, gy)
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        step = rows["SparseLinear forward+backward"]
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
    for name in filter(None, args.profile_rows.split(",")):
        print(f"== cProfile: {name}")
        print_python_profile(rows[name], 300, ("tottime", "cumulative"), 30)
    if args.profile:
        print_python_profile(rows["SparseLinear forward+backward"], 200, ("tottime", "cumulative"), 40)


if __name__ == "__main__":
    main()
