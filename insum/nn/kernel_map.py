"""insum.nn.kernel_map: which input voxel each output voxel reads at each kernel offset.

A sparse convolution's kernel map is the table `nbr[v, w]`: the input row that output row
`v` multiplies by `weight[w]` (`-1` where that neighbour is absent). It is built on the
coordinates' device without a Python loop over points: coordinates become int64 keys
(batch and three 16-bit axes). On CUDA the input keys go into a hash table (one insert
kernel) and one probe kernel looks every (output, offset) query up in it (`_lookup_hashed`,
every mode); elsewhere (and with INSUM_MAP_KERNELS=0) the keys are sorted once and the
queries found by one `torch.searchsorted`. Both give the same map, duplicate sites
included (every copy reads the first copy's row; such a map is not symmetric, and its
transpose, a convolution's input gradient, raises: several outputs would read one input at
one offset). Keys are linear in the coordinates, so
the query key of an offset is the output's key plus the offset's key; each axis is checked
on its own.

    >>> import torch
    >>> coords = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1]])
    >>> km = build_kernel_map(coords, kernel_size=3)
    >>> km.nbr[:, 13].tolist(), km.nbr[0, 14].item(), km.nbr[1, 12].item()
    ([0, 1], 1, 0)

The map is then packed into the tensors of the statements that run the convolution
(`tiles`, `pairs`); packings are computed once per map and kept on it, and maps are kept in
a `KernelMapCache` keyed by the coordinate tensors' identity, so the layers of a network
that share coordinates share one map.

On a GPU, at 100k-1M voxels, the build's time is host time (kernel launches, host syncs)
and the lookup's chains of dependent reads (the sorted-keys build, 1.37 ms at 1.2M voxels
on an H200: a sort, then 9 binary searches of 21 dependent reads per site), so it is
written to few torch ops, few syncs and short probes (counted by
`benchmarks/map_overhead.py`): the range check and the per-offset pair counts are read
back in one sync at the end of the build (on CUDA both written by the lookup kernels); the
tiles are one sort of the rows' neighbour bitmasks, two kernels and one small sort, and
the one-launch packing reads one value (their width) and is one kernel; the transposed map
of a submanifold map with an odd kernel is the offset-mirrored map, reuses the forward
tiles and copies the table only when read; the pair groups are sized from the counts
already on the host (and on CUDA written by two kernels around one scan of per-block pair
counts).
Shape-deciding values come to the host only there, never through `nonzero` or a mask.
"""

from __future__ import annotations

import functools
import numbers
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..arith import cdiv, next_power_of_2
from ..errors import InsumError, InsumShapeError, InsumTypeError
from ..settings import flag

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
MAX_BATCH = (1 << (63 - 3 * _BITS)) - 1  # the greatest batch index the key's top field holds
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


