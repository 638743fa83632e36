"""The kernel-map build's fast paths against its plain ones (test_conv.py checks the plain
ones against a dictionary lookup and the dense convolution):

- the fused lookup kernel (CUDA's path; here in the Triton interpreter) against the torch
  lookup, every mode it serves, int32/int64, negative and non-contiguous coordinates;
- the mirrored transpose of a submanifold map (odd kernel) and its tiles, which reuse the
  forward tiles, against the general transpose;
- the pair groups sized from the host's per-offset counts against the ones counted anew;
- the build's op and host-sync budget: a training build reads the device twice.
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, KERNEL_MARK  # before insum: the interpreter on CPU-only machines

import insum.nn.kernel_map as kernel_map
from insum.errors import InsumError
from insum.formats.opcount import count_ops
from insum.nn.kernel_map import KernelMap, build_kernel_map, pair_groups


def random_sites(n: int, extent: int, batches: int = 2, seed: int = 0, dtype=torch.int64) -> torch.Tensor:
    """Unique [M, 4] sites (batch first) in [-3, extent - 3)^3, in random order."""
    gen = torch.Generator().manual_seed(seed)
    pts = torch.cat([torch.randint(0, batches, (n, 1), generator=gen),
                     torch.randint(-3, extent - 3, (n, 3), generator=gen)], 1)
    pts = torch.unique(pts, dim=0)
    return pts[torch.randperm(pts.shape[0], generator=gen)].to(dtype)


def pair_set(km: KernelMap) -> set[tuple[int, int, int]]:
    v, w = (km.nbr >= 0).nonzero().unbind(1)
    return set(zip(v.tolist(), w.tolist(), km.nbr[v, w].tolist()))


def tiled_pair_set(km: KernelMap, tile: int) -> set[tuple[int, int, int]]:
    """The (output, offset, input) triples the one-launch tiles hold, each within its tile's
    declared length, and those of the buckets (they must agree)."""
    tiled = km.tiles(tile)
    rows = torch.full((tiled.n_tiles * tile,), -1, dtype=torch.long)
    rows[tiled.inverse] = torch.arange(km.n_out)
    NB, TW, TL = km.tiles_whole(tile)
    t, m, j = (NB < km.n_in).nonzero().unbind(1)
    assert (j < TL[t]).all()
    whole = list(zip(rows[t * tile + m].tolist(), TW[t, j].tolist(), NB[t, m, j].tolist()))
    assert len(set(whole)) == len(whole)
    buckets = []
    for start, _end, nb, tw in tiled.buckets:
        t, m, j = (nb < km.n_in).nonzero().unbind(1)
        buckets += zip(rows[(start + t) * tile + m].tolist(), tw[t, j].tolist(), nb[t, m, j].tolist())
    assert set(buckets) == set(whole) and len(buckets) == len(whole)
    assert tiled.real_pairs == len(whole) <= tiled.padded_pairs
    return set(whole)


def packings(km: KernelMap, tile: int) -> list[torch.Tensor]:
    """Every tensor of the tiled packing the layer reads, the buckets included."""
    tiled = km.tiles(tile)
    buckets = [t for _start, _end, nb, tw in tiled.buckets for t in (nb, tw)]
    return [*km.tiles_whole(tile), tiled.inverse, tiled.output_rows(), tiled._rows, tiled._counts, *buckets]


def assert_same_maps(got: KernelMap, expected: KernelMap, tiles=(16, 12)) -> None:
    assert torch.equal(got.out_coords, expected.out_coords)
    assert torch.equal(got.nbr, expected.nbr) and got.nbr.dtype == torch.int32
    assert got.offset_pairs == expected.offset_pairs == (expected.nbr >= 0).sum(0).tolist()
    for tile in tiles:  # the tile kernels (12: not a power of two)
        for a, b in zip(packings(got, tile), packings(expected, tile), strict=True):
            assert torch.equal(a, b) and a.dtype == b.dtype


def kernel_build(monkeypatch, lookup: str, *args) -> KernelMap:
    """The map by CUDA's path (the Triton kernels), `lookup` "hash" (the default) or
    "sorted" (INSUM_MAP_HASH=0), or by the torch ops ("torch")."""
    monkeypatch.setattr(kernel_map, "_use_kernels", lambda device: lookup != "torch")
    monkeypatch.setattr(kernel_map, "_hashing", lambda: lookup == "hash")
    return build_kernel_map(*args)


@KERNEL_MARK
@pytest.mark.parametrize("k,s,d,mode", [
    (3, 1, 1, "subm"), (3, 1, 2, "subm"), (2, 1, 1, "subm"), (5, 1, 1, "subm"), (1, 1, 1, "subm"),
    (2, 2, 1, "strided"), (3, 2, 1, "strided"), (3, 2, 2, "strided"), (2, 2, 1, "transposed"), (3, 2, 1, "transposed"),
])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kernel_lookups_equal_the_torch_lookup(monkeypatch, k, s, d, mode, dtype):
    coords = random_sites(100, 7, seed=k + s + d, dtype=dtype).to(DEVICE)
    out = random_sites(90, 12, seed=3, dtype=dtype).to(DEVICE) if mode == "transposed" else None
    plain = kernel_build(monkeypatch, "torch", coords, k, s, d, mode, out)
    assert_same_maps(kernel_build(monkeypatch, "hash", coords, k, s, d, mode, out), plain)
    if dtype == torch.int64 and mode != "transposed":  # the sorted-keys kernel (no transposed maps)
        assert_same_maps(kernel_build(monkeypatch, "sorted", coords, k, s, d, mode, out), plain, tiles=(16,))


@KERNEL_MARK
def test_kernel_lookup_edge_cases(monkeypatch):
    monkeypatch.setattr(kernel_map, "_use_kernels", lambda device: True)
    wide = random_sites(70, 6, seed=4).to(DEVICE).t().contiguous().t()  # column-major [N, 4]
    assert not wide.is_contiguous()
    assert torch.equal(build_kernel_map(wide).nbr, build_kernel_map(wide.contiguous()).nbr)
    one = build_kernel_map(torch.tensor([[0, 0, 0]], device=DEVICE))
    assert one.nbr.tolist() == [[-1] * 13 + [0] + [-1] * 13] and one.pairs == 1
    groups = one.pair_groups(4)  # the pair-group kernel on one row
    assert groups.PI.tolist() == [[0, 1, 1, 1]] and groups.PO.tolist() == [[0] * 4] and groups.PW.tolist() == [13]
    NB, TW, TL = one.tiles_whole(4)
    assert NB.tolist() == [[[0], [1], [1], [1]]] and TW.tolist() == [[13]] and TL.tolist() == [1]
    assert one.tiles(4).output_rows().tolist() == [[0, 1, 2, 3]]
    empty = build_kernel_map(torch.zeros(0, 3, dtype=torch.long, device=DEVICE))
    assert empty.nbr.shape == (0, 27) and empty.pairs == 0
    NB, TW, TL = empty.tiles_whole(4)
    assert NB.tolist() == [[[0]] * 4] and TL.tolist() == [0] and empty.tiles(4).output_rows().tolist() == [[0, 1, 2, 3]]
    # strided onto given sites, none of which reads an input
    far = build_kernel_map(random_sites(20, 4).to(DEVICE), 3, 2, 1, "strided", torch.tensor([[0, 50, 50, 50]], device=DEVICE))
    assert far.nbr.tolist() == [[-1] * 27] and far.offset_pairs == [0] * 27
    # transposed onto no sites, and from no sites
    sites = random_sites(20, 4).to(DEVICE)
    assert build_kernel_map(sites, 3, 2, 1, "transposed", sites[:0]).nbr.shape == (0, 27)
    assert build_kernel_map(sites[:0], 3, 2, 1, "transposed", sites).offset_pairs == [0] * 27


@KERNEL_MARK
@pytest.mark.parametrize("lookup", ["hash", "sorted", "torch"])
def test_duplicate_sites_read_their_first_copy(monkeypatch, lookup):
    """A site given twice: every path maps both copies to the first copy's row. Found by
    fuzzing: the sorted-keys kernel (INSUM_MAP_HASH=0), whose window of places assumes
    distinct keys, summed the places of repeated keys (another site's row, silently, or a
    read past the keys); repeated sites take the torch lookup there."""
    sites = random_sites(40, 5, seed=6).to(DEVICE)
    n = sites.shape[0]
    coords = torch.cat([sites, sites[[3, 0, 3]]])  # rows n, n + 2 copy row 3; row n + 1 copies row 0
    km = kernel_build(monkeypatch, lookup, coords)
    unique = build_kernel_map(sites)
    assert torch.equal(km.nbr[:n], unique.nbr) and torch.equal(km.nbr[n:], unique.nbr[[3, 0, 3]])


@KERNEL_MARK
def test_the_hash_table_is_exact_when_fingerprints_collide(monkeypatch):
    """With 2-bit fingerprints (rows given 29 bits) a quarter of the other keys' entries
    share a probe's fingerprint: their keys are read and refused, and copies of a site still
    keep the first one's row."""
    sites = random_sites(120, 6, seed=11).to(DEVICE)
    coords = torch.cat([sites, sites[[7, 2, 7]]])
    plain = kernel_build(monkeypatch, "torch", coords)
    monkeypatch.setattr(kernel_map, "_row_bits", lambda n_in: 29)
    assert_same_maps(kernel_build(monkeypatch, "hash", coords), plain, tiles=(16,))
    out = kernel_map.output_coords(sites, 3, 2, 1)
    assert_same_maps(kernel_build(monkeypatch, "hash", out, 3, 2, 1, "transposed", sites),
                     kernel_build(monkeypatch, "torch", out, 3, 2, 1, "transposed", sites), tiles=(16,))


