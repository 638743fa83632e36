"""schedule(spec) -> Plan: choose which variable each tile axis carries and how to write out.

Tile axes are M and N (output-side, tiled over program ids) and K (a reduction, looped in
chunks). A *dot plan* is chosen when the factors split into a left part without the N
variable and a right part without the M variable that share K: the inner loop is then one
`tl.dot` of an (M, K) block by a (K, N) block. Otherwise a *reduce plan* multiplies the
factors by broadcasting over (M, K, N) and sums K with `tl.sum`. Other output variables go
to the grid (one value per program); other reduced variables become scalar outer loops.

Which variable goes on M, N and K (and which become grid or loop variables) is ranked, not
read off the index order: `rank` enumerates every valid tiling of the plan's kind and
scores it with a cost model of tile fill, loop steps, operand contiguity, programs against
SMs, output writes (atomics cost more than owned stores) and declared lengths (a program
holding one padded row stops at its length); `schedule` takes the cheapest,
but keeps the conventional tiling (innermost output variable on N, ...) unless another
costs less than KEEP times as much, so that GPU-tuned defaults move only for a clear reason.
`insum.explain` prints the ranked candidates.

A tile axis may carry several variables. M is *stacked* when the model prefers it: a grid
variable flattened onto M outside M's own variable (M = (b, q): 48 batches of 16 rows fill
128-row tiles that q alone cannot), offered by `rank` wherever M's extent is below NARROW.
And `schedule(spec, fold_k=True)` folds the innermost
scalar loop onto K, which then runs over (q, k) flattened, k fastest, so one `tl.dot`
consumes several 32-wide blocks at once. It is not the default: on an H200 the pointer
gathers it needs lost to one block per step with tensor descriptors
(benchmarks/results/tensorcore_run2_h200.log).

Persistent programs (one per SM, looping over the tiles) are chosen for dot plans whose
operands all load through descriptors with no scalar loop (the dense GEMM class), where
they measured faster; with pointer gathers or per-step index loads they measured slower.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from ..dtypes import HALF_NAMES, DtypeName
from ..ir import Access, Index, Role, Statement, Var

__all__ = ["KernelSpec", "Plan", "PlanKind", "OutputMode", "schedule", "box_layout", "segment_index", "single_owner", "permuted_output", "rank", "choose", "plan_of", "Candidate", "AXES", "SIZE_CAP"]

AXES = ("M", "K", "N")  # canonical order of block dimensions: (M, K) @ (K, N) -> (M, N)
#: "dot": a tl.dot of an (M, K) block by a (K, N) block; "reduce": broadcast multiply, tl.sum.
PlanKind = Literal["dot", "reduce"]
#: "store": each output element has one owner; "atomic": scattered contributions may collide.
OutputMode = Literal["store", "atomic", "segment"]
# Hopper's warp-group MMA needs 64 rows of M per tile: a variable with a smaller extent (the
# rows of one 32 x 32 block) goes on N instead when the statement allows it.
NARROW = 64
# Extent buckets stop here: larger extents fill every tile size the tuner offers.
SIZE_CAP = 256
# Tensor descriptors (Triton's `tl.make_tensor_descriptor`) take 2 to 5 dimensions.
BOX_RANKS = range(2, 6)


def box_layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, address: int) -> bool:
    """Whether a tensor can back a tensor descriptor: 2 to 5 dimensions, a 16-byte aligned
    start, a contiguous last dimension and every other stride a positive multiple of 16 bytes.

    >>> box_layout((64, 32), (32, 1), 2, 4096), box_layout((64, 31), (31, 1), 2, 4096)
    (True, False)
    """
    if len(shape) not in BOX_RANKS or address % 16 or strides[-1] != 1:
        return False
    return all(st > 0 and st * itemsize % 16 == 0 for st in strides[:-1])


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel depends on: the statement, roles, dtypes and addressing width."""

    stmt: Statement
    roles: tuple[tuple[str, Role], ...]  # (variable, role)
    dtypes: tuple[tuple[str, DtypeName], ...]  # (tensor, dtype name)
    wide: frozenset[str] = frozenset()  # tensors whose element offsets may exceed 2**31 - 1
    precision: str = "tf32"  # float32 tl.dot: "tf32" or "ieee"
    narrow: frozenset[str] = frozenset()  # output-side variables with extents below NARROW
    boxes: frozenset[str] = frozenset()  # input tensors whose layout fits a tensor descriptor
    # Index tensors the caller declares sorted (equal values adjacent), e.g. a format's
    # row index: a facts channel from formats to the code generator through the call.
    sorted_indices: frozenset[str] = frozenset()
    # Index tensors the caller declares unique (no value twice), e.g. the row index of a
    # format with one group per row: a scatter through one can have a single writer.
    unique_indices: frozenset[str] = frozenset()
    # Variable extents rounded up to a power of two and capped at SIZE_CAP (a bucket, so
    # that one kernel serves a family of sizes): upper bounds for ownership proofs and the
    # tile-fill term of the cost model. A variable absent here is taken as large.
    sizes: tuple[tuple[str, int], ...] = ()
    # Declared lengths of reduced variables, (variable, tensor, index variables[, order]):
    # entries with `var >= tensor[index variables]` contribute zero (a format's padding), so
    # the kernel may stop there. See `Plan.lengths`. order: for a length over one output
    # variable, a tensor of that variable's values from the longest length to the shortest
    # (`Plan.ordered`), "" or absent where there is none.
    lengths: tuple[tuple, ...] = ()
    # (tensor, dim, m): strides a multiple of m = 2, 4 or 8 elements but not of 16, which
    # Triton's specialisation does not see (it marks multiples of 16 only); the kernel
    # states them (rounding each down to its multiple: `tl.multiple_of` on a scalar argument
    # never reaches its analysis), so that rows 8 elements apart still load as vectors.
    stride_multiples: tuple[tuple[str, int, int], ...] = ()
    # (variable, m): extents of variables that index a tensor's contiguous dimension, a
    # multiple of m = 2, 4 or 8 but not of 16 (their masks then keep m lanes constant).
    extent_multiples: tuple[tuple[str, int], ...] = ()

    def role(self, var: str) -> Role:
        return dict(self.roles)[var]

    def dtype(self, tensor: str) -> DtypeName:
        return dict(self.dtypes)[tensor]

    def size(self, var: str) -> int | None:
        """The variable's extent bucket (an upper bound below SIZE_CAP), None when unknown or
        at least SIZE_CAP."""
        size = dict(self.sizes).get(var)
        return size if size is not None and size < SIZE_CAP else None