@functools.cache
def _key_layout(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bias, shift) per column of [N, 4] coordinates: key = sum((c + bias) << shift).
    Kept per device: a tensor built from a list is a host-to-device copy, a sync on CUDA."""
    bias = torch.tensor([0, _BIAS, _BIAS, _BIAS], device=device)
    shift = torch.tensor([3 * _BITS, 2 * _BITS, _BITS, 0], device=device)
    return bias, shift


def _keys(coords: torch.Tensor) -> torch.Tensor:
    """int64 keys of [N, 4] coordinates whose axes lie in [-2**15, 2**15) (the fields do not
    overlap, so their sum is their bitwise or)."""
    bias, shift = _key_layout(coords.device)
    return ((coords + bias) << shift).sum(1)


def _decode(keys: torch.Tensor) -> torch.Tensor:
    axes = [((keys >> (_BITS * (3 - a))) & ((1 << _BITS) - 1)) - _BIAS for a in range(1, 4)]
    return torch.stack([keys >> (3 * _BITS)] + axes, 1)


def _range_stats(coords: torch.Tensor) -> list[torch.Tensor]:
    """Device scalars (least and greatest axis value, least and greatest batch index) of
    non-empty [N, 4] coordinates, for `_batch_room` and `_check_stats` once on the host."""
    lo, hi = torch.aminmax(coords[:, 1:])
    batch_lo, batch_hi = torch.aminmax(coords[:, 0])
    return [lo.view(1), hi.view(1), batch_lo.view(1), batch_hi.view(1)]


def _batch_room(stats: list[int]) -> list[int]:
    """`_range_stats`' four values as `_check_stats` takes them (the hash kernels' three):
    the batch index's least room min(batch, MAX_BATCH - batch), negative where one is out of
    range."""
    lo, hi, batch_lo, batch_hi = stats
    return [lo, hi, min(batch_lo, MAX_BATCH - batch_hi)]


def _check_stats(stats: list[int], scale: int, reach: int, name: str) -> None:
    """Raise unless (lo, hi, batch room) from `_range_stats`, axes times `scale`, leave
    `reach` of room on both sides of the key's 16-bit axes, and the batch indices lie in
    [0, MAX_BATCH] (the key's top field: a larger one would alias another batch)."""
    lo, hi, batch = stats
    if lo * scale - reach < -_BIAS or hi * scale + reach >= _BIAS or batch < 0:
        raise InsumError(
            f"{name}: coordinates must lie in [{-_BIAS + reach}, {_BIAS - reach}) and batch indices in "
            f"[0, {MAX_BATCH}] for this kernel, got axes in [{lo * scale}, {hi * scale}]"
        )


def _check_range(coords: torch.Tensor, reach: int, name: str) -> None:
    if coords.numel():
        _check_stats(_batch_room(torch.cat(_range_stats(coords)).tolist()), 1, reach, name)


@functools.cache
def _taps(kernel_size: int, dilation: int, device: torch.device) -> torch.Tensor:
    """Per-axis offsets dilation * (i - r) of the kernel taps, r = (k - 1) // 2 (kept per
    device and geometry: built once, not per map)."""
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
    bias, shift = _key_layout(coords.device)
    per_axis = (pos + bias[1:, None]) << shift[1:, None]  # [N, 3, k]
    per_axis[:, 0] += coords[:, :1] << (3 * _BITS)  # the batch field rides on the x term
    keys = _combine(per_axis)
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


class TiledMap:
    """The output-stationary packing: output rows sorted by their neighbour mask, cut in
    tiles of `tile` rows, each tile reading only the offsets some row in it needs.

    For bucket b (tiles with at most J_b offsets), rows `tiles[b]` of the tiled output:
        O[t, m, co] = X[NB[t, m, j], ci] * W[TW[t, j], ci, co]
    with X the input and one zero row appended (absent neighbours read it). `inverse[v]` is
    where output row v sits in the tiled output ([T * tile] rows). `whole()` is every tile
    in one launch. The buckets (a host loop over the tiles' offset counts) and the pair
    totals are computed on first use: the one-launch path never reads them."""

    def __init__(self, tile: int, nbr: torch.Tensor | None, n_in: int, rows: torch.Tensor, active: torch.Tensor,
                 counts: torch.Tensor, inverse: torch.Tensor, max_buckets: int, mirror_of: TiledMap | None = None,
                 output_rows: torch.Tensor | None = None, width: int | None = None):
        self.tile, self.n_tiles, self.inverse = tile, rows.shape[0], inverse
        # rows [T, tile] (-1: padding), active [T, volume], counts [T] ascending: the tiles
        self._nbr, self._n_in, self._rows, self._active, self._counts = nbr, n_in, rows, active, counts
        self._max_buckets, self._mirror_of = max_buckets, mirror_of
        self._buckets: list | None = None
        self._whole: tuple | None = None
        self._output_rows = output_rows  # (the placing kernel writes them with the rows)
        self._width = width  # `whole()`'s J when the host knows a bound (no read of the counts)

    def mirrored(self) -> TiledMap:
        """The same tiles over the offset-mirrored map `nbr.flip(1)` (the transpose of a
        submanifold map with an odd kernel): each row reads the same inputs at the mirrored
        offsets. The mirrored table is made only for the buckets (`_table`)."""
        return TiledMap(self.tile, None, self._n_in, self._rows, self._active.flip(1), self._counts,
                        self.inverse, self._max_buckets, mirror_of=self, width=self._width)

    def _table(self) -> torch.Tensor:
        """The map the tiles pack (a mirrored tiling: its forward tiling's, flipped once)."""
        if self._nbr is None:
            self._nbr = self._mirror_of._table().flip(1)
        return self._nbr

    @property
    def buckets(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(first tile, last tile + 1, NB, TW) per bucket of tiles of similar width."""
        if self._buckets is None:
            self._buckets = self._make_buckets()
        return self._buckets

    @property
    def real_pairs(self) -> int:
        return int((self._table() >= 0).sum())

    @property
    def padded_pairs(self) -> int:
        return sum((end - start) * self.tile * nb.shape[2] for start, end, nb, _ in self.buckets)

    def output_rows(self) -> torch.Tensor:
        """TR [T, tile] (int32): the output row of each tile row, the padding rows (the end of
        the one tile that has them) numbered on from n_out: a permutation of the T * tile
        rows, for a statement that stores the tiles' rows straight to their output rows."""
        if self._output_rows is None:
            if self._mirror_of is not None:
                self._output_rows = self._mirror_of.output_rows()
            else:
                n_out = self.inverse.shape[0]
                n_pad = self.n_tiles * self.tile - n_out
                # padding row m of its tile (m >= tile - n_pad) is output row n_out + m - (tile - n_pad)
                padding = torch.arange(n_out + n_pad - self.tile, n_out + n_pad, device=self._rows.device)
                self._output_rows = torch.where(self._rows >= 0, self._rows, padding).to(torch.int32)
        return self._output_rows

    def _make_buckets(self):
        host_counts = self._counts.tolist()
        nbr_padded = F.pad(self._table(), (0, 0, 0, 1), value=-1)  # row -1 (padding) reads no neighbour
        buckets = []
        start = 0
        for end in bucket_bounds(host_counts, self._max_buckets):
            width = max(1, host_counts[end - 1])
            # The tile's active offsets first, in offset order.
            tw = torch.argsort((~self._active[start:end]).to(torch.int8), dim=1, stable=True)[:, :width]
            nb = nbr_padded[self._rows[start:end, :, None], tw[:, None, :]].long()  # [t, tile, width]
            nb = torch.where(nb >= 0, nb, self._n_in)
            buckets.append((start, end, nb.to(torch.int32).contiguous(), tw.to(torch.int32).contiguous()))
            start = end
        return buckets

    def whole(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every tile in one launch: NB [T, tile, J] and TW [T, J], each tile's active offsets
        first (then offsets no row of it reads, NB = n_in, the zero row), and TL [T], each
        tile's active offsets: `insum(..., lengths={"j[t]": TL})` stops each tile's loop there.
        J: the offsets that have any pair, when the map's per-offset counts are on the host
        (a bound on every tile's count; no sync), else the widest tile's (one host sync)."""
        if self._whole is None:
            if self._mirror_of is not None:
                NB, TW, TL = self._mirror_of.whole()
                self._whole = NB, (self._active.shape[1] - 1) - TW, TL
            else:
                width = self._width if self._width is not None else max(1, int(self._counts[-1]))
                self._whole = _pack_tiles(self._nbr, self._n_in, self._rows, self._active, self._counts, width)
        return self._whole


def _pack_tiles(nbr: torch.Tensor, n_in: int, rows: torch.Tensor, active: torch.Tensor, counts: torch.Tensor,
                width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(NB, TW, TL) of `TiledMap.whole`: TW[t] the offsets of tile t, its active ones first
    (a stable sort of the inactive flags), cut to `width`; NB[t, m, j] = nbr[rows[t, m],
    TW[t, j]], n_in where absent or rows[t, m] = -1; TL = counts. On the kernel path one
    launch writes all three."""
    if not _use_kernels(nbr.device):
        tw = torch.argsort((~active).to(torch.int8), dim=1, stable=True)[:, :width].to(torch.int32)
        nbr_zero_row = F.pad(torch.where(nbr >= 0, nbr, n_in), (0, 0, 0, 1), value=n_in)  # row -1: padding
        return nbr_zero_row[rows[:, :, None], tw[:, None, :]].to(torch.int32), tw, counts.to(torch.int32)
    n_tiles, tile = rows.shape
    volume = nbr.shape[1]
    NB = torch.empty((n_tiles, tile, width), dtype=torch.int32, device=nbr.device)
    TW = torch.empty((n_tiles, width), dtype=torch.int32, device=nbr.device)
    TL = torch.empty(n_tiles, dtype=torch.int32, device=nbr.device)
    _launch(_pack_kernel(), (n_tiles,), nbr, rows, active.view(torch.int8), NB, TW, TL, n_in, tile, width, volume,
            nbr.stride(0), nbr.stride(1), rows.stride(0), active.stride(0), BLOCK_M=next_power_of_2(tile),
            BLOCK_J=next_power_of_2(width), BLOCK_W=next_power_of_2(volume))
    return NB, TW, TL


@functools.cache
def _pack_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def insum_kernel_map_pack_tiles(
        # pointers
        nbr_ptr, rows_ptr, active_ptr, nb_ptr, tw_ptr, tl_ptr,
        # sizes
        n_in, tile, width, volume,
        # strides
        stride_nv, stride_nw, stride_rt, stride_at,
        # meta-parameters
        BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        offs_j = tl.arange(0, BLOCK_J)  # [BLOCK_J]
        offs_w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
        mask_m = offs_m < tile
        mask_j = offs_j < width
        mask_w = offs_w < volume
        # TW: the active offsets in order, then the others in order (place of offset w: dest[w])
        active = tl.load(active_ptr + pid_t * stride_at + offs_w, mask=mask_w, other=0).to(tl.int32)  # [BLOCK_W]
        idle = mask_w.to(tl.int32) - active  # [BLOCK_W]
        count = tl.sum(active, axis=0)
        dest = tl.where(active > 0, tl.cumsum(active, axis=0), count + tl.cumsum(idle, axis=0)) - 1  # [BLOCK_W]
        placed = (dest[None, :] == offs_j[:, None]) & mask_w[None, :]  # [BLOCK_J, BLOCK_W]
        tw = tl.sum(tl.where(placed, offs_w[None, :], 0), axis=1)  # [BLOCK_J]
        tl.store(tw_ptr + pid_t.to(tl.int64) * width + offs_j, tw, mask=mask_j)
        tl.store(tl_ptr + pid_t, count)
        rows = tl.load(rows_ptr + pid_t * stride_rt + offs_m, mask=mask_m, other=-1).to(tl.int64)  # [BLOCK_M]
        real = (rows[:, None] >= 0) & mask_j[None, :]  # [BLOCK_M, BLOCK_J]
        nbr_ptrs = nbr_ptr + rows[:, None] * stride_nv + tw[None, :] * stride_nw
        v = tl.load(nbr_ptrs, mask=real, other=-1)  # [BLOCK_M, BLOCK_J]
        nb_ptrs = nb_ptr + (pid_t.to(tl.int64) * tile + offs_m)[:, None] * width + offs_j[None, :]
        tl.store(nb_ptrs, tl.where(v >= 0, v, n_in).to(tl.int32), mask=mask_m[:, None] & mask_j[None, :])

    return insum_kernel_map_pack_tiles


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
    """nbr[v, w]: the input row read by output row v at offset w (-1: absent).

    offset_pairs: the real pairs per offset, on the host (read back with the build's range
    check; None: counted when asked). symmetric: the output sites are the input sites, in
    order, and the taps are symmetric (submanifold, odd kernel): the transpose is the map
    with its offsets mirrored."""

    nbr: torch.Tensor
    n_in: int
    out_coords: torch.Tensor
    kernel_size: int
    offset_pairs: list[int] | None = None
    symmetric: bool = False
    _packed: dict = field(default_factory=dict, repr=False)
    # Tilings by tile size, apart from `_packed` so that a mirrored transpose can read them
    # without holding this map (no reference cycle through `_packed["transpose"]`).
    _tilings: dict = field(default_factory=dict, repr=False)
    _mirror_tilings: dict | None = field(default=None, repr=False)
    # Each output row's neighbour bitmask (tile_map's sort key), when the lookup kernel made it.
    _row_mask: torch.Tensor | None = field(default=None, repr=False)
    # The pairs per offset and block of rows (`pair_groups`' counts), when the lookup kernel made them.
    _block_pairs: torch.Tensor | None = field(default=None, repr=False)

    @property
    def n_out(self) -> int:
        return self.nbr.shape[0]

    @property
    def volume(self) -> int:
        return self.nbr.shape[1]

    @property
    def pairs(self) -> int:
        """Real (input, output, offset) triples: the work of the convolution."""
        return self.cached("pairs", lambda: sum(self._offset_pairs()))

    def _offset_pairs(self) -> list[int]:
        if self.offset_pairs is None:
            self.offset_pairs = (self.nbr >= 0).sum(0).tolist()
        return self.offset_pairs

    def prepare(self, tile: int = 128, training: bool = True, mask_dtype: torch.dtype | None = None) -> KernelMap:
        """Build the packings a forward (either form) and, with `training`, a backward pass
        read, so that a function compiled with `torch.compile(fullgraph=True)` only looks
        them up. mask_dtype: also the masked packings (`absent="mask"`) for that dtype."""
        for km in (self, self.transpose()) if training else (self,):
            tiled = km.tiles(tile)
            tiled.buckets, tiled.whole(), tiled.output_rows()  # (the buckets are made on first read)
        self.pairs, self.pair_groups(tile)
        if training:
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
        if tile not in self._tilings:
            if self._mirror_tilings is not None:  # the forward map's tiles, offsets mirrored
                if tile not in self._mirror_tilings:  # (self: a _MirroredTranspose; its source, the forward map)
                    self._mirror_tilings[tile] = tile_map(self._source, self.n_out, tile, width=self._tile_width())
                self._tilings[tile] = self._mirror_tilings[tile].mirrored()
            else:
                self._tilings[tile] = tile_map(self.nbr, self.n_in, tile, mask=self._row_mask, width=self._tile_width())
        return self._tilings[tile]

    def _tile_width(self) -> int | None:
        """The offsets that have any pair (`TiledMap.whole`'s J), when their counts are on the host."""
        return None if self.offset_pairs is None else max(1, sum(c > 0 for c in self.offset_pairs))

    def pair_groups(self, group: int | None = None) -> PairGroups:
        return self.cached(("pairs", group), lambda: pair_groups(self.nbr, self.n_in, group, self._offset_pairs(),
                                                                 self._block_pairs))

    def tiles_whole(self, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every tile in one launch (`TiledMap.whole`): NB [T, tile, J], TW [T, J], TL [T]."""
        return self.tiles(tile).whole()

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


class _MirroredTranspose(KernelMap):
    """The transpose of a symmetric map: the forward map's table with its offsets mirrored.
    Constructed from the forward table (`nbr` below is its setter), flipped (a copy of the
    table) on first read: the tiled backward reuses the forward tiles and never reads it."""

    @property
    def nbr(self) -> torch.Tensor:
        if self._flipped is None:
            self._flipped = self._source.flip(1)
        return self._flipped

    @nbr.setter
    def nbr(self, source: torch.Tensor) -> None:
        self._source, self._flipped = source, None

    @property
    def n_out(self) -> int:
        return self._source.shape[0]

    @property
    def volume(self) -> int:
        return self._source.shape[1]


def _transpose(km: KernelMap) -> KernelMap:
    if km.symmetric:
        # nbr[v, w] = i: site i = site v + t_w, so v = site i + t_(mirror w) = nbr[i, mirror w].
        offset_pairs = None if km.offset_pairs is None else km.offset_pairs[::-1]
        return _MirroredTranspose(km.nbr, km.n_out, km.out_coords, km.kernel_size, offset_pairs, symmetric=True,
                                  _mirror_tilings=km._tilings)
    out, w = (km.nbr >= 0).nonzero(as_tuple=True)
    nbr_t = torch.full((km.n_in, km.volume), -1, dtype=km.nbr.dtype, device=km.nbr.device)
    nbr_t[km.nbr[out, w].long(), w] = out.to(km.nbr.dtype)
    if int((nbr_t >= 0).sum()) != out.numel():  # (`nonzero` above synced already)
        # Repeated sites: several outputs read one input at one offset, which a table of one
        # output per (input, offset) cannot hold; the gradient would lose all but one.
        raise InsumError(
            "the transpose of this kernel map (a convolution's input gradient) needs every input site read by at "
            "most one output per offset, and the sites repeat (coords or out_coords list a site twice); pass "
            "unique sites (torch.unique(coords, dim=0))"
        )
    return KernelMap(nbr_t, km.n_out, km.out_coords.new_empty(0, 4), km.kernel_size)


def _lookup(in_keys: torch.Tensor, order: torch.Tensor, out: torch.Tensor, mode: str, kernel_size: int,
            stride: int, dilation: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nbr [M, k**3] (int32) and the pairs per offset [k**3] by torch ops: every (output,
    offset) query key at once, one `searchsorted` into the sorted input keys."""
    query, valid = _query_keys(out, mode, kernel_size, stride, dilation)
    if in_keys.shape[0] == 0:
        nbr = torch.full(query.shape, -1, dtype=torch.int32, device=query.device)
        return nbr, nbr.new_zeros(query.shape[1], dtype=torch.int64)
    pos = torch.searchsorted(in_keys, query, out_int32=True).clamp_max_(in_keys.shape[0] - 1)
    hit = in_keys[pos] == query
    if valid is not None:
        hit &= valid
    return torch.where(hit, order.to(torch.int32)[pos], -1), hit.sum(0)


def _use_kernels(device: torch.device) -> bool:
    """Whether the build runs its Triton kernels (`_hash_kernels`: the lookup in two launches,
    no sort and no [M, k**3] int64 temporaries; the tiles' activity, placing and packing
    kernels; the pair groups' count and scatter kernels) rather than the torch ops that do
    the same: on CUDA, unless INSUM_MAP_KERNELS=0. Tests switch them on in the Triton
    interpreter."""
    return device.type == "cuda" and flag("INSUM_MAP_KERNELS", default=True)


def _launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """One Triton launch (benchmarks/map_overhead.py counts them here)."""
    kernel[grid](*args, **kwargs)


def _hashing() -> bool:
    """Whether the kernel path looks neighbours up in a hash table (`_lookup_hashed`) rather
    than in the sorted keys (`_lookup_fused`): unless INSUM_MAP_HASH=0 (kept to time both)."""
    return flag("INSUM_MAP_HASH", default=True)


_EMPTY = -1  # a free slot of the hash table: every entry (fingerprint and row) is below 2**31
_INT64_MAX = (1 << 63) - 1
_MAX_HASHED = 1 << 29  # input sites the hash table takes (its slots: 2**31 at most, int32 masks)


def _pair_block_rows(volume: int) -> int:
    """Output rows per block of the pair groups' counts ([volume, blocks]: the pairs of each
    offset in each block of rows). The probe kernel adds its sites' pairs to them (a block is
    a whole number of its programs), and `pair_groups` ranks each block's pairs after them."""
    return max(1, 2048 // next_power_of_2(volume))


def _row_bits(n_in: int) -> int:
    """Bits of the row in a hash table entry ((fingerprint << row_bits) | row, below 2**31;
    the fingerprint takes the other 31 - row_bits, at least 2 below `_MAX_HASHED`)."""
    return max(1, (n_in - 1).bit_length())


def _slot_bits(n_in: int) -> int:
    """log2 of the hash table's slots: 8 to 16 a key (`_lookup_hashed` says why), at most
    2**30 slots (4 GB) unless 2 a key need more, and at least 16."""
    sparse = (8 * n_in - 1).bit_length()
    return max(4, min(sparse, max(30, (2 * n_in - 1).bit_length())))


@functools.cache
def _stats_template(volume: int, device: torch.device) -> torch.Tensor:
    """The starting value of `_lookup_hashed`'s result buffer: for the input sites (least
    axis value, greatest axis value negated, the batch index's least room, -1 where a site
    repeats: four least values), for the output sites the first three, then room for the
    pairs per offset. Cloned per build (one copy; a tensor built from a list is an upload, a
    sync)."""
    far = [_INT64_MAX, _INT64_MAX, _INT64_MAX]
    return torch.tensor(far + [0] + far + [0] * volume, dtype=torch.int64, device=device)


def _lookup_hashed(coords: torch.Tensor, out: torch.Tensor, mode: str, kernel_size: int, stride: int,
                   dilation: int, check_out: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The map by a hash table on the device, in two launches and no sort: every input key
    is inserted once (open addressing, linear probing), then each (output, offset) query
    probes it. Every mode. Returns nbr [M, k**3] (int32), each row's neighbour bitmask
    (`tile_map`'s sort key), an int64 [6 + k**3]: the range check's values (`_stats_template`;
    of the output sites only when `check_out`) and the pairs per offset, for the build's one read back, and
    the pairs per offset and block of rows (`_pair_block_rows`), which `pair_groups` reads.
    Every atomic operation is relaxed: each orders nothing but its own word (Triton's
    default, acq_rel, fences memory around every compare-and-swap of the insert loop). The
    range check's values are each program's, reduced after (`torch.amin`): three atomics on
    one address from every program took half the insert kernel's time (H200, 1.2M sites:
    76 against 159 us, session7/call3).

    Keys are those of `_keys`. Two sites that differ only in z's low bit hash to one pair of
    adjacent slots, so the 3 z taps of an (x, y) tap read 2 places rather than 3. Simulated
    on the 1.2M-voxel room scene (table at 2**22 slots, load 0.28): 1.33 probes per found
    key, 1.66 per absent one; 7.3 probe rounds per block of 64 sites (the block's longest;
    4 slots per group: 13.6 rounds, one: 7.6), 5.9 per block of 16. A block's lanes loop
    until its longest probe ends, so the blocks are small: 8 sites in the probe kernel, one
    warp a program, 128 keys in the insert kernel (4.4 compare-and-swaps issued per key,
    1.33 needed; 6.6 in blocks of 1024). The probe is bound by integer instructions (ncu,
    1.45M sites on an H200: the ALU pipe 82% busy, DRAM 4%, L2 hits 90%), and with one warp
    a program each round's exit test is a warp's shuffles rather than a block reduction
    through shared memory and a barrier: 445M instructions instead of 651M, the build
    0.92 ms instead of 1.22 (16 sites and 4 warps a program; benchmarks/results/h200/
    session5/kmap_variants*). For the same reason the table is sparse, 8 to 16 slots a key
    (`_slot_bits`): a warp's 256 probes run as many rounds as the longest of them, and a
    sparser table shortens the longest more than it costs in L2 hits. Measured at 1.45M
    sites (A/B in one call, each build with spconv-triton's beside it): the build 0.96 ms
    at 2 to 4 slots a key (2**22 slots), 0.78 at 4 to 8, 0.70 at 8 to 16 (67 MB, transient);
    map + tiles 1.35 / 1.20 / 1.11 ms, with the training packings 1.64 / 1.48 / 1.41 ms,
    against spconv-triton's 1.53-1.55 and 1.57-1.59 ms.

    The table is one int32 per slot: the input row under a fingerprint (`_row_bits`: the
    hash's bits below the slot's), and the keys sit in input order (`row_keys`, written by
    the insert kernel): a probe reads a key only at an entry with its fingerprint (its hit,
    or 1 in 2**(31 - row_bits) of the other keys' entries, 1 in 1024 at 1.2M sites): a slot
    of 4 bytes where an int64 key and an int32 row took 12. Counted on the 1.17M-voxel room scene (benchmarks'
    `room_scene(1_000_000)`), the distinct 32-byte sectors each block of 16 sites reads: 140
    (of the table and the hits' keys), against 182 (of the int64 keys and the hits' rows);
    144 against 188 at 142k sites. The chain of dependent reads is as long: the probe
    rounds, then one key (where it was one row).
    Duplicate sites: every copy maps to the first copy's row, as the lower bound in the
    stably sorted keys does (a copy keeps the least entry by an atomic min: the fingerprints
    are equal)."""
    volume = kernel_size**3
    n_out, n_in = out.shape[0], coords.shape[0]
    device = out.device
    slot_bits = _slot_bits(n_in)
    row_bits = _row_bits(n_in)
    table = torch.full((1 << slot_bits,), _EMPTY, dtype=torch.int32, device=device)
    row_keys = torch.empty(n_in, dtype=torch.int64, device=device)
    stats = _stats_template(volume, device).clone()
    pair_rows = _pair_block_rows(volume)
    block_pairs = torch.zeros((volume, cdiv(n_out, pair_rows)), dtype=torch.int32, device=device)
    nbr = torch.empty((n_out, volume), dtype=torch.int32, device=device)
    bits = min(volume, _MASK_BITS)
    mask = torch.empty(n_out, dtype=_mask_dtype(bits), device=device)
    insert, probe = _hash_kernels()
    if n_in:
        block = 128
        grid = cdiv(n_in, block)
        ranges = torch.empty((grid, 4), dtype=torch.int64, device=device)
        _launch(insert, (grid,), coords, table, row_keys, ranges, n_in, slot_bits, row_bits,
                coords.stride(0), coords.stride(1), BLOCK=block)
        torch.amin(ranges, 0, out=stats[0:4])
    if n_out:
        block_w = next_power_of_2(volume)
        block_m = max(1, 256 // block_w)
        grid = cdiv(n_out, block_m)
        ranges = torch.empty((grid if check_out else 0, 3), dtype=torch.int64, device=device)
        _launch(probe, (grid,), out, table, row_keys, nbr, mask, ranges, block_pairs, n_out,
                block_pairs.shape[1], slot_bits, row_bits, out.stride(0), out.stride(1), STRIDE=stride,
                DILATION=dilation, K=kernel_size, TRANSPOSED=mode == "transposed", OUT_STATS=check_out, BITS=bits,
                PAIR_ROWS=pair_rows, BLOCK_M=block_m, BLOCK_W=block_w, num_warps=1)
        if check_out:
            torch.amin(ranges, 0, out=stats[4:7])
    torch.sum(block_pairs, 1, out=stats[7:])
    return nbr, mask, stats, block_pairs


@functools.cache
def _hash_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def insum_kernel_map_hash_insert(
        # pointers
        coords_ptr, table_ptr, row_keys_ptr, ranges_ptr,
        # sizes
        n_in, slot_bits, row_bits,
        # strides
        stride_cm, stride_cc,
        # meta-parameters
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        mask = offs < n_in
        site_ptrs = coords_ptr + offs.to(tl.int64) * stride_cm
        batch = tl.load(site_ptrs, mask=mask, other=0)  # [BLOCK]
        x = tl.load(site_ptrs + stride_cc, mask=mask, other=0)  # [BLOCK]
        y = tl.load(site_ptrs + 2 * stride_cc, mask=mask, other=0)  # [BLOCK]
        z = tl.load(site_ptrs + 3 * stride_cc, mask=mask, other=0)  # [BLOCK]
        key = (batch << 48) | ((x + 32768) << 32) | ((y + 32768) << 16) | (z + 32768)  # [BLOCK] as `_keys`
        tl.store(row_keys_ptr + offs, key, mask=mask)  # the probe kernel compares its queries with these
        # The first slot: a multiplicative hash (Fibonacci's constant as a signed int64, the
        # wrapping product's top bits) of the key without z's low bit, which then picks the
        # place in a pair of slots (the probe kernel does the same).
        mixed = (key >> 1) * -7046029254386353131  # [BLOCK]
        slot = (((mixed >> (65 - slot_bits)) & ((1 << (slot_bits - 1)) - 1)) << 1) | (key & 1)  # [BLOCK]
        slot_mask = (1 << slot_bits) - 1
        # the entry: the row under the next bits of the hash (the probe kernel does the same)
        print_bits = 31 - row_bits
        finger = ((mixed >> (65 - slot_bits - print_bits)) & ((1 << print_bits) - 1)).to(tl.int32)  # [BLOCK]
        entry = (finger << row_bits) | offs  # [BLOCK]
        # Each pending row tries to claim its slot. A slot held by another fingerprint sends
        # the row on; by the same one, the held row's key is read from the coordinates (never
        # written: no ordering needed with the store above): a copy of the key keeps the
        # least row of its copies, another key sends the row on. A settled row compares with
        # -2 (no entry): its try writes nothing.
        pending = mask  # [BLOCK]
        repeated = offs < 0  # [BLOCK] a site whose key an earlier row holds
        while tl.max(pending.to(tl.int32), axis=0) > 0:
            held = tl.atomic_cas(table_ptr + slot, tl.where(pending, -1, -2), tl.where(pending, entry, -2),
                                 sem="relaxed")  # [BLOCK]
            taken = pending & (held >= 0)  # [BLOCK]
            alike = taken & ((held >> row_bits) == finger)  # [BLOCK]
            held_ptrs = coords_ptr + (held & ((1 << row_bits) - 1)).to(tl.int64) * stride_cm
            held_key = ((tl.load(held_ptrs, mask=alike, other=0) << 48)
                        | ((tl.load(held_ptrs + stride_cc, mask=alike, other=0) + 32768) << 32)
                        | ((tl.load(held_ptrs + 2 * stride_cc, mask=alike, other=0) + 32768) << 16)
                        | (tl.load(held_ptrs + 3 * stride_cc, mask=alike, other=0) + 32768))  # [BLOCK]
            copy = alike & (held_key == key)  # [BLOCK]
            tl.atomic_min(table_ptr + slot, entry, mask=copy, sem="relaxed")  # (a copy's entry: the same fingerprint)
            repeated = repeated | copy
            pending = taken & ~copy
            slot = tl.where(pending, (slot + 1) & slot_mask, slot)
        # the range check's values of this program's sites: least axis value, greatest negated,
        # the batch index's least room, -1 where a site repeats (a row of `ranges`, whose
        # least values the build reads)
        lo = tl.minimum(tl.minimum(x, y), z)
        hi = tl.maximum(tl.maximum(x, y), z)
        tl.store(ranges_ptr + pid * 4, tl.min(tl.where(mask, lo, 1 << 62), axis=0))
        tl.store(ranges_ptr + pid * 4 + 1, tl.min(tl.where(mask, -hi, 1 << 62), axis=0))
        # (32767: MAX_BATCH)
        tl.store(ranges_ptr + pid * 4 + 2, tl.min(tl.where(mask, tl.minimum(batch, 32767 - batch), 1 << 62), axis=0))
        tl.store(ranges_ptr + pid * 4 + 3, tl.min(tl.where(repeated, -1, 0).to(tl.int64), axis=0))

    @triton.jit
    def insum_kernel_map_hash_probe(
        # pointers
        out_ptr, table_ptr, row_keys_ptr, nbr_ptr, mask_ptr, ranges_ptr, block_pairs_ptr,
        # sizes
        n_out, n_pair_blocks, slot_bits, row_bits,
        # strides
        stride_om, stride_oc,
        # meta-parameters
        STRIDE: tl.constexpr, DILATION: tl.constexpr, K: tl.constexpr, TRANSPOSED: tl.constexpr,
        OUT_STATS: tl.constexpr, BITS: tl.constexpr, PAIR_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        VOLUME: tl.constexpr = K * K * K
        R: tl.constexpr = (K - 1) // 2
        pid_m = tl.program_id(0)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        offs_w = tl.arange(0, BLOCK_W)  # [BLOCK_W] the offsets, z tap fastest
        mask_m = offs_m < n_out
        mask_w = offs_w < VOLUME
        site_ptrs = out_ptr + offs_m.to(tl.int64) * stride_om
        batch = tl.load(site_ptrs, mask=mask_m, other=0)  # [BLOCK_M]
        x = tl.load(site_ptrs + stride_oc, mask=mask_m, other=0)  # [BLOCK_M]
        y = tl.load(site_ptrs + 2 * stride_oc, mask=mask_m, other=0)  # [BLOCK_M]
        z = tl.load(site_ptrs + 3 * stride_oc, mask=mask_m, other=0)  # [BLOCK_M]
        tap_x = DILATION * (offs_w // (K * K) - R)  # [BLOCK_W]
        tap_y = DILATION * (offs_w // K % K - R)  # [BLOCK_W]
        tap_z = DILATION * (offs_w % K - R)  # [BLOCK_W]
        live = mask_m[:, None] & mask_w[None, :]  # [BLOCK_M, BLOCK_W]
        if TRANSPOSED:  # input (x - t) / s where that is an integer (exact division: C's truncation is fine)
            qx = x[:, None] - tap_x[None, :]  # [BLOCK_M, BLOCK_W]
            qy = y[:, None] - tap_y[None, :]  # [BLOCK_M, BLOCK_W]
            qz = z[:, None] - tap_z[None, :]  # [BLOCK_M, BLOCK_W]
            live = live & (qx % STRIDE == 0) & (qy % STRIDE == 0) & (qz % STRIDE == 0)
            qx = qx // STRIDE
            qy = qy // STRIDE
            qz = qz // STRIDE
        else:  # input o * s + t
            qx = x[:, None] * STRIDE + tap_x[None, :]  # [BLOCK_M, BLOCK_W]
            qy = y[:, None] * STRIDE + tap_y[None, :]  # [BLOCK_M, BLOCK_W]
            qz = z[:, None] * STRIDE + tap_z[None, :]  # [BLOCK_M, BLOCK_W]
        query = (batch[:, None] << 48) | ((qx + 32768) << 32) | ((qy + 32768) << 16) | (qz + 32768)  # [BLOCK_M, BLOCK_W]
        mixed = (query >> 1) * -7046029254386353131  # [BLOCK_M, BLOCK_W] the insert kernel's first slot
        slot = ((((mixed >> (65 - slot_bits)) & ((1 << (slot_bits - 1)) - 1)) << 1) | (query & 1)).to(tl.int32)  # [BLOCK_M, BLOCK_W]
        slot_mask = (1 << slot_bits) - 1
        print_bits = 31 - row_bits
        finger = ((mixed >> (65 - slot_bits - print_bits)) & ((1 << print_bits) - 1)).to(tl.int32)  # [BLOCK_M, BLOCK_W]
        held = tl.full((BLOCK_M, BLOCK_W), -1, tl.int32)  # [BLOCK_M, BLOCK_W] the entry the probe stopped at
        # Probe until the key or a free slot: every inserted key lies before the first free slot.
        # The inner loop reads entries only, up to one with the query's fingerprint (or a free
        # slot); then that entry's key is read, once per probe but for the 1 in
        # 2**print_bits of the other keys' entries with the fingerprint, whose probe goes on.
        # The loops' exit tests reduce the sites first: a lane holds a column's sites (one warp,
        # lanes along the offsets), so that is in registers, and one warp reduction follows
        # (the offsets first: a warp reduction per site, BLOCK_M of them each probe round).
        pending = live  # [BLOCK_M, BLOCK_W]
        while tl.max(tl.max(pending.to(tl.int32), axis=0), axis=0) > 0:
            seeking = pending  # [BLOCK_M, BLOCK_W]
            while tl.max(tl.max(seeking.to(tl.int32), axis=0), axis=0) > 0:
                entry = tl.load(table_ptr + slot, mask=seeking, other=-1)  # [BLOCK_M, BLOCK_W]
                stop = seeking & ((entry < 0) | ((entry >> row_bits) == finger))  # [BLOCK_M, BLOCK_W]
                held = tl.where(stop, entry, held)
                seeking = seeking & ~stop
                slot = tl.where(seeking, (slot + 1) & slot_mask, slot)
            alike = pending & (held >= 0)  # [BLOCK_M, BLOCK_W]
            match = alike & (tl.load(row_keys_ptr + (held & ((1 << row_bits) - 1)), mask=alike, other=-1) == query)
            pending = alike & ~match  # another key with the fingerprint: on past it
            slot = tl.where(pending, (slot + 1) & slot_mask, slot)
        # Every probe ended at a free slot (held < 0) or at its key's entry.
        hit = held >= 0  # [BLOCK_M, BLOCK_W]
        row = tl.where(hit, held & ((1 << row_bits) - 1), -1)  # [BLOCK_M, BLOCK_W] the query's input row
        nbr_ptrs = nbr_ptr + offs_m.to(tl.int64)[:, None] * VOLUME + offs_w[None, :]
        tl.store(nbr_ptrs, row, mask=mask_m[:, None] & mask_w[None, :])
        # this program's pairs per offset, to its block of PAIR_ROWS rows (a multiple of BLOCK_M)
        counts_ptrs = block_pairs_ptr + offs_w.to(tl.int64) * n_pair_blocks + (pid_m * BLOCK_M) // PAIR_ROWS
        tl.atomic_add(counts_ptrs, tl.sum(hit.to(tl.int32), axis=0), mask=mask_w, sem="relaxed")
        bit = tl.where(offs_w < BITS, tl.full((BLOCK_W,), 1, tl.int64) << offs_w.to(tl.int64), 0)  # [BLOCK_W]
        tl.store(mask_ptr + offs_m, tl.sum(tl.where(hit, bit[None, :], 0), axis=1).to(mask_ptr.dtype.element_ty),
                 mask=mask_m)
        if OUT_STATS:  # the range check's values of the output sites, as the insert kernel's
            lo = tl.minimum(tl.minimum(x, y), z)
            hi = tl.maximum(tl.maximum(x, y), z)
            tl.store(ranges_ptr + pid_m * 3, tl.min(tl.where(mask_m, lo, 1 << 62), axis=0))
            tl.store(ranges_ptr + pid_m * 3 + 1, tl.min(tl.where(mask_m, -hi, 1 << 62), axis=0))
            tl.store(ranges_ptr + pid_m * 3 + 2, tl.min(tl.where(mask_m, tl.minimum(batch, 32767 - batch), 1 << 62),
                                                        axis=0))

    return insum_kernel_map_hash_insert, insum_kernel_map_hash_probe


def _lookup_fused(in_keys: torch.Tensor, order: torch.Tensor, out: torch.Tensor, kernel_size: int, stride: int,
                  dilation: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_lookup` for submanifold and strided maps as one kernel, which also writes each row's
    neighbour bitmask (`tile_map`'s sort key) and adds its hits per offset to the counts.

    The k taps along z of one (x, y) tap are keys d apart (d: the dilation), so the sorted
    input keys hold them within (k - 1) * d + 1 places of the first one's lower bound: one
    binary search per (output, x tap, y tap), then a look at that window, instead of one
    search per offset (a third of the searches for k = 3). Distinct sites only: a duplicate
    key shifts the window. Taken only with INSUM_MAP_HASH=0 (`_lookup_hashed` is the default)."""
    volume = kernel_size**3
    n_out, n_in = out.shape[0], in_keys.shape[0]
    nbr = torch.empty((n_out, volume), dtype=torch.int32, device=out.device)
    counts = torch.zeros(volume, dtype=torch.int32, device=out.device)
    bits = min(volume, _MASK_BITS)
    mask = torch.empty(n_out, dtype=_mask_dtype(bits), device=out.device)
    if n_out:
        block_xy = next_power_of_2(kernel_size**2)
        block_z = next_power_of_2((kernel_size - 1) * dilation + 1)
        block_m = max(1, 2048 // (block_xy * block_z))
        _launch(_lookup_kernel(), (cdiv(n_out, block_m),), out, in_keys, order, nbr, counts, mask, n_out, n_in,
                n_in.bit_length(), out.stride(0), out.stride(1), STRIDE=stride, DILATION=dilation, K=kernel_size,
                BITS=bits, BLOCK_M=block_m, BLOCK_XY=block_xy, BLOCK_Z=block_z)
    return nbr, counts, mask


@functools.cache
def _lookup_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def insum_kernel_map_lookup(
        # pointers
        out_ptr, keys_ptr, order_ptr, nbr_ptr, counts_ptr, mask_ptr,
        # sizes
        n_out, n_in, search_steps,
        # strides
        stride_om, stride_oc,
        # meta-parameters
        STRIDE: tl.constexpr, DILATION: tl.constexpr, K: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_XY: tl.constexpr, BLOCK_Z: tl.constexpr,
    ):
        VOLUME: tl.constexpr = K * K * K
        WINDOW: tl.constexpr = (K - 1) * DILATION + 1
        R: tl.constexpr = (K - 1) // 2
        pid_m = tl.program_id(0)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        offs_xy = tl.arange(0, BLOCK_XY)  # [BLOCK_XY] the (x, y) taps, y fastest
        offs_z = tl.arange(0, BLOCK_Z)  # [BLOCK_Z] places after the lower bound
        mask_m = offs_m < n_out
        mask_xy = offs_xy < K * K
        site_ptrs = out_ptr + offs_m.to(tl.int64) * stride_om
        batch = tl.load(site_ptrs, mask=mask_m, other=0)  # [BLOCK_M]
        x = tl.load(site_ptrs + stride_oc, mask=mask_m, other=0) * STRIDE  # [BLOCK_M]
        y = tl.load(site_ptrs + 2 * stride_oc, mask=mask_m, other=0) * STRIDE  # [BLOCK_M]
        z = tl.load(site_ptrs + 3 * stride_oc, mask=mask_m, other=0) * STRIDE  # [BLOCK_M]
        # tap t = DILATION * (i - R), biased into the key's 16 bits; the first z tap
        tap_x = DILATION * (offs_xy // K - R) + 32768  # [BLOCK_XY]
        tap_y = DILATION * (offs_xy % K - R) + 32768  # [BLOCK_XY]
        first = ((batch[:, None] << 48) | ((x[:, None] + tap_x[None, :]) << 32) | ((y[:, None] + tap_y[None, :]) << 16)
                 | (z[:, None] - DILATION * R + 32768))  # [BLOCK_M, BLOCK_XY]
        # The first sorted key >= first: lo == hi after bit_length(n_in) halvings.
        lo = tl.zeros((BLOCK_M, BLOCK_XY), dtype=tl.int32)  # [BLOCK_M, BLOCK_XY]
        hi = tl.zeros((BLOCK_M, BLOCK_XY), dtype=tl.int32) + n_in  # [BLOCK_M, BLOCK_XY]
        for _ in range(search_steps):
            open_ = lo < hi
            mid = (lo + hi) >> 1
            below = tl.load(keys_ptr + mid, mask=open_, other=0) < first  # [BLOCK_M, BLOCK_XY]
            lo = tl.where(open_ & below, mid + 1, lo)
            hi = tl.where(open_ & (below == 0), mid, hi)
        places = lo[:, :, None] + offs_z[None, None, :]  # [BLOCK_M, BLOCK_XY, BLOCK_Z]
        live = (mask_m[:, None] & mask_xy[None, :])[:, :, None] & (offs_z[None, None, :] < WINDOW) & (places < n_in)
        window = tl.load(keys_ptr + places, mask=live, other=-1)  # [BLOCK_M, BLOCK_XY, BLOCK_Z]
        row_mask = tl.zeros((BLOCK_M,), dtype=tl.int64)  # [BLOCK_M]
        for tap_z in tl.static_range(K):
            match = live & (window == (first + tap_z * DILATION)[:, :, None])  # [BLOCK_M, BLOCK_XY, BLOCK_Z]
            hit = tl.max(match.to(tl.int32), axis=2) > 0  # [BLOCK_M, BLOCK_XY]
            place = lo + tl.sum(tl.where(match, offs_z[None, None, :], 0), axis=2)  # [BLOCK_M, BLOCK_XY]
            row = tl.load(order_ptr + place, mask=hit, other=-1).to(tl.int32)  # [BLOCK_M, BLOCK_XY]
            offs_w = offs_xy * K + tap_z  # [BLOCK_XY] the offsets of this z tap
            nbr_ptrs = nbr_ptr + offs_m.to(tl.int64)[:, None] * VOLUME + offs_w[None, :]
            tl.store(nbr_ptrs, tl.where(hit, row, -1), mask=mask_m[:, None] & mask_xy[None, :])
            tl.atomic_add(counts_ptr + offs_w, tl.sum(hit.to(tl.int32), axis=0), mask=mask_xy)
            bit = tl.where(offs_w < BITS, tl.full((BLOCK_XY,), 1, tl.int64) << offs_w.to(tl.int64), 0)  # [BLOCK_XY]
            row_mask += tl.sum(tl.where(hit, bit[None, :], 0), axis=1)
        tl.store(mask_ptr + offs_m, row_mask.to(mask_ptr.dtype.element_ty), mask=mask_m)

    return insum_kernel_map_lookup


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
    for name, value in (("kernel_size", kernel_size), ("stride", stride), ("dilation", dilation)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise InsumError(f"build_kernel_map: {name} must be a positive integer, got {value!r}")
    if mode == "subm" and (stride != 1 or out_coords is not None):
        # (both were ignored: a submanifold map's outputs are its inputs, read at stride 1)
        raise InsumError("build_kernel_map: mode 'subm' has stride 1 and its outputs at the input sites; "
                         "pass mode='strided' for other stride or out_coords")
    coords = _as_batched(coords, "coords")
    reach = dilation * kernel_size
    if mode == "subm":
        out = coords
    elif out_coords is None:
        if mode == "transposed":
            raise InsumError("a transposed convolution needs out_coords (the sites to upsample onto)")
        out = output_coords(coords, kernel_size, stride, dilation)
    else:
        out = _as_batched(out_coords, "out_coords")
    # One sync: the coordinates' ranges (checked now: keys out of range would alias) and the
    # pairs per offset (sizing the pair groups, the form choice).
    checks = [(coords, 1, "coords")] if coords.shape[0] else []
    if mode != "subm" and out_coords is not None and out.shape[0]:
        checks.append((out, stride if mode == "strided" else 1, "out_coords"))
    row_mask = block_pairs = None
    if _use_kernels(coords.device) and _hashing() and coords.shape[0] < _MAX_HASHED:
        nbr, row_mask, stats, block_pairs = _lookup_hashed(coords, out, mode, kernel_size, stride, dilation,
                                                           len(checks) == 2)
        host = stats.tolist()
        ranges = [[lo, -negated_hi, batch] for lo, negated_hi, batch in (host[0:3], host[4:7])][: len(checks)]
        repeated = host[3] < 0
        offset_pairs = host[7:]
    else:
        in_keys, order = torch.sort(_keys(coords), stable=True)  # stable: duplicates map to their first row
        repeats = (in_keys[1:] == in_keys[:-1]).any().view(1)
        # The fused kernel's window of places holds distinct keys only: repeated sites take the
        # torch lookup (a second sync, on this path alone: INSUM_MAP_HASH=0 or 2**29 sites).
        if mode != "transposed" and _use_kernels(coords.device) and not bool(repeats):
            nbr, counts, row_mask = _lookup_fused(in_keys, order, out, kernel_size, stride, dilation)
        else:
            nbr, counts = _lookup(in_keys, order, out, mode, kernel_size, stride, dilation)
        host = torch.cat([t for c, _, _ in checks for t in _range_stats(c)] + [repeats, counts]).tolist()
        ranges = [_batch_room(host[4 * i: 4 * i + 4]) for i in range(len(checks))]
        repeated = host[4 * len(checks)] > 0
        offset_pairs = host[4 * len(checks) + 1:]
    for (_, scale, name), values in zip(checks, ranges):
        _check_stats(values, scale, reach, name)
    # (repeated sites all read the first copy's row, which no copy's row reads back: not symmetric)
    symmetric = mode == "subm" and kernel_size % 2 == 1 and not repeated
    return KernelMap(nbr, coords.shape[0], out, kernel_size, offset_pairs=offset_pairs, symmetric=symmetric,
                     _row_mask=row_mask, _block_pairs=block_pairs)


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


_MASK_BITS = 62  # offsets in a row's neighbour bitmask (the sort key of the tiles)


def _mask_dtype(bits: int) -> torch.dtype:
    return torch.int32 if bits <= 31 else torch.int64


def _count_dtype(volume: int) -> torch.dtype:
    """The tiles' offset counts (0 to volume): the narrowest type, since the radix sort of the
    tiles by count runs one pass per byte of its key (int64: 8 passes of ~6 us at 11k tiles)."""
    return torch.uint8 if volume <= 255 else torch.int16 if volume <= 32767 else torch.int32


@functools.cache
def _bit_weights(bits: int, device: torch.device) -> torch.Tensor:
    """2**w for the first `bits` offsets, in the narrowest integer type that holds them."""
    dtype = _mask_dtype(bits)
    return torch.ones((), dtype=dtype, device=device) << torch.arange(bits, dtype=dtype, device=device)


def tile_map(nbr: torch.Tensor, n_in: int, tile: int = 128, max_buckets: int = 6,
             mask: torch.Tensor | None = None, width: int | None = None) -> TiledMap:
    """Pack a kernel map into the output-stationary tiled form (see `TiledMap`). No host
    sync: the buckets and the one-launch tensors are made when first read. mask: each row's
    neighbour bitmask (offsets below 62), when the lookup kernel already made it. width: a
    bound on every tile's active offsets (`TiledMap.whole`), when the host knows one."""
    n_out, volume = nbr.shape
    device = nbr.device
    if mask is None:
        weights = _bit_weights(min(volume, _MASK_BITS), device)
        mask = torch.where(nbr[:, : weights.shape[0]] >= 0, weights, 0).sum(1, dtype=weights.dtype)
    order = torch.argsort(mask, stable=True)
    n_tiles = max(1, cdiv(n_out, tile))
    if _use_kernels(device):
        return _tile_map_kernels(nbr, n_in, tile, max_buckets, mask, order, n_tiles, width)
    rows = F.pad(order, (0, n_tiles * tile - n_out), value=-1).view(n_tiles, tile)
    found = F.pad(nbr >= 0, (0, 0, 0, 1))  # row -1 (padding) reads no neighbour
    active = found[rows].any(1)
    counts, tile_order = torch.sort(active.sum(1).to(_count_dtype(volume)), stable=True)
    rows, active = rows[tile_order], active[tile_order]
    # Padding rows (-1) all land in one spare slot past the end.
    flat = rows.flatten()
    inverse = torch.empty(n_out + 1, dtype=torch.long, device=device)
    inverse.scatter_(0, torch.where(flat >= 0, flat, n_out), torch.arange(flat.numel(), device=device))
    return TiledMap(tile, nbr, n_in, rows, active, counts, inverse[:n_out], max_buckets, width=width)


def _tile_map_kernels(nbr: torch.Tensor, n_in: int, tile: int, max_buckets: int, mask: torch.Tensor,
                      order: torch.Tensor, n_tiles: int, width: int | None) -> TiledMap:
    """`tile_map`'s torch ops after the row sort as two launches and one small sort: the
    activity kernel (each tile's offsets, from its rows' bitmasks where they hold every
    offset), the sort of the tiles by their offset counts, the placing kernel (rows, inverse,
    output rows and activity in the sorted tile order)."""
    n_out, volume = nbr.shape
    device = nbr.device
    active = torch.empty((n_tiles, volume), dtype=torch.int8, device=device)
    counts = torch.empty(n_tiles, dtype=_count_dtype(volume), device=device)
    block_m, block_w = next_power_of_2(tile), next_power_of_2(volume)
    _launch(_activity_kernel(), (n_tiles,), nbr, order, mask, active, counts, n_out, tile, volume, nbr.stride(0),
            nbr.stride(1), FROM_MASK=volume <= _MASK_BITS, BLOCK_M=block_m, BLOCK_W=block_w)
    counts, tile_order = torch.sort(counts, stable=True)
    rows = torch.empty((n_tiles, tile), dtype=torch.int64, device=device)
    output_rows = torch.empty((n_tiles, tile), dtype=torch.int32, device=device)
    inverse = torch.empty(n_out, dtype=torch.int64, device=device)
    placed_active = torch.empty((n_tiles, volume), dtype=torch.int8, device=device)
    _launch(_place_kernel(), (n_tiles,), order, tile_order, active, rows, output_rows, inverse, placed_active, n_out,
            tile, volume, BLOCK_M=block_m, BLOCK_W=block_w)
    return TiledMap(tile, nbr, n_in, rows, placed_active.view(torch.bool), counts, inverse, max_buckets,
                    output_rows=output_rows, width=width)


@functools.cache
def _activity_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def insum_kernel_map_tile_activity(
        # pointers
        nbr_ptr, order_ptr, mask_ptr, active_ptr, counts_ptr,
        # sizes
        n_out, tile, volume,
        # strides
        stride_nv, stride_nw,
        # meta-parameters
        FROM_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        offs_w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
        mask_w = offs_w < volume
        places = pid_t.to(tl.int64) * tile + offs_m  # [BLOCK_M] tile t holds rows order[t * tile: (t + 1) * tile]
        real = (offs_m < tile) & (places < n_out)
        rows = tl.load(order_ptr + places, mask=real, other=0)  # [BLOCK_M]
        if FROM_MASK:  # the bitmask holds every offset
            bits = tl.load(mask_ptr + rows, mask=real, other=0).to(tl.int64)  # [BLOCK_M]
            found = ((bits[:, None] >> offs_w.to(tl.int64)[None, :]) & 1) > 0  # [BLOCK_M, BLOCK_W]
        else:
            v = tl.load(nbr_ptr + rows[:, None] * stride_nv + offs_w[None, :] * stride_nw,
                        mask=real[:, None] & mask_w[None, :], other=-1)  # [BLOCK_M, BLOCK_W]
            found = v >= 0
        active = tl.max((found & real[:, None] & mask_w[None, :]).to(tl.int8), axis=0)  # [BLOCK_W]
        tl.store(active_ptr + pid_t.to(tl.int64) * volume + offs_w, active, mask=mask_w)
        tl.store(counts_ptr + pid_t, tl.sum(active.to(tl.int32), axis=0).to(counts_ptr.dtype.element_ty))

    return insum_kernel_map_tile_activity


@functools.cache
def _place_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def insum_kernel_map_place_tiles(
        # pointers
        order_ptr, tile_order_ptr, active_ptr, rows_ptr, output_rows_ptr, inverse_ptr, placed_active_ptr,
        # sizes
        n_out, tile, volume,
        # meta-parameters
        BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        pid_t = tl.program_id(0)  # the tile's place in count order
        offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        offs_w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
        mask_m = offs_m < tile
        mask_w = offs_w < volume
        source = tl.load(tile_order_ptr + pid_t)  # the tile's index before the sort
        places = source * tile + offs_m  # [BLOCK_M]
        real = mask_m & (places < n_out)
        rows = tl.load(order_ptr + places, mask=real, other=-1)  # [BLOCK_M]
        slots = pid_t.to(tl.int64) * tile + offs_m  # [BLOCK_M]
        tl.store(rows_ptr + slots, rows, mask=mask_m)
        # padding rows (the end of the last tile before the sort) numbered on from n_out
        tl.store(output_rows_ptr + slots, tl.where(real, rows, places).to(tl.int32), mask=mask_m)
        tl.store(inverse_ptr + rows, slots, mask=real)
        active = tl.load(active_ptr + source * volume + offs_w, mask=mask_w, other=0)  # [BLOCK_W]
        tl.store(placed_active_ptr + pid_t.to(tl.int64) * volume + offs_w, active, mask=mask_w)

    return insum_kernel_map_place_tiles


def pair_groups(nbr: torch.Tensor, n_in: int, group: int | None = None, offset_pairs: list[int] | None = None,
                block_pairs: torch.Tensor | None = None) -> PairGroups:
    """Pack a kernel map into per-offset groups of `group` pairs (default: about 384 groups).
    offset_pairs: the real pairs per offset, when the host has them (`KernelMap.offset_pairs`);
    with them no host sync. block_pairs: the pairs per offset and block of `_pair_block_rows`
    rows, when the lookup kernel counted them (one launch less)."""
    volume = nbr.shape[1]
    device = nbr.device
    if offset_pairs is None:
        offset_pairs = (nbr >= 0).sum(0).tolist()
    n_pairs = sum(offset_pairs)
    if group is None:
        group = min(16384, max(256, next_power_of_2(cdiv(max(1, n_pairs), 384))))
    groups = [cdiv(c, group) for c in offset_pairs]
    n_groups = max(1, sum(groups))
    if sum(groups) and _use_kernels(device):
        # Pair r of offset w goes to slot first_group[w] * group + r, r counted in output order:
        # the pairs of each block of rows per offset (one launch), one scan of those counts
        # (offset-major, flat: torch scans a 1-D tensor with CUB), then each block ranks its
        # own pairs after the scanned ones and pads its offset's last group (one launch).
        PI = torch.empty((n_groups, group), dtype=torch.int32, device=device)
        PO = torch.empty((n_groups, group), dtype=torch.int32, device=device)
        n_out = nbr.shape[0]
        block_w = next_power_of_2(volume)
        block_m = _pair_block_rows(volume)
        n_blocks = cdiv(n_out, block_m)
        if block_pairs is None:
            block_pairs = torch.empty((volume, n_blocks), dtype=torch.int32, device=device)
            _launch(_block_pairs_kernel(), (n_blocks,), nbr, block_pairs, n_out, n_blocks, nbr.stride(0),
                    nbr.stride(1), VOLUME=volume, BLOCK_M=block_m, BLOCK_W=block_w)
        scanned = torch.cumsum(block_pairs.view(-1), 0, dtype=torch.int32)
        PW = torch.empty(n_groups, dtype=torch.long, device=device)
        grid = max(n_blocks, cdiv(n_groups, 1024), volume)
        _launch(_pairs_kernel(), (grid,), nbr, block_pairs, scanned, PI, PO, PW, n_in, n_out, n_blocks, n_groups,
                group, nbr.stride(0), nbr.stride(1), VOLUME=volume, BLOCK_M=block_m, BLOCK_W=block_w, BLOCK_G=1024,
                BLOCK_P=1024)
        return PairGroups(group, PI, PO, PW)
    PI = torch.full((n_groups, group), n_in, dtype=torch.int32, device=device)
    PO = torch.zeros((n_groups, group), dtype=torch.int32, device=device)
    if not sum(groups):
        return PairGroups(group, PI, PO, torch.zeros(1, dtype=torch.long, device=device))
    # Pair r of offset w (r-th in output order) goes to slot first_group[w] * group + r.
    found_t = nbr.t() >= 0
    w, out = torch.nonzero_static(found_t, size=n_pairs).unbind(1)  # by offset, then output row
    per_offset = found_t.sum(1)
    groups_dev = (per_offset + (group - 1)) // group
    shift = (torch.cumsum(groups_dev, 0) - groups_dev) * group - (torch.cumsum(per_offset, 0) - per_offset)
    slot = shift[w] + torch.arange(n_pairs, device=device)
    PI.view(-1).scatter_(0, slot, nbr[out, w].to(torch.int32))
    PO.view(-1).scatter_(0, slot, out.to(torch.int32))
    PW = torch.repeat_interleave(torch.arange(volume, device=device), groups_dev, output_size=n_groups)
    return PairGroups(group, PI, PO, PW)


@functools.cache
def _block_pairs_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def insum_kernel_map_block_pairs(
        # pointers
        nbr_ptr, block_pairs_ptr,
        # sizes
        n_out, n_blocks,
        # strides
        stride_nv, stride_nw,
        # meta-parameters
        VOLUME: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        offs_w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
        mask_w = offs_w < VOLUME
        live = (offs_m < n_out)[:, None] & mask_w[None, :]  # [BLOCK_M, BLOCK_W]
        inp = tl.load(nbr_ptr + offs_m.to(tl.int64)[:, None] * stride_nv + offs_w[None, :] * stride_nw, mask=live,
                      other=-1)  # [BLOCK_M, BLOCK_W]
        pairs = tl.sum((inp >= 0).to(tl.int32), axis=0)  # [BLOCK_W]
        tl.store(block_pairs_ptr + offs_w.to(tl.int64) * n_blocks + pid, pairs, mask=mask_w)

    return insum_kernel_map_block_pairs


@functools.cache
def _pairs_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def insum_kernel_map_pair_groups(
        # pointers
        nbr_ptr, block_pairs_ptr, scanned_ptr, pi_ptr, po_ptr, pw_ptr,
        # sizes
        n_in, n_out, n_blocks, n_groups, group,
        # strides
        stride_nv, stride_nw,
        # meta-parameters
        VOLUME: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_w = tl.arange(0, BLOCK_W)  # [BLOCK_W]
        mask_w = offs_w < VOLUME
        # scanned: the inclusive scan of the pairs per (offset, block of rows), offset-major
        row_w = offs_w.to(tl.int64) * n_blocks  # [BLOCK_W]
        before_w = (tl.load(scanned_ptr + row_w, mask=mask_w, other=0)
                    - tl.load(block_pairs_ptr + row_w, mask=mask_w, other=0))  # [BLOCK_W] pairs of the offsets before
        counts = tl.load(scanned_ptr + row_w + n_blocks - 1, mask=mask_w, other=0) - before_w  # [BLOCK_W]
        # Each offset's groups follow the previous offsets' (every program works them out).
        groups = (counts + group - 1) // group  # [BLOCK_W]
        end_group = tl.cumsum(groups, axis=0)  # [BLOCK_W]
        first_slot = (end_group - groups) * group - 1  # [BLOCK_W] slot of rank 1, less one
        # The pairs of this block of rows: rank r (1-based) of offset w in slot first_slot[w] + r.
        mine = mask_w & (offs_w * 0 + pid < n_blocks)  # [BLOCK_W] (programs past the rows only write PW)
        done = (tl.load(scanned_ptr + row_w + pid, mask=mine, other=0)
                - tl.load(block_pairs_ptr + row_w + pid, mask=mine, other=0) - before_w)  # [BLOCK_W] earlier blocks' pairs
        # Offsets by rows, rows fastest: a warp's lanes store one offset's pairs of consecutive
        # rows, to consecutive slots (rows by offsets: 32 offsets' slots, a sector a pair).
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        live = mask_w[:, None] & (offs_m < n_out)[None, :]  # [BLOCK_W, BLOCK_M]
        rows = offs_m.to(tl.int64)[None, :]
        inp = tl.load(nbr_ptr + rows * stride_nv + offs_w[:, None] * stride_nw, mask=live, other=-1)
        real = live & (inp >= 0)  # [BLOCK_W, BLOCK_M]
        rank = done[:, None] + tl.cumsum(real.to(tl.int32), axis=1)  # [BLOCK_W, BLOCK_M]
        slots = first_slot[:, None].to(tl.int64) + rank  # [BLOCK_W, BLOCK_M]
        tl.store(pi_ptr + slots, inp.to(tl.int32), mask=real)
        tl.store(po_ptr + slots, (rows + tl.zeros((BLOCK_W, BLOCK_M), tl.int64)).to(tl.int32), mask=real)
        if pid * BLOCK_G < n_groups:  # PW[g]: the offsets whose groups end at or before g
            offs_g = pid * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
            ended = (end_group[None, :] <= offs_g[:, None]) & mask_w[None, :]  # [BLOCK_G, BLOCK_W]
            tl.store(pw_ptr + offs_g, tl.sum(ended.to(tl.int64), axis=1), mask=offs_g < n_groups)
        if pid < VOLUME:  # program w pads offset w's last group: the zero row of X, output row 0
            this_w = offs_w == pid  # [BLOCK_W]
            pad_start = tl.sum(tl.where(this_w, first_slot + 1 + counts, 0), axis=0).to(tl.int64)
            pad_end = tl.sum(tl.where(this_w, end_group, 0), axis=0).to(tl.int64) * group
            for start in range(0, group, BLOCK_P):
                offs_p = pad_start + start + tl.arange(0, BLOCK_P)  # [BLOCK_P]
                tl.store(pi_ptr + offs_p, tl.full((BLOCK_P,), 0, tl.int32) + n_in, mask=offs_p < pad_end)
                tl.store(po_ptr + offs_p, tl.full((BLOCK_P,), 0, tl.int32), mask=offs_p < pad_end)

    return insum_kernel_map_pair_groups


class KernelMapCache:
    """Kernel maps keyed by the identity and version of the coordinate tensors (and the
    kernel's geometry). Entries die with their coordinate tensors. Pass one cache to every
    layer of a network, or rely on `default_cache`. Inference tensors keep no version
    counter: their maps are built on each call, not kept. A change that bypasses the version
    counter (through `.data`, `.numpy()` or DLPack) is not seen: the old map is returned;
    give changed coordinates as a new tensor, or `clear()` the cache."""

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
        if any(t.is_inference() for t in tensors):  # no version counter to key on: built each call
            return build_kernel_map(coords, kernel_size, stride, dilation, mode, out_coords)
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

    def __reduce__(self):
        """Pickled (torch.save, deepcopy) empty: its entries are keyed by tensors of this
        process. `default_cache` pickles by name, as the loading process's own."""
        return "default_cache" if self is default_cache else (KernelMapCache, ())


default_cache = KernelMapCache()
