"""A/B: SparseLinear MLP step with `fmt @ B` reading B's strides as given (current) against
copying B to contiguous first (the previous behaviour).

    python -m benchmarks.ab_contiguous
"""

from __future__ import annotations

import torch
import triton.testing

from insum.formats.base import SparseFormat
from insum.nn import SparseLinear


def main() -> None:
    torch.manual_seed(0)
    width = 4096
    dense = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width),
    ).cuda().half()
    model = torch.nn.Sequential(*[
        SparseLinear.from_linear(m, "BlockGroupCOO", sparsity=0.9, block=(32, 32)) if isinstance(m, torch.nn.Linear) else m
        for m in dense
    ])
    x = torch.randn(width, width, device="cuda", dtype=torch.float16)
    gy = torch.randn_like(x)
    params = list(model.parameters())
    original = SparseFormat.spmm

    def contiguous_spmm(self, B, **kw):
        return original(self, B.contiguous(), **kw)

    def fwd():
        with torch.no_grad():
            model(x)

    def step():
        model(x).backward(gy)

    for label, spmm in (("strided B (current)", original), ("contiguous B (copy)", contiguous_spmm),
                        ("strided B again", original)):
        SparseFormat.spmm = spmm
        fwd(), step()
        t_fwd = triton.testing.do_bench(fwd, return_mode="median")
        t_step = triton.testing.do_bench(step, grad_to_none=params, return_mode="median")
        print(f"{label:24s} forward {t_fwd:.3f} ms  forward+backward {t_step:.3f} ms", flush=True)
    SparseFormat.spmm = original


if __name__ == "__main__":
    main()
