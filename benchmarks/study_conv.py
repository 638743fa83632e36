"""Sparse 3-D convolution on voxelised indoor scenes: insum.nn.SparseConv3d against the torch
gather-mm-index_add loop and spconv-triton (when importable), fp16, submanifold 3x3x3.

    python -m benchmarks.study_conv [--sizes 120000,1000000] [--channels 32,64,128] [--parts maps,conv] [--out DIR]
    python -m benchmarks.study_conv --sizes 3000 --channels 8 --parts maps,conv   # CPU smoke (torch backend)

Scenes are rooms (floor, ceiling, walls), boxes (furniture), spheres and slanted planes,
sampled densely on their surfaces and voxelised at unit size: surface-like sets whose
voxels have about 9-14 neighbours of 27. Every form is checked against the float32 loop
(relative error); TFLOP/s count 2 * in * out flops per real (input, output, offset) pair,
three times that for forward+backward. The kernel-map part (`maps`, DIR/conv_maps.json) times
insum's build (hash table, tiling; plus the transposed tiling and pair groups for training;
also with the sorted-keys lookup and with torch ops) against spconv-triton's own builder on the same scenes,
`ops.get_indice_pairs_implicit_gemm` (what its SubMConv3d calls on a tensor without cached
indices), for inference and for training. Rows go to DIR/conv.json as they finish. On a
CPU the study runs with the torch backend and wall-clock medians (no spconv-triton).
`CONV_ANCHOR=spconv` puts spconv 2.x (its CUDA wheels) in spconv-triton's place, same API.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

import insum.nn.conv as conv_module
import insum.nn.kernel_map as kernel_map_module
from benchmarks.common import cpu_median_ms, relative_error, shorten_autotune
from benchmarks.common import median_ms as _gpu_median_ms
from insum import insum
from insum.nn.conv import TILED, sparse_conv3d
from insum.nn.kernel_map import build_kernel_map

BUDGET_S = float(os.environ.get("CONV_BUDGET_S", "300"))


def median_ms(fn) -> float:
    """do_bench's median on a GPU, the host's wall-clock median on a CPU (smoke runs)."""
    return _gpu_median_ms(fn) if torch.cuda.is_available() else cpu_median_ms(fn)


# --------------------------------------------------------------------------- scenes


def _parallelogram(origin, a, b, density, gen, device):
    area = torch.linalg.cross(a, b).norm().item()
    n = max(1, int(area * density))
    uv = torch.rand(n, 2, generator=gen, device=device)
    return origin + uv[:, :1] * a + uv[:, 1:] * b


def _box_faces(lo, hi, density, gen, device, floor=True):
    size = hi - lo
    ex, ey, ez = (torch.diag(size)[i] for i in range(3))
    faces = [(lo, ex, ey), (lo + ez, ex, ey), (lo, ex, ez), (lo + ey, ex, ez), (lo, ey, ez), (lo + ex, ey, ez)]
    if not floor:
        faces = faces[1:]
    return [_parallelogram(o, a, b, density, gen, device) for o, a, b in faces]


def room_scene(target: int, seed: int, device) -> torch.Tensor:
    """int32 [N, 4] voxel coordinates (batch 0) of a furnished room of about `target` voxels."""
    gen = torch.Generator(device=device).manual_seed(seed)
    side = math.sqrt(target / 3.4)
    height = side / 3
    density = 4.0
    lo = torch.zeros(3, device=device)
    hi = torch.tensor([side, side, height], device=device)
    parts = _box_faces(lo, hi, density, gen, device)
    for _ in range(12):  # furniture
        size = torch.rand(3, generator=gen, device=device) * torch.tensor([side / 6, side / 6, height / 2], device=device) + 2
        corner = torch.rand(3, generator=gen, device=device) * (hi - size)
        corner[2] = 0
        parts += _box_faces(corner, corner + size, density, gen, device, floor=False)
    for _ in range(6):  # spheres
        radius = float(torch.rand(1, generator=gen, device=device)) * height / 4 + 2
        centre = torch.rand(3, generator=gen, device=device) * (hi - 2 * radius) + radius
        n = int(4 * math.pi * radius**2 * density)
        d = torch.randn(n, 3, generator=gen, device=device)
        parts.append(centre + radius * d / d.norm(dim=1, keepdim=True))
    for _ in range(4):  # slanted planes (ramps, open doors)
        origin = torch.rand(3, generator=gen, device=device) * hi * 0.5
        a = torch.randn(3, generator=gen, device=device) * side / 6
        b = torch.randn(3, generator=gen, device=device) * side / 6
        pts = _parallelogram(origin, a, b, density, gen, device)
        parts.append(pts[((pts >= 0) & (pts < hi)).all(1)])
    vox = torch.cat(parts).floor().long().clamp_min(0)
    vox = torch.unique(vox, dim=0)
    return torch.cat([torch.zeros_like(vox[:, :1]), vox], 1).int()


# --------------------------------------------------------------------------- anchors


def torch_loop(feats, weight, pairs_in, pairs_out):
    """The gather-mm-index_add loop over the 27 offsets."""
    out = feats.new_zeros(feats.shape[0], weight.shape[-1])
    for w, (i, o) in enumerate(zip(pairs_in, pairs_out)):
        if i.numel():
            out = out.index_add(0, o, feats[i] @ weight[w])
    return out


def _pairs_per_offset(km):
    nbr = km.nbr.long()
    ins, outs = [], []
    for w in range(nbr.shape[1]):
        o = (nbr[:, w] >= 0).nonzero().flatten()
        ins.append(nbr[o, w])
        outs.append(o)
    return ins, outs


#: The anchor's package: spconv-triton (default) or spconv 2.x (`CONV_ANCHOR=spconv`, the CUDA
#: wheels spconv-cu12x with cumm-cu12x); both keep spconv 2.x's `pytorch` API.
ANCHOR = os.environ.get("CONV_ANCHOR", "spconv_triton")


def _spconv():
    try:
        spconv = importlib.import_module(f"{ANCHOR}.pytorch")
    except Exception as e:  # noqa: BLE001 - report why the anchor is missing
        return None, f"{type(e).__name__}: {e}"
    return spconv, None


# --------------------------------------------------------------------------- the study


def gpu_checks(device, size: int = 6000) -> list[dict]:
    """The generated kernels against the torch lowering (float64) on a small scene: every
    mode and form, fp32/fp16/bf16, forward and both gradients."""
    from insum.nn import SparseConv3d

    coords = room_scene(size, seed=7, device=device)[:, 1:] + 4
    rows = []
    cases = (("subm", 3, 1, "tiles"), ("subm", 3, 1, "pairs"), ("subm", 5, 1, "tiles"),
             ("strided", 2, 2, "tiles"), ("strided", 3, 2, "pairs"), ("transposed", 2, 2, "tiles"))
    tuning = os.environ.get("INSUM_AUTOTUNE")
    os.environ["INSUM_AUTOTUNE"] = "0"  # correctness only: one configuration per kernel
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for mode, k, s, form in cases if dtype == torch.float32 else cases[:2] + cases[-1:]:
            down = SparseConv3d(8, 8, 2, stride=2, subm=False).to(device)
            coarse = down(torch.randn(coords.shape[0], 8, device=device), coords)[1]
            kw = dict(subm=mode == "subm", transposed=mode == "transposed", stride=s, form=form)
            conv = SparseConv3d(24, 40, k, bias=True, **kw).to(device)
            src, dst = (coarse, coords) if mode == "transposed" else (coords, None)
            x = torch.randn(src.shape[0], 24, device=device).to(dtype).float()
            results = {}
            for backend, dt in (("triton", dtype), ("torch", torch.float64)):
                conv.backend = backend
                c = conv.to(dt)
                xg = x.to(dt).clone().requires_grad_()
                y, _ = c(xg, src, dst)
                g = torch.ones_like(y) + torch.arange(y.shape[1], device=device, dtype=dt) / y.shape[1]
                y.backward(g)
                results[backend] = (y.double(), xg.grad.double(), c.weight.grad.double())
                c.weight.grad = None
            errs = [relative_error(a, b) for a, b in zip(results["triton"], results["torch"])]
            rows.append({"check": f"{mode} k{k} s{s} {form} {str(dtype)[6:]}", "y": errs[0], "dx": errs[1], "dw": errs[2]})
            print(json.dumps(rows[-1]), flush=True)
    if tuning is None:
        del os.environ["INSUM_AUTOTUNE"]
    else:
        os.environ["INSUM_AUTOTUNE"] = tuning
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="120000,1000000")
    parser.add_argument("--channels", default="32,64,128")
    parser.add_argument("--parts", default="maps,conv", help="maps: kernel-map build times; conv: the layer")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    undo = shorten_autotune()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    spconv, why = _spconv()
    rows = []
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, {ANCHOR}: {why or 'ok'}", flush=True)

    def add(row):
        rows.append(row)
        (out_dir / "conv.json").write_text(json.dumps(rows, indent=1))
        print(json.dumps(row), flush=True)

    scenes = []
    map_rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        coords = room_scene(size, seed=size, device=device)
        km = build_kernel_map(coords)
        maps = _map_times(coords) if "maps" in parts else {}
        if "maps" in parts:
            map_rows.append({"voxels": coords.shape[0], "pairs": km.pairs, **maps, **_spconv_map_times(spconv, coords)})
            (out_dir / "conv_maps.json").write_text(json.dumps(map_rows, indent=1))
            print(json.dumps(map_rows[-1]), flush=True)
        scenes.append((coords, km, _pairs_per_offset(km), maps))
    _map_table(map_rows)
    # Widest channels first: the point the issue found worst.
    for c in sorted((int(s) for s in args.channels.split(",")), reverse=True) if "conv" in parts else ():
        for coords, km, (ins, outs), maps in scenes:
            if time.perf_counter() - started > BUDGET_S:
                print(f"budget spent: skipping N={coords.shape[0]} C={c}", flush=True)
                continue
            try:
                add({**maps, **_case(km, coords, ins, outs, c, spconv)})
            except Exception:  # noqa: BLE001 - one failed case must not lose the others
                traceback.print_exc()
    if rows:
        _table(rows)
    if "conv" in parts and device.type == "cuda" and time.perf_counter() - started < BUDGET_S + 30:
        checks = gpu_checks(device)
        (out_dir / "conv_checks.json").write_text(json.dumps(checks, indent=1))
    undo()
    return 0


def _map_times(coords) -> dict:
    """insum's kernel map: for inference (map + tiles, one-launch packing) and for training
    (+ the transposed map's, pair groups); the build alone; the same with the sorted-keys
    lookup kernel in place of the hash table (INSUM_MAP_HASH=0, `kernel_map._hashing`) and
    with the build's torch ops in place of its Triton kernels (`kernel_map._use_kernels`),
    and whether all give the same map and tiles."""
    def build_train():
        km = build_kernel_map(coords)
        km.tiles_whole(128), km.transpose().tiles_whole(128), km.pair_groups()

    # tiles_whole: the one-launch packing the layer reads on a GPU
    times = {"map_fwd_ms": median_ms(lambda: build_kernel_map(coords).tiles_whole(128)),
             "map_train_ms": median_ms(build_train), "map_build_ms": median_ms(lambda: build_kernel_map(coords))}
    if coords.is_cuda:
        def packed(km):  # the map, its tiles, the tiles' output rows, the pair groups
            groups = km.pair_groups()
            return [km.nbr, *km.tiles_whole(128), km.tiles(128).output_rows(), groups.PI, groups.PO, groups.PW]

        fast = packed(build_kernel_map(coords))
        for name, switch, choice in (("sorted", "_hashing", lambda: False), ("torch_ops", "_use_kernels", lambda device: False)):
            chosen = getattr(kernel_map_module, switch)
            setattr(kernel_map_module, switch, choice)
            try:
                times[f"map_fwd_{name}_ms"] = median_ms(lambda: build_kernel_map(coords).tiles_whole(128))
                times[f"map_build_{name}_ms"] = median_ms(lambda: build_kernel_map(coords))
                other = packed(build_kernel_map(coords))
                times[f"map_equal_{name}"] = all(torch.equal(a, b) for a, b in zip(fast, other, strict=True))
            finally:
                setattr(kernel_map_module, switch, chosen)
    return times


def _spconv_map_times(spconv, coords) -> dict:
    """spconv-triton's kernel-map build for a submanifold 3x3x3 layer, inference and training
    (what its SubMConv3d runs when the input tensor has no cached indices)."""
    if spconv is None:
        return {}
    ops = importlib.import_module(f"{ANCHOR}.pytorch.ops")

    shape = (coords[:, 1:].max(0).values + 1).tolist()
    algo = spconv.SubMConv3d(8, 8, 3, bias=False).algo

    def build(train: bool):
        return ops.get_indice_pairs_implicit_gemm(coords, 1, shape, algo, ksize=[3, 3, 3], stride=[1, 1, 1],
                                                  padding=[1, 1, 1], dilation=[1, 1, 1], out_padding=[0, 0, 0],
                                                  subm=True, is_train=train)

    try:
        return {"spconv_map_fwd_ms": median_ms(lambda: build(False)), "spconv_map_train_ms": median_ms(lambda: build(True))}
    except Exception as e:  # noqa: BLE001 - keep insum's numbers when the anchor fails
        return {"spconv_map_error": f"{type(e).__name__}: {str(e)[:300]}"}


def _map_table(rows) -> None:
    if not rows:
        return
    print("\nkernel-map build, ms (median): insum (map + tiles | + transposed tiles, pair groups | the build alone) vs "
          "spconv-triton (get_indice_pairs_implicit_gemm, inference | training); insum's map + tiles | build with the "
          "sorted-keys lookup (INSUM_MAP_HASH=0) and with torch ops")
    for r in rows:
        def f(key, r=r):
            v = r.get(key)
            return f"{v:8.3f}" if isinstance(v, (int, float)) else f"{'-':>8}"

        ratio = r["spconv_map_fwd_ms"] / r["map_fwd_ms"] if "spconv_map_fwd_ms" in r else None
        print(f"{r['voxels']:>8} voxels | insum {f('map_fwd_ms')} {f('map_train_ms')} {f('map_build_ms')}"
              f" | spconv-triton {f('spconv_map_fwd_ms')} {f('spconv_map_train_ms')}"
              f" | spconv/insum inference {ratio if ratio is None else f'{ratio:.2f}x'}"
              f" | sorted-keys lookup {f('map_fwd_sorted_ms')} {f('map_build_sorted_ms')}"
              f" (same map: {r.get('map_equal_sorted', '-')})"
              f" | torch ops for the kernels {f('map_fwd_torch_ops_ms')} {f('map_build_torch_ops_ms')}"
              f" (same map: {r.get('map_equal_torch_ops', '-')})")


def _case(km, coords, ins, outs, c, spconv) -> dict:
    """One scene and channel count: every form, the loop and spconv-triton."""
    device, n, pairs = coords.device, coords.shape[0], km.pairs
    gen = torch.Generator(device=device).manual_seed(c)
    x32 = torch.randn(n, c, device=device, generator=gen)
    w32 = torch.randn(3, 3, 3, c, c, device=device, generator=gen) / math.sqrt(27 * c)
    x, w = x32.half(), w32.half()
    ref = torch_loop(x32, w32.reshape(27, c, c), ins, outs)
    flops = 2 * pairs * c * c
    row = {"voxels": n, "pairs": pairs, "pairs_per_voxel": pairs / n, "channels": c}
    # absent="mask" (no zero-row copy; a 0/1 factor in the statement) beside the default
    for form, tile, absent in (("tiles", 128, "zero_row"), ("tiles", 64, "zero_row"), ("pairs", 128, "zero_row"),
                               ("tiles", 128, "mask"), ("pairs", 128, "mask")):
        got = sparse_conv3d(x, w, km, form=form, tile=tile, absent=absent)
        name = f"{form}{tile}" + ("_mask" if absent == "mask" else "")
        row[f"{name}_err"] = relative_error(got.float(), ref)
        row[f"{name}_fwd_ms"] = median_ms(
            lambda form=form, tile=tile, absent=absent: sparse_conv3d(x, w, km, form=form, tile=tile, absent=absent))
        if form == "tiles":
            t = km.tiles(tile)
            row[f"{name}_padding"] = t.padded_pairs / max(1, t.real_pairs)
            row[f"{name}_buckets"] = [b[2].shape[2] for b in t.buckets]
    # The tiled statement alone (no zero-row copy, no reordering gather): kernel efficiency.
    tiled, w3 = km.tiles(128), w.reshape(27, c, c)
    x0 = torch.cat([x, x.new_zeros(1, c)])
    y = x.new_empty(tiled.n_tiles, tiled.tile, c)

    def kernels_only():
        for start, end, nb, tw in tiled.buckets:
            insum(TILED, O=y[start:end], X=x0, NB=nb, TW=tw, W=w3, check_indices=False)

    row["tiles128_kernels_ms"] = median_ms(kernels_only)
    NB, TW, TL = km.tiles_whole(128)
    row["tiles128_one_kernel_ms"] = median_ms(
        lambda: insum(TILED, O=y, X=x0, NB=NB, TW=TW, W=w3, lengths={"j[t]": TL}, check_indices=False))
    row["tiles128_kernels_padded_tflops"] = 2 * tiled.padded_pairs * c * c / row["tiles128_kernels_ms"] * 1e-9
    row["loop_fwd_ms"] = median_ms(lambda: torch_loop(x, w.reshape(27, c, c), ins, outs))
    for form in ("tiles128", "pairs128"):
        row[f"{form}_mask_speedup"] = row[f"{form}_fwd_ms"] / row[f"{form}_mask_fwd_ms"]
    # The tiles as one launch with declared lengths (the default) against one launch per bucket.
    conv_module.TILES_IN_ONE_LAUNCH = False
    try:
        row["tiles128_buckets_fwd_ms"] = median_ms(lambda: sparse_conv3d(x, w, km, form="tiles", tile=128))
    finally:
        conv_module.TILES_IN_ONE_LAUNCH = True
    row["tiles128_one_launch_speedup"] = row["tiles128_buckets_fwd_ms"] / row["tiles128_fwd_ms"]
    best = min(("tiles128", "tiles64", "pairs128"), key=lambda f: row[f"{f}_fwd_ms"])
    row["best_fwd"] = best
    row["best_fwd_tflops"] = flops / row[f"{best}_fwd_ms"] * 1e-9

    # forward + backward (tiled forward and input gradient, grouped-pairs weight gradient)
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    g = torch.randn(n, c, device=device, dtype=torch.float16, generator=gen)
    for tile, absent in ((128, "zero_row"), (64, "zero_row"), (128, "mask")):
        def step(tile=tile, absent=absent):
            xg.grad = wg.grad = None
            sparse_conv3d(xg, wg, km, tile=tile, absent=absent).backward(g)

        step()
        if absent == "mask":
            row["tiles128_mask_fwdbwd_ms"] = median_ms(step)
            continue
        if tile == 128:
            x32g, w32g = x32.clone().requires_grad_(), w32.clone().requires_grad_()
            torch_loop(x32g, w32g.reshape(27, c, c), ins, outs).backward(g.float())
            row["grad_x_err"] = relative_error(xg.grad.float(), x32g.grad)
            row["grad_w_err"] = relative_error(wg.grad.float(), w32g.grad)
        row[f"tiles{tile}_fwdbwd_ms"] = median_ms(step)

    def loop_step():
        xg.grad = wg.grad = None
        torch_loop(xg, wg.reshape(27, c, c), ins, outs).backward(g)

    row["loop_fwdbwd_ms"] = median_ms(loop_step)
    row["best_fwdbwd_ms"] = min(row["tiles128_fwdbwd_ms"], row["tiles64_fwdbwd_ms"])
    row["best_fwdbwd_tflops"] = 3 * flops / row["best_fwdbwd_ms"] * 1e-9
    if spconv is not None:
        try:
            _spconv_row(spconv, row, coords, x, w, g, ref, n, c, flops)
        except Exception as e:  # noqa: BLE001 - keep insum's numbers when the anchor fails
            row["spconv_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def _spconv_row(spconv, row, coords, x, w, g, ref, n, c, flops):
    shape = (coords[:, 1:].max(0).values + 1).tolist()
    conv = spconv.SubMConv3d(c, c, 3, bias=False, indice_key="subm0").cuda().half()
    # spconv 2.x keeps [out, k, k, k, in]; ours is [k, k, k, in, out].
    with torch.no_grad():
        if tuple(conv.weight.shape) == (c, 3, 3, 3, c):
            conv.weight.copy_(w.permute(4, 0, 1, 2, 3))
        else:
            row["spconv_weight_shape"] = list(conv.weight.shape)
    st = spconv.SparseConvTensor(x, coords, shape, 1)
    got = conv(st).features
    row["spconv_err"] = relative_error(got.float(), ref)
    if row["spconv_err"] > 0.05:  # the other kernel orientation?
        with torch.no_grad():
            conv.weight.copy_(w.flip(0, 1, 2).permute(4, 0, 1, 2, 3))
        row["spconv_err_flipped"] = relative_error(conv(st).features.float(), ref)
    row["spconv_fwd_ms"] = median_ms(lambda: conv(st))
    row["spconv_map_ms"] = median_ms(lambda: conv(spconv.SparseConvTensor(x, coords, shape, 1))) - row["spconv_fwd_ms"]
    xg = x.clone().requires_grad_()
    stg = spconv.SparseConvTensor(xg, coords, shape, 1)
    stg.indice_dict = st.indice_dict

    def step():
        xg.grad = None
        conv.weight.grad = None
        conv(stg).features.backward(g)

    step()
    row["spconv_fwdbwd_ms"] = median_ms(step)
    row["speedup_fwd"] = row["spconv_fwd_ms"] / row[f"{row['best_fwd']}_fwd_ms"]
    row["speedup_fwdbwd"] = row["spconv_fwdbwd_ms"] / row["best_fwdbwd_ms"]
    row["spconv_fwd_tflops"] = flops / row["spconv_fwd_ms"] * 1e-9


def _table(rows):
    head = (f"{'voxels':>8} {'p/v':>5} {'C':>4} | {'tiles128':>8} {'tiles64':>8} {'pairs':>8} {'loop':>8} {'spconv':>8}"
            f" | {'x spc':>6} {'TF/s':>6} | {'fb ins':>8} {'fb loop':>8} {'fb spc':>8} {'x spc':>6} | {'map':>6} {'map spc':>7}"
            f" | {'err':>7} {'pad':>5}")
    print("\nforward / forward+backward, ms (do_bench median), fp16 submanifold 3x3x3")
    print(head)
    for r in rows:
        def f(key, fmt="8.3f", r=r):
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else format("-", ">" + fmt.split(".")[0])

        print(f"{r['voxels']:>8} {r['pairs_per_voxel']:5.1f} {r['channels']:>4} | {f('tiles128_fwd_ms')} {f('tiles64_fwd_ms')}"
              f" {f('pairs128_fwd_ms')} {f('loop_fwd_ms')} {f('spconv_fwd_ms')} | {f('speedup_fwd', '6.2f')}"
              f" {f('best_fwd_tflops', '6.1f')} | {f('best_fwdbwd_ms')} {f('loop_fwdbwd_ms')} {f('spconv_fwdbwd_ms')}"
              f" {f('speedup_fwdbwd', '6.2f')} | {f('map_fwd_ms', '6.2f')} {f('spconv_map_ms', '7.2f')}"
              f" | {f('tiles128_err', '7.1e')} {f('tiles128_padding', '5.2f')}"
              f" | mask: fwd x {f('tiles128_mask_speedup', '5.2f')} (tiles) {f('pairs128_mask_speedup', '5.2f')} (pairs),"
              f" fb {f('tiles128_mask_fwdbwd_ms')} | one launch x {f('tiles128_one_launch_speedup', '5.2f')}"
              f" (kernels {f('tiles128_kernels_ms')} buckets, {f('tiles128_one_kernel_ms')} one)")


if __name__ == "__main__":
    sys.exit(main())
