"""What a row-sharded SpMM (`insum.distributed.spmm`) holds and issues per call, counted
without a GPU: each pass's nonzeros, groups, group size, stored slots and written rows,
the rows exchanged and gathered, the bytes each step moves at N features, and (in 2
gloo processes, the kernel launches stubbed) the torch ops, host syncs and host time of
one call. Every packing of `--packings` side by side, so that the halo pass's packing
can be compared before ("GroupCOO": the two blocks on their own, the paper's group size
per block, as measured on the H200; "auto": formats.auto per block) and after ("split":
one grouping of the whole rows cut by column range, the default).

    python -m benchmarks.distributed_counts                      # 200k nodes, ~2.7M nonzeros
    python -m benchmarks.distributed_counts --nodes 4000000      # the GPU study's graph (~53M)

Writes $OUT/distributed_counts.json (default: benchmarks/results/cpu/).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import insum.distributed as distributed
import insum.formats.transposed as transposed
from insum.distributed import partition_rows, spmm
from insum.formats.auto import GROUP_ROWS
from insum.formats.opcount import count_ops

from .graphs import make_graph

WORLD = 2
PACKINGS = {"GroupCOO": "GroupCOO", "auto": "auto", "split": None}


def pass_counts(fmt, columns: int, element: int) -> dict:
    """A pass's stored work and the bytes of B rows it gathers and of C rows it writes."""
    info = {"format": type(fmt).__name__, "nnz": fmt.nnz, "slots": fmt.stored_values}
    if hasattr(fmt, "AM"):
        written = int(fmt.AM.unique().numel()) if fmt.nnz else 0
        info.update(groups=fmt.groups if hasattr(fmt, "groups") else fmt.nnz, rows_written=written)
        info["group_size"] = fmt.group_size if hasattr(fmt, "group_size") else 1
        info["nnz_per_group"] = fmt.nnz / max(info["groups"], 1)
        # formats.auto's cost model: gathered rows of B, each group costing GROUP_ROWS more.
        info["model_rows"] = info["slots"] + GROUP_ROWS * info["groups"]
    info["gather_bytes"] = info["slots"] * columns * element
    return info


def part_counts(part, columns: int, element: int) -> dict:
    row_bytes = columns * element
    local, halo = pass_counts(part.local, columns, element), pass_counts(part.halo, columns, element)
    out = {
        "rows": len(part.rows), "nnz": part.nnz, "local": local, "halo": halo,
        "halo_nnz_fraction": part.halo.nnz / max(part.nnz, 1),
        "halo_rows": sum(part.recv_counts), "send_rows": sum(part.send_counts),
        "ext_rows": int(part.ext_rows.numel()), "fan_in": part.fan_in,
        "exchange_bytes": part.exchange_bytes(columns), "allgather_bytes": part.allgather_bytes(columns),
        # The gathers read and write the rows sent and ext_rows.
        "gather_send_bytes": 2 * sum(part.send_counts) * row_bytes,
        "gather_ext_bytes": 2 * int(part.ext_rows.numel()) * row_bytes,
    }  # fmt: skip
    if "rows_written" in halo:
        # The halo pass adds into C rows the local pass wrote: a read and a write each.
        out["halo_rmw_bytes"] = 2 * halo["rows_written"] * row_bytes
    return out


