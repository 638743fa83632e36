"""Row-sharded SpMM on 1 vs 2 GPUs (`insum.distributed.spmm`), on generated power-law graphs.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.study_distributed   # the GPU run
    python -m benchmarks.study_distributed --small                          # CPU smoke (gloo)

Not part of `python -m benchmarks` (whose studies run in one process): it needs two.

Graphs: `benchmarks/graphs.py` ("community": locality as after a reordering; "uniform": none).

For each step of --plan (graph:dtype): the one-GPU products on rank 0 (GroupCOO with its
default group size, the format formats.auto picks for the whole matrix, cuSPARSE), then,
for each packing of --packings ("auto": the default, each block packed by formats.auto;
"groupcoo"), the 2-GPU `spmm` (every iteration aligned by a barrier, timed by CUDA events,
the slower rank's time kept, the median reported), its steps timed alone
(`insum.distributed.steps`: the gather, the exchange, the local and the halo pass; an
all-gather of B and torch.index_select's gather for comparison; all steps one after
another, without overlap), what the
overlap left unhidden (2-GPU time minus the compute steps), the scaling efficiency, each
pass's nonzeros and groups, bytes exchanged against an all-gather of B, and the result
checked against the one-GPU product and a float64 cuSPARSE product. A `graph+backward`
step times a forward and backward step instead, the backward's steps alone (the
transposed passes, the exchange back), and checks the gradient. Steps run until the
time budget is spent. Full rows go to $OUT/study_distributed.jsonl.

What to read: `x` (2 GPUs against the faster one-GPU insum product; target >= 1.7 on
community:fp32), `unhid` (the exchange not hidden:
~0 when the overlap works), `halo` against `local` with `halo%nnz` (the halo pass's cost
per nonzero against the local pass's), and the gather against index_select's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from insum.distributed import partition_rows, spmm, steps
from insum.formats import GroupCOO, auto

from .common import DTYPES, relative_error
from .graphs import make_graph

WORLD = 2


# --------------------------------------------------------------------------- timing


class Timer:
    """Per-iteration times of a collective step, every rank aligned by a barrier first."""

    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, fn) -> float:
        """Milliseconds of one call: CUDA events on a GPU, wall time on the host."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def _once(self, fn) -> float:
        self.sync()
        dist.barrier()
        return self._time(fn)

    def times(self, fn) -> list[float]:
        """This rank's milliseconds per iteration (same iteration count on every rank)."""
        for _ in range(self.warmup):
            fn()
        return [self._once(fn) for _ in range(self.reps)]

    def local_times(self, fn) -> list[float]:
        """Times of a step on this rank alone (no barrier: the other rank is waiting)."""
        for _ in range(self.warmup):
            fn()
        out = []
        for _ in range(self.reps):
            self.sync()
            out.append(self._time(fn))
        return out

    def slowest(self, fn) -> tuple[float, list[float]]:
        """(median over iterations of the slowest rank's time, each rank's own median)."""
        mine = torch.tensor(self.times(fn), dtype=torch.float64, device=self.device)
        per_rank = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(per_rank, mine)
        worst = torch.stack(per_rank).max(0).values
        return statistics.median(worst.tolist()), [statistics.median(t.tolist()) for t in per_rank]


def gather_objects(obj) -> list:
    out = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- one configuration

#: --packings: the default (each block packed by formats.auto) and GroupCOO, to compare.
PACKINGS = {"auto": "auto", "groupcoo": "GroupCOO"}
FORWARD_STEPS = ("gather_send", "exchange", "local", "halo")


def _graph(graph: str, dtype, args, device):
    A = make_graph(graph, args.nodes, args.avg, device)
    if dtype != torch.float32:
        A = A.to(dtype)
    checksum = torch.stack([A.crow_indices()[-1], A.col_indices()[::997].sum()]).double()
    sums = [torch.empty_like(checksum) for _ in range(WORLD)]
    dist.all_gather(sums, checksum)
    assert torch.equal(sums[0], sums[1]), "the ranks generated different graphs"
    return A