@KERNEL_MARK
@pytest.mark.parametrize("lookup", ["hash", "torch"])
def test_out_of_range_sites_are_refused_on_every_path(monkeypatch, lookup):
    sites = random_sites(30, 5)
    # no room for the taps; a negative batch; batches past the key's top field (65536 aliased batch 0)
    for bad in ([0, 32767, 0, 0], [0, 0, -32767, 0], [-1, 0, 0, 0], [32768, 0, 0, 0], [65536, 0, 0, 0]):
        with pytest.raises(InsumError, match="coords"):
            kernel_build(monkeypatch, lookup, torch.cat([sites, torch.tensor([bad])]).to(DEVICE))
    with pytest.raises(InsumError, match="out_coords"):  # 40000 at stride 2
        kernel_build(monkeypatch, lookup, sites.to(DEVICE), 3, 2, 1, "strided", torch.tensor([[0, 20000, 0, 0]], device=DEVICE))
    with pytest.raises(InsumError, match="out_coords"):
        kernel_build(monkeypatch, lookup, sites.to(DEVICE), 3, 2, 1, "strided", torch.tensor([[65536, 0, 0, 0]], device=DEVICE))
    top = torch.cat([sites, torch.tensor([[kernel_map.MAX_BATCH, 0, 0, 0]])]).to(DEVICE)
    kernel_build(monkeypatch, lookup, top)  # the greatest batch index is taken


