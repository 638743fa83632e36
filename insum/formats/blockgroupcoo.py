"""BlockGroupCOO: dense bm x bk blocks, grouped along block rows (InSum §4.1).

Blocks turn the per-nonzero product into a (bm x bk) @ (bk x N) tile product, which the
generated kernel runs on tensor cores with `tl.dot`; grouping g blocks of one block row
lets a program accumulate them before a single scatter.

A matrix whose size is not a multiple of the block is padded with zero rows/columns up
to the next multiple. `spmm` hides this: it pads B with zero rows to K' = ceil(K/bk)*bk
when needed and returns only the first M rows of the (M' x N) result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..api import insum
from ..arith import cdiv, next_power_of_2
from ..bind import tensor_version
from ..dtypes import as_dtype, promoted
from ..errors import InsumError, InsumIndexError
from .base import SparseFormat, pad_rows
from .coords import Coords, check_block, check_positive_int, index_dtype_for
from .grouping import GroupCounts
from .repeat import run_repeated
from .transposed import block_gradient, transpose_slots
from .tuning import tune, tuning_operand

_UNIQUE_SLOTS = frozenset({"F"})  # STORED_GRADIENT's slot index: no slot twice
_UNIQUE_GROUP_SLOTS = frozenset({"GF"})  # GROUPED_GRADIENT's: nor there (padding has its own scratch slots)
_STORED_VARYING = frozenset({"dW", "dC", "B"})  # what changes between its calls

__all__ = ["BlockGroupCOO"]

#: Block grids up to this many cells find their nonzero blocks with a dense occupancy map
#: (a fill, a scatter and a cumsum); larger, sparser grids sort the nonzeros' block keys.
BITMAP_CELLS = 1 << 22
# coarsen="tune" (the enumerate-and-coarsen paper's row coarsening): the factors tried, and
# the bounds on a candidate before it is timed. A coarse block is at most COARSEN_ROWS rows
# (the tallest M tile the tuner's table holds), and a packing may multiply at most
# COARSEN_WORK times the fine blocks' elements (its explicit zero blocks included): a
# taller tile reuses each slab of B for more rows, which on Hopper gained at most ~1.5x
# (32 x 32 against 64 x 64 blocks at equal density), so a union twice as large cannot win.
COARSEN_FACTORS = (2, 4)
COARSEN_ROWS = 128
COARSEN_WORK = 2.0


def _block_ranks(
    br: torch.Tensor, bc: torch.Tensor, MB: int, KB: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each nonzero's block numbered from 1 in row-major block order, and blocks per block row.

    Sync-free either way: the number of blocks is read later, with the packer's other sizes.
    """
    nnz, device = br.numel(), br.device
    if nnz == 0:
        return br, torch.zeros(MB, dtype=torch.int64, device=device)
    key = torch.add(bc, br, alpha=KB)
    if MB * KB <= max(BITMAP_CELLS, 4 * nnz):
        occupied = torch.zeros(MB * KB, dtype=torch.bool, device=device).index_fill_(0, key, True)
        return occupied.cumsum(0)[key], occupied.view(MB, KB).sum(1)
    ordered, order = torch.sort(key)
    new = F.pad(ordered.diff().sign(), (1, 0), value=1)  # 1 where a block starts
    rank = torch.empty_like(order).scatter_(0, order, new.cumsum(0))
    per_row = torch.zeros(MB, dtype=torch.int64, device=device)
    return rank, per_row.index_add_(0, ordered // KB, new)


class BlockGroupCOO(SparseFormat):
    """Block-grouped COO: AM[G] block rows, AK[G, g] block columns, AV[G, g, bm, bk] blocks
    (Block-ELL: no AM, AL[G] blocks per block row).

    block: (bm, bk) or one integer for square blocks; default (16, 16), the smallest
    tile `tl.dot` accepts. `from_torch` of a BSR tensor defaults to its own blocksize.
    group_size: blocks per group; None for the paper's rule applied to block rows;
    "row" for Block-ELL: one group per block row, as wide as the longest block row (zero
    blocks pad the others, empty block rows get an all-padding group), so each output
    block has one owner: there is no AM, the statement indexes C directly
    (`row_expression`) and the kernel stores without atomics; each block row's block count
    is packed as AL[G] and declared (`declared_lengths`), so the product stops there instead of multiplying
    the padding (which must stay zero: `SparseLinear` gives it no gradient); "tune" times the rule's
    value, its power-of-two neighbours and "row" (unless it would store over 4x the
    rule's blocks) with real SpMMs (B with `tune_cols` columns, `backend` as given) and
    keeps the fastest.
    pad: allow sizes that are not multiples of the block (zero padding); with pad=False
    such a matrix raises InsumError.
    coarsen: merge r neighbouring block rows into one block of r * bm rows, with explicit
    zero blocks where a block row lacks a block of the union (Hsu et al.'s coarsening): the
    kernel's tile is r times taller, so each slab of B it loads serves r times the rows, at
    the cost of multiplying the zeros. An integer r >= 1, or "tune": time r = 1 and each of
    COARSEN_FACTORS whose coarse block stays within COARSEN_ROWS rows and whose union holds
    at most COARSEN_WORK times the fine blocks' elements (B with `tune_cols` columns), and
    keep the fastest. Patterns whose neighbouring block rows share block columns gain;
    uniformly random ones mostly keep r = 1, except at low sparsity with wide products
    (H200, fp16, random 32 x 32 blocks at 8192^3, s = 0.5: r = 2, 1859 -> 1650 µs; 16 x 16
    blocks r = 4 below s = 0.6). The choice depends on B's width: pass `tune_cols` = the
    columns of the B it will multiply (at the default 128 the same matrices keep r = 1).
    The stored block is (r * bm, bk): a `SparseLinear` refuses a coarsened weight, whose
    zero blocks training would fill in.

    `fmt.expression` is the statement of this instance: `expression` for groups,
    `row_expression` for group_size="row".

    >>> A = torch.zeros(4, 4); A[0, 0] = 1.0; A[3, 2] = 2.0
    >>> F = BlockGroupCOO.from_dense(A, block=2, group_size=1)
    >>> F.AM.tolist(), F.AK.tolist(), tuple(F.AV.shape)
    ([0, 1], [[0], [1]], (2, 1, 2, 2))
    >>> E = BlockGroupCOO.from_dense(A, block=2, group_size="row")
    >>> E.expression, E.AK.tolist()
    ('C[p,m,n] += AV[p,q,m,k]*B[AK[p,q],k,n]', [[0], [1]])
    """

    name = "blockgroupcoo"
    expression = "C[AM[p],m,n] += AV[p,q,m,k]*B[AK[p,q],k,n]"
    row_expression = "C[p,m,n] += AV[p,q,m,k]*B[AK[p,q],k,n]"
    _value_names = ("AV",)
    _declared_names = frozenset({"AL"})

    @classmethod
    def from_torch(cls, t: torch.Tensor, **params: Any) -> BlockGroupCOO:
        """Pack a torch sparse matrix; a BSR/BSC tensor's blocksize is the default block."""
        if isinstance(t, torch.Tensor) and t.layout in (torch.sparse_bsr, torch.sparse_bsc):
            params.setdefault("block", tuple(int(s) for s in t.values().shape[-2:]))
        return super().from_torch(t, **params)

    @classmethod
    def _pack(
        cls,
        coords: Coords,
        *,
        block: int | tuple[int, int] = (16, 16),
        group_size: int | str | None = None,
        pad: bool = True,
        index_dtype: torch.dtype | None = None,
        tune_cols: int = 128,
        backend: str = "auto",
        coarsen: int | str = 1,
    ) -> BlockGroupCOO:
        bm, bk = check_block(block)
        if coarsen != 1 or isinstance(coarsen, bool):
            return cls._coarsened(coords, (bm, bk), coarsen, group_size=group_size, pad=pad, index_dtype=index_dtype,
                                  tune_cols=tune_cols, backend=backend)
        M, K = coords.shape
        if not pad and (M % bm or K % bk):
            raise InsumError(
                f"block ({bm}, {bk}) does not divide the matrix shape ({M}, {K}); pass pad=True "
                "to pad it with zeros"
            )
        if isinstance(group_size, str) and group_size not in ("row", "tune"):
            raise InsumError(
                f"group_size must be an integer >= 1, None, 'row' or 'tune', got {group_size!r}"
            )
        if group_size == "tune":
            return cls._tuned(coords, (bm, bk), index_dtype, tune_cols, backend)
        if group_size is not None and group_size != "row":
            check_positive_int("group_size", group_size)
        MB, KB = cdiv(M, bm), cdiv(K, bk)
        itype = index_dtype_for(MB, KB, requested=index_dtype)
        device = coords.device
        params = dict(block=(bm, bk), group_size=group_size, pad=pad, index_dtype=index_dtype)

        coords = coords.within_shape()  # (the device work below indexes by them before the sync)
        rows, cols = coords.rows, coords.cols
        br = torch.div(rows, bm, rounding_mode="floor")
        bc = torch.div(cols, bk, rounding_mode="floor")
        rank, counts = _block_ranks(br, bc, MB, KB)  # rank: 1-based block of each nonzero

        # The one host sync: the number of blocks and the padded group count.
        if group_size == "row":
            host = coords.read(counts.sum(), counts.max() if MB else counts.sum())
            if host is not None:
                blocks, g, G, fan_in = host[0], max(host[1], 1), MB, 1
        elif group_size is None:
            rule = GroupCounts(counts, KB)
            host = coords.read(rule.values)
            if host is not None:
                (g, G), blocks = rule.choose(host), -host[0]
                fan_in = rule.fan_in(host, g)
                per_row = rule.per_row(g)
        else:
            g = group_size
            per_row = cdiv(counts, g)
            host = coords.read(counts.sum(), per_row.sum(), F.pad(per_row, (0, 1)).max())
            if host is not None:
                blocks, G, fan_in = host
        if host is None:
            return cls._pack(coords.canonical(), **params)

        # Every nonzero's block slot (group * g + position): its block's rank minus the
        # rank its group row starts at, plus the groups before. All scatters over nonzeros.
        crow = F.pad(counts, (1, 0), value=1).cumsum(0)  # 1-based block row pointer
        if group_size == "row":
            group = br
            slot = torch.add(rank - crow[:-1][br], br, alpha=g)
            tensors = {}
        else:
            cum = torch.cumsum(per_row, 0)
            base = torch.sub(crow[:-1], cum - per_row, alpha=g)  # group j starts at base + j*g
            slot = rank - base[br]
            group = torch.div(slot, g, rounding_mode="floor")
            tensors = {"AM": torch.repeat_interleave(per_row, output_size=G).to(itype)}
        # Pad a group with its first (smallest) block column; an empty block row with 0.
        pad = torch.zeros(G, dtype=torch.int64, device=device)
        pad.scatter_reduce_(0, group, bc, reduce="amin", include_self=False)
        AK = pad.unsqueeze(1).repeat(1, g)
        AK.view(-1).index_put_((slot,), bc)
        # Each nonzero's place in AV viewed flat: (slot, row in block, column in block).
        inner = torch.add(torch.sub(cols, bc, alpha=bk), torch.sub(rows, br, alpha=bm), alpha=bk)
        AV = torch.zeros(G * g * bm * bk, dtype=coords.dtype, device=device)
        AV.index_put_((torch.add(inner, slot, alpha=bm * bk),), coords.vals)
        tensors["AK"] = AK.to(itype)
        tensors["AV"] = AV.view(G, g, bm, bk)
        if group_size == "row":  # each block row's stored blocks: its declared length
            tensors["AL"] = counts.to(itype)
        chosen = {"block": (bm, bk), "group_size": group_size or g, "blocks": blocks, "fan_in": fan_in}
        fmt = cls._packed(coords, tensors, itype, chosen)
        if group_size == "row":
            fmt.expression = cls.row_expression
        return fmt

    @classmethod
    def _tuned(
        cls, coords: Coords, block: tuple[int, int], index_dtype, tune_cols: int, backend: str
    ) -> BlockGroupCOO:
        coords = coords.checked()

        def build(g: int | str | None) -> BlockGroupCOO:
            return cls._pack(coords, block=block, group_size=g, index_dtype=index_dtype)

        rule = build(None)
        g0, (bm, _) = rule.group_size, block
        # Blocks per block row, from the rule's groups: a padded slot repeats slot 0.
        per_group = (rule.AK != rule.AK[:, :1]).sum(1) + 1
        per_row = torch.zeros(rule.padded_shape[0] // bm, dtype=torch.int64, device=coords.device)
        per_row.index_add_(0, rule.AM.long(), per_group)
        widest = int(per_row.max()) if per_row.numel() else 0
        candidates = sorted({max(1, g0 // 2), g0, min(next_power_of_2(widest), 2 * g0)})
        if per_row.numel() * max(widest, 1) <= 4 * max(rule.AK.numel(), 1):
            candidates.append("row")  # unless Block-ELL would store 4x the rule's blocks
        B = tuning_operand(coords, tune_cols)
        best, times = tune(candidates, build, B, backend)
        best.params["tuned_seconds"] = times
        return best

    @classmethod
    def _coarsened(cls, coords: Coords, block: tuple[int, int], coarsen: int | str, **params: Any) -> BlockGroupCOO:
        """The packing with r neighbouring block rows merged (see `coarsen` above)."""
        bm, bk = block
        if coarsen == "tune":
            if params["group_size"] == "tune":
                raise InsumError('coarsen="tune" takes a fixed group_size (an integer, None or "row"), not "tune"')
            return cls._tuned_coarsening(coords, block, **params)
        if isinstance(coarsen, bool) or not isinstance(coarsen, int) or coarsen < 1:
            raise InsumError(f'coarsen must be an integer >= 1 or "tune", got {coarsen!r}')
        if not params["pad"] and coords.shape[0] % (coarsen * bm):
            raise InsumError(
                f"coarsen={coarsen} merges blocks of {bm} rows into {coarsen * bm}, which does not divide the "
                f"matrix's {coords.shape[0]} rows; pass pad=True to pad it with zeros"
            )
        fmt = cls._pack(coords, block=(coarsen * bm, bk), **params)
        fmt.params.update(coarsen=coarsen, pattern_block=(bm, bk))
        return fmt

    @classmethod
    def _tuned_coarsening(cls, coords: Coords, block: tuple[int, int], **params: Any) -> BlockGroupCOO:
        coords = coords.checked()
        bm, tune_cols = block[0], params.pop("tune_cols")
        fine = cls._pack(coords, block=block, **params)
        packed: dict[int, BlockGroupCOO] = {1: fine}
        for r in COARSEN_FACTORS:
            if r * bm > min(COARSEN_ROWS, max(coords.shape[0], 1)):
                break
            coarse = cls._coarsened(coords, block, r, **params)
            if coarse.params["blocks"] * r <= COARSEN_WORK * fine.params["blocks"]:
                packed[r] = coarse
        B = tuning_operand(coords, tune_cols)
        best, times = tune(list(packed), packed.__getitem__, B, params["backend"])
        best.params["coarsen_seconds"] = times
        return best

    @property
    def block(self) -> tuple[int, int]:
        # (read from the packed dict directly: the views of every product and gradient ask,
        # and `fmt.AV` goes through `__getattr__`)
        shape = self._tensors["AV"].shape
        return (int(shape[2]), int(shape[3]))

    @property
    def group_size(self) -> int:
        return int(self._tensors["AK"].shape[1])

    @property
    def padded_shape(self) -> tuple[int, int]:
        """The shape rounded up to whole blocks, which the kernel works on (kept outside
        traced code: a layer's step asks six times)."""
        derived = {} if torch.compiler.is_compiling() else self.__dict__.setdefault("_derived", {})
        if "padded_shape" not in derived:
            (bm, bk), (M, K) = self.block, self.shape
            derived["padded_shape"] = (cdiv(M, bm) * bm, cdiv(K, bk) * bk)
        return derived["padded_shape"]

    def _dense(self) -> torch.Tensor:
        (bm, bk), (Mp, Kp) = self.block, self.padded_shape
        G, g = self.AK.shape
        tiles = torch.zeros(Mp // bm, Kp // bk, bm, bk, dtype=self.dtype, device=self.device)
        owner = self.AM.long() if "AM" in self._tensors else torch.arange(G, device=self.device)
        rows = owner.unsqueeze(1).expand(G, g)
        tiles.index_put_((rows, self.AK.long()), self.AV, accumulate=True)
        dense = tiles.permute(0, 2, 1, 3).reshape(Mp, Kp)
        return dense[: self.shape[0], : self.shape[1]].contiguous()

    @classmethod
    def statement_forms(cls) -> tuple[str, ...]:
        return (cls.expression, cls.row_expression)

    def operand(self, B: torch.Tensor) -> torch.Tensor:
        """B padded with zero rows to whole blocks, viewed (K'/bk, bk, N)."""
        (_, bk), (_, Kp) = self.block, self.padded_shape
        return pad_rows(B, Kp).view(Kp // bk, bk, B.shape[1])

    def from_operand(self, dB: torch.Tensor) -> torch.Tensor:
        K, Kp = self.shape[1], self.padded_shape[1]
        rows = dB.reshape(Kp, -1)
        return rows if Kp == K else rows[:K]  # (a slice that keeps everything is still an op)

    def output_shape(self, N: int) -> tuple[int, ...]:
        (bm, _), (Mp, _) = self.block, self.padded_shape
        return (Mp // bm, bm, N)

    def result(self, C: torch.Tensor) -> torch.Tensor:
        return C.view(self.padded_shape[0], -1)[: self.shape[0]]

    def output_view(self, dC: torch.Tensor) -> torch.Tensor:
        return pad_rows(dC, self.padded_shape[0]).reshape(self.output_shape(dC.shape[1]))

    @classmethod
    def pruning_block(cls, params: Mapping[str, Any]) -> tuple[int, int]:
        """Whole blocks of the packer's block size."""
        return check_block(params.get("block", (16, 16)))

    @classmethod
    def row_padding_slots(cls, shape: tuple[int, int], longest: int, params: Mapping[str, Any]) -> int:
        """group_size="row" (Block-ELL) pads every block row to the longest: at most bm rows'
        worth of blocks per block row. Groups pad little (0)."""
        if params.get("group_size") != "row":
            return 0
        (M, K), (bm, bk) = shape, cls.pruning_block(params)
        return cdiv(M, bm) * min(cdiv(K, bk), bm * longest) * bm * bk

    def _row_counts(self) -> torch.Tensor | None:
        """Blocks per block row of a Block-ELL packing (AL, group_size="row"), None for groups
        and for a Block-ELL object built without AL (then every slot counts as stored). The
        counts are packed, not read off AK: an empty block row's padding repeats a column as
        a stored block's padding does, and only its count (0) tells them apart."""
        if self.params.get("group_size") != "row" or "AM" in self._tensors:
            return None
        return self._tensors.get("AL")

    def check_indices(self) -> None:
        """As `SparseFormat.check_indices`, and no block row counted longer than AK's rows (the
        kernel would clamp it, but the values' gradient lists each row's stored blocks by
        its count)."""
        super().check_indices()
        counts = self._row_counts()
        if counts is None or not counts.numel() or tensor_version(counts) is None:
            return
        longest = int(counts.max())
        if longest > self.AK.shape[1]:
            raise InsumIndexError(
                f"AL holds {longest}, out of range: more blocks than a block row of AK holds ({self.AK.shape[1]})"
            )

    def counted_params(self) -> dict[str, Any]:
        """The stored block count ("blocks": `_stored_blocks` lists that many) and fan_in, off
        this object's tensors: a Block-ELL packing's from its row counts (one sync), a
        grouped packing's not recorded."""
        counts = self._row_counts()
        if counts is None:
            return {"blocks": None, "fan_in": None}
        return {"blocks": int(counts.sum()), "fan_in": 1}

    def declared_lengths(self) -> dict[str, torch.Tensor] | None:
        """Block-ELL rows stop at their own block count (`insum(..., lengths=)`): at s = 0.9
        with random blocks the padding to the longest block row is about 45% of the slots."""
        counts = self._row_counts()
        return None if counts is None else {"q[p]": counts}

    #: AV's gradient on the stored blocks only: one program per stored block (F: its slot in
    #: AV viewed (G * g, bm, bk); SP, SK: its block row and column), padding left zero.
    STORED_GRADIENT = "dW[F[s], m, k] = dC[SP[s], m, n] * B[SK[s], k, n]"
    #: The same with J stored blocks of one block row per program (GF: their slots, padded
    #: with slots of a scratch tail; GP: the row; GK: their columns): dC's rows are read once
    #: for the J blocks instead of once per block (the statement stacks (j, k) on one tile axis).
    GROUPED_GRADIENT = "dW[GF[t, j], m, k] = dC[GP[t], m, n] * B[GK[t, j], k, n]"
    #: The same on every slot (the derived statement), for traced code over a format whose
    #: block count is not known (built by hand, without params["blocks"]): padding masked after.
    SLOT_GRADIENT = "dW[p, q, m, k] = dC[p, m, n] * B[AK[p, q], k, n]"

    def _stored_blocks(self) -> dict[str, torch.Tensor] | None:
        """F, SP, SK of `STORED_GRADIENT` for a Block-ELL packing, listed at the packed block
        count (a static size: no host sync, and traceable); kept on the object outside traced
        code. None in traced code where the count is unknown."""
        tracing = torch.compiler.is_compiling()
        derived = {} if tracing else self.__dict__.setdefault("_derived", {})
        versions = None if tracing else self._index_versions()
        kept = derived.get("stored_blocks")
        blocks = kept[1] if kept is not None and kept[0] == versions else None
        if blocks is None:
            count = self.params.get("blocks")
            if count is None and tracing:
                return None
            AK, counts = self.AK, self._row_counts()
            stored = (torch.arange(AK.shape[1], device=AK.device) < counts[:, None]).reshape(-1)
            slots = (stored.nonzero() if count is None else torch.nonzero_static(stored, size=count)).squeeze(1)
            rows = torch.div(slots, AK.shape[1], rounding_mode="floor")
            blocks = {"F": slots.to(AK.dtype), "SP": rows.to(AK.dtype), "SK": AK.reshape(-1)[slots]}
            if versions is not None:
                derived["stored_blocks"] = (versions, blocks)
        return blocks

    def _index_versions(self) -> tuple[int, ...] | None:
        """The version counters of the index tensors (AK, AL): what is derived from them is
        kept per version, so an in-place edit (`fmt.AK.copy_(...)`) derives it again. None
        where there are none to trust (traced, inference tensors)."""
        versions = tuple(tensor_version(t) for t in self._tensors.values() if not t.is_floating_point())
        return None if None in versions else versions

    def _stored_groups(self) -> dict[str, torch.Tensor] | None:
        """GF, GP, GK of `GROUPED_GRADIENT`: each block row's stored blocks in groups of J
        (J * bk = 128 lanes), the last group of a row padded with scratch slots past the
        G * g real ones (GF stays unique: a padded entry writes its own scratch slot) and
        column 0. Counted on the host once per format (a sync), so None in traced code, and
        None where a group would hold one block (STORED_GRADIENT is then the same)."""
        G, g, bm, bk = self._tensors["AV"].shape
        J = max(1, 128 // bk)
        if J == 1 or torch.compiler.is_compiling():
            return None
        derived = self.__dict__.setdefault("_derived", {})
        versions = self._index_versions()
        kept = derived.get("stored_groups")
        groups = kept[1] if kept is not None and kept[0] == versions else None
        if groups is None:
            AK, counts = self.AK, self._row_counts().long()
            per_row = torch.div(counts + J - 1, J, rounding_mode="floor")
            T = int(per_row.sum())  # (the one sync)
            device = AK.device
            rows = torch.repeat_interleave(torch.arange(G, device=device), per_row, output_size=T)
            first = torch.cumsum(per_row, 0) - per_row  # each row's first group
            q = (torch.arange(T, device=device) - first[rows])[:, None] * J + torch.arange(J, device=device)
            valid = q < counts[rows][:, None]
            scratch = G * g + torch.cumsum((~valid).reshape(-1), 0).reshape(T, J) - 1
            GF = torch.where(valid, rows[:, None] * g + q, scratch)
            GK = torch.where(valid, AK[rows[:, None], q.clamp(max=g - 1)], 0)
            groups = {"GF": GF.to(AK.dtype), "GP": rows.to(AK.dtype), "GK": GK.to(AK.dtype)}
            if versions is not None:
                derived["stored_groups"] = (versions, groups)
        return groups

    def value_gradient_tables(self) -> dict[str, torch.Tensor]:
        """GF, GP, GK of `GROUPED_GRADIENT` (`_stored_groups`), whose count is a host sync:
        a layer that keeps them runs the grouped gradient under torch.compile too."""
        groups = None if self._row_counts() is None else self._stored_groups()
        return groups or {}

    def value_gradient(self, name, dC, B, backend, precision, tables=None):
        """Block-ELL: AV's gradient runs on the stored blocks only (`STORED_GRADIENT`), not on
        every slot as the derived statement does: the padding (~45% of the slots at s = 0.9
        with random blocks) costs neither a program nor a read of dC and B, and stays zero.
        Where the group tables are known (`tables`, or counted here outside traced code), J
        stored blocks of a block row per program (`GROUPED_GRADIENT`)."""
        if name != "AV" or self._row_counts() is None:
            return None
        G, g, bm, bk = self.AV.shape
        dtype = promoted(dC.dtype, B.dtype)
        groups = tables if tables else self._stored_groups()
        if groups:
            # A slot per group entry past the G * g real ones: enough for every padded entry.
            dW = torch.empty(G * g + groups["GF"].numel(), bm, bk, dtype=dtype, device=dC.device)
            run_repeated(self, self.GROUPED_GRADIENT, {"dW": dW, "dC": dC, "B": B, **groups},
                         {"unique_indices": _UNIQUE_GROUP_SLOTS}, _STORED_VARYING, backend=backend, precision=precision)
            if torch.compiler.is_compiling():  # (traced: the slice and view the graph has always had)
                return dW[: G * g].view(G, g, bm, bk)
            return dW.as_strided((G, g, bm, bk), (g * bm * bk, bm * bk, bk, 1))  # (its first G * g slots: one op)
        blocks = self._stored_blocks()
        if blocks is None:
            dW = insum(self.SLOT_GRADIENT, dC=dC, B=B, AK=self.AK, backend=backend, precision=precision)
            padding = torch.arange(g, device=dW.device) >= self._row_counts()[:, None]
            return dW.to(dtype).masked_fill(padding[:, :, None, None], 0)
        dW = torch.empty(G * g, bm, bk, dtype=dtype, device=dC.device)
        run_repeated(self, self.STORED_GRADIENT, {"dW": dW, "dC": dC, "B": B, **blocks}, {"unique_indices": _UNIQUE_SLOTS},
                     _STORED_VARYING, backend=backend, precision=precision)
        return dW.view(G, g, bm, bk)

    def transposed_pattern(self) -> dict[str, torch.Tensor]:
        AM = self._tensors.get("AM")  # absent when each block row is one group ("row")
        one_group_per_row = AM is None
        if one_group_per_row:
            AM = torch.arange(self.AK.shape[0], device=self.AK.device)
        rows = AM.unsqueeze(1).expand_as(self.AK)
        KB = self.padded_shape[1] // self.block[1]
        counts = self._row_counts()  # declared padding: no slot of the transpose
        stored = None if counts is None else torch.arange(self.AK.shape[1], device=self.AK.device) < counts[:, None]
        return transpose_slots(rows, self.AK, KB, self.index_dtype, by_column=one_group_per_row, stored=stored)

    def input_gradient(self, pattern, dC, backend, precision) -> torch.Tensor:
        KB = self.padded_shape[1] // self.block[1]
        return block_gradient(as_dtype(self.AV, dC.dtype), pattern, dC, KB, backend, precision, owner=self)

    def _describe(self) -> dict[str, Any]:
        shown = {"block": self.block, "group_size": self.group_size}
        if self.params.get("group_size") == "row":
            shown["group_size"] = "row"
            shown["width"] = self.group_size
        shown["blocks"] = self.params.get("blocks")
        if "tuned_seconds" in self.params:
            shown["tuned"] = {
                g: f"{t * 1e6:.0f}us" for g, t in self.params["tuned_seconds"].items()
            }
        if self.params.get("coarsen", 1) != 1:
            shown["coarsen"] = self.params["coarsen"]
        if "coarsen_seconds" in self.params:
            shown["coarsen_tuned"] = {r: f"{t * 1e6:.0f}us" for r, t in self.params["coarsen_seconds"].items()}
        return shown
