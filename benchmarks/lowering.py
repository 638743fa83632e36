"""The torch lowering of a statement (`insum.reference.run_reference`) as an anchor: eager or
under torch.compile, and `fmt @ B` through it (`lowered_spmm`)."""

from __future__ import annotations

import torch

from insum.dtypes import compute_dtype

__all__ = ["Lowering", "allow_many_recompiles", "lowered_spmm"]


class Lowering:
    """A statement's torch reference lowering (`insum.reference.run_reference`) as a plain
    function of its tensors, eager or under `torch.compile`.

    Parsing and binding happen once, outside the function; the extents are read from the
    tensors' shapes inside it, so one compiled function serves every shape (dynamic after
    the first recompile). The lowering's index bounds checks are switched off while it
    runs: they are validation (and a host sync each), not part of the computation.
    """

    _compiled_cache: dict = {}

    def __init__(self, expr: str, names: tuple[str, ...], dynamic: bool | None = None):
        from insum.parser import parse

        self.dynamic = dynamic  # torch.compile's: None recompiles dynamic on a second shape
        self.expr = expr
        self.stmt = parse(expr)
        self.names = tuple(names)
        dims: dict[str, tuple[str, int]] = {}
        for access, _ in self.stmt.walk():
            for d, index in enumerate(access.indices):
                if index.variable is not None:
                    dims.setdefault(index.variable, (access.name, d))
        self.dims = dims
        self.out_name = self.stmt.output.name

    def _run(self, *values):
        # The index checks are off: validation (a host sync each), not the computation.
        from insum.reference import run_reference

        tensors = dict(zip(self.names, values))
        view = _BoundView(self.stmt, {v: tensors[n].shape[d] for v, (n, d) in self.dims.items()}, tensors)
        return run_reference(view, tensors[self.out_name], check_bounds=False)

    def eager(self, **tensors):
        return self._call(self._run, tensors)

    def compiled(self, **tensors):
        key = (self.expr, self.names, self.dynamic)
        fn = Lowering._compiled_cache.get(key)
        if fn is None:
            fn = Lowering._compiled_cache[key] = torch.compile(self._run, dynamic=self.dynamic)
        return self._call(fn, tensors)

    def _call(self, fn, tensors):
        return fn(*(tensors[n] for n in self.names))


class _BoundView:
    """What run_reference reads from a Bound: the statement, extents, tensors, device.

    Not `insum.bind.bind`: its checks (aliasing, shapes) would run inside torch.compile's
    trace, and one compiled lowering serves every shape, so its extents come from the
    tensors at each call."""

    def __init__(self, stmt, extents, tensors):
        self.stmt = stmt
        self.extents = extents
        self.tensors = tensors
        self.device = next(iter(tensors.values())).device


def allow_many_recompiles() -> None:
    """One compiled lowering per statement serves many shapes: raise dynamo's limits."""
    import torch._dynamo

    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))


def lowered_spmm(fmt, B_dtype: torch.dtype, compiled: bool, dynamic: bool | None = None):
    """`fmt @ B` through the torch lowering of the format's statement(s): a callable of B.

    Asks the format for its statements and views (`operand`, `output_shape`, `result`), so
    that the anchor computes what `fmt @ B` computes with the generated kernel swapped out;
    it accumulates from zeros with `+=`, half precision in float32.
    `dynamic` goes to torch.compile (True: one compilation for many matrices).
    """
    acc = compute_dtype(B_dtype)
    run = "compiled" if compiled else "eager"
    parts = [
        (getattr(Lowering(expr, tuple(sorted(tensors)) + ("B", "C"), dynamic=dynamic), run), tensors)
        for expr, tensors in fmt.statements()
    ]

    def spmm(B):
        C = torch.zeros(fmt.output_shape(B.shape[1]), dtype=acc, device=B.device)
        operand = fmt.operand(B)
        for call, tensors in parts:
            call(C=C, B=operand, **tensors)
        return fmt.result(C).to(B_dtype)

    return spmm
