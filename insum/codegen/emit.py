"""emit(plan) -> Source: the Triton kernel for a plan, as readable Python source.

The kernel body is built from a few rules (index, gather, product, reduce or dot, store or
atomic), each emitting lines at the shallowest loop level its inputs allow, so loads that do
not depend on an inner loop are hoisted out of it. Every named line carries a comment with
its block shape. Dot operands the plan marks as boxes are loaded through a tensor
descriptor that the host makes and passes as an argument (TMA on Hopper: no pointer block,
no masks, since the descriptor's bounds zero-fill what lies outside the tensor; made on the
host, no program writes and fences a descriptor of its own before its first load); the rest
through pointers. `Source.args` says how the host makes each one (`("desc", ...)`).

Over 400 lines, as one module: every rule reads and extends the one `_Emitter` state (names,
loop levels, hoisted loads), and the assembly below must see all of it.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from ..dtypes import TL_DTYPES
from ..errors import UnsupportedStatement
from ..ir import Access, Index, Literal, Var
from .schedule import Plan, segment_index
from .values import Value, broadcast, union

__all__ = ["Source", "emit", "KERNEL_NAME"]

KERNEL_NAME = "insum_kernel"
_RESERVED = (
    "tl", "triton", "pid", "acc", "partial", "prod", "lhs", "rhs", "out_ptrs", "range", "step", "rest", "task",
    "seg_key", "next_key", "seg_tail", "seg_before", "seg_owned", "_segment_add",
)


@dataclass(frozen=True)
class Source:
    """Generated kernel source and the order of its runtime arguments."""

    text: str
    # ("ptr", tensor) | ("desc", tensor, dims) | ("size", var) | ("stride", tensor, dim); a descriptor's dims:
    # per dimension of its tensor, (variable, tile axis) where a tiled variable indexes it (its extent
    # bounds the box, BLOCK_<axis> wide), else (None, None) (the tensor's own size, 1 wide).
    args: tuple[tuple, ...]
    blocks: tuple[str, ...]  # constexpr tile sizes, e.g. ("BLOCK_M", "BLOCK_N")
    plan: Plan

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


class _Emitter:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.stmt = plan.stmt
        self.used: set[str] = set(_RESERVED)
        # Two levels: outside the reduction loop, and inside it. All reduced variables
        # (scalar loops and the K tile) share one flattened loop, which Triton pipelines.
        self.depth = 1 if plan.loops or plan.axis_var("K") else 0
        self.levels: list[list[str]] = [[] for _ in range(self.depth + 1)]
        self.epilogue: list[str] = []
        self.in_epilogue = False
        self.cache: dict[str, Value] = {}
        self.level_of = {v: 0 for v in plan.grid}
        self.level_of.update({v: 0 for a, v in plan.tiles if a != "K"})
        self.level_of.update({v: 1 for v in plan.loops})
        if plan.axis_var("K"):
            self.level_of[plan.axis_var("K")] = 1
        self.ptr = {n: self.fresh(f"{n}_ptr") for n in self._tensor_names()}
        self.size = {v: self.fresh(f"size_{v}") for v in self.stmt.variables()}
        self.level_of.update({v: 1 for v in plan.folded})
        self.level_of.update({v: 0 for v in plan.stacked})
        self.offs = {v: self.fresh(f"offs_{v}") for _, v in plan.tiles}
        self.offs.update({v: self.fresh(f"offs_{v}") for v in (*plan.folded, *plan.stacked)})
        # A stacked M axis: one flat lane index over its variables (the last fastest).
        self.flat_m = self.fresh(f"offs_{''.join(plan.axis_vars('M'))}") if plan.stacked else None
        self.mask = {v: self.fresh(f"mask_{v}") for _, v in plan.tiles}
        self.scalar = {v: self.fresh(f"i_{v}") for v in (*plan.grid, *plan.loops)}
        self.tile_pid = {v: self.fresh(f"pid_{v}") for a, v in plan.tiles if a != "K"}
        k = plan.axis_var("K")
        self.start_k = self.fresh(f"start_{k}") if k else None
        self.steps_k = self.fresh(f"steps_{k}") if k else None
        # Reduction loop counts: the extent, or the declared length loaded per program.
        self.count = dict(self.size)
        self.length_masks: list[Value] = []  # lanes past their row's length, K-tiled loads only
        # The K axis's extent: a product when variables are folded onto it.
        self.extent_k = " * ".join(self.size[v] for v in plan.axis_vars("K")) if k else None
        self.flat_k = self.fresh(f"offs_{''.join(plan.axis_vars('K'))}") if plan.folded else None
        self.strides: dict[tuple[str, int], str] = {}
        self.descs: dict[tuple, str] = {}  # ("desc", tensor, dims) -> its parameter (`Source.args`)
        factors = self.stmt.factors
        self.boxes = {str(factors[i]) for i in plan.boxes}

    # -- names ------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        name = base
        while name in self.used:
            name += "_"
        self.used.add(name)
        return name

    def _tensor_names(self) -> list[str]:
        names = [access.name for access, _ in self.stmt.walk()] + [fact[1] for fact in self.plan.lengths]
        names += [order for _, order in self.plan.ordered]
        return list(dict.fromkeys(names))

    def stride(self, tensor: str, dim: int) -> str:
        key = (tensor, dim)
        if key not in self.strides:
            self.strides[key] = self.fresh(f"stride_{tensor}_{dim}")
        return self.strides[key]

    def extent(self, axis: str) -> str:
        """The number of lanes along a tile axis: a product when variables share it."""
        return " * ".join(self.size[v] for v in self.plan.axis_vars(axis))

    def tile_start(self, axis: str) -> str:
        """The first index of this program's (or this step's) tile along an axis."""
        if axis == "K":
            return self.start_k
        return f"{self.tile_pid[self.plan.axis_var(axis)]} * BLOCK_{axis}"

    def shape_comment(self, axes: tuple[str, ...]) -> str:
        labels = [self.plan.axis_vars(a) for a in axes]
        return f"  # [{', '.join(v[0] if len(v) == 1 else '(' + ', '.join(v) + ')' for v in labels)}]"

    def put(self, level: int, line: str) -> None:
        (self.epilogue if self.in_epilogue and level == 0 else self.levels[level]).append(line)

    # -- rules ------------------------------------------------------------------------
    def var(self, name: str) -> Value:
        axis = self.plan.var_axis(name)
        if axis is not None:
            return Value(self.offs[name], (axis,), self.level_of[name])
        return Value(self.scalar[name], (), self.level_of[name])

    def index(self, index: Index) -> Value:
        """An affine index as one expression over the union of its terms' axes."""
        atoms = [self.var(t.atom.name) if isinstance(t.atom, Var) else self.gather(t.atom) for t in index.terms]
        axes = union(*(a.axes for a in atoms))
        parts = []
        for term, atom in zip(index.terms, atoms):
            text = broadcast(atom, axes) + (f" * {abs(term.coef)}" if abs(term.coef) != 1 else "")
            parts.append(("- " if term.coef < 0 else "+ ") + text if parts else ("-" if term.coef < 0 else "") + text)
        if index.const or not parts:
            parts.append(str(index.const) if not parts else ("- " if index.const < 0 else "+ ") + str(abs(index.const)))
        level = max((a.level for a in atoms), default=0)
        return Value(" ".join(parts), axes, level)

    def address(self, access: Access) -> tuple[str, tuple[str, ...], int]:
        """Pointer expression, block axes and level of an access."""
        indices = [self.index(i) for i in access.indices]
        axes = union(*(i.axes for i in indices))
        wide = access.name in self.plan.spec.wide
        terms = []
        for dim, (index, idx) in enumerate(zip(access.indices, indices)):
            text = broadcast(idx, axes)
            if not _is_atomic(index):  # `(a + b) * stride`, never `a + b * stride`
                text = f"({text})"
            if wide:
                text = f"{text}.to(tl.int64)"
            terms.append(f"{text} * {self.stride(access.name, dim)}")
        pointer = " + ".join([self.ptr[access.name], *terms])
        return pointer, axes, max((i.level for i in indices), default=0)

    def mask_for(self, axes: tuple[str, ...], level: int = 0) -> str | None:
        """The mask of a load or store over `axes` at loop `level`: the tiles' bounds, and the
        declared lengths' masks defined at or above that level."""
        if not axes:
            return None
        masks = [broadcast(Value(self.mask[self.plan.axis_var(a)], (a,), 0), axes) for a in axes]
        masks += [f"({broadcast(m, axes)})" for m in self.length_masks if set(m.axes) <= set(axes) and m.level <= level]
        return " & ".join(masks)

    def lengths(self) -> None:
        """Load each applied declared length once per program (before the reduction loop):
        the loop stops at it, the longest of the tile's rows when its index is tiled, where
        K-tiled loads also mask each row's lanes past its own length (no bytes moved there).
        Clamped to the extent, so that a too-long length reads nothing out of bounds."""
        for var, tensor, index, *_ in self.plan.lengths:
            value = self.gather(Access(tensor, tuple(Index.of(Var(v)) for v in index)))
            name = self.fresh(f"len_{var}")
            longest = f"tl.max({value.expr}, axis=0)" if value.axes else value.expr
            # 32-bit (bounded by the extent): a loop over an int64 length would give int64
            # tensor-descriptor coordinates, which Triton refuses.
            self.put(0, f"{name} = tl.minimum({longest}, {self.size[var]}).to(tl.int32)  # []")
            self.count[var] = name
            if value.axes and self.plan.axis_var("K") == var:
                lanes = Value(self.offs[var], ("K",), 1)
                axes = union(value.axes, ("K",))
                self.length_masks.append(Value(f"{broadcast(lanes, axes)} < {broadcast(value, axes)}", axes, 1))
            elif value.axes and var in self.plan.loops:
                # A loop over var runs to the tile's longest row: the shorter rows' loads
                # inside it stop at their own length (padding past it is not read).
                self.length_masks.append(Value(f"{self.scalar[var]} < {value.expr}", value.axes, self.level_of[var]))
        if self.plan.axis_var("K") in self.count and not self.plan.folded:
            self.extent_k = self.count[self.plan.axis_var("K")]
        for _, order in self.plan.ordered:  # read where the program id is split (`_ordered_lines`)
            self.stride(order, 0)

    def gather(self, access: Access) -> Value:
        """Load an access (an indirect index or a factor) once, at the shallowest level."""
        key = str(access)
        if key in self.cache:
            return self.cache[key]
        if key in self.boxes:
            self.cache[key] = self.box_load(access)
            return self.cache[key]
        pointer, axes, level = self.address(access)
        name = self.fresh(f"{access.name}_val")
        mask = self.mask_for(axes, level)
        load = f"tl.load({pointer}, mask={mask}, other=0)" if mask else f"tl.load({pointer})"
        self.put(level, f"{name} = {load}" + self.shape_comment(axes))
        value = Value(name, axes, level)
        self.cache[key] = value
        return value

    def box_load(self, access: Access) -> Value:
        """Load a dot operand's tile through a tensor descriptor the host passes.

        The block has a 1 for every scalar-indexed dimension; it is reshaped to the two tiled
        axes, and transposed where the tensor holds them in the other order than the dot's."""
        name = access.name
        indices = [self.index(i) for i in access.indices]
        tiled = [self.plan.var_axis(i.variable) if i.variable else None for i in access.indices]
        dims = tuple((i.variable, a) if a else (None, None) for a, i in zip(tiled, access.indices))
        key = ("desc", name, dims)
        if key not in self.descs:
            self.descs[key] = self.fresh(f"{name}_desc")
        desc = self.descs[key]
        # Coordinates are 32-bit; a gathered index may be int64.
        coords = [
            self.tile_start(a) if a else f"({idx.expr}).to(tl.int32)" if index.indirect_accesses() else idx.expr
            for a, idx, index in zip(tiled, indices, access.indices)
        ]
        axes = tuple(a for a in tiled if a)
        load = f"{desc}.load([{', '.join(coords)}])"
        if len(axes) < len(tiled):
            load = f"{load}.reshape({', '.join(f'BLOCK_{a}' for a in axes)})"
        if axes != union(axes):  # held in the other order than the dot's
            load, axes = f"tl.trans({load})", union(axes)
        value_name = self.fresh(f"{name}_val")
        level = max((i.level for i in indices), default=0)
        self.put(level, f"{value_name} = {load}" + self.shape_comment(axes))
        return Value(value_name, axes, level)

    def product(self, positions: tuple[int, ...], dtype: str | None, name: str) -> Value:
        """Multiply factors in the accumulator dtype, broadcasting where they meet."""
        values = [self.gather(self.stmt.factors[i]) for i in positions]
        axes = union(*(v.axes for v in values))
        level = max(v.level for v in values)
        spec = self.plan.spec
        if len(values) == 1 and spec.dtype(self.stmt.factors[positions[0]].name) == dtype:
            return values[0]  # a lone operand already in the dot's dtype needs no line
        acc = TL_DTYPES[self.plan.acc_dtype]
        expr = " * ".join(f"{broadcast(v, axes)}.to({acc})" for v in values)
        if dtype is not None and dtype != self.plan.acc_dtype:
            expr = f"({expr}).to({TL_DTYPES[dtype]})"
        self.put(level, f"{name} = {expr}" + self.shape_comment(axes))
        return Value(name, axes, level)


