"""The tensor product's statements and the Clebsch–Gordan tables they index
(`insum.nn.tensor_product` runs them): e3nn's path normalisation, the instruction checks,
and the forward and gradient tables, built once per layer in numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .irreps import Irreps, IrrepsError, wigner_3j

__all__ = [
    "FLAT_GRADIENT_STATEMENTS",
    "FLAT_STATEMENTS",
    "GRADIENT_STATEMENTS",
    "IRREP_NORMALIZATIONS",
    "LAYOUT_STATEMENTS",
    "MODES",
    "PATH_NORMALIZATIONS",
    "ROW_SLAB_STATEMENTS",
    "RUN_STATEMENTS",
    "STATEMENTS",
    "Instruction",
    "check_instruction",
    "flat_gradient_tables",
    "flat_tables",
    "normalised_instructions",
    "tensor_product_tables",
]

# The layer's statements, by (connection mode, weights shared across the batch).
STATEMENTS = {
    ("uvw", True): "Z[b,p,w] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,CGI[p,q],u] * W[PW[p,q],u,w]",
    ("uvw", False): "Z[b,p,w] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,CGI[p,q],u] * W[b,PW[p,q],u,w]",
    ("uvu", True): "Z[b,p,u] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,CGI[p,q],u] * W[PW[p,q],u]",
    ("uvu", False): "Z[b,p,u] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,CGI[p,q],u] * W[b,PW[p,q],u]",
}
# Channel-wise products whose every output component is fed by one weight slab (each output
# entry has one path with one input-2 channel, as in MACE): the weight is read once per
# (component, channel) through PR[p] instead of once per CG entry.
ROW_SLAB_STATEMENTS = {
    ("uvu", True): "Z[b,p,u] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,CGI[p,q],u] * W[PR[p],u]",
    ("uvu", False): "Z[b,p,u] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,CGI[p,q],u] * W[b,PR[p],u]",
}
# The same products writing straight into e3nn's layout: one launch per run of consecutive
# output entries of one multiplicity and dimension, Z a strided view [batch, entry, m, channel].
RUN_STATEMENTS = {
    ("uvw", True): "Z[b,j,k,w] = CGV[j,k,q] * Y[b,CGJ[j,k,q]] * X[b,CGI[j,k,q],u] * W[PW[j,k,q],u,w]",
    ("uvw", False): "Z[b,j,k,w] = CGV[j,k,q] * Y[b,CGJ[j,k,q]] * X[b,CGI[j,k,q],u] * W[b,PW[j,k,q],u,w]",
    ("uvu", True): "Z[b,j,k,u] = CGV[j,k,q] * Y[b,CGJ[j,k,q]] * X[b,CGI[j,k,q],u] * W[PW[j,k,q],u]",
    ("uvu", False): "Z[b,j,k,u] = CGV[j,k,q] * Y[b,CGJ[j,k,q]] * X[b,CGI[j,k,q],u] * W[b,PW[j,k,q],u]",
}


# The channel-wise product with one column per e3nn output position t (output="flat"): input 1,
# the output and the flat weight are read and written in e3nn's layouts, by (shared weights,
# one weight position per output: FR[t], else FW[q, t] per CG entry). The tables are [Q, D],
# so that a tile of consecutive outputs loads each entry slot's values contiguously. See
# `flat_tables`.
FLAT_STATEMENTS = {
    (False, True): "Z[b, t] = FV[q, t] * Y[b, FJ[q, t]] * X[b, FX[q, t]] * W[b, FR[t]]",
    (False, False): "Z[b, t] = FV[q, t] * Y[b, FJ[q, t]] * X[b, FX[q, t]] * W[b, FW[q, t]]",
    (True, True): "Z[b, t] = FV[q, t] * Y[b, FJ[q, t]] * X[b, FX[q, t]] * W[FR[t]]",
    (True, False): "Z[b, t] = FV[q, t] * Y[b, FJ[q, t]] * X[b, FX[q, t]] * W[FW[q, t]]",
}
# Their gradients, in e3nn's layouts too: the same CG entries grouped by input-1 position s
# (dX), weight position r (dW; split over batch groups g for a shared weight) and input-2
# position j (dY), so that each gradient element is one column's sum (no atomics, no gather).
FLAT_GRADIENT_STATEMENTS = {
    False: {
        "X": "DX[b, s] = GXV[q, s] * Y[b, GXJ[q, s]] * W[b, GXW[q, s]] * DZ[b, GXT[q, s]]",
        "W": "DW[b, r] = GWV[q, r] * Y[b, GWJ[q, r]] * X[b, GWX[q, r]] * DZ[b, GWT[q, r]]",
        "Y": "DY[b, j] = GYV[q, j] * X[b, GYX[q, j]] * W[b, GYW[q, j]] * DZ[b, GYT[q, j]]",
    },
    True: {
        "X": "DX[b, s] = GXV[q, s] * Y[b, GXJ[q, s]] * W[GXW[q, s]] * DZ[b, GXT[q, s]]",
        "W": "DW[g, r] = GWV[q, r] * Y[g, i, GWJ[q, r]] * X[g, i, GWX[q, r]] * DZ[g, i, GWT[q, r]]",
        "Y": "DY[b, j] = GYV[q, j] * X[b, GYX[q, j]] * W[GYW[q, j]] * DZ[b, GYT[q, j]]",
    },
}

# The backward statements (the same CG entries regrouped: see _gradient_tables), by
# (mode, weights shared): the gradients of X, of W, and of Y (through T for "uvw").
GRADIENT_STATEMENTS = {
    ("uvw", True): {
        "X": "DX[b,c,u] = XV[c,q] * Y[b,XJ[c,q]] * DZ[b,XP[c,q],w] * W[XS[c,q],u,w]",
        # split over batch groups g (summed after): one weight slab alone is too little parallel work
        "W": "DW[g,s,u,w] = WV[s,q] * Y[g,i,WJ[s,q]] * X[g,i,WC[s,q],u] * DZ[g,i,WP[s,q],w]",
        "T": "T[b,r,w] = X[b,RC[r],u] * W[RS[r],u,w]",
        "Y": "DY[b,j] = YV[j,q] * T[b,YR[j,q],w] * DZ[b,YP[j,q],w]",
    },
    ("uvw", False): {
        "X": "DX[b,c,u] = XV[c,q] * Y[b,XJ[c,q]] * DZ[b,XP[c,q],w] * W[b,XS[c,q],u,w]",
        "W": "DW[b,s,u,w] = WV[s,q] * Y[b,WJ[s,q]] * X[b,WC[s,q],u] * DZ[b,WP[s,q],w]",
        "T": "T[b,r,w] = X[b,RC[r],u] * W[b,RS[r],u,w]",
        "Y": "DY[b,j] = YV[j,q] * T[b,YR[j,q],w] * DZ[b,YP[j,q],w]",
    },
    ("uvu", True): {
        "X": "DX[b,c,u] = XV[c,q] * Y[b,XJ[c,q]] * DZ[b,XP[c,q],u] * W[XS[c,q],u]",
        "W": "DW[g,s,u] = WV[s,q] * Y[g,i,WJ[s,q]] * X[g,i,WC[s,q],u] * DZ[g,i,WP[s,q],u]",
        "Y": "DY[b,j] = YV[j,q] * X[b,YC[j,q],u] * W[YS[j,q],u] * DZ[b,YP[j,q],u]",
    },
    ("uvu", False): {
        "X": "DX[b,c,u] = XV[c,q] * Y[b,XJ[c,q]] * DZ[b,XP[c,q],u] * W[b,XS[c,q],u]",
        "W": "DW[b,s,u] = WV[s,q] * Y[b,WJ[s,q]] * X[b,WC[s,q],u] * DZ[b,WP[s,q],u]",
        "Y": "DY[b,j] = YV[j,q] * X[b,YC[j,q],u] * W[b,YS[j,q],u] * DZ[b,YP[j,q],u]",
    },
}
# The fully connected ("uvw") product reading x1 and writing the output in e3nn's layout,
# forward and backward, by (weights shared): XI[c, u] is x1's flat position of component c,
# channel u, and ZO[p, w] the output's of (component p, channel w). Both are permutations
# of their layouts (every input-1 entry of one multiplicity, every output entry of one), so
# the statements that write through them store plainly with no zero fill, and no gather
# copies x1, the output or their gradients.
LAYOUT_STATEMENTS = {
    True: {
        "Z": "Z[b,ZO[p,w]] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,XI[CGI[p,q],u]] * W[PW[p,q],u,w]",
        "X": "DX[b,XI[c,u]] = XV[c,q] * Y[b,XJ[c,q]] * DZ[b,ZO[XP[c,q],w]] * W[XS[c,q],u,w]",
        # split over batch groups g (summed after), as in GRADIENT_STATEMENTS
        "W": "DW[g,s,u,w] = WV[s,q] * Y[g,i,WJ[s,q]] * X[g,i,XI[WC[s,q],u]] * DZ[g,i,ZO[WP[s,q],w]]",
        "T": "T[b,r,w] = X[b,XI[RC[r],u]] * W[RS[r],u,w]",
        "Y": "DY[b,j] = YV[j,q] * T[b,YR[j,q],w] * DZ[b,ZO[YP[j,q],w]]",
    },
    False: {
        "Z": "Z[b,ZO[p,w]] = CGV[p,q] * Y[b,CGJ[p,q]] * X[b,XI[CGI[p,q],u]] * W[b,PW[p,q],u,w]",
        "X": "DX[b,XI[c,u]] = XV[c,q] * Y[b,XJ[c,q]] * DZ[b,ZO[XP[c,q],w]] * W[b,XS[c,q],u,w]",
        "W": "DW[b,s,u,w] = WV[s,q] * Y[b,WJ[s,q]] * X[b,XI[WC[s,q],u]] * DZ[b,ZO[WP[s,q],w]]",
        "T": "T[b,r,w] = X[b,XI[RC[r],u]] * W[b,RS[r],u,w]",
        "Y": "DY[b,j] = YV[j,q] * T[b,YR[j,q],w] * DZ[b,ZO[YP[j,q],w]]",
    },
}
MODES = ("uvw", "uvu")
IRREP_NORMALIZATIONS = ("component", "norm", "none")
PATH_NORMALIZATIONS = ("element", "path", "none")


@dataclass(frozen=True)
class Instruction:
    """One path: input-1 entry, input-2 entry, output entry, mode, and its coefficient."""

    i_in1: int
    i_in2: int
    i_out: int
    mode: str
    coefficient: float

    def weight_shape(self, irreps1: Irreps, irreps2: Irreps, irreps_out: Irreps) -> tuple[int, ...]:
        mul1, mul2, mul_out = irreps1[self.i_in1][0], irreps2[self.i_in2][0], irreps_out[self.i_out][0]
        return (mul1, mul2, mul_out) if self.mode == "uvw" else (mul1, mul2)


def normalised_instructions(
    irreps1: Irreps, irreps2: Irreps, irreps_out: Irreps, paths: list[tuple[int, int, int, str, float]],
    irrep_normalization: str, path_normalization: str,
) -> list[Instruction]:
    """e3nn's path coefficients: sqrt(alpha), alpha from the output's dimension and fan-in."""

    def fan_in(i1: int, i2: int, mode: str) -> int:
        return irreps1[i1][0] * irreps2[i2][0] if mode == "uvw" else irreps2[i2][0]

    out = []
    for i1, i2, io, mode, path_weight in paths:
        ir1, ir2, ir_out = irreps1[i1][1], irreps2[i2][1], irreps_out[io][1]
        alpha = {"component": ir_out.dim, "norm": ir1.dim * ir2.dim, "none": 1}[irrep_normalization]
        if path_normalization == "element":
            x = sum(fan_in(a, b, m) for a, b, o, m, _ in paths if o == io)
        elif path_normalization == "path":
            x = fan_in(i1, i2, mode) * sum(1 for path in paths if path[2] == io)
        else:
            x = 1
        if x > 0:
            alpha /= x
        out.append(Instruction(i1, i2, io, mode, math.sqrt(alpha * path_weight)))
    return out


def check_instruction(irreps1: Irreps, irreps2: Irreps, irreps_out: Irreps, ins: Instruction) -> None:
    """Raise IrrepsError, naming `ins`, when its entries, irreps or connection mode do not fit."""
    for name, irreps, i in (("irreps_in1", irreps1, ins.i_in1), ("irreps_in2", irreps2, ins.i_in2), ("irreps_out", irreps_out, ins.i_out)):
        if not 0 <= i < len(irreps):
            raise IrrepsError(f"instruction {ins}: {name} has {len(irreps)} entries, no entry {i}")
    (mul1, ir1), (_, ir2), (mul_out, ir_out) = irreps1[ins.i_in1], irreps2[ins.i_in2], irreps_out[ins.i_out]
    if ir_out not in ir1 * ir2:
        raise IrrepsError(f"instruction {ins}: {ir_out} is not in {ir1} x {ir2}")
    if ins.mode not in MODES:
        raise IrrepsError(f"instruction {ins}: connection mode {ins.mode!r} is not supported (choose one of {', '.join(MODES)})")
    if ins.mode == "uvu" and mul1 != mul_out:
        raise IrrepsError(f"instruction {ins}: 'uvu' needs the output multiplicity ({mul_out}) to equal input 1's ({mul1})")


def tensor_product_tables(
    irreps1: Irreps, irreps2: Irreps, irreps_out: Irreps, instructions: list[Instruction], sort_rows: bool = False
) -> dict[str, np.ndarray]:
    """The index and value tables of the layer's statement (numpy, built once per layer).

    sort_rows: order the output components p by their number of CG entries (fewest first,
    stable), so that runs of rows with similar counts can run with their own Q; OUT_INDEX
    and the gradient tables follow the new order.

    CGV, CGJ, CGI, PW [P, Q]: the CG entries grouped by output component p (padded with
    zero entries); CGL [P]: each row's entry count (its declared length, `q[p]`); X_INDEX [C1, U]: input 1's flat position of (component, channel);
    W_INDEX [S, U, Wd] or [S, U]: the flat weight position of each slab element;
    OUT_INDEX [D_out]: where each e3nn output position lies in the flattened Z.
    Padded positions point one past the end (a zero appended there).
    """
    mode = instructions[0].mode if instructions else "uvw"
    offsets1, offsets2, offsets_out = irreps1.offsets(), irreps2.offsets(), irreps_out.offsets()
    # uvu: output channel w is input channel u, so the output's multiplicities bound U too
    # (an output entry that no path feeds may be wider than every input entry).
    U = max([mul for mul, _ in irreps1] + ([mul for mul, _ in irreps_out] if mode == "uvu" else []), default=1) or 1
    Wd = U if mode == "uvu" else (max((mul for mul, _ in irreps_out), default=1) or 1)
    comp1 = np.cumsum([0] + [ir.dim for _, ir in irreps1])  # first component row of each entry
    x_index = np.full((int(comp1[-1]), U), irreps1.dim, dtype=np.int64)
    for e, (mul, ir) in enumerate(irreps1):
        for i in range(ir.dim):
            x_index[comp1[e] + i, :mul] = offsets1[e] + np.arange(mul) * ir.dim + i

    comp_out = np.cumsum([0] + [ir.dim for _, ir in irreps_out])
    rows: list[list[tuple[int, float, int, int]]] = [[] for _ in range(int(comp_out[-1]))]  # (slab, v, j, i)
    slabs: list[np.ndarray] = []
    weight_numel, weight_offset = 0, 0
    for ins in instructions:
        (mul1, ir1), (mul2, ir2), (mul_out, ir_out) = irreps1[ins.i_in1], irreps2[ins.i_in2], irreps_out[ins.i_out]
        cg = wigner_3j(ir1.l, ir2.l, ir_out.l).numpy()
        size = int(np.prod(ins.weight_shape(irreps1, irreps2, irreps_out)))
        for v in range(mul2):
            slab = len(slabs)
            u = np.arange(mul1)[:, None]
            if mode == "uvw":
                index = np.full((U, Wd), -1, dtype=np.int64)
                index[:mul1, :mul_out] = weight_offset + (u * mul2 + v) * mul_out + np.arange(mul_out)[None, :]
            else:
                index = np.full((U,), -1, dtype=np.int64)
                index[:mul1] = weight_offset + u[:, 0] * mul2 + v
            slabs.append(index)
            for i, j, k in zip(*np.nonzero(cg)):
                rows[comp_out[ins.i_out] + k].append(
                    (slab, ins.coefficient * float(cg[i, j, k]), offsets2[ins.i_in2] + v * ir2.dim + j, comp1[ins.i_in1] + i)
                )
        weight_offset += size
        weight_numel += size
    row_of = np.arange(len(rows))  # component (e3nn order) -> row p
    if sort_rows:
        order = sorted(range(len(rows)), key=lambda p: len(rows[p]))
        rows = [rows[p] for p in order]
        row_of[order] = np.arange(len(rows))
    Q = max((len(r) for r in rows), default=1) or 1
    P = len(rows)
    cgv, cgj, cgi, pw = np.zeros((P, Q)), np.zeros((P, Q), np.int64), np.zeros((P, Q), np.int64), np.zeros((P, Q), np.int64)
    for p, row in enumerate(rows):
        row.sort(key=lambda entry: (entry[0], entry[3], entry[2]))  # neighbouring entries share weight slabs
        for q, (slab, value, j, i) in enumerate(row):
            pw[p, q], cgv[p, q], cgj[p, q], cgi[p, q] = slab, value, j, i
    w_index = np.stack(slabs) if slabs else np.full((1, U, Wd) if mode == "uvw" else (1, U), -1, dtype=np.int64)
    w_index[w_index < 0] = weight_numel

    out_index = np.zeros(irreps_out.dim, dtype=np.int64)
    for e, (mul, ir) in enumerate(irreps_out):
        w, k = np.meshgrid(np.arange(mul), np.arange(ir.dim), indexing="ij")
        out_index[offsets_out[e] + w * ir.dim + k] = row_of[comp_out[e] + k] * Wd + w
    out_inverse = np.full(P * Wd, irreps_out.dim, dtype=np.int64)  # Z position -> e3nn position
    out_inverse[out_index] = np.arange(irreps_out.dim)
    tables = {"CGV": cgv, "CGJ": cgj, "CGI": cgi, "PW": pw, "CGL": np.array([len(r) for r in rows], np.int64),
              "X_INDEX": x_index, "W_INDEX": w_index, "OUT_INVERSE": out_inverse,
              "OUT_INDEX": out_index, "weight_numel": np.array(weight_numel)}
    entries = [(p, slab, value, j, c) for p, row in enumerate(rows) for slab, value, j, c in row]
    tables.update(_gradient_tables(entries, mode, n_components=len(x_index), n_slabs=len(w_index), n_in2=irreps2.dim))
    return tables


def _grouped(entries: list[tuple], key: int, fields: tuple[int, ...], n_rows: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The CG entries (p, slab, value, j, c) grouped by entry[key] into n_rows padded rows;
    one [n_rows, Q] table per field (value tables float64, index tables int64), and the
    entry count of each row under the first name's letter + "L" (XV -> XL)."""
    rows: list[list[tuple]] = [[] for _ in range(n_rows)]
    for entry in entries:
        rows[entry[key]].append(entry)
    Q = max((len(r) for r in rows), default=1) or 1
    out = {name: np.zeros((n_rows, Q), np.float64 if f == 2 else np.int64) for name, f in zip(names, fields)}
    for r, row in enumerate(rows):
        for q, entry in enumerate(sorted(row)):
            for name, f in zip(names, fields):
                out[name][r, q] = entry[f]
    out[names[0][0] + "L"] = np.array([len(r) for r in rows], np.int64)
    return out


