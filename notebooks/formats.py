"""Source of notebooks/formats.ipynb, in the percent format (`# %%` starts a code cell,
`# %% [markdown]` a markdown cell whose lines are comments).

`python notebooks/build_formats.py` turns it into the notebook and executes it; the code
also runs as a plain script (`python notebooks/formats.py`), with figures left unshown.

Over 400 lines, as one file: it is one notebook's cells in reading order (a notebook is one
file), and every section draws with the helpers of the cells before it.
"""

# %% [markdown]
# # Sparse formats as pictures
#
# `insum.formats` packs a sparse matrix into plain dense index and value tensors plus
# one indirect Einsum that multiplies it with a dense matrix `B`. This notebook shows,
# on the CPU and on small matrices:
#
# 1. the matrices: a real pruned layer from the DLMC collection and a synthetic
#    power-law matrix;
# 2. every format as a picture (where the slots go, where the padding goes), and a
#    table of stored slots, padding and bytes;
# 3. the group-size trade-off of GroupCOO: gathers against scatters, and the rule
#    that picks the default;
# 4. the generated Triton kernels (`insum.explain`), run here in the Triton interpreter;
# 5. measured speed on the H200, read from `benchmarks/results/h200/*.json` when the
#    benchmark suite has written them.
#
# Regenerate with `python notebooks/build_formats.py` (see `notebooks/README.md`).

# %%
import importlib.util
import io
import json
import math
import os
import sys
import warnings
from pathlib import Path

# The generated kernels run in the Triton interpreter on the CPU: set before triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The repository root: above the working directory, else where insum is installed from.
ROOT = next(
    (p for p in (Path.cwd(), *Path.cwd().parents) if (p / "insum" / "__init__.py").exists()),
    None,
)
if ROOT is None:
    spec = importlib.util.find_spec("insum")
    ROOT = Path(spec.origin).parents[1] if spec and spec.origin else Path.cwd()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402
from PIL import Image as PILImage  # noqa: E402

import insum  # noqa: E402
from insum.arith import cdiv  # noqa: E402
from insum.formats import (  # noqa: E402
    CELL,
    COO,
    ELL,
    NM,
    BlockGroupCOO,
    GroupCOO,
    load_smtx,
    power_law_matrix,
)
from insum.formats.cell import cell_cost  # noqa: E402

try:
    from IPython import get_ipython
    from IPython.display import Image, Markdown, display
except ImportError:
    get_ipython = None
if get_ipython is None or get_ipython() is None:  # a plain script: print markdown as text

    def Markdown(text):  # noqa: N802
        return text

    def display(obj):
        print(obj)


warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