def _gathered_rows(local: torch.Tensor, part) -> torch.Tensor | None:
    """Every rank's rows of a row-partitioned result, concatenated on rank 0 (None elsewhere)."""
    widest = max(len(r) for r in _ranges(part))
    padded = torch.nn.functional.pad(local, (0, 0, 0, widest - local.shape[0])).contiguous()
    out = padded.new_empty(WORLD * widest, local.shape[1])
    dist.all_gather_into_tensor(out, padded)
    if dist.get_rank() != 0:
        return None
    return torch.cat([out[k * widest : k * widest + len(r)] for k, r in enumerate(_ranges(part))])


def study(graph: str, dtype_name: str, args, device: torch.device, timer: Timer, log) -> list[dict]:
    """One graph and dtype: the one-GPU product on rank 0, then each packing on 2 GPUs."""
    rank = dist.get_rank()
    dtype = DTYPES[dtype_name]
    t0 = time.perf_counter()
    A = _graph(graph, dtype, args, device)
    n, N = A.shape[0], args.features
    generate_s = time.perf_counter() - t0
    gen = torch.Generator(device=device).manual_seed(2)
    B = torch.randn(n, N, generator=gen, device=device, dtype=dtype)

    # One GPU: rank 0 multiplies the whole matrix (rank 1 waits), packed as GroupCOO and
    # by formats.auto (measured tune); the faster is the one-GPU time.
    one = {}
    if rank == 0:
        full = GroupCOO.from_torch(A)
        C_full = full @ B  # compiles and tunes
        one["groupcoo_ms"] = statistics.median(timer.local_times(lambda: full @ B))
        one["groupcoo_group_size"] = full.group_size
        t0 = time.perf_counter()
        chosen = auto(A, n_cols=N)
        one["auto_pack_s"] = time.perf_counter() - t0
        one["auto_format"] = repr(chosen)[:120]
        chosen @ B
        one["auto_ms"] = statistics.median(timer.local_times(lambda: chosen @ B))
        one["best_ms"] = min(one["groupcoo_ms"], one["auto_ms"])
        del chosen
        try:
            A @ B
            one["cusparse_ms"] = statistics.median(timer.local_times(lambda: A @ B))
        except RuntimeError as error:  # cuSPARSE lacks some half-precision products
            one["cusparse_ms"] = f"n/a ({str(error)[:60]})"
        C64 = A.double() @ B.double()
        one["error_vs_fp64"] = relative_error(C_full, C64)
        del full
    dist.barrier()

    context = (one, C_full, C64) if rank == 0 else (one, None, None)
    rows = []
    for packing in args.packings.split(","):
        row = _study_packing(A, B, packing, generate_s, context, args, timer)
        row.update(graph=graph, dtype=dtype_name)
        if rank == 0:
            log(json.dumps(row))
            log(_forward_line(row))
        rows.append(row)
        gc.collect()
    return rows


