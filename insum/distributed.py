"""insum.distributed: row-sharded SpMM over torch.distributed (NCCL on GPUs, gloo on CPU).

A square sparse matrix A (a graph's adjacency) and a dense B (its node features) are cut
into the same contiguous row ranges, one per rank. Rank r owns rows `part.rows` of both
and computes its rows of A @ B from its own rows of B plus the few remote rows of B that
its columns touch (its *halo*), fetched with one `all_to_all_single` that carries only
those rows, not an all-gather of B:

    >>> parts = partition_rows(A, world_size)          # every rank, the same A  # doctest: +SKIP
    >>> C_local = spmm(parts[rank], B[parts[rank].rows])                         # doctest: +SKIP

How the rows are packed: one grouping, cut by column range. Two things pull apart. The
exchange (~1 ms for 50M nonzeros on two H200s) hides only behind work that needs no
remote row, so the product runs in two passes: a *local* pass over B_local while the halo
travels, then a *halo* pass. Packed as two matrices (A[rows, rows] and A[rows, remote]),
the halo block's rows are short (~2 of a row's ~13 entries on a community graph), so its
groups are short (g = 2 where the whole rows take 4 to 8): more groups, index loads and
writes per nonzero; it measured 28% of the time for 15% of the nonzeros. One format over
a compact [B_local | received] operand keeps whole-row groups, but starts only when the
exchange ends and needs all of B_local copied into that operand.

So (format=None, the default) each row's columns are renumbered, local ones first (0 ..
n_local-1: B_local's rows), remote ones after (the received rows), and the whole rows are
cut into GroupCOO groups of one size g, the one `formats.auto`'s cost model ranks first
on these rows: exactly the groups of a one-GPU packing of them. A group of local columns
only goes to the local pass; every other group (the row's remote groups and at most one
*mixed* group, straddling its last local and first remote columns) to the halo pass,
which reads `[B_local[part.ext_rows] | received rows]`: the local rows its mixed groups
touch are gathered ahead of the received ones in the buffer they arrive in. Both passes
together hold the groups and slots of one packing (the model's cost of the 200k-node
community graph's rank 0: 2.15M gathered rows with g = 8, 2.33M with the ext_rows gather,
against 2.54M for the two blocks packed by formats.auto, g = 8 and 2). The price: the
mixed groups move local nonzeros behind the exchange (the halo pass holds 38% of them, not
16%; still hidden while the local pass outlasts the exchange), and ext_rows, gathered while
the halo travels, cover most local rows (`benchmarks/distributed_counts.py`, results under
benchmarks/results/cpu/). Cutting each row's groups at the local/remote boundary instead
would need no ext_rows but pads both halves: about g + 3 more gathered rows per row in the
model, against ~2 (a gathered row read and written) for its share of ext_rows; smaller g
mixes less but groups more (g = 4: 2.61M). Both passes declare their
sorted rows, so a row's groups are summed in registers (segment reduction) and written
once per tile. The local pass writes C (`=`), the halo pass adds into it in place (`+=`),
in half precision too wherever the whole rows' fan-in allows (`accumulation_dtype`, as
on one GPU): no float32 scratch, no extra add pass. A named `format=` packs the two blocks
separately in it instead (`part.ext_rows` is then empty), e.g. "auto" for the former
default, to compare.

A call enqueues, with no host sync in steady state: one gather of the rows to send (into a
buffer the part keeps, reused by later calls), the `all_to_all_single` (async), the gather
of ext_rows, the local pass, the wait (on NCCL a stream dependency), the halo pass. The
backward mirrors it: the halo pass's transposed product first (its received rows go back
to their owners), the exchange back (async), the local pass's transposed product while
it travels, ext_rows' and then the received rows' gradients added into B_local's. The
transposed products run on the formats' transposed patterns (kept by the part after the
first backward), as SparseLinear's input gradient does, instead of a scatter per slot.

One module of about 650 lines: the partition, the exchange and the differentiable product
all read the same halo bookkeeping (`RowPart`), and split apart each would need it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .api import insum
from .arith import cdiv
from .dtypes import VALUE_DTYPES, compute_dtype
from .errors import InsumError, InsumShapeError, InsumTypeError
from .formats.auto import packer, rank, row_stats
from .formats.base import (
    Coords,
    SparseFormat,
    accumulation_dtype,
    check_positive_int,
    coords_of,
    index_dtype_for,
    overwrite,
)
from .formats.groupcoo import GroupCOO
from .formats.grouping import pack_row_groups
from .formats.transposed import SCALAR, with_zero_slot

__all__ = ["RowPart", "partition_rows", "spmm", "steps", "BALANCES"]

#: How `partition_rows` places the row boundaries.
BALANCES = ("nnz", "rows")
#: The parameters of the default packing (format=None).
SPLIT_PARAMS = ("group_size", "index_dtype", "n_cols")


@dataclass(frozen=True, eq=False)
class RowPart:
    """One rank's share of a square sparse matrix A (n x n), made by `partition_rows`.

    rows: the global rows (and rows of B) this rank owns, a `range`.
    row_starts: every rank's first row, plus n at the end (world_size + 1 entries).
    local: the local pass, columns relative to rows.start (they index B_local).
    halo: the halo pass, columns index `[B_local[ext_rows] | received rows]`.
    halo_rows: the global rows of B received (int64, sorted, so grouped by owner);
        `recv_counts[s]` of them come from rank s.
    send_rows: the rows of B_local (local indices, int64) that other ranks need,
        grouped by destination rank; `send_counts[d]` of them go to rank d.
    ext_rows: the rows of B_local (local indices, int64, sorted) that the halo pass reads
        (its mixed groups' local columns); empty when the blocks are packed separately.
    fan_in: the most groups that add into one output row over both passes (None: unknown).
    """

    rank: int
    world_size: int
    shape: tuple[int, int]
    rows: range
    row_starts: tuple[int, ...]
    local: SparseFormat
    halo: SparseFormat
    halo_rows: torch.Tensor
    recv_counts: tuple[int, ...]
    send_rows: torch.Tensor
    send_counts: tuple[int, ...]
    ext_rows: torch.Tensor
    fan_in: int | None
    # Buffers reused across calls and the transposed patterns of the first backward.
    workspace: dict = field(init=False, repr=False, default_factory=dict)

    @property
    def nnz(self) -> int:
        """Nonzeros of A in this rank's rows (local and halo passes together)."""
        return self.local.nnz + self.halo.nnz

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def remote_rows(self) -> list[torch.Tensor]:
        """The global rows of B this rank receives from each rank (empty for itself)."""
        return list(torch.split(self.halo_rows, list(self.recv_counts)))

    def exchange_bytes(self, columns: int, dtype: torch.dtype | None = None) -> int:
        """Bytes this rank receives per SpMM with a B of `columns` columns."""
        size = torch.empty((), dtype=dtype or self.dtype).element_size()
        return sum(self.recv_counts) * columns * size

    def allgather_bytes(self, columns: int, dtype: torch.dtype | None = None) -> int:
        """Bytes this rank would receive if B were all-gathered instead."""
        size = torch.empty((), dtype=dtype or self.dtype).element_size()
        return (self.shape[0] - len(self.rows)) * columns * size

    def stats(self) -> dict[str, Any]:
        """What each pass holds: nonzeros, groups, group size, stored slots; and the rows
        exchanged and gathered (host integers; for the benchmark and the report)."""

        def one(fmt: SparseFormat) -> dict[str, Any]:
            info = {"format": type(fmt).__name__, "nnz": fmt.nnz, "slots": fmt.stored_values}
            if isinstance(fmt, GroupCOO):
                info.update(groups=fmt.groups, group_size=fmt.group_size)
            return info

        return {
            "rows": len(self.rows), "local": one(self.local), "halo": one(self.halo),
            "halo_rows": sum(self.recv_counts), "send_rows": sum(self.send_counts),
            "ext_rows": int(self.ext_rows.numel()), "fan_in": self.fan_in,
        }  # fmt: skip

    def to(self, device: torch.device | str) -> RowPart:
        """A copy with every tensor on `device` (the partitioning is not repeated)."""
        return RowPart(
            self.rank, self.world_size, self.shape, self.rows, self.row_starts,
            self.local.to(device), self.halo.to(device), self.halo_rows.to(device),
            self.recv_counts, self.send_rows.to(device), self.send_counts,
            self.ext_rows.to(device), self.fan_in,
        )  # fmt: skip

    def buffer(self, name: str, rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
        """A (rows, columns) buffer kept across calls (stream order makes reuse safe: the
        next call's writes are enqueued after this call's readers, NCCL's included)."""
        key = (name, columns, dtype)
        buf = self.workspace.get(key)
        if buf is None or buf.shape[0] != rows:
            buf = self.workspace[key] = torch.empty(rows, columns, dtype=dtype, device=self.device)
        return buf

    def __repr__(self) -> str:
        return (
            f"RowPart(rank={self.rank}/{self.world_size}, rows={self.rows.start}:{self.rows.stop}, "
            f"nnz={self.nnz} ({self.halo.nnz} in the halo pass), halo_rows={sum(self.recv_counts)}, "
            f"send_rows={sum(self.send_counts)}, ext_rows={self.ext_rows.numel()}, "
            f"format={type(self.local).__name__}/{type(self.halo).__name__}, "
            f"dtype={self.dtype}, device={self.device})"
        )


# --------------------------------------------------------------------------- partitioning


def _row_starts(row_ptr: torch.Tensor, n: int, world_size: int, balance: str) -> torch.Tensor:
    """First row of every rank plus n (world_size + 1), on row_ptr's device.

    "nnz": rank k starts at the first row with at least k * nnz / world_size nonzeros
    before it; "rows": equal row counts (the first ranks take one more when uneven).
    """
    ranks = torch.arange(world_size + 1, device=row_ptr.device)
    nnz = row_ptr[-1]
    if balance == "rows":
        return cdiv(ranks * n, world_size)  # the first ranks take the extra rows
    targets = (ranks * nnz) // world_size
    starts = torch.searchsorted(row_ptr, targets).clamp_(max=n)
    starts[-1] = n
    return starts


def partition_rows(
    A: torch.Tensor,
    world_size: int,
    balance: str = "nnz",
    *,
    rank: int | None = None,
    format: str | None = None,
    **format_params: Any,
) -> list[RowPart]:
    """Split a square sparse matrix A into `world_size` contiguous row ranges, one part each.

    A: a dense or torch sparse (COO, CSR, ...) n x n matrix, the same on every rank.
    balance: "nnz" (default) balances nonzeros, "rows" balances rows. A rank may get
    no rows (n < world_size, or one row holding most nonzeros).
    rank: pack only this rank's part (what each process of a run does) and return it
    as a one-element list; None packs every part.
    format: None (default) cuts one GroupCOO grouping of the whole rows by column range
    (the module docstring says why); its parameters: `group_size` (default: formats.auto's
    cost model on the rows, for B of `n_cols` columns, default 128) and `index_dtype`.
    A format name ("auto", "GroupCOO", "COO", "ELL", "CELL", ...) packs the local and the
    remote block separately in it, with its packer's parameters; COO, GroupCOO and ELL add
    the halo pass into the local pass's output in place, other formats in an extra pass.

    Everything runs vectorised on A's device.

    >>> A = torch.tensor([[1.0, 2.0, 0.0], [0.0, 3.0, 0.0], [4.0, 0.0, 5.0]])
    >>> [p.rows for p in partition_rows(A, 2, "rows")]
    [range(0, 2), range(2, 3)]
    >>> partition_rows(A, 2, "rows")[1].halo_rows.tolist()
    [0]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InsumError(f"world_size must be an integer >= 1, got {world_size!r}")
    if balance not in BALANCES:
        raise InsumError(f"unknown balance {balance!r}; choose one of {', '.join(BALANCES)}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise InsumError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    if format is None:
        unknown = [p for p in format_params if p not in SPLIT_PARAMS]
        if unknown:
            raise InsumError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))} for the default packing "
                f"(format=None); valid: {', '.join(SPLIT_PARAMS)}"
            )
        pack = None
    else:
        pack = packer(format)
    if isinstance(A, torch.Tensor) and A.dim() == 2 and A.shape[0] != A.shape[1]:
        raise InsumShapeError(
            f"distributed spmm partitions B like A's rows, so A must be square; A has shape "
            f"{tuple(A.shape)} ({A.shape[0]} rows, {A.shape[1]} columns)"
        )
    coords = coords_of(A).checked()  # sorted row-major, duplicates summed
    n = coords.shape[0]
    row_ptr = coords.row_ptr
    if coords.nnz == 0:
        balance = "rows"
    starts_t = _row_starts(row_ptr, n, world_size, balance)
    bounds_t = row_ptr[starts_t]
    host = torch.cat([starts_t, bounds_t]).tolist()
    starts, bounds = host[: world_size + 1], host[world_size + 1 :]

    # Which rank needs which remote row of B: (needing rank, column) of every nonzero
    # whose column another rank owns, deduplicated; sorted by rank, then column.
    first_rows = starts_t[:-1]
    row_owner = torch.searchsorted(first_rows, coords.rows, right=True) - 1
    col_owner = torch.searchsorted(first_rows, coords.cols, right=True) - 1
    remote = row_owner != col_owner
    need = torch.unique(row_owner[remote] * max(n, 1) + coords.cols[remote])
    need_rank, need_col = need // max(n, 1), need % max(n, 1)
    need_owner = torch.searchsorted(first_rows, need_col, right=True) - 1

    ranks = range(world_size) if rank is None else [rank]
    return [
        _pack_part(r, coords, starts, bounds, need_rank, need_col, need_owner, pack, format_params)
        for r in ranks
    ]


def _pack_part(
    r: int,
    coords: Coords,
    starts: list[int],
    bounds: list[int],
    need_rank: torch.Tensor,
    need_col: torch.Tensor,
    need_owner: torch.Tensor,
    pack_format: Callable[..., SparseFormat] | None,
    format_params: dict[str, Any],
) -> RowPart:
    world_size = len(starts) - 1
    first, stop = starts[r], starts[r + 1]
    n_local = stop - first
    entries = slice(bounds[r], bounds[r + 1])
    rows = coords.rows[entries] - first
    cols = coords.cols[entries]
    vals = coords.vals[entries]
    device = cols.device

    halo_rows = need_col[need_rank == r]  # sorted, so grouped by owner
    recv_ptr = torch.searchsorted(halo_rows, torch.tensor(starts, device=device))
    mine = need_owner == r
    send_rows = need_col[mine] - first  # grouped by destination (need is sorted by rank)
    send_per_rank = torch.searchsorted(need_rank[mine], torch.arange(world_size + 1, device=device))
    host = torch.cat([recv_ptr, send_per_rank]).tolist()
    recv_counts = tuple(b - a for a, b in zip(host[:world_size], host[1 : world_size + 1]))
    send_ptr = host[world_size + 1 :]
    send_counts = tuple(b - a for a, b in zip(send_ptr[:-1], send_ptr[1:]))

    # Columns renumbered: local ones first (rows of B_local), then the received rows.
    is_local = (cols >= first) & (cols < stop)
    renumbered = torch.where(is_local, cols - first, n_local + torch.searchsorted(halo_rows, cols))
    width = n_local + int(halo_rows.numel())
    if pack_format is None:
        local, halo, ext_rows, fan_in = _split_groups(rows, renumbered, vals, n_local, width, **format_params)
    else:
        local, halo, fan_in = _separate_blocks(rows, renumbered, vals, is_local, n_local, width, pack_format, format_params)
        ext_rows = torch.empty(0, dtype=torch.int64, device=device)
    return RowPart(
        rank=r,
        world_size=world_size,
        shape=coords.shape,
        rows=range(first, stop),
        row_starts=tuple(starts),
        local=local,
        halo=halo,
        halo_rows=halo_rows,
        recv_counts=recv_counts,
        send_rows=send_rows,
        send_counts=send_counts,
        ext_rows=ext_rows,
        fan_in=fan_in,
    )


def _separate_blocks(rows, cols, vals, is_local, n_local: int, width: int, pack_format, format_params):
    """The local block (columns < n_local) and the remote block (columns shifted to the
    received rows), each packed in the named format."""

    def pack(keep: torch.Tensor, shift: int, block_width: int) -> SparseFormat:
        indices = torch.stack([rows[keep], cols[keep] - shift])
        sparse = torch.sparse_coo_tensor(
            indices, vals[keep], (n_local, block_width), is_coalesced=True, check_invariants=False
        )  # sorted row-major and unique, as the canonical input was (renumbering keeps a block's order)
        return pack_format(sparse, **format_params)

    local = pack(is_local, 0, n_local)
    halo = pack(~is_local, n_local, width - n_local)
    fans = (local.fan_in, halo.fan_in)
    return local, halo, None if None in fans else sum(fans)


def _split_groups(
    rows: torch.Tensor,
    cols: torch.Tensor,
    vals: torch.Tensor,
    n_local: int,
    width: int,
    *,
    group_size: int | None = None,
    index_dtype: torch.dtype | None = None,
    n_cols: int = 128,
) -> tuple[GroupCOO, GroupCOO, torch.Tensor, int]:
    """One GroupCOO grouping of the rows (columns renumbered [local | received]) cut into
    the local pass (groups of local columns only) and the halo pass (every other group,
    its local columns renumbered into ext_rows). Returns (local, halo, ext_rows, fan_in)."""
    device = cols.device
    itype = index_dtype_for(n_local, width, requested=index_dtype)
    order = torch.argsort(rows * max(width, 1) + cols)  # each row's local columns first
    rows, cols, vals = rows[order], cols[order], vals[order]
    row_ptr = torch.searchsorted(rows, torch.arange(n_local + 1, device=device))
    counts = row_ptr.diff()
    if group_size is None:
        group_size = _model_group_size(rows, cols, vals, (n_local, width), n_cols)
    g = check_positive_int("group_size", group_size)
    per_row = cdiv(counts, g)
    G, fan_in = torch.stack([per_row.sum(), per_row.max() if n_local else per_row.sum()]).tolist()
    group_row, idx, valid, _ = pack_row_groups(row_ptr, per_row, g, G)
    AK = cols[idx]
    AV = torch.where(valid, vals[idx], 0)
    in_halo = AK.amax(1) >= n_local if G else torch.zeros(0, dtype=torch.bool, device=device)
    # The halo pass's local columns (its mixed groups') index ext_rows, received rows follow.
    halo_AK = AK[in_halo]
    ext_rows = torch.unique(halo_AK[halo_AK < n_local])
    halo_AK = torch.where(
        halo_AK < n_local, torch.searchsorted(ext_rows, halo_AK), halo_AK - n_local + ext_rows.numel()
    )
    nnz_halo = int(valid[in_halo].sum())

    def fmt(keep, AK_part, K: int, nnz: int) -> GroupCOO:
        tensors = {"AM": group_row[keep].to(itype), "AK": AK_part.to(itype), "AV": AV[keep]}
        fan = int(torch.bincount(group_row[keep]).max()) if nnz else 0  # groups in the fullest row
        return GroupCOO(
            (n_local, K), tensors, nnz=nnz, dtype=vals.dtype, index_dtype=itype, device=device,
            params={"group_size": g, "fan_in": fan},
        )  # fmt: skip

    local = fmt(~in_halo, AK[~in_halo], n_local, rows.numel() - nnz_halo)
    halo = fmt(in_halo, halo_AK, int(ext_rows.numel()) + width - n_local, nnz_halo)
    return local, halo, ext_rows, fan_in


def _model_group_size(rows, cols, vals, shape: tuple[int, int], n_cols: int) -> int:
    """The group size formats.auto's cost model ranks first among GroupCOO's for these rows
    (sorted row-major, unique)."""
    sparse = torch.sparse_coo_tensor(
        torch.stack([rows, cols]), vals, shape, is_coalesced=True, check_invariants=False
    )
    for candidate in rank(row_stats(sparse), n_cols, vals.dtype):
        if candidate.format == "GroupCOO":
            return candidate.params["group_size"]
    return 1


# --------------------------------------------------------------------------- the product


def _check(part: RowPart, B_local: torch.Tensor, group) -> None:
    if not isinstance(part, RowPart):
        raise InsumTypeError(f"part must be a RowPart from partition_rows, got {type(part).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise InsumError("insum.distributed.spmm needs an initialised torch.distributed process group")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != part.world_size or rank != part.rank:
        raise InsumError(
            f"the part was made for rank {part.rank} of {part.world_size}, but this process is "
            f"rank {rank} of a group of {size}"
        )
    if not isinstance(B_local, torch.Tensor) or B_local.layout != torch.strided:
        raise InsumTypeError("B_local must be a dense torch.Tensor")
    if B_local.dim() != 2 or B_local.shape[0] != len(part.rows):
        raise InsumShapeError(
            f"B_local must hold this rank's {len(part.rows)} rows of B (rows "
            f"{part.rows.start}:{part.rows.stop}) as a matrix; got shape {tuple(B_local.shape)}"
        )
    if B_local.dtype not in VALUE_DTYPES:
        raise InsumTypeError(f"B_local has dtype {B_local.dtype}; use float16, bfloat16, float32 or float64")
    if B_local.dtype != part.dtype:
        raise InsumTypeError(
            f"B_local has dtype {B_local.dtype} but A was partitioned in {part.dtype}: the "
            "halo exchange sends B's rows as they are, so partition A in B's dtype"
        )
    if B_local.device != part.device:
        raise InsumTypeError(f"B_local is on {B_local.device} but the part is on {part.device}; use part.to()")


def spmm(
    part: RowPart,
    B_local: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str = "auto",
    precision: str = "tf32",
) -> torch.Tensor:
    """This rank's rows of A @ B, for B row-partitioned like A (B_local = B[part.rows]).

    Collective: every rank of `group` calls it with its own part. Exchanges only the halo
    rows (`part.exchange_bytes`), overlapped with the local pass. Differentiable with
    respect to B_local (A's values are constants here); float16, bfloat16, float32 and
    float64, half precision accumulated in float32 where many groups meet in one row.
    backend, precision: as for `insum()`.
    """
    _check(part, B_local, group)
    return _HaloSpMM.apply(B_local, part, group, backend, precision)


def _start_exchange(recv: torch.Tensor, send: torch.Tensor, recv_counts, send_counts, group) -> Any:
    """Start the all_to_all of rows (rank d gets send_counts[d] rows of `send`); its wait()
    makes the current stream wait for it (no host sync on NCCL)."""
    return dist.all_to_all_single(recv, send, list(recv_counts), list(send_counts), group=group, async_op=True)


def _accumulate(fmt: SparseFormat, C: torch.Tensor, B: torch.Tensor, backend: str, precision: str, *, first: bool) -> None:
    """C (=, or += unless first) fmt @ B: in place by the format's own statement where it
    is one (sorted rows declared: segment reduction), else `fmt.spmm` and one more pass."""
    if fmt.nnz == 0 or B.shape[1] == 0:
        if first:
            C.zero_()
        return
    if not fmt.single_statement:
        product = fmt.spmm(B, backend=backend, precision=precision)
        C.copy_(product) if first else C.add_(product)
        return
    expression = overwrite(fmt.expression) if first else fmt.expression
    facts = frozenset(name for name in fmt.sorted_indices if name in fmt.tensors)
    insum(
        expression, backend=backend, precision=precision, check_indices=False, sorted_indices=facts,
        unique_indices=fmt.unique_in(fmt.tensors), C=C, B=B, **fmt.tensors,
    )  # fmt: skip


def _transposed(part: RowPart, which: str, dC: torch.Tensor, backend: str, precision: str) -> torch.Tensor:
    """fmt^T @ dC (fmt's columns x N, float32 for half precision) for the pass `which`: on
    the format's transposed pattern (an SpMM shaped like the forward, kept by the part
    after the first call), or autograd through `fmt.spmm` for formats of several statements.

    Scalar-slot formats (COO, GroupCOO) run the pattern's statement here rather than through
    `fmt.input_gradient`, for two things a layer cannot have, whose values change every
    step: the values with their zero slot are kept (not copied again each call), and the
    pattern's column index TM, sorted by construction, is declared so (segment reduction,
    as in the forward)."""
    fmt = getattr(part, which)
    out_dtype = compute_dtype(dC.dtype)
    if fmt.nnz == 0 or dC.shape[1] == 0:
        return dC.new_zeros(fmt.shape[1], dC.shape[1], dtype=out_dtype)
    if fmt.single_statement:
        key = (which, "pattern")
        if key not in part.workspace:
            part.workspace[key] = fmt.transposed_pattern()  # host syncs: once
        pattern = part.workspace[key]
        scalar = type(fmt).input_gradient is SparseFormat.input_gradient
        if pattern is not None and scalar and "TM" in pattern:
            values = (which, "values", dC.dtype)
            if values not in part.workspace:
                part.workspace[values] = with_zero_slot(fmt.AV.reshape(-1)).to(dC.dtype)
            DX = dC.new_zeros(fmt.shape[1], dC.shape[1], dtype=out_dtype)
            insum(
                SCALAR, backend=backend, precision=precision, check_indices=False,
                sorted_indices=frozenset({"TM"}), DX=DX, WT=part.workspace[values], DY=dC, **pattern,
            )  # fmt: skip
            return DX
        if pattern is not None:
            return fmt.input_gradient(pattern, dC.to(fmt.dtype), backend, precision).to(out_dtype)
    with torch.enable_grad():  # the product is linear in B: any B gives its gradient
        B = dC.new_zeros(fmt.shape[1], dC.shape[1], dtype=fmt.dtype, requires_grad=True)
        product = fmt.spmm(B, backend=backend, precision=precision)
        (grad,) = torch.autograd.grad(product, B, dC.to(product.dtype))
    return grad.to(out_dtype)


def _forward_buffers(part: RowPart, B_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(send, ext, recv) views of one buffer kept by the part, laid out [send | ext_rows |
    received]: the halo pass reads ext (ext_rows, then the received rows) as its B."""
    S, k = int(part.send_rows.numel()), int(part.ext_rows.numel())
    H = int(part.halo_rows.numel())
    buf = part.buffer("forward", S + k + H, B_local.shape[1], B_local.dtype)
    return buf[:S], buf[S:], buf[S + k :]


def _gather_send(part: RowPart, B_local: torch.Tensor, send: torch.Tensor) -> None:
    """The rows other ranks need, by one gather kernel into the kept send buffer."""
    torch.index_select(B_local, 0, part.send_rows, out=send)


def _gather_ext(part: RowPart, B_local: torch.Tensor, ext: torch.Tensor) -> None:
    """The local rows the halo pass reads (ext_rows), ahead of the received rows; enqueued
    after the exchange has started, so that it runs while the rows travel."""
    if part.ext_rows.numel():
        torch.index_select(B_local, 0, part.ext_rows, out=ext[: part.ext_rows.numel()])


def _output(part: RowPart, B_local: torch.Tensor) -> torch.Tensor:
    dtype = accumulation_dtype(B_local.dtype, part.fan_in)
    return B_local.new_empty(len(part.rows), B_local.shape[1], dtype=dtype)


class _HaloSpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, B_local, part: RowPart, group, backend: str, precision: str):
        ctx.part, ctx.group, ctx.backend, ctx.precision = part, group, backend, precision
        send, ext, recv = _forward_buffers(part, B_local)
        _gather_send(part, B_local, send)
        work = _start_exchange(recv, send, part.recv_counts, part.send_counts, group)
        _gather_ext(part, B_local, ext)
        C = _output(part, B_local)
        _accumulate(part.local, C, B_local, backend, precision, first=True)  # while the halo travels
        work.wait()
        _accumulate(part.halo, C, ext, backend, precision, first=False)
        return C.to(B_local.dtype)

    @staticmethod
    def backward(ctx, dC):
        part, group = ctx.part, ctx.group
        dtype, k = dC.dtype, int(part.ext_rows.numel())
        # The halo pass's transposed product: its received rows go back to their owners.
        dExt = _transposed(part, "halo", dC, ctx.backend, ctx.precision)
        send = dExt[k:].to(dtype)
        recv = part.buffer("backward", int(part.send_rows.numel()), dC.shape[1], dtype)
        work = _start_exchange(recv, send, part.send_counts, part.recv_counts, group)
        dB = _transposed(part, "local", dC, ctx.backend, ctx.precision)  # while it travels
        dB.index_add_(0, part.ext_rows, dExt[:k])
        work.wait()
        dB.index_add_(0, part.send_rows, recv.to(dB.dtype))
        return dB.to(dtype), None, None, None, None


def steps(
    part: RowPart,
    B_local: torch.Tensor,
    dC: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    backend: str = "auto",
    precision: str = "tf32",
) -> dict[str, Callable[[], object]]:
    """The steps `spmm` overlaps, each runnable alone, for timing them one by one (the
    benchmark): "gather_send", "gather_ext" (the gathers from B_local), "exchange" (collective, waited
    for), "local" and "halo" (the passes, on buffers filled once here); with the output
    gradient dC also "local_T", "halo_T" (the transposed products) and "exchange_T".

    >>> timings = {name: time_it(fn) for name, fn in steps(part, B_local).items()}  # doctest: +SKIP
    """
    _check(part, B_local, group)
    B = B_local.detach()
    send, ext, recv = _forward_buffers(part, B)
    _gather_send(part, B, send)
    _start_exchange(recv, send, part.recv_counts, part.send_counts, group).wait()
    _gather_ext(part, B, ext)
    C = _output(part, B_local)
    out = {
        "gather_send": lambda: _gather_send(part, B, send),
        "gather_ext": lambda: _gather_ext(part, B, ext),
        "exchange": lambda: _start_exchange(recv, send, part.recv_counts, part.send_counts, group).wait(),
        "local": lambda: _accumulate(part.local, C, B, backend, precision, first=True),
        "halo": lambda: _accumulate(part.halo, C, ext, backend, precision, first=False),
    }
    if dC is not None:
        back = torch.empty_like(send)
        sent = torch.empty_like(recv)
        out.update(
            {
                "local_T": lambda: _transposed(part, "local", dC, backend, precision),
                "halo_T": lambda: _transposed(part, "halo", dC, backend, precision),
                "exchange_T": lambda: _start_exchange(back, sent, part.send_counts, part.recv_counts, group).wait(),
            }
        )
    return out
