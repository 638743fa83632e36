"""SparseConv3d and its kernel map against dense references.

- The kernel map against a Python dictionary lookup, for every mode.
- The convolution (torch lowering, float64) against `torch.nn.functional.conv3d` /
  `conv_transpose3d` on a dense voxel grid, read at the active sites.
- The generated kernels (Triton interpreter) against the torch lowering, forward and both
  gradients; gradients by gradcheck in float64.
"""

from __future__ import annotations

import gc
import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from insum.errors import InsumError, InsumShapeError, InsumTypeError
from insum.nn import KernelMapCache, SparseConv3d, build_kernel_map, sparse_conv3d
from insum.nn.kernel_map import output_coords, pair_groups, tile_map

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def random_sites(n: int, extent: int, batches: int = 1, seed: int = 0, dtype=torch.int64) -> torch.Tensor:
    """Unique [M, 4] sites (batch first) in [0, extent)^3, in random order."""
    gen = torch.Generator().manual_seed(seed)
    pts = torch.cat([torch.randint(0, batches, (n, 1), generator=gen), torch.randint(0, extent, (n, 3), generator=gen)], 1)
    pts = torch.unique(pts, dim=0)
    return pts[torch.randperm(pts.shape[0], generator=gen)].to(dtype)


def naive_map(coords, out_coords, k, s, d, mode):
    """nbr[v][w] by a dictionary lookup, one (output, offset) at a time."""
    where = {tuple(c): i for i, c in enumerate(coords.tolist())}
    r = (k - 1) // 2
    rows = []
    for b, *o in out_coords.tolist():
        row = []
        for tap in itertools.product(range(k), repeat=3):
            t = [d * (i - r) for i in tap]
            if mode == "subm":
                pos = [o[a] + t[a] for a in range(3)]
            elif mode == "strided":
                pos = [o[a] * s + t[a] for a in range(3)]
            else:
                if any((o[a] - t[a]) % s for a in range(3)):
                    row.append(-1)
                    continue
                pos = [(o[a] - t[a]) // s for a in range(3)]
            row.append(where.get((b, *pos), -1))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, k**3)


def dense_reference(x, coords, weight, out_coords, stride, dilation, transposed=False):
    """The convolution on a dense grid (float64), read at `out_coords` ([M, 4])."""
    k = weight.shape[0]
    r = (k - 1) // 2
    margin = stride * (dilation * k + 1)
    batches = int(max(coords[:, 0].max(), out_coords[:, 0].max())) + 1
    size = int(max(coords[:, 1:].max(), out_coords[:, 1:].max())) + 2 * margin + 2
    grid = torch.zeros(batches, x.shape[1], size, size, size, dtype=x.dtype)
    c = coords[:, 1:] + margin
    grid[coords[:, 0], :, c[:, 0], c[:, 1], c[:, 2]] = x
    if transposed:
        y = F.conv_transpose3d(grid, weight.permute(3, 4, 0, 1, 2), stride=stride, padding=dilation * r, dilation=dilation)
        o = out_coords[:, 1:] + margin * stride
    else:
        y = F.conv3d(grid, weight.permute(4, 3, 0, 1, 2), stride=stride, padding=dilation * r, dilation=dilation)
        o = out_coords[:, 1:] + margin // stride
    return y[out_coords[:, 0], :, o[:, 0], o[:, 1], o[:, 2]]


# --------------------------------------------------------------------------- the kernel map


@pytest.mark.parametrize("k,s,d,mode", [
    (3, 1, 1, "subm"), (3, 1, 2, "subm"), (2, 1, 1, "subm"), (5, 1, 1, "subm"),
    (2, 2, 1, "strided"), (3, 2, 1, "strided"), (3, 3, 2, "strided"),
    (2, 2, 1, "transposed"), (3, 2, 1, "transposed"),
])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kernel_map_matches_dictionary_lookup(k, s, d, mode, dtype):
    coords = random_sites(80, 7, batches=2, seed=k + s + d, dtype=dtype)
    out = None
    if mode == "transposed":
        out = random_sites(60, 12, batches=2, seed=3, dtype=dtype)
    km = build_kernel_map(coords, k, s, d, mode, out)
    expected_out = coords if mode == "subm" else out if out is not None else output_coords(coords, k, s, d)
    assert torch.equal(km.out_coords, expected_out.long())
    assert torch.equal(km.nbr, naive_map(coords.long(), km.out_coords, k, s, d, mode))