def show(fig):
    """Display a figure as a palette PNG (128 colours look the same and keep the notebook
    small); a plain script just closes it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    if get_ipython is not None and get_ipython() is not None:
        image = PILImage.open(buffer).convert("RGB").quantize(128, method=PILImage.Quantize.FASTOCTREE)
        packed = io.BytesIO()
        image.save(packed, format="png", optimize=True)
        display(Image(data=packed.getvalue(), format="png"))


torch.manual_seed(0)
plt.rcParams.update({"figure.dpi": 80, "font.size": 9})

# Slot maps: white = not stored, blues = real entries (alternating per group), red = padding.
SLOT_CMAP = ListedColormap(["white", "#3b6fb6", "#9cc0ea", "#d9453d"])
SLOT_LEGEND = [
    Patch(color="#3b6fb6", label="entry (even group)"),
    Patch(color="#9cc0ea", label="entry (odd group)"),
    Patch(color="#d9453d", label="padding"),
]
print(f"torch {torch.__version__}, insum {insum.__version__}, root {ROOT}")

# %% [markdown]
# ## 1. Two matrices
#
# **DLMC** (Deep Learning Matrix Collection): weights of a Transformer layer pruned to 98%
# by magnitude, 512 x 512. The `.smtx` files hold only the pattern; `load_smtx` draws the
# values from a standard normal with a fixed seed, so no stored value is exactly zero
# (the pictures below use `value == 0` to tell padding from entries).
#
# **Power law**: `power_law_matrix(512, 512, 8, alpha=1.0)`: row lengths follow a Zipf law,
# so a few rows are very long and most are short. That skew is what separates ELL, GroupCOO
# and CELL.

# %%
DLMC_FILE = (
    "transformer/magnitude_pruning/0.98/"
    "body_decoder_layer_1_self_attention_multihead_attention_q_fully_connected.smtx.gz"
)
dlmc_path = ROOT / ".data" / "dlmc" / DLMC_FILE
if dlmc_path.exists():
    A_dlmc = load_smtx(dlmc_path)
    dlmc_name = "DLMC transformer, 98% pruned, decoder layer 1 self-attention q"
else:
    # No DLMC copy (it lives in ../shared/data and is copied to .data/): a stand-in of the
    # same size and density, so that the rest of the notebook still runs.
    print(f"{dlmc_path} is absent: using power_law_matrix(512, 512, 10.24, alpha=0.5) instead")
    A_dlmc = power_law_matrix(512, 512, 10.24, alpha=0.5, seed=1)
    dlmc_name = "stand-in for DLMC (power law, alpha=0.5)"
A_pow = power_law_matrix(512, 512, 8.0, alpha=1.0, seed=0)
MATRICES = {"DLMC": A_dlmc, "power law": A_pow}
TITLES = {"DLMC": dlmc_name, "power law": "power_law_matrix(512, 512, 8, alpha=1)"}


def row_lengths(A):
    return A.crow_indices().diff().numpy()


fig, axes = plt.subplots(1, 4, figsize=(15, 3.6), gridspec_kw={"width_ratios": [1, 1.3, 1, 1.3]})
for (key, A), ax_spy, ax_hist in zip(MATRICES.items(), axes[0::2], axes[1::2]):
    dense = A.to_dense()
    lengths = row_lengths(A)
    ax_spy.spy(dense.numpy(), markersize=0.6, color="k")
    ax_spy.set_title(f"{key}: {tuple(A.shape)}, nnz {A._nnz()}", fontsize=9)
    ax_spy.tick_params(labelsize=7)
    ax_hist.hist(lengths, bins=40, color="#3b6fb6")
    ax_hist.set_yscale("log")
    ax_hist.set_xlabel("entries per row")
    ax_hist.set_ylabel("rows")
    ax_hist.set_title(
        f"row lengths: mean {lengths.mean():.1f}, max {lengths.max()}, "
        f"cv {lengths.std() / lengths.mean():.2f}",
        fontsize=9,
    )
fig.tight_layout()
show(fig)
print("DLMC matrix:", TITLES["DLMC"])

# %% [markdown]
# ## 2. Every format, as a picture
#
# ### Row-wise formats: COO, GroupCOO, ELL
#
# The three formats differ only in how many of a row's entries share one row index:
#
# | format | tensors | statement | one row index per |
# |---|---|---|---|
# | COO | `AM[nnz], AK[nnz], AV[nnz]` | `C[AM[p],n] += AV[p]*B[AK[p],n]` | entry (one scatter each) |
# | GroupCOO | `AM[G], AK[G,g], AV[G,g]` | `C[AM[p],n] += AV[p,q]*B[AK[p,q],n]` | group of g entries of one row |
# | ELL | `AK[M,W], AV[M,W]` | `C[m,n] += AV[m,q]*B[AK[m,q],n]` | row (W = longest row; plain stores) |
#
# The *slot maps* below draw, for the first 64 rows, every stored slot at its position in
# its row: a row of length n takes n slots in COO, ceil(n/g)*g in GroupCOO, and W in ELL.
# Padded slots (red) hold value 0 and re-use the group's first column, so they add nothing
# but are still gathered and multiplied.

# %%
def slot_map(group_rows, valid, rows):
    """Image (rows x slots) of groups laid out along their rows: 0 empty, 1/2 entry, 3 pad."""
    group_rows = np.asarray(group_rows, dtype=np.int64)
    valid = np.asarray(valid, dtype=bool)
    G, g = valid.shape
    first = np.searchsorted(group_rows, np.arange(rows))  # groups are ordered by row
    keep = group_rows < rows
    j = np.arange(G) - first[np.minimum(group_rows, rows - 1)]  # group number within its row
    width = int(((j[keep] + 1) * g).max()) if keep.any() else 1
    image = np.zeros((rows, width), dtype=np.int8)
    for p in np.flatnonzero(keep):
        r, start = group_rows[p], j[p] * g
        image[r, start : start + g] = np.where(valid[p], 1 + j[p] % 2, 3)
    return image


def row_slot_maps(A, rows=64, gs=None):
    """(title, image, fmt) for COO, GroupCOO at each g in gs (None: the rule), and ELL."""
    coo = COO.from_torch(A)
    out = [("COO", slot_map(coo.AM, np.ones((coo.nnz, 1)), rows), coo)]
    for g in gs or [None]:
        G = GroupCOO.from_torch(A, group_size=g)
        label = f"GroupCOO g={G.group_size}" + (" (default rule)" if g is None else "")
        out.append((label, slot_map(G.AM, G.AV != 0, rows), G))
    E = ELL.from_torch(A)
    out.append((f"ELL W={E.width}", slot_map(np.arange(A.shape[0]), E.AV != 0, rows), E))
    return out


def draw_slot_maps(maps, suptitle, xmax=None):
    fig, axes = plt.subplots(1, len(maps), figsize=(3.1 * len(maps), 3.6), sharey=True)
    xmax = xmax or max(image.shape[1] for _, image, _ in maps)
    for ax, (label, image, fmt) in zip(axes, maps):
        ax.imshow(image, cmap=SLOT_CMAP, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
        ax.set_xlim(-0.5, xmax - 0.5)
        ax.set_title(f"{label}\npadding {fmt.padding_ratio:.0%} of all slots", fontsize=9)
        ax.set_xlabel("slot within the row")
    axes[0].set_ylabel(f"row (first {maps[0][1].shape[0]})")
    fig.legend(handles=SLOT_LEGEND, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    show(fig)


maps = row_slot_maps(A_dlmc, gs=[None, 16])
draw_slot_maps(maps, f"{TITLES['DLMC']}: slots of the first 64 rows")
maps = row_slot_maps(A_pow, gs=[None, 16])
draw_slot_maps(maps, f"{TITLES['power law']}: slots of the first 64 rows", xmax=80)
print(
    "(power law: the x axis is cut at 80 slots; ELL pads every row to "
    f"W={maps[-1][2].width}, the longest row of the whole matrix)"
)

# %% [markdown]
# ### BlockGroupCOO and Block-ELL
#
# `BlockGroupCOO` stores dense bm x bk blocks (default 16 x 16, the smallest `tl.dot`
# tile) and groups g blocks of one block row under one block-row index:
# `C[AM[p],m,n] += AV[p,q,m,k]*B[AK[p,q],k,n]`, one `tl.dot` per block. With
# `group_size="row"` it becomes **Block-ELL**: one group per block row, as wide as the
# widest block row, no `AM`, and the kernel stores without atomics
# (`C[p,m,n] += ...`).
#
# Two kinds of padding: zeros *inside* stored blocks (the block fill), and whole padding
# blocks that complete a group. The picture uses a block-sparse matrix (256 x 256, 16 x 16
# blocks, power-law blocks per block row, 70% of each block filled) and, for contrast, the
# unstructured DLMC matrix, where nearly every block is stored and mostly empty.

# %%
def block_sparse_matrix(blocks=16, block=16, avg_blocks=4.0, alpha=0.6, fill=0.7, seed=1):
    """A dense matrix whose nonzero blocks follow a power law per block row."""
    mask = power_law_matrix(blocks, blocks, avg_blocks, alpha=alpha, seed=seed).to_dense() != 0
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(blocks * block, blocks * block, generator=gen)
    inside = torch.rand(values.shape, generator=gen) < fill
    grid = mask.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return values * (grid & inside)


A_blk = block_sparse_matrix()


def block_slots(fmt):
    """Block rows of each group and whether each block slot holds a real (nonzero) block."""
    G, g = fmt.AK.shape
    rows = fmt.AM.numpy() if "AM" in fmt.tensors else np.arange(G)
    real = fmt.AV.reshape(G, g, -1).ne(0).any(-1).numpy()
    fill = fmt.AV.reshape(G, g, -1).ne(0).float().mean(-1).numpy()
    return rows, real, fill


def draw_block_groups(ax, A, fmt, title):
    """The matrix with every stored block tinted by its group: light where the block holds
    a zero (padding inside the block), dark where it holds an entry."""
    (bm, bk), (Mp, Kp) = fmt.block, fmt.padded_shape
    rows, real, _ = block_slots(fmt)
    colours = plt.get_cmap("tab10")
    image = np.ones((Mp, Kp, 3))
    nonzero = np.zeros((Mp, Kp), dtype=bool)
    nonzero[: A.shape[0], : A.shape[1]] = (A != 0).numpy()
    for p, (br, ks) in enumerate(zip(rows, fmt.AK.numpy())):
        colour = np.array(colours(p % 10)[:3])
        for q, bc in enumerate(ks):
            if real[p, q]:
                tile = (slice(br * bm, br * bm + bm), slice(bc * bk, bc * bk + bk))
                image[tile] = np.where(nonzero[tile][..., None], colour * 0.8, 0.65 + 0.35 * colour)
    ax.imshow(image, interpolation="nearest")
    for edge in range(0, Mp + 1, bm):
        ax.axhline(edge - 0.5, color="#dddddd", lw=0.4)
    for edge in range(0, Kp + 1, bk):
        ax.axvline(edge - 0.5, color="#dddddd", lw=0.4)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)


def draw_block_slots(ax, fmt, title):
    rows, real, _ = block_slots(fmt)
    MB = fmt.padded_shape[0] // fmt.block[0]
    image = slot_map(rows, real, MB)
    ax.imshow(image, cmap=SLOT_CMAP, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("block slot within the block row")
    ax.set_ylabel("block row")


grouped = BlockGroupCOO.from_dense(A_blk, block=16)
block_ell = BlockGroupCOO.from_dense(A_blk, block=16, group_size="row")
fig, axes = plt.subplots(1, 4, figsize=(15, 3.9), gridspec_kw={"width_ratios": [1, 1, 0.8, 0.8]})
draw_block_groups(axes[0], A_blk, grouped,
                  f"BlockGroupCOO g={grouped.group_size}: {grouped.AK.shape[0]} groups")
draw_block_groups(axes[1], A_blk, block_ell,
                  f"Block-ELL: {block_ell.AK.shape[0]} block rows, width {block_ell.group_size}")
draw_block_slots(axes[2], grouped, f"grouped: {grouped.AK.numel()} block slots")
draw_block_slots(axes[3], block_ell, f"Block-ELL: {block_ell.AK.numel()} block slots")
fig.legend(handles=SLOT_LEGEND, loc="lower right", ncol=3, fontsize=8, frameon=False)
fig.suptitle("block-sparse 256 x 256, 16 x 16 blocks: colour = group (one scatter each; "
             "dark = entry, light = zero stored in the block)", fontsize=10)
fig.tight_layout(rect=(0, 0.05, 1, 1))
show(fig)

fig, axes = plt.subplots(1, 3, figsize=(13, 3.3))
for ax, (name, fmt) in zip(axes[:2], [("block-sparse", grouped), ("DLMC (unstructured)", BlockGroupCOO.from_torch(A_dlmc, block=16))]):
    _, real, fill = block_slots(fmt)
    ax.hist(fill[real], bins=np.linspace(0, 1, 33), color="#3b6fb6")
    ax.set_title(f"{name}: fill of the {int(real.sum())} stored blocks\n"
                 f"padding ratio {fmt.padding_ratio:.0%} (zeros in blocks + padding blocks)", fontsize=9)
    ax.set_xlabel("nonzero fraction of a 16 x 16 block")
    ax.set_ylabel("blocks")
gs_blk = [1, 2, 4, 8, 16]
blk_fmts = [BlockGroupCOO.from_dense(A_blk, block=16, group_size=g) for g in gs_blk] + [block_ell]
labels = [str(g) for g in gs_blk] + ["row"]
ax = axes[2]
ax.bar(np.arange(len(labels)) - 0.2, [f.AK.numel() for f in blk_fmts], 0.4, label="block slots (tl.dot tiles)", color="#3b6fb6")
ax.bar(np.arange(len(labels)) + 0.2, [f.AK.shape[0] for f in blk_fmts], 0.4, label="groups (scatters of a tile)", color="#e39b3c")
ax.set_xticks(np.arange(len(labels)), labels)
ax.set_xlabel(f"group_size (default rule: {grouped.group_size})")
ax.set_title("block-sparse: block slots vs groups", fontsize=9)
ax.legend(fontsize=8)
fig.tight_layout()
show(fig)

# %% [markdown]
# ### CELL (LiteForm's Composable Ellpack)
#
# CELL splits the columns into `partitions`; inside a partition each row's run of entries
# goes to the bucket of the next power-of-two width and is padded to it (Ellpack per
# bucket). Rows longer than the partition's maximum width are *folded* into several bucket
# rows of that width. The maximum width comes from LiteForm's cost model (eq. 7), scanned
# over the powers of two. Each bucket width is one statement
# `C[RI[r],n] += V[r,w]*B[CI[r,w],n]` (buckets of one width from all partitions share it).
#
# Left: every entry coloured by the width of the bucket it landed in (partition borders
# dashed). Middle: entries and padding per bucket width. Right: the cost model per
# partition against the maximum width, with the chosen width marked.

# %%
def draw_cell(A, partitions, title):
    fmt = CELL.from_torch(A, partitions=partitions)
    widths = fmt.widths
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(len(widths), 1)))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.0), gridspec_kw={"width_ratios": [1, 1.2, 1.2]})
    ax = axes[0]
    for colour, w in zip(colours, widths):
        CI, RI, V = fmt.tensors[f"CI_{w}"], fmt.tensors[f"RI_{w}"], fmt.tensors[f"V_{w}"]
        real = (V != 0).numpy()
        rows = RI.numpy()[:, None].repeat(w, 1)
        ax.scatter(CI.numpy()[real], rows[real], s=0.6, color=colour, label=f"W={w}")
    part_width = cdiv(A.shape[1], partitions)
    for p in range(1, partitions):
        ax.axvline(p * part_width - 0.5, color="k", ls="--", lw=0.8)
    ax.set_xlim(-0.5, A.shape[1] - 0.5)
    ax.set_ylim(A.shape[0] - 0.5, -0.5)
    ax.set_title(f"{title}: entries by bucket width", fontsize=9)
    ax.legend(markerscale=8, fontsize=7, loc="lower left", ncol=2)

    ax = axes[1]
    x = np.arange(len(widths))
    real_counts, pad_counts = [], []
    for w in widths:
        V = fmt.tensors[f"V_{w}"]
        real_counts.append(int((V != 0).sum()))
        pad_counts.append(V.numel() - real_counts[-1])
    ax.bar(x, real_counts, color="#3b6fb6", label="entries")
    ax.bar(x, pad_counts, bottom=real_counts, color="#d9453d", label="padding")
    for xi, w in zip(x, widths):
        ax.text(xi, real_counts[xi] + pad_counts[xi], f"{fmt.tensors[f'RI_{w}'].numel()} rows",
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [f"W={w}" for w in widths])
    ax.set_ylabel("slots")
    ax.set_title(f"slots per bucket width (one statement each); padding {fmt.padding_ratio:.0%}", fontsize=9)
    ax.legend(fontsize=8)

    ax = axes[2]
    longest = int(row_lengths(A).max())
    caps = [1 << e for e in range(0, max(longest, 1).bit_length() + 1)]
    costs = np.array([cell_cost(A, partitions=partitions, max_width=c) for c in caps])
    for p in range(partitions):
        line = ax.plot(caps, costs[:, p], marker=".", label=f"partition {p}")[0]
        chosen = fmt.params["max_widths"][p]
        ax.plot([chosen], [costs[caps.index(chosen), p]], "o", ms=9, mfc="none", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("maximum bucket width (rows folded above it)")
    ax.set_ylabel("LiteForm cost (eq. 7, J=128)")
    ax.set_title("cost model; circle = chosen max_width", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    show(fig)
    return fmt


cell_dlmc = draw_cell(A_dlmc, 4, "DLMC, 4 partitions")
cell_pow = draw_cell(A_pow, 2, "power law, 2 partitions")
print("DLMC:", cell_dlmc)
print("power law:", cell_pow)

# %% [markdown]
# ### Vector-wise N:M
#
# A *vector* is L consecutive rows of one column; along each row block, every window of
# M consecutive vectors keeps N of them (`NM.from_dense` keeps the N of largest norm, so
# it prunes; `NM.from_mask` / `from_torch` take a given pattern). All L rows of a row block
# share one index row `AK[rb, :]`, so with L >= 16 the kernel runs `tl.dot` on them:
# `C[rb,l,n] += AV[rb,l,u]*B[AK[rb,u],n]`. Below: 2:4 with L = 4 on a 16 x 32 dense matrix
# (window borders in grey, row blocks in black), and the compressed tensors.

# %%
gen = torch.Generator().manual_seed(5)
A_small = torch.randn(16, 32, generator=gen)
nm = NM.from_dense(A_small, n=2, m=4, vector_len=4)
kept = nm.to_dense()
fig, axes = plt.subplots(1, 4, figsize=(16, 3.6), gridspec_kw={"width_ratios": [2, 2, 1, 1]})
vmax = float(A_small.abs().max())
for ax, image, title in [
    (axes[0], A_small.abs(), "|A| (dense, 16 x 32)"),
    (axes[1], kept.abs(), "kept by 2:4 with L=4: the 2 largest-norm vectors per window"),
]:
    ax.imshow(image.numpy(), cmap="Greys", vmin=0, vmax=vmax, interpolation="nearest")
    for c in range(4, 32, 4):
        ax.axvline(c - 0.5, color="#999999", lw=0.8)
    for r in range(4, 16, 4):
        ax.axhline(r - 0.5, color="k", lw=1.2)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("column (windows of m=4)")
    ax.set_ylabel("row (row blocks of L=4)")
mask = (kept != 0).numpy()
axes[1].imshow(np.ma.masked_where(~mask, np.ones(mask.shape)), cmap=ListedColormap(["#3b6fb6"]),
               alpha=0.3, interpolation="nearest")
ax = axes[2]
ax.imshow(nm.AV.reshape(nm.padded_rows, -1).abs().numpy(), cmap="Greys", vmin=0, vmax=vmax,
          interpolation="nearest")
for r in range(4, 16, 4):
    ax.axhline(r - 0.5, color="k", lw=1.2)
ax.set_title(f"AV {tuple(nm.AV.shape)}, viewed (16, 16)", fontsize=9)
ax.set_xlabel("u (kept vector)")
ax = axes[3]
ax.imshow(nm.AK.numpy() // 4 % 8, cmap="Pastel2", interpolation="nearest", aspect="auto")
ax.set_yticks(range(nm.AK.shape[0]))
for rb, ks in enumerate(nm.AK.numpy()):
    for u, k in enumerate(ks):
        ax.text(u, rb, str(k), ha="center", va="center", fontsize=7)
ax.set_title(f"AK {tuple(nm.AK.shape)}: one index row per row block\n(shared by its L rows; colour = window)", fontsize=9)
ax.set_xlabel("u (kept vector)")
ax.set_ylabel("row block rb")
fig.tight_layout()
show(fig)
print(nm)

# %% [markdown]
# ### The numbers
#
# Every format packs the same matrix; `stored slots` counts value slots including padding
# (for the block formats, every element of every stored block), `padding` is
# `fmt.padding_ratio = 1 - nnz / stored slots`, and `bytes` is `fmt.nbytes` (index and
# value tensors together, int32 indices, float32 values). torch's CSR tensor (int64
# indices) is listed for reference. `statements` counts the kernel launches of one SpMM.
# N:M *prunes* to its pattern (`from_dense` keeps 2 of every 4 vectors), so its nnz
# differs: it is meant for dense weights, not for a matrix already 98% sparse.

# %%
def pack_all(A):
    """Every format packed from A, exactness checked against the dense matrix."""
    dense = A.to_dense()
    fmts = [
        COO.from_torch(A),
        GroupCOO.from_torch(A),
        ELL.from_torch(A),
        BlockGroupCOO.from_torch(A, block=16),
        BlockGroupCOO.from_torch(A, block=16, group_size="row"),
        CELL.from_torch(A, partitions=1),
        CELL.from_torch(A, partitions=4),
        NM.from_dense(dense, n=2, m=4, vector_len=16),
    ]
    for fmt in fmts[:-1]:
        assert torch.equal(fmt.to_dense(), dense), type(fmt).__name__
    return fmts


def csr_bytes(A):
    return sum(t.numel() * t.element_size() for t in (A.crow_indices(), A.col_indices(), A.values()))


def format_table(A):
    lines = [
        "| format | parameters | nnz | stored slots | padding | bytes | bytes / nnz | statements |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        f"| torch CSR | int64 indices | {A._nnz()} | {A._nnz()} | 0% | {csr_bytes(A):,} | "
        f"{csr_bytes(A) / A._nnz():.1f} | - |",
    ]
    for fmt in pack_all(A):
        lines.append(
            f"| {type(fmt).__name__} | {fmt.describe()} | {fmt.nnz} | {fmt.stored_values:,} | "
            f"{fmt.padding_ratio:.1%} | {fmt.nbytes:,} | {fmt.nbytes / max(fmt.nnz, 1):.1f} | "
            f"{len(fmt.statements())} |"
        )
    return "\n".join(lines)


for key, A in MATRICES.items():
    display(Markdown(f"**{TITLES[key]}** ({A.shape[0]} x {A.shape[1]}, nnz {A._nnz()}); "
                     "every lossless format's `to_dense()` equals the matrix exactly.\n\n"
                     + format_table(A)))

# %% [markdown]
# ## 3. The group-size trade-off (GroupCOO)
#
# With group size g, each row of length n is cut into ceil(n/g) groups. Every slot is a
# *gather* (a row of B read and multiplied) and every group a *scatter* (one atomic update
# of a row of C). g = 1 is COO (no padding, one scatter per entry); g = the longest row is
# ELL-like (fewest scatters, most padding). Bounding ceil(x) by x + 1, gathers plus scatters
# are about nnz + nnz/g + R g + R over the R non-empty rows, minimised at
# g = sqrt(nnz / R); the default rounds that to a power of two and caps it at the longest
# row (InSum paper, §4.2). `group_size="tune"` then times the default and its two
# power-of-two neighbours on the device.

# %%
def sweep(A):
    lengths = row_lengths(A)
    nnz, R = int(lengths.sum()), int((lengths > 0).sum())
    top = 1 << int(lengths.max() - 1).bit_length()
    gs = [1 << e for e in range(top.bit_length())]
    fmts = [GroupCOO.from_torch(A, group_size=g) for g in gs]
    default = GroupCOO.from_torch(A).group_size
    return dict(
        gs=np.array(gs), default=default, optimum=math.sqrt(nnz / R), nnz=nnz, R=R,
        padding=np.array([f.padding_ratio for f in fmts]),
        gathers=np.array([f.stored_values for f in fmts]),
        scatters=np.array([f.groups for f in fmts]),
    )


fig, axes = plt.subplots(2, 2, figsize=(13, 7))
summary = []
for (key, A), (ax_pad, ax_ops) in zip(MATRICES.items(), axes):
    s = sweep(A)
    gs = s["gs"]
    ax_pad.plot(gs, s["padding"], "o-", color="#d9453d")
    ax_pad.set_ylabel("padding ratio")
    ax_pad.set_ylim(0, 1)
    total = s["gathers"] + s["scatters"]
    model = s["nnz"] + s["nnz"] / gs + s["R"] * gs + s["R"]
    ax_ops.plot(gs, s["gathers"], "o-", label="gathers = stored slots (G x g)", color="#3b6fb6")
    ax_ops.plot(gs, s["scatters"], "s-", label="scatters = groups (G)", color="#e39b3c")
    ax_ops.plot(gs, total, "k^-", label="gathers + scatters")
    ax_ops.plot(gs, model, "k:", label="bound nnz + nnz/g + Rg + R")
    ax_ops.set_yscale("log")
    ax_ops.set_ylabel("count")
    ax_ops.legend(fontsize=7)
    best = gs[int(np.argmin(total))]
    at = {int(g): int(t) for g, t in zip(gs, total)}
    summary.append(
        f"{key}: default g={s['default']}: {at[s['default']]:,} gathers + scatters, "
        f"padding {s['padding'][list(gs).index(s['default'])]:.0%}; fewest at g={best}: "
        f"{at[int(best)]:,} ({1 - at[int(best)] / at[s['default']]:.0%} fewer)"
    )
    for ax in (ax_pad, ax_ops):
        ax.set_xscale("log", base=2)
        ax.axvline(s["default"], color="#2a9d55", lw=2, alpha=0.7)
        ax.axvline(s["optimum"], color="#2a9d55", lw=1, ls="--")
        ax.set_xlabel("group size g")
        ax.set_title(f"{key}: default g={s['default']} (green), sqrt(nnz/R)={s['optimum']:.1f} (dashed); "
                     f"measured min of gathers+scatters at g={best}", fontsize=8)
fig.tight_layout()
show(fig)
print("\n".join(summary))

# %% [markdown]
# The rule uses the *average* row length, rounded to a power of two in log scale, so it
# lands on or next to the count's minimum, where the total is flat. One g for all rows
# cannot suit a skewed matrix: large groups pay off on the few long rows but pad every
# short one. CELL (a width per bucket of rows) adapts to each row instead. Counts are only
# a model: the real trade-off also depends on how atomics contend and on tile sizes, which
# is why `group_size="tune"` times the default and its neighbours on the device.

# %% [markdown]
# ## 4. Generated kernels
#
# `insum.explain(expression, **tensors)` prints how the statement is understood (IR,
# extents, the role of each variable), the plan the scheduler chose, and the Triton source.
# Here the tensors live on the CPU and `TRITON_INTERPRET=1`, so the kernel is generated
# and can run in the Triton interpreter (slowly; on a GPU the same source is compiled).
#
# **GroupCOO** (`p` scattered: the output goes through `tl.atomic_add`; `q` reduced):

# %%
G = GroupCOO.from_torch(A_dlmc)
N = 32
B = torch.randn(A_dlmc.shape[1], N)
C = torch.zeros(A_dlmc.shape[0], N)
print(insum.explain(G.expression, C=C, B=B, **G.tensors))

# %% [markdown]
# The same statement, run by the generated kernel in the interpreter and checked against
# the dense product:

# %%
out = insum.insum(G.expression, backend="triton", C=torch.zeros_like(C), B=B, **G.tensors)
reference = A_dlmc.to_dense() @ B
print(f"max |triton - dense| = {(out - reference).abs().max():.2e} "
      f"(fp32 atomics and tf32 rounding are allowed; dense magnitude {reference.abs().max():.1f})")

# %% [markdown]
# **BlockGroupCOO** (a *dot plan*: the block's (m, k) tile times B's (k, n) tile, one
# `tl.dot` per block; `p` on the grid, `q` looped). C and B are viewed blocked:
# C as (M/bm, bm, N), B as (K/bk, bk, N).

# %%
D = BlockGroupCOO.from_dense(A_blk, block=16)
(bm, bk), (Mp, Kp) = D.block, D.padded_shape
Bb = torch.randn(Kp // bk, bk, N)
Cb = torch.zeros(Mp // bm, bm, N)
print(insum.explain(D.expression, C=Cb, B=Bb, **D.tensors))

# %% [markdown]
# **Block-ELL** (`group_size="row"`): the output index is the block row `p` itself, so each
# output tile has one owner and the plan stores instead of scattering. Only the plan:

# %%
text = insum.explain(block_ell.expression, C=Cb, B=Bb, **block_ell.tensors)
print(text[text.index("plan:"): text.index("source:")])
out = insum.insum(block_ell.expression, backend="triton", C=torch.zeros_like(Cb), B=Bb, **block_ell.tensors)
reference = (A_blk @ Bb.reshape(Kp, N)).reshape(Mp // bm, bm, N)
print(f"Block-ELL in the interpreter: max |triton - dense| = {(out - reference).abs().max():.2e}")

# %% [markdown]
# ## 5. Measured speed (H200)
#
# The benchmark suite (`python -m benchmarks` on the H200, see `benchmarks/`) writes one
# `benchmarks/results/<device>/<study>.json` per study: each row holds `set`, `case`, `insum_ms`,
# the `anchor` (cuSPARSE, cuBLAS, TorchBSR, cuSPARSELt, torch eager / torch.compile, ...),
# `anchor_ms`, and `ratio = anchor_ms / insum_ms` (> 1: insum is faster). Only rows whose
# result passed its float64 check are plotted. Nothing here is measured on this CPU.

# %% [markdown] results-status

# %%
RESULTS = Path(os.environ.get("INSUM_RESULTS", ROOT / "benchmarks" / "results" / "h200"))
STUDY_ORDER = ["unstructured", "structured", "nm", "fusion", "costs"]
studies = {}
for path in sorted(RESULTS.glob("*.json")):
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        print(f"skipping {path.name}: {e}")
        continue
    if isinstance(data, dict) and "study" in data and isinstance(data.get("rows"), list):  # the runner's study files
        studies[data.get("study", path.stem)] = data
studies = dict(sorted(studies.items(), key=lambda kv: (STUDY_ORDER + [kv[0]]).index(kv[0])))
if not studies:
    display(Markdown(f"**No benchmark results** in `{RESULTS.relative_to(ROOT) if RESULTS.is_relative_to(ROOT) else RESULTS}`: "
                     "run the H200 suite (`bash benchmarks/gpu_suite.sh` or `python -m benchmarks`) "
                     "and re-run this notebook. No numbers are shown rather than made up."))
for name, data in studies.items():
    env = data.get("env", {})
    print(f"{name}.json: {len(data['rows'])} rows, status {data.get('status')}, mode {data.get('mode')}, "
          f"device {env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}, "
          f"{env.get('date')}, commit {env.get('commit')}")


def ratio_axis(axis):
    """A log axis of ratios labelled 0.5x, 1x, 2x, ... rather than powers of ten."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    axis.set_minor_formatter(NullFormatter())