@dataclass(frozen=True)
class Plan:
    """The kernel's shape: tiles, grid, loops, dot split and output strategy."""

    spec: KernelSpec
    kind: PlanKind
    tiles: tuple[tuple[str, str], ...]  # (axis, variable) for the tiled axes, in AXES order
    grid: tuple[str, ...]  # variables with one value per program
    loops: tuple[str, ...]  # reduced variables looped one value at a time, outermost first
    left: tuple[int, ...]  # factor positions multiplied into the (M, K) dot operand
    right: tuple[int, ...]  # factor positions multiplied into the (K, N) dot operand
    output: OutputMode  # "segment": see segment_index
    acc_dtype: DtypeName  # "fp32" or "fp64"
    dot_dtype: DtypeName | None  # operand dtype of tl.dot
    boxes: tuple[int, ...] = ()  # factor positions loaded through a tensor descriptor
    folded: tuple[str, ...] = ()  # reduced variables flattened onto K outside its variable, outermost first
    # Output-side variables flattened onto M outside its variable, outermost first (M = (b, q):
    # several short rows side by side fill one tall tile).
    stacked: tuple[str, ...] = ()
    persistent: bool = False  # one program per SM loops over the tiles (`tl.range(..., flatten=True)`)
    # The declared lengths this plan applies (see `_applied_lengths`): the reduction loop of
    # each variable stops at its length (the largest over the program's tile), and K-tiled
    # loads mask the lanes past each row's own length.
    lengths: tuple[tuple, ...] = ()
    # Grid variables whose programs run longest first: (variable, tensor of its values in
    # decreasing declared length). A program's value of the variable is read from the
    # tensor at its program index, so the programs with the most steps start first and the
    # short ones fill the GPU's tail (the LPT rule; see `_ordered`).
    ordered: tuple[tuple[str, str], ...] = ()
    # Program order: the grid variables vary fastest (before the tile indices), so that the
    # programs of one tile, which read the same operand rows, run side by side (see `_grid_first`).
    grid_first: bool = False
    # Grouped program order with the grid variables inside it: "M" when they join the rows
    # ((grid values, M tile) per row), "N" when they join the columns ((grid values, N tile)
    # per column), "" when they stay outside. Programs of many grid values that read the
    # same tiles of the shared operand run side by side (see `_grid_joins`).
    grid_joins: str = ""

    @property
    def stmt(self) -> Statement:
        return self.spec.stmt

    def axis_var(self, axis: str) -> str | None:
        return dict(self.tiles).get(axis)

    def var_axis(self, var: str) -> str | None:
        if var in self.folded:
            return "K"
        return "M" if var in self.stacked else {v: a for a, v in self.tiles}.get(var)

    def axis_vars(self, axis: str) -> tuple[str, ...]:
        """Every variable the axis carries, outermost first (the last one varies fastest)."""
        var = self.axis_var(axis)
        if var is None:
            return ()
        return (*self.folded, var) if axis == "K" else (*self.stacked, var) if axis == "M" else (var,)

    @property
    def covers_output(self) -> bool:
        """Whether the kernel writes every output element: the output's indices are distinct
        plain variables. An owned scatter (`output == "store"` otherwise) leaves the rest, so
        an `=` statement zero-fills the output first."""
        out_vars = [i.variable for i in self.stmt.output.indices]
        return all(v is not None for v in out_vars) and len(set(out_vars)) == len(out_vars)

    @property
    def grouped(self) -> bool:
        """Programs walk (M, N) tiles in groups of GROUP_M row tiles, so that the column tiles
        they share are read while still in L2 (the order of the Triton matmul tutorial)."""
        return self.kind == "dot" and self.axis_var("M") is not None and self.axis_var("N") is not None

    def __str__(self) -> str:
        tiles = ", ".join(
            f"{a}=({', '.join(self.axis_vars(a))})" if len(self.axis_vars(a)) > 1 else f"{a}={v}" for a, v in self.tiles
        ) or "-"
        lines = [
            f"kind: {self.kind}" + (" (tl.dot)" if self.kind == "dot" else " (broadcast multiply, tl.sum)"),
            f"tiles: {tiles}",
            f"grid variables: {', '.join(self.grid) or '-'}",
            f"loop variables: {', '.join(self.loops) or '-'}",
        ]
        if self.kind == "dot":
            factors = self.stmt.factors
            lines.append(f"left (M, K): {' * '.join(str(factors[i]) for i in self.left)}")
            lines.append(f"right (K, N): {' * '.join(str(factors[i]) for i in self.right)}")
            lines.append(f"dot operands: {self.dot_dtype}" + (f", {self.spec.precision}" if self.dot_dtype == "fp32" else ""))
            if self.boxes:
                lines.append(f"tensor descriptors: {', '.join(str(factors[i]) for i in self.boxes)}")
        if self.persistent:
            lines.append("programs: persistent (one per SM, striding over the tiles)")
        if self.grid_first:
            lines.append(f"program order: {', '.join(self.grid)} fastest, then the tiles")
        if self.grid_joins == "M":
            lines.append(f"program order: groups of GROUP_M rows of ({', '.join(self.grid)}, M tile), rows fastest")
        elif self.grid_joins == "N":
            lines.append(f"program order: groups of GROUP_M M tiles, columns of ({', '.join(self.grid)}, N tile)")
        for var, tensor, index, *_ in self.lengths:
            lines.append(f"length: {var} < {tensor}[{', '.join(index)}] (declared: later entries are padding)")
        for var, order in self.ordered:
            lines.append(f"program order: {var} longest first ({var} = {order}[program's {var}])")
        lines.append(f"accumulator: {self.acc_dtype}")
        note = "owned" if self.output == "store" and not self.covers_output else self.output
        lines.append(f"output: {self.output}" + _OUTPUT_NOTES[note])
        return "\n".join(lines)


