"""What `check_indices=True` costs per call on the suite's SpMMs, and the GPU side of issue 15.

    python3 -m benchmarks.study_index_check

1. Time per call (do_bench medians) of the COO, GroupCOO and ELL statements on a DLMC-sized
   and a graph-sized power-law matrix, fp32 and fp16, N=128, with and without the index
   check, and the check alone; the table's last column is the overhead in percent.
2. bf16 dense product and a bf16 GroupCOO SpMM against float64 on CUDA.
3. Memory back to its baseline after `del` with every cache warm.
4. An out-of-range index with check_indices=True stops before the kernel writes (run in a
   child process: a device-side assert ends the CUDA context).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import torch

from insum import insum
from insum.formats import COO, ELL, GroupCOO, power_law_matrix

from .common import median_ms, padded_slots

MATRICES = {  # name: (rows, cols, average nonzeros per row)
    "dlmc_2048": (2048, 2048, 205),  # 90% sparse, a DLMC transformer layer's size
    "graph_200k": (200_000, 200_000, 12),  # a power-law graph
}
FORMATS = {"COO": COO, "GroupCOO": GroupCOO, "ELL": ELL}
N = 128


def _timings() -> list[dict]:
    from insum.bind import bind
    from insum.bounds import check_indices
    from insum.parser import parse

    rows = []
    for matrix, (m, k, avg) in MATRICES.items():
        csr = power_law_matrix(m, k, avg, seed=0, device="cuda")
        for dtype in (torch.float32, torch.float16):
            B = torch.randn(k, N, device="cuda", dtype=dtype)
            for fname, cls in FORMATS.items():
                if padded_slots(cls, csr) > (1 << 26):
                    continue  # ELL: a power-law graph's longest row (about 190k) makes it dense
                fmt = cls.from_torch(csr.to(dtype))
                tensors = dict(fmt.tensors)
                C = torch.empty(m, N, device="cuda", dtype=torch.float32)
                expr = fmt.expression

                def run(flag, tensors=tensors, C=C, B=B, expr=expr):
                    return insum(expr, backend="triton", check_indices=flag, C=C, B=B, **tensors)

                run(False)
                ref = (csr.to(torch.float64) @ B.to(torch.float64)).float()
                C.zero_()
                run(True)
                torch.cuda.synchronize()
                err = ((C - ref).norm() / ref.norm()).item()
                off = median_ms(lambda run=run: run(False))
                on = median_ms(lambda run=run: run(True))
                bound = bind(parse(expr), {"C": C, "B": B, **tensors})
                alone = median_ms(lambda bound=bound, C=C: check_indices(bound, C))
                nnz = csr.values().numel()
                rows.append(
                    dict(matrix=matrix, dtype=str(dtype).split(".")[-1], format=fname, nnz=nnz,
                         off_us=off * 1e3, on_us=on * 1e3, check_us=alone * 1e3,
                         overhead_pct=100 * (on - off) / off, rel_err=err)
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _bf16() -> dict:
    out = {}
    A = torch.randn(256, 192, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(192, 160, device="cuda", dtype=torch.bfloat16)
    C = insum("C[m,n] += A[m,k]*B[k,n]", A=A, B=B, backend="triton")
    ref = A.double() @ B.double()
    out["dense_bf16_rel_err"] = ((C.double() - ref).norm() / ref.norm()).item()
    csr = power_law_matrix(512, 384, 20, seed=1, device="cuda")
    fmt = GroupCOO.from_torch(csr.to(torch.bfloat16))
    B = torch.randn(384, 64, device="cuda", dtype=torch.bfloat16)
    C = fmt @ B
    ref = csr.double() @ B.double()
    out["groupcoo_bf16_rel_err"] = ((C.double() - ref).norm() / ref.norm()).item()
    return out


def _memory() -> dict:
    torch.cuda.synchronize()
    W = torch.randn(64, 64, device="cuda")
    for _ in range(2):  # caches warm: binding, kernel, launcher
        X = torch.randn(100_000, 64, device="cuda")
        Y = insum("O[i,n] = X[i,k]*W[k,n]", X=X, W=W, backend="triton")
        del X, Y
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    X = torch.randn(100_000, 64, device="cuda")
    Y = insum("O[i,n] = X[i,k]*W[k,n]", X=X, W=W, backend="triton")
    during = torch.cuda.memory_allocated()
    del X, Y
    gc.collect()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    return {"memory_baseline": base, "memory_during": during, "memory_after_del": after,
            "memory_back_to_baseline": after == base}


_CHILD = """
import torch
from insum import insum
B = torch.randn(1000, 64, device="cuda")
C = torch.zeros(100, 64, device="cuda")
AK = torch.randint(0, 1000, (100,), device="cuda")
AK[7] = 10**6
try:
    insum("C[p,n] += B[AK[p],n]", B=B, AK=AK, C=C, backend="triton", check_indices=True)
    torch.cuda.synchronize()
    print("NO ERROR")
except Exception as e:
    print("RAISED", type(e).__name__, str(e).splitlines()[0][:160])
"""


def _out_of_range() -> dict:
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    tail = (child.stdout + child.stderr).strip().splitlines()
    asserted = [line for line in tail if "out of range" in line][:1]
    return {"child_exit": child.returncode, "child_said": tail[-1][:200] if tail else "",
            "assert_message": asserted[0][:240] if asserted else ""}


def main() -> None:
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results.update(_bf16())
    results.update(_memory())
    results.update(_out_of_range())
    results["timings"] = _timings()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "index_check.json"), "w") as f:
            json.dump(results, f, indent=1)
    print()
    for key, value in results.items():
        if key != "timings":
            print(f"{key}: {value}")
    print(f"\n{'matrix':<11} {'dtype':<8} {'format':<9} {'nnz':>9} {'off us':>8} {'on us':>8} "
          f"{'check us':>8} {'overhead':>8} {'rel err':>8}")
    for r in results["timings"]:
        print(f"{r['matrix']:<11} {r['dtype']:<8} {r['format']:<9} {r['nnz']:>9} {r['off_us']:>8.1f} "
              f"{r['on_us']:>8.1f} {r['check_us']:>8.1f} {r['overhead_pct']:>7.1f}% {r['rel_err']:>8.1e}")


if __name__ == "__main__":
    main()
