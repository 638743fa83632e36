"""Equivariant tensor products: insum.nn against e3nn, cuEquivariance and OpenEquivariance.

    python -m benchmarks.study_tensor_product [--parts fctp,uvu,compile] [--out DIR] [--budget S] [--L 1,2,3] [--C 16,32,64]

- fctp: the paper's grid, FullyConnectedTensorProduct with in1 = C x (0e+1o+...+L),
  in2 = the spherical harmonics up to L (1x each), out = in1; L 1-3, C 16/32/64, batch
  10,000. insum's layer (tf32 and ieee float32 dots), its bare statement (the layer minus
  its two layout gathers), e3nn eager, cuEquivariance (`cuet.FullyConnectedTensorProduct`,
  e3nn's weights copied) and OpenEquivariance where they import. Forward, and forward +
  backward (gradients of both inputs and the weights, `torch.autograd.grad`).
- uvu: the channel-wise product of a MACE interaction block: in1 = 128x0e+128x1o+128x2e,
  in2 = sh up to 3, every path whose output is in 0e+1o+2e+3o (sorted as MACE does),
  per-edge weights; e3nn, insum (output="gather", the default; "flat", "views" and
  row_buckets=4 beside it), cuEquivariance (`ChannelWiseTensorProduct`) and OEQ.
- compile: e3nn under torch.compile at one grid point (compiling e3nn is not cheap).

Every result is checked against e3nn in float64 (relative Frobenius error). Times are
`triton.testing.do_bench` medians in ms; the table is printed last, the rows saved as JSON.

A little over 400 lines, as one script: its three parts share the optional anchors'
loading, the timing switch (--smoke) and the one result table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import cpu_median_ms, geomean, median_ms, relative_error

PARITY = "eo"
DEVICE = "cuda"  # --smoke: "cpu", tiny sizes, the Triton interpreter (a check of this script)
SMOKE = False
#: --measure: which implementations to time; "layer" is insum's default layer alone (tf32 for
#: fctp), "insum" that and its other forms (ieee, views, gather, the bare statement).
MEASURE = {"e3nn", "insum", "cue", "oeq"}
GRID = {"L": (1, 2, 3), "C": (16, 32, 64)}  # --L, --C: the fctp grid


def _chain(C: int, L: int) -> str:
    return "+".join(f"{C}x{l}{PARITY[l % 2]}" for l in range(L + 1))  # noqa: E741


def _optional(name: str):
    try:
        return __import__(name)
    except Exception as e:  # noqa: BLE001 (an anchor that does not import is reported, not fatal)
        print(f"[{name}] not available: {type(e).__name__}: {str(e)[:300]}")
        return None


def _time(fn) -> float:
    if SMOKE:
        return cpu_median_ms(fn, reps=1)
    return median_ms(fn, warmup=25, rep=100)


def _fwd_bwd(module_call, inputs, params, grad_out):
    def step():
        out = module_call()
        torch.autograd.grad(out, inputs + params, grad_out)

    return step


def _cue_irreps(cue, text: str):
    return cue.Irreps("O3", text)


def fctp(rows: list, budget_end: float, libs: dict) -> None:
    for L in (1,) if SMOKE else GRID["L"]:
        for C in (4,) if SMOKE else GRID["C"]:
            if time.time() > budget_end:
                print(f"budget spent: skipping fctp L={L} C={C}")
                continue
            row = _fctp_point(L, C, 16 if SMOKE else 10_000, libs)
            rows.append(row)
            print(json.dumps(row), flush=True)
            _save(rows)
            torch.cuda.empty_cache()


def _fctp_point(L: int, C: int, batch: int, libs: dict) -> dict:
    from e3nn import o3

    from insum import insum
    from insum.nn import FullyConnectedTensorProduct

    cue, cuet, oeq = libs.get("cue"), libs.get("cuet"), libs.get("oeq")
    torch.manual_seed(L * 100 + C)
    irreps1, irreps2 = _chain(C, L), _chain(1, L)
    ref = o3.FullyConnectedTensorProduct(irreps1, irreps2, irreps1).to(DEVICE)
    x1 = torch.randn(batch, ref.irreps_in1.dim, device=DEVICE)
    x2 = torch.randn(batch, ref.irreps_in2.dim, device=DEVICE)
    g = torch.randn(batch, ref.irreps_out.dim, device=DEVICE)
    with torch.no_grad():
        ref64 = FullyConnectedTensorProduct.from_e3nn(ref, backend="torch").double()
        expect = ref64(x1.double(), x2.double())
    row = {"case": "fctp", "L": L, "C": C, "batch": batch, "weight_numel": ref.weight_numel}
    x1g, x2g = x1.clone().requires_grad_(), x2.clone().requires_grad_()

    def measure(name, call, params, backward=True):
        try:
            with torch.no_grad():
                row[f"{name}_err"] = relative_error(call(x1, x2), expect)
                row[f"{name}_fwd_ms"] = _time(lambda: call(x1, x2))
            if backward:
                row[f"{name}_fb_ms"] = _time(_fwd_bwd(lambda: call(x1g, x2g), [x1g, x2g], params, g))
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()

    if "e3nn" in MEASURE:
        measure("e3nn", ref, [ref.weight])
    if MEASURE & {"layer", "insum"}:
        # float32 dots: ieee forward only (the sweep's tuning time), and only with "insum"
        for precision in ("ieee", "tf32") if "insum" in MEASURE else ("tf32",):
            layer = FullyConnectedTensorProduct.from_e3nn(ref, precision=precision)
            measure(f"insum_{precision}", layer, [layer.weight], backward=precision == "tf32")
    if "insum" in MEASURE:
        views = FullyConnectedTensorProduct.from_e3nn(ref, output="views")
        measure("insum_views", views, [views.weight], backward=False)
        # The layout before output="direct" (the default here): x1 and Z gathered around the statement.
        gathered = FullyConnectedTensorProduct.from_e3nn(ref, output="gather")
        measure("insum_gather", gathered, [gathered.weight])
        try:
            tensors = layer.statement_tensors(x1, x2)
            with torch.no_grad():
                row["statement_fwd_ms"] = _time(lambda: insum(layer.statement, precision="tf32", **layer.statement_facts(), **tensors))
            if C == (4 if SMOKE else 64):
                row.update(_backward_breakdown(gathered, gathered.statement_tensors(x1, x2), g, (x1, x2, gathered.weight.detach())))
        except Exception as e:  # noqa: BLE001
            row["statement_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()
    if cuet is not None and "cue" in MEASURE:
        try:
            mod = cuet.FullyConnectedTensorProduct(
                _cue_irreps(cue, irreps1), _cue_irreps(cue, irreps2), _cue_irreps(cue, irreps1),
                layout=cue.mul_ir, shared_weights=True, internal_weights=True, device=DEVICE,
            )
            with torch.no_grad():
                mod.weight.copy_(ref.weight.detach().view_as(mod.weight))
            measure("cue", mod, [mod.weight])
        except Exception as e:  # noqa: BLE001
            row["cue_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()
    if oeq is not None and "oeq" in MEASURE:
        try:
            problem = oeq.TPProblem(
                irreps1, irreps2, irreps1,
                [(i.i_in1, i.i_in2, i.i_out, "uvw", True, 1.0) for i in ref.instructions],
                shared_weights=True, internal_weights=False,
            )
            op = oeq.TensorProduct(problem, torch_op=True)
            w = ref.weight.detach().clone().requires_grad_()
            measure("oeq", lambda a, b: op(a, b, w), [w])
        except Exception as e:  # noqa: BLE001
            row["oeq_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()
    return row


def _backward_breakdown(layer, tensors: dict, g: torch.Tensor, flat: tuple) -> dict:
    """The layer's autograd function (layout gathers and regrouped gradient statements) and
    the statement with insum's derived gradients (no layout gathers), forward + backward, and
    each gradient statement alone. flat: the layer's inputs (x1, x2, weight)."""
    from insum import insum
    from insum.nn.tensor_product import _batch_groups, _ProductFunction

    leaves = {k: tensors[k].detach().clone().requires_grad_() for k in ("Y", "X", "W")}
    rest = {k: v for k, v in tensors.items() if k not in leaves}
    out = {}
    grads = list(leaves.values())
    z = insum(layer.statement, precision=layer.precision, **tensors)  # component-major [b, p, w]
    dz = torch.randn_like(z)
    flat = [t.detach().clone().requires_grad_() for t in flat]
    d_out = torch.randn_like(_ProductFunction.apply(layer, *flat).detach())  # e3nn layout
    out["stmt_fb_grouped_ms"] = _time(_fwd_bwd(lambda: _ProductFunction.apply(layer, *flat), flat, [], d_out))
    out["stmt_fb_derived_ms"] = _time(_fwd_bwd(lambda: insum(layer.statement, precision=layer.precision, **rest, **leaves), grads, [], dz))
    with torch.no_grad():
        common = {"Y": tensors["Y"], "X": tensors["X"], "W": tensors["W"], "DZ": dz}
        stmts = layer.gradient_statements
        if "T" in stmts:
            common["T"] = insum(stmts["T"], precision=layer.precision, **_tables(layer, stmts["T"], common))
        for name, stmt in stmts.items():
            given = common
            if name == "W" and layer.shared_weights:  # the batch split into groups, as the layer does
                groups = _batch_groups(z.shape[0])
                given = {k: v.reshape(groups, v.shape[0] // groups, *v.shape[1:]) for k, v in common.items() if k != "W"}
            args = _tables(layer, stmt, given)
            lengths = {"X": {"q[c]": layer.XL}, "W": {"q[s]": layer.WL}, "Y": {"q[j]": layer.YL}}.get(name)  # as the layer runs them
            out[f"grad_{name}_ms"] = _time(
                lambda stmt=stmt, args=args, lengths=lengths: insum(stmt, precision=layer.precision, lengths=lengths, **args))
    return out


def _tables(layer, stmt: str, given: dict) -> dict:
    """The tensors a gradient statement reads: `given` ones, else the layer's tables."""
    import re

    names = set(re.findall(r"([A-Z][A-Z0-9]*)\[", stmt.split("=", 1)[1]))
    dtype = given["X"].dtype
    return {n: given[n] if n in given else (getattr(layer, n).to(dtype) if getattr(layer, n).is_floating_point()
            else getattr(layer, n)) for n in names}


def uvu(rows: list, budget_end: float, libs: dict) -> None:
    for edges in (8,) if SMOKE else (10_000, 40_000):
        if time.time() > budget_end:
            print(f"budget spent: skipping uvu E={edges}")
            continue
        row = _uvu_point(edges, libs)
        rows.append(row)
        print(json.dumps(row), flush=True)
        _save(rows)
        torch.cuda.empty_cache()


def _uvu_point(edges: int, libs: dict) -> dict:
    from e3nn import o3

    from insum import insum
    from insum.nn import TensorProduct
    from insum.nn.tensor_product import mace_instructions

    cue, cuet, oeq = libs.get("cue"), libs.get("cuet"), libs.get("oeq")
    irreps1 = o3.Irreps("4x0e+4x1o" if SMOKE else "128x0e+128x1o+128x2e")
    irreps2 = o3.Irreps("0e+1o+2e+3o")
    irreps_out, ins = mace_instructions(irreps1, irreps2, 3)
    irreps_out = o3.Irreps(str(irreps_out))
    torch.manual_seed(edges)
    ref = o3.TensorProduct(irreps1, irreps2, irreps_out, ins, shared_weights=False, internal_weights=False).to(DEVICE)
    x1 = torch.randn(edges, irreps1.dim, device=DEVICE)
    x2 = torch.randn(edges, irreps2.dim, device=DEVICE)
    w = torch.randn(edges, ref.weight_numel, device=DEVICE)
    g = torch.randn(edges, irreps_out.dim, device=DEVICE)
    layer64 = TensorProduct.from_e3nn(ref, backend="torch").to(DEVICE).double()
    with torch.no_grad():
        expect = layer64(x1.double(), x2.double(), w.double())
    row = {"case": "uvu", "edges": edges, "irreps_in1": str(irreps1), "irreps_out_dim": irreps_out.dim,
           "paths": len(ins), "weight_numel": ref.weight_numel}
    x1g, x2g, wg = (t.clone().requires_grad_() for t in (x1, x2, w))

    def measure(name, call, check=True):
        try:
            with torch.no_grad():
                out = call(x1, x2, w)
                if check:
                    row[f"{name}_err"] = relative_error(out, expect)
                else:
                    row[f"{name}_out_dim"] = out.shape[-1]
                row[f"{name}_fwd_ms"] = _time(lambda: call(x1, x2, w))
            row[f"{name}_fb_ms"] = _time(_fwd_bwd(lambda: call(x1g, x2g, wg), [x1g, x2g, wg], [], g))
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()

    if "e3nn" in MEASURE:
        measure("e3nn", ref)
    if MEASURE & {"layer", "insum"}:
        layer = TensorProduct.from_e3nn(ref).to(DEVICE)  # output="gather", the default for uvu paths
        measure("insum", layer)
    if "insum" in MEASURE:
        measure("insum_flat", TensorProduct.from_e3nn(ref, output="flat").to(DEVICE))
        measure("insum_views", TensorProduct.from_e3nn(ref, output="views").to(DEVICE))
        # rows sorted by CG entry count, one launch per bucket (opt-in; 568 -> 239 entry slots per edge, 215 real)
        measure("insum_buckets4", TensorProduct.from_e3nn(ref, row_buckets=4).to(DEVICE))
        try:
            tensors = layer.statement_tensors(x1, x2, w)
            with torch.no_grad():
                row["statement_fwd_ms"] = _time(lambda: insum(layer.statement, **layer.statement_facts(), **tensors))
        except Exception as e:  # noqa: BLE001
            row["statement_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if cuet is not None and "cue" in MEASURE:
        try:
            mod = cuet.ChannelWiseTensorProduct(
                _cue_irreps(cue, str(irreps1)), _cue_irreps(cue, str(irreps2)),
                [cue.O3(l, (-1) ** l) for l in range(4)],  # noqa: E741
                layout=cue.mul_ir, shared_weights=False, internal_weights=False, device=DEVICE,
            )
            row["cue_weight_numel"] = mod.weight_numel
            # Same paths and sizes; its path order and normalisation differ from e3nn's, so
            # the output is not compared.
            measure("cue", mod, check=False)
        except Exception as e:  # noqa: BLE001
            row["cue_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()
    if oeq is not None and "oeq" in MEASURE:
        try:
            problem = oeq.TPProblem(str(irreps1), str(irreps2), str(irreps_out), [(*i, 1.0) for i in ins],
                                    shared_weights=False, internal_weights=False)
            op = oeq.TensorProduct(problem, torch_op=True)
            measure("oeq", op)
        except Exception as e:  # noqa: BLE001
            row["oeq_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            traceback.print_exc()
    return row


def compiled(rows: list, budget_end: float, libs: dict) -> None:
    """e3nn and insum's layer under torch.compile at one grid point (fullgraph for insum)."""
    from e3nn import o3

    from insum.nn import FullyConnectedTensorProduct

    if time.time() + 60 > budget_end:
        print("budget spent: skipping compile")
        return
    L, C, batch = (1, 4, 16) if SMOKE else (2, 32, 10_000)
    ref = o3.FullyConnectedTensorProduct(_chain(C, L), _chain(1, L), _chain(C, L)).to(DEVICE)
    layer = FullyConnectedTensorProduct.from_e3nn(ref)
    x1 = torch.randn(batch, ref.irreps_in1.dim, device=DEVICE)
    x2 = torch.randn(batch, ref.irreps_in2.dim, device=DEVICE)
    row = {"case": "compiled", "L": L, "C": C, "batch": batch}
    for name, module, options in (("insum", layer, {"fullgraph": True}), ("e3nn", ref, {})):
        try:
            start = time.time()
            fn = torch.compile(module, **options)
            with torch.no_grad():
                row[f"{name}_compiled_err"] = relative_error(fn(x1, x2), ref(x1, x2))
                row[f"{name}_compile_s"] = time.time() - start
                row[f"{name}_compiled_fwd_ms"] = _time(lambda fn=fn: fn(x1, x2))
                row[f"{name}_eager_fwd_ms"] = _time(lambda module=module: module(x1, x2))
        except Exception as e:  # noqa: BLE001
            row[f"{name}_compiled_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        print(json.dumps(row), flush=True)
    rows.append(row)
    print(json.dumps(row), flush=True)


SAVE_TO: list = []  # the partial-results file (set by main), rewritten after every row


def _save(rows: list) -> None:
    if SAVE_TO:
        SAVE_TO[0].write_text(json.dumps(rows, indent=1))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if math.isfinite(v) else "nan"
    return str(v)


def table(rows: list) -> str:
    lines = []
    grid = [r for r in rows if r["case"] == "fctp"]
    if grid:
        lines.append("FullyConnectedTensorProduct, batch 10,000, fp32 (ms; err vs float64)")
        lines.append("L  C  | e3nn fwd/fb | insum tf32 fwd/fb | insum ieee fwd/fb | stmt | views | cue fwd/fb | oeq fwd/fb | err tf32/ieee/cue/oeq")
        for r in grid:
            lines.append(" ".join(_fmt(x) for x in (
                r["L"], r["C"], "|", r.get("e3nn_fwd_ms"), r.get("e3nn_fb_ms"), "|", r.get("insum_tf32_fwd_ms"),
                r.get("insum_tf32_fb_ms"), "|", r.get("insum_ieee_fwd_ms"), r.get("insum_ieee_fb_ms"), "|",
                r.get("statement_fwd_ms"), "|", r.get("insum_views_fwd_ms"), "|", r.get("cue_fwd_ms"), r.get("cue_fb_ms"), "|", r.get("oeq_fwd_ms"),
                r.get("oeq_fb_ms"), "|", r.get("insum_tf32_err"), r.get("insum_ieee_err"), r.get("cue_err"), r.get("oeq_err"))))
        for anchor in ("e3nn", "cue", "oeq"):
            for prec in ("tf32", "ieee", "views", "gather"):
                for what in ("fwd", "fb"):
                    ratios = [r[f"{anchor}_{what}_ms"] / r[f"insum_{prec}_{what}_ms"] for r in grid
                              if r.get(f"insum_{prec}_{what}_ms") and r.get(f"{anchor}_{what}_ms")]
                    if ratios:
                        lines.append(f"speed-up over {anchor} ({what}, insum {prec}): geomean {geomean(ratios):.2f}x, "
                                     f"min {min(ratios):.2f}x, max {max(ratios):.2f}x over {len(ratios)} points")
    for r in rows:
        if r["case"] == "uvu":
            lines.append(f"uvu E={r['edges']} ({r['paths']} paths, out dim {r['irreps_out_dim']}): " + ", ".join(
                f"{k}={_fmt(v)}" for k, v in r.items() if k.endswith(("_ms", "_err", "_error"))))
        if r["case"] == "compiled":
            lines.append("torch.compile: " + ", ".join(f"{k}={_fmt(v)}" for k, v in r.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="fctp,uvu")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget", type=float, default=200.0)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (TRITON_INTERPRET=1)")
    parser.add_argument("--measure", default="e3nn,insum,cue,oeq", help="which implementations to time")
    parser.add_argument("--tag", default="", help="suffix of the output files")
    parser.add_argument("--L", default="1,2,3", help="fctp: the degrees L of the grid")
    parser.add_argument("--C", default="16,32,64", help="fctp: the multiplicities C of the grid")
    args = parser.parse_args()
    GRID.update(L=tuple(int(v) for v in args.L.split(",")), C=tuple(int(v) for v in args.C.split(",")))
    global DEVICE, SMOKE
    if args.smoke:
        DEVICE, SMOKE = "cpu", True
    start = time.time()
    libs = {}
    anchors = args.measure.split(",")
    MEASURE.clear()
    MEASURE.update(anchors)
    cue = _optional("cuequivariance") if "cue" in anchors else None
    cuet = _optional("cuequivariance_torch") if cue is not None else None
    if cuet is not None:
        libs.update(cue=cue, cuet=cuet)
    oeq = _optional("openequivariance") if "oeq" in anchors else None
    if oeq is not None:
        libs["oeq"] = oeq
    from benchmarks.common import environment

    env = environment(torch.device(DEVICE))
    print(json.dumps(env))
    if not SMOKE:
        # The many kernels of the sweep (forward and derived backward, per shape) are tuned
        # with shorter measurements; the reported times use the full do_bench.
        from benchmarks.common import shorten_autotune

        shorten_autotune()
    rows: list = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    SAVE_TO.append(Path(args.out) / f"tensor_product{args.tag}_partial.json")
    parts = args.parts.split(",")
    end = start + args.budget
    for part, fn in (("uvu", uvu), ("fctp", fctp), ("compile", compiled)):
        if part in parts:
            try:
                fn(rows, end, libs)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tensor_product{args.tag}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    text = table(rows)
    (out / f"tensor_product{args.tag}_table.txt").write_text(text + "\n")
    print(f"\n(total {time.time() - start:.0f} s)\n" + text)


if __name__ == "__main__":
    main()