_OUTPUT_NOTES = {
    "store": " (one owner per element)",
    "owned": " (scattered, but one writer per element: plain stores)",
    "atomic": " (tl.atomic_add: scattered contributions may collide)",
    "segment": " (sorted scatter index: equal rows summed in registers, one tl.atomic_add per segment)",
}


def permuted_output(plan: Plan) -> tuple[str, int] | None:
    """(tensor, output dimension) where an owned scatter writes every output element exactly
    once if that tensor holds as many values as the dimension's extent.

    The output is `O[..., U[i, j], ...]` with U declared unique and indexed by distinct plain
    variables that no other output index uses, every other output index a distinct plain
    variable. U's values are distinct and in range (the caller's declaration, as for
    ownership), so as many of them as the extent are a permutation of it: an `=` statement
    then needs no zero fill. The count is the caller's to compare (`runtime`), since the
    plan does not hold sizes.

    >>> from insum.parser import parse
    >>> from insum.bind import _roles
    >>> def permuted(text, **facts):
    ...     stmt = parse(text)
    ...     dtypes = (("O", "fp32"), ("X", "fp32"), ("R", "int64"))
    ...     return permuted_output(schedule(KernelSpec(stmt, tuple(_roles(stmt).items()), dtypes, **facts)))
    >>> permuted("O[R[t, m], c] = X[t, m, c]", unique_indices=frozenset({"R"}))
    ('R', 0)
    >>> permuted("O[R[t, m], m] = X[t, m]", unique_indices=frozenset({"R"})), permuted("O[R[t, m], c] = X[t, m, c]")
    (None, None)
    """
    if plan.output != "store" or plan.covers_output:
        return None
    out = plan.stmt.output
    scattered = _scattered_access(out)
    if scattered is None or scattered[1].name not in plan.spec.unique_indices:
        return None
    dim, access = scattered
    names = [i.variable for i in access.indices] + [i.variable for d, i in enumerate(out.indices) if d != dim]
    if None in names or len(set(names)) != len(names):
        return None
    return access.name, dim


def _scattered_access(out: Access) -> tuple[int, Access] | None:
    """(dimension, access) when the output has exactly one indirect index and it is a plain
    access `X[...]` (coefficient 1, no constant); else None."""
    scattered = [(dim, index) for dim, index in enumerate(out.indices) if not index.is_direct]
    if len(scattered) != 1:
        return None
    dim, index = scattered[0]
    if index.const or len(index.terms) != 1 or index.terms[0].coef != 1:
        return None
    access = index.terms[0].atom
    return (dim, access) if isinstance(access, Access) else None


def segment_index(plan: Plan) -> Access | None:
    """The sorted 1-D index `X[v]` of a segment-reduced output (None for other strategies)."""
    if plan.output != "segment":
        return None
    return _sorted_scatter(plan.spec, dict(plan.tiles))


def _sorted_scatter(spec: KernelSpec, tiles: dict[str, str]) -> Access | None:
    """The output's one scattered index, when it is `X[v]` with X declared sorted and v tiled.

    Then consecutive values of v that share a row are adjacent in a tile, so a segmented
    scan over the tile adds them in registers (the segment group of the Sgap paper) and only
    each segment's last lane writes: one atomic per segment and tile instead of one per value.
    """
    out = spec.stmt.output
    scattered = _scattered_access(out)
    if scattered is None:
        return None
    access = scattered[1]
    if access.name not in spec.sorted_indices or len(access.indices) != 1:
        return None
    var = access.indices[0].variable
    if var is None or not access.indices[0].is_direct or var not in tiles.values() or tiles.get("K") == var:
        return None
    if sum(var in i.variables() for i in out.indices) != 1:
        return None
    return access