def _is_atomic(index: Index) -> bool:
    """Whether an index prints as one operand (a lone unscaled atom: a name or a subscript).
    Integers stay parenthesised too, so that `(2).to(tl.int64)` parses."""
    return len(index.terms) == 1 and index.terms[0].coef == 1 and index.const == 0


def _launch_grid_lines(em: _Emitter) -> list[str]:
    """Split the flat program id into grid variables and tile indices (N fastest; the grid
    variables before the tiles when the plan walks them first)."""
    plan = em.plan
    lines = ["pid = tl.program_id(0)"]
    if plan.grouped:
        return lines + _grouped_tile_lines(em) + _ordered_lines(em)
    order = [("tile", a, v) for a, v in reversed(plan.tiles) if a != "K"]
    grid = [("grid", None, v) for v in reversed(plan.grid)]
    order = grid + order if plan.grid_first else order + grid
    for position, (kind, axis, var) in enumerate(order):
        last = position == len(order) - 1
        if kind == "tile":
            extent = em.extent(axis)
            count = f"tl.cdiv({extent}, BLOCK_{axis})"
            tile = em.tile_pid[var]
            lines.append(f"{tile} = pid" if last else f"{tile} = pid % {count}")
            if not last:
                lines.append(f"pid = pid // {count}")
            lines.extend(_tile_offset_lines(em, axis))
        else:
            lines.append(f"{em.scalar[var]} = pid" if last else f"{em.scalar[var]} = pid % {em.size[var]}")
            if not last:
                lines.append(f"pid = pid // {em.size[var]}")
    return lines + _ordered_lines(em)