def geomean(values):
    return float(np.exp(np.mean(np.log(values)))) if len(values) else float("nan")


def plot_study(name, data):
    """Every checked ratio per set (sets grouped by anchor), coloured by sparsity where the
    study records it, with the geomean; then the per-set summary as a table."""
    rows = [r for r in data["rows"] if r.get("ok") and r.get("ratio")]
    failed = sum(not r.get("ok") for r in data["rows"])
    if not rows:
        print(f"{name}: no row with a checked ratio ({failed} failed checks)")
        return
    anchors = list(dict.fromkeys(r["anchor"] for r in rows))
    sets = sorted(dict.fromkeys(r["set"] for r in rows),
                  key=lambda s: anchors.index(next(r["anchor"] for r in rows if r["set"] == s)))
    by_sparsity = all(r.get("sparsity") is not None for r in rows) and len({r["sparsity"] for r in rows}) > 1
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(sets) + 1.3))
    summary = ["| set | anchor | configs | geomean ratio | min | max |", "|---|---|---:|---:|---:|---:|"]
    for y, s in enumerate(sets):
        mine = [r for r in rows if r["set"] == s]
        ratios = np.array([r["ratio"] for r in mine])
        jitter = (np.random.default_rng(y).random(len(ratios)) - 0.5) * 0.35
        if by_sparsity:
            dots = ax.scatter(ratios, y + jitter, s=14, c=[r["sparsity"] for r in mine], cmap="viridis",
                              vmin=min(r["sparsity"] for r in rows), vmax=max(r["sparsity"] for r in rows))
        else:
            ax.scatter(ratios, y + jitter, s=14, alpha=0.7, color="#3b6fb6")
        g = geomean(ratios)
        ax.plot([g, g], [y - 0.35, y + 0.35], color="#d9453d", lw=2.5)
        summary.append(f"| {s} | {mine[0]['anchor']} | {len(ratios)} | {g:.3g}x | {ratios.min():.3g}x | {ratios.max():.3g}x |")
    if by_sparsity:
        fig.colorbar(dots, ax=ax, label="sparsity", fraction=0.03, pad=0.01)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xscale("log")
    ratio_axis(ax.xaxis)
    ax.set_yticks(range(len(sets)), sets, fontsize=8)
    ax.set_ylim(len(sets) - 0.5, -0.5)
    ax.set_xlabel("ratio = anchor time / insum time  (> 1: insum faster; red bar: geomean)")
    device = data.get("env", {}).get("device", "?")
    ax.set_title(f"{name}: {len(rows)} checked configurations on {device}"
                 + (f" ({failed} failed check(s) left out)" if failed else ""), fontsize=9)
    fig.tight_layout()
    show(fig)
    display(Markdown("\n".join(summary)))


