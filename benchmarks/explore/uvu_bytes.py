"""Launches and compulsory bytes per edge of the channel-wise ("uvu") layer's forward, by output layout.

    python -m benchmarks.explore.uvu_bytes [--edges 16]

MACE-like irreps (128x0e+128x1o+128x2e ⊗ sh up to 3, per-edge weights), float32, on the CPU
(the torch lowering runs the statements: only what each launch touches is counted). Every
launch (an insum statement, or a torch op such as the layout gathers' `index_select`)
counts each of its per-edge tensors once, read or written (tables with no edge dimension,
the CG tables and the gathers' index, are a few KB per launch, not per edge, and are left
out): the HBM traffic a launch cannot avoid, divided by the edges.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import insum.nn.tensor_product as tp_module
from insum.nn import TensorProduct
from insum.nn.tensor_product import mace_instructions

IRREPS1, IRREPS2, LMAX = "128x0e+128x1o+128x2e", "0e+1o+2e+3o", 3


def _per_edge_bytes(tensors, edges: int) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == edges)


class _Count(TorchDispatchMode):
    """Launches and bytes of the torch ops outside insum statements (views are free)."""

    def __init__(self, edges: int):
        super().__init__()
        self.edges = edges
        self.launches, self.bytes, self.inside = [], 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside or func.is_view or func in (torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default):
            return out
        self.launches.append(str(func))
        self.bytes += _per_edge_bytes((*args, *(kwargs or {}).values(), out), self.edges)
        return out


def measure(output: str, edges: int) -> tuple[list[str], float]:
    irreps_out, ins = mace_instructions(IRREPS1, IRREPS2, LMAX)
    layer = TensorProduct(IRREPS1, IRREPS2, irreps_out, ins, shared_weights=False, backend="torch", output=output)
    x1, x2 = torch.randn(edges, layer.irreps_in1.dim), torch.randn(edges, layer.irreps_in2.dim)
    w = torch.randn(edges, layer.weight_numel)
    layer(x1, x2, w)  # value tables converted once
    count = _Count(edges)
    real = tp_module.insum

    def statement(expr, **kwargs):
        count.launches.append(f"insum: {expr}")
        count.inside = True
        try:
            out = real(expr, **kwargs)
        finally:
            count.inside = False
        given = [t for t in kwargs.values() if isinstance(t, torch.Tensor)]
        count.bytes += _per_edge_bytes(given + ([] if any(t is out for t in given) else [out]), edges)
        return out

    tp_module.insum = statement
    try:
        with torch.no_grad(), count:
            layer(x1, x2, w)
    finally:
        tp_module.insum = real
    return count.launches, count.bytes / edges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", type=int, default=16)
    args = parser.parse_args()
    for output in ("gather", "indexed", "flat"):
        launches, per_edge = measure(output, args.edges)
        print(f"output={output!r}: {len(launches)} launches, {per_edge / 1000:.1f} KB per edge")
        for launch in launches:
            print(f"    {launch}")


if __name__ == "__main__":
    main()
