"""The channel-wise ("uvu") tensor product of a MACE interaction block: every variant, one run.

    python -m benchmarks.explore.uvu_variants [--out DIR] [--workers 12] [--budget 85] [--smoke]

in1 = 128x0e+128x1o+128x2e, in2 = the spherical harmonics 0e+1o+2e+3o, every path into
0e+1o+2e+3o (17 paths, out dim 9088), one weight vector per edge, fp32, E = 10,000 and
40,000 edges (issue 12). Bytes per edge: x1 4608, x2 64, weight 8704, output 36352: 49.7 KB,
0.104 ms at E = 10k on 4.8 TB/s (0.414 ms at 40k), the floor every variant is held to.

Statement variants, one kernel each: a sweep ranks the tile configurations the tuner would
try (at E = 10k; at 40k the three fastest of 10k) by the mean of 10 back-to-back launches
(CUDA events), and the fastest is timed by `do_bench` (median, L2 flushed) and printed with
its configuration and plan:

  stmt_gather      the layer's statement `Z[b,p,u]` (component-major Z, X gathered), its
                   plan (with the rows' entry counts declared: M=b (edges) K=q N=u, grid p
                   walked first)
  stmt_gather_pb   the same statement under the conventional plan, M=p K=q N=u, grid b (the
                   schedule's choice before declared lengths entered its cost model)
  stmt_indexed     output="indexed"'s statement `Z[b, ZO[p,u]] = ...`: X gathered, the output
                   stored in e3nn's layout (stride-d stores along u), its plan
  stmt_zi          `Z[b, ZI[p,u]] = ... X[b, XI[CGI[p,q],u]] ...`: e3nn layouts through nested
                   tables (stride-d loads and stores along u), its plan (grid p first)
  stmt_flat        output="flat"'s statement `Z[b,t] = FV[q,t] * Y[b,FJ[q,t]] * X[b,FX[q,t]]
                   * W[b,FR[t]]`: one column per e3nn output position, contiguous tiles
  stmt_flat_tb     the same statement, M=t N=b (the cost model's cheapest, not chosen)

The gather layer's layout changes (`insum.nn.layout`: each run of equal [U, D] irrep blocks
one transpose statement `F[b,i,u,m] = T[b,i,m,u]` with u and m tiled, all runs one launch):
first every run's kernel is swept (`copy_<change>_<n>x<D>`, tiles TRANSPOSE_CONFIGS /
PLAIN_COPY_CONFIGS; the layer's calls then use the fastest), then each change is timed
whole: `layout_out` (Z -> the output, forward), `layout_x1` (x1 -> X, forward and again in
the backward), `layout_dz` (the output gradient -> DZ), `layout_dx1` (DX -> x1's gradient),
beside the gather through the flat table that the layer ran before (`gather_<change>`,
index_select) and torch's strided copies per run (`tcopy_<change>`), each against the HBM
time of its bytes (`note`) and checked exactly equal to the gather (`err`: max difference).
`grad_Y_jgrid`: the gather layer's dY statement with j on the grid (M=b, K=u; each
program stops at its own j's entry count), a plan the schedule does not offer (equal to
grad_Y's output on the CPU).

And the gather layer's former output gather alone, component-major Z into e3nn's layout: `gather_torch`
(its `index_select`, as the layer runs it) and `gather_insum` (`O[b, t] = Z[b, OI[t]]`, the
configurations GATHER_CONFIGS), each against the HBM time of its bytes (`note`).

Layer variants (`TensorProduct` as a user calls it; its kernels take the best configuration
of the sweep above, so no autotuning runs inside the timed calls): `layer_gather`
(output="gather", the default: x1's layout change, statement, the output's; on the GPU both
block transposes), `layer_gather_old` (the same layer with its layout changes as the gathers
through the flat tables, index_select, as before: the A/B of the block transposes in one
process), `layer_indexed`
(output="indexed", opt-in: X gather, the statement storing e3nn's layout; its backward is
the gather layer's) and `layer_flat` (output="flat", opt-in: one launch), forward and
forward+backward (`torch.autograd.grad` of all three inputs). Their backward statements are
swept the same way: `grad_X/W/Y` (the gather layer's, component-major, after gathering the
output gradient) and `flat_grad_X/W/Y` (the flat layer's, in e3nn's layouts).
cuEquivariance (`ChannelWiseTensorProduct`; its path order and normalisation differ from
e3nn's, so its output is not compared) and OpenEquivariance (e3nn's instructions; compared)
where they import, forward and forward+backward.

Every insum output is compared with a float64 reference (the torch lowering of today's
statement, in chunks of edges) by relative Frobenius error, the layers' gradients too; a
variant above 1e-5 is marked FAILED. Compiling every (kernel, configuration) pair is the slow
part: `--workers N` first compiles them in N processes (Triton's disk cache; stopped at half
the budget), then one process times everything. `--budget` seconds: parts left when it runs
out are skipped and named; the order is, at each size, the statements the layers run, the
layers and the anchors, then at each size the exploratory plans. `--smoke`: CPU
(interpreter), tiny irreps, two configurations per kernel, no timing: a check of the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the smoke run: the interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from insum.bind import bind  # noqa: E402
from insum.codegen.schedule import plan_of, rank  # noqa: E402
from insum.codegen.tune import configs_for, prune_configs  # noqa: E402
from insum.execute import length_facts  # noqa: E402
from insum.nn import TensorProduct  # noqa: E402
from insum.nn.layout import COPY_TO_COMPONENTS, COPY_TO_FLAT, TO_COMPONENTS, TO_FLAT, copy_kernel  # noqa: E402
from insum.nn.tensor_product import mace_instructions  # noqa: E402
from insum.parser import parse  # noqa: E402
from insum.runtime import Kernel, kernel_for  # noqa: E402

from ..common import median_ms, relative_error  # noqa: E402

IRREPS1, IRREPS2, LMAX = "128x0e+128x1o+128x2e", "0e+1o+2e+3o", 3
SMOKE_IRREPS1 = "4x0e+4x1o+4x2e"
EDGES, SMOKE_EDGES = (10_000, 40_000), (7,)
TOLERANCE = 1e-5
ZI_STATEMENT = "Z[b, ZI[p, u]] = CGV[p, q] * Y[b, CGJ[p, q]] * X[b, XI[CGI[p, q], u]] * W[b, PR[p], u]"
GATHER_STATEMENT = "O[b, t] = Z[b, OI[t]]"
# The layout copies' tiles (`insum.nn.layout`): a transpose holds u (M) by m (N) of one
# block, a plain copy (0e runs) edges (M) by channels (N); clamped to the extents.
TRANSPOSE_CONFIGS = [{"BLOCK_M": 128, "BLOCK_N": 8, "num_warps": w, "num_stages": 2} for w in (4, 2)] + [
    {"BLOCK_M": 64, "BLOCK_N": 8, "num_warps": 2, "num_stages": 2}]
PLAIN_COPY_CONFIGS = [{"BLOCK_M": m, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2} for m in (4, 8, 16)]
GATHER_CONFIGS = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": 4, "num_stages": 2} for m, n in ((4, 512), (8, 256), (16, 128))]


@dataclasses.dataclass
class Case:
    """One statement on one problem size: the kernel, its binding and how to read its output."""

    name: str
    kernel: Kernel
    bound: object
    to_e3nn: object  # output -> e3nn-layout [E, 9088] (outside the timing); None: not compared


def _layers(device, smoke: bool) -> dict:
    irreps1 = SMOKE_IRREPS1 if smoke else IRREPS1
    irreps_out, ins = mace_instructions(irreps1, IRREPS2, LMAX)
    # (the smoke run: the generated kernels in the interpreter, layout copies included)
    make = dict(shared_weights=False, internal_weights=False)
    kernels = {"backend": "triton"} if smoke else {}
    gather_old = TensorProduct(irreps1, IRREPS2, irreps_out, ins, output="gather", **make, **kernels).to(device)
    gather_old._copies = lambda layout, t: False  # the layout changes as gathers (index_select), as before
    return {
        "gather": TensorProduct(irreps1, IRREPS2, irreps_out, ins, output="gather", **make, **kernels).to(device),
        "gather_old": gather_old,
        "indexed": TensorProduct(irreps1, IRREPS2, irreps_out, ins, output="indexed", **make, **kernels).to(device),
        "flat": TensorProduct(irreps1, IRREPS2, irreps_out, ins, output="flat", **make, **kernels).to(device),
        "reference": TensorProduct(irreps1, IRREPS2, irreps_out, ins, backend="torch", output="gather", **make).to(device).double(),
        "instructions": ins,
        "irreps": (irreps1, IRREPS2, str(irreps_out)),
    }


def _inputs(layer: TensorProduct, edges: int, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(edges)
    shape = {"x1": layer.irreps_in1.dim, "x2": layer.irreps_in2.dim, "w": layer.weight_numel, "g": layer.irreps_out.dim}
    return {k: torch.randn(edges, n, device=device, generator=gen) for k, n in shape.items()}


def _reference(layer64: TensorProduct, x: dict, chunk: int = 4096) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The float64 output and the gradients of x1, x2 and the weight for the output gradient
    x["g"], in chunks of edges (every edge is its own product: per-edge weights)."""
    outs, grads = [], []
    for s in range(0, x["x1"].shape[0], chunk):
        leaves = [x[k][s:s + chunk].double().requires_grad_() for k in ("x1", "x2", "w")]
        out = layer64(*leaves)
        grads.append(torch.autograd.grad(out, leaves, x["g"][s:s + chunk].double()))
        outs.append(out.detach())
    return torch.cat(outs), [torch.cat(parts) for parts in zip(*grads)]


