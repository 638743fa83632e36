"""Tensor-core path (issue 11): the generated dot kernels A/B against main's generator and
side by side with cuBLAS, TorchBSR and cuSPARSELt, in one process.

    python -m benchmarks.explore.tensorcore [--budget 300] [--out DIR]

Variants of each generated kernel, compiled in this one process on the same inputs:
  main       the generator of `main` (a copy of its `insum` package importable as
             `insum_main`, placed beside this checkout by the GPU command); skipped if absent
  pointers   this branch, every operand loaded through pointer blocks (INSUM_TMA=0's plan)
  tma        this branch, box operands through tensor descriptors (the default on Hopper)
  folded     the same, folding the block loop onto K (`schedule(spec, fold_k=True)`: K = (q, k))
  persistent the `tma` plan with one program per SM striding over the tiles (the default
             for plans whose operands are all descriptors and that have no scalar loop)
  coarsenR   block rows only: R neighbouring block rows packed as one (R * b)-tall block row
             over the union of their columns, explicit zero blocks (`tma` plan)
Both generators tune over the same short list of tile configurations (`CONFIGS`), so an A/B
shows what the generated source changes, not a wider search; `--full` tunes each over its
own whole space instead. Every result is checked against a float64 product of the same
inputs (relative error <= 1e-2 for fp16/bf16). Times: do_bench medians, B rotated over two
copies. Sections run in order of value and stop when the time budget is spent.

The logs: results/h200/tensorcore_ab1.log (commit 1d28f85: grouped order, descriptors),
results/h200/tensorcore_run2.log (commit 5df1a41: folding was the default for 32-wide
16-bit blocks and transposed boxes were allowed: its `tma` rows for 32x32 blocks are the
folded plan, `unfolded` the transposed-descriptor plan; both lost to main's pointers, so
neither is the default now, and 32x32 blocks run the `pointers` plan of the first log).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from insum.bind import bind
from insum.codegen import schedule, tune
from insum.execute import length_facts
from insum.formats import NM, BlockGroupCOO
from insum.parser import parse
from insum.runtime import BareLaunch, Kernel, kernel_for, spec_for

from ..common import DTYPES, block_sparse, median_ms, relative_error, rotating

try:  # main's generator, for the A/B
    import insum_main
    import insum_main.codegen.tune
    from insum_main.bind import bind as bind_main
    from insum_main.parser import parse as parse_main
    from insum_main.runtime import Kernel as KernelMain
    from insum_main.runtime import spec_for as spec_for_main
except ImportError:
    insum_main = None

# (BLOCK_M, BLOCK_K, BLOCK_N, num_warps, num_stages): the tiles that won on Hopper before,
# the deeper pipelines and the 256-row tile.
CONFIGS = [
    (128, 64, 256, 8, 3), (128, 64, 256, 8, 4), (256, 64, 128, 8, 3), (128, 64, 128, 8, 4),
    (64, 64, 256, 4, 4), (64, 32, 128, 4, 4), (128, 128, 64, 4, 4), (256, 128, 32, 8, 3),
]
ROWS: list[dict] = []
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def write_rows(out: str, name: str, rows: list) -> None:
    """An exploration's rows as `<out>/<name>.json`."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)


