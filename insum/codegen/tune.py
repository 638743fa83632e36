"""The autotuning space: tile sizes, warps and stages per plan kind, pruned by extents.

Dot plans that walk (M, N) tiles in groups (`Plan.grouped`) also carry GROUP_M, the row
tiles per group. The dot table reaches the tiles and depths that run dense GEMMs near
cuBLAS on Hopper: 128 x 256 and 256 x 128 tiles with 8 warps, 3 to 5 stages (a stage that
does not fit in shared memory fails to compile and the autotuner skips it).

Pruning follows two rules: no tile larger than the next power of two of its extent (a
larger tile only computes masked lanes), and `tl.dot` tiles of at least 16 (the smallest
tensor-core shape). Clamped configurations that coincide are kept once.
"""

from __future__ import annotations

from ..arith import next_power_of_2
from .schedule import Plan, segment_index

__all__ = ["configs_for", "prune_configs"]

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