def packing_table(results: dict) -> str:
    head = (
        f"{'packing':<9}{'rank':>5}{'pass':>6}{'format':>10}{'nnz':>10}{'groups':>10}{'g':>4}"
        f"{'nnz/grp':>8}{'slots':>10}{'rows wr':>9}{'gather MB':>10}{'model':>10}"
    )
    lines = [head, "-" * len(head)]
    for name, parts in results.items():
        for r, p in enumerate(parts):
            for which in ("local", "halo"):
                c = p[which]
                lines.append(
                    f"{name:<9}{r:>5}{which:>6}{c['format']:>10}{c['nnz']:>10}{c.get('groups', 0):>10}"
                    f"{c.get('group_size', 0):>4}{c.get('nnz_per_group', 0):>8.2f}{c['slots']:>10}"
                    f"{c.get('rows_written', 0):>9}{c['gather_bytes'] / 1e6:>10.1f}{c.get('model_rows', 0) / 1e3:>9.0f}K"
                )
            lines.append(
                f"{'':<9}{r:>5}  halo {100 * p['halo_nnz_fraction']:.1f}% of nnz, ext_rows {p['ext_rows']}, "
                f"exchange {p['exchange_bytes'] / 1e6:.1f} MB ({100 * p['exchange_bytes'] / max(p['allgather_bytes'], 1):.1f}% "
                f"of an all-gather), gathers {p['gather_send_bytes'] / 1e6:.1f} (send) + {p['gather_ext_bytes'] / 1e6:.1f} (ext) MB, "
                f"halo read-modify-write of C {p.get('halo_rmw_bytes', 0) / 1e6:.1f} MB"
            )
    lines.append(
        "rows wr: output rows the pass writes; gather MB: B rows it gathers (slots x N x 4 B); "
        f"model: formats.auto's cost, in gathered B rows (slots + {GROUP_ROWS:g} x groups)"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- per call, 2 processes


class _Done:
    def wait(self) -> None:
        pass


def _calls(rank: int, port: int, args, out_dir: str) -> None:
    """Ops, syncs and host time of one spmm call (forward; forward + backward) per packing,
    with the kernels stubbed: what the host issues, not what the CPU computes."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    A = make_graph(args.graph, args.call_nodes, args.avg, "cpu")
    A_tiny = make_graph(args.graph, args.host_nodes, args.avg, "cpu")
    launches = []

    def stub(expression, **tensors):  # one kernel launch, recorded, not run
        launches.append(expression)
        output = tensors.get("C", tensors.get("DX"))
        if output is None:  # the transposed pattern's one-owner statement allocates its own
            DY, TS = tensors["DY"], tensors["TS"]
            output = torch.empty(TS.shape[0], DY.shape[1], dtype=DY.dtype)
        return output

    distributed.insum = transposed.insum = stub
    start_exchange = distributed._start_exchange
    rows = {}
    for name, fmt in PACKINGS.items():
        (part,) = partition_rows(A, WORLD, rank=rank, format=fmt)
        if not part.local.single_statement or not part.halo.single_statement:
            continue  # its passes run through fmt.spmm: not stubbed here
        B = torch.randn(len(part.rows), args.features, requires_grad=True)
        spmm(part, B).backward(torch.ones(len(part.rows), args.features))  # keeps the patterns
        # Host time on a tiny graph (its CPU work is a few microseconds), the exchange
        # stubbed too: what the host spends issuing one call.
        (tiny,) = partition_rows(A_tiny, WORLD, rank=rank, format=fmt)
        B_tiny = torch.randn(len(tiny.rows), args.features)
        for step in ("forward", "forward+backward"):
            backward = step != "forward"

            def call(p, b, backward=backward):
                C = spmm(p, b.detach().requires_grad_(backward))
                if backward:
                    C.backward(torch.ones_like(C))

            launches.clear()
            with count_ops() as counted:
                call(part, B)
            kernels = len(launches)
            distributed._start_exchange = lambda *args, **kwargs: _Done()
            for _ in range(3):
                call(tiny, B_tiny)
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                call(tiny, B_tiny)
                times.append((time.perf_counter() - start) * 1e6)
            distributed._start_exchange = start_exchange
            rows[f"{name} {step}"] = {
                "torch_ops": counted.ops, "syncs": counted.syncs, "insum_launches": kernels,
                "ops": dict(counted.names), "host_us_median": statistics.median(times),
            }  # fmt: skip
    with open(os.path.join(out_dir, f"calls_rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", default="community")
    parser.add_argument("--nodes", type=int, default=200_000)
    parser.add_argument("--avg", type=float, default=13.5)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--call-nodes", type=int, default=20_000, help="graph of the per-call counts")
    parser.add_argument("--host-nodes", type=int, default=1000, help="graph of the host time per call")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)
    out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results" / "cpu"))
    out_dir.mkdir(parents=True, exist_ok=True)

    A = make_graph(args.graph, args.nodes, args.avg, "cpu")
    header = f"# {args.graph} graph, {A.shape[0]} nodes, {A._nnz()} nonzeros, {WORLD} ranks, N={args.features} fp32"
    print(header, flush=True)
    packings = {}
    for name, fmt in PACKINGS.items():
        start = time.perf_counter()
        parts = partition_rows(A, WORLD, format=fmt)
        seconds = time.perf_counter() - start
        packings[name] = [part_counts(p, args.features, 4) for p in parts]
        print(f"# {name}: packed in {seconds:.1f} s", flush=True)
    table = packing_table(packings)
    print(table, flush=True)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_calls, args=(port, args, str(out_dir)), nprocs=WORLD)
    calls = [json.loads((out_dir / f"calls_rank{r}.json").read_text()) for r in range(WORLD)]
    for r in range(WORLD):
        (out_dir / f"calls_rank{r}.json").unlink()
    lines = [
        f"per call ({args.call_nodes}-node graph, rank 0 | rank 1): generated kernels (insum launches), "
        "other torch ops and host syncs issued, kernels stubbed; host time (median) on a "
        f"{args.host_nodes}-node graph with the exchange stubbed too (the host's own cost of a call)"
    ]
    for key in calls[0]:
        a, b = calls[0][key], calls[1][key]
        lines.append(
            f"  {key:<28} insum launches {a['insum_launches']}|{b['insum_launches']}, torch ops "
            f"{a['torch_ops']}|{b['torch_ops']}, host syncs {a['syncs']}|{b['syncs']}, host "
            f"{a['host_us_median']:.0f}|{b['host_us_median']:.0f} us"
        )
    print("\n".join(lines), flush=True)
    result = {"header": header, "args": vars(args), "packings": packings, "calls": calls}
    (out_dir / "distributed_counts.json").write_text(json.dumps(result, indent=1))
    (out_dir / "distributed_counts.log").write_text(header + "\n" + table + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