def single_owner(spec: KernelSpec) -> bool:
    """Whether every output element provably has at most one writer, from the statement and
    the caller's facts alone (no data read).

    Programs never split a reduction (reduced variables loop inside one program), so this
    holds when the output coordinates determine every non-reduced variable: each output
    index *recovers* variables (`_recovered`), and together they must recover all of them.
    A duplicate value in a tensor declared unique breaks the proof: the caller's fault
    (two writers race and one contribution is lost), as a wrong sorted claim is.

    >>> from insum.parser import parse
    >>> from insum.bind import _roles
    >>> def owned(text, **facts):
    ...     stmt = parse(text)
    ...     return single_owner(KernelSpec(stmt, tuple(_roles(stmt).items()), (), **facts))
    >>> owned("C[AM[p], n] += A[p, n]"), owned("C[AM[p], n] += A[p, n]", unique_indices=frozenset({"AM"}))
    (False, True)
    >>> owned("C[2*i + 1] += A[i]"), owned("C[i + j] += A[i] * E[j]")
    (True, False)
    """
    stmt = spec.stmt
    needed = {v for v, role in spec.roles if role != "reduced"}
    recovered: set[str] = set()
    for index in stmt.output.indices:
        recovered |= _recovered(index, spec)
    return needed <= recovered


def _recovered(index: Index, spec: KernelSpec) -> set[str]:
    """The variables whose values one value of `index` determines.

    A plain or scaled variable recovers itself; an access to a tensor declared unique
    recovers what its own indices recover; a sum of terms recovers all of theirs when it is
    a mixed-radix number: sorted by |coefficient|, each coefficient exceeds the largest
    value the smaller terms can add up to (from the extent buckets, which bound extents from
    above), and only the largest term may be an access (its range is unknown)."""
    terms = sorted(index.terms, key=lambda t: abs(t.coef))
    reach = 0  # the most the smaller terms can add, in absolute value
    out: set[str] = set()
    for position, term in enumerate(terms):
        if abs(term.coef) <= reach:
            return set()
        if isinstance(term.atom, Var):
            out.add(term.atom.name)
            size = spec.size(term.atom.name)
            if size is None and position < len(terms) - 1:
                return set()
            reach += abs(term.coef) * ((size or 1) - 1)
        else:
            if position < len(terms) - 1 or term.atom.name not in spec.unique_indices:
                return set()
            for inner in term.atom.indices:
                out |= _recovered(inner, spec)
    return out


def _direct_in(var: str, accesses: list[Access]) -> bool:
    """Whether every access that depends on `var` indexes a dimension with it directly."""
    using = [a for a in accesses if var in a.variables()]
    return bool(using) and all(any(i.variable == var for i in a.indices) for a in using)


def _output_candidates(stmt: Statement, roles: dict[str, Role]) -> list[str]:
    """Output-side variables, the innermost direct output dimension first."""
    direct = [i.variable for i in reversed(stmt.output.indices) if i.is_direct]
    scattered = [v for v in stmt.variables() if roles[v] == "scattered"]
    return list(dict.fromkeys(direct + scattered))


def _dot_splits(stmt: Statement, outside: list[str], reduced: list[str], narrow: frozenset[str]):
    """Every (M, N, K, left, right) such that left factors lack N and right factors lack M,
    and the index of the *conventional* one: for each N (innermost output variable first),
    each M (directly indexed first) with the first directly indexed K; the first whose M is
    not narrow (tensor cores want tall tiles; N takes any width). The cost model ranks them
    all (`rank`), and keeps the conventional split unless another is clearly cheaper."""
    accesses = [(i, f) for i, f in enumerate(stmt.factors) if isinstance(f, Access)]
    ms = sorted(outside, key=lambda v: not _direct_in(v, [f for _, f in accesses]))
    ks = sorted(reduced, key=lambda v: not _direct_in(v, [f for _, f in accesses]))
    splits, firsts = [], []
    for n in outside:
        right = [i for i, f in accesses if n in f.variables()]
        left = [i for i, f in accesses if n not in f.variables()]
        if not left or not right:
            continue
        left_vars = {v for i in left for v in stmt.factors[i].variables()}
        right_vars = {v for i in right for v in stmt.factors[i].variables()}
        for m in ms:
            if m == n or m in right_vars or m not in left_vars:
                continue
            shared = [k for k in ks if k in left_vars and k in right_vars]
            if shared:
                firsts.append(len(splits))
            splits.extend((m, n, k, tuple(left), tuple(right)) for k in shared)
    conventional = next((i for i in firsts if splits[i][0] not in narrow), firsts[0] if firsts else None)
    return splits, conventional


def _reduce_tilings(outside: list[str], reduced: list[str]):
    """Every (N, M, K) for a broadcast-and-sum plan (M and K None where nothing is left),
    and the index of the conventional one: N the innermost output variable, M the next, K
    the first directly indexed reduced variable."""
    ns = outside or [None]
    tilings = []
    for n in ns:
        ms = [m for m in outside if m != n] or [None]
        for m in ms:
            tilings.extend((n, m, k) for k in (reduced or [None]))
    return tilings, 0


