"""insum inside PyTorch on a CUDA GPU: custom ops, autograd, CUDA graphs, torch.compile, nn.

    python -m benchmarks.torch_checks [--quick] [--skip-bench | --skip-checks] [--budget S]
                                    [--forward] [--out FILE.json]
    TRITON_INTERPRET=1 python -m benchmarks.torch_checks --cpu   # a smoke run of the logic

Checks (each prints PASS/FAIL; the exit status is the number of failures):
  opcheck       torch.library.opcheck of insum::insum_ and insum::insum, backend="triton"
  gradients     every curated statement: generated-kernel gradients against the torch
                lowering's (fp32, ieee), and gradcheck in float64 on the generated kernels
  no sync       eager insum(), fmt @ B and SparseLinear forward+backward under
                torch.cuda.set_sync_debug_mode("error") (any host sync raises)
  cuda graph    capture + replay of an insum SpMM, of `fmt @ B`, of SparseLinear forward
                and of its forward+backward, against eager results on new input values
  compile       torch.compile(fullgraph=True): new values and new nnz (dynamic) compile
                once; a compiled SparseLinear MLP matches eager; mode="reduce-overhead"
Benchmark: a 3-layer MLP (4096 wide, batch 4096, fp16), compiled forward+backward step
(do_bench median): dense nn.Linear against SparseLinear with 90% block sparsity (32x32,
BlockGroupCOO with its default groups, and with one group per block row, i.e. Block-ELL)
and 2:4 (NM, vector length 128); the transposed-pattern input gradient (default) and, for
comparison, the plain derived one (a scatter per stored slot). The same eager step is also
replayed as CUDA graphs (torch.cuda.make_graphed_callables): the sparse steps are bound by
host time (a few hundred microseconds of Python per layer), the graphs show the GPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import insum  # noqa: E402
from insum import insum as run  # noqa: E402
from insum.formats import BlockGroupCOO, GroupCOO  # noqa: E402
from insum.nn import SparseLinear  # noqa: E402

from .common import cuda_graph, host_us_per_call  # noqa: E402
from .torch_mlp import mlp_benchmark  # noqa: E402

SPMM = "C[AM[p],n] += AV[p,q]*B[AK[p,q],n]"
DEVICE = torch.device("cuda")  # --cpu: a smoke run (interpreter, tiny sizes, no CUDA checks)
RESULTS: dict = {"checks": {}, "bench": []}
FAILURES: list[str] = []


def check(name: str, cuda_only: bool = False):
    """Run a check function, print PASS/FAIL with its time, record it."""

    def wrap(fn):
        if cuda_only and DEVICE.type != "cuda":
            print(f"[SKIP] {name} (needs CUDA)")
            return fn
        start = time.perf_counter()
        try:
            note = fn()
            status = "PASS"
        except Exception as e:  # noqa: BLE001 - every failure is reported, the run goes on
            note = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            status = "FAIL"
            FAILURES.append(name)
            traceback.print_exc(limit=6)
        elapsed = time.perf_counter() - start
        print(f"[{status}] {name} ({elapsed:.1f}s){': ' + note if note else ''}", flush=True)
        RESULTS["checks"][name] = {"status": status, "note": note, "seconds": elapsed}
        return fn

    return wrap


def close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str = "") -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def group_coo(groups: int = 64, rows: int = 96, cols: int = 80, n: int = 48, dtype=torch.float32, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return {
        "AM": torch.randint(0, rows, (groups,), generator=g, device=DEVICE, dtype=torch.int32),
        "AK": torch.randint(0, cols, (groups, 4), generator=g, device=DEVICE, dtype=torch.int32),
        "AV": torch.randn(groups, 4, generator=g, device=DEVICE).to(dtype),
        "B": torch.randn(cols, n, generator=g, device=DEVICE).to(dtype),
    }


def pruned(rows: int, cols: int, density: float, dtype=torch.float16, block: int = 1, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    keep = torch.rand(rows // block, cols // block, generator=g, device=DEVICE) < density
    keep = keep.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (torch.randn(rows, cols, generator=g, device=DEVICE) * keep).to(dtype)


# ---------------------------------------------------------------------------- checks


def checks(quick: bool) -> None:
    """Correctness only: kernels take their first tile configuration (INSUM_AUTOTUNE=0)."""
    import os

    from statements import CASES, build

    tuning = os.environ.get("INSUM_AUTOTUNE")
    os.environ["INSUM_AUTOTUNE"] = "0"
    try:
        _checks(quick, CASES, build)
    finally:
        if tuning is None:
            os.environ.pop("INSUM_AUTOTUNE")
        else:
            os.environ["INSUM_AUTOTUNE"] = tuning


def _checks(quick: bool, CASES, build) -> None:
    if quick:
        keep = {"group_coo_spmm", "block_group_coo", "nm_spmm", "sddmm", "shift", "dot", "segment_sum"}
        CASES = [c for c in CASES if c.id in keep]

    @check("opcheck insum::insum_ / insum::insum (triton)")
    def _():
        from torch.library import opcheck

        for dtype in (torch.float32, torch.float16):
            t = group_coo(dtype=dtype)
            names, values = list(t), list(t.values())
            C = torch.zeros(96, 48, device=DEVICE, dtype=torch.float32)
            opcheck(torch.ops.insum.insum_.default, (SPMM, C, names, values, "triton", "ieee"))
            opcheck(torch.ops.insum.insum.default, (SPMM, C, names, values, None, None, "triton", "ieee"))
        t = group_coo()
        t["AV"].requires_grad_(True)
        t["B"].requires_grad_(True)
        names, values = list(t), list(t.values())
        C = torch.zeros(96, 48, device=DEVICE)
        opcheck(torch.ops.insum.insum.default, (SPMM, C, names, values, None, None, "triton", "ieee"))

    @check("gradients: generated kernels vs torch lowering, every curated statement (fp32)")
    def _():
        import warnings

        bad = []
        for c in CASES:
            tensors = build(c, seed=0, dtype=torch.float32, device=DEVICE)
            names = [n for n, t in tensors.items() if t.is_floating_point() and n != c.output]
            if c.stmt.split("=")[0].endswith("+"):
                names.append(c.output)
            grads = {}
            for backend in ("torch", "triton"):
                inputs = {n: tensors[n].clone().requires_grad_(True) for n in names}
                given = {**tensors, **inputs}
                given[c.output] = given[c.output].clone()
                with warnings.catch_warnings():
                    warnings.filterwarnings("error", message="insum: falling back")
                    y = run(c.stmt, backend=backend, precision="ieee", **given)
                seed = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
                grads[backend] = torch.autograd.grad(y, list(inputs.values()), seed)
            for n, a, b in zip(names, grads["triton"], grads["torch"]):
                try:
                    close(a, b, 1e-4, 1e-4, f"{c.id} d{n}")
                except AssertionError as e:
                    bad.append(str(e).splitlines()[0])
        if bad:
            raise AssertionError("; ".join(bad[:5]))
        return f"{len(CASES)} statements"

    @check("gradcheck float64 on the generated kernels")
    def _():
        ids = ["group_coo_spmm", "block_group_coo", "nm_spmm", "sddmm", "shift", "scalar_factor"]
        for c in [c for c in CASES if c.id in ids]:
            tensors = build(c, seed=0, dtype=torch.float64, device=DEVICE)
            names = [n for n, t in tensors.items() if t.is_floating_point() and n != c.output]

            def f(*values, c=c, tensors=tensors, names=names):
                given = {**tensors, **dict(zip(names, values))}
                given[c.output] = given[c.output].clone()
                return run(c.stmt, backend="triton", **given)

            inputs = tuple(tensors[n].clone().requires_grad_(True) for n in names)
            # Scatters add with atomics, so repeated backward passes may differ by rounding.
            torch.autograd.gradcheck(f, inputs, fast_mode=True, nondet_tol=1e-10)
        return ", ".join(ids)

    layer = SparseLinear.from_dense(
        pruned(256, 192, 0.3, block=32), torch.randn(256, device=DEVICE, dtype=torch.float16),
        "BlockGroupCOO", block=(32, 32),
    )
    dense_w = layer.to_dense()

    @check("no host sync on the launch path (set_sync_debug_mode='error')", cuda_only=True)
    def _():
        t = group_coo()
        C = torch.zeros(96, 48, device=DEVICE)
        fmt = GroupCOO.from_dense(pruned(96, 80, 0.1, dtype=torch.float32))
        B = torch.randn(80, 48, device=DEVICE)
        x = torch.randn(64, 192, device=DEVICE, dtype=torch.float16, requires_grad=True)

        def calls():
            run(SPMM, C=C, **t)  # eager, no autograd: the kernel directly
            fmt @ B
            y = layer(x)  # autograd path: the custom operators
            y.float().square().sum().backward()

        calls()  # compile and tune first (they may sync)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()

    @check("CUDA graph: capture + replay of insum SpMM and fmt @ B", cuda_only=True)
    def _():
        t = group_coo()
        C = torch.zeros(96, 48, device=DEVICE)
        fmt = BlockGroupCOO.from_dense(pruned(128, 96, 0.4, dtype=torch.float32, block=16), block=(16, 16))
        B = torch.randn(96, 40, device=DEVICE)
        def body():
            C.zero_()
            run(SPMM, C=C, **t)
            return fmt @ B

        graph, out = cuda_graph(body)  # (after two warm-up runs: compile, tune, allocate)
        for seed in (1, 2):
            new = group_coo(seed=seed)
            t["AV"].copy_(new["AV"])
            t["B"].copy_(new["B"])
            B.copy_(torch.randn_like(B))
            graph.replay()
            torch.cuda.synchronize()
            want = run(SPMM, C=torch.zeros(96, 48, device=DEVICE), backend="torch", **t)
            close(C, want, 1e-4, 1e-4, "SpMM replay")
            close(out, fmt.to_dense() @ B, 2e-2, 2e-2, "fmt @ B replay (tf32)")

    @check("CUDA graph: SparseLinear forward and forward+backward", cuda_only=True)
    def _():
        # A fresh layer: autograd nodes kept from earlier checks belong to another stream.
        fresh = SparseLinear.from_dense(dense_w, layer.bias.detach().clone(), "BlockGroupCOO", block=(32, 32))
        sample = torch.randn(64, 192, device=DEVICE, dtype=torch.float16, requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(fresh, (sample,))
        for seed in (1, 2):
            torch.manual_seed(seed)
            x = torch.randn(64, 192, device=DEVICE, dtype=torch.float16, requires_grad=True)
            gy = torch.randn(64, 256, device=DEVICE, dtype=torch.float16)
            fresh.zero_grad(set_to_none=True)
            y = graphed(x)
            y.backward(gy)
            got_x, got_av = x.grad.clone(), fresh.AV.grad.clone()
            close(y, x.float() @ dense_w.float().T + fresh.bias.float(), 2e-2, 5e-2, "forward")
            fresh.zero_grad(set_to_none=True)
            x2 = x.detach().clone().requires_grad_(True)
            fresh(x2).backward(gy)
            close(got_x, x2.grad, 2e-2, 5e-2, "dx")
            close(got_av, fresh.AV.grad, 2e-2, 5e-2, "dAV")
        return "make_graphed_callables, 2 replays"

    @check("torch.compile(fullgraph=True): one compile for new values and new nnz")
    def _():
        from torch._dynamo.testing import CompileCounterWithBackend

        torch._dynamo.reset()

        def f(C, t):
            run(SPMM, C=C, **t)
            return C.relu()

        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
        for groups, seed in ((40, 0), (40, 1), (57, 2), (91, 3)):
            t = group_coo(groups=groups, seed=seed)
            got = compiled(torch.zeros(96, 48, device=DEVICE), t)
            close(got, f(torch.zeros(96, 48, device=DEVICE), t), 1e-3, 1e-3, "compiled SpMM")
        if counter.frame_count != 1:
            raise AssertionError(f"{counter.frame_count} compiles for 4 calls")
        return "4 calls (3 nnz), 1 compile"

    @check("torch.compile: SparseLinear MLP forward+backward matches eager; reduce-overhead")
    def _():
        torch._dynamo.reset()
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(
            SparseLinear(192, 256, format="BlockGroupCOO", block=(32, 32), sparsity=0.5, device=DEVICE, dtype=torch.float16),
            torch.nn.ReLU(),
            SparseLinear(256, 128, format="NM", n=2, m=4, vector_len=16, device=DEVICE, dtype=torch.float16),
        )
        x = torch.randn(64, 192, device=DEVICE, dtype=torch.float16)
        compiled = torch.compile(mlp, fullgraph=True)
        y = compiled(x)
        y.float().square().sum().backward()
        got = [p.grad.clone() for p in mlp.parameters()]
        mlp.zero_grad()
        want_y = mlp(x)
        want_y.float().square().sum().backward()
        close(y, want_y, 1e-2, 1e-2, "forward")
        for a, p in zip(got, mlp.parameters()):
            close(a, p.grad, 2e-2, 5e-1, "grad")
        note = "fullgraph fwd+bwd ok"
        try:
            ro = torch.compile(mlp, mode="reduce-overhead", fullgraph=True)
            with torch.no_grad():
                for _ in range(3):
                    out = ro(x)
            close(out, want_y, 1e-2, 1e-2, "reduce-overhead")
            note += "; reduce-overhead forward ok"
        except Exception as e:  # noqa: BLE001 - reported, not a failure of the op itself
            note += f"; reduce-overhead: {type(e).__name__}: {str(e)[:120]}"
        return note

    @check("host time per call: eager insum, without and with gradients", cuda_only=True)
    def _():
        t = group_coo(groups=8, rows=16, cols=16, n=16)
        C = torch.zeros(16, 16, device=DEVICE)
        AVg = t["AV"].clone().requires_grad_(True)

        plain = host_us_per_call(lambda: run(SPMM, C=C, **t))
        graded = host_us_per_call(lambda: run(SPMM, C=torch.zeros(16, 16, device=DEVICE), **{**t, "AV": AVg}))
        RESULTS["host_us"] = {"eager": plain, "autograd_op": graded}
        return f"no grad {plain:.1f} us/call, with gradients (an autograd node, forward only) {graded:.1f} us/call"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true",
        help="7 statements in the gradient check; a 2048-wide MLP, no derived-dx variants",
    )
    parser.add_argument("--skip-bench", action="store_true", help="checks only")
    parser.add_argument("--skip-checks", action="store_true", help="benchmark only")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--budget", type=float, default=200, help="seconds for the MLP table")
    parser.add_argument("--forward", action="store_true", help="also time a compiled forward")
    parser.add_argument("--models", default="", help="MLP table: comma-separated parts of model names (dense always)")
    parser.add_argument("--cpu", action="store_true", help="smoke run on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    global DEVICE
    if args.cpu:
        DEVICE = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu with TRITON_INTERPRET=1 for a smoke run)")
        return 1
    import triton

    start = time.perf_counter()
    RESULTS["env"] = {
        "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "insum": insum.__version__,
    }
    print(" | ".join(f"{k} {v}" for k, v in RESULTS["env"].items()), flush=True)
    if not args.skip_checks:
        checks(args.quick)
    if not args.skip_bench:
        mlp_benchmark(args.quick, args.budget, args.forward, DEVICE, RESULTS["bench"], FAILURES, args.models)
    RESULTS["failures"] = FAILURES
    RESULTS["seconds"] = time.perf_counter() - start
    print(f"\n{len(FAILURES)} failure(s){': ' + ', '.join(FAILURES) if FAILURES else ''}; "
          f"{RESULTS['seconds']:.0f}s in all")
    if args.out:
        args.out.write_text(json.dumps(RESULTS, indent=1, default=str))
    return len(FAILURES)


if __name__ == "__main__":
    sys.exit(main())
