"""Launches, torch ops and layout bytes per call of the "uvu" gather layer, its layout changes
as gathers (before) and as block transposes (`insum.nn.layout`, now), on the CPU.

    TRITON_INTERPRET=1 python -m benchmarks.explore.uvu_layout [--mul 4] [--edges 3]

MACE-like irreps (MULx0e+MULx1o+MULx2e ⊗ sh up to 3, per-edge weights, float32) on the
generated kernels in the interpreter. Per call after the first (the first runs each run of
blocks alone to find its tiles): Triton launches, the torch ops that launch a kernel
(views and allocations are free), and the bytes per edge that the layout changes read and
write (each element once, either way). At MUL = 128 those bytes are 72.7 KB per edge for
the output (and for its gradient), 36.9 KB for x1 (and its gradient).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from insum.direct import DirectLaunch  # noqa: E402
from insum.nn import TensorProduct  # noqa: E402
from insum.nn.tensor_product import mace_instructions  # noqa: E402


class _Ops(TorchDispatchMode):
    """The torch ops that launch a kernel (not views, not allocations; not the interpreter's
    own copies inside a Triton launch)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.launching = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if not self.launching and not func.is_view and name not in ("empty", "empty_strided", "new_empty", "as_strided", "detach", "alias"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def count(layer: TensorProduct, x: list[torch.Tensor], backward: bool) -> tuple[int, list[str]]:
    """(Triton launches, torch ops) of one forward (and backward) call."""
    launches = []
    real = DirectLaunch.__call__
    ops = _Ops()

    def counted(self, *args, **kwargs):
        launches.append(1)
        ops.launching = True
        try:
            return real(self, *args, **kwargs)
        finally:
            ops.launching = False

    DirectLaunch.__call__ = counted
    try:
        with ops:
            if backward:
                leaves = [t.clone().requires_grad_() for t in x]
                out = layer(*leaves)
                torch.autograd.grad(out, leaves, torch.ones_like(out))
            else:
                with torch.no_grad():
                    layer(*x)
    finally:
        DirectLaunch.__call__ = real
    return len(launches), ops.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mul", type=int, default=4)
    parser.add_argument("--edges", type=int, default=3)
    args = parser.parse_args()
    irreps1 = f"{args.mul}x0e+{args.mul}x1o+{args.mul}x2e"
    irreps_out, ins = mace_instructions(irreps1, "0e+1o+2e+3o", 3)
    for label, copies in (("before (gathers)", False), ("now (block transposes)", True)):
        layer = TensorProduct(irreps1, "0e+1o+2e+3o", irreps_out, ins, shared_weights=False, internal_weights=False,
                              backend="triton", precision="ieee")
        if not copies:
            layer._copies = lambda layout, t: False
        x = [torch.randn(args.edges, n) for n in (layer.irreps_in1.dim, layer.irreps_in2.dim, layer.weight_numel)]
        for backward in (False, True):
            count(layer, x, backward)  # the first call: tiles found, batches made
            launches, ops = count(layer, x, backward)
            what = "forward+backward" if backward else "forward"
            print(f"{label:24} {what:17} Triton launches {launches:2}  torch ops {len(ops):2} {sorted(ops)}")
    per_edge = {name: 2 * 4 * dim for name, dim in (("out", layer.irreps_out.dim), ("x1", layer.irreps_in1.dim))}
    print(f"layout bytes per edge (read + written, fp32), either way: output {per_edge['out']}, output gradient "
          f"{per_edge['out']}, x1 {per_edge['x1']}, x1's gradient {per_edge['x1']}")


if __name__ == "__main__":
    main()