def _ordered_lines(em: _Emitter) -> list[str]:
    """A grid variable walked longest first takes its value from the order tensor at the
    program's index (`Plan.ordered`)."""
    return [
        f"{em.scalar[var]} = tl.load({em.ptr[order]} + {em.scalar[var]} * {em.stride(order, 0)})"
        f"  # {var} in decreasing declared length"
        for var, order in em.plan.ordered
    ]


def _grouped_tile_lines(em: _Emitter) -> list[str]:
    """(M, N) tiles in groups of GROUP_M row tiles, M fastest within a group, so that
    consecutive programs share B's column tiles and A's row tiles in L2. The grid variables
    stay outside, or join the rows or the columns (`Plan.grid_joins`, the tile fastest)."""
    plan = em.plan
    m, n = plan.axis_var("M"), plan.axis_var("N")
    tiles_m, tiles_n, tile = em.fresh(f"tiles_{m}"), em.fresh(f"tiles_{n}"), em.fresh("tile")
    group, first_m, rows = em.fresh("group"), em.fresh(f"first_{m}"), em.fresh("group_rows")
    lines = [
        f"{tiles_m} = tl.cdiv({em.extent('M')}, BLOCK_M)",
        f"{tiles_n} = tl.cdiv({em.extent('N')}, BLOCK_N)",
    ]
    row_count, col_count, row, col = tiles_m, tiles_n, em.tile_pid[m], em.tile_pid[n]
    joined = plan.grid_joins
    if joined:
        grid_size = " * ".join(em.size[v] for v in plan.grid)
        if joined == "M":
            row_count, row = em.fresh("rows"), em.fresh("row")
            lines.append(f"{row_count} = {tiles_m} * {grid_size}")
        else:
            col_count, col = em.fresh("columns"), em.fresh("column")
            lines.append(f"{col_count} = {tiles_n} * {grid_size}")
        lines.append(f"{tile} = pid")
    elif plan.grid:
        lines.append(f"{tile} = pid % ({tiles_m} * {tiles_n})")
        lines.append(f"pid = pid // ({tiles_m} * {tiles_n})")
    else:
        lines.append(f"{tile} = pid")
    lines += [
        f"{group} = GROUP_M * {col_count}",
        f"{first_m} = ({tile} // {group}) * GROUP_M",
        f"{rows} = tl.minimum({row_count} - {first_m}, GROUP_M)",
        f"{row} = {first_m} + ({tile} % {group}) % {rows}",
        f"{col} = ({tile} % {group}) // {rows}",
    ]
    if joined == "M":
        lines += [f"{em.tile_pid[m]} = {row} % {tiles_m}", f"pid = {row} // {tiles_m}"]
    elif joined == "N":
        lines += [f"{em.tile_pid[n]} = {col} % {tiles_n}", f"pid = {col} // {tiles_n}"]
    for axis in ("M", "N"):
        lines.extend(_tile_offset_lines(em, axis))
    lines.extend(_unflatten("pid", [(em.scalar[v], em.size[v]) for v in reversed(plan.grid)]))
    return lines


