"""The tensor-product part of notebooks/applications.ipynb (built by build_applications.py).

`CELLS` is a list of (kind, source) pairs, kind "markdown" or "code". The cells run on the CPU
(the layer's kernels in the Triton interpreter), with e3nn where it is installed, and read
the H200 measurements from benchmarks/results/h200/tensor_product/tensor_product.json.
"""

from __future__ import annotations

CELLS: list[tuple[str, str]] = [
    ("markdown", """\
## Equivariant tensor products: `insum.nn.FullyConnectedTensorProduct`

An O(3)-equivariant tensor product combines two irreps-valued features through
Clebsch–Gordan (CG) tables: for every path l1 ⊗ l2 → l3 allowed by the selection rules,
out[w, k] += α · Σ C[i, j, k] · x1[u, i] · x2[v, j] · W[u, v, w]. The CG tables are sparse, so
e3nn's dense einsums spend most of their work on zeros. insum groups the tables' nonzero
entries by the output component p they feed (padded to the longest group, Q) and the whole
layer becomes one statement:

```
Z[b,p,w] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,CGI[p,q],u] * W[PW[p,q],u,w]
```

CGV holds the CG value times the path's normalisation, CGJ the position in input 2, CGI the
component of input 1, PW the weight slab of the entry's path; the code generator runs it
as a `tl.dot` over the channels u (M = batch, N = output channels) with the CG entries as
the loop. The channel-wise ("uvu") product of MACE keeps the channel instead:
`Z[b,p,u] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,CGI[p,q],u] * W[b,PW[p,q],u]`."""),
    ("code", """\
import json, os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import insum
from insum.nn import FullyConnectedTensorProduct, Irreps, TensorProduct, wigner_3j

torch.manual_seed(0)
tp = FullyConnectedTensorProduct("4x0e+4x1o+4x2e", "0e+1o+2e", "4x0e+4x1o+4x2e", backend="torch")
print(tp)
print("statement:", tp.statement)
print("CG tables: P =", tp.CGV.shape[0], "output components, Q =", tp.CGV.shape[1], "entries each (padded);",
      int((tp.CGV != 0).sum()), "nonzero of", tp.CGV.numel())"""),
    ("markdown", """\
### The CG tables as pictures

Left: the real Wigner-3j table of 1 ⊗ 1 → 2 in e3nn's basis (computed by insum from
Racah's formula), one panel per output component k: each is a 3 × 3 matrix over (i, j) with
few nonzeros. Right: the layer's grouped table CGV[p, q], one row per output component
(blocks of 1, 3 and 5 rows for 0e, 1o, 2e), white where a row is padded."""),
    ("code", """\
c = wigner_3j(1, 1, 2).numpy()
fig, axes = plt.subplots(1, 6, figsize=(15, 2.6), gridspec_kw={"width_ratios": [1, 1, 1, 1, 1, 4]})
lim = np.abs(c).max()
for k in range(5):
    axes[k].imshow(c[:, :, k], cmap="RdBu", vmin=-lim, vmax=lim)
    axes[k].set_title(f"C[i, j, k={k}]"); axes[k].set_xticks(range(3)); axes[k].set_yticks(range(3))
table = tp.CGV.numpy().copy()
table[table == 0] = np.nan
lim = np.nanmax(np.abs(table))
axes[5].imshow(table, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
axes[5].set_title("CGV[p, q] (white: padding)"); axes[5].set_xlabel("q (entry)"); axes[5].set_ylabel("p (output component)")
for edge in np.cumsum([ir.dim for _, ir in tp.irreps_out])[:-1]:
    axes[5].axhline(edge - 0.5, color="k", lw=0.8)
plt.tight_layout(); plt.show()

counts = (tp.CGV != 0).sum(1).numpy()
print("entries per output component:", counts.tolist())
print(f"padding: {1 - counts.sum() / tp.CGV.numel():.0%} of the Q slots; dense CG einsum would touch",
      sum(wigner_3j(a.l, b.l, o.l).numel() for _, a in tp.irreps_in1 for _, b in tp.irreps_in2
          for _, o in tp.irreps_out if o in a * b), "entries")"""),
    ("markdown", """\
### The plan the code generator picks, and the backward statements

`insum.explain` shows the forward as a `tl.dot` (M = b, K = u, N = w) over the grid of
output components p, the CG entries q as the loop. The backward does not use insum's derived
gradients (they scatter every CG entry into dX and dW with atomics): the layer regroups the
same entries by input-1 component (dX), by weight slab (dW, the batch split into groups and
summed after) and by input-2 position (dY, through T = X·W for "uvw"), so every gradient
element is owned by one row. Where every input-1 entry has one multiplicity and so does every
output entry (as here), the statements read x1 and write the output in e3nn's layout through
two index tables, `X[b,XI[CGI[p,q],u]]` and `Z[b,ZO[p,w]]` (ZO declared unique: plain stores,
no zero fill), so the layer is one launch (`output="direct"`, `LAYOUT_STATEMENTS`)."""),
    ("code", """\
t = tp.statement_tensors(torch.randn(64, tp.irreps_in1.dim), torch.randn(64, tp.irreps_in2.dim))
print(insum.explain(tp.statement, precision="ieee", **tp.statement_facts(), **t).split("source:")[0])
for name, stmt in tp.gradient_statements.items():
    print(f"{'T' if name == 'T' else 'd' + name}: {stmt}")"""),
    ("markdown", """\
### Checked against e3nn

`from_e3nn` copies an e3nn module's weights and path coefficients; the generated kernel (here
in the Triton interpreter) matches e3nn's output and gradients."""),
    ("code", """\
try:
    from e3nn import o3
except ImportError:
    print("e3nn is not installed: pip install 'insum[e3nn]'")
else:
    os.environ["TRITON_INTERPRET"] = "1"
    ref = o3.FullyConnectedTensorProduct("2x0e+2x1o+2x2e", "0e+1o+2e", "2x0e+2x1o+2x2e")
    mine = FullyConnectedTensorProduct.from_e3nn(ref, backend="triton", precision="ieee")
    x1 = torch.randn(8, ref.irreps_in1.dim, requires_grad=True); x2 = torch.randn(8, ref.irreps_in2.dim)
    a, b = mine(x1, x2), ref(x1, x2)
    a, b = a.detach(), b.detach()
    (ga,) = torch.autograd.grad(mine(x1, x2).sum(), [x1]); (gb,) = torch.autograd.grad(ref(x1, x2).sum(), [x1])
    print(f"forward max |diff| {float((a - b).abs().max()):.2e}, gradient max |diff| {float((ga - gb).abs().max()):.2e}")"""),
    ("markdown", """\
### Measured speed (H200, batch 10,000, float32)

The paper's grid: in1 = C × (0e + 1o + … + L), in2 = the spherical harmonics up to L,
out = in1. Ratios of median times against cuEquivariance 0.13 (`cuet.FullyConnectedTensorProduct`,
e3nn's weights copied) and e3nn eager, for the bare statement (the CG contraction alone),
the layer (tf32 and float32 `tl.dot`), and the layer's forward + backward. From
`python -m benchmarks.explore.layer_probe` (the layer as it is now, one launch:
benchmarks/results/h200/session4/fctp_probe.log) where that log exists, else from
`python -m benchmarks.study_tensor_product` (benchmarks/results/h200/tensor_product)."""),
    ("code", """\
results = Path("..") / "benchmarks" / "results" / "h200"
probe, path = results / "session4" / "fctp_probe.log", results / "tensor_product" / "tensor_product.json"
rows = None
if probe.exists():  # lines "L=1  C=16  key=value ...": the layer_probe grid
    rows = [dict(kv.split("=", 1) for kv in line.split()) for line in probe.read_text().splitlines()
            if line.startswith("L=") and "cue_fwd_us=" in line]
    labels = [f"L{r['L']} C{r['C']}" for r in rows]
    ratio = lambda r, a, b: float(r[a]) / float(r[b])
    series = {
        "statement fwd": [ratio(r, "cue_fwd_us", "stmt_fwd_us") for r in rows],
        "layer fwd": [ratio(r, "cue_fwd_us", "layer_fwd_us") for r in rows],
        "layer fwd+bwd": [ratio(r, "cue_fb_us", "layer_fb_us") for r in rows],
    }
elif path.exists():
    rows = [r for r in json.loads(path.read_text())["rows"] if r["case"] == "fctp"]
    labels = [f"L{r['L']} C{r['C']}" for r in rows]
    series = {
        "statement fwd": [r["cue_fwd_ms"] / r["statement_fwd_ms"] for r in rows],
        "layer fwd (tf32)": [r["cue_fwd_ms"] / r["insum_tf32_fwd_ms"] for r in rows],
        "layer fwd (fp32)": [r["cue_fwd_ms"] / r["insum_ieee_fwd_ms"] for r in rows],
        "layer fwd+bwd": [r["cue_fb_ms"] / r["insum_tf32_fb_ms"] for r in rows],
    }
if not rows:
    print("no measurements at", probe, "or", path)
else:
    x = np.arange(len(rows)); width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(12, 3.5))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.axhline(1, color="k", lw=0.8); ax.set_yscale("log"); ax.set_xticks(x, labels)
    ax.set_ylabel("speed-up over cuEquivariance"); ax.legend(ncol=4); plt.tight_layout(); plt.show()
    geo = lambda v: float(np.exp(np.mean(np.log(v))))
    for name, values in series.items():
        print(f"{name:18s} geomean {geo(values):5.1f}x over cuEquivariance (min {min(values):.2f}x)")
    if "e3nn_fwd_ms" in rows[0]:
        print("statement fwd over e3nn eager: geomean", round(geo([r["e3nn_fwd_ms"] / r["statement_fwd_ms"] for r in rows]), 1), "x")"""),
]

