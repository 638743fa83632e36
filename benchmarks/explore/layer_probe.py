"""Where a FullyConnectedTensorProduct call spends its time beyond its statement, and how it compares.

    python -m benchmarks.explore.layer_probe [--L 1,2,3] [--C 16,32] [--batch 10000] [--budget 80]
    TRITON_INTERPRET=1 python -m benchmarks.explore.layer_probe --host [--L 1 --C 16]

The layer: in1 = C x (0e+1o+...+L), in2 = the spherical harmonics up to L (1x each),
out = in1, fp32 with tf32 dots; output="direct" (the default on this grid: one launch
reading x1 and writing e3nn's layout) and "gather" (the layout before: x1 gathered
component-major, the statement, Z gathered into e3nn's order).

On CUDA, per grid point in the order given: do_bench medians (L2 flushed) of the forward of
the layer ("direct" and "gather"), of its statement alone (`insum()` on the layer's tables,
`statement_facts`) and of cuEquivariance's FullyConnectedTensorProduct where it imports (e3nn's
weights layout, `cue.mul_ir`); forward+backward (gradients of both inputs and the weight) of
the layer and cuEquivariance; host wall time per forward call (many calls, one
synchronisation) of the layer, the statement's `insum()` and its bare direct launch; and the
kernels one forward and one forward+backward of the layer launch (torch.profiler). Points
that do not fit `--budget` seconds (tuning included) are skipped; then the speed-ups over
cuEquivariance. The "gather" layer's forward is measured at the first point only unless
--gather-all, its forward+backward with --gather-fb (each new kernel's first call compiles
and times its candidate tiles, seconds per kernel with an empty tuning cache).

With --host (CPU, TRITON_INTERPRET=1): every generated kernel's launch is stubbed as in
`benchmarks/host_time.py`, and it prints the host's CPU time per call (the layer's forward,
"direct" and "gather"; `insum()` on the statement; the layer's pinned launch alone; the bare
direct launch; forward+backward) and what one call launches and runs besides (generated
kernels; other torch ops, counted by `insum.formats.opcount`).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from insum import insum
from insum.nn import FullyConnectedTensorProduct

from ..common import geomean, host_us_per_call, median_ms

_ALLOCATIONS = ("new_empty", "empty_like")  # counted by count_ops, but they launch nothing


def _chain(mul: int, lmax: int) -> str:
    return "+".join(f"{mul}x{degree}{'e' if degree % 2 == 0 else 'o'}" for degree in range(lmax + 1))


def _layers(L: int, C: int, device: str, backend: str = "auto"):
    irreps = _chain(C, L)
    direct = FullyConnectedTensorProduct(irreps, _chain(1, L), irreps, backend=backend).to(device)
    gather = FullyConnectedTensorProduct(irreps, _chain(1, L), irreps, backend=backend, output="gather").to(device)
    with torch.no_grad():
        gather.weight.copy_(direct.weight)
    assert direct.output == "direct"
    return direct, gather


def _bare_launch(layer: FullyConnectedTensorProduct, tensors: dict):
    """The launch the layer pinned for its statement on these tensors, through insum's direct
    path alone (`insum.direct`: no checks, tensors as the JIT would get them)."""
    varying = {name: tensors[name] for name in ("Z", "X", "Y", "W")}
    pinned = layer._layout_statements(tensors["X"].dtype)["Z"].pinned(varying)
    if pinned is None:
        return None
    launcher = pinned.launch.launcher
    args = launcher.args({**pinned.parts[0], **varying}, varying["Z"])
    return lambda: launcher.direct(launcher.kernel.fn, args)


def _fwd_bwd(layer, x1, x2, params, g):
    def step():
        torch.autograd.grad(layer(x1, x2), [x1, x2, *params], g)

    return step


def _kernels_per_call(fn, calls: int = 5) -> tuple[float, list[str]]:
    """CUDA kernels launched per call of fn (torch.profiler) and their names."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.count for e in kernels) / calls, sorted({e.key[:60] for e in kernels})


