"""emit_batch(sources) -> Batch: several generated kernels as one launch.

A format whose SpMM is several statements into one output (CELL's buckets, one statement
per width) would otherwise launch once per statement. Here each part's kernel becomes a
device function that takes its program id as an argument, and one kernel splits its
programs among them by ranges: programs [0, end_0) run part 0, [end_0, end_1) part 1, ...
Each part keeps its own tile sizes (constexprs suffixed with the part's number); what the
parts share is the launch's num_warps and num_stages.

The parts run concurrently, so the caller batches only statements that add into their
outputs atomically and read nothing another part writes. A persistent part (its programs
stride over the tiles by the launch's program count) cannot be a part.

    >>> batch = emit_batch([emit(plan_a), emit(plan_b)])  # doctest: +SKIP
    >>> print(batch.text)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UnsupportedStatement
from .emit import KERNEL_NAME, Source

__all__ = ["Batch", "emit_batch"]

_HEADER = "import triton\nimport triton.language as tl\n\n\n"
_PID = "    pid = tl.program_id(0)\n"


@dataclass(frozen=True)
class Batch:
    """One kernel running several parts: its source, and per part the names of its runtime
    arguments and of its constexprs (the batch's own are suffixed `_<part>`)."""

    text: str
    args: tuple[tuple[str, ...], ...]  # per part, as the part's kernel orders them
    blocks: tuple[tuple[str, ...], ...]

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


def _parameters(text: str) -> tuple[list[str], list[str]]:
    """(runtime arguments, constexprs) of the generated kernel in `text`, in order."""
    start = text.index(f"def {KERNEL_NAME}(\n") + len(f"def {KERNEL_NAME}(\n")
    names, blocks = [], []
    for line in text[start : text.index("\n):", start)].splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        for name in filter(None, (p.strip() for p in line.split(","))):
            if name.endswith(": tl.constexpr"):
                blocks.append(name.removesuffix(": tl.constexpr"))
            else:
                names.append(name)
    return names, blocks


def emit_batch(parts: Sequence[Source]) -> Batch:
    """The kernel that runs `parts` (emitted kernels) in one launch."""
    helpers: list[str] = []
    functions: list[str] = []
    signature: list[str] = []
    calls: list[str] = []
    args, blocks = [], []
    for i, part in enumerate(parts):
        if part.plan.persistent:
            raise UnsupportedStatement(f"a persistent kernel cannot be part of a batch: '{part.plan.stmt}'")
        body = part.text.removeprefix(_HEADER)
        kernel_at = body.index("@triton.jit\ndef " + KERNEL_NAME)
        helper, body = body[:kernel_at], body[kernel_at:]
        if helper.strip() and helper not in helpers:
            helpers.append(helper)  # (the segmented sum, once)
        if body.count(_PID) != 1:
            raise UnsupportedStatement(f"kernel of '{part.plan.stmt}' does not read its program id once")
        names, constexprs = _parameters(body)
        body = body.replace(f"def {KERNEL_NAME}(\n", f"def insum_part_{i}(\n    part_pid,\n", 1)
        functions.append(body.replace(_PID, "    pid = part_pid\n", 1))
        args.append(tuple(names))
        blocks.append(tuple(constexprs))
        signature.append(f"    # part {i}: {part.plan.stmt}")
        signature.append("    " + ", ".join(f"{n}_{i}" for n in names) + ",")
        first = "pid" if i == 0 else f"pid - end_{i - 1}"
        given = ", ".join([first, *(f"{n}_{i}" for n in names), *(f"{b}_{i}" for b in constexprs)])
        calls.append(f"    {'if' if i == 0 else 'elif'} pid < end_{i}:\n        insum_part_{i}({given})")
    ends = ", ".join(f"end_{i}" for i in range(len(parts)))
    meta = ", ".join(f"{b}_{i}: tl.constexpr" for i, bs in enumerate(blocks) for b in bs)
    top = ["@triton.jit", f"def {KERNEL_NAME}(", *signature, "    # where each part's programs end", f"    {ends},"]
    if meta:
        top += ["    # meta-parameters", f"    {meta},"]
    top += ["):", f'    """{len(parts)} statements in one launch: programs [end_(i-1), end_i) run part i."""',
            "    pid = tl.program_id(0)", *calls]
    text = _HEADER + "".join(helpers) + "\n\n".join(f.rstrip("\n") + "\n" for f in functions) + "\n\n" + "\n".join(top) + "\n"
    return Batch(text=text, args=tuple(args), blocks=tuple(blocks))
