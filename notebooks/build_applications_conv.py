"""The point-cloud part of notebooks/applications.ipynb: sparse convolution with insum.

    python notebooks/build_applications_conv.py --run            # run the cells as a script

`CELLS` holds the cells in the percent format (`# %%` a code cell, `# %% [markdown]` a
markdown cell whose lines are comments); `cells()` returns them as (kind, source) pairs for
the builder that combines the notebook's parts. They show, on the CPU: a voxelised scene and
its kernel map as pictures, the tiled and grouped-pairs packings, the statements and one
generated kernel (`insum.explain`), a check against a dense `conv3d`, and the H200 speed read
from `benchmarks/results/h200/conv.json` (never measured here).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from nbcells import parse_cells

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CELLS = r'''
# %% [markdown]
# ## Point clouds: `insum.nn.SparseConv3d`
#
# A sparse 3-D convolution over voxel coordinates is one indirect Einsum per pass. The
# *kernel map* `nbr[v, w]` says which input voxel output voxel `v` reads at kernel offset
# `w` (-1: none). It is built on the coordinates' device with no loop over points: each
# voxel becomes an int64 key, the input keys are sorted once, and every (output, offset)
# query is one `torch.searchsorted`. The map is then packed into the tensors of two
# statements:
#
# | pass | statement |
# |---|---|
# | forward, tiles (output-stationary, no atomics) | `O[t, m, co] = X[NB[t, m, j], ci] * W[TW[t, j], ci, co]` |
# | forward, grouped pairs (fp32 atomics) | `O[PO[p, q], co] += X[PI[p, q], ci] * W[PW[p], ci, co]` |
# | input gradient | the tiled statement on the transposed map, `W` transposed per offset |
# | weight gradient | `dWp[p, ci, co] = X[PI[p, q], ci] * dO[PO[p, q], co]`, summed per offset |
#
# In the tiled form, output rows are sorted by their neighbour mask and cut into tiles of
# 128 rows; each tile lists only the offsets one of its rows needs (`TW`), and tiles with
# similar counts share one launch (a *bucket*, padded to its widest tile). `X` gets one
# zero row that absent neighbours read.

# %%
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "insum" / "__init__.py").exists()), Path.cwd())
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import insum  # noqa: E402
from insum.nn import SparseConv3d, build_kernel_map  # noqa: E402
from insum.nn.conv import TILED, sparse_conv3d  # noqa: E402
from insum.nn.kernel_map import pair_groups, tile_map  # noqa: E402

torch.manual_seed(0)


def slab_scene(side=24):
    """A small room corner: floor, two walls and a ball, voxelised at unit size."""
    g = torch.arange(side)
    a, b = torch.meshgrid(g, g, indexing="ij")
    a, b = a.flatten(), b.flatten()
    floor = torch.stack([a, b, torch.zeros_like(a)], 1)
    wall_x = torch.stack([torch.zeros_like(a), a, b // 2], 1)
    wall_y = torch.stack([a, torch.zeros_like(a), b // 2], 1)
    d = torch.randn(3000, 3)
    ball = (torch.tensor([14.0, 14.0, 6.0]) + 5 * d / d.norm(dim=1, keepdim=True)).round().long()
    return torch.unique(torch.cat([floor, wall_x, wall_y, ball]), dim=0)


coords = slab_scene()
km = build_kernel_map(coords, kernel_size=3)
print(f"{coords.shape[0]} voxels, {km.pairs} (input, output, offset) pairs: "
      f"{km.pairs / coords.shape[0]:.1f} of 27 neighbours per voxel")

# %%
fig = plt.figure(figsize=(13, 4.2))
ax = fig.add_subplot(1, 3, 1, projection="3d")
count = (km.nbr >= 0).sum(1)
ax.scatter(*coords.t(), c=count, s=3, cmap="viridis")
ax.set_title("voxels, coloured by neighbour count")
ax = fig.add_subplot(1, 3, 2)
ax.imshow((km.nbr[:400] >= 0).numpy(), aspect="auto", interpolation="nearest", cmap="Greys")
ax.set_xlabel("offset w (dx, dy, dz), z fastest")
ax.set_ylabel("output voxel v (first 400)")
ax.set_title("kernel map nbr[v, w] >= 0")
ax = fig.add_subplot(1, 3, 3)
ax.hist(count.numpy(), bins=range(1, 29), color="tab:blue")
ax.set_xlabel("neighbours of a voxel")
ax.set_title("real pairs per output row")
plt.tight_layout()
plt.show()

# %% [markdown]
# The tiled packing: rows sorted by their neighbour mask (identical masks become
# neighbours), cut in tiles; per tile the offsets some row needs (dark) and the padding its
# bucket adds (light). Real pairs over the computed slots is the packing's efficiency.

# %%
tiled = tile_map(km.nbr, km.n_in, tile=32)
fig, axes = plt.subplots(1, 2, figsize=(13, 4))
need = torch.zeros(tiled.n_tiles, 27)
for start, end, nb, tw in tiled.buckets:
    for t in range(end - start):
        active = (nb[t] < km.n_in).any(0)
        need[start + t, tw[t].long()] = torch.where(active, 2.0, 1.0)
axes[0].imshow(need.t().numpy(), aspect="auto", interpolation="nearest", cmap="Blues")
for start, end, *_ in tiled.buckets:
    axes[0].axvline(start - 0.5, color="tab:red", lw=0.8)
axes[0].set_xlabel("tile (sorted by offset count); red lines: bucket starts")
axes[0].set_ylabel("offset")
axes[0].set_title(f"TW per tile: computed slots / real pairs = {tiled.padded_pairs / tiled.real_pairs:.2f}")
ratios = []
for tile in (16, 32, 64, 128):
    for buckets in (1, 2, 4, 6):
        t = tile_map(km.nbr, km.n_in, tile=tile, max_buckets=buckets)
        ratios.append((tile, buckets, t.padded_pairs / t.real_pairs))
for tile in (16, 32, 64, 128):
    xs = [b for t, b, _ in ratios if t == tile]
    axes[1].plot(xs, [r for t, _, r in ratios if t == tile], "o-", label=f"{tile} rows per tile")
axes[1].set_xlabel("buckets (launches)")
axes[1].set_ylabel("computed slots / real pairs")
axes[1].set_title("padding of the tiled form")
axes[1].legend()
plt.tight_layout()
plt.show()
groups = pair_groups(km.nbr, km.n_in, group=256)
print(f"grouped pairs: {groups.PI.shape[0]} groups of {groups.group}, "
      f"{(groups.PI < km.n_in).float().mean():.0%} of the slots real")

# %% [markdown]
# The tiled statement as the code generator sees it: a `tl.dot` plan with the tile's rows
# on M, the output channels on N, the input channels on K, the tile on the grid and the
# tile's offsets as the outer loop; plain stores (each output row has one owner).

# %%
nb, tw = tiled.buckets[-1][2], tiled.buckets[-1][3]
x0 = torch.randn(km.n_in + 1, 16, dtype=torch.float16)
w = torch.randn(27, 16, 32, dtype=torch.float16)
out = torch.empty(nb.shape[0], nb.shape[1], 32, dtype=torch.float16)
plan = insum.explain(TILED, O=out, X=x0, NB=nb, TW=tw, W=w).split("source:")[0]
print("\n".join(line for line in plan.splitlines() if not line.startswith("ir:")))

# %% [markdown]
# The layer against a dense `torch.nn.functional.conv3d` on the voxel grid, read at the
# active sites (the generated kernels run in the Triton interpreter here):

# %%
conv = SparseConv3d(16, 32, kernel_size=3, tile=32, form="tiles")
feats = torch.randn(coords.shape[0], 16)
y, _ = conv(feats, coords)
grid = torch.zeros(1, 16, *(coords.max(0).values + 3).tolist())
grid[0, :, coords[:, 0] + 1, coords[:, 1] + 1, coords[:, 2] + 1] = feats.t()
dense = F.conv3d(grid, conv.weight.detach().permute(4, 3, 0, 1, 2), padding=1)
want = dense[0][:, coords[:, 0] + 1, coords[:, 1] + 1, coords[:, 2] + 1].t()
print(f"relative error against dense conv3d: {((y - want).norm() / want.norm()).item():.1e}")

# %% [markdown]
# ### Speed on the H200
#
# `python -m benchmarks.study_conv` on voxelised rooms (floor, walls, furniture, balls,
# ramps) of 146k and 1.2M voxels, fp16, submanifold 3x3x3, in = out channels, against
# spconv-triton 1.0 (its `SubMConv3d` with cached indices, as a user calls it) and the
# torch gather-mm-index_add loop. TFLOP/s count 2 * in * out per real pair.

# %%
path = ROOT / "benchmarks" / "results" / "h200" / "conv.json"
if not path.exists():
    print(f"no results at {path}: run python -m benchmarks.study_conv on the GPU")
else:
    rows = json.loads(path.read_text())
    print(f"{'voxels':>8} {'C':>4} {'insum fwd':>10} {'spconv':>8} {'x':>5} {'TF/s':>6} | "
          f"{'fwd+bwd':>8} {'spconv':>8} {'x':>5} | {'loop fwd':>8} {'stmt only':>9}")
    for r in rows:
        print(f"{r['voxels']:>8} {r['channels']:>4} {r[r['best_fwd'] + '_fwd_ms']:>10.3f} "
              f"{r.get('spconv_fwd_ms', float('nan')):>8.3f} {r.get('speedup_fwd', float('nan')):>5.2f} "
              f"{r['best_fwd_tflops']:>6.1f} | {r['best_fwdbwd_ms']:>8.3f} {r.get('spconv_fwdbwd_ms', float('nan')):>8.3f} "
              f"{r.get('speedup_fwdbwd', float('nan')):>5.2f} | {r['loop_fwd_ms']:>8.3f} {r['tiles128_kernels_ms']:>9.3f}")
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), sharey=True)
    for ax, key, title in ((axes[0], "speedup_fwd", "forward"), (axes[1], "speedup_fwdbwd", "forward + backward")):
        for i, n in enumerate(sorted({r["voxels"] for r in rows})):
            sub = sorted((r for r in rows if r["voxels"] == n), key=lambda r: r["channels"])
            xs = [j + 0.38 * i for j in range(len(sub))]
            ax.bar(xs, [r.get(key, 0) for r in sub], width=0.36, label=f"{n / 1e3:.0f}k voxels")
            ax.set_xticks([j + 0.19 for j in range(len(sub))], [f"C={r['channels']}" for r in sub])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.5 if key == "speedup_fwd" else 1.2, color="tab:red", lw=0.8, ls="--", label="target")
        ax.set_title(f"{title}: spconv-triton time / insum time")
        ax.legend()
    plt.tight_layout()
    plt.show()
'''


def cells() -> list[tuple[str, str]]:
    """(kind, source) for every cell of CELLS, kind "markdown" or "code"."""
    return [(kind, source) for kind, _, source in parse_cells(CELLS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run the code cells as one script (figures not shown)")
    args = parser.parse_args(argv)
    if args.run:
        os.environ.setdefault("MPLBACKEND", "Agg")
        os.chdir(ROOT)
        exec(compile("\n\n".join(src for kind, src in cells() if kind == "code"), "applications_conv", "exec"), {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