def _tile_offset_lines(em: _Emitter, axis: str) -> list[str]:
    """Offsets and mask of this program's tile along M or N; on a stacked axis, every
    variable's offsets from one flat lane index (the axis's own variable fastest)."""
    var = em.plan.axis_var(axis)
    start = f"{em.tile_pid[var]} * BLOCK_{axis}"
    names = em.plan.axis_vars(axis)
    if len(names) == 1:
        return [
            f"{em.offs[var]} = {start} + tl.arange(0, BLOCK_{axis})  # [{var}]",
            f"{em.mask[var]} = {em.offs[var]} < {em.size[var]}  # [{var}]",
        ]
    shape = f"  # [({', '.join(names)})]"
    flat = em.flat_m
    lines = [
        f"{flat} = {start} + tl.arange(0, BLOCK_{axis})" + shape,
        f"{em.mask[var]} = {flat} < {em.extent(axis)}" + shape,
    ]
    return lines + _split_flat_lines(em, flat, names, shape)


def _split_flat_lines(em: _Emitter, flat: str, names: tuple[str, ...], shape: str) -> list[str]:
    """`offs_v` of each variable in `names` (outermost first) from the flat index `flat`."""
    lines = [f"{em.offs[names[-1]]} = {flat} % {em.size[names[-1]]}" + shape]
    divisor = [em.size[names[-1]]]
    for position, var in enumerate(reversed(names[:-1])):
        expr = f"{flat} // {divisor[0]}" if len(divisor) == 1 else f"{flat} // ({' * '.join(divisor)})"
        if position < len(names) - 2:
            expr = f"({expr}) % {em.size[var]}"
        lines.append(f"{em.offs[var]} = {expr}" + shape)
        divisor.append(em.size[var])
    return lines