def _gradient_tables(entries: list[tuple], mode: str, n_components: int, n_slabs: int, n_in2: int) -> dict[str, np.ndarray]:
    """Tables of the backward statements: the same CG entries grouped by the input-1
    component (dX), by the weight slab (dW) and by the input-2 position (dY), so that
    every gradient is owned by one row and stored without atomics."""
    P, S, V, J, C = range(5)
    tables = _grouped(entries, C, (V, J, P, S), n_components, ("XV", "XJ", "XP", "XS"))
    tables.update(_grouped(entries, S, (V, J, C, P), n_slabs, ("WV", "WJ", "WC", "WP")))
    if mode == "uvu":
        tables.update(_grouped(entries, J, (V, C, S, P), n_in2, ("YV", "YC", "YS", "YP")))
        return tables
    # uvw: dY goes through T[b, r, w] = X[b, c_r, :] @ W[s_r] for each (component, slab) pair r.
    pairs = sorted({(e[C], e[S]) for e in entries}) or [(0, 0)]
    pair_of = {pair: r for r, pair in enumerate(pairs)}
    with_pair = [e + (pair_of[(e[C], e[S])],) for e in entries]
    tables.update(_grouped(with_pair, J, (V, 5, P), n_in2, ("YV", "YR", "YP")))
    tables["RC"] = np.array([c for c, _ in pairs], np.int64)
    tables["RS"] = np.array([s for _, s in pairs], np.int64)
    return tables


