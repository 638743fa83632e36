"""Triton's Hopper warp specialization and persistence on the generated products, before building either:

    python -m benchmarks.explore.warp_spec [--out DIR] [--budget 420] [--points 0,1,2,3]

Why: the products issue 11 still misses run few K steps a program (Block-ELL 64x64 s = 0.9:
~13; 128x128: 3-6; N:M 1:8: 8), so each program's pipeline fill and epilogue weigh as much
as its loop, and the 4096^3 products run 2-4 waves. Triton >= 3.5 splits a
`tl.range(..., warp_specialize=True)` loop into producer warps (descriptor loads) and
consumer warps (wgmma); a persistent kernel whose tile loop is flattened and specialised
lets the producers fetch the next tile while the consumers finish the last.

This takes each product's tuned generated kernel and rewrites only loop headers:
  generated    the kernel as the library runs it (tuned configuration)
  ws           its K loop `tl.range(..., warp_specialize=True)`
  persistent   the same plan with one program per SM striding over the tiles (`flatten=True`)
  persistent+ws, persistent+inner-ws   the tile loop, or the K loop inside it, specialised
each at the tuned configuration and a few warps / stages / N tiles, checked against a float64
product and timed beside cuBLAS. Session 9's run of the warp-specialised rewrite aborted the
process in Triton's compiler (an assertion at a 256-wide N tile), so each point runs in a
child process that resumes after a variant that kills it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time

#: (label, size, kind, block or vector length, sparsity or (n, m)) of the products, in the order they run.
POINTS = [
    ("Block-ELL 64x64 s=0.9 4096^3", 4096, "block", 64, 0.9),
    ("Block-ELL 128x128 s=0.9 4096^3", 4096, "block", 128, 0.9),
    ("Block-ELL 128x128 s=0.5 4096^3", 4096, "block", 128, 0.5),
    ("N:M 1:8 L=256 4096^3", 4096, "nm", 256, (1, 8)),
]
K_LOOP = re.compile(r"^(\s*)for (step|start_\w+) in range\((.*)\):$", re.M)
TILE_LOOP = re.compile(r"flatten=True\):")


def say(line: str) -> None:
    print(line, flush=True)


def variants(source: str, persistent_source: str, config: dict) -> list[tuple[str, str, dict]]:
    """(label, source, configuration) of every variant, the unrewritten ones first."""
    ws = K_LOOP.sub(lambda m: f"{m[1]}for {m[2]} in tl.range({m[3]}, warp_specialize=True):", source, count=1)
    pws = TILE_LOOP.sub("flatten=True, warp_specialize=True):", persistent_source, count=1)
    inner = K_LOOP.sub(lambda m: f"{m[1]}for {m[2]} in tl.range({m[3]}, warp_specialize=True):", persistent_source,
                       count=1)
    configs = [("tuned", config)]
    for warps, stages, bn in ((4, 3, 128), (8, 3, 128), (4, 4, 128), (8, 4, None), (4, 2, None)):
        c = {**config, "num_warps": warps, "num_stages": stages}
        if bn and "BLOCK_N" in c:
            c["BLOCK_N"] = min(bn, c["BLOCK_N"])
        if c not in [x for _, x in configs]:
            configs.append((f"{warps}w {stages}st N{c.get('BLOCK_N')}", c))
    out = [("generated", source, config), ("persistent", persistent_source, config)]
    out += [(f"ws {name}", ws, c) for name, c in configs]
    out += [(f"persistent+ws {name}", pws, c) for name, c in configs[:3]]
    out += [(f"persistent+inner-ws {name}", inner, c) for name, c in configs[:2]]
    return out


def child(index: int, start: int, out: str) -> None:
    """Run point `index`'s variants from `start`, printing `DONE i` after each."""
    from insum.runtime import Kernel, _load, cache_dir

    from .tensorcore import bare_launches, check_and_time, missed_point

    label, size, kind, block, param = POINTS[index]
    fmt, Bs, expected, t_cublas, (kernel, bound, prepared, C, operands) = missed_point(size, kind, block, param)
    config = dict(prepared.config)
    persistent = Kernel(kernel.spec, dataclasses.replace(kernel.plan, persistent=True))
    p_launcher = persistent.prepared(bound)
    p_launcher.set_config(config)
    if start == 0:
        say(f"{label}: cuBLAS {t_cublas * 1e3:.1f} us; plan {kernel.plan.tiles}, boxes {sorted(kernel.plan.boxes)}; "
            f"tuned {config}")
        if not K_LOOP.search(kernel.source):
            say("  no K loop header to rewrite:\n" + kernel.source)
    rows = []
    for i, (name, source, cfg) in enumerate(variants(kernel.source, persistent.source, config)):
        if i < start:
            continue
        launcher = p_launcher if name.startswith("persistent") else prepared
        try:
            digest = f"{kernel.digest}_v{i}"
            fn = _load(cache_dir() / "kernels" / f"insum_{digest}.py", source, digest)
            err, ms = check_and_time(bare_launches(fn, launcher, bound, cfg, operands, C), C, fmt.result, expected)
        except Exception as e:  # a rewrite or configuration that does not compile or run is reported
            say(f"  {name:34s} FAILED {type(e).__name__}: {str(e)[:160]}")
        else:
            ok = "ok" if err <= 1e-2 else "WRONG"
            say(f"  {name:34s} {ms * 1e3:8.1f} us  x{t_cublas / ms:.2f} cuBLAS  err {err:.1e} {ok}  {cfg}")
            rows.append(dict(point=label, variant=name, config=cfg, ms=ms, err=err, vs_cublas=t_cublas / ms))
        with open(os.path.join(out, "warp_spec.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        rows.clear()
        say(f"DONE {i}")
    say("POINT DONE")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget", type=float, default=420.0)
    parser.add_argument("--points", default=",".join(str(i) for i in range(len(POINTS))))
    parser.add_argument("--child", type=int, default=None)
    parser.add_argument("--start", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.child is not None:
        child(args.child, args.start, args.out)
        return
    deadline = time.time() + args.budget
    for index in (int(p) for p in args.points.split(",")):
        start = 0
        while time.time() < deadline:
            cmd = [sys.executable, "-m", "benchmarks.explore.warp_spec", "--child", str(index), "--start", str(start),
                   "--out", args.out]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(deadline - time.time(), 1))
            except subprocess.TimeoutExpired as e:
                say((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
                say("  budget spent")
                return
            lines = run.stdout.splitlines()
            say("\n".join(line for line in lines if not line.startswith("DONE")))
            done = [int(line.split()[1]) for line in lines if line.startswith("DONE ")]
            if "POINT DONE" in lines:
                break
            crashed = (done[-1] + 1) if done else start
            tail = [line for line in run.stderr.splitlines() if "Assertion" in line or "Error" in line][-2:]
            say(f"  variant {crashed} killed the process (rc {run.returncode}): {' | '.join(tail)[:300]}")
            start = crashed + 1


if __name__ == "__main__":
    main()