def _unflatten(flat: str, scalars: list[tuple[str, str]]) -> list[str]:
    """Lines that split the counter `flat` into (name, extent) scalars, the first fastest;
    the last takes what remains."""
    lines = []
    for position, (name, size) in enumerate(scalars):
        if position == len(scalars) - 1:
            lines.append(f"{name} = {flat}")
        else:
            lines += [f"{name} = {flat} % {size}", f"{flat} = {flat} // {size}"]
    return lines


def _loop_lines(em: _Emitter) -> list[str]:
    """One loop over every reduction step: scalar loop variables and K tiles, K fastest."""
    plan = em.plan
    k = plan.axis_var("K")
    if not plan.loops and k is None:
        return []
    lines = []
    if not plan.loops:
        lines.append(f"for {em.start_k} in range(0, {em.extent_k}, BLOCK_K):")
    elif k is None and len(plan.loops) == 1:
        var = plan.loops[0]
        lines.append(f"for {em.scalar[var]} in range(0, {em.count[var]}):")
    else:
        counts = [em.count[v] for v in plan.loops]
        if k is not None:
            lines.append(f"{em.steps_k} = tl.cdiv({em.extent_k}, BLOCK_K)")
            counts.append(em.steps_k)
        lines.append(f"for step in range(0, {' * '.join(counts)}):")
        inner = "    rest = step"
        lines.append(inner)
        if k is not None:
            lines.append(f"    {em.start_k} = (rest % {em.steps_k}) * BLOCK_K")
            lines.append(f"    rest = rest // {em.steps_k}")
        lines.extend("    " + line for line in _unflatten("rest", [(em.scalar[v], em.count[v]) for v in reversed(plan.loops)]))
    if k is not None and plan.folded:
        lines.extend("    " + line for line in _folded_k_lines(em))
    elif k is not None:
        # Descriptor loads take `start_k` alone: the offsets and mask only where a line uses them.
        body = "\n".join(em.levels[1])
        masked = re.search(rf"\b{em.mask[k]}\b", body) is not None
        if masked or re.search(rf"\b{em.offs[k]}\b", body):
            lines.append(f"    {em.offs[k]} = {em.start_k} + tl.arange(0, BLOCK_K)  # [{k}]")
        if masked:  # a declared length ends the last tile early too
            lines.append(f"    {em.mask[k]} = {em.offs[k]} < {em.count[k]}  # [{k}]")
    lines.extend("    " + line for line in em.levels[1])
    return lines