def _cue_layer(L: int, C: int, weight: torch.Tensor):
    try:
        import cuequivariance as cue
        import cuequivariance_torch as cuet
    except Exception as e:  # noqa: BLE001 (an anchor that does not import is reported)
        return None, f"{type(e).__name__}: {str(e)[:120]}"
    irreps = cue.Irreps("O3", _chain(C, L))
    mod = cuet.FullyConnectedTensorProduct(irreps, cue.Irreps("O3", _chain(1, L)), irreps, layout=cue.mul_ir,
                                           shared_weights=True, internal_weights=True, device="cuda")
    with torch.no_grad():
        mod.weight.copy_(weight.detach().view_as(mod.weight))
    return mod, None


def gpu(args) -> None:
    from ..common import shorten_autotune

    shorten_autotune()  # the many kernels' tuning with shorter measurements; do_bench below is full
    end = time.time() + args.budget
    rows = []
    for n, (L, C) in enumerate((L, C) for L in args.L for C in args.C):
        if time.time() > end:
            print(f"budget spent: skipping L={L} C={C}", flush=True)
            continue
        gather_too = n == 0 or args.gather_all
        row = _point(L, C, args.batch, first=n == 0, gather_too=gather_too, gather_fb=gather_too and args.gather_fb, end=end)
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
    for what in ("fwd", "fb"):
        for name in ("layer", "stmt", "gather"):
            ratios = [r[f"cue_{what}_us"] / r[f"{name}_{what}_us"] for r in rows if f"{name}_{what}_us" in r and f"cue_{what}_us" in r]
            if ratios:
                print(f"{name} {what} over cuEquivariance: geomean {geomean(ratios):.2f}x, min {min(ratios):.2f}x "
                      f"over {len(ratios)} points")


def _point(L: int, C: int, batch: int, first: bool, gather_too: bool, gather_fb: bool, end: float) -> dict:
    """One grid point on CUDA (see the module doc)."""
    torch.manual_seed(L * 100 + C)
    direct, gather = _layers(L, C, "cuda")
    x1 = torch.randn(batch, direct.irreps_in1.dim, device="cuda")
    x2 = torch.randn(batch, direct.irreps_in2.dim, device="cuda")
    g = torch.randn(batch, direct.irreps_out.dim, device="cuda")
    x1g, x2g = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    cue, why = _cue_layer(L, C, direct.weight)
    row: dict = {"L": L, "C": C}
    with torch.no_grad():
        expect = direct(x1, x2)
        row["gather_err"] = float((gather(x1, x2) - expect).norm() / expect.norm())
        if cue is not None:
            row["cue_err"] = float((cue(x1, x2) - expect).norm() / expect.norm())
        tensors = direct.statement_tensors(x1, x2)
        facts = direct.statement_facts()

        def statement():
            return insum(direct.statement, precision=direct.precision, **facts, **tensors)

        statement(), statement()
        row["layer_fwd_us"] = median_ms(lambda: direct(x1, x2)) * 1e3
        row["stmt_fwd_us"] = median_ms(statement) * 1e3
        if gather_too:
            row["gather_fwd_us"] = median_ms(lambda: gather(x1, x2)) * 1e3
            row["gather_host_us"] = host_us_per_call(lambda: gather(x1, x2))
            row["gather_kernels_fwd"], _ = _kernels_per_call(lambda: gather(x1, x2))
        if cue is not None:
            row["cue_fwd_us"] = median_ms(lambda: cue(x1, x2)) * 1e3
        row["layer_host_us"] = host_us_per_call(lambda: direct(x1, x2))
        row["stmt_host_us"] = host_us_per_call(statement)
        bare = _bare_launch(direct, tensors)
        if bare is not None:
            row["bare_host_us"] = host_us_per_call(bare)
        row["layer_kernels_fwd"], names = _kernels_per_call(lambda: direct(x1, x2))
    step = _fwd_bwd(direct, x1g, x2g, [direct.weight], g)
    row["layer_fb_us"] = median_ms(step) * 1e3
    row["layer_fb_host_us"] = host_us_per_call(step, calls=300)
    row["layer_kernels_fb"], fb_names = _kernels_per_call(step)
    if cue is not None:
        row["cue_fb_us"] = median_ms(_fwd_bwd(cue, x1g, x2g, [cue.weight], g)) * 1e3
    if gather_fb and time.time() < end:
        row["gather_fb_us"] = median_ms(_fwd_bwd(gather, x1g, x2g, [gather.weight], g)) * 1e3
    if first:
        print(f"kernels of one forward: {names}\nkernels of one forward+backward: {fb_names}")
        if why:
            print(f"cuEquivariance not measured: {why}")
    return row