@pytest.mark.parametrize("k,d", [(3, 1), (3, 2), (5, 1)])
def test_mirrored_transpose_equals_the_general_one(k, d):
    coords = random_sites(300, 9, seed=k * d)
    km = build_kernel_map(coords, k, 1, d)
    assert km.symmetric
    general = KernelMap(km.nbr, km.n_in, km.out_coords, k).transpose()  # scattered, not mirrored
    mirrored = km.transpose()
    assert torch.equal(mirrored.nbr, general.nbr)
    assert mirrored.offset_pairs == (general.nbr >= 0).sum(0).tolist() and mirrored.pairs == km.pairs
    forward_tiles = km.tiles(16)
    assert torch.equal(mirrored.tiles(16).inverse, forward_tiles.inverse)  # the forward's tiles, reused
    assert mirrored.tiles_whole(16)[0] is km.tiles_whole(16)[0]
    assert tiled_pair_set(mirrored, 16) == pair_set(general)
    assert tiled_pair_set(km, 16) == pair_set(km)
    # The transposed map's tiles first: the forward tiles are made from its mirror.
    km2 = build_kernel_map(coords, k, 1, d)
    assert tiled_pair_set(km2.transpose(), 8) == pair_set(general)
    assert km2.tiles_whole(8)[0] is km2.transpose().tiles_whole(8)[0] and tiled_pair_set(km2, 8) == pair_set(km)