def _case(name: str, stmt: str, tensors: dict, lengths: dict, to_e3nn, unique=frozenset(), pick=None, grid_first=None) -> Case:
    """The kernel the layer's call would use (pick None), or one of a chosen candidate plan."""
    bound = bind(parse(stmt), tensors)
    bound, declared = length_facts(bound, lengths)
    kernel = kernel_for(bound, "tf32", unique_indices=frozenset(unique), lengths=declared)
    if pick is not None or grid_first is not None:
        plan = plan_of(kernel.spec, pick(rank(kernel.spec))) if pick is not None else kernel.plan
        if grid_first is not None:
            plan = dataclasses.replace(plan, grid_first=grid_first)
        kernel = Kernel(kernel.spec, plan)
    return Case(name, kernel, bound, to_e3nn)


def _tiles(*wanted):
    def pick(candidates):
        for c in candidates:
            if tuple(v for _, v in c.tiles) == wanted and not c.stacked:
                return c
        raise LookupError(f"no candidate with tiles {wanted}")
    return pick


def _cases(layers: dict, x: dict) -> list[Case]:
    """Every statement variant on the inputs x (forward, then the gradient statements)."""
    gather, flat = layers["gather"], layers["flat"]
    E = x["x1"].shape[0]
    t = gather.statement_tensors(x["x1"], x["x2"], x["w"])
    out_index = gather.OUT_INDEX
    lengths = {"q[p]": gather.CGL}

    def from_z(z):
        return z.reshape(E, -1).index_select(1, out_index)

    P, U = gather.CGV.shape[0], gather.X_INDEX.shape[1]
    zi = {"Z": torch.empty(E, gather.irreps_out.dim, device=x["x1"].device), "ZI": gather.OUT_INVERSE.view(P, U).int(),
          "XI": gather.X_INDEX.int(), "X": x["x1"], **{k: v for k, v in t.items() if k != "X"}}
    ft = flat.statement_tensors(x["x1"], x["x2"], x["w"])
    indexed = layers["indexed"]
    # In the order the run needs them (the compile workers take them in this order): the
    # default layer's layout copies, statement and gradient statements (on a random
    # component-major output gradient), then the exploratory ones.
    cases = _copy_cases(gather, x)
    cases.append(_case("stmt_gather", gather.statement, t, lengths, from_z))
    dz = torch.randn(E, P, U, device=x["x1"].device)
    given = {"Y": t["Y"], "X": t["X"], "W": t["W"], "DZ": dz}
    rows = {"X": ("q[c]", "XL"), "W": ("q[s]", "WL"), "Y": ("q[j]", "YL")}
    for grad, stmt in gather.gradient_statements.items():
        key, length = rows[grad]
        cases.append(_case(f"grad_{grad}", stmt, _statement_tensors(gather, stmt, given), {key: getattr(gather, length)}, None))
    # dY with the input-2 position j on the grid (no candidate of the schedule has it): each
    # program stops at its own j's entry count (215 entry steps per edge instead of 16 x 18).
    stmt = gather.gradient_statements["Y"]
    cases.append(_case("grad_Y_jgrid", stmt, _statement_tensors(gather, stmt, given), {"q[j]": gather.YL}, None,
                       pick=lambda ranked: dataclasses.replace(ranked[0], tiles=(("M", "b"), ("K", "u")), grid=("j",),
                                                               stacked=())))
    cases += [
        _case("stmt_indexed", indexed.statement, indexed.statement_tensors(x["x1"], x["x2"], x["w"]), lengths,
              lambda z: z, unique={"ZO"}),
        _case("stmt_gather_pb", gather.statement, t, lengths, from_z, pick=_tiles("p", "q", "u"), grid_first=False),
        _case("stmt_zi", ZI_STATEMENT, zi, lengths, lambda z: z, unique={"ZI"}),
        _case("stmt_flat", flat.statement, ft, {"q[t]": flat.FL}, lambda z: z),
        _case("stmt_flat_tb", flat.statement, ft, {"q[t]": flat.FL}, lambda z: z, pick=_tiles("t", "q", "b")),
    ]
    # The flat layer's gradient statements, in e3nn's layouts.
    given = {"Y": x["x2"], "X": x["x1"], "W": x["w"], "DZ": dz.view(E, -1)}
    rows = {"X": ("q[s]", "GXL"), "W": ("q[r]", "GWL"), "Y": ("q[j]", "GYL")}
    for grad, stmt in flat.gradient_statements.items():
        key, length = rows[grad]
        cases.append(_case(f"flat_grad_{grad}", stmt, _statement_tensors(flat, stmt, given), {key: getattr(flat, length)}, None))
    return cases


