"""A generated kernel compiled for a GPU that is not here: its PTX and SASS-level facts, on the
development machine (no GPU, no interpreter).

Triton's compiler needs no device to lower a kernel; only launching does. This builds the
kernel an `insum()` call would build on Hopper (tensor descriptors allowed), binds its
arguments from CPU tensors of the real shapes and strides, and compiles it for sm_90 with one
tile configuration. What it reports answers layout questions without device time: how wide
each global load, store and atomic is (a vector of 8 fp16 or a lone element), whether the
loop's loads went asynchronous (cp.async / TMA), whether the dot is a wgmma, and the
registers and spills ptxas counts.

    python -m benchmarks.explore.ptx                       (the session-16 cliffs, side by side)
    python -m benchmarks.explore.ptx --print-ptx NAME      (also write NAME's PTX to stdout)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import tempfile

import torch

GPU_TARGET = ("cuda", 90, 32)  # (backend, capability, warp size): the H100 / H200


class _OfflineDriver:
    """What Triton's JIT asks the active driver for when it only compiles (`warmup`)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(*GPU_TARGET)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def offline_driver():
    """Triton's active driver replaced by one that reports sm_90 and never touches a GPU."""
    from triton.runtime import driver

    real = driver._active  # (None here: no GPU, so no default driver to make)
    driver.set_active(_OfflineDriver())
    try:
        yield
    finally:
        driver._active = real


def compile_for_hopper(statement: str, tensors: dict[str, torch.Tensor], config: dict, **facts):
    """The compiled kernel (Triton's CompiledKernel: `.asm["ptx"]`, `.n_regs`, `.n_spills`) of
    `statement` on `tensors` (CPU tensors of the real shapes and strides) with `config`.

    facts: `insum.runtime.kernel_for`'s sorted_indices / unique_indices / lengths."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_for_hopper needs the compiler: unset TRITON_INTERPRET")
    from insum.bind import bind
    from insum.parser import parse
    from insum.runtime import Kernel, _Launcher, spec_for

    bound = bind(parse(statement), tensors)
    spec = spec_for(bound, "tf32", descriptors=True, **facts)
    kernel = Kernel(spec, autotune=False)
    launcher = _Launcher(kernel, bound)
    config = launcher.fitted(config)
    args = launcher.args(bound.tensors, bound.output(), config)
    meta = {k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}
    with offline_driver():
        return kernel.fn.warmup(*args, grid=(1,), num_warps=config["num_warps"],
                                num_stages=config["num_stages"], **meta)


_MEMORY = re.compile(r"\b(ld\.global|st\.global|atom\.global|red\.global|cp\.async\.bulk\.tensor|cp\.async)\S*")


def ptx_facts(ptx: str) -> dict[str, int]:
    """Counts of the PTX's memory and tensor-core instructions, by full opcode."""
    counts = collections.Counter(m.group(0) for m in _MEMORY.finditer(ptx))
    counts["wgmma.mma_async"] = ptx.count("wgmma.mma_async")
    counts["mma.sync"] = ptx.count("mma.sync")
    return dict(sorted((k, v) for k, v in counts.items() if v))


def ptxas_usage(ptx: str) -> str:
    """ptxas's own line on the kernel's registers, spills and shared memory (`-v`)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(GPU_TARGET[1]).path, "-v", f"--gpu-name=sm_{GPU_TARGET[1]}a", path,
                               "-o", os.path.join(folder, "kernel.cubin")], capture_output=True, text=True)
    lines = [line.split("info    : ")[-1] for line in done.stderr.splitlines() if "Used" in line or "spill" in line]
    return "; ".join(lines) or done.stderr.strip()


def summarise(name: str, compiled) -> None:
    print(f"== {name}: {ptxas_usage(compiled.asm['ptx'])}")
    for opcode, count in ptx_facts(compiled.asm["ptx"]).items():
        print(f"   {count:5d}  {opcode}")


def _cases():
    """The cliffs `explore/shapes` found in session 16, each beside its fast neighbour."""
    from insum.formats import BlockGroupCOO
    from insum.nn.conv import TILED

    gen = torch.Generator().manual_seed(0)
    cases = {}
    for N in (1000, 1008):
        A = torch.zeros(512, 512)
        A[torch.rand(512 // 32, 512 // 32, generator=gen).repeat_interleave(32, 0).repeat_interleave(32, 1) < 0.1] = 1
        fmt = BlockGroupCOO.from_dense(A.half(), block=(32, 32), group_size=4)
        B = torch.randn(512, N).half()
        tensors = {**fmt.tensors, "B": fmt.operand(B), "C": torch.zeros(fmt.output_shape(N)).half()}
        config = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
        cases[f"grouped BlockGroupCOO N={N}"] = (fmt.expression, tensors, config, {})
    for c in (98, 120, 128):
        t, m, j, n = 64, 128, 27, 4096
        tensors = {
            "X": torch.randn(n, c).half(),
            "NB": torch.randint(0, n, (t, m, j), dtype=torch.int32),
            "TW": torch.randint(0, j, (t, j), dtype=torch.int32),
            "W": torch.randn(j, c, c).half(),
        }
        config = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
        cases[f"conv TILED {c} channels"] = (TILED, tensors, config, {})
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--print-ptx", default=None, help="a case's name: print its PTX")
    args = parser.parse_args()
    for name, (statement, tensors, config, facts) in _cases().items():
        compiled = compile_for_hopper(statement, tensors, config, **facts)
        summarise(name, compiled)
        if args.print_ptx == name:
            print(compiled.asm["ptx"])


if __name__ == "__main__":
    main()