def test_even_kernels_and_strided_maps_are_not_mirrored():
    coords = random_sites(80, 6, seed=9)
    assert not build_kernel_map(coords, 2).symmetric
    assert not build_kernel_map(coords, 3, 2, 1, "strided").symmetric


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=KERNEL_MARK)])
@pytest.mark.parametrize("group", [None, 4, 32, 2048])  # 2048: padding past one block of the kernel
def test_pair_groups_from_host_counts_equal_counted_ones(monkeypatch, group, kernel):
    """From the host's counts (with the kernels: CUDA's path, the probe's counts per block of
    rows) against counted anew (torch)."""
    coords = random_sites(200, 7, seed=3).to(DEVICE)  # (the kernels need DEVICE's tensors)
    km = kernel_build(monkeypatch, "hash" if kernel else "torch", coords, 3)
    assert (km._block_pairs is not None) == kernel
    monkeypatch.setattr(kernel_map, "_use_kernels", lambda device: False)
    counted = pair_groups(km.nbr, km.n_in, group)
    monkeypatch.setattr(kernel_map, "_use_kernels", lambda device: kernel)
    given = km.pair_groups(group)
    assert torch.equal(given.PI, counted.PI) and torch.equal(given.PO, counted.PO) and torch.equal(given.PW, counted.PW)
    assert given.PI.dtype == given.PO.dtype == torch.int32 and given.PW.dtype == torch.long
    real = given.PI < km.n_in
    p, q = real.nonzero().unbind(1)
    got = list(zip(given.PO[p, q].tolist(), given.PW[p].tolist(), given.PI[p, q].tolist()))
    assert set(got) == pair_set(km) and len(got) == km.pairs
    empty = pair_groups(torch.full((5, 27), -1, dtype=torch.int32, device=DEVICE), 3, group)
    assert empty.PW.tolist() == [0] and (empty.PI == 3).all()


def test_out_coords_range_is_checked_at_their_scale():
    coords = random_sites(30, 5)
    with pytest.raises(InsumError, match="out_coords"):
        build_kernel_map(coords, 3, 2, 1, "strided", torch.tensor([[0, 20000, 0, 0]]))  # 40000 at stride 2
    build_kernel_map(coords, 3, 2, 1, "strided", torch.tensor([[0, 16000, 0, 0]]))


def test_a_training_build_keeps_its_op_and_sync_budget():
    """The build syncs once (range check and per-offset counts), the packings a training
    step read never (the tiles' width is bounded by the offsets with pairs); the op counts
    (torch path, CPU) are budgets with a little room: on a GPU each op is a launch (benchmarks/map_overhead.py)."""
    coords = random_sites(200, 7, seed=1)
    build_kernel_map(coords)  # the per-device constants, made once
    with count_ops() as build:
        km = build_kernel_map(coords)
    with count_ops() as packings:
        km.pairs, km.tiles_whole(128), km.transpose().tiles_whole(128), km.pair_groups(), km.pair_groups(128)
    assert (build.syncs, packings.syncs) == (1, 0), (build, packings)
    assert build.ops <= 26 and packings.ops <= 80, (build.names, packings.names)


@KERNEL_MARK
def test_the_kernel_path_keeps_its_launch_and_sync_budget(monkeypatch):
    """CUDA's path: the build is 8 ops (the coordinates' copy, the table's fill, the counters'
    copy, the block counters' fill, the insert and probe kernels, the least of the programs'
    range values, the counters' sum) and syncs once; the training packings
    (tiles, the transposed tiles, pair groups) add 11 ops and no sync.
    Each Triton launch counts as one op (benchmarks/map_overhead.py prints them)."""
    from torch.utils._python_dispatch import _disable_current_modes

    monkeypatch.setattr(kernel_map, "_use_kernels", lambda device: True)
    coords = random_sites(150, 7, seed=1).to(DEVICE)

    def train_step():
        km = build_kernel_map(coords)
        return km, lambda: (km.tiles_whole(128), km.transpose().tiles_whole(128), km.pair_groups())

    train_step()[1]()  # compiles the kernels, makes the per-device constants
    launch = kernel_map._launch

    def counted(kernel, grid, *args, **kwargs):
        counters[-1].ops += 1
        with _disable_current_modes():
            launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(kernel_map, "_launch", counted)
    counters = [count_ops()]
    with counters[-1]:
        km, packings = train_step()
    counters.append(count_ops())
    with counters[-1]:
        packings()
    build, packed = counters
    assert (build.ops, build.syncs) == (8, 1), build.names
    assert packed.ops <= 11 and packed.syncs == 0, packed.names


# Compiles each kernel the build launched for sm_90, in a process without the interpreter.
_COMPILE_FOR_HOPPER = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import insum.nn.kernel_map as km

kernels = {k.fn.__name__: k for k in (*km._hash_kernels(), km._lookup_kernel(), km._activity_kernel(),
           km._place_kernel(), km._pack_kernel(), km._block_pairs_kernel(), km._pairs_kernel())}
