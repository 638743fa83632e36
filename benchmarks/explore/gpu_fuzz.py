"""Random products on the GPU in what the CPU interpreter cannot run (bf16, fp16 atomics,
tensor descriptors, tuned tiles), against float64:

    python -m benchmarks.explore.gpu_fuzz [--budget 240] [--seed 0] [--out DIR]

Why: the unit tests pin their shapes, and CI's interpreter has no bf16, no fp16 atomics and
no descriptors. Each case draws a format (and its parameters), a dtype, an index dtype, a
shape (odd sizes, one row, empty rows, not whole blocks) and a B (contiguous, transposed or a
strided slice), packs a random sparse matrix, and checks `fmt @ B` against the float64
product of the matrix it holds (relative error <= 2e-3 fp32, which runs in tf32 / 1e-2 fp16, 2e-2 bf16) with the
output poisoned first where one is passed. A few cases run a `SparseLinear` step instead
(forward and gradients of x, weights and bias against float64 autograd of the dense layer),
and some a random statement of a product's shape written by hand (`statement_case`: gathered,
affine and scattered rows and reduction indices, a block statement, a scale factor, an added
term, a transposed output; `=` into a NaN-poisoned output or `+=` into a random one) against
the reference lowering in float64, some with the gradients of both factors.
Tuning is on for every fourth case, off (the default tile) otherwise, to cover both.
A failing case prints everything needed to rerun it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import traceback

import torch

from insum import insum
from insum.formats import CELL, COO, ELL, NM, BlockGroupCOO, GroupCOO, auto
from insum.nn import SparseLinear
from insum.nn.sparse_autograd import format_meta, rebuild_format

#: --smoke: the CPU interpreter (fp32 only, small sizes).
SMOKE = False
TOL = {torch.float32: 2e-3,  # (tf32: the default precision of fp32 products on a GPU)
        torch.float16: 1e-2, torch.bfloat16: 2e-2}


def say(line: str) -> None:
    print(line, flush=True)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def random_matrix(rng: random.Random, M: int, K: int, dtype, device) -> torch.Tensor:
    """A random sparse matrix: uniform, with empty rows, one dense row, or blocks."""
    kind = rng.choice(["uniform", "empty-rows", "hub", "blocks", "zero"] if M * K else ["uniform"])
    gen = torch.Generator(device=device).manual_seed(rng.randrange(1 << 30))
    A = torch.randn(M, K, device=device, generator=gen)
    if kind == "zero":
        return torch.zeros(M, K, device=device, dtype=dtype)
    density = rng.choice([0.01, 0.05, 0.2, 0.5, 1.0])
    keep = torch.rand(M, K, device=device, generator=gen) < density
    if kind == "empty-rows":
        keep &= torch.rand(M, 1, device=device, generator=gen) < 0.5
    elif kind == "hub":
        keep[rng.randrange(M)] = True
    elif kind == "blocks":
        b = rng.choice([16, 32, 64])
        rows, cols = -(-M // b), -(-K // b)
        blocks = torch.rand(rows, cols, device=device, generator=gen) < density
        keep = blocks.repeat_interleave(b, 0).repeat_interleave(b, 1)[:M, :K]
    return (A * keep).to(dtype)


def draw_format(rng: random.Random, A: torch.Tensor, index_dtype):
    """(label, packed format) for a random format and parameters."""
    name = rng.choice(["COO", "GroupCOO", "ELL", "CELL", "BlockGroupCOO", "Block-ELL", "coarsened", "NM", "auto"])
    idx = {"index_dtype": index_dtype}
    if name == "COO":
        return name, COO.from_dense(A, **idx)
    if name == "GroupCOO":
        g = rng.choice([1, 2, 4, 8, 16, 32])
        return f"GroupCOO g={g}", GroupCOO.from_dense(A, group_size=g, **idx)
    if name == "ELL":
        return name, ELL.from_dense(A, **idx)
    if name == "CELL":
        p = min(rng.choice([1, 2, 4]), max(A.shape[1], 1))  # (at most one partition per column)
        return f"CELL p={p}", CELL.from_dense(A, partitions=p, **idx)
    b = rng.choice([16, 32, 64])
    if name == "BlockGroupCOO":
        return f"BlockGroupCOO {b}", BlockGroupCOO.from_dense(A, block=(b, b), **idx)
    if name == "Block-ELL":
        return f"Block-ELL {b}", BlockGroupCOO.from_dense(A, block=(b, b), group_size="row", **idx)
    if name == "coarsened":
        r = rng.choice([2, 4])
        return f"Block-ELL {b} coarsen={r}", BlockGroupCOO.from_dense(A, block=(b, b), group_size="row", coarsen=r, **idx)
    if name == "NM":
        n, m = rng.choice([(2, 4), (1, 8), (2, 8), (3, 8)])
        L = rng.choice([16, 32, 128])
        return f"NM {n}:{m} L={L}", NM.from_dense(A, n=n, m=m, vector_len=L, **idx)
    return "auto", auto(A, n_cols=64, measure=False, index_dtype=index_dtype)


def draw_operand(rng: random.Random, K: int, N: int, dtype, device) -> tuple[str, torch.Tensor]:
    layout = rng.choice(["contiguous", "transposed", "strided"])
    if layout == "contiguous":
        return layout, torch.randn(K, N, device=device).to(dtype)
    if layout == "transposed":
        return layout, torch.randn(N, K, device=device).to(dtype).t()
    return layout, torch.randn(K, 2 * N, device=device).to(dtype)[:, ::2]


def product_case(rng: random.Random, device) -> dict:
    dtype = rng.choice([torch.float32] if SMOKE else [torch.float32, torch.float16, torch.bfloat16])
    index_dtype = rng.choice([torch.int32, torch.int64])
    M = rng.choice([1, 7, 64, 100] if SMOKE else [1, 7, 64, 100, 257, 1000, 2048, 3001])
    K = rng.choice([1, 5, 64, 96] if SMOKE else [1, 5, 64, 96, 130, 1024, 2500])
    N = rng.choice([1, 7, 33] if SMOKE else [1, 7, 33, 64, 128, 257, 1001])
    A = random_matrix(rng, M, K, dtype, device)
    label, fmt = draw_format(rng, A, index_dtype)
    held = fmt.to_dense()
    layout, B = draw_operand(rng, K, N, dtype, device)
    case = dict(kind="product", format=label, dtype=str(dtype), index_dtype=str(index_dtype), M=M, K=K, N=N, B=layout)
    got = fmt @ B
    want = held.double() @ B.double()
    case["err"] = relative_error(got, want) if want.numel() and want.norm() > 0 else float(got.abs().max() if got.numel() else 0)
    case["shape_ok"] = tuple(got.shape) == (M, N)
    case["ok"] = case["shape_ok"] and case["err"] <= TOL[dtype]
    return case


def layer_case(rng: random.Random, device) -> dict:
    dtype = rng.choice([torch.float32] if SMOKE else [torch.float32, torch.float16, torch.bfloat16])
    fin, fout, batch = rng.choice([64, 96, 256, 300]), rng.choice([32, 64, 200, 256]), rng.choice([1, 16, 100])
    fmt, params = rng.choice([
        ("BlockGroupCOO", dict(sparsity=0.75, block=(32, 32), group_size="row")),
        ("BlockGroupCOO", dict(sparsity=0.5, block=(16, 16))),
        ("GroupCOO", dict(sparsity=0.9)),
        ("NM", dict(n=2, m=4, vector_len=32)),
        ("ELL", dict(sparsity=0.95)),
        ("CELL", dict(sparsity=0.9)),
        ("COO", dict(sparsity=0.98)),  # (empty rows: padding at column 0)
    ])
    dense = torch.nn.Linear(fin, fout, device=device)
    layer = SparseLinear.from_linear(dense, fmt, **params).to(dtype)
    W = layer.weight.to_dense().double().detach().requires_grad_()
    bias = layer.bias.double().detach().requires_grad_()
    x = torch.randn(batch, fin, device=device).to(dtype).requires_grad_()
    gy = torch.randn(batch, fout, device=device).to(dtype)
    case = dict(kind="layer", format=f"{fmt} {params}", dtype=str(dtype), fin=fin, fout=fout, batch=batch)
    for step in range(2):  # the second step runs the kept, pinned path
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        y = layer(x)
        y.backward(gy)
        x64 = x.detach().double().requires_grad_()
        W.grad = bias.grad = None
        y64 = x64 @ W.t() + bias
        y64.backward(gy.double())
        errs = {"y": relative_error(y, y64), "dx": relative_error(x.grad, x64.grad),
                "dbias": relative_error(layer.bias.grad, bias.grad)}
        # The weight's gradient: the values' gradients seen densely (the format over them) are
        # dW on the pattern (padding frozen, each position trained once: `frozen_slots`).
        grads = {n: p.grad for n, p in layer.named_parameters() if n != "bias" and p.grad is not None}
        errs["values_have_grad"] = float(len(grads) > 0)
        fmt = layer.weight
        seen = rebuild_format(type(fmt), fmt.shape, format_meta(fmt), {**fmt._tensors, **grads}).to_dense()
        errs["dW"] = relative_error(seen, W.grad * (W != 0))
        case[f"step{step}"] = errs
    tol = TOL[dtype] * 3
    case["ok"] = all(v <= tol for s in ("step0", "step1") for k, v in case[s].items() if k != "values_have_grad") \
        and all(case[s]["values_have_grad"] for s in ("step0", "step1"))
    return case


#: Sizes of a statement case's variables: 1, odd, a tile, past a tile.
STATEMENT_SIZES = [1, 16, 33, 64, 100, 130, 257]


def _indices(rng: random.Random, high: int, shape: tuple, index_dtype, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(rng.randrange(1 << 30))
    return torch.randint(0, max(high, 1), shape, device=device, generator=gen).to(index_dtype)


def _values(rng: random.Random, shape: tuple, dtype, device) -> torch.Tensor:
    """Random values, held transposed (non-contiguous) one time in four when 2-D or more."""
    gen = torch.Generator(device=device).manual_seed(rng.randrange(1 << 30))
    if len(shape) >= 2 and rng.random() < 0.25:
        flipped = shape[:-2] + (shape[-1], shape[-2])
        return torch.randn(flipped, device=device, generator=gen).to(dtype).transpose(-1, -2)
    return torch.randn(shape, device=device, generator=gen).to(dtype)


def draw_statement(rng: random.Random, dtype, index_dtype, device) -> tuple[str, dict, bool]:
    """(statement, tensors with the output "O", whether the output is a plain (m, n) one):
    O[rows, n] op [c *] X[xrows, xk] * [S *] Y[yk, n] [+ D], each index drawn from plain,
    gathered, row-dependent, affine and scattered forms, or a BlockGroupCOO statement."""
    M, N, K = (rng.choice(STATEMENT_SIZES) for _ in range(3))
    t: dict[str, torch.Tensor] = {}
    if rng.random() < 0.2:  # blocks: O[AM[p]*b + i, n] += AV[p, q, i, j] * B[AK[p, q]*b + j, n]
        b, P, Q, R = rng.choice([16, 32]), rng.choice([1, 3, 9]), rng.choice([1, 2, 5]), rng.choice([1, 2, 4])
        t["AM"] = _indices(rng, R, (P,), index_dtype, device)
        t["AK"] = _indices(rng, R, (P, Q), index_dtype, device)
        t["AV"] = _values(rng, (P, Q, b, b), dtype, device)
        t["B"] = _values(rng, (R * b, N), dtype, device)
        op = rng.choice(["+=", "="])
        t["O"] = _values(rng, (R * b, N), dtype, device) if op == "+=" else torch.full((R * b, N), float("nan"), device=device, dtype=dtype)
        return f"O[AM[p]*{b} + i, n] {op} AV[p, q, i, j] * B[AK[p, q]*{b} + j, n]", t, False
    xrows = rng.choice(["m", "IX[m]", "m + 3"])
    xk = rng.choice(["k", "IK[k]"])
    yk = rng.choice(["k", "IY[k]", "JY[m, k]"])
    rows = rng.choice(["m", "m", "OM[m]", "m + 2"])
    m_in_inputs = xrows != "m + 3" or yk == "JY[m, k]"  # (m's extent: a dimension it indexes directly)
    if not m_in_inputs and rows == "m + 2":
        rows = "m"
    transposed = rows == "m" and rng.random() < 0.2
    XM = {"m": M, "IX[m]": M + 5, "m + 3": M + 3}[xrows]
    XK = {"k": K, "IK[k]": K + 2}[xk]
    YK = {"k": K, "IY[k]": K + 7, "JY[m, k]": K + 7}[yk]
    OM = {"m": M, "OM[m]": max(M // 2, 1), "m + 2": M + 2}[rows]
    if xrows == "IX[m]":
        t["IX"] = _indices(rng, XM, (M,), index_dtype, device)
    if xk == "IK[k]":
        t["IK"] = _indices(rng, XK, (K,), index_dtype, device)
    if yk == "IY[k]":
        t["IY"] = _indices(rng, YK, (K,), index_dtype, device)
    if yk == "JY[m, k]":
        t["JY"] = _indices(rng, YK, (M, K), index_dtype, device)
    if rows == "OM[m]":
        t["OM"] = _indices(rng, OM, (M,), index_dtype, device)
    t["X"] = _values(rng, (XM, XK), dtype, device)
    t["Y"] = _values(rng, (YK, N), dtype, device)
    factors = f"X[{xrows}, {xk}] * Y[{yk}, n]"
    if rng.random() < 0.2:
        t["S"] = _values(rng, (K,), dtype, device)
        factors = f"X[{xrows}, {xk}] * S[k] * Y[{yk}, n]"
    if rng.random() < 0.2:
        factors = f"0.5 * {factors}"
    out = f"O[n, {rows}]" if transposed else f"O[{rows}, n]"
    op = rng.choice(["+=", "="])
    added = ""
    if rows == "m" and rng.random() < 0.3:
        t["D"] = _values(rng, (N,), dtype, device)
        added = " + D[n]"
    shape = (N, OM) if transposed else (OM, N)
    t["O"] = _values(rng, shape, dtype, device) if op == "+=" else torch.full(shape, float("nan"), device=device, dtype=dtype)
    return f"{out} {op} {factors}{added}", t, m_in_inputs and rows == "m" and not transposed and op == "="


def statement_case(rng: random.Random, device) -> dict:
    dtype = rng.choice([torch.float32] if SMOKE else [torch.float32, torch.float16, torch.bfloat16])
    index_dtype = rng.choice([torch.int32, torch.int64])
    stmt, t, plain = draw_statement(rng, dtype, index_dtype, device)
    case = dict(kind="statement", stmt=stmt, dtype=str(dtype), index_dtype=str(index_dtype),
                shapes={n: tuple(v.shape) for n, v in t.items()})
    want = insum(stmt, backend="torch", **{n: v.double() if v.is_floating_point() else v for n, v in t.items()})
    given = {n: v.clone() for n, v in t.items()}
    got = insum(stmt, **given)
    case["err"] = relative_error(got, want) if want.norm() > 0 else float(got.abs().max() if got.numel() else 0)
    case["in_place"] = got is given["O"]
    ok = case["in_place"] and case["err"] <= TOL[dtype]
    if plain and rng.random() < 0.5:  # gradients of both factors, the output allocated
        names = [n for n in ("X", "Y") if n in t]
        leaves = {n: t[n].detach().clone().requires_grad_() for n in names}
        leaves64 = {n: t[n].detach().double().requires_grad_() for n in names}
        rest = {n: v for n, v in t.items() if n not in names and n != "O"}
        y = insum(stmt, **rest, **leaves)
        y64 = insum(stmt, backend="torch", **{n: v.double() if v.is_floating_point() else v for n, v in rest.items()},
                    **leaves64)
        gy = torch.randn_like(y64)
        y.backward(gy.to(y.dtype))
        y64.backward(gy)
        case["grads"] = {n: relative_error(leaves[n].grad, leaves64[n].grad) for n in names
                         if leaves64[n].grad.norm() > 0}
        ok = ok and all(e <= TOL[dtype] * 3 for e in case["grads"].values())
    case["ok"] = ok
    return case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="the CPU interpreter, fp32 and small sizes: the plumbing")
    args = parser.parse_args()
    global SMOKE
    SMOKE = args.smoke
    device = torch.device("cpu" if args.smoke else "cuda")
    say(f"{torch.cuda.get_device_name() if not args.smoke else 'cpu'} torch {torch.__version__}")
    rng = random.Random(args.seed)
    deadline = time.time() + args.budget
    rows, failures, i = [], 0, 0
    while time.time() < deadline:
        seed = rng.randrange(1 << 30)
        case_rng = random.Random(seed)
        os.environ["INSUM_AUTOTUNE"] = "1" if i % 4 == 0 else "0"
        try:
            case = (layer_case if i % 5 == 4 else statement_case if i % 5 in (1, 3) else product_case)(case_rng, device)
        except Exception as e:  # a crash is a finding too: reported with its seed
            case = dict(kind="crash", error=f"{type(e).__name__}: {str(e)[:300]}", trace=traceback.format_exc()[-1500:],
                        ok=False)
        case.update(seed=seed, index=i, autotune=os.environ["INSUM_AUTOTUNE"])
        rows.append(case)
        if not case["ok"]:
            failures += 1
            say(f"FAIL {json.dumps(case, default=str)}")
        i += 1
    say(f"{i} cases, {failures} failed")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_fuzz.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
