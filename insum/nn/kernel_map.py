"""insum.nn.kernel_map: which input voxel each output voxel reads at each kernel offset.

A sparse convolution's kernel map is the table `nbr[v, w]`: the input row that output row
`v` multiplies by `weight[w]` (`-1` where that neighbour is absent). It is built on the
coordinates' device without a Python loop over points: coordinates become int64 keys
(batch and three 16-bit axes), the input keys are sorted once, and every (output, offset)
query is one `torch.searchsorted`. Keys are linear in the coordinates, so the query key of
an offset is the output's key plus the offset's key; each axis is checked on its own.

    >>> import torch
    >>> coords = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1]])
    >>> km = build_kernel_map(coords, kernel_size=3)
    >>> km.nbr[:, 13].tolist(), km.nbr[0, 14].item(), km.nbr[1, 12].item()
    ([0, 1], 1, 0)

The map is then packed into the tensors of the statements that run the convolution
(`tiles`, `pairs`); packings are computed once per map and kept on it, and maps are kept in
a `KernelMapCache` keyed by the coordinate tensors' identity, so the layers of a network
that share coordinates share one map.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..arith import cdiv, next_power_of_2
from ..errors import InsumError, InsumShapeError, InsumTypeError

__all__ = [
    "KernelMap",
    "KernelMapCache",
    "TiledMap",
    "PairGroups",
    "build_kernel_map",
    "output_coords",
    "tile_map",
    "pair_groups",
    "bucket_bounds",
    "default_cache",
]

_BITS = 16  # bits per spatial axis in a key; the batch index takes the top bits
_BIAS = 1 << (_BITS - 1)
_MODES = ("subm", "strided", "transposed")


def _as_batched(coords: torch.Tensor, name: str) -> torch.Tensor:
    """[N, 3] or [N, 4] (batch first) integer coordinates as an int64 [N, 4] tensor."""
    if coords.dtype.is_floating_point or coords.dtype == torch.bool:
        raise InsumTypeError(f"{name} must be an integer tensor, got {coords.dtype}")
    if coords.dim() != 2 or coords.shape[1] not in (3, 4):
        raise InsumShapeError(f"{name} must have shape [N, 3] or [N, 4] (batch first), got {tuple(coords.shape)}")
    coords = coords.to(torch.int64, copy=True)  # never the caller's tensor: a cached map must not keep it alive
    if coords.shape[1] == 3:
        coords = torch.cat([coords.new_zeros(coords.shape[0], 1), coords], 1)
    return coords


def _keys(coords: torch.Tensor) -> torch.Tensor:
    """int64 keys of [N, 4] coordinates whose axes lie in [-2**15, 2**15)."""
    key = coords[:, 0]
    for axis in range(1, 4):
        key = (key << _BITS) | (coords[:, axis] + _BIAS)
    return key


def _decode(keys: torch.Tensor) -> torch.Tensor:
    axes = [((keys >> (_BITS * (3 - a))) & ((1 << _BITS) - 1)) - _BIAS for a in range(1, 4)]
    return torch.stack([keys >> (3 * _BITS)] + axes, 1)


def _check_range(coords: torch.Tensor, reach: int, name: str) -> None:
    if coords.numel() == 0:
        return
    lo, hi = coords[:, 1:].min().item(), coords[:, 1:].max().item()
    if lo - reach < -_BIAS or hi + reach >= _BIAS or coords[:, 0].min().item() < 0:
        raise InsumError(
            f"{name}: coordinates must lie in [{-_BIAS + reach}, {_BIAS - reach}) with a non-negative batch "
            f"index for this kernel, got [{lo}, {hi}]"
        )


def _taps(kernel_size: int, dilation: int, device) -> torch.Tensor:
    """Per-axis offsets dilation * (i - r) of the kernel taps, r = (k - 1) // 2."""
    return dilation * (torch.arange(kernel_size, device=device) - (kernel_size - 1) // 2)


def _per_axis_positions(coords: torch.Tensor, mode: str, taps: torch.Tensor, stride: int):
    """For each output row and tap, the input coordinate on each axis and whether it exists.

    subm: x + t; strided: o * s + t; transposed: (x - t) / s where divisible.
    Returns positions [N, 3, k] and validity [N, 3, k] (None when always valid)."""
    pos = coords[:, 1:, None]
    if mode == "subm":
        return pos + taps, None
    if mode == "strided":
        return pos * stride + taps, None
    shifted = pos - taps
    return torch.div(shifted, stride, rounding_mode="floor"), shifted.remainder(stride) == 0


def _combine(per_axis: torch.Tensor) -> torch.Tensor:
    """[N, 3, k] per-axis values -> [N, k**3] sums over (x, y, z) taps, z fastest."""
    x, y, z = per_axis[:, 0], per_axis[:, 1], per_axis[:, 2]
    return (x[:, :, None, None] + y[:, None, :, None] + z[:, None, None, :]).flatten(1)


def _query_keys(coords: torch.Tensor, mode: str, kernel_size: int, stride: int, dilation: int):
    """Keys [N, k**3] of the input positions each output row reads, and their validity."""
    taps = _taps(kernel_size, dilation, coords.device)
    pos, ok = _per_axis_positions(coords, mode, taps, stride)
    shifts = torch.tensor([2 * _BITS, _BITS, 0], device=coords.device)[None, :, None]
    keys = _combine((pos + _BIAS) << shifts) + (coords[:, :1] << (3 * _BITS))
    valid = None if ok is None else _combine(ok.to(torch.int8)) == 3
    return keys, valid


def output_coords(coords: torch.Tensor, kernel_size: int = 3, stride: int = 1, dilation: int = 1) -> torch.Tensor:
    """The active output sites of a strided (non-submanifold) convolution, sorted by key.

    Output o is active when some input lies at o * stride + dilation * (i - r) for a tap i
    (the sites `torch.nn.functional.conv3d(padding=dilation * r, stride=stride)` would
    compute from a nonzero input). int64 [M, 4], batch first."""
    coords = _as_batched(coords, "coords")
    _check_range(coords, dilation * kernel_size, "coords")
    # The outputs that read input x are the transposed-mode positions of x.
    keys, valid = _query_keys(coords, "transposed", kernel_size, stride, dilation)
    return _decode(torch.unique(keys[valid]))


@dataclass
class TiledMap:
    """The output-stationary packing: output rows sorted by their neighbour mask, cut in
    tiles of `tile` rows, each tile reading only the offsets some row in it needs.

    For bucket b (tiles with at most J_b offsets), rows `tiles[b]` of the tiled output:
        O[t, m, co] = X[NB[t, m, j], ci] * W[TW[t, j], ci, co]
    with X the input and one zero row appended (absent neighbours read it). `inverse[v]` is
    where output row v sits in the tiled output ([T * tile] rows)."""

    tile: int
    n_tiles: int
    buckets: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (first tile, last tile + 1, NB, TW)
    inverse: torch.Tensor
    real_pairs: int
    padded_pairs: int


@dataclass
class PairGroups:
    """The pairs of each offset in groups of `group` (padding reads the zero row of X):
        dWp[p, ci, co] = X[PI[p, q], ci] * dO[PO[p, q], co];  dW[PW[p]] += dWp[p]
        O[PO[p, q], co] += X[PI[p, q], ci] * W[PW[p], ci, co]"""

    group: int
    PI: torch.Tensor
    PO: torch.Tensor
    PW: torch.Tensor


@dataclass
class KernelMap:
    """nbr[v, w]: the input row read by output row v at offset w (-1: absent)."""

    nbr: torch.Tensor
    n_in: int
    out_coords: torch.Tensor
    kernel_size: int
    _packed: dict = field(default_factory=dict, repr=False)

    @property
    def n_out(self) -> int:
        return self.nbr.shape[0]

    @property
    def volume(self) -> int:
        return self.nbr.shape[1]

    @property
    def pairs(self) -> int:
        """Real (input, output, offset) triples: the work of the convolution."""
        return self.cached("pairs", lambda: int((self.nbr >= 0).sum()))

    def prepare(self, tile: int = 128, training: bool = True, mask_dtype: torch.dtype | None = None) -> KernelMap:
        """Build the packings a forward (either form) and, with `training`, a backward pass
        read, so that a function compiled with `torch.compile(fullgraph=True)` only looks
        them up. mask_dtype: also the masked packings (`absent="mask"`) for that dtype."""
        self.pairs, self.tiles(tile), self.tiles_whole(tile), self.pair_groups(tile)
        if training:
            self.transpose().tiles(tile), self.transpose().tiles_whole(tile)
            self.pair_groups()
        if mask_dtype is not None:
            self.masked_tiles(tile, mask_dtype), self.masked_tiles_whole(tile, mask_dtype), self.masked_pairs(tile, mask_dtype)
            if training:
                self.transpose().masked_tiles(tile, mask_dtype), self.transpose().masked_tiles_whole(tile, mask_dtype)
                self.masked_pairs(None, mask_dtype)
        return self

    def transpose(self) -> KernelMap:
        """The map of the adjoint: for each input row and offset, the output that reads it."""
        return self.cached("transpose", lambda: _transpose(self))

    def tiles(self, tile: int = 128) -> TiledMap:
        return self.cached(("tiles", tile), lambda: tile_map(self.nbr, self.n_in, tile))

    def pair_groups(self, group: int | None = None) -> PairGroups:
        return self.cached(("pairs", group), lambda: pair_groups(self.nbr, self.n_in, group))

    def tiles_whole(self, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every tile in one launch: NB [T, tile, J] and TW [T, J] padded to the widest tile
        (NB = n_in, the zero row; TW = 0), and TL [T], each tile's active offsets (its first
        TL[t] entries): `insum(..., lengths={"j[t]": TL})` stops each tile's loop there."""

        def make():
            tiled = self.tiles(tile)
            width = max(nb.shape[2] for _, _, nb, _ in tiled.buckets)
            device = self.nbr.device
            NB = torch.full((tiled.n_tiles, tiled.tile, width), self.n_in, dtype=torch.int32, device=device)
            TW = torch.zeros((tiled.n_tiles, width), dtype=torch.int32, device=device)
            for start, end, nb, tw in tiled.buckets:
                NB[start:end, :, : nb.shape[2]] = nb
                TW[start:end, : tw.shape[1]] = tw
            TL = (NB != self.n_in).any(1).sum(1).to(torch.int32)  # active offsets come first in a tile
            return NB, TW, TL

        return self.cached(("tiles whole", tile), make)

    def masked_tiles_whole(self, tile: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`tiles_whole` without the zero row: (NB, V, TW, TL), absent neighbours reading row 0
        with V = 0."""

        def make():
            NB, TW, TL = self.tiles_whole(tile)
            return torch.where(NB == self.n_in, 0, NB), (NB != self.n_in).to(dtype), TW, TL

        return self.cached(("masked tiles whole", tile, dtype), make)

    def masked_tiles(self, tile: int, dtype: torch.dtype) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The tiled buckets without the zero row: (first tile, last tile + 1, NB, V, TW) with
        absent neighbours reading row 0 and V = 0 there (1 elsewhere), V in `dtype`."""

        def make():
            return [(start, end, torch.where(nb == self.n_in, 0, nb), (nb != self.n_in).to(dtype), tw)
                    for start, end, nb, tw in self.tiles(tile).buckets]

        return self.cached(("masked tiles", tile, dtype), make)

    def masked_pairs(self, group: int | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(PI, V) of the grouped pairs without the zero row: padding reads row 0, V = 0 there."""

        def make():
            real = self.pair_groups(group).PI != self.n_in
            return torch.where(real, self.pair_groups(group).PI, 0), real.to(dtype)

        return self.cached(("masked pairs", group, dtype), make)

    def cached(self, key, make):
        """`make()` once per key, kept on the map (packings, derived coordinates)."""
        if key not in self._packed:
            self._packed[key] = make()
        return self._packed[key]


def _transpose(km: KernelMap) -> KernelMap:
    out, w = (km.nbr >= 0).nonzero(as_tuple=True)
    nbr_t = torch.full((km.n_in, km.volume), -1, dtype=km.nbr.dtype, device=km.nbr.device)
    nbr_t[km.nbr[out, w].long(), w] = out.to(km.nbr.dtype)
    return KernelMap(nbr_t, km.n_out, km.out_coords.new_empty(0, 4), km.kernel_size)


def build_kernel_map(
    coords: torch.Tensor,
    kernel_size: int = 3,
    stride: int = 1,
    dilation: int = 1,
    mode: str = "subm",
    out_coords: torch.Tensor | None = None,
) -> KernelMap:
    """The kernel map from `coords` (the input sites) to the output sites.

    mode "subm": outputs at the input sites, reading x + dilation * (i - r).
    mode "strided": outputs at `out_coords` (default: `output_coords(...)`), reading
    o * stride + dilation * (i - r). mode "transposed": outputs at `out_coords` (required,
    the finer sites), reading (x - dilation * (i - r)) / stride where that is an integer:
    the adjoint of the strided map. Coordinates are [N, 3] or [N, 4] (batch first)."""
    if mode not in _MODES:
        raise InsumError(f"unknown kernel map mode {mode!r}; choose one of {', '.join(_MODES)}")
    if kernel_size < 1 or stride < 1 or dilation < 1:
        raise InsumError(f"kernel_size, stride and dilation must be positive, got {kernel_size}, {stride}, {dilation}")
    coords = _as_batched(coords, "coords")
    reach = dilation * kernel_size
    _check_range(coords, reach, "coords")
    if mode == "subm":
        out = coords
    elif out_coords is None:
        if mode == "transposed":
            raise InsumError("a transposed convolution needs out_coords (the sites to upsample onto)")
        out = output_coords(coords, kernel_size, stride, dilation)
    else:
        out = _as_batched(out_coords, "out_coords")
        scale = stride if mode == "strided" else 1
        _check_range(out * torch.tensor([1, scale, scale, scale], device=out.device), reach, "out_coords")
    in_keys, order = torch.sort(_keys(coords))
    query, valid = _query_keys(out, mode, kernel_size, stride, dilation)
    if coords.shape[0] == 0:
        nbr = torch.full(query.shape, -1, dtype=torch.int32, device=coords.device)
    else:
        pos = torch.searchsorted(in_keys, query).clamp_max_(coords.shape[0] - 1)
        hit = in_keys[pos] == query
        if valid is not None:
            hit &= valid
        nbr = torch.where(hit, order[pos], -1).to(torch.int32)
    return KernelMap(nbr, coords.shape[0], out, kernel_size)


def bucket_bounds(counts: list[int], max_buckets: int) -> list[int]:
    """Split items sorted by count (tiles by offsets, tensor-product rows by CG entries) into
    at most `max_buckets` runs minimising the padded work sum(run length * run maximum).
    Returns the run ends."""
    n = len(counts)
    if n == 0:
        return []
    # Candidate cut points: where the count changes (few distinct counts).
    ends = [i + 1 for i in range(n - 1) if counts[i] != counts[i + 1]] + [n]
    best = {0: (0, [])}  # start -> (cost, ends) with `b` runs so far
    for _ in range(max_buckets):
        nxt = dict(best)
        for start, (cost, runs) in best.items():
            for end in ends:
                if end <= start:
                    continue
                c = cost + (end - start) * counts[end - 1]
                if end not in nxt or c < nxt[end][0]:
                    nxt[end] = (c, runs + [end])
        best = nxt
    return best[n][1]


def tile_map(nbr: torch.Tensor, n_in: int, tile: int = 128, max_buckets: int = 6) -> TiledMap:
    """Pack a kernel map into the output-stationary tiled form (see `TiledMap`)."""
    n_out, volume = nbr.shape
    device = nbr.device
    found = nbr >= 0
    bits = min(volume, 62)
    mask = (found[:, :bits].long() << torch.arange(bits, device=device)).sum(1)
    order = torch.argsort(mask, stable=True)
    n_tiles = max(1, cdiv(n_out, tile))
    rows = torch.full((n_tiles * tile,), -1, dtype=torch.long, device=device)
    rows[:n_out] = order
    rows = rows.view(n_tiles, tile)
    # Row -1 (padding) reads an appended row with no neighbours.
    nbr_padded = torch.cat([nbr, nbr.new_full((1, volume), -1)])
    row_found = nbr_padded[rows] >= 0  # [T, tile, volume]
    active = row_found.any(1)  # [T, volume]
    counts = active.sum(1)
    counts, tile_order = torch.sort(counts, stable=True)
    rows, active = rows[tile_order], active[tile_order]
    inverse = torch.empty(n_out, dtype=torch.long, device=device)
    flat = rows.flatten()
    real = flat >= 0
    inverse[flat[real]] = torch.arange(flat.numel(), device=device)[real]
    host_counts = counts.tolist()
    buckets = []
    start = 0
    for end in bucket_bounds(host_counts, max_buckets):
        width = max(1, host_counts[end - 1])
        # The tile's active offsets first, in offset order.
        tw = torch.argsort((~active[start:end]).to(torch.int8), dim=1, stable=True)[:, :width]
        nb = nbr_padded[rows[start:end, :, None], tw[:, None, :]].long()  # [t, tile, width]
        nb = torch.where(nb >= 0, nb, n_in)
        buckets.append((start, end, nb.to(torch.int32).contiguous(), tw.to(torch.int32).contiguous()))
        start = end
    padded = sum((end - start) * tile * nb.shape[2] for start, end, nb, _ in buckets)
    return TiledMap(tile, n_tiles, buckets, inverse, int(found.sum()), padded)


def pair_groups(nbr: torch.Tensor, n_in: int, group: int | None = None) -> PairGroups:
    """Pack a kernel map into per-offset groups of `group` pairs (default: about 384 groups)."""
    w, out = (nbr.t() >= 0).nonzero(as_tuple=True)  # sorted by offset, then output row
    inp = nbr[out, w].long()
    volume = nbr.shape[1]
    n_pairs = int(w.numel())
    if group is None:
        group = min(16384, max(256, next_power_of_2(cdiv(max(1, n_pairs), 384))))
    per_offset = torch.bincount(w, minlength=volume)
    groups = cdiv(per_offset, group)
    first_group = torch.cumsum(groups, 0) - groups
    first_pair = torch.cumsum(per_offset, 0) - per_offset
    n_groups = max(1, int(groups.sum()))
    rank = torch.arange(n_pairs, device=nbr.device) - first_pair[w]
    gid = first_group[w] + rank // group
    slot = rank % group
    PI = torch.full((n_groups, group), n_in, dtype=torch.int32, device=nbr.device)
    PO = torch.zeros((n_groups, group), dtype=torch.int32, device=nbr.device)
    PI[gid, slot] = inp.to(torch.int32)
    PO[gid, slot] = out.to(torch.int32)
    PW = torch.repeat_interleave(torch.arange(volume, device=nbr.device), groups)
    if PW.numel() == 0:
        PW = torch.zeros(1, dtype=torch.long, device=nbr.device)
    return PairGroups(group, PI, PO, PW)


class KernelMapCache:
    """Kernel maps keyed by the identity and version of the coordinate tensors (and the
    kernel's geometry). Entries die with their coordinate tensors. Pass one cache to every
    layer of a network, or rely on `default_cache`."""

    def __init__(self) -> None:
        self._maps: dict[tuple, tuple[list[weakref.ref], KernelMap]] = {}

    def get(
        self,
        coords: torch.Tensor,
        kernel_size: int,
        stride: int,
        dilation: int,
        mode: str,
        out_coords: torch.Tensor | None = None,
    ) -> KernelMap:
        tensors = [t for t in (coords, out_coords) if t is not None]
        key = (mode, kernel_size, stride, dilation) + tuple((id(t), t._version) for t in tensors)
        hit = self._maps.get(key)
        if hit is not None and all(ref() is t for ref, t in zip(hit[0], tensors)):
            return hit[1]
        km = build_kernel_map(coords, kernel_size, stride, dilation, mode, out_coords)
        refs = [weakref.ref(t, lambda _, key=key: self._maps.pop(key, None)) for t in tensors]
        self._maps[key] = (refs, km)
        return km

    def __len__(self) -> int:
        return len(self._maps)

    def clear(self) -> None:
        self._maps.clear()


default_cache = KernelMapCache()
