"""insum.distributed: row-sharded SpMM over torch.distributed (NCCL on GPUs, gloo on CPU).

A square sparse matrix A (a graph's adjacency) and a dense B (its node features) are cut
into the same contiguous row ranges, one per rank. Rank r owns rows `part.rows` of both
and computes its rows of A @ B from its own rows of B plus the few remote rows of B that
its columns touch (its *halo*), fetched with one `all_to_all_single` that carries only
those rows, not an all-gather of B:

    >>> parts = partition_rows(A, world_size)          # every rank, the same A  # doctest: +SKIP
    >>> C_local = spmm(parts[rank], B[parts[rank].rows])                         # doctest: +SKIP

How the rows are packed: as two matrices, A[rows, rows] (the *local* pass, over
B_local) and A[rows, remote] (the *halo* pass, over the received rows), each packed by
`formats.auto` (or a named format). The exchange (~1 ms for 50M nonzeros on two H200s)
hides only behind work that needs no remote row, so the local pass runs while the halo
travels, and the halo pass after it. The halo block's rows are short (~2 of a row's ~13
entries on a community graph), so its groups are short and it costs more per nonzero than
the local pass; cutting one grouping of the whole rows by column range instead (longer
halo groups, but a third of the nonzeros behind the exchange and ~90% of B_local copied
into the halo operand) measured slower on two H200s in every case (community fp32 1.37x
against 1.65x, uniform fp32 0.91x against 1.12x; README, "Several GPUs"), so it was
removed. The local pass writes C (`=`), the halo pass adds into it in place (`+=`), in
half precision too wherever the whole rows' fan-in allows (`accumulation_dtype`, as on one
GPU): no float32 scratch, no extra add pass. Both passes declare their sorted rows, so a
row's groups are summed in registers (segment reduction) and written once per tile.

A call enqueues, with no host sync in steady state: one gather of the rows to send (an
insum statement, `S[r, n] = B[R[r], n]`, into a buffer the part keeps, reused by later
calls), the `all_to_all_single` (async), the local pass, the wait (on NCCL a stream
dependency), the halo pass. The backward mirrors it: the halo pass's transposed product
first (its received rows go back to their owners), the exchange back (async), the local
pass's transposed product while it travels, the received rows' gradients added into
B_local's. The transposed products run on the formats' transposed patterns (kept by the
part after the first backward), as SparseLinear's input gradient does, instead of a
scatter per slot.

One module of about 500 lines: the partition, the exchange and the differentiable product
all read the same halo bookkeeping (`RowPart`), and split apart each would need it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .api import insum
from .arith import cdiv
from .bind import tensor_version
from .dtypes import VALUE_DTYPES, compute_dtype
from .errors import InsumError, InsumShapeError, InsumTypeError
from .formats.auto import packer
from .formats.base import Coords, SparseFormat, accumulation_dtype, coords_of, overwrite
from .formats.groupcoo import GroupCOO
from .formats.transposed import SCALAR, with_zero_slot

__all__ = ["RowPart", "partition_rows", "spmm", "steps", "BALANCES"]

#: How `partition_rows` places the row boundaries.
BALANCES = ("nnz", "rows")
#: The gather of the rows to send: one program per tile of rows, no reduction.
GATHER_ROWS = "S[r, n] = B[R[r], n]"


@dataclass(frozen=True, eq=False)
class RowPart:
    """One rank's share of a square sparse matrix A (n x n), made by `partition_rows`.

    rows: the global rows (and rows of B) this rank owns, a `range`.
    row_starts: every rank's first row, plus n at the end (world_size + 1 entries).
    local: the local pass, columns relative to rows.start (they index B_local).
    halo: the halo pass, columns index the received rows.
    halo_rows: the global rows of B received (int64, sorted, so grouped by owner);
        `recv_counts[s]` of them come from rank s.
    send_rows: the rows of B_local (local indices, int64) that other ranks need,
        grouped by destination rank; `send_counts[d]` of them go to rank d.
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
            "fan_in": self.fan_in,
        }  # fmt: skip

    def to(self, device: torch.device | str) -> RowPart:
        """A copy with every tensor on `device` (the partitioning is not repeated)."""
        return RowPart(
            self.rank, self.world_size, self.shape, self.rows, self.row_starts,
            self.local.to(device), self.halo.to(device), self.halo_rows.to(device),
            self.recv_counts, self.send_rows.to(device), self.send_counts, self.fan_in,
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
            f"send_rows={sum(self.send_counts)}, "
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
    format: str = "auto",
    **format_params: Any,
) -> list[RowPart]:
    """Split a square sparse matrix A into `world_size` contiguous row ranges, one part each.

    A: a dense or torch sparse (COO, CSR, ...) n x n matrix, the same on every rank.
    balance: "nnz" (default) balances nonzeros, "rows" balances rows. A rank may get
    no rows (n < world_size, or one row holding most nonzeros).
    rank: pack only this rank's part (what each process of a run does) and return it
    as a one-element list; None packs every part.
    format: how the local and the remote block are each packed: "auto" (default:
    `formats.auto` per block) or a format name ("GroupCOO", "COO", "ELL", "CELL", ...),
    with its packer's parameters (`format_params`). COO, GroupCOO and ELL add the halo
    pass into the local pass's output in place, other formats in an extra pass.

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
    pack = packer(format)
    if format.lower() == "nm":
        # (a part's blocks renumber A's columns, and its rows start anywhere: an N:M pattern
        # holds in A's own m-column windows and L-row vectors only)
        raise InsumError(
            "partition_rows cannot pack N:M: its local and remote blocks renumber A's columns, which breaks "
            "the pattern's m-column windows; pack the parts in another format (or use DistributedSparseLinear, "
            "which splits an N:M weight at whole vectors)"
        )
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
    pack_format: Callable[..., SparseFormat],
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
    local, halo, fan_in = _separate_blocks(rows, renumbered, vals, is_local, n_local, width, pack_format, format_params)
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


def _kept(part: RowPart, key: tuple, tensors: list[torch.Tensor], make: Callable[[], Any]) -> Any:
    """part.workspace[key], made by `make()` on the first call and again once one of `tensors`
    is replaced or edited in place (their identities and version counters: a format's values
    and pattern may be edited between steps, as a layer's may)."""
    stamp = tuple((id(t), tensor_version(t)) for t in tensors)
    kept = part.workspace.get(key)
    if kept is None or kept[0] != stamp:
        kept = part.workspace[key] = (stamp, make())
    return kept[1]


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
        indices = [t for t in fmt.tensors.values() if not t.is_floating_point()]
        pattern = _kept(part, (which, "pattern"), indices, fmt.transposed_pattern)  # (host syncs)
        scalar = type(fmt).input_gradient is SparseFormat.input_gradient
        if pattern is not None and scalar and "TM" in pattern:
            values = _kept(part, (which, "values", dC.dtype), [fmt.AV],
                           lambda: with_zero_slot(fmt.AV.reshape(-1)).to(dC.dtype))
            DX = dC.new_zeros(fmt.shape[1], dC.shape[1], dtype=out_dtype)
            insum(
                SCALAR, backend=backend, precision=precision, check_indices=False,
                sorted_indices=frozenset({"TM"}), DX=DX, WT=values, DY=dC, **pattern,
            )  # fmt: skip
            return DX
        if pattern is not None:
            return fmt.input_gradient(pattern, dC.to(fmt.dtype), backend, precision).to(out_dtype)
    with torch.enable_grad():  # the product is linear in B: any B gives its gradient
        B = dC.new_zeros(fmt.shape[1], dC.shape[1], dtype=fmt.dtype, requires_grad=True)
        product = fmt.spmm(B, backend=backend, precision=precision)
        (grad,) = torch.autograd.grad(product, B, dC.to(product.dtype))
    return grad.to(out_dtype)


def _forward_buffers(part: RowPart, B_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(send, recv), buffers kept by the part: the rows to send and the rows received."""
    S, H = int(part.send_rows.numel()), int(part.halo_rows.numel())
    buf = part.buffer("forward", S + H, B_local.shape[1], B_local.dtype)
    return buf[:S], buf[S:]


def _gather_send(part: RowPart, B_local: torch.Tensor, send: torch.Tensor, backend: str) -> None:
    """The rows other ranks need, gathered into the kept send buffer by an insum statement
    (a row tile per program, each row read as one contiguous vector: torch.index_select
    measured ~0.45 ms for 670k rows of 128 floats on an H200, as slow in fp16 as in fp32)."""
    if send.numel():
        insum(GATHER_ROWS, backend=backend, check_indices=False, S=send, B=B_local, R=part.send_rows)


def _output(part: RowPart, B_local: torch.Tensor) -> torch.Tensor:
    dtype = accumulation_dtype(B_local.dtype, part.fan_in)
    return B_local.new_empty(len(part.rows), B_local.shape[1], dtype=dtype)


class _HaloSpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, B_local, part: RowPart, group, backend: str, precision: str):
        ctx.part, ctx.group, ctx.backend, ctx.precision = part, group, backend, precision
        send, recv = _forward_buffers(part, B_local)
        _gather_send(part, B_local, send, backend)
        work = _start_exchange(recv, send, part.recv_counts, part.send_counts, group)
        C = _output(part, B_local)
        _accumulate(part.local, C, B_local, backend, precision, first=True)  # while the halo travels
        work.wait()
        _accumulate(part.halo, C, recv, backend, precision, first=False)
        return C.to(B_local.dtype)

    @staticmethod
    @once_differentiable  # (its exchange records no graph: a double backward would drop the halo's terms)
    def backward(ctx, dC):
        part, group = ctx.part, ctx.group
        dtype = dC.dtype
        # The halo pass's transposed product: its received rows go back to their owners.
        send = _transposed(part, "halo", dC, ctx.backend, ctx.precision).to(dtype)
        recv = part.buffer("backward", int(part.send_rows.numel()), dC.shape[1], dtype)
        work = _start_exchange(recv, send, part.send_counts, part.recv_counts, group)
        dB = _transposed(part, "local", dC, ctx.backend, ctx.precision)  # while it travels
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
    benchmark): "gather_send" (the gather from B_local), "exchange" (collective, waited
    for), "local" and "halo" (the passes, on buffers filled once here); with the output
    gradient dC also "local_T", "halo_T" (the transposed products) and "exchange_T".

    >>> timings = {name: time_it(fn) for name, fn in steps(part, B_local).items()}  # doctest: +SKIP
    """
    _check(part, B_local, group)
    B = B_local.detach()
    send, recv = _forward_buffers(part, B)
    _gather_send(part, B, send, backend)
    _start_exchange(recv, send, part.recv_counts, part.send_counts, group).wait()
    C = _output(part, B_local)
    out = {
        "gather_send": lambda: _gather_send(part, B, send, backend),
        "exchange": lambda: _start_exchange(recv, send, part.recv_counts, part.send_counts, group).wait(),
        "local": lambda: _accumulate(part.local, C, B, backend, precision, first=True),
        "halo": lambda: _accumulate(part.halo, C, recv, backend, precision, first=False),
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
