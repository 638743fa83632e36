"""Where a gathered GEMM loses to cuBLAS: the generated dense GEMM, the same with B's rows
gathered through an identity index, and the N:M kernel, against cuBLAS, fully autotuned.

    python -m benchmarks.explore.gemm [--size 4096]
"""

from __future__ import annotations

import argparse

import torch

import insum
from insum.bind import bind
from insum.formats import NM
from insum.parser import parse
from insum.runtime import kernel_for

from ..common import median_ms, relative_error, rotating


def chosen_config(expr: str, tensors: dict) -> str:
    """The dot's M and N variables and the tile configuration insum() chose for `tensors`."""
    bound = bind(parse(expr), tensors)
    kernel = kernel_for(bound)
    plan = f"M={kernel.plan.axis_var('M')} N={kernel.plan.axis_var('N')}"
    try:
        config = kernel.launcher(bound).config
    except KeyError:  # no insum() call has run with these tensors
        config = "?"
    return f"{plan} {config}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args()
    n = args.size
    torch.backends.cuda.matmul.allow_tf32 = True  # the anchor in tf32, like insum's default
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        A = torch.randn(n, n, device="cuda", dtype=dtype, generator=gen)
        Bs = [torch.randn(n, n, device="cuda", dtype=dtype, generator=gen) for _ in range(2)]
        C = torch.empty(n, n, device="cuda", dtype=dtype)
        ident = torch.arange(n, device="cuda", dtype=torch.int32)
        expected = A.double() @ Bs[0].double()
        t_dense = median_ms(rotating(lambda B, A=A: A @ B, [(B,) for B in Bs]))
        rows = [("cuBLAS", t_dense, relative_error(A @ Bs[0], expected), "")]
        for name, expr, extra in [
            ("insum dense", "C[m, n] = A[m, k] * B[k, n]", {}),
            ("insum gathered B", "C[m, n] = A[m, k] * B[I[k], n]", {"I": ident}),
        ]:
            def call(B, expr=expr, extra=extra, A=A, C=C):
                return insum.insum(expr, A=A, B=B, C=C, **extra)

            err = relative_error(call(Bs[0]).clone(), expected)
            t = median_ms(rotating(call, [(B,) for B in Bs]))
            rows.append((name, t, err, chosen_config(expr, dict(A=A, B=Bs[0], C=C, **extra))))
        for nm in ((2, 4), (1, 8)):
            fmt = NM.from_dense(A, nm[0], nm[1], 128)
            dense_pruned = fmt.to_dense().double()
            exp_nm = dense_pruned @ Bs[0].double()
            err = relative_error(fmt @ Bs[0], exp_nm)
            t = median_ms(rotating(lambda B, f=fmt: f @ B, [(B,) for B in Bs]))
            Cn = torch.empty(fmt.AV.shape[0], fmt.AV.shape[1], n, device="cuda", dtype=dtype)
            direct = fmt.expression.replace("+=", "=")

            def call_nm(B, f=fmt, Cn=Cn, direct=direct):
                return insum.insum(direct, C=Cn, B=B, **f.tensors)

            err_direct = relative_error(call_nm(Bs[0]).reshape(n, n), exp_nm)
            t_direct = median_ms(rotating(call_nm, [(B,) for B in Bs]))
            rows.append((f"NM {nm[0]}:{nm[1]} fmt @ B", t, err, ""))
            rows.append((f"NM {nm[0]}:{nm[1]} '=' into {str(dtype)[6:]}", t_direct, err_direct,
                         chosen_config(direct, dict(C=Cn, B=Bs[0], **fmt.tensors))))
        print(f"\n{str(dtype)[6:]} {n}^3 (dense flops {2 * n**3 / t_dense / 1e9:.0f} TFLOP/s)")
        for name, t, err, config in rows:
            print(f"  {name:28s} {t:.4f} ms  x{t_dense / t:.2f} vs cuBLAS  err {err:.1e}  {config}", flush=True)


if __name__ == "__main__":
    main()