for name, signature, constexprs, options in json.load(sys.stdin):
    compiled = triton.compile(ASTSource(fn=kernels[name], signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"], name
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU tests compile and run them")
def test_the_build_kernels_compile_for_hopper(monkeypatch):
    """The interpreter runs the kernels' Python, not Triton's compiler: compile every kernel
    the CUDA path launches (with the arguments it launches them with) for an H100/H200,
    which needs no GPU (ptxas ships with triton)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    seen = {}
    launch = kernel_map._launch

    def record(kernel, grid, *args, **kwargs):
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}  # launch options, not arguments
        constexprs = {k: v for k, v in kwargs.items() if k not in options}
        names = [name for name in kernel.arg_names if name not in constexprs]
        types = {torch.int8: "*i8", torch.uint8: "*u8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64"}
        signature = {name: types[a.dtype] if isinstance(a, torch.Tensor) else "i32" for name, a in zip(names, args)}
        seen[kernel.fn.__name__, json.dumps(kwargs, sort_keys=True)] = (
            signature | dict.fromkeys(constexprs, "constexpr"), constexprs, options)
        launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(kernel_map, "_launch", record)
    coords = random_sites(60, 6, seed=5)
    km = kernel_build(monkeypatch, "hash", coords)
    km.tiles_whole(16), km.pair_groups()
    kernel_map.pair_groups(km.nbr, km.n_in, offset_pairs=km.offset_pairs)  # counting its blocks itself
    kernel_build(monkeypatch, "hash", kernel_map.output_coords(coords, 3, 2, 1), 3, 2, 1, "transposed", coords)
    kernel_build(monkeypatch, "sorted", coords)
    jobs = [(name, *compiled) for (name, _), compiled in seen.items()]
    assert len({job[0] for job in jobs}) == 8
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], input=json.dumps(jobs), capture_output=True,
                          text=True, env=env | {"PYTHONPATH": str(root)}, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("n,tile", [(300, 16), (64, 16), (5, 16), (0, 8)])
def test_output_rows_place_every_tile_row_once(n, tile):
    """TR (the one-launch tiles' output rows) against its definition: real rows where the
    tiles put them (`inverse`), padding rows numbered on from n_out in tile order."""
    coords = random_sites(n, 9, seed=n)[:n] if n else torch.zeros(0, 4, dtype=torch.long)
    km = build_kernel_map(coords)
    tiled = km.tiles(tile)
    rows = torch.full((tiled.n_tiles * tile,), -1, dtype=torch.long)
    rows[tiled.inverse] = torch.arange(km.n_out)
    padding = rows < 0
    expected = torch.where(padding, km.n_out + torch.cumsum(padding, 0) - 1, rows).view(tiled.n_tiles, tile)
    TR = tiled.output_rows()
    assert TR.dtype == torch.int32 and torch.equal(TR.long(), expected)
    assert km.transpose().tiles(tile).output_rows() is TR


def test_a_prepared_map_runs_the_layer_without_host_reads(monkeypatch):
    """After `prepare`, the bucketed tiles (torch backend, torch.compile) and the backward
    read nothing from the device: a compiled function would only look the packings up."""
    from insum.nn import sparse_conv3d

    km = build_kernel_map(random_sites(120, 6, seed=8)).prepare(tile=16)
    x = torch.randn(km.n_in, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, 3, 3, 2, dtype=torch.float64, requires_grad=True)
    reads = []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append("tolist") or tolist(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item") or item(t))
    for form in ("tiles", "pairs"):
        sparse_conv3d(x, w, km, form=form, tile=16, backend="torch").sum().backward()
    assert reads == []


def test_the_mirrored_transpose_copies_its_table_only_when_read():
    """The one-launch backward reads the transpose's tiles (the forward's) and its counts,
    never its table: no flipped copy of the map is made for them."""
    km = build_kernel_map(random_sites(100, 6, seed=2))
    t = km.transpose()
    t.tiles_whole(16), t.tiles(16).output_rows(), t.pairs, t.n_out, t.volume
    assert t._flipped is None and t.tiles(16)._nbr is None
    assert torch.equal(t.nbr, km.nbr.flip(1)) and (t.n_out, t.volume) == (km.n_in, 27)
    assert tiled_pair_set(t, 16) == pair_set(t)  # the buckets: the mirrored table made for them