_SEGMENT_ADD = '''@triton.jit
def _segment_add(key_a, acc_a, key_b, acc_b):
    """Segmented sum: b adds a's running sum when both lanes belong to one output row."""
    return key_b, acc_b + tl.where(key_a == key_b, acc_a, 0)'''


def _segment_lines(em: _Emitter, acc_axes: tuple[str, ...], mask: str | None) -> tuple[str, str | None]:
    """Sum adjacent lanes of one output row (sorted index) and keep each segment's last lane.

    Returns the mask argument of the write (only a segment's last lane in the tile writes)
    and, for `=` statements, the block-shaped condition of the segments that start and end
    inside the tile: their rows have no other writer, so a plain store replaces the atomic.
    Exactly those: a segment is its row's only one unless it continues from the previous
    tile (its row is the one before the tile's first lane) or into the next (its row is the
    one after the tile's last lane). A packer that keeps every row inside one tile (CELL's
    aligned folds) thus leaves no atomic, and nothing that needs a zero-filled output.
    """
    access = segment_index(em.plan)
    var = access.indices[0].variable
    axis = em.plan.var_axis(var)
    key = em.gather(access)  # the row of each lane, [var]
    offs, size = em.offs[var], em.size[var]
    index = f"{offs} + 1"
    if access.name in em.plan.spec.wide:
        index = f"({index}).to(tl.int64)"
    following = f"{em.ptr[access.name]} + ({index}) * {em.stride(access.name, 0)}"
    shape = em.shape_comment((axis,))
    em.put(0, f"seg_key = tl.where({em.mask[var]}, {key.expr}, -1)" + shape)
    em.put(0, f"next_key = tl.load({following}, mask={offs} + 1 < {size}, other=-1)" + shape)
    em.put(0, f"seg_tail = (next_key != seg_key) | (tl.arange(0, BLOCK_{axis}) == BLOCK_{axis} - 1)" + shape)
    keys = broadcast(Value("seg_key", (axis,), 0), acc_axes)
    if acc_axes != (axis,):
        blocks = ", ".join(f"BLOCK_{a}" for a in acc_axes)
        keys = f"tl.broadcast_to({keys}, ({blocks}))"
    em.put(0, f"_, acc = tl.associative_scan(({keys}, acc), {acc_axes.index(axis)}, _segment_add)" + em.shape_comment(acc_axes))
    tail = broadcast(Value("seg_tail", (axis,), 0), acc_axes)
    mask_arg = f", mask={mask} & {tail}" if mask else f", mask={tail}"
    if em.stmt.accumulate:
        return mask_arg, None
    first = f"{em.tile_pid[var]} * BLOCK_{axis}"
    if access.name in em.plan.spec.wide:
        first = f"({first}).to(tl.int64)"
    before = f"{em.ptr[access.name]} + ({first} - 1) * {em.stride(access.name, 0)}"
    em.put(0, f"seg_before = tl.load({before}, mask={first} > 0, other=-1)  # []")
    em.put(0, "seg_owned = (next_key != seg_key) & (seg_key != seg_before)" + shape)
    return mask_arg, broadcast(Value("seg_owned", (axis,), 0), acc_axes)


def _folded_k_lines(em: _Emitter) -> list[str]:
    """Offsets of every variable on a folded K axis, from one flat offset (K's variable fastest)."""
    names = em.plan.axis_vars("K")
    shape = f"  # [({', '.join(names)})]"
    flat = em.flat_k
    k = names[-1]
    lines = [
        f"{flat} = {em.start_k} + tl.arange(0, BLOCK_K)" + shape,
        f"{em.mask[k]} = {flat} < {em.extent_k}" + shape,
    ]
    return lines + _split_flat_lines(em, flat, names, shape)