def flat_tables(tables: dict[str, np.ndarray], dim_out: int) -> dict[str, np.ndarray]:
    """The tables of FLAT_STATEMENTS from a channel-wise product's component tables (rows
    unsorted): each component row p repeated for its channels u, one column per e3nn output
    position t, its CG entries pointing at input 1's and the weight's flat positions.

    FV [Q, D] (values, float64), FJ (input 2), FX (input 1), FW (weight) [Q, D] and FL [D]
    (entry counts); FR [D] when every entry of an output reads one weight position (MACE: one
    path per output entry), else None. Padding entries read position 0 with value 0.
    """
    cgv, cgj, cgi, pw, cgl = (tables[n] for n in ("CGV", "CGJ", "CGI", "PW", "CGL"))
    x_index, w_index = tables["X_INDEX"], tables["W_INDEX"]
    P, U = cgv.shape[0], x_index.shape[1]
    position = tables["OUT_INVERSE"].reshape(P, U)  # e3nn output position of (p, u); dim_out: padding
    p, u = np.nonzero(position < dim_out)
    t = position[p, u]
    real = np.arange(cgv.shape[1])[None, :] < cgl[p][:, None]  # [outputs, Q]
    columns = {
        "FV": np.where(real, cgv[p], 0.0),
        "FJ": np.where(real, cgj[p], 0),
        "FX": np.where(real, x_index[cgi[p], u[:, None]], 0),
        "FW": np.where(real, w_index[pw[p], u[:, None]], 0),
    }
    out = {}
    for name, column in columns.items():
        out[name] = np.zeros((cgv.shape[1], dim_out), column.dtype)
        out[name][:, t] = column.T
    out["FL"] = np.zeros(dim_out, np.int64)
    out["FL"][t] = cgl[p]
    first = out["FW"][0]
    out["FR"] = first.copy() if ((out["FW"] == first) | (out["FV"] == 0)).all() else None
    return out