def _study_packing(A, B, packing: str, generate_s: float, context, args, timer: Timer) -> dict:
    """One packing on 2 GPUs: spmm, each step alone, the steps in sequence, an all-gather."""
    rank, (one, C_full, C64) = dist.get_rank(), context
    n, nnz, N = A.shape[0], A._nnz(), args.features
    row = {"graph": "", "dtype": "", "packing": packing, "nodes": n, "nnz": nnz, "features": N}
    row["generate_s"] = generate_s
    t0 = time.perf_counter()
    (part,) = partition_rows(A, WORLD, rank=rank, format=PACKINGS[packing])
    timer.sync()
    row["partition_s"] = time.perf_counter() - t0
    B_local = B[part.rows.start : part.rows.stop].contiguous()
    C = spmm(part, B_local)  # compiles and tunes the passes' kernels
    two_ms, two_per_rank = timer.slowest(lambda: spmm(part, B_local))

    # Each step alone (the slower rank's median), then all of them one after another.
    step_fns = steps(part, B_local)
    step_ms = {name: timer.slowest(step_fns[name])[0] for name in FORWARD_STEPS}
    step_per_rank = {name: timer.slowest(step_fns[name])[1] for name in ("local", "halo")}

    def sequential():
        for name in FORWARD_STEPS:
            step_fns[name]()

    sequential_ms, _ = timer.slowest(sequential)
    widest = max(len(r) for r in _ranges(part))
    padded = torch.nn.functional.pad(B_local, (0, 0, 0, widest - B_local.shape[0]))
    gathered = padded.new_empty(WORLD * widest, N)
    allgather_ms, _ = timer.slowest(lambda: dist.all_gather_into_tensor(gathered, padded))
    sent = B_local.new_empty(part.send_rows.numel(), N)
    index_select_ms, _ = timer.slowest(lambda: torch.index_select(B_local, 0, part.send_rows, out=sent))

    # Correctness: every rank's rows against the one-GPU product and float64.
    C_two = _gathered_rows(C, part)
    info = part.stats()
    info.update(exchange_bytes=part.exchange_bytes(N), allgather_bytes=part.allgather_bytes(N))
    parts_info = gather_objects(info)
    if rank == 0:
        row["error_vs_one_gpu"] = relative_error(C_two, C_full)
        row["max_abs_vs_one_gpu"] = float((C_two.double() - C_full.double()).abs().max())
        row["error_vs_fp64"] = relative_error(C_two, C64)
        row.update({"one_gpu_" + k: v for k, v in one.items()})
        exchanged = sum(p["exchange_bytes"] for p in parts_info)
        allgather = sum(p["allgather_bytes"] for p in parts_info)
        compute_ms = sum(step_ms[name] for name in FORWARD_STEPS if name != "exchange")
        row.update(
            {
                "two_gpu_ms": two_ms, "two_gpu_per_rank_ms": two_per_rank,
                "speedup": one["best_ms"] / two_ms, "efficiency": one["best_ms"] / two_ms / WORLD,
                "index_select_ms": index_select_ms,
                **{f"{name}_ms": ms for name, ms in step_ms.items()},
                "local_per_rank_ms": step_per_rank["local"], "halo_per_rank_ms": step_per_rank["halo"],
                "sequential_ms": sequential_ms, "allgather_ms": allgather_ms,
                # What the overlap did not hide: the 2-GPU time beyond its compute steps.
                "unhidden_ms": two_ms - compute_ms,
                "exchanged_bytes": exchanged, "allgather_bytes": allgather,
                "exchange_fraction": exchanged / allgather if allgather else 0.0,
                "parts": parts_info,
            }
        )  # fmt: skip
    return row


def _forward_line(r: dict) -> str:
    halo = r["parts"][0]["halo"]
    return (
        f"{r['graph']} {r['dtype']} {r['packing']}: 1 GPU {r['one_gpu_best_ms']:.2f} ms (GroupCOO "
        f"{r['one_gpu_groupcoo_ms']:.2f}, auto {r['one_gpu_auto_ms']:.2f}: {r['one_gpu_auto_format']}), 2 GPUs "
        f"{r['two_gpu_ms']:.2f} ms ({r['speedup']:.2f}x, efficiency {r['efficiency']:.0%}) = local "
        f"{r['local_ms']:.2f} + halo {r['halo_ms']:.2f} + gather {r['gather_send_ms']:.2f} "
        f"(index_select {r['index_select_ms']:.2f}) "
        f"+ unhidden {r['unhidden_ms']:.2f} (exchange alone {r['exchange_ms']:.2f}); rank 0's halo pass: "
        f"{halo['nnz']} nnz in {halo.get('groups', '?')} groups of {halo.get('group_size', '?')}"
    )


