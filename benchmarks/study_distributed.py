"""Row-sharded SpMM on 1 vs 2 GPUs (`insum.distributed.spmm`), on generated power-law graphs.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.study_distributed   # the GPU run
    python -m benchmarks.study_distributed --small                          # CPU smoke (gloo)

Not part of `python -m benchmarks` (whose studies run in one process): it needs two.

Graphs: `benchmarks/graphs.py` ("community": locality as after a reordering; "uniform": none).

For each step of --plan (graph:dtype): the one-GPU GroupCOO product (and cuSPARSE) on rank 0, then the
2-GPU `spmm` (every iteration aligned by a barrier, timed by CUDA events, the slower
rank's time kept, the median reported), its parts timed alone (local block, halo block,
the halo all_to_all, an all-gather of B for comparison, exchange-then-compute without
overlap), bytes exchanged against an all-gather of B, and the result checked against the
one-GPU product and a float64 cuSPARSE product. A `graph+backward` step times a forward
and backward step instead and checks the gradient. Steps run until the time budget is
spent. Full rows go to $OUT/study_distributed.jsonl.
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

from insum.distributed import partition_rows, spmm
from insum.formats import GroupCOO

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


def study(graph: str, dtype_name: str, args, device: torch.device, timer: Timer, log) -> dict:
    rank = dist.get_rank()
    dtype = DTYPES[dtype_name]
    t0 = time.perf_counter()
    A = make_graph(graph, args.nodes, args.avg, device)
    if dtype != torch.float32:
        A = A.to(dtype)
    n, nnz = A.shape[0], A._nnz()
    checksum = torch.stack([A.crow_indices()[-1], A.col_indices()[::997].sum()]).double()
    sums = [torch.empty_like(checksum) for _ in range(WORLD)]
    dist.all_gather(sums, checksum)
    assert torch.equal(sums[0], sums[1]), "the ranks generated different graphs"
    generate_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    (part,) = partition_rows(A, WORLD, rank=rank)
    timer.sync()
    partition_s = time.perf_counter() - t0
    N = args.features
    gen = torch.Generator(device=device).manual_seed(2)
    B = torch.randn(n, N, generator=gen, device=device, dtype=dtype)
    B_local = B[part.rows.start : part.rows.stop].contiguous()
    if rank != 0:
        del B
    row = {
        "graph": graph, "dtype": dtype_name, "nodes": n, "nnz": nnz, "features": N,
        "generate_s": generate_s, "partition_s": partition_s,
    }  # fmt: skip

    # One GPU: rank 0 multiplies the whole matrix (rank 1 waits).
    one = {}
    if rank == 0:
        full = GroupCOO.from_torch(A)
        C_full = full @ B  # compiles and tunes
        one["groupcoo_ms"] = statistics.median(timer.local_times(lambda: full @ B))
        try:
            A @ B
            one["cusparse_ms"] = statistics.median(timer.local_times(lambda: A @ B))
        except RuntimeError as error:  # cuSPARSE lacks some half-precision products
            one["cusparse_ms"] = f"n/a ({str(error)[:60]})"
        C64 = A.double() @ B.double()
        one["error_vs_fp64"] = relative_error(C_full, C64)
        del full
    dist.barrier()

    # Two GPUs.
    C = spmm(part, B_local)  # compiles and tunes the local and halo kernels
    two_ms, two_per_rank = timer.slowest(lambda: spmm(part, B_local))
    halo_rows = int(part.halo_rows.numel())
    send = B_local.index_select(0, part.send_rows)
    halo = B_local.new_empty(halo_rows, N)

    def exchange():
        dist.all_to_all_single(halo, send, list(part.recv_counts), list(part.send_counts))

    exchange()
    widest = max(len(r) for r in _ranges(part))
    padded = torch.nn.functional.pad(B_local, (0, 0, 0, widest - B_local.shape[0]))
    gathered = padded.new_empty(WORLD * widest, N)
    exchange_ms, _ = timer.slowest(exchange)
    allgather_ms, _ = timer.slowest(lambda: dist.all_gather_into_tensor(gathered, padded))
    local_ms, local_per_rank = timer.slowest(lambda: part.local @ B_local)
    halo_ms, halo_per_rank = timer.slowest(lambda: part.halo @ halo)

    def sequential():
        exchange()
        out = part.local @ B_local
        out += part.halo @ halo

    sequential_ms, _ = timer.slowest(sequential)

    # Correctness: every rank's rows against the one-GPU product and float64.
    padded_C = torch.nn.functional.pad(C, (0, 0, 0, widest - C.shape[0]))
    all_C = padded_C.new_empty(WORLD * widest, N)
    dist.all_gather_into_tensor(all_C, padded_C.contiguous())
    parts_info = gather_objects(
        {
            "rows": len(part.rows), "nnz": part.nnz, "halo_nnz": part.halo.nnz,
            "halo_rows": halo_rows, "send_rows": int(part.send_rows.numel()),
            "exchange_bytes": part.exchange_bytes(N), "allgather_bytes": part.allgather_bytes(N),
        }
    )  # fmt: skip
    if rank == 0:
        ranges = _ranges(part)
        C_two = torch.cat([all_C[k * widest : k * widest + len(r)] for k, r in enumerate(ranges)])
        row["error_vs_one_gpu"] = relative_error(C_two, C_full)
        row["max_abs_vs_one_gpu"] = float((C_two.double() - C_full.double()).abs().max())
        row["error_vs_fp64"] = relative_error(C_two, C64)
        row.update({"one_gpu_" + k: v for k, v in one.items()})
        exchanged = sum(p["exchange_bytes"] for p in parts_info)
        allgather = sum(p["allgather_bytes"] for p in parts_info)
        row.update(
            {
                "two_gpu_ms": two_ms, "two_gpu_per_rank_ms": two_per_rank,
                "speedup": one["groupcoo_ms"] / two_ms, "efficiency": one["groupcoo_ms"] / two_ms / WORLD,
                "exchange_ms": exchange_ms, "allgather_ms": allgather_ms,
                "local_ms": local_ms, "local_per_rank_ms": local_per_rank,
                "halo_ms": halo_ms, "halo_per_rank_ms": halo_per_rank,
                "sequential_ms": sequential_ms,
                "exchanged_bytes": exchanged, "allgather_bytes": allgather,
                "exchange_fraction": exchanged / allgather if allgather else 0.0,
                "parts": parts_info,
            }
        )  # fmt: skip
        log(json.dumps(row))
    return row


def study_backward(graph: str, dtype_name: str, args, device: torch.device, timer: Timer, log) -> None:
    """Forward + backward (the transposed exchange) on 1 vs 2 GPUs, gradients checked."""
    rank, dtype, N = dist.get_rank(), DTYPES[dtype_name], args.features
    A = make_graph(graph, args.nodes, args.avg, device).to(dtype)
    (part,) = partition_rows(A, WORLD, rank=rank)
    gen = torch.Generator(device=device).manual_seed(3)
    B = torch.randn(A.shape[0], N, generator=gen, device=device, dtype=dtype)
    G = torch.randn(A.shape[0], N, generator=gen, device=device, dtype=dtype)
    rows = slice(part.rows.start, part.rows.stop)
    B_local, G_local = B[rows].clone().requires_grad_(), G[rows].contiguous()
    result = {"graph": graph, "dtype": dtype_name, "nnz": A._nnz(), "step": "forward+backward"}
    if rank == 0:
        full, B_one = GroupCOO.from_torch(A), B.clone().requires_grad_()

        def one_step():
            B_one.grad = None
            full.spmm(B_one).backward(G)

        result["one_gpu_ms"] = statistics.median(timer.local_times(one_step))
        AT = A.to_sparse_coo().t().coalesce().to_sparse_csr()
        want = AT.double() @ G.double()
        del AT
    dist.barrier()

    def two_step():
        B_local.grad = None
        spmm(part, B_local).backward(G_local)

    result["two_gpu_ms"], result["two_gpu_per_rank_ms"] = timer.slowest(two_step)
    widest = max(len(r) for r in _ranges(part))
    grad = torch.nn.functional.pad(B_local.grad, (0, 0, 0, widest - B_local.shape[0])).contiguous()
    grads = grad.new_empty(WORLD * widest, N)
    dist.all_gather_into_tensor(grads, grad)
    if rank == 0:
        dB = torch.cat([grads[k * widest : k * widest + len(r)] for k, r in enumerate(_ranges(part))])
        result["grad_error_vs_one_gpu"] = relative_error(dB, B_one.grad)
        result["grad_error_vs_fp64"] = relative_error(dB, want)
        result["speedup"] = result["one_gpu_ms"] / result["two_gpu_ms"]
        log(json.dumps(result))
        log(
            f"forward+backward {graph} {dtype_name}: 1 GPU {result['one_gpu_ms']:.2f} ms, 2 GPUs "
            f"{result['two_gpu_ms']:.2f} ms ({result['speedup']:.2f}x), gradient error vs 1 GPU "
            f"{result['grad_error_vs_one_gpu']:.1e}, vs fp64 {result['grad_error_vs_fp64']:.1e}"
        )


def _ranges(part) -> list[range]:
    s = part.row_starts
    return [range(a, b) for a, b in zip(s[:-1], s[1:])]


# --------------------------------------------------------------------------- driver


def table(rows: list[dict]) -> str:
    head = (
        f"{'graph':<10}{'dtype':<6}{'nnz':>11}{'1 GPU':>9}{'cuSPARSE':>9}{'2 GPUs':>9}{'speedup':>8}"
        f"{'exch %AG':>9}{'exch':>8}{'allgath':>8}{'local':>8}{'halo':>8}{'no-ovl':>8}{'err 1GPU':>10}{'err f64':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cu = r.get("one_gpu_cusparse_ms")
        cu = f"{cu:9.2f}" if isinstance(cu, float) else f"{'n/a':>9}"
        lines.append(
            f"{r['graph']:<10}{r['dtype']:<6}{r['nnz']:>11}{r['one_gpu_groupcoo_ms']:9.2f}{cu}"
            f"{r['two_gpu_ms']:9.2f}{r['speedup']:7.2f}x{100 * r['exchange_fraction']:8.1f}%"
            f"{r['exchange_ms']:8.2f}{r['allgather_ms']:8.2f}{r['local_ms']:8.2f}{r['halo_ms']:8.2f}"
            f"{r['sequential_ms']:8.2f}{r['error_vs_one_gpu']:10.1e}{r['error_vs_fp64']:9.1e}"
        )
    lines.append("times in ms (medians; 2-GPU steps: the slower rank); exch %AG: halo bytes / all-gather bytes")
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
            rows.append(study(graph, dtype_name, args, device, timer, log))
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
        default="community:fp32,uniform:fp32,community:fp16,community+backward:fp32,uniform:fp16",
        help="graph:dtype steps in order (graph+backward times forward and backward)",
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