def _layout_tensors(layer: TensorProduct, x: dict) -> dict:
    """Per layout change of the gather layer, (layout, component-major tensor, e3nn-layout
    tensor) on this size's inputs: the forward's output (Z -> out) and x1 (x1 -> X), the
    backward's output gradient (g -> DZ) and x1's gradient (DX -> dx1)."""
    E = x["x1"].shape[0]
    out, xl = layer._out_layout, layer._x_layout
    z = torch.randn(E, out.rows, out.channels, device=x["x1"].device)
    dx = torch.randn(E, xl.rows, xl.channels, device=x["x1"].device)
    return {"out": (out, z, True), "x1": (xl, x["x1"], False), "dz": (out, x["g"], False), "dx1": (xl, dx, True)}


def _copy_cases(layer: TensorProduct, x: dict) -> list[Case]:
    """One case per run of each layout change (the kernels the layer's copies share,
    `insum.nn.layout.copy_kernel`), swept so that the layer's first calls find their tiles."""
    cases = []
    for name, (layout, source, to_flat) in _layout_tensors(layer, x).items():
        flat = torch.empty(source.shape[0], layout.flat_dim, device=source.device) if to_flat else source
        comp = source if to_flat else torch.empty(source.shape[0], layout.rows, layout.channels, device=source.device)
        for kind, fv, cv in layout._views(flat, comp):
            texts = (TO_FLAT, TO_COMPONENTS) if kind == "transpose" else (COPY_TO_FLAT, COPY_TO_COMPONENTS)
            bound = bind(parse(texts[0] if to_flat else texts[1]), {"F": fv, "T": cv})
            D = fv.shape[3] if kind == "transpose" else 1
            cases.append(Case(f"copy_{name}_{fv.shape[1]}x{D}", copy_kernel(bound), bound, None))
    return cases


