"""insum.nn.layout: e3nn's irreps layout <-> component-major, as coalesced block transposes.

A tensor product's statement reads input 1 and writes its output component-major,
`T[b, c, u]` (component c = an irrep entry's row m, channel u), while e3nn lays each irrep
entry of multiplicity U and dimension D out as `[U, D]` blocks, `F[b, offset + u*D + m]`.
Between the two, each block is a transpose: F's block `[U, D]` is T's rows `[D, U]` swapped.
A gather through a flat index table (`index_select`) reads one side strided by the
multiplicity; here each run of equal blocks (same U and D, consecutive in both layouts)
is one copy statement on strided views, no index tensor,

    F[b, i, u, m] = T[b, i, m, u]        (to e3nn's layout; i: the run's blocks)
    T[b, i, m, u] = F[b, i, u, m]        (to component-major)

run with both of its unit-stride variables (u and m) tiled, so that Triton gives the load
and the store each its own coalesced layout (converting through shared memory), and all
runs of one direction go out as one launch (`insum.runtime.batch_launch`; each run's
elements are its own). Runs of 1-dimensional entries (0e) are plain copies,
`F[b, i, u] = T[b, i, u]`, planned by the cost model.

    >>> import numpy as np
    >>> index = np.array([[0, 1], [2, 5], [3, 6], [4, 7]])  # 2x0e + 2x1o: rows 0e, 1o m=0..2
    >>> [tuple(r) for r in BlockLayout(index, 8).runs]
    [(0, 0, 1, 2, 1), (2, 1, 1, 2, 3)]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..bind import bind
from ..cache import BoundedCache
from ..codegen.schedule import plan_of, rank
from ..parser import parse
from ..runtime import Kernel, batch_launch, spec_for

__all__ = ["BlockLayout", "Run", "TO_FLAT", "TO_COMPONENTS", "COPY_TO_FLAT", "COPY_TO_COMPONENTS", "copy_kernel"]

#: A run of [D, U] component-major blocks into e3nn's [U, D] blocks, and back.
TO_FLAT = "F[b,i,u,m] = T[b,i,m,u]"
TO_COMPONENTS = "T[b,i,m,u] = F[b,i,u,m]"
#: A run of 1-dimensional entries (D = 1): the same positions in both layouts' order.
COPY_TO_FLAT = "F[b,i,u] = T[b,i,u]"
COPY_TO_COMPONENTS = "T[b,i,u] = F[b,i,u]"


class Run(NamedTuple):
    """n consecutive irrep entries of multiplicity U and dimension D: at `offset` in e3nn's
    layout (n blocks of U*D), at component row `row` in the component-major one (n*D rows)."""

    offset: int
    row: int
    n: int
    U: int
    D: int


def _runs(index: np.ndarray, flat_dim: int) -> tuple[Run, ...] | None:
    """The runs of a layout table (index[c, u]: the flat position of component c, channel
    u; flat_dim marks a padded channel), or None where it is not made of such blocks."""
    rows, width = index.shape
    real = index < flat_dim
    runs: list[Run] = []
    c = 0
    while c < rows:
        U = int(real[c].sum())
        if U == 0 or not real[c, :U].all():
            return None
        D = int(index[c, 1] - index[c, 0]) if U > 1 else 1
        if D < 1 or c + D > rows:
            return None
        block = index[c : c + D]
        expected = index[c, 0] + np.arange(U)[None, :] * D + np.arange(D)[:, None]
        if not (block[:, :U] == expected).all() or real[c : c + D, U:].any():
            return None
        last = runs[-1] if runs else None
        if last is not None and (last.U, last.D) == (U, D) and last.row + last.n * D == c \
                and last.offset + last.n * U * D == index[c, 0]:
            runs[-1] = last._replace(n=last.n + 1)
        else:
            runs.append(Run(int(index[c, 0]), c, 1, U, D))
        c += D
    covered = np.sort(index[real])
    if covered.size != flat_dim or not (covered == np.arange(flat_dim)).all():
        return None
    return tuple(runs)


_KERNELS: BoundedCache[object, Kernel] = BoundedCache()


def copy_kernel(bound) -> Kernel:
    """The kernel of one copy statement on its bound views: for a transpose (TO_FLAT,
    TO_COMPONENTS), the plan with both unit-stride variables tiled, u on M and m on N, the
    rest (b, i) on the grid; for a plain copy, the cost model's. Kept per kernel spec (the
    shared kernel whose tuned configurations a benchmark may set)."""
    spec = spec_for(bound, "ieee", descriptors=False)
    kernel = _KERNELS.get(spec)
    if kernel is None:
        plan = None
        if "m" in bound.extents:
            chosen = next(c for c in rank(spec) if not c.stacked and dict(c.tiles) == {"M": "u", "N": "m"})
            plan = plan_of(spec, chosen)
        kernel = _KERNELS[spec] = Kernel(spec, plan)
    return kernel


class _Prepared:
    """The copies of one direction for one signature: per run its views' geometry (size,
    stride and offset into the flat and the component-major tensor) and the one-launch
    batch of all runs once each has its configuration (None before)."""

    __slots__ = ("geometry", "batch")

    def __init__(self, geometry: tuple, batch) -> None:
        self.geometry = geometry
        self.batch = batch


class BlockLayout:
    """The block transposes between e3nn's layout [batch, flat_dim] and the component-major
    one [batch, rows, channels] that a layout table describes (`index[c, u]`: the flat
    position of component c, channel u, or flat_dim for a padded channel, which reads zero).

    `runs` is None where the table is not made of [U, D] blocks (row-sorted tables): the
    caller then gathers through the table. Both directions run as insum copy statements
    (`to_flat`, `to_components`), one launch each after the first call.
    """

    def __init__(self, index: np.ndarray, flat_dim: int) -> None:
        index = np.asarray(index).reshape(index.shape[0], -1)
        self.rows, self.channels = index.shape
        self.flat_dim = flat_dim
        self.runs = _runs(index, flat_dim)
        self.padded = bool((index >= flat_dim).any())
        self._prepared: BoundedCache[tuple, _Prepared] = BoundedCache()

    def __getstate__(self) -> dict:
        """A copy or pickle starts without the prepared launches (made anew on first use)."""
        return {name: getattr(self, name) for name in ("rows", "channels", "flat_dim", "runs", "padded")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._prepared = BoundedCache()

    def _geometry(self, flat: torch.Tensor, comp: torch.Tensor) -> tuple:
        """Per run, (kind, flat view's size, stride, offset, component-major view's size,
        stride, offset), offsets from the tensors' own: [B, n, U, D] and [B, n, D, U] for a
        transpose, [B, n, U] twice for a 1-dimensional run."""
        B = flat.shape[0]
        sf, sc = flat.stride(), comp.stride()
        out = []
        for offset, row, n, U, D in self.runs:
            if D == 1:
                out.append(("copy", (B, n, U), (sf[0], U * sf[1], sf[1]), offset * sf[1],
                            (B, n, U), (sc[0], sc[1], sc[2]), row * sc[1]))
            else:
                out.append(("transpose", (B, n, U, D), (sf[0], U * D * sf[1], D * sf[1], sf[1]), offset * sf[1],
                            (B, n, D, U), (sc[0], D * sc[1], sc[1], sc[2]), row * sc[1]))
        return tuple(out)

    def _views(self, flat: torch.Tensor, comp: torch.Tensor, geometry: tuple | None = None) -> list[tuple]:
        """Per run, (kind, flat view, component-major view) (see `_geometry`)."""
        f0, c0 = flat.storage_offset(), comp.storage_offset()
        return [(kind, flat.as_strided(fs, fst, f0 + fo), comp.as_strided(cs, cst, c0 + co))
                for kind, fs, fst, fo, cs, cst, co in geometry or self._geometry(flat, comp)]

    def _run(self, to_flat: bool, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy `source` into `target` (flat -> component-major or back), run by run."""
        flat, comp = (target, source) if to_flat else (source, target)
        key = (to_flat, source.dtype, source.device, source.shape, source.stride(), target.stride())
        prepared = self._prepared.get(key)
        if prepared is not None and prepared.batch is not None:
            views = self._views(flat, comp, prepared.geometry)
            prepared.batch.run([({"F": fv, "T": cv}, fv if to_flat else cv) for _, fv, cv in views])
            return
        geometry = self._geometry(flat, comp)
        parts = []
        for kind, fv, cv in self._views(flat, comp, geometry):
            if kind == "copy":
                text = COPY_TO_FLAT if to_flat else COPY_TO_COMPONENTS
            else:
                text = TO_FLAT if to_flat else TO_COMPONENTS
            bound = bind(parse(text), {"F": fv, "T": cv})
            launcher = copy_kernel(bound).prepared(bound)
            launcher.run(bound.tensors, fv if to_flat else cv)
            parts.append(launcher)
        batch = None
        if len(parts) > 1 and all(p.config is not None for p in parts):
            batch = batch_launch(parts, disjoint=True)
        elif len(parts) == 1:
            batch = _Single(parts[0])
        self._prepared[key] = _Prepared(geometry, batch)

    def to_flat(self, comp: torch.Tensor) -> torch.Tensor:
        """e3nn's layout [B, flat_dim] of a component-major [B, rows, channels] tensor."""
        flat = comp.new_empty(comp.shape[0], self.flat_dim)
        if flat.numel():
            self._run(True, comp, flat)
        return flat

    def to_components(self, flat: torch.Tensor) -> torch.Tensor:
        """The component-major [B, rows, channels] tensor of e3nn's layout [B, flat_dim]
        (padded channels zero)."""
        make = flat.new_zeros if self.padded else flat.new_empty
        comp = make(flat.shape[0], self.rows, self.channels)
        if comp.numel():
            self._run(False, flat, comp)
        return comp


class _Single:
    """One run: its launcher as the batch (the same `run` signature)."""

    __slots__ = ("launcher",)

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def run(self, calls) -> None:
        (tensors, out), = calls
        self.launcher.run(tensors, out)