def run_points(name: str, points: list[tuple[int, int, float]], case) -> None:
    """An exploration's main over Block-ELL points: --out (default $OUT), the device line, then
    `case(size, block, s, rows)` for each (size, block, s), the rows written to
    `<out>/<name>.json` after every point."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    rows: list = []
    for size, block, s in points:
        case(size, block, s, rows)
        write_rows(args.out, name, rows)


def record(section: str, label: str, point: str, dtype: str, fn, check, expected, anchor_ms=None, flops=None):
    """Check `check()` against `expected`, time `fn`, keep the row."""
    try:
        err = relative_error(check().reshape(expected.shape), expected)
        ms = median_ms(fn)
    except Exception as e:  # a variant that fails to compile or run is reported, not fatal
        say(f"  {section:8s} {point:24s} {dtype} {label:22s} FAILED {type(e).__name__}: {str(e)[:200]}")
        ROWS.append(dict(section=section, label=label, point=point, dtype=dtype, error=str(e)[:500]))
        return None
    ok = err <= 1e-2
    ratio = anchor_ms / ms if anchor_ms else None
    tflops = flops / ms / 1e9 if flops else None
    extra = f"x{ratio:.2f} vs cuBLAS" if ratio else ""
    extra += f"  {tflops:.0f} TFLOP/s" if tflops else ""
    say(f"  {section:8s} {point:24s} {dtype} {label:22s} {ms * 1e3:9.1f} us  err {err:.1e} {'ok' if ok else 'FAIL'}  {extra}")
    ROWS.append(dict(section=section, label=label, point=point, dtype=dtype, ms=ms, err=err, ok=ok,
                     vs_cublas=ratio, tflops=tflops))
    return ms


def generated(expr: str, tensors: dict, out_name: str, swap: str, variant: str):
    """(run(B) -> out, describe) for one variant of the generated kernel of `expr`."""
    # No public hook picks a plan variant: this builds Kernel(spec, plan) from spec_for and schedule.
    if variant == "main":
        stmt = parse_main(expr)
        kernel = KernelMain(spec_for_main(bind_main(stmt, tensors)))
        binder = bind_main
    else:
        stmt = parse(expr)
        bound = bind(stmt, tensors)
        spec = spec_for(bound, descriptors=(variant != "pointers"))
        kernel = Kernel(spec)
        if variant == "folded":
            kernel = Kernel(spec, schedule(spec, fold_k=True))
        elif variant == "persistent":
            kernel = Kernel(spec, dataclasses.replace(kernel.plan, persistent=True))
        binder = bind
    out = tensors[out_name]

    def run(B):
        return kernel.launch(binder(stmt, {**tensors, swap: B}), out)

    return run, kernel


def plan_line(kernel) -> str:
    plan = kernel.plan
    boxes = len(getattr(plan, "boxes", ()))
    k = "(" + ", ".join(plan.axis_vars("K")) + ")" if hasattr(plan, "axis_vars") else plan.axis_var("K")
    return f"M={plan.axis_var('M')} K={k} N={plan.axis_var('N')} descriptors={boxes}"


def chosen(names: tuple[str, ...]) -> list[str]:
    return [v for v in names if v != "main" or insum_main is not None]


def time_variant(section: str, variant: str, expr: str, tensors: dict, Bs: list, point: str, dtype_name: str,
                 expected, anchor_ms, flops, plan: str | None = None):
    """Compile one variant of `expr` (plan: the variant whose plan it runs, default its own)
    for `tensors`, check it with Bs[0] and time it over `Bs` swapped in as B: (ms, kernel),
    or None when it does not compile. The output "C" is poisoned first."""
    try:
        run, kernel = generated(expr, tensors, "C", "B", plan or variant)
    except Exception as e:
        say(f"  {section} {variant}: no kernel: {e}")
        return None
    tensors["C"].fill_(float("nan"))
    ms = record(section, f"insum {variant}", point, dtype_name, rotating(run, [(B,) for B in Bs]),
                lambda: run(Bs[0]).clone(), expected, anchor_ms, flops)
    return ms, kernel


def dense_section(args, size: int, dtype_name: str, ab: tuple[str, ...]) -> None:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(size)
    A = torch.randn(size, size, device="cuda", dtype=dtype, generator=gen)
    Bs = [torch.randn(size, size, device="cuda", dtype=dtype, generator=gen) for _ in range(2)]
    C = torch.empty(size, size, device="cuda", dtype=dtype)
    ident = torch.arange(size, device="cuda", dtype=torch.int32)
    expected = A.double() @ Bs[0].double()
    flops = 2 * size**3
    point = f"{size}^3"
    t_cublas = record("dense", "cuBLAS", point, dtype_name, rotating(lambda B: A @ B, [(B,) for B in Bs]),
                      lambda: A @ Bs[0], expected, flops=flops)
    for name, expr, extra in [
        ("dense", "C[m, n] = A[m, k] * B[k, n]", {}),
        ("gathered", "C[m, n] = A[m, k] * B[I[k], n]", {"I": ident}),
    ]:
        for variant in chosen(ab):
            tensors = {"A": A, "B": Bs[0], "C": C, **extra}
            timed = time_variant(name, variant, expr, tensors, Bs, point, dtype_name, expected, t_cublas, flops)
            if timed and timed[0]:
                say(f"      {plan_line(timed[1])}")


def block_problem(size: int, block: int, s: float, dtype=torch.float16):
    """One block-sparse point of the explore scripts, seeded by size and block: (Bs, two
    dense operands to rotate; the cuBLAS time of a same-sized dense product in ms; A; its
    mask of kept blocks; A @ Bs[0] in float64)."""
    gen = torch.Generator(device="cuda").manual_seed(size + block)
    Bs = [torch.randn(size, size, device="cuda", dtype=dtype, generator=gen) for _ in range(2)]
    D = torch.randn(size, size, device="cuda", dtype=dtype, generator=gen)
    t_cublas = median_ms(rotating(lambda B: D @ B, [(B,) for B in Bs]))
    A, keep = block_sparse(size, block, s, dtype, gen, "cuda")
    return Bs, t_cublas, A, keep, A.double() @ Bs[0].double()


def bare_launches(fn, launcher, bound, config: dict, operands: list, C: torch.Tensor) -> list[BareLaunch]:
    """One bare launch of `fn` (a kernel's JIT function or a rewrite of it) under `config`
    per operand in `operands` (each bound as B), with `launcher`'s grid and argument list."""
    launcher.set_config(config)
    return [BareLaunch(fn, launcher.grid, config, tuple(launcher.args(bound.with_tensors({**bound.tensors, "B": B}).tensors, C)))
            for B in operands]


def check_and_time(launches: list, C: torch.Tensor, result, expected: torch.Tensor) -> tuple[float, float]:
    """(relative error of the first launch's output, C filled with NaN before it and read
    through `result`; the do_bench median in ms of the launches taken in turn)."""
    C.fill_(float("nan"))
    launches[0]()
    err = relative_error(result(C), expected)
    return err, median_ms(rotating(lambda f: f(), [(f,) for f in launches]))


def time_variants(point: str, variants: list, launcher, bound, operands: list, C: torch.Tensor, result, expected,
                  t_cublas: float, rows: list) -> None:
    """Time each (label, JIT function, configuration) of `variants` with bare launches
    (`bare_launches`, `check_and_time`) beside cuBLAS's `t_cublas` ms, keep a row per
    variant that ran, report the ones that fail; the launcher's configuration is restored."""
    base = dict(launcher.config)
    for label, fn, config in variants:
        try:
            err, ms = check_and_time(bare_launches(fn, launcher, bound, config, operands, C), C, result, expected)
        except Exception as e:  # a rewrite or configuration that does not compile or run is reported
            say(f"  {label:18s} FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(dict(point=point, label=label, config=config, ms=ms, err=err, vs_cublas=t_cublas / ms))
        say(f"  {label:18s} {ms * 1e3:8.1f} us  x{t_cublas / ms:.2f} cuBLAS  err {err:.1e}  {config}")
    launcher.set_config(base)


def format_product(fmt, Bs: list) -> tuple:
    """A format's statement (overwriting) as one generated kernel, tuned on `Bs[0]`:
    (kernel, bound, launcher, C, operands), operands being each B as the statement reads it,
    C the output they write (fp16, as the B's)."""
    (expr, tensors), = fmt.statements()
    C = torch.empty(fmt.output_shape(Bs[0].shape[1]), device=Bs[0].device, dtype=Bs[0].dtype)
    operands = [fmt.operand(B) for B in Bs]
    bound = bind(parse(expr.replace("+=", "=")), {**tensors, "B": operands[0], "C": C})
    declared = ()
    if fmt.declared_lengths():
        bound, declared = length_facts(bound, fmt.declared_lengths())
    kernel = kernel_for(bound, lengths=declared)
    kernel.launch(bound, C)  # the tuner's choice
    return kernel, bound, kernel.prepared(bound), C, operands


def missed_point(size: int, kind: str, block: int, param) -> tuple:
    """One of the products issue 11 still misses, fp16, its format tuned and launched once:
    (fmt, Bs, expected, cuBLAS ms, (kernel, bound, launcher, C, operands) of
    `format_product`). kind "block": Block-ELL of block x block blocks at sparsity `param`;
    "nm": N:M with (n, m) = `param` in vectors of `block` rows."""
    dtype = torch.float16
    gen = torch.Generator(device="cuda").manual_seed(size + block)
    Bs = [torch.randn(size, size, device="cuda", dtype=dtype, generator=gen) for _ in range(2)]
    D = torch.randn(size, size, device="cuda", dtype=dtype, generator=gen)
    t_cublas = median_ms(rotating(lambda B: D @ B, [(B,) for B in Bs]))
    if kind == "block":
        dense, _ = block_sparse(size, block, param, dtype, gen, "cuda")
        fmt = BlockGroupCOO.from_dense(dense, block=(block, block), group_size="row")
    else:
        A = torch.randn(size, size, device="cuda", generator=gen).to(dtype)
        fmt = NM.from_dense(A, n=param[0], m=param[1], vector_len=block)
        dense = fmt.to_dense()
    expected = dense.double() @ Bs[0].double()
    return fmt, Bs, expected, t_cublas, format_product(fmt, Bs)


def block_ell(keep: torch.Tensor, A: torch.Tensor, block: int, rows: int = 1) -> dict[str, torch.Tensor]:
    """One group per block row (BlockGroupCOO group_size="row"), padded with zero blocks.

    rows > 1 coarsens: `rows` neighbouring block rows become one (rows * block)-tall block
    row over the union of their block columns, with explicit zero blocks (the same as
    packing with block=(rows * block, block))."""
    if rows > 1:
        keep = keep.reshape(keep.shape[0] // rows, rows, keep.shape[1]).any(1)
    nb, kb = keep.shape
    bm = A.shape[0] // nb
    width = max(1, int(keep.sum(1).max()))
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
    valid = torch.gather(keep, 1, order)
    AK = torch.where(valid, order, 0).to(torch.int32)
    blocks = A.reshape(nb, bm, kb, block).permute(0, 2, 1, 3)
    AV = blocks[torch.arange(nb, device=A.device)[:, None], order] * valid[:, :, None, None]
    return {"AV": AV.contiguous(), "AK": AK.contiguous()}


def block_section(args, size: int, dtype_name: str, block: int, sparsities, ab: tuple[str, ...], t_cublas: dict) -> None:
    from torch.sparse._triton_ops import bsr_dense_mm

    dtype = DTYPES[dtype_name]
    nb = size // block
    gen = torch.Generator(device="cuda").manual_seed(size + block)
    Bs = [torch.randn(size, size, device="cuda", dtype=dtype, generator=gen) for _ in range(2)]
    key = (size, dtype_name)
    if key not in t_cublas:
        D = torch.randn(size, size, device="cuda", dtype=dtype, generator=gen)
        t_cublas[key] = median_ms(rotating(lambda B: D @ B, [(B,) for B in Bs]))
        say(f"  block    {size}^3 {dtype_name} cuBLAS {t_cublas[key] * 1e3:.1f} us")
    expr = "C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]"
    for s in sparsities:
        A, keep = block_sparse(size, block, s, dtype, gen, "cuda")
        expected = A.double() @ Bs[0].double()
        flops = 2 * size**3 * keep.float().mean().item()
        point = f"{size}^3 b{block} s={s}"
        anchor = t_cublas[key]
        try:
            bsr = A.to_sparse_bsr((block, block))
            record("block", "TorchBSR", point, dtype_name, rotating(lambda B, bsr=bsr: bsr_dense_mm(bsr, B), [(B,) for B in Bs]),
                   lambda bsr=bsr: bsr_dense_mm(bsr, Bs[0]), expected, anchor, flops)
        except Exception as e:
            say(f"  TorchBSR failed: {e}")
        Bv = [B.view(nb, block, size) for B in Bs]
        for variant in chosen(ab):
            rows = int(variant[len("coarsen"):]) if variant.startswith("coarsen") else 1
            packed = block_ell(keep, A, block, rows)
            C = torch.empty(nb // rows, block * rows, size, device="cuda", dtype=dtype)
            tensors = {**packed, "B": Bv[0], "C": C}
            timed = time_variant("block", variant, expr, tensors, Bv, point, dtype_name, expected, anchor, flops,
                                 plan="tma" if rows > 1 else variant)
            if timed is None:
                continue
            ms, kernel = timed
            if rows > 1:
                say(f"      coarsened: {packed['AK'].shape[1]} of {keep.shape[1]} block columns per {rows}-row group")
            if ms and (s == sparsities[0] or rows > 1):
                say(f"      {plan_line(kernel)}")


def nm_section(args, size: int, dtype_name: str, ab: tuple[str, ...]) -> None:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(7)
    A = torch.randn(size, size, device="cuda", dtype=dtype, generator=gen)
    Bs = [torch.randn(size, size, device="cuda", dtype=dtype, generator=gen) for _ in range(2)]
    t_cublas = median_ms(rotating(lambda B: A @ B, [(B,) for B in Bs]))
    say(f"  nm       {size}^3 {dtype_name} cuBLAS {t_cublas * 1e3:.1f} us")
    for n, m in ((2, 4), (2, 8), (1, 8)):
        point = f"{size}^3 {n}:{m}"
        fmt = NM.from_dense(A, n, m, 128)
        pruned = fmt.to_dense()
        expected = pruned.double() @ Bs[0].double()
        flops = 2 * size**3 * n / m
        if (n, m) == (2, 4):
            try:
                from torch.sparse import to_sparse_semi_structured

                sparse = to_sparse_semi_structured(pruned)
                record("nm", "cuSPARSELt 2:4", point, dtype_name, rotating(lambda B, sparse=sparse: sparse @ B, [(B,) for B in Bs]),
                       lambda sparse=sparse: sparse @ Bs[0], expected, t_cublas, flops)
            except Exception as e:
                say(f"  cuSPARSELt failed: {type(e).__name__}: {str(e)[:200]}")
        Cn = torch.empty(fmt.AV.shape[0], fmt.AV.shape[1], size, device="cuda", dtype=dtype)
        expr = fmt.expression.replace("+=", "=")
        for variant in chosen(ab):
            tensors = {**fmt.tensors, "B": Bs[0], "C": Cn}
            timed = time_variant("nm", variant, expr, tensors, Bs, point, dtype_name, expected, t_cublas, flops)
            if timed and timed[0]:
                say(f"      {plan_line(timed[1])}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; later sections are skipped after it")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--full", action="store_true", help="tune each generator over its own whole space")
    args = parser.parse_args()
    if not args.full:
        tune._DOT[:] = CONFIGS
        if insum_main is not None:
            insum_main.codegen.tune._DOT[:] = CONFIGS
    start = time.time()
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} insum_main={'yes' if insum_main else 'no'}")
    t_cublas: dict = {}
    new = ("tma",)
    sections = [
        lambda: block_section(args, 4096, "fp16", 32, (0.9, 0.5, 0.75, 0.95),
                              ("main", "tma", "folded", "persistent", "coarsen2", "coarsen4"), t_cublas),
        lambda: dense_section(args, 4096, "fp16", ("main", "pointers", "tma", "persistent")),
        lambda: block_section(args, 4096, "fp16", 64, (0.9, 0.5, 0.75, 0.95),
                              ("main", "tma", "folded", "persistent", "coarsen2"), t_cublas),
        lambda: dense_section(args, 8192, "fp16", ("main", "tma", "persistent")),
        lambda: dense_section(args, 4096, "bf16", ("tma", "persistent")),
        lambda: dense_section(args, 8192, "bf16", ("tma", "persistent")),
        lambda: block_section(args, 4096, "fp16", 128, (0.5, 0.75, 0.9), ("tma", "persistent"), t_cublas),
        lambda: block_section(args, 8192, "fp16", 32, (0.9, 0.5), new, t_cublas),
        lambda: block_section(args, 8192, "fp16", 64, (0.9, 0.5), ("tma", "persistent"), t_cublas),
        lambda: block_section(args, 4096, "bf16", 32, (0.9, 0.5, 0.75, 0.95), new, t_cublas),
        lambda: block_section(args, 4096, "bf16", 64, (0.9, 0.5, 0.75, 0.95), new, t_cublas),
        lambda: nm_section(args, 8192, "fp16", ("tma", "persistent")),
        lambda: nm_section(args, 8192, "bf16", new),
    ]
    for number, section in enumerate(sections):
        if time.time() - start > args.budget:
            say(f"budget spent: skipped sections {number}..{len(sections) - 1}")
            break
        section()
        say(f"-- section {number} done at {time.time() - start:.0f} s")
        write_rows(args.out, "tensorcore", ROWS)


if __name__ == "__main__":
    main()