def host(args) -> None:
    """CPU, the interpreter: host time per call with every launch stubbed, and what a call runs."""
    from insum.formats.opcount import count_ops
    from insum.runtime import _Launcher

    from ..host_time import measure, stubbed_launches

    L, C, batch = args.L[0], args.C[0], 4
    torch.manual_seed(0)
    direct, gather = _layers(L, C, "cpu", backend="triton")
    x1, x2 = torch.randn(batch, direct.irreps_in1.dim), torch.randn(batch, direct.irreps_in2.dim)
    g = torch.randn(batch, direct.irreps_out.dim)
    x1g, x2g = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    tensors, facts = direct.statement_tensors(x1, x2), direct.statement_facts()
    varying = {name: tensors[name] for name in ("Z", "X", "Y", "W")}
    rows = {
        "layer forward (direct)": lambda: direct(x1, x2),
        "layer forward (gather)": lambda: gather(x1, x2),
        "statement insum()": lambda: insum(direct.statement, backend="triton", **facts, **tensors),
    }
    fb = {"layer fwd+bwd (direct)": _fwd_bwd(direct, x1g, x2g, [direct.weight], g),
          "layer fwd+bwd (gather)": _fwd_bwd(gather, x1g, x2g, [gather.weight], g)}
    with torch.no_grad():
        for fn in rows.values():  # interpreted for real once, then pinned
            fn(), fn()
        pinned = direct._layout_statements(x1.dtype)["Z"].pinned(varying)
        rows["pinned launch alone"] = lambda: pinned.run(varying)
        rows["bare direct launch"] = _bare_launch(direct, tensors)
        rows["torch.empty (the output)"] = lambda: torch.empty(batch, direct.irreps_out.dim)
    for fn in fb.values():
        fn(), fn()
    counts = {}
    launches = [0]
    run = _Launcher.run

    def counted(self, *a, **k):
        launches[0] += 1
        return run(self, *a, **k)

    with stubbed_launches():
        with torch.no_grad():
            timed = measure(rows, args.calls, args.repeats, lambda: None, time.thread_time)
        timed.update(measure(fb, max(1, args.calls // 10), args.repeats, lambda: None, time.thread_time))
        _Launcher.run = counted
        try:
            for name, fn in list(rows.items())[:3] + list(fb.items()):
                launches[0] = 0
                with count_ops() as ops, torch.set_grad_enabled("bwd" in name):
                    fn()
                moved = {op: n for op, n in ops.names.items() if op not in _ALLOCATIONS}
                counts[name] = (launches[0], sum(moved.values()), moved)
        finally:
            _Launcher.run = run
    print(f"FCTP {direct.irreps_in1} x {direct.irreps_in2}: host CPU us per call, launches stubbed "
          f"({args.repeats} x {args.calls} calls; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"  {'':28s} {'median':>8s} {'min':>8s}  launches  other ops (not allocations)")
    for name, (median, least) in timed.items():
        launched, ops, names = counts.get(name, ("", "", ""))
        print(f"  {name:28s} {median:8.2f} {least:8.2f}  {launched!s:>8s}  {ops} {names or ''}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--L", default="1", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--C", default="16", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--budget", type=float, default=80.0, help="seconds for the CUDA grid, tuning included")
    parser.add_argument("--gather-all", action="store_true", help="measure the gather layer at every point")
    parser.add_argument("--gather-fb", action="store_true", help="and its forward+backward (more kernels to tune)")
    parser.add_argument("--host", action="store_true", help="CPU: host time with launches stubbed (TRITON_INTERPRET=1)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if args.host:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--host runs on the CPU: set TRITON_INTERPRET=1")
        host(args)
    else:
        gpu(args)


if __name__ == "__main__":
    main()
