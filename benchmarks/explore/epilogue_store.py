"""Does a tensor-descriptor (TMA) store of the output tile help the short products?

    python -m benchmarks.explore.epilogue_store [--points 0,1,2]

The products issue 11 still misses run few K steps a program (Block-ELL 128x128 s = 0.9:
~6; N:M 1:8: 8), so each program's epilogue weighs against its loop. The generated kernel
stores C with pointers (`tl.store(out_ptrs, ...)`): the accumulator goes through a layout
conversion and many global stores. A descriptor store writes the tile from shared memory
with one bulk copy. This takes each product's tuned generated kernel and rewrites only its
store, `C[g, m, n]` with a unit last stride, into a descriptor made in the kernel, checks both
against a float64 product (C poisoned with NaN first) and times them with bare launches
(do_bench medians, B rotated) beside cuBLAS in one process.
"""

from __future__ import annotations

import argparse
import re

import torch
import triton

from insum.runtime import _load, cache_dir

from .tensorcore import bare_launches, check_and_time, missed_point

POINTS = [
    ("Block-ELL 128x128 s=0.5 4096^3", 4096, "block", 128, 0.5),
    ("Block-ELL 128x128 s=0.75 4096^3", 4096, "block", 128, 0.75),
    ("Block-ELL 128x128 s=0.9 4096^3", 4096, "block", 128, 0.9),
    ("Block-ELL 64x64 s=0.9 4096^3", 4096, "block", 64, 0.9),
    ("N:M 1:8 L=256 4096^3", 4096, "nm", 256, (1, 8)),
    ("Block-ELL 128x128 s=0.75 8192^3", 8192, "block", 128, 0.75),
]
OUT_PTRS = re.compile(
    r"^(\s*)out_ptrs = C_ptr \+ (i_\w+) \* stride_C_0 \+ offs_(\w+)\[:, None\] \* stride_C_1 "
    r"\+ offs_(\w+)\[None, :\] \* stride_C_2.*$", re.M)
STORE = re.compile(r"^(\s*)tl\.store\(out_ptrs, acc\.to\(C_ptr\.dtype\.element_ty\), mask=.*\)$", re.M)


def descriptor_store(source: str) -> str | None:
    """The source with its pointer store of C[g, m, n] made a descriptor store (None: another form)."""
    ptrs = OUT_PTRS.search(source)
    if not ptrs or not STORE.search(source):
        return None
    indent, grid, m, n = ptrs.groups()
    made = (f"{indent}C_desc = tl.make_tensor_descriptor(C_ptr, shape=[size_{grid[2:]}, size_{m}, size_{n}], "
            f"strides=[stride_C_0, stride_C_1, 1], block_shape=[1, BLOCK_M, BLOCK_N])")
    stored = (f"{indent}C_desc.store([{grid}, pid_{m} * BLOCK_M, pid_{n} * BLOCK_N], "
              f"acc.to(C_ptr.dtype.element_ty).reshape(1, BLOCK_M, BLOCK_N))")
    return STORE.sub(lambda _: stored, OUT_PTRS.sub(lambda _: made, source))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default=",".join(str(i) for i in range(len(POINTS))))
    args = parser.parse_args()
    # Descriptors made in a kernel need global scratch memory.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for index in (int(p) for p in args.points.split(",")):
        label, size, kind, block, param = POINTS[index]
        fmt, Bs, expected, t_cublas, (kernel, bound, prepared, C, operands) = missed_point(size, kind, block, param)
        config = dict(prepared.config)
        print(f"{label}: cuBLAS {t_cublas * 1e3:.1f} us; tuned {config}", flush=True)
        rewritten = descriptor_store(kernel.source)
        if rewritten is None:
            print("  store not of the form C[g, m, n]:\n" + kernel.source, flush=True)
            continue
        sources = [("generated", kernel.source), ("descriptor store", rewritten)]
        for round_ in range(2):
            for name, source in sources:
                try:
                    digest = f"{kernel.digest}_{name.replace(' ', '_')}"
                    fn = _load(cache_dir() / "kernels" / f"insum_{digest}.py", source, digest)
                    err, ms = check_and_time(bare_launches(fn, prepared, bound, config, operands, C), C, fmt.result,
                                             expected)
                except Exception as e:  # a rewrite that does not compile or run is reported
                    print(f"  {name:18s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                ok = "ok" if err <= 1e-2 else "WRONG"
                print(f"  round {round_} {name:18s} {ms * 1e3:8.1f} us  x{t_cublas / ms:.2f} cuBLAS  err {err:.1e} {ok}",
                      flush=True)


if __name__ == "__main__":
    main()