def study_backward(graph: str, dtype_name: str, args, device: torch.device, timer: Timer, log) -> None:
    """Forward + backward (the transposed exchange) on 1 vs 2 GPUs, gradients checked, and
    the backward's steps alone (transposed passes, the exchange back)."""
    rank, dtype, N = dist.get_rank(), DTYPES[dtype_name], args.features
    A = _graph(graph, dtype, args, device)
    gen = torch.Generator(device=device).manual_seed(3)
    B = torch.randn(A.shape[0], N, generator=gen, device=device, dtype=dtype)
    G = torch.randn(A.shape[0], N, generator=gen, device=device, dtype=dtype)
    one = {}
    if rank == 0:
        full, B_one = GroupCOO.from_torch(A), B.clone().requires_grad_()

        def one_step():
            B_one.grad = None
            full.spmm(B_one).backward(G)

        one["one_gpu_ms"] = statistics.median(timer.local_times(one_step))
        AT = A.to_sparse_coo().t().coalesce().to_sparse_csr()
        want = AT.double() @ G.double()
        del AT, full
    dist.barrier()
    for packing in args.packings.split(","):
        result = {"graph": graph, "dtype": dtype_name, "packing": packing, "nnz": A._nnz(), "step": "forward+backward"}
        result.update(one)
        dB = _backward_packing(A, B, G, packing, timer, result)
        if rank == 0:
            result["grad_error_vs_one_gpu"] = relative_error(dB, B_one.grad)
            result["grad_error_vs_fp64"] = relative_error(dB, want)
            result["speedup"] = result["one_gpu_ms"] / result["two_gpu_ms"]
            log(json.dumps(result))
            log(
                f"forward+backward {graph} {dtype_name} {packing}: 1 GPU {result['one_gpu_ms']:.2f} ms, 2 GPUs "
                f"{result['two_gpu_ms']:.2f} ms ({result['speedup']:.2f}x); backward steps alone: local_T "
                f"{result['local_T_ms']:.2f}, halo_T {result['halo_T_ms']:.2f}, exchange back "
                f"{result['exchange_T_ms']:.2f} ms; gradient error vs 1 GPU "
                f"{result['grad_error_vs_one_gpu']:.1e}, vs fp64 {result['grad_error_vs_fp64']:.1e}"
            )
        gc.collect()


def _backward_packing(A, B, G, packing: str, timer: Timer, result: dict) -> torch.Tensor | None:
    """One packing's forward + backward step on 2 GPUs and its backward steps alone (into
    `result`); every rank's gradient on rank 0."""
    (part,) = partition_rows(A, WORLD, rank=dist.get_rank(), format=PACKINGS[packing])
    rows = slice(part.rows.start, part.rows.stop)
    B_local, G_local = B[rows].clone().requires_grad_(), G[rows].contiguous()

    def two_step():
        B_local.grad = None
        spmm(part, B_local).backward(G_local)

    result["two_gpu_ms"], result["two_gpu_per_rank_ms"] = timer.slowest(two_step)
    step_fns = steps(part, B_local, G_local)
    for name in ("local_T", "halo_T", "exchange_T"):
        result[f"{name}_ms"] = timer.slowest(step_fns[name])[0]
    return _gathered_rows(B_local.grad, part)


def _ranges(part) -> list[range]:
    s = part.row_starts
    return [range(a, b) for a, b in zip(s[:-1], s[1:])]


# --------------------------------------------------------------------------- driver