# -- the cost model ------------------------------------------------------------------------
# A relative estimate of a plan's time, in lane-steps, used only to rank the plans of one
# statement. Extents come from `KernelSpec.sizes` (buckets); unknown or large ones count as
# LARGE. Each term is one thing the GPU pays for:
#   tile fill      each tile axis takes min(extent, its preferred width) lanes, and at least
#                  its floor: tl.dot's 16 (64 on M for 16-bit operands: Hopper's warp-group
#                  MMA), so a 4-wide extent on a dot axis computes 4x the useful work;
#   steps          every step of the reduction loop (a K tile or a scalar loop value) pays
#                  STEP_COST lanes of fixed cost (index loads, address arithmetic, a pipeline
#                  bubble): many short steps lose to few long ones;
#   contiguity     each operand tile loaded in the loop costs its elements, STRIDED times as
#                  many when its last dimension (row-major: unit stride) is not indexed by a
#                  tiled variable (no coalescing; gathers pay it in every plan);
#   programs       every program pays PROGRAM_COST lanes once (offsets, masks, the first
#                  loads' latency, the epilogue): short programs are latency-bound, so a
#                  tiny tile per program (a batch variable left on the grid) loses to a tall
#                  one; fewer programs than SMS leave SMs idle: time counts max(programs, SMS);
#   launch         LAUNCH_COST once: a tiny problem is launch-bound, so its candidates
#                  cost nearly the same and the conventional plan stays;
#   write          each program writes its output tile once: ATOMIC times as much for
#                  atomics, SEGMENT for segment-reduced scatters, x STRIDED when the output's
#                  last dimension is not tiled;
#   declared       a declared length (`lengths={"q[p]": L}`) says q's rows are padded to the
#   lengths        longest. A program that holds one row (p on the grid) stops at that row's
#                  own length, and its K tile can be as short as the rows are; a tile of
#                  several rows (p on M or N) runs to its longest row, taken as the padded
#                  extent (its masked lanes still compute). The schedule reads no data, so a
#                  row is taken LENGTH_FILL full: q's extent counts LENGTH_FILL times in the
#                  first case (K width, steps, loop trips), whole in the second.
# tl.dot's multiply-adds run DOT_RATE times faster than broadcast ones. Dot plans are always
# preferred to reduce plans where a split exists (as before); the model ranks within a kind.
LARGE = 4096
SMS = 132  # H100 / H200
STEP_COST = 2048
PROGRAM_COST = 16384
LAUNCH_COST = SMS * 65536  # every SM busy with one 128 x 128 x 4 tile
STRIDED = 4.0
ATOMIC, SEGMENT = 4.0, 2.0
DOT_RATE = 16
_DOT_TILE = {"M": 128, "N": 128, "K": 64}
_REDUCE_LANES = 8192  # as tune._REDUCE: N up to 128, K up to 8, M the rest
# The mean fill of a row under a declared length (unknown to the schedule: no data is read).
LENGTH_FILL = 0.5
# The conventional plan is kept unless another costs less than KEEP times as much: tuned
# defaults (dense GEMM, GroupCOO, BlockGroupCOO, N:M) change only for a clear reason.
KEEP = 0.8


@dataclass(frozen=True)
class Candidate:
    """One way to tile a statement, with its estimated cost (lower is better)."""

    kind: PlanKind
    tiles: tuple[tuple[str, str], ...]  # (axis, variable), in AXES order
    grid: tuple[str, ...]
    loops: tuple[str, ...]
    left: tuple[int, ...]
    right: tuple[int, ...]
    output: OutputMode
    cost: float
    terms: tuple[tuple[str, float], ...]  # the model's terms, for explain
    conventional: bool = False
    stacked: tuple[str, ...] = ()  # grid variables flattened onto M, outside its variable

    def __str__(self) -> str:
        tiles = " ".join(f"{a}=({', '.join((*self.stacked, v))})" if a == "M" and self.stacked else f"{a}={v}"
                         for a, v in self.tiles) or "-"
        terms = ", ".join(f"{k} {v:.3g}" for k, v in self.terms)
        mark = "  (conventional)" if self.conventional else ""
        return (f"{self.kind} {tiles} | grid {','.join(self.grid) or '-'} | loops {','.join(self.loops) or '-'}"
                f" | {self.output}: cost {self.cost:.3g} ({terms}){mark}")


def _extent(spec: KernelSpec, var: str) -> int:
    return spec.size(var) or LARGE


def _run_extents(spec: KernelSpec, tiles: dict[str, str], stacked: tuple[str, ...]) -> dict[str, int]:
    """Per variable, the extent a program runs over: its bucket, or LENGTH_FILL of it for a
    reduced variable whose declared length the plan applies per program (every index
    variable of the length on the grid: see the cost model's declared lengths).

    >>> spec = KernelSpec(None, (("p", "output"), ("q", "reduced")), (), sizes=(("p", 64), ("q", 8)),
    ...                   lengths=(("q", "LEN_q", ("p",)),))
    >>> _run_extents(spec, {"K": "q"}, ())["q"], _run_extents(spec, {"M": "p", "K": "q"}, ())["q"]
    (4, 8)
    """
    extents = {v: _extent(spec, v) for v, _ in spec.roles}
    on_tiles = set(tiles.values()) | set(stacked)
    grid = {v for v, role in spec.roles if role != "reduced" and v not in on_tiles}
    loops = tuple(v for v, role in spec.roles if role == "reduced" and v not in on_tiles)
    for var, _, index, *_ in () if stacked else _applied_lengths(spec, tiles, tuple(grid), loops):
        if all(v in grid for v in index):
            extents[var] = max(1, math.ceil(extents[var] * LENGTH_FILL))
    return extents


