"""The autotuning space: tile sizes, warps and stages per plan kind, pruned by extents.

Dot plans that walk (M, N) tiles in groups (`Plan.grouped`) also carry GROUP_M, the row
tiles per group; where the grid variables join the grouped order it is sized from the
operands at launch (`group_rows`). The dot table reaches the tiles and depths that run dense GEMMs near
cuBLAS on Hopper: 128 x 256 and 256 x 128 tiles with 8 warps, 3 to 5 stages (a stage that
does not fit in shared memory fails to compile and the autotuner skips it).

Pruning follows two rules: no tile larger than the next power of two of its extent (a
larger tile only computes masked lanes), and `tl.dot` tiles of at least 16 (the smallest
tensor-core shape). Clamped configurations that coincide are kept once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..arith import next_power_of_2
from .schedule import LENGTH_FILL, Plan, segment_index

__all__ = ["configs_for", "prune_configs", "group_rows", "operand_bytes"]

# (BLOCK_M, BLOCK_K, BLOCK_N, num_warps, num_stages)
_DOT = [
    (128, 32, 128, 8, 3), (128, 64, 128, 8, 3), (128, 32, 64, 4, 4), (64, 32, 128, 4, 4),
    (64, 32, 64, 4, 4), (64, 64, 64, 4, 3), (32, 32, 64, 4, 4), (64, 32, 32, 4, 4),
    (32, 32, 32, 4, 3), (16, 32, 64, 4, 3), (64, 32, 16, 4, 3), (16, 64, 16, 2, 3),
    (128, 64, 256, 8, 3), (256, 64, 128, 8, 3), (128, 64, 256, 8, 4), (256, 64, 128, 8, 4),
    (128, 64, 128, 8, 4), (128, 64, 128, 4, 5), (64, 64, 256, 4, 4), (128, 128, 64, 4, 4),
    (256, 128, 32, 8, 3),
    # Deep pipelines for block products with few K steps per program, each faster than every
    # other entry on its case (benchmarks/results/h200/session9/call7 and call9, `python -m
    # benchmarks.explore.config_sweep`): Block-ELL 32x32 s = 0.9 (M = the dense columns, K
    # and N clamped to the block) 6%, 64x64 s = 0.9 12%, 128x128 s = 0.5 4%.
    (256, 32, 64, 4, 5), (64, 32, 256, 4, 5), (128, 64, 256, 8, 5),
]
GROUP_M = 8  # row tiles per group in grouped program order
# The bytes of the left operand one group of rows may hold in L2 (`group_rows`), where the
# device's L2 size is not known: about half the L2 of an H100 or H200 (50 MB), the rest for
# the right operand's tiles.
L2_SHARE = 24 << 20
# Broadcast-and-sum plans hold an M x K x N block in registers: keep it to 8192 elements.
_REDUCE = [
    (1, 16, 128, 4, 2), (1, 32, 128, 4, 2), (2, 16, 128, 4, 2), (4, 8, 128, 4, 2),
    (1, 8, 256, 4, 2), (2, 32, 64, 4, 2), (4, 16, 64, 4, 2), (8, 8, 64, 4, 2),
    (16, 8, 32, 4, 2), (32, 4, 32, 4, 2), (64, 4, 16, 4, 2), (16, 16, 16, 4, 2),
    (128, 1, 32, 4, 2), (1, 64, 64, 4, 2), (1, 128, 32, 4, 2), (256, 1, 16, 4, 2),
    # Tall tiles of narrow groups: a sorted scatter reduces more groups per segment.
    (32, 2, 128, 4, 2), (64, 1, 128, 8, 2), (128, 1, 64, 8, 2),
    (16, 4, 128, 4, 2), (32, 4, 64, 4, 2), (16, 8, 64, 4, 2),
]


def configs_for(plan: Plan) -> list[dict]:
    """Every candidate: {"BLOCK_M": .., ..., "num_warps": .., "num_stages": ..}."""
    table = _DOT if plan.kind == "dot" else _REDUCE
    tiled = {a for a, _ in plan.tiles}
    out = []
    for m, k, n, warps, stages in table:
        blocks = {f"BLOCK_{a}": size for a, size in zip("MKN", (m, k, n)) if a in tiled}
        group = {"GROUP_M": GROUP_M} if plan.grouped else {}
        out.append({**blocks, **group, "num_warps": warps, "num_stages": stages})
    return _unique(out)


def operand_bytes(plan: Plan, nbytes: Mapping[str, int]) -> tuple[int, int]:
    """The bytes the left and the right dot operands read (`group_rows`), from each factor
    tensor's size in `nbytes`.

    A factor indexed directly by a variable whose declared length the plan applies holds its
    rows padded to the longest; the loop stops at each row's own length, so the factor is
    taken LENGTH_FILL full, as the schedule's cost model takes it (no data is read: a mean
    length would cost a host sync). Block-ELL's values AV[p, q, m, k] under `q < LEN[p]`
    count so; B[AK[p, q], k, n], reached through an index, counts whole.

    >>> from insum.parser import parse
    >>> from types import SimpleNamespace
    >>> stmt = parse("C[p, m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]")
    >>> plan = SimpleNamespace(stmt=stmt, left=(0,), right=(1,), lengths=(("q", "LEN", ("p",)),))
    >>> operand_bytes(plan, {"AV": 1000, "B": 800, "AK": 40})
    (500, 800)
    """
    padded = {fact[0] for fact in plan.lengths}
    sides = []
    for side in (plan.left, plan.right):
        factors = {plan.stmt.factors[i].name: plan.stmt.factors[i] for i in side}  # each tensor once
        sides.append(int(sum(
            nbytes[name] * (LENGTH_FILL if any(index.variable in padded for index in factor.indices) else 1)
            for name, factor in factors.items()
        )))
    return sides[0], sides[1]


def group_rows(
    plan: Plan, config: dict, extents: dict[str, int], left_bytes: int, right_bytes: int, share: int | None = None
) -> int:
    """GROUP_M where the grid variables join the grouped order (`Plan.grid_joins`); share:
    half the device's L2 in bytes (default L2_SHARE).

    Grid values in the rows (M): a group's programs sweep every column of its rows, so its
    rows' tiles of the left operand are read from HBM once if they stay in L2 over the
    sweep, and each column's tiles of the right operand once per group. The group is the
    most rows (a power of two) whose share of the left operand's read bytes
    (`operand_bytes`: padding past a declared length counts LENGTH_FILL) fits in half the
    L2; one row (p outside, in effect) when the right operand fits in the L2 by itself,
    which then needs no sharing between groups.

    Grid values in the columns (N): one M tile per group, so that every grid value's
    programs read that tile's rows of the shared left operand together.

    On an H200 (fp16 Block-ELL, `python -m benchmarks.explore.grid_order`, session 11
    call2): at 8192^3 64 x 64 s = 0.9 the best groups were 64 block rows or more (369 ->
    282 us), at 128 x 128 s = 0.5 16 to 32 (1074 -> 1049 us; 256 rows: 1666 us); at 4096^3
    (B 32 MB) more than one row gained nothing and lost up to 7%. In the columns (32 x 32
    blocks, M the dense columns) one M tile was best at all eight points, 4096^3 and 8192^3
    (616 -> 430 us at 8192^3 s = 0.9, 2975 -> 2074 us at s = 0.5).

    >>> from types import SimpleNamespace
    >>> plan = SimpleNamespace(grid_joins="M", grid=("p",), axis_vars=lambda a: ("m",))
    >>> group_rows(plan, {"BLOCK_M": 64, "GROUP_M": 8}, {"p": 128, "m": 64}, 128 * 172_000, 128 << 20)
    128
    >>> group_rows(plan, {"BLOCK_M": 128, "GROUP_M": 8}, {"p": 64, "m": 128}, 84 << 20, 128 << 20)
    16
    >>> group_rows(plan, {"BLOCK_M": 128, "GROUP_M": 8}, {"p": 32, "m": 128}, 22 << 20, 32 << 20)
    1
    """
    if plan.grid_joins == "N":
        return 1
    if not plan.grid_joins:
        return config["GROUP_M"]
    share = share or L2_SHARE
    if right_bytes <= 2 * share:
        return 1
    rows = -(-math.prod(extents[v] for v in plan.axis_vars("M")) // config["BLOCK_M"])
    rows *= math.prod(extents[v] for v in plan.grid)
    fit = max(1, share // max(1, left_bytes // max(1, rows)))
    return min(1 << (fit.bit_length() - 1), next_power_of_2(max(1, rows)))


# A segment-reduced scatter writes once per segment and tile: narrower tiles along the
# scattered variable multiply the atomics that one long row (a graph's hub) serialises on.
SEGMENT_TILE = 16


def prune_configs(plan: Plan, configs: list[dict], extents: dict[str, int]) -> list[dict]:
    """Clamp each tile to its extent (and to 16 for tl.dot), dropping duplicates; segment
    plans keep tiles of at least SEGMENT_TILE along the scattered variable."""
    floor = 16 if plan.kind == "dot" else 1
    segment = segment_index(plan)
    if segment is not None:
        var = segment.indices[0].variable
        axis = plan.var_axis(var)
        tall = min(SEGMENT_TILE, next_power_of_2(extents[var]))
        configs = [c for c in configs if c[f"BLOCK_{axis}"] >= tall] or configs
    pruned = []
    for config in configs:
        config = dict(config)
        for axis, _ in plan.tiles:
            extent = 1
            for var in plan.axis_vars(axis):  # a folded axis spans the product
                extent *= extents[var]
            limit = max(floor, next_power_of_2(extent))
            config[f"BLOCK_{axis}"] = min(config[f"BLOCK_{axis}"], limit)
        # Small blocks do not need many warps.
        elements = 1
        for axis, _ in plan.tiles:
            elements *= config[f"BLOCK_{axis}"]
        while config["num_warps"] > 1 and elements < 32 * config["num_warps"] * 4:
            config["num_warps"] //= 2
        pruned.append(config)
    return _unique(pruned)


def _unique(configs: list[dict]) -> list[dict]:
    seen, out = set(), []
    for config in configs:
        key = tuple(sorted(config.items()))
        if key not in seen:
            seen.add(key)
            out.append(config)
    return out