def plot_sparsity(name, data):
    """Ratio against sparsity per set: one panel per (anchor, dtype) that was swept."""
    rows = [r for r in data["rows"] if r.get("ok") and r.get("ratio") and r.get("sparsity") is not None]
    # Sets measured at two sparsities or more, by (anchor, first word of the set: the dtype).
    sets = {}
    for r in rows:
        sets.setdefault(r["set"], set()).add(r["sparsity"])
    swept = [s for s, sparsities in sets.items() if len(sparsities) > 1]
    if not swept:
        return
    anchor_of = {r["set"]: r["anchor"] for r in rows}
    anchors = list(dict.fromkeys(anchor_of[s] for s in swept))
    dtypes = list(dict.fromkeys(s.split()[0] for s in swept))
    fig, axes = plt.subplots(len(anchors), len(dtypes), figsize=(5.2 * len(dtypes), 3.4 * len(anchors)),
                             squeeze=False, sharex=True)
    for (i, anchor), (j, dtype) in ((a, d) for a in enumerate(anchors) for d in enumerate(dtypes)):
        ax = axes[i, j]
        mine = [s for s in swept if anchor_of[s] == anchor and s.split()[0] == dtype]
        for s in mine:
            pts = sorted((r["sparsity"], r["ratio"]) for r in rows if r["set"] == s)
            ax.plot(*zip(*pts), "o-", ms=3, label=s.replace(f" vs {anchor}", ""))
        if anchor == "cuBLAS" and mine:
            grid = np.linspace(min(min(sets[s]) for s in mine), max(max(sets[s]) for s in mine), 50)
            ax.plot(grid, 1 / (1 - grid), "k:", label="ideal 1 / (1 - s)")
        ax.axhline(1.0, color="k", lw=1)
        ax.set_yscale("log")
        ratio_axis(ax.yaxis)
        ax.set_xlabel("sparsity")
        ax.set_ylabel(f"{anchor} / insum")
        ax.set_title(f"{name}, {dtype}: against {anchor}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    show(fig)


def rows_table(data):
    """Every row as it is: the fusion study's cases are different statements, and many of
    the costs study's rows have no anchor ratio."""
    def ms(value):
        return "-" if value is None else f"{value:.4g}"

    lines = ["| set | case | insum ms | anchor | anchor ms | ratio | check |",
             "|---|---|---:|---|---:|---:|---|"]
    for r in data["rows"]:
        lines.append(f"| {r.get('set')} | {r.get('case')} | {ms(r.get('insum_ms'))} | {r.get('anchor')} | "
                     f"{ms(r.get('anchor_ms'))} | {ms(r.get('ratio'))} | {'ok' if r.get('ok') else 'FAILED'} |")
    display(Markdown("\n".join(lines)))


for name, data in studies.items():
    plot_study(name, data)
    if name == "structured":
        plot_sparsity(name, data)
    if name in ("fusion", "costs"):
        rows_table(data)
    notes = list(dict.fromkeys(data.get("notes", [])))  # studies repeat a note per config
    for note in notes[:8]:
        print(f"  note ({name}): {note}")
    if len(notes) > 8:
        print(f"  ... and {len(notes) - 8} more notes in {name}.json")