def test_three_column_coords_are_batch_zero():
    coords = random_sites(50, 6)
    km3 = build_kernel_map(coords[:, 1:] - 3, 3)  # negative coordinates too
    km4 = build_kernel_map(torch.cat([coords[:, :1] * 0, coords[:, 1:] - 3], 1), 3)
    assert torch.equal(km3.nbr, km4.nbr)


@pytest.mark.parametrize("k,s,d", [(2, 2, 1), (3, 2, 1), (3, 2, 2), (3, 1, 1)])
def test_output_sites_are_the_reachable_dense_sites(k, s, d):
    coords = random_sites(40, 8, seed=k * s)
    ones = torch.ones(coords.shape[0], 1, dtype=torch.float64)
    w = torch.ones(k, k, k, 1, 1, dtype=torch.float64)
    margin = s * (d * k + 1)
    size = int(coords[:, 1:].max()) + 2 * margin + 2
    grid = torch.zeros(1, 1, size, size, size, dtype=torch.float64)
    c = coords[:, 1:] + margin
    grid[0, 0, c[:, 0], c[:, 1], c[:, 2]] = 1
    reach = F.conv3d(grid, w.permute(4, 3, 0, 1, 2), stride=s, padding=d * ((k - 1) // 2), dilation=d)[0, 0]
    dense_sites = {tuple((v - margin // s).tolist()) for v in reach.nonzero()}
    sites = output_coords(coords, k, s, d)
    assert {tuple(v) for v in sites[:, 1:].tolist()} == dense_sites
    assert dense_reference(ones, coords, w, sites, s, d).min() > 0


def test_packings_hold_every_pair_once():
    coords = random_sites(300, 9, seed=5)
    km = build_kernel_map(coords, 3)
    pairs = {(v, w, i) for v, w in (km.nbr >= 0).nonzero().tolist() for i in [int(km.nbr[v, w])]}
    tiled = tile_map(km.nbr, km.n_in, tile=16, max_buckets=3)
    assert len(tiled.buckets) <= 3 and tiled.padded_pairs >= tiled.real_pairs == len(pairs)
    rows = torch.full((tiled.n_tiles * 16,), -1, dtype=torch.long)
    rows[tiled.inverse] = torch.arange(km.n_out)
    seen = set()
    for start, _end, nb, tw in tiled.buckets:
        for t, m, j in (nb < km.n_in).nonzero().tolist():
            seen_pair = (int(rows[(start + t) * 16 + m]), int(tw[t, j]), int(nb[t, m, j]))
            assert seen_pair not in seen
            seen.add(seen_pair)
    assert seen == pairs
    groups = pair_groups(km.nbr, km.n_in, group=32)
    real = groups.PI < km.n_in
    got = {(o, int(groups.PW[p]), i) for p, q in real.nonzero().tolist() for o, i in [(int(groups.PO[p, q]), int(groups.PI[p, q]))]}
    assert got == pairs and int(real.sum()) == len(pairs)
    # One launch: every pair within its tile's declared length, nothing real beyond it.
    NB, TW, TL = km.tiles_whole(16)
    tiled = km.tiles(16)
    rows[tiled.inverse] = torch.arange(km.n_out)
    within = torch.arange(NB.shape[2])[None, None, :] < TL[:, None, None].long()
    assert not (NB[~within.expand_as(NB)] < km.n_in).any()
    got = {(int(rows[t * 16 + m]), int(TW[t, j]), int(NB[t, m, j])) for t, m, j in (NB < km.n_in).nonzero().tolist()}
    assert got == pairs


def test_transpose_inverts_the_map():
    coords = random_sites(100, 8, seed=2)
    km = build_kernel_map(coords, 3, 2, 1, "strided")
    kt = km.transpose()
    assert kt.n_in == km.n_out and kt.n_out == km.n_in
    for v, w in (km.nbr >= 0).nonzero().tolist():
        assert int(kt.nbr[km.nbr[v, w], w]) == v
    assert int((kt.nbr >= 0).sum()) == km.pairs


def test_map_errors_name_the_tensor():
    with pytest.raises(InsumTypeError, match="coords"):
        build_kernel_map(torch.zeros(3, 3))
    with pytest.raises(InsumShapeError, match="coords"):
        build_kernel_map(torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(InsumError, match="coordinates must lie"):
        build_kernel_map(torch.tensor([[0, 0, 40000]]))
    with pytest.raises(InsumError, match="out_coords"):
        build_kernel_map(torch.zeros(1, 3, dtype=torch.long), 2, 2, 1, "transposed")
    with pytest.raises(InsumError, match="mode"):
        build_kernel_map(torch.zeros(1, 3, dtype=torch.long), mode="dense")
    # Found by fuzzing: a submanifold map ignored stride and out_coords, kernel_size=2.0 failed in
    # a shift, and a tile of 0 divided by zero in the forward.
    one = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(InsumError, match="mode 'subm' has stride 1"):
        build_kernel_map(one, 3, 2)
    with pytest.raises(InsumError, match="mode 'subm' has stride 1"):
        build_kernel_map(one, 3, out_coords=one)
    with pytest.raises(InsumError, match="kernel_size must be a positive integer"):
        build_kernel_map(one, 2.0)
    with pytest.raises(InsumError, match="tile"):
        SparseConv3d(2, 4, tile=0)
    with pytest.raises(InsumError, match="tile"):
        sparse_conv3d(torch.ones(1, 2), torch.ones(3, 3, 3, 2, 4), build_kernel_map(one), tile=-1)


# --------------------------------------------------------------------------- the convolution


@pytest.mark.parametrize("absent", ["zero_row", "mask"])
@pytest.mark.parametrize("form", ["tiles", "pairs"])
@pytest.mark.parametrize("k,d", [(3, 1), (3, 2), (2, 1), (5, 1), (1, 1)])
def test_submanifold_matches_dense_conv3d(k, d, form, absent):
    coords = random_sites(70, 7, batches=2, seed=k + d)
    x = torch.randn(coords.shape[0], 3, dtype=torch.float64)
    w = torch.randn(k, k, k, 3, 4, dtype=torch.float64)
    km = build_kernel_map(coords, k, 1, d)
    got = sparse_conv3d(x, w, km, form=form, tile=16, backend="torch", absent=absent)
    torch.testing.assert_close(got, dense_reference(x, coords, w, coords, 1, d))


@pytest.mark.parametrize("form", ["tiles", "pairs"])
@pytest.mark.parametrize("k,s,d", [(2, 2, 1), (3, 2, 1), (3, 2, 2), (3, 3, 1)])
def test_strided_matches_dense_conv3d(k, s, d, form):
    coords = random_sites(70, 9, batches=2, seed=k * s + d)
    x = torch.randn(coords.shape[0], 3, dtype=torch.float64)
    conv = SparseConv3d(3, 5, k, stride=s, dilation=d, subm=False, bias=True, form=form, tile=16, backend="torch").double()
    y, sites = conv(x, coords.int())
    assert sites.dtype == torch.int32 and sites.shape[1] == 4
    want = dense_reference(x, coords, conv.weight.detach(), sites.long(), s, d) + conv.bias.detach()
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize("k,s", [(2, 2), (3, 2)])
def test_transposed_matches_conv_transpose3d(k, s):
    fine = random_sites(80, 10, batches=2, seed=k)
    down = SparseConv3d(3, 3, k, stride=s, subm=False, backend="torch").double()
    _, coarse = down(torch.randn(fine.shape[0], 3, dtype=torch.float64), fine)
    up = SparseConv3d(3, 4, k, stride=s, subm=False, transposed=True, tile=16, backend="torch").double()
    x = torch.randn(coarse.shape[0], 3, dtype=torch.float64)
    y, sites = up(x, coarse, fine)
    assert sites is fine
    torch.testing.assert_close(y, dense_reference(x, coarse, up.weight.detach(), fine, s, 1, transposed=True))


@pytest.mark.parametrize("absent", ["zero_row", "mask"])
def test_empty_input_and_one_point(absent):
    conv = SparseConv3d(3, 4, backend="torch", absent=absent).double()
    y, _ = conv(torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, 3, dtype=torch.long))
    assert y.shape == (0, 4)
    one = torch.tensor([[2, 3, 4]])
    x = torch.randn(1, 3, dtype=torch.float64)
    y, _ = conv(x, one)
    torch.testing.assert_close(y, x @ conv.weight.detach()[1, 1, 1])
    down = SparseConv3d(3, 4, 2, stride=2, subm=False, backend="torch", absent=absent).double()
    y, sites = down(torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, 4, dtype=torch.long))
    assert y.shape == (0, 4) and sites.shape == (0, 4)
    # An upsampling onto sites from no input: zeros, and zero gradients.
    for form in ("tiles", "pairs"):
        up = SparseConv3d(3, 4, 2, stride=2, subm=False, transposed=True, bias=True, backend="torch", absent=absent,
                          form=form).double()
        x = torch.zeros(0, 3, dtype=torch.float64, requires_grad=True)
        y, _ = up(x, torch.zeros(0, 4, dtype=torch.long), one)
        torch.testing.assert_close(y, up.bias.detach()[None])
        y.sum().backward()
        assert up.weight.grad.abs().max() == 0 and x.grad.shape == (0, 3)
        # From one site onto no sites: an empty output, and zero gradients.
        x = torch.randn(1, 3, dtype=torch.float64, requires_grad=True)
        y, _ = up(x, one, torch.zeros(0, 4, dtype=torch.long))
        assert y.shape == (0, 4)
        y.sum().backward()
        assert up.weight.grad.abs().max() == 0 and x.grad.abs().max() == 0


def test_auto_form_picks_by_real_pairs(monkeypatch):
    from insum.nn import conv as conv_module

    km = build_kernel_map(random_sites(50, 5))
    assert conv_module.choose_form(km) == "pairs" and conv_module.choose_form(km, "tiles") == "tiles"
    monkeypatch.setattr(conv_module, "PAIRS_BELOW", km.pairs)
    assert conv_module.choose_form(km) == "tiles"
    with pytest.raises(InsumError, match="form"):
        conv_module.choose_form(km, "dense")


def test_layer_errors_name_the_tensor():
    with pytest.raises(InsumError, match="stride"):
        SparseConv3d(3, 4, stride=2)
    with pytest.raises(InsumError, match="submanifold"):
        SparseConv3d(3, 4, transposed=True)
    with pytest.raises(InsumError, match="form"):
        SparseConv3d(3, 4, form="dense")
    with pytest.raises(InsumError, match="absent"):
        SparseConv3d(3, 4, absent="nan")
    conv = SparseConv3d(3, 4, backend="torch")
    coords = random_sites(10, 4)
    with pytest.raises(InsumShapeError, match="feats"):
        conv(torch.randn(coords.shape[0], 5), coords)
    with pytest.raises(InsumShapeError, match="weight"):
        sparse_conv3d(torch.randn(coords.shape[0], 3), torch.randn(3, 3, 3, 4), build_kernel_map(coords))


def test_layers_share_one_map_per_coordinate_tensor():
    cache = KernelMapCache()
    coords = random_sites(60, 6)
    a = SparseConv3d(3, 4, cache=cache, backend="torch")
    b = SparseConv3d(4, 4, cache=cache, backend="torch")
    down = SparseConv3d(4, 4, 2, stride=2, subm=False, cache=cache, backend="torch")
    y, _ = b(*a(torch.randn(coords.shape[0], 3), coords))
    assert a.kernel_map(coords) is b.kernel_map(coords) and len(cache) == 1
    _, s1 = down(y, coords)
    _, s2 = down(y, coords)
    assert s1 is s2 and len(cache) == 2
    coords += 1  # a new version: the map is rebuilt
    assert a.kernel_map(coords) is not b.kernel_map(coords.clone())
    del coords, s1, s2
    gc.collect()
    assert len(cache) == 0  # entries die with their coordinate tensors


@pytest.mark.parametrize("absent", ["zero_row", "mask"])
@pytest.mark.parametrize("mode", ["subm", "strided", "transposed"])
@pytest.mark.parametrize("form", ["tiles", "pairs"])
def test_gradcheck(mode, form, absent):
    fine = random_sites(20, 4, seed=11)
    kw = {"subm": mode == "subm", "transposed": mode == "transposed", "stride": 1 if mode == "subm" else 2}
    coarse = output_coords(fine, 2, 2, 1)
    src, dst = (coarse, fine) if mode == "transposed" else (fine, None)
    k = 3 if mode == "subm" else 2
    km = SparseConv3d(2, 3, k, **kw).kernel_map(src, dst)
    x = torch.randn(src.shape[0], 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(k, k, k, 2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    conv = lambda x, w, b: sparse_conv3d(x, w, km, b, form=form, tile=16, backend="torch", absent=absent)  # noqa: E731
    assert torch.autograd.gradcheck(conv, (x, w, b), fast_mode=True)


@pytest.mark.parametrize("absent", ["zero_row", "mask"])
def test_compiles_without_graph_breaks(absent):
    coords = random_sites(40, 5)
    km = build_kernel_map(coords).prepare(tile=16, mask_dtype=torch.float32)
    x = torch.randn(coords.shape[0], 3, requires_grad=True)
    w = torch.randn(3, 3, 3, 3, 4, requires_grad=True)
    # Both forms without a bias; with a bias, the pairs (which accumulate onto it) and the tiles.
    with_bias = "pairs" if absent == "zero_row" else "tiles"
    for form, b in (("tiles", None), ("pairs", None), (with_bias, torch.randn(4, requires_grad=True))):
        compiled = torch.compile(lambda x, w, b, form=form: sparse_conv3d(x, w, km, b, form=form, tile=16, absent=absent),
                                 backend="aot_eager", fullgraph=True)
        y = compiled(x, w, b)
        torch.testing.assert_close(y, sparse_conv3d(x, w, km, b, form=form, tile=16))
        y.square().sum().backward()
        params = [t for t in (x, w, b) if t is not None]
        grads = [t.grad.clone() for t in params]
        for t in params:
            t.grad = None
        sparse_conv3d(x, w, km, b, form=form, tile=16).square().sum().backward()
        for got, t in zip(grads, params):
            torch.testing.assert_close(got, t.grad)
            t.grad = None


# --------------------------------------------------------------------------- generated kernels


@interpreter
@pytest.mark.parametrize("absent", ["zero_row", "mask"])
def test_tiles_in_one_launch_equal_the_buckets(monkeypatch, absent):
    """The generated tiled kernel: one launch with declared lengths (the default) and one
    launch per bucket give the same forward and input gradient."""
    from insum.nn import conv as conv_module

    coords = random_sites(60, 5, seed=6)
    km = build_kernel_map(coords)
    x = torch.randn(coords.shape[0], 16)
    w = torch.randn(3, 3, 3, 16, 8) / 10
    g = torch.randn(coords.shape[0], 8)
    results = []
    for one in (True, False):
        monkeypatch.setattr(conv_module, "TILES_IN_ONE_LAUNCH", one)
        xg = x.clone().requires_grad_()
        y = sparse_conv3d(xg, w, km, form="tiles", tile=16, backend="triton", precision="ieee", absent=absent)
        y.backward(g)
        results.append((y, xg.grad))
    assert len(km.tiles(16).buckets) > 1
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("dtype,absent", [(torch.float32, "zero_row"), (torch.float16, "zero_row"), (torch.bfloat16, "zero_row"),
                                          (torch.float16, "mask")])
@pytest.mark.parametrize("mode,form", [("subm", "tiles"), ("subm", "pairs"), ("strided", "tiles"), ("transposed", "tiles")])
def test_generated_kernels_match_the_lowering(mode, form, dtype, absent):
    fine = random_sites(40, 5, batches=2, seed=4)
    coarse = output_coords(fine, 2, 2, 1)
    src, dst = (coarse, fine) if mode == "transposed" else (fine, None)
    k = 3 if mode == "subm" else 2
    conv = SparseConv3d(16, 24, k, stride=1 if mode == "subm" else 2, subm=mode == "subm",
                        transposed=mode == "transposed", form=form, tile=16, precision="ieee")
    km = conv.kernel_map(src, dst)
    x = torch.randn(src.shape[0], 16).to(dtype)
    w = conv.weight.detach().to(dtype)
    g = torch.randn(km.n_out, 24).to(dtype)
    results = {}
    for backend in ("triton", "torch"):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = sparse_conv3d(xg, wg, km, form=form, tile=16, backend=backend, precision="ieee", absent=absent)
        y.backward(g)
        results[backend] = [t.double() for t in (y, xg.grad, wg.grad)]
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5}[dtype]
    tol = {"rtol": tol, "atol": tol}
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, **tol)


def test_inference_mode_coordinates_are_mapped_without_the_cache():
    """Inference tensors keep no version counter: their maps are built per call (the cache
    keys on versions), and the layer still computes what it computes outside the mode."""
    cache = KernelMapCache()
    conv = SparseConv3d(3, 4, cache=cache, backend="torch")
    coords = random_sites(40, 5)
    x = torch.randn(coords.shape[0], 3)
    expected, _ = conv(x, coords)
    with torch.inference_mode():
        coords_i, x_i = coords.clone(), x.clone()
        y, _ = conv(x_i, coords_i)
    torch.testing.assert_close(y, expected)
    assert len(cache) == 1  # only the map of the ordinary coordinates


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreter)])
@pytest.mark.parametrize("form", ["pairs", "tiles", "auto"])
def test_one_output_site_leaves_the_bias_as_it_is(form, backend):
    """Found by fuzzing: with one output site the expanded bias is contiguous, so the pairs'
    accumulator was the bias parameter itself: every forward added the convolution into the
    bias (and returned a view of it)."""
    layer = SparseConv3d(2, 3, kernel_size=3, bias=True, form=form, backend=backend).double()
    with torch.no_grad():
        layer.bias.copy_(torch.tensor([10.0, 20.0, 30.0]))
    coords, feats = torch.tensor([[0, 4, 5, 6]]), torch.ones(1, 2, dtype=torch.float64)
    expected = feats @ layer.weight.detach()[1, 1, 1] + torch.tensor([10.0, 20.0, 30.0])
    for _ in range(3):
        out, _ = layer(feats, coords)
        torch.testing.assert_close(out.detach(), expected)
        assert layer.bias.tolist() == [10.0, 20.0, 30.0]


def test_returned_sites_edited_by_the_caller_come_back_unedited():
    """Found by fuzzing: a strided layer returned the map's own sites tensor (a view of the
    map's coordinates), so a caller's in-place edit changed the map and came back on the next
    call; the sites are a copy of their own, made again when the caller changed them."""
    layer = SparseConv3d(1, 1, 3, stride=2, subm=False, backend="torch").double()
    coords, feats = torch.tensor([[0, 0, 0], [0, 0, 4]]), torch.ones(2, 1, dtype=torch.float64)
    out, sites = layer(feats, coords)
    expected = sites.clone()
    assert layer(feats, coords)[1] is sites  # (one tensor per map: the next layer's cache hits)
    sites += 100
    again = layer(feats, coords)[1]
    assert torch.equal(again, expected) and torch.equal(layer(feats, coords)[0], out)


def test_a_layer_pickles_after_its_kernel_maps_are_cached():
    """Found by fuzzing: once a layer had run, its cache held weak references and
    torch.save / pickle / deepcopy of the layer (or a model holding it) failed. A cache
    pickles empty; the default cache pickles as the loading process's own."""
    import copy
    import io
    import pickle

    from insum.nn.kernel_map import default_cache

    coords = torch.tensor([[0, 0, 0], [0, 0, 1], [2, 3, 1]])
    feats = torch.randn(3, 3)
    for cache in (None, KernelMapCache()):
        conv = SparseConv3d(3, 4, kernel_size=3, backend="torch", **({} if cache is None else {"cache": cache}))
        y, _ = conv(feats, coords)
        buffer = io.BytesIO()
        torch.save(conv, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for twin in (loaded, pickle.loads(pickle.dumps(conv)), copy.deepcopy(conv)):
            torch.testing.assert_close(twin(feats, coords)[0], y)
            assert (twin.cache is default_cache) == (cache is None)


def test_forward_mode_tangent_of_features_weight_and_bias():
    """Forward-mode AD: the convolution is bilinear in features and weight (its autograd
    Function has no jvp: torch raised); checked against finite differences."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(0)
    conv = SparseConv3d(3, 4, kernel_size=3, bias=True, backend="torch").double()
    coords = torch.tensor([[0, 0, 0], [0, 0, 1], [1, 0, 1], [2, 2, 2]])
    f, vf = (torch.randn(4, 3, dtype=torch.float64, generator=gen) for _ in range(2))
    vw, vb = torch.randn_like(conv.weight), torch.randn_like(conv.bias)
    w, b = conv.weight.detach().clone(), conv.bias.detach().clone()
    km = conv.kernel_map(coords)
    h = 1e-6
    want = (sparse_conv3d(f + h * vf, w + h * vw, km, b + h * vb) - sparse_conv3d(f - h * vf, w - h * vw, km, b - h * vb)) / (2 * h)
    with fwAD.dual_level():
        y = sparse_conv3d(fwAD.make_dual(f, vf), fwAD.make_dual(w, vw), km, fwAD.make_dual(b, vb))
        primal, tangent = fwAD.unpack_dual(y)
        with torch.no_grad():  # (the module's weight requires grad: with gradients recorded its Function runs)
            module_tangent = fwAD.unpack_dual(conv(fwAD.make_dual(f, vf), coords)[0]).tangent
    torch.testing.assert_close(primal, sparse_conv3d(f, w, km, b))
    torch.testing.assert_close(tangent, want, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(module_tangent, (conv(f + h * vf, coords)[0] - conv(f - h * vf, coords)[0]) / (2 * h),
                                   rtol=1e-6, atol=1e-6)