def _addend_lines(em: _Emitter, acc_axes: tuple[str, ...]) -> None:
    """`+ D[...]`: the added term, loaded over the output tile once, into the accumulator
    before the store. Only where each output element has one writer (`store`): an atomic or
    segmented output would add it once per contribution."""
    plan, addend = em.plan, em.stmt.addend
    if plan.output != "store":
        raise UnsupportedStatement(f"an added term needs a stored output, not {plan.output}: '{plan.stmt}'")
    value = em.gather(addend)
    if not set(value.axes) <= set(acc_axes):
        raise UnsupportedStatement(f"the added term {addend} spans a tile the product does not: '{plan.stmt}'")
    em.put(0, f"acc += {broadcast(value, acc_axes)}.to({TL_DTYPES[plan.acc_dtype]})" + em.shape_comment(acc_axes))


def emit(plan: Plan) -> Source:
    """Generate the Triton source for `plan`."""
    em = _Emitter(plan)
    stmt = plan.stmt
    acc_axes = tuple(a for a, _ in plan.tiles if a != "K")
    acc_tl = TL_DTYPES[plan.acc_dtype]
    acc_shape = ", ".join(f"BLOCK_{a}" for a in acc_axes) if len(acc_axes) > 1 else f"BLOCK_{acc_axes[0]}," if acc_axes else "1,"
    accesses = tuple(i for i, f in enumerate(stmt.factors) if isinstance(f, Access))

    em.lengths()
    # Body: the contribution of one step of the innermost loop, added into `acc`.
    if plan.kind == "dot":
        lhs = em.product(plan.left, plan.dot_dtype, "lhs")
        rhs = em.product(plan.right, plan.dot_dtype, "rhs")
        lhs_expr = lhs.expr if lhs.axes == ("M", "K") else f"tl.broadcast_to({broadcast(lhs, ('M', 'K'))}, (BLOCK_M, BLOCK_K))"
        rhs_expr = rhs.expr if rhs.axes == ("K", "N") else f"tl.broadcast_to({broadcast(rhs, ('K', 'N'))}, (BLOCK_K, BLOCK_N))"
        precision = f', input_precision="{plan.spec.precision}"' if plan.dot_dtype == "fp32" else ""
        em.put(em.depth, f"acc = tl.dot({lhs_expr}, {rhs_expr}, acc{precision})" + em.shape_comment(("M", "N")))
    elif accesses:
        prod = em.product(accesses, None, "prod")
        if "K" in prod.axes:
            reduced_axes = tuple(a for a in prod.axes if a != "K")
            em.put(em.depth, f"partial = tl.sum({prod.expr}, axis={prod.axes.index('K')})" + em.shape_comment(reduced_axes))
            prod = Value("partial", reduced_axes, em.depth)
        em.put(em.depth, f"acc += {broadcast(prod, acc_axes)}" + em.shape_comment(acc_axes))
    else:
        em.put(em.depth, "acc += 1.0")

    # Epilogue: scale by literal factors, then store or scatter.
    em.in_epilogue = True
    scale = 1.0
    for factor in stmt.factors:
        if isinstance(factor, Literal):
            scale *= factor.value
    if scale != 1.0:  # (literals whose product overflows: `float("inf")`, a name Triton knows)
        em.put(0, f"acc = acc * {float(scale)!r}" if math.isfinite(scale) else f'acc = acc * float("{scale}")')
    if not acc_axes:
        em.put(0, "acc = tl.sum(acc, axis=0)  # []")
    if stmt.addend is not None:
        _addend_lines(em, acc_axes)
    pointer, out_axes, _ = em.address(stmt.output)
    em.put(0, f"out_ptrs = {pointer}" + em.shape_comment(out_axes))
    mask = em.mask_for(acc_axes)
    mask_arg = f", mask={mask}" if mask else ""
    value = broadcast(Value("acc", acc_axes, 0), out_axes) if out_axes != acc_axes else "acc"
    out_ty = f"{em.ptr[stmt.output.name]}.dtype.element_ty"
    # float64 into bf16 through float32, as torch rounds it (the interpreter's direct
    # conversion reads the float64 bits as an integer).
    via = ".to(tl.float32)" if plan.acc_dtype == "fp64" and plan.spec.dtype(stmt.output.name) == "bf16" else ""
    if plan.output == "segment":
        mask_arg, owned = _segment_lines(em, acc_axes, mask)
        if owned is not None:
            # `=`: a segment inside the tile is its row's only writer (the output was zeroed).
            em.put(0, f"tl.store(out_ptrs, acc{via}.to({out_ty}){mask_arg} & {owned})")
            mask_arg = f"{mask_arg} & ~{owned}"
    if plan.output in ("atomic", "segment"):
        # Into a float32 buffer, or the output's own dtype where the GPU has such atomics.
        cast = f"({value}){via}.to({out_ty})" if value != "acc" else f"acc{via}.to({out_ty})"
        em.put(0, f"tl.atomic_add(out_ptrs, {cast}{mask_arg}, sem=\"relaxed\")")
    elif stmt.accumulate:
        em.put(0, f"acc += tl.load(out_ptrs{mask_arg}).to({acc_tl})")
        em.put(0, f"tl.store(out_ptrs, acc{via}.to({out_ty}){mask_arg})")
    else:
        em.put(0, f"tl.store(out_ptrs, acc{via}.to({out_ty}){mask_arg})")

    # Assemble: body first (which pointers it reads), then signature and docstring.
    tile = _launch_grid_lines(em)
    tile.append(f"acc = tl.zeros(({acc_shape}), dtype={acc_tl})" + em.shape_comment(acc_axes))
    tile.extend(em.levels[0])
    tile.extend(_loop_lines(em))
    tile.extend(em.epilogue)
    if plan.persistent:
        # Programs stride over the tiles; flattening lets the pipeline run across tiles.
        counts = [em.size[v] for v in plan.grid] + [f"tl.cdiv({em.extent(a)}, BLOCK_{a})" for a, _ in plan.tiles if a != "K"]
        body = [f"for task in tl.range(tl.program_id(0), {' * '.join(counts) or '1'}, tl.num_programs(0), flatten=True):"]
        body += ["    " + ("pid = task" if line == "pid = tl.program_id(0)" else line) for line in tile]
    else:
        body = tile
    # Strides and extents that Triton sees as multiples of 1 (not of 16) but are multiples
    # of 2, 4 or 8: rows that many elements apart, and masks that many lanes constant,
    # load as vectors of that width.
    hints = [(em.strides[(t, d)], m) for t, d, m in plan.spec.stride_multiples if (t, d) in em.strides]
    hints += [(em.size[v], m) for v, m in plan.spec.extent_multiples if v in em.size]
    if hints:
        lines = [f"{name} = {name} // {m} * {m}" for name, m in hints]
        body = [lines[0] + "  # (not multiples of 16: the vector width Triton cannot see)", *lines[1:], *body]
    # A tensor read only through its descriptors takes no pointer argument.
    read = set(re.findall(r"\w+", "\n".join(body)))
    boxed = {key[1] for key in em.descs}
    pointers = [n for n in em.ptr if n not in boxed or em.ptr[n] in read]
    blocks = tuple(f"BLOCK_{a}" for a, _ in plan.tiles) + (("GROUP_M",) if plan.grouped else ())
    tensor_order = list(em.ptr)
    args = [("ptr", n) for n in pointers] + list(em.descs) + [("size", v) for v in em.size]
    args += [("stride", t, d) for (t, d) in sorted(em.strides, key=lambda k: (tensor_order.index(k[0]), k[1]))]
    arg_names = {("ptr", n): em.ptr[n] for n in pointers}
    arg_names.update(em.descs)
    arg_names.update({("size", v): em.size[v] for v in em.size})
    arg_names.update({("stride", t, d): em.strides[(t, d)] for (t, d) in em.strides})

    def group(kind):
        return ", ".join(arg_names[a] for a in args if a[0] == kind)

    out = ["import triton", "import triton.language as tl", "", ""]
    if plan.output == "segment":
        out += _SEGMENT_ADD.splitlines() + ["", ""]
    out += ["@triton.jit", f"def {KERNEL_NAME}("]
    out.append(f"    # pointers\n    {group('ptr')},")
    if em.descs:
        out.append(f"    # tensor descriptors (made on the host)\n    {group('desc')},")
    if em.size:  # a statement without variables has no extents
        out.append(f"    # extents\n    {group('size')},")
    if em.strides:
        out.append(f"    # strides\n    {group('stride')},")
    if blocks:
        out.append("    # meta-parameters\n    " + ", ".join(f"{b}: tl.constexpr" for b in blocks) + ",")
    out.append("):")
    doc = [str(stmt), "", *str(plan).splitlines()]
    out.append('    """' + "\n".join(("    " + d if d and i else d) for i, d in enumerate(doc)) + '\n    """')
    out.extend("    " + line for line in body)
    return Source(text="\n".join(out) + "\n", args=tuple(args), blocks=blocks, plan=plan)