def table(rows: list[dict]) -> str:
    head = (
        f"{'graph':<10}{'dtype':<6}{'packing':<9}{'nnz':>10}{'1 GPU':>8}{'cuSP':>7}{'2 GPUs':>8}{'x':>7}{'eff':>5}"
        f"{'local':>8}{'halo':>8}{'gath':>7}{'unhid':>7}{'exch':>7}{'AG':>7}{'exch%AG':>8}{'halo%nnz':>9}{'err 1GPU':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cu = r.get("one_gpu_cusparse_ms")
        cu = f"{cu:7.2f}" if isinstance(cu, float) else f"{'n/a':>7}"
        halo_share = sum(p["halo"]["nnz"] for p in r["parts"]) / max(r["nnz"], 1)
        lines.append(
            f"{r['graph']:<10}{r['dtype']:<6}{r['packing']:<9}{r['nnz']:>10}{r['one_gpu_best_ms']:8.2f}{cu}"
            f"{r['two_gpu_ms']:8.2f}{r['speedup']:6.2f}x{r['efficiency']:5.0%}{r['local_ms']:8.2f}{r['halo_ms']:8.2f}"
            f"{r['gather_send_ms']:7.2f}{r['unhidden_ms']:7.2f}{r['exchange_ms']:7.2f}"
            f"{r['allgather_ms']:7.2f}{100 * r['exchange_fraction']:7.1f}%{100 * halo_share:8.1f}%{r['error_vs_one_gpu']:9.1e}"
        )
    lines.append(
        "times in ms (medians; 2-GPU steps: the slower rank); 1 GPU: the faster of GroupCOO and formats.auto; "
        "local, halo, gath: the passes and the gather alone; unhid: 2 GPUs minus those (the exchange not hidden); exch%AG: halo bytes / all-gather bytes"
    )
    return "\n".join(lines)


def main(rank: int, args) -> None:
    cuda = torch.cuda.is_available() and not args.small
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("INSUM_CACHE_DIR", f"/tmp/insum-cache-rank{rank}")  # no tuning-file races
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300),
            **({"device_id": device} if cuda else {}),
        )  # fmt: skip
    if cuda:
        from .common import shorten_autotune

        shorten_autotune()
    out_dir = os.environ.get("OUT", ".")
    log_path = os.path.join(out_dir, "study_distributed.jsonl")

    def log(text: str) -> None:
        print(text, flush=True)
        with open(log_path, "a") as f:
            f.write(text + "\n")

    start = time.perf_counter()
    if rank == 0:
        name = torch.cuda.get_device_name(device) if cuda else "CPU"
        log(f"# {name} x{WORLD}, torch {torch.__version__}, nodes={args.nodes}, avg={args.avg}, N={args.features}")
    timer = Timer(device, reps=args.reps, warmup=3)
    rows = []
    for step in args.plan.split(","):
        graph, dtype_name = step.split(":")
        go = [time.perf_counter() - start < args.budget_s]
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            if rank == 0:
                log(f"# skipped {step}: over the {args.budget_s} s budget")
            continue
        if graph.endswith("+backward"):
            study_backward(graph.removesuffix("+backward"), dtype_name, args, device, timer, log)
        else:
            rows.extend(study(graph, dtype_name, args, device, timer, log))
        gc.collect()  # the configuration's tensors, before the next one allocates
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        log(table(rows))
        log(f"# total {time.perf_counter() - start:.0f} s")
    dist.destroy_process_group()


def _spawned(rank: int, args, port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    main(rank, args)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4_000_000)
    parser.add_argument("--avg", type=float, default=13.5, help="nonzeros per row before merging duplicates")
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument(
        "--plan",
        default="community:fp32,community:fp16,community+backward:fp32,uniform:fp32,uniform:fp16",
        help="graph:dtype steps in order (graph+backward times forward and backward)",
    )
    parser.add_argument(
        "--packings", default="auto,groupcoo", help=f"comma-separated, of {', '.join(PACKINGS)} (see PACKINGS)"
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=170.0, help="start no configuration after this")
    parser.add_argument("--small", action="store_true", help="CPU smoke run: gloo, 20k nodes")
    args = parser.parse_args(argv)
    if args.small:
        args.nodes, args.reps = min(args.nodes, 20_000), min(args.reps, 3)
    return args


if __name__ == "__main__":
    args = parse_args()
    if "RANK" in os.environ:  # torchrun
        main(int(os.environ["RANK"]), args)
    else:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args, port), nprocs=WORLD)