def _statement_tensors(layer: TensorProduct, stmt: str, given: dict) -> dict:
    """The tensors a gradient statement reads: `given` ones, else the layer's tables (value
    tables in float32, as the layer's backward converts them)."""
    names = re.findall(r"([A-Z][A-Z0-9]*)\[", stmt.split("=", 1)[1])
    return {n: given[n] if n in given else layer._table(n, torch.float32) if layer._buffers[n].is_floating_point()
            else layer._buffers[n] for n in names}


def _configs(case: Case, smoke: bool) -> list[dict]:
    table = configs_for(case.kernel.plan)
    if case.name.startswith("copy_"):
        table = TRANSPOSE_CONFIGS if dict(case.kernel.plan.tiles).get("N") == "m" else PLAIN_COPY_CONFIGS
    configs = prune_configs(case.kernel.plan, table, case.kernel.prepared(case.bound).extents)
    return configs[:2] if smoke else configs


def _bucket(case: Case) -> tuple:
    return case.kernel.bucket(case.kernel.prepared(case.bound))


def _sweep(case: Case, expected: torch.Tensor | None, smoke: bool, only=None, configs=None) -> dict:
    """Time the case under each configuration (configs: these instead of the tuner's list;
    only: the indices to run, untimed: the compile workers); keep the best on the kernel and
    its launcher, so that the layer's calls use it."""
    launcher = case.kernel.prepared(case.bound)
    out = case.bound.output()
    row = {"case": case.name, "plan": str(case.kernel.plan).replace("\n", "; "), "configs": []}
    best = None
    for index, config in enumerate(configs if configs is not None else _configs(case, smoke)):
        if only is not None and index not in only:
            continue
        try:
            launcher.set_config(config)
            launcher.run(case.bound.tensors, out)
            if only is not None:
                continue
            ms = float("nan") if smoke else _quick_ms(lambda: launcher.run(case.bound.tensors, out))
        except Exception as e:  # noqa: BLE001 (a configuration that does not compile or fit is skipped)
            row["configs"].append({"config": config, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        row["configs"].append({"config": config, "ms": ms})
        if best is None or ms < best[0] or math.isnan(best[0]):
            best = (ms, config)
    if only is not None or best is None:
        return row
    launcher.set_config(best[1])
    case.kernel.tuned[_bucket(case)] = best[1]
    launcher.run(case.bound.tensors, out)
    ms = float("nan") if smoke else median_ms(lambda: launcher.run(case.bound.tensors, out), warmup=5, rep=25)
    row.update(ms=ms, config=best[1])
    if expected is not None and case.to_e3nn is not None:
        row["err"] = relative_error(case.to_e3nn(out), expected)
    return row


def _quick_ms(fn, runs: int = 10) -> float:
    """Mean milliseconds of `runs` back-to-back calls after two (CUDA events): the sweep's
    ranking; the configuration it picks is then timed by do_bench."""
    fn()
    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(runs):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / runs


def _time_layer(name: str, layer: TensorProduct, x: dict, expected: torch.Tensor, expected_grads: list, smoke: bool) -> dict:
    """Forward and forward+backward times, the output's error and the gradients' (the largest
    of the three) against the float64 reference's, on every edge (the swept signatures: no
    tuning inside these calls)."""
    row = {"case": name}
    leaves = [x[k].clone().requires_grad_() for k in ("x1", "x2", "w")]
    got = torch.autograd.grad(layer(*leaves), leaves, x["g"])
    row["fb_err"] = max(relative_error(a, b) for a, b in zip(got, expected_grads))
    with torch.no_grad():
        out = layer(x["x1"], x["x2"], x["w"])
        row["err"] = relative_error(out, expected)
        if not smoke:
            row["ms"] = median_ms(lambda: layer(x["x1"], x["x2"], x["w"]), warmup=5, rep=25)

    def step():
        torch.autograd.grad(layer(*leaves), leaves, x["g"])

    step()
    if not smoke:
        row["fb_ms"] = median_ms(step, warmup=5, rep=25)
    return row


def _anchors(layers: dict, x: dict, expected, smoke: bool) -> list[dict]:
    """cuEquivariance and OpenEquivariance, where they import (forward, forward+backward)."""
    rows = []
    irreps1, irreps2, irreps_out = layers["irreps"]
    leaves = [x[k].clone().requires_grad_() for k in ("x1", "x2", "w")]

    def measure(name, call, check):
        row = {"case": name}
        try:
            with torch.no_grad():
                out = call(x["x1"], x["x2"], x["w"])
                if check:
                    row["err"] = relative_error(out, expected)
                row["ms"] = float("nan") if smoke else median_ms(lambda: call(x["x1"], x["x2"], x["w"]), warmup=5, rep=25)
            g = torch.randn_like(out)

            def step():
                torch.autograd.grad(call(*leaves), leaves, g)

            step()
            row["fb_ms"] = float("nan") if smoke else median_ms(step, warmup=5, rep=25)
        except Exception as e:  # noqa: BLE001 (an anchor that fails is reported, not fatal)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)

    try:
        import cuequivariance as cue
        import cuequivariance_torch as cuet
    except Exception as e:  # noqa: BLE001
        rows.append({"case": "cue", "error": f"not importable: {type(e).__name__}: {str(e)[:120]}"})
    else:
        try:
            if "cue" not in layers:  # built once, for every size
                layers["cue"] = cuet.ChannelWiseTensorProduct(
                    cue.Irreps("O3", irreps1), cue.Irreps("O3", irreps2), [cue.O3(l, (-1) ** l) for l in range(LMAX + 1)],  # noqa: E741
                    layout=cue.mul_ir, shared_weights=False, internal_weights=False, device=x["x1"].device)
            measure("cue", layers["cue"], check=False)  # same paths and sizes, its own path order and normalisation
        except Exception as e:  # noqa: BLE001
            rows.append({"case": "cue", "error": f"{type(e).__name__}: {str(e)[:200]}"})
    try:
        import openequivariance as oeq
    except Exception as e:  # noqa: BLE001
        rows.append({"case": "oeq", "error": f"not importable: {type(e).__name__}: {str(e)[:120]}"})
    else:
        try:
            if "oeq" not in layers:  # built (and its kernels compiled) once, for every size
                problem = oeq.TPProblem(irreps1, irreps2, irreps_out, [(*i, 1.0) for i in layers["instructions"]],
                                        shared_weights=False, internal_weights=False)
                layers["oeq"] = oeq.TensorProduct(problem, torch_op=True)
            measure("oeq", layers["oeq"], check=True)
        except Exception as e:  # noqa: BLE001
            rows.append({"case": "oeq", "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return rows


def _output_gathers(layer: TensorProduct, expected: torch.Tensor, smoke: bool) -> list[dict]:
    """The gather layer's output permutation alone (component-major Z -> e3nn's layout), by
    torch's index_select and by an insum gather statement, on Z made from the expected output."""
    z = expected.float().index_select(1, layer.OUT_INVERSE).contiguous()
    per_edge = 2 * z.shape[1] * z.element_size()
    note = f"{per_edge} B per edge read and written: {z.shape[0] * per_edge / 4.8e9:.3f} ms at 4.8 TB/s"
    row = {"case": "gather_torch", "note": note}
    out = z.index_select(1, layer.OUT_INDEX)
    row["err"] = relative_error(out, expected)
    row["ms"] = float("nan") if smoke else median_ms(lambda: z.index_select(1, layer.OUT_INDEX), warmup=5, rep=25)
    case = _case("gather_insum", GATHER_STATEMENT, {"Z": z, "OI": layer.OUT_INDEX.int()}, {}, lambda o: o)
    swept = _sweep(case, expected, smoke, configs=GATHER_CONFIGS[:1] if smoke else GATHER_CONFIGS)
    return [row, {**{k: v for k, v in swept.items() if k != "configs"}, "note": f"{note} | {swept.get('config')}"}]


def _layout_rows(layer: TensorProduct, x: dict, smoke: bool) -> list[dict]:
    """Each layout change of the gather layer alone: the block transposes the layer runs now
    (`layout_<name>`, one launch), the gather through the flat table it ran before
    (`gather_<name>`, index_select) and torch's strided copy per run (`tcopy_<name>`), each
    against the HBM time of its bytes (read and written once) and checked equal to the gather."""
    rows = []
    tables = {"out": layer.OUT_INDEX, "x1": layer.X_INDEX.reshape(-1), "dz": layer.OUT_INVERSE, "dx1": layer.X_INVERSE}
    for name, (layout, source, to_flat) in _layout_tensors(layer, x).items():
        E = source.shape[0]
        flat_source = source.reshape(E, -1)
        per_edge = 2 * layout.flat_dim * source.element_size()
        note = f"{per_edge} B per edge read and written: {E * per_edge / 4.8e9:.3f} ms at 4.8 TB/s"

        def new(layout=layout, source=source, to_flat=to_flat):
            return layout.to_flat(source) if to_flat else layout.to_components(source)

        def old(flat_source=flat_source, index=tables[name]):
            return flat_source.index_select(1, index)

        def torch_copy(layout=layout, source=source, to_flat=to_flat):
            E = source.shape[0]
            target = source.new_empty(E, layout.flat_dim) if to_flat else source.new_empty(E, layout.rows, layout.channels)
            flat, comp = (target, source) if to_flat else (source, target)
            for kind, fv, cv in layout._views(flat, comp):
                if to_flat:
                    fv.copy_(cv.transpose(-1, -2) if kind == "transpose" else cv)
                else:
                    cv.copy_(fv.transpose(-1, -2) if kind == "transpose" else fv)
            return target

        expected = old().reshape(E, -1)
        for case, fn in ((f"layout_{name}", new), (f"gather_{name}", old), (f"tcopy_{name}", torch_copy)):
            row = {"case": case, "note": note}
            try:
                got = fn().reshape(E, -1)
                row["err"] = float((got - expected).abs().max()) if got.shape == expected.shape else float("inf")
                row["ms"] = float("nan") if smoke else median_ms(fn, warmup=5, rep=25)
            except Exception as e:  # noqa: BLE001 (reported, not fatal)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
    return rows


def warm(shard: int, shards: int, smoke: bool) -> None:
    """Compile this shard's (kernel, configuration) pairs (round robin over all of them)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = _layers(device, smoke)
    x = _inputs(layers["gather"], (SMOKE_EDGES if smoke else EDGES)[0], device)
    position = 0
    for case in _cases(layers, x):
        count = len(_configs(case, smoke))
        mine = {i for i in range(count) if (position + i) % shards == shard}
        position += count
        _sweep(case, None, smoke, only=mine)


def _print_table(rows: list[dict]) -> None:
    print("\nuvu tensor product, MACE-like (ms, do_bench medians; err vs float64)")
    print(f"{'E':>6} {'variant':16} {'fwd ms':>8} {'f+b ms':>8} {'err':>9}  note")
    for r in rows:
        if "edges" not in r:
            continue
        note = r.get("error") or r.get("note") or (f"{r['config']} | {r['plan']}" if "config" in r else "")
        flag = "  FAILED" if any(not r[k] <= TOLERANCE for k in ("err", "fb_err") if isinstance(r.get(k), float)) else ""
        cells = [f"{r[k]:8.3f}" if isinstance(r.get(k), float) else f"{'-':>8}" for k in ("ms", "fb_ms")]
        err = f"{r['err']:9.1e}" if isinstance(r.get("err"), float) else f"{'-':>9}"
        if isinstance(r.get("fb_err"), float):
            note = f"gradients err {r['fb_err']:.1e} " + note
        print(f"{r['edges']:>6} {r['case']:16} {cells[0]} {cells[1]} {err}  {note[:150]}{flag}")
    for edges in sorted({r["edges"] for r in rows if "edges" in r}):
        by = {r["case"]: r for r in rows if r.get("edges") == edges}
        for name in ("out", "x1", "dz", "dx1"):
            new, old, tcopy = by.get(f"layout_{name}", {}), by.get(f"gather_{name}", {}), by.get(f"tcopy_{name}", {})
            if isinstance(new.get("ms"), float) and isinstance(old.get("ms"), float):
                print(f"E={edges}: layout change {name}: block transposes {new['ms']:.3f} ms, gather {old['ms']:.3f} ms, "
                      f"torch strided copies {tcopy.get('ms', float('nan')):.3f} ms ({new['note']})")
        for anchor in ("cue", "oeq"):
            for name in ("layer_gather", "layer_gather_old", "layer_indexed", "stmt_gather", "layer_flat"):
                a, b = by.get(anchor, {}), by.get(name, {})
                for key in ("ms", "fb_ms"):
                    if isinstance(a.get(key), float) and isinstance(b.get(key), float) and b[key] > 0:
                        print(f"E={edges}: {name} {key} speed-up over {anchor}: {a[key] / b[key]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--workers", type=int, default=12, help="processes that compile first (0: none)")
    parser.add_argument("--budget", type=float, default=85.0, help="seconds; later parts are skipped")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--warm", default=None, help=argparse.SUPPRESS)  # "k/N": a compile worker
    args = parser.parse_args()
    if args.warm:
        shard, shards = map(int, args.warm.split("/"))
        warm(shard, shards, args.smoke)
        return
    start = time.time()
    if args.workers > 0:
        env = dict(os.environ, INSUM_CACHE_DIR=tempfile.mkdtemp(prefix="uvu_warm_"))  # their tuning results stay theirs
        command = [sys.executable, "-m", "benchmarks.explore.uvu_variants"] + (["--smoke"] if args.smoke else [])
        workers = [subprocess.Popen([*command, "--warm", f"{k}/{args.workers}"], env=env) for k in range(args.workers)]
        codes = []
        for worker in workers:  # at most half the budget: what is left compiles on first use
            try:
                codes.append(worker.wait(timeout=max(1.0, start + args.budget / 2 - time.time())))
            except subprocess.TimeoutExpired:
                worker.kill()
                codes.append("stopped")
        print(f"compiled in {args.workers} processes: {time.time() - start:.0f} s (exit codes {codes})", flush=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = _layers(device, args.smoke)
    rows: list[dict] = []
    fastest: dict[str, list[dict]] = {}  # per case, its fastest configurations at the first size
    sizes = SMOKE_EDGES if args.smoke else EDGES
    data = {}  # per size: inputs, float64 output and gradients, the cases (built on first use)
    # What the default layer runs first (its layout copies and statements: their best
    # configurations are what the layer then uses), the layer and the anchors next, at every
    # size; dY with j on the grid, the indexed layer (its statement first), the conventional
    # plan, the flat layer and the exploratory plans last (what the budget cuts).
    first = ["copies", "layouts", "stmt_gather", "grad_X", "grad_W", "grad_Y", "layers", "anchors"]
    later = ["grad_Y_jgrid", "stmt_indexed", "layer_indexed", "stmt_gather_pb", "output_gathers", "stmt_flat",
             "flat_grad_X", "flat_grad_W", "flat_grad_Y", "layer_flat", "stmt_zi", "stmt_flat_tb"]
    steps = [(e, n) for e in sizes for n in first] + [(e, n) for e in sizes for n in later]
    for edges, name in steps:
        if time.time() - start > args.budget:
            print(f"budget spent: skipping {name} at E={edges}")
            continue
        if edges not in data:
            x = _inputs(layers["gather"], edges, device)
            data[edges] = (x, *_reference(layers["reference"], x), {case.name: case for case in _cases(layers, x)})
        x, expected, expected_grads, cases = data[edges]
        if name in ("layers", "layer_indexed", "layer_flat"):
            for kind in {"layers": ("gather", "gather_old"), "layer_indexed": ("indexed",), "layer_flat": ("flat",)}[name]:
                rows.append({"edges": edges, **_time_layer(f"layer_{kind}", layers[kind], x, expected, expected_grads, args.smoke)})
                print(json.dumps(rows[-1]), flush=True)
            continue
        if name == "copies":  # every layout copy's kernel (the layer's copies then find their tiles)
            for case in [c for c in cases.values() if c.name.startswith("copy_")]:
                try:
                    row = _sweep(case, None, args.smoke, configs=fastest.get(case.name))
                    fastest.setdefault(case.name, [c["config"] for c in sorted(
                        (c for c in row["configs"] if "ms" in c), key=lambda c: c["ms"])[:2]])
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row = {"case": case.name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                rows.append({"edges": edges, **{k: v for k, v in row.items() if k != "configs"}})
                print(json.dumps(rows[-1]), flush=True)
            continue
        if name == "layouts":
            found = [{"edges": edges, **r} for r in _layout_rows(layers["gather"], x, args.smoke)]
            rows.extend(found)
            print(json.dumps(found), flush=True)
            continue
        if name == "output_gathers":
            rows.extend({"edges": edges, **r} for r in _output_gathers(layers["gather"], expected, args.smoke))
            print(json.dumps(rows[-2:]), flush=True)
            continue
        if name == "anchors":
            anchors = [{"edges": edges, **r} for r in _anchors(layers, x, expected, args.smoke)]
            rows.extend(anchors)
            print(json.dumps(anchors), flush=True)
            continue
        try:
            row = _sweep(cases[name], expected, args.smoke, configs=fastest.get(name))
            timed = sorted((c for c in row["configs"] if "ms" in c), key=lambda c: c["ms"])
            fastest.setdefault(name, [c["config"] for c in timed[:3]])
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append({"edges": edges, **row})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "configs"}), flush=True)
    layer = layers["gather"]
    per_edge = 4 * (layer.irreps_in1.dim + layer.irreps_in2.dim + layer.weight_numel + layer.irreps_out.dim)
    for edges in sizes:  # every byte read or written once, at the H200's 4.8 TB/s
        rows.append({"edges": edges, "case": "hbm_floor", "ms": edges * per_edge / 4.8e9,
                     "note": f"{per_edge} B per edge (x1, x2, weight, output), read or written once, at 4.8 TB/s"})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "uvu_variants.json").write_text(json.dumps(rows, indent=1, default=str))
    _print_table(rows)
    print(f"(total {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
