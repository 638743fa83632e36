"""The pruned-vs-dense MLP step of `torch_checks.py`: a 3-layer MLP (4096 wide, batch 4096,
fp16), dense nn.Linear against SparseLinear (90% 32x32 BlockGroupCOO, Block-ELL, 2:4 NM),
eager, compiled, replayed as CUDA graphs (torch.cuda.make_graphed_callables) and compiled with
CUDA graphs (mode="reduce-overhead"), forward+backward (do_bench medians).

    python -m benchmarks.torch_checks --skip-checks    # runs it
"""

from __future__ import annotations

import copy
import time
import traceback

import torch

from insum.nn import SparseLinear

__all__ = ["mlp_benchmark"]


def bench(fn, params, device: torch.device) -> float:
    """do_bench median in ms (grads reset to None before each run); a host clock on the CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, grad_to_none=params, return_mode="median")


def mlp_benchmark(
    quick: bool, budget: float, forward: bool, device: torch.device, rows: list, failures: list, only: str = ""
) -> None:
    """The MLP table, a row per model appended to `rows` (a failure's name to `failures`);
    models after `budget` seconds are skipped (listed as skipped). `only`: comma-separated
    parts of model names to run (dense always runs: the ratios' base)."""
    begin = time.perf_counter()
    width, batch, layers = (2048, 2048, 3) if quick else (4096, 4096, 3)
    if device.type != "cuda":
        width, batch = 64, 32
    dtype = torch.float16
    torch.manual_seed(0)
    dense = torch.nn.Sequential(
        *[m for i in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())][:-1]
    ).to(device, dtype)

    def sparse(fmt: str, transposed: bool, **params):
        mods = []
        for m in dense:
            if isinstance(m, torch.nn.Linear):
                mods.append(SparseLinear.from_linear(m, fmt, transposed_backward=transposed, **params))
            else:
                mods.append(torch.nn.ReLU())
        return torch.nn.Sequential(*mods)

    models = {  # by importance: the budget cuts from the end (NM prunes to its own pattern)
        "dense (cuBLAS)": lambda: dense,
        "BlockGroupCOO 90% 32x32": lambda: sparse("BlockGroupCOO", True, sparsity=0.9, block=(32, 32)),
        "NM 2:4 L=128": lambda: sparse("NM", True, n=2, m=4, vector_len=128),
        "Block-ELL 90% 32x32 (row groups)": lambda: sparse(
            "BlockGroupCOO", True, sparsity=0.9, block=(32, 32), group_size="row"
        ),
    }
    if not quick:  # the plain derived input gradient (scatters), for comparison
        models["BlockGroupCOO 90%, derived dx"] = lambda: sparse("BlockGroupCOO", False, sparsity=0.9, block=(32, 32))
        models["NM 2:4 L=128, derived dx"] = lambda: sparse("NM", False, n=2, m=4, vector_len=128)
    if only:
        parts = [p.strip() for p in only.split(",") if p.strip()]
        models = {n: b for i, (n, b) in enumerate(models.items()) if i == 0 or any(p in n for p in parts)}
    x = torch.randn(batch, width, device=device, dtype=dtype)
    gy = torch.randn(batch, width, device=device, dtype=dtype)
    print(f"\nMLP {layers} x {width}, batch {batch}, {dtype}: do_bench median, ms", flush=True)
    print(f"{'model':34s} {'eager fwd':>10s} {'eager f+b':>10s} {'vs dense':>9s} {'compiled fwd':>13s} {'compiled f+b':>13s} "
          f"{'vs dense':>9s} {'graphed f+b':>12s} {'vs dense':>9s} {'compiled+graphs':>14s} {'vs dense':>9s} {'err':>8s}")
    dense_step = None
    for name, build in models.items():
        row = {"model": name}
        if time.perf_counter() - begin > budget:
            row["skipped"] = f"over the {budget:.0f}s budget"
            print(f"{name:34s} skipped ({row['skipped']}; raise --budget)", flush=True)
            rows.append(row)
            continue
        try:
            start = time.perf_counter()
            model = build()
            params = list(model.parameters())
            with torch.no_grad():
                reference = model(x)
                if isinstance(model[0], SparseLinear):  # the same weights, dense, in fp32
                    h = x.float()
                    for m in model:
                        h = h.relu() if isinstance(m, torch.nn.ReLU) else h @ m.to_dense().float().T + m.bias.float()
                    row["err"] = float((reference.float() - h).norm() / h.norm())
            compiled = torch.compile(model, fullgraph=True)

            def eager_fwd(model=model):
                with torch.no_grad():
                    model(x)

            def eager_step(model=model):
                model(x).backward(gy)

            def compiled_fwd(compiled=compiled):
                with torch.no_grad():
                    compiled(x)

            def compiled_step(compiled=compiled):
                compiled(x).backward(gy)

            runs = [("eager_fwd", eager_fwd), ("eager_step", eager_step)]
            if forward and "derived" not in name:  # a second compile (the inference graph)
                runs.append(("compiled_fwd", compiled_fwd))
            runs.append(("compiled_step", compiled_step))
            for key, fn in runs:
                fn()
                row[key] = bench(fn, params, device)
            if device.type == "cuda":
                # The eager step replayed as CUDA graphs: no host time. (On a copy: the capture
                # replaces the module's forward, which the compile below must not see; and a
                # capture after cudagraph trees have run fails.)
                try:
                    copied = copy.deepcopy(model)
                    graphed = torch.cuda.make_graphed_callables(copied, (x.clone(),))

                    def graphed_step(graphed=graphed):
                        graphed(x).backward(gy)

                    graphed_step()
                    row["graphed_step"] = bench(graphed_step, list(copied.parameters()), device)
                except Exception as e:  # noqa: BLE001 - keep the eager and compiled numbers
                    row["graphed_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    failures.append(f"graphed {name}")
                    print(f"{name}: graph capture FAILED {row['graphed_error']}", flush=True)
                    torch.cuda.synchronize()
                # Compiled with CUDA graphs (mode="reduce-overhead"): the compiled step without
                # its host time, as a user whose step is host-bound would run it.
                try:
                    reduced = torch.compile(model, mode="reduce-overhead", fullgraph=True)

                    def reduced_step(reduced=reduced):
                        torch.compiler.cudagraph_mark_step_begin()
                        reduced(x).backward(gy)

                    reduced_step()
                    row["compiled_graphs_step"] = bench(reduced_step, params, device)
                except Exception as e:  # noqa: BLE001 - keep the other numbers
                    row["compiled_graphs_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    failures.append(f"compiled graphs {name}")
                    print(f"{name}: reduce-overhead compile FAILED {row['compiled_graphs_error']}", flush=True)
                    torch.cuda.synchronize()
            row["setup_s"] = time.perf_counter() - start
            nan = float("nan")
            if dense_step is None:
                dense_step = (row["compiled_step"], row.get("graphed_step", nan), row["eager_step"],
                              row.get("compiled_graphs_step", nan))
            row["vs_dense"] = dense_step[0] / row["compiled_step"]
            row["graphed_vs_dense"] = dense_step[1] / row.get("graphed_step", nan)
            row["eager_vs_dense"] = dense_step[2] / row["eager_step"]
            row["compiled_graphs_vs_dense"] = dense_step[3] / row.get("compiled_graphs_step", nan)
            print(
                f"{name:34s} {row['eager_fwd']:10.3f} {row['eager_step']:10.3f} {row['eager_vs_dense']:8.2f}x "
                f"{row.get('compiled_fwd', nan):13.3f} "
                f"{row['compiled_step']:13.3f} {row['vs_dense']:8.2f}x {row.get('graphed_step', nan):12.3f} "
                f"{row['graphed_vs_dense']:8.2f}x {row.get('compiled_graphs_step', nan):14.3f} "
                f"{row['compiled_graphs_vs_dense']:8.2f}x {row.get('err', 0.0):8.1e}"
                f"   (setup {row['setup_s']:.0f}s)",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - one model failing must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            failures.append(f"bench {name}")
            print(f"{name:34s} FAILED {row['error']}", flush=True)
            traceback.print_exc(limit=6)
        rows.append(row)
        torch._dynamo.reset()
