"""insum.distributed: row-sharded SpMM over torch.distributed (NCCL on GPUs, gloo on CPU).

A square sparse matrix A (a graph's adjacency) and a dense B (its node features) are cut
into the same contiguous row ranges, one per rank. Rank r owns rows `part.rows` of both
and computes its rows of A @ B from its own rows of B plus the few remote rows of B that
its columns touch (its *halo*), fetched with one `all_to_all_single` that carries only
those rows, not an all-gather of B:

    >>> parts = partition_rows(A, world_size)          # every rank, the same A  # doctest: +SKIP
    >>> C_local = spmm(parts[rank], B[parts[rank].rows])                         # doctest: +SKIP

Each part holds A's block in two packed formats, both with *local* column indices:
`part.local` (A[rows, rows], columns index B_local) and `part.halo` (A[rows, other
ranks' rows], columns index the received halo buffer, which holds `part.halo_rows` in
order: grouped by the rank that owns them, ascending). `spmm` starts the exchange
asynchronously, multiplies the local block while the halo rows travel, then adds the
halo block's product into the same output. Its backward is the transposed exchange:
the halo block's transposed product is sent back to the rows' owners (overlapped with
the local block's transposed product) and added into their gradient.

One module of a little over 400 lines: the partition, the exchange and the differentiable
product all read the same halo bookkeeping (`RowPart`), and split apart each would need it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .api import insum
from .arith import cdiv
from .autograd import derive
from .dtypes import VALUE_DTYPES
from .errors import InsumError, InsumShapeError, InsumTypeError
from .formats.auto import packer
from .formats.base import (
    Coords,
    SparseFormat,
    accumulation_dtype,
    coords_of,
    overwrite,
)

__all__ = ["RowPart", "partition_rows", "spmm", "BALANCES"]

#: How `partition_rows` places the row boundaries.
BALANCES = ("nnz", "rows")


@dataclass(frozen=True, eq=False)
class RowPart:
    """One rank's share of a square sparse matrix A (n x n), made by `partition_rows`.

    rows: the global rows (and rows of B) this rank owns, a `range`.
    row_starts: every rank's first row, plus n at the end (world_size + 1 entries).
    local: A[rows, rows] packed, columns relative to rows.start (they index B_local).
    halo: A[rows, rows of other ranks] packed, columns index the halo buffer.
    halo_rows: the global rows of B in the halo buffer (int64, sorted, so grouped by
        owner); `recv_counts[s]` of them come from rank s.
    send_rows: the rows of B_local (local indices, int64) that other ranks need,
        grouped by destination rank; `send_counts[d]` of them go to rank d.
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

    @property
    def nnz(self) -> int:
        """Nonzeros of A in this rank's rows (local and halo blocks together)."""
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

    def to(self, device: torch.device | str) -> RowPart:
        """A copy with every tensor on `device` (the partitioning is not repeated)."""
        return RowPart(
            self.rank, self.world_size, self.shape, self.rows, self.row_starts,
            self.local.to(device), self.halo.to(device), self.halo_rows.to(device),
            self.recv_counts, self.send_rows.to(device), self.send_counts,
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"RowPart(rank={self.rank}/{self.world_size}, rows={self.rows.start}:{self.rows.stop}, "
            f"nnz={self.nnz} ({self.halo.nnz} in the halo), halo_rows={sum(self.recv_counts)}, "
            f"send_rows={sum(self.send_counts)}, format={type(self.local).__name__}/"
            f"{type(self.halo).__name__}, "
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
    format, format_params: the packed format of both blocks and its packer's parameters
    (e.g. `index_dtype=torch.int64`, `group_size=4`). None: `formats.auto`. COO, GroupCOO
    and ELL add the halo block's product into the local block's output in place; other
    formats add it in an extra pass.

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
    pack = packer("auto" if format is None else format)
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
    is_local = (cols >= first) & (cols < stop)

    halo_rows = need_col[need_rank == r]  # sorted, so grouped by owner
    first_rows = torch.tensor(starts, device=cols.device)
    recv_ptr = torch.searchsorted(halo_rows, first_rows)
    mine = need_owner == r
    send_rows = need_col[mine] - first  # grouped by destination (need is sorted by rank)
    send_per_rank = torch.searchsorted(need_rank[mine], torch.arange(world_size + 1, device=cols.device))
    host = torch.cat([recv_ptr, send_per_rank]).tolist()
    recv_counts = tuple(b - a for a, b in zip(host[:world_size], host[1 : world_size + 1]))
    send_ptr = host[world_size + 1 :]
    send_counts = tuple(b - a for a, b in zip(send_ptr[:-1], send_ptr[1:]))

    def pack(block_rows, block_cols, block_vals, width: int) -> SparseFormat:
        indices = torch.stack([block_rows, block_cols])
        sparse = torch.sparse_coo_tensor(
            indices, block_vals, (n_local, width), is_coalesced=True, check_invariants=False
        )  # sorted row-major and unique, as the canonical input was
        return pack_format(sparse, **format_params)

    remote = ~is_local
    halo_cols = torch.searchsorted(halo_rows, cols[remote])
    local = pack(rows[is_local], cols[is_local] - first, vals[is_local], n_local)
    halo = pack(rows[remote], halo_cols, vals[remote], int(halo_rows.numel()))
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
    )


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
    rows (`part.exchange_bytes`), overlapped with the local block's product.
    Differentiable with respect to B_local (A's values are constants here); float16,
    bfloat16, float32 and float64, with half precision accumulated in float32 where many
    groups meet in one row. backend, precision: as for `insum()`.
    """
    _check(part, B_local, group)
    return _HaloSpMM.apply(B_local, part, group, backend, precision)


def _exchange(
    send: torch.Tensor, recv_rows: int, send_counts: Sequence[int], recv_counts: Sequence[int], group
) -> tuple[torch.Tensor, Any]:
    """Start the all_to_all of rows: rank d gets send_counts[d] rows of `send`."""
    recv = send.new_empty(recv_rows, *send.shape[1:])
    work = dist.all_to_all_single(
        recv, send.contiguous(), list(recv_counts), list(send_counts), group=group, async_op=True
    )
    return recv, work


def _accumulate(fmt: SparseFormat, C: torch.Tensor, B: torch.Tensor, backend: str, precision: str, *, first: bool) -> None:
    """C (=, or += unless first) fmt @ B: in place by the format's own statement where it
    is one, else through `fmt.spmm` and one more pass over C."""
    if fmt.nnz == 0 or B.shape[1] == 0:
        if first:
            C.zero_()
        return
    if not fmt.single_statement:
        product = fmt.spmm(B, backend=backend, precision=precision)
        C.copy_(product) if first else C.add_(product)
        return
    expression = overwrite(fmt.expression) if first else fmt.expression
    facts = fmt.sorted_indices & fmt.tensors.keys()  # a sorted row index: segment reduction
    insum(
        expression, backend=backend, precision=precision, check_indices=False, sorted_indices=facts,
        unique_indices=fmt.unique_in(fmt.tensors), C=C, B=B, **fmt.tensors,
    )


def _transposed(fmt: SparseFormat, dC: torch.Tensor, dB: torch.Tensor, backend: str, precision: str) -> None:
    """dB += fmt^T @ dC: the format's derived gradient statement for B (a scatter), or
    autograd through `fmt.spmm` for formats of several statements."""
    if fmt.nnz == 0 or dC.shape[1] == 0:
        return
    if not fmt.single_statement:
        with torch.enable_grad():  # the product is linear in B: any B gives its gradient
            B = dC.new_zeros(fmt.shape[1], dC.shape[1], dtype=fmt.dtype, requires_grad=True)
            product = fmt.spmm(B, backend=backend, precision=precision)
            (grad,) = torch.autograd.grad(product, B, dC.to(product.dtype))
        dB.add_(grad)
        return
    derivation = derive(fmt.expression)
    (statement,) = derivation.gradients["B"]
    tensors = {derivation.grad_names["B"]: dB, derivation.output_grad: dC.to(fmt.dtype)}
    insum(str(statement), backend=backend, precision=precision, check_indices=False, **tensors, **fmt.tensors)


def _fan_in(part: RowPart) -> int | None:
    local, halo = part.local.fan_in, part.halo.fan_in
    return None if local is None or halo is None else local + halo


class _HaloSpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, B_local, part: RowPart, group, backend: str, precision: str):
        ctx.part, ctx.group, ctx.backend, ctx.precision = part, group, backend, precision
        send = B_local.index_select(0, part.send_rows)
        halo, work = _exchange(send, sum(part.recv_counts), part.send_counts, part.recv_counts, group)
        dtype = B_local.dtype
        C = B_local.new_empty(len(part.rows), B_local.shape[1], dtype=accumulation_dtype(dtype, _fan_in(part)))
        _accumulate(part.local, C, B_local, backend, precision, first=True)  # while the halo travels
        work.wait()
        _accumulate(part.halo, C, halo, backend, precision, first=False)
        return C.to(dtype)

    @staticmethod
    def backward(ctx, dC):
        part, group = ctx.part, ctx.group
        dtype = dC.dtype
        grad_dtype = accumulation_dtype(dtype, None)  # scatters: fan-in unknown
        columns = dC.shape[1]
        # The halo block's gradient goes back to the rows' owners: the transposed exchange.
        dHalo = dC.new_zeros(sum(part.recv_counts), columns, dtype=grad_dtype)
        _transposed(part.halo, dC, dHalo, ctx.backend, ctx.precision)
        dSent, work = _exchange(dHalo.to(dtype), sum(part.send_counts), part.recv_counts, part.send_counts, group)
        dB = dC.new_zeros(len(part.rows), columns, dtype=grad_dtype)
        _transposed(part.local, dC, dB, ctx.backend, ctx.precision)  # while it travels
        work.wait()
        dB.index_add_(0, part.send_rows, dSent.to(grad_dtype))
        return dB.to(dtype), None, None, None, None