def flat_gradient_tables(flat: dict[str, np.ndarray], dim1: int, dim2: int, weight_numel: int) -> dict[str, np.ndarray]:
    """The tables of FLAT_GRADIENT_STATEMENTS from `flat_tables`' output: the real CG entries
    (output t, value, input-2 j, input-1 x, weight w) grouped by x (GX*), by w (GW*) and by
    j (GY*), each [Q, rows] with the row's entry count in GXL / GWL / GYL."""
    q, t = np.nonzero(np.arange(flat["FV"].shape[0])[:, None] < flat["FL"][None, :])
    entry = {"V": flat["FV"][q, t], "J": flat["FJ"][q, t], "X": flat["FX"][q, t], "W": flat["FW"][q, t], "T": t}
    out = {}
    for key, rows, fields in (("X", dim1, "VJWT"), ("W", weight_numel, "VJXT"), ("J", dim2, "VXWT")):
        name = "GY" if key == "J" else "G" + key
        keys = entry[key]
        order = np.argsort(keys, kind="stable")
        counts = np.bincount(keys, minlength=rows)
        slot = np.arange(len(keys)) - np.repeat(np.cumsum(counts) - counts, counts)  # rank within its row
        width = max(int(counts.max(initial=0)), 1)
        for field in fields:
            table = np.zeros((width, rows), np.float64 if field == "V" else np.int64)
            table[slot, keys[order]] = entry[field][order]
            out[name + field] = table
        out[name + "L"] = counts.astype(np.int64)
    return out