def _tile_widths(spec: KernelSpec, kind: PlanKind, tiles: dict[str, str], dot_dtype, stacked=()) -> dict[str, int]:
    """The lanes each tile axis computes (see the cost model)."""
    run = _run_extents(spec, tiles, stacked)
    extents = {a: run[v] for a, v in tiles.items()}
    for v in stacked:
        extents["M"] *= run[v]
    widths = {}
    if kind == "dot":
        for axis in tiles:
            floor = 64 if axis == "M" and dot_dtype in HALF_NAMES else 16
            widths[axis] = max(floor, min(extents[axis], _DOT_TILE[axis]))
        return widths
    if "N" in tiles:
        widths["N"] = min(extents["N"], 128)
    if "K" in tiles:
        widths["K"] = min(extents["K"], 8)
    if "M" in tiles:
        widths["M"] = max(1, min(extents["M"], _REDUCE_LANES // (widths.get("N", 1) * widths.get("K", 1))))
    return widths


def _cost(spec: KernelSpec, kind: PlanKind, tiles: dict[str, str], dot_dtype, output: OutputMode, stacked=()):
    """(cost, terms) of one tiling under the cost model above; `stacked` variables share M."""
    stmt = spec.stmt
    roles = dict(spec.roles)
    widths = _tile_widths(spec, kind, tiles, dot_dtype, stacked)
    run = _run_extents(spec, tiles, stacked)
    axis_of = {v: a for a, v in tiles.items()} | {v: "M" for v in stacked}
    extent_on = {a: run[v] for a, v in tiles.items()}
    for v in stacked:
        extent_on["M"] *= run[v]
    outside = [v for v in stmt.variables() if roles[v] != "reduced"]
    reduced = [v for v in stmt.variables() if roles[v] == "reduced"]
    programs = 1
    for axis in ("M", "N"):
        if axis in tiles:
            programs *= -(-extent_on[axis] // widths[axis])
    for v in outside:
        if v not in axis_of:
            programs *= run[v]
    steps = 1
    for v in reduced:
        steps *= -(-run[v] // widths["K"]) if axis_of.get(v) == "K" else run[v]
    lanes = 1
    for w in widths.values():
        lanes *= w
    compute = lanes / (DOT_RATE if kind == "dot" else 1)
    loads = 0.0
    for access in stmt.accesses():
        spanned = {axis_of[v] for v in access.variables() if v in axis_of}
        elements = 1
        for axis in spanned:
            elements *= widths[axis]
        last = access.indices[-1].variable if access.indices else None
        contiguous = not spanned or (last is not None and last in axis_of)
        loads += elements * (1 if contiguous else STRIDED)
    out_tile = 1
    for axis in ("M", "N"):
        out_tile *= widths.get(axis, 1)
    out = stmt.output
    last = out.indices[-1].variable if out.indices else None
    write = out_tile * {"atomic": ATOMIC, "segment": SEGMENT}.get(output, 1.0)
    write *= 1 if last is None or last in axis_of or not out.indices else STRIDED
    per_step = compute + loads + STEP_COST
    cost = LAUNCH_COST + max(programs, SMS) * (steps * per_step + write + PROGRAM_COST)
    terms = (("programs", programs), ("steps", steps), ("lanes", lanes), ("loads", loads), ("write", write))
    return cost, terms


def rank(spec: KernelSpec) -> list[Candidate]:
    """Every candidate plan of the chosen kind with its cost, cheapest first (the
    conventional one marked); `schedule` picks from this list."""
    stmt = spec.stmt
    roles = dict(spec.roles)
    outside = _output_candidates(stmt, roles)
    reduced = [v for v in stmt.variables() if roles[v] == "reduced"]
    acc_dtype, dot_dtype = _dtypes(spec)
    narrow = spec.narrow if dot_dtype in HALF_NAMES else frozenset()
    splits, conventional = _dot_splits(stmt, outside, reduced, narrow) if acc_dtype == "fp32" else ([], None)
    owned = single_owner(spec)
    out = []
    if splits:
        for position, (m, n, k, left, right) in enumerate(splits):
            tiles = {"M": m, "K": k, "N": n}
            out.append(_candidate(spec, "dot", tiles, left, right, dot_dtype, owned, position == conventional))
    else:
        accesses = list(stmt.accesses())
        direct_first = sorted(reduced, key=lambda v: not _direct_in(v, accesses))
        tilings, conventional = _reduce_tilings(outside, direct_first)
        for position, (n, m, k) in enumerate(tilings):
            tiles = {a: v for a, v in (("M", m), ("K", k), ("N", n)) if v is not None}
            out.append(_candidate(spec, "reduce", tiles, (), (), None, owned, position == conventional))
    out += [s for c in out for s in _stacked_variants(spec, c, dot_dtype, owned)]
    return sorted(out, key=lambda c: c.cost)


def _stacked_variants(spec: KernelSpec, base: Candidate, dot_dtype, owned: bool) -> list[Candidate]:
    """The base tiling with one grid variable flattened onto M outside M's variable, when
    M's extent is short (below NARROW): M = (b, q) fills a tall tile where q alone cannot.
    A dot's M variables must stay out of the right operand; segment-reduced and folded
    plans are not stacked (their lanes assume one variable on the axis)."""
    tiles = dict(base.tiles)
    m = tiles.get("M")
    if m is None or base.output == "segment" or (spec.size(m) or LARGE) >= NARROW:
        return []
    right_vars = {v for i in base.right for v in spec.stmt.factors[i].variables()}
    variants = []
    for g in base.grid:
        if g in right_vars:
            continue
        cost, terms = _cost(spec, base.kind, tiles, dot_dtype, base.output, (g,))
        variants.append(dataclasses.replace(
            base, grid=tuple(v for v in base.grid if v != g), stacked=(g,), cost=cost, terms=terms,
            conventional=False,
        ))
    return variants


def _candidate(spec, kind, tiles, left, right, dot_dtype, owned, conventional) -> Candidate:
    stmt = spec.stmt
    roles = dict(spec.roles)
    tiled = set(tiles.values())
    output = "store" if owned else "segment" if _sorted_scatter(spec, tiles) else "atomic"
    cost, terms = _cost(spec, kind, tiles, dot_dtype, output)
    return Candidate(
        kind=kind,
        tiles=tuple((a, tiles[a]) for a in AXES if a in tiles),
        grid=tuple(v for v in stmt.variables() if roles[v] != "reduced" and v not in tiled),
        loops=tuple(v for v in stmt.variables() if roles[v] == "reduced" and v not in tiled),
        left=left,
        right=right,
        output=output,
        cost=cost,
        terms=terms,
        conventional=conventional,
    )


def choose(candidates: list[Candidate]) -> Candidate:
    """The cheapest candidate if it costs less than KEEP times the conventional one's,
    else the conventional one."""
    best = candidates[0]
    usual = next((c for c in candidates if c.conventional), best)
    return best if best.cost < KEEP * usual.cost else usual


def _dtypes(spec: KernelSpec):
    """(accumulator dtype, tl.dot operand dtype) of a statement."""
    stmt = spec.stmt
    value_dtypes = [spec.dtype(f.name) for f in stmt.accesses()]
    acc_dtype = "fp64" if "fp64" in value_dtypes or spec.dtype(stmt.output.name) == "fp64" else "fp32"
    dot_dtype = value_dtypes[0] if len(set(value_dtypes)) == 1 and value_dtypes[0] in HALF_NAMES else "fp32"
    return acc_dtype, dot_dtype


def _box_factors(spec: KernelSpec, tiles: dict[str, str], positions: tuple[int, ...], folded: tuple[str, ...]) -> tuple[int, ...]:
    """Dot operands that are one box of their tensor: each tiled variable indexes its own
    dimension directly (so the tensor's bounds are the tile's mask), the last dimension is
    one of them, and every other index is a scalar per program or step. A box held in the
    other order than the dot's is loaded so and transposed (`tl.trans`): with descriptors
    made on the host that beat pointers too (Block-ELL's swapped 16- and 32-row blocks,
    2-10%, benchmarks/explore/transposed_boxes.py). A folded K axis is no box: its steps
    cross blocks."""
    if folded:
        return ()
    tiled = set(tiles.values())
    boxes = []
    for position in positions:
        access = spec.stmt.factors[position]
        if access.name not in spec.boxes or len(access.indices) not in BOX_RANKS:
            continue
        direct = [i.variable for i in access.indices]
        on_tiles = [v for v in direct if v in tiled]
        scalar = all(v in tiled or not (set(i.variables()) & tiled) for v, i in zip(direct, access.indices))
        if scalar and len(on_tiles) == len(set(on_tiles)) == 2 and direct[-1] in tiled:
            boxes.append(position)
    return tuple(sorted(boxes))


def schedule(spec: KernelSpec, *, fold_k: bool = False) -> Plan:
    """Choose the tile roles, grid, loops and output strategy for a statement: the cheapest
    candidate of `rank` by the cost model (kept conventional unless clearly cheaper).

    fold_k: fold the innermost scalar loop onto the dot's K axis (K = (q, k))."""
    return plan_of(spec, choose(rank(spec)), fold_k=fold_k)


def plan_of(spec: KernelSpec, chosen: Candidate, *, fold_k: bool = False) -> Plan:
    """The plan of one candidate (benchmarks compare candidates through it)."""
    acc_dtype, dot_dtype = _dtypes(spec)
    tiles = dict(chosen.tiles)
    loops = chosen.loops
    if chosen.kind == "dot":
        folded = (loops[-1],) if loops and fold_k else ()
        boxes = () if chosen.stacked else _box_factors(spec, tiles, chosen.left + chosen.right, folded)
        persistent = len(boxes) == len(chosen.left) + len(chosen.right) and not loops
    else:
        dot_dtype, boxes, folded, persistent = None, (), (), False
    output = "atomic" if chosen.output == "segment" and persistent else chosen.output
    loops = tuple(v for v in loops if v not in folded)
    applied = () if chosen.stacked else _applied_lengths(spec, tiles, chosen.grid, loops)
    return Plan(
        spec=spec,
        kind=chosen.kind,
        tiles=chosen.tiles,
        grid=chosen.grid,
        loops=loops,
        left=chosen.left,
        right=chosen.right,
        output=output,
        acc_dtype=acc_dtype,
        dot_dtype=dot_dtype,
        boxes=boxes,
        folded=folded,
        persistent=persistent,
        lengths=applied,
        ordered=_ordered(applied, chosen.grid),
        stacked=chosen.stacked,
        grid_first=chosen.kind == "reduce" and _grid_first(spec, tiles, chosen.grid),
        grid_joins=_grid_joins(spec, tiles, chosen.grid, chosen.left, chosen.right) if chosen.kind == "dot" else "",
    )


def _grid_first(spec: KernelSpec, tiles: dict[str, str], grid: tuple[str, ...]) -> bool:
    """Whether a broadcast-and-sum plan walks its grid variables fastest: when each has a
    small extent (a known bucket) and an M or N tile carries a large one.

    Programs that differ only in a grid value read the same rows of every operand the
    large tiled variable indexes (the batch rows of the tensor product's inputs and
    weights), so that all of a tile's programs run side by side and read those rows from
    HBM once; with the grid outermost each grid value sweeps every tile, and operands
    larger than L2 are read once per grid value. What moves the other way (tables indexed
    by the grid variables alone) is small: their extents are bounded by SIZE_CAP. Dot plans
    keep their grouped order (measured on GEMMs).

    >>> spec = KernelSpec(None, (), (), sizes=(("p", 64),))
    >>> _grid_first(spec, {"M": "b", "N": "u"}, ("p",)), _grid_first(spec, {"M": "p", "N": "u"}, ("b",))
    (True, False)
    """
    large = [v for a, v in tiles.items() if a != "K" and spec.size(v) is None]
    return bool(grid) and bool(large) and all(spec.size(v) is not None for v in grid)


def _grid_joins(
    spec: KernelSpec, tiles: dict[str, str], grid: tuple[str, ...], left: tuple[int, ...], right: tuple[int, ...]
) -> str:
    """Where a dot plan's grid variables go in the grouped order: "M" when no right factor
    is split by a grid variable directly (programs of different grid values read the same
    right operand tiles), else "N" when no left factor is, else "" (outside: a batch).

    Block-ELL's `C[p, m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]` reads B's rows through
    AK: every block row reads ~(1 - s) of B's block rows. With p outside the grouped order,
    a wave of programs covers a few block rows, each streaming its own slabs of B over all
    N tiles: at 8192^3 with 64 x 64 blocks at s = 0.9, ~1.7 GB from HBM for a 128 MB B.
    With p inside, a wave covers many block rows of a few tiles, which share B's tiles in
    L2 (`tune.group_rows` sizes the groups).

    >>> from insum.parser import parse
    >>> spec = KernelSpec(parse("C[p, m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]"), (), ())
    >>> _grid_joins(spec, {"M": "m", "K": "k", "N": "n"}, ("p",), (0,), (1,))
    'M'
    >>> _grid_joins(spec, {"M": "n", "K": "k", "N": "m"}, ("p",), (1,), (0,))
    'N'
    >>> batched = KernelSpec(parse("C[b, m, n] += A[b, m, k] * B[b, k, n]"), (), ())
    >>> _grid_joins(batched, {"M": "m", "K": "k", "N": "n"}, ("b",), (0,), (1,))
    ''
    """
    if not grid or "M" not in tiles or "N" not in tiles:
        return ""

    def split(positions: tuple[int, ...]) -> bool:
        return any(i.variable in grid for p in positions for i in spec.stmt.factors[p].indices)

    return "M" if not split(right) else "N" if not split(left) else ""


def _applied_lengths(spec: KernelSpec, tiles: dict[str, str], grid: tuple[str, ...], loops: tuple[str, ...]):
    """The declared lengths a plan can use: the variable is a scalar loop or the K tile, and
    its index variables are grid variables (one length per program) or at most one M/N tile
    variable (the loop runs to the tile's longest row). Others are ignored, which is correct:
    the entries past a length contribute zero."""
    applied = []
    for fact in spec.lengths:
        var, _, index = fact[:3]
        if var not in loops and tiles.get("K") != var:
            continue
        tiled = [v for v in index if v in tiles.values()]
        if all(v in grid or v in tiled for v in index) and len(tiled) <= 1 and tiles.get("K") not in tiled:
            applied.append(fact)
    return tuple(applied)


def _ordered(lengths: tuple[tuple, ...], grid: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The grid variables to walk longest first: each applied length over one grid variable
    that comes with its order tensor. Block-ELL at s = 0.9 holds 3 to 40 blocks a block row;
    in index order the longest rows may start last and leave the GPU idle behind them. On an
    H200 (fp16, 4096^3-8192^3, 32-128 blocks, s = 0.5-0.9) a prototype with the block rows
    packed longest first ran 1-10% faster at every point (benchmarks/results/h200/session9/
    call2, `python -m benchmarks.explore.order_stage`); this order 0-6% faster than the
    prototype's row order, measured in the next process (call3, `block_configs --lengths`).

    >>> _ordered((("q", "LEN_q", ("p",), "ORDER_LEN_q"),), ("p",)), _ordered((("q", "LEN_q", ("p",)),), ("p",))
    ((('p', 'ORDER_LEN_q'),), ())
    """
    ordered = {}
    for fact in lengths:
        index, order = fact[2], fact[3] if len(fact) > 3 else ""
        if order and len(index) == 1 and index[0] in grid and index[0] not in ordered:
            ordered[index[0]] = order
    return tuple(ordered.items())
