"""insum.nn.distributed: a SparseLinear whose output features are split across ranks.

Tensor parallelism for a sparse weight W (out_features x in_features): rank r holds the
rows `layer.out_rows` of W (and of the bias) as an ordinary `SparseLinear`, so each rank
stores and multiplies about 1/world_size of the nonzeros. Activations move with the usual
collectives, each an autograd function whose backward is the transposed collective:

- the input is either replicated on every rank (`input_is_sharded=False`: forward uses
  it as is, backward all-reduces x's gradient, since every rank's rows of W contribute
  to it), or split by rows (tokens, nodes) across the ranks (`input_is_sharded=True`:
  forward all-gathers the rows, backward reduce-scatters their gradient);
- the output is either all-gathered along the features (`gather_output=True`: every
  rank gets y whole; backward keeps its own features' gradient) or left as this
  rank's features (`gather_output=False`, to feed a row-parallel layer or a loss
  computed per shard).

Launch one process per GPU (e.g. `torchrun --nproc_per_node=2`) and build the layer
with the same arguments on every rank; `from_dense`/`from_linear` slice a full weight.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..arith import cdiv
from ..errors import InsumError, InsumShapeError
from ..formats.base import format_class
from .linear import SparseLinear, initial_bias, initial_weight, pruned_linear

__all__ = ["DistributedSparseLinear", "feature_ranges"]


def feature_ranges(features: int, world_size: int, granule: int = 1) -> list[range]:
    """The contiguous output features of each rank, split at multiples of `granule` (the
    format's `row_granule`: N:M's vectors), so that every rank packs its rows as the whole
    weight packs them; sizes differ by at most one granule.

    >>> feature_ranges(7, 2)
    [range(0, 4), range(4, 7)]
    >>> feature_ranges(10, 2, granule=4)
    [range(0, 8), range(8, 10)]
    """
    units = cdiv(features, granule)
    if world_size < 1 or units < world_size:
        raise InsumError(
            f"DistributedSparseLinear splits out_features={features} over {world_size} ranks: each rank needs "
            f"at least one output feature" + (f" (in runs of {granule}, the format's row granule)" if granule > 1 else "")
        )
    bounds = [min(features, cdiv(k * units, world_size) * granule) for k in range(world_size + 1)]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def row_granule(format: str, format_params: dict[str, Any]) -> int:
    """The rows a format packs together (1 for "auto", which each rank chooses itself)."""
    return 1 if format == "auto" else format_class(format).row_granule(format_params)


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise InsumError("DistributedSparseLinear needs an initialised torch.distributed process group")
    return dist.get_rank(group), dist.get_world_size(group)


# torch >= 2.13 renames the tensor collectives (the old names warn); the device runs 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _CopyToRanks(torch.autograd.Function):
    """Forward: x as is (replicated). Backward: the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dx):
        dx = dx.contiguous()
        dist.all_reduce(dx, group=ctx.group)
        return dx, None


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows, concatenated in rank order. Backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, world_size):
        ctx.group = group
        out = x.new_empty(world_size * x.shape[0], *x.shape[1:])
        _all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, dout):
        dx = dout.new_empty(dout.shape[0] // dist.get_world_size(ctx.group), *dout.shape[1:])
        _reduce_scatter_single(dx, dout.contiguous(), group=ctx.group)
        return dx, None, None


class _GatherFeatures(torch.autograd.Function):
    """Forward: every rank's features (last dim) concatenated. Backward: this rank's slice.

    Ranks hold up to one feature more than others, so each pads to the widest first.
    """

    @staticmethod
    def forward(ctx, y, group, ranges: list[range], rank: int):
        ctx.own = ranges[rank]
        widest = max(len(r) for r in ranges)
        padded = torch.nn.functional.pad(y, (0, widest - y.shape[-1])).contiguous()
        out = y.new_empty(len(ranges) * padded.shape[0], widest)
        _all_gather_single(out, padded, group=group)
        pieces = out.view(len(ranges), padded.shape[0], widest)
        return torch.cat([pieces[k, :, : len(r)] for k, r in enumerate(ranges)], dim=-1)

    @staticmethod
    def backward(ctx, dy):
        return dy[:, ctx.own.start : ctx.own.stop], None, None, None


class DistributedSparseLinear(nn.Module):
    """y = x @ W^T + b with W's output features split across the ranks of `group`.

    Every rank builds it with the same arguments. A new layer draws its rows of W as
    nn.Linear would and prunes them by magnitude to `sparsity` (each rank's rows on
    their own); `from_dense`/`from_linear` take a full weight and keep this rank's rows,
    the same weight as `SparseLinear.from_dense` packs: the rows split at multiples of the
    format's row granule (N:M's vector_len: its pruning keeps one choice per vector).
    format, format_params, backend, precision: as for `SparseLinear`.
    input_is_sharded: x holds this rank's rows of the batch (the same count on every rank)
    instead of all of them. gather_output: return all features instead of this rank's.

    Attributes: `local` (this rank's `SparseLinear`, out_rows x in_features),
    `out_rows` (its features), `rank`, `world_size`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        format: str = "GroupCOO",
        *,
        sparsity: float = 0.0,
        group: dist.ProcessGroup | None = None,
        input_is_sharded: bool = False,
        gather_output: bool = True,
        backend: str = "auto",
        precision: str = "tf32",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **format_params: Any,
    ):
        super().__init__()
        self._setup(in_features, out_features, group, input_is_sharded, gather_output, row_granule(format, format_params))
        rows = len(self.out_rows)
        weight = initial_weight(rows, in_features, format, sparsity, format_params, device, dtype)
        local_bias = initial_bias(rows, in_features, device, dtype) if bias else None
        self.local = SparseLinear.from_dense(
            weight, local_bias, format, backend=backend, precision=precision, **format_params
        )

    def _setup(self, in_features, out_features, group, input_is_sharded, gather_output, granule: int) -> None:
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.group = group
        self.rank, self.world_size = _group_info(group)
        self.ranges = feature_ranges(self.out_features, self.world_size, granule)
        self.out_rows = self.ranges[self.rank]
        self.input_is_sharded, self.gather_output = bool(input_is_sharded), bool(gather_output)

    def __deepcopy__(self, memo: dict) -> DistributedSparseLinear:
        """A copy (an EMA of the weights, say) on the same process group: the group is a
        handle of this process, shared, not copied (it pickles not at all)."""
        if self.group is not None:
            memo[id(self.group)] = self.group
        copy_ = type(self).__new__(type(self))
        memo[id(self)] = copy_
        for key, value in self.__dict__.items():
            copy_.__dict__[key] = copy.deepcopy(value, memo)
        return copy_

    @classmethod
    def from_dense(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        format: str = "GroupCOO",
        *,
        group: dist.ProcessGroup | None = None,
        input_is_sharded: bool = False,
        gather_output: bool = True,
        backend: str = "auto",
        precision: str = "tf32",
        **format_params: Any,
    ) -> DistributedSparseLinear:
        """This rank's rows of a full `weight` (out x in; its zeros are the pattern) and `bias`."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise InsumShapeError(f"weight must be (out_features, in_features), got {got}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(weight.shape[1], weight.shape[0], group, input_is_sharded, gather_output,
                     row_granule(format, format_params))
        if bias is not None and tuple(bias.shape) != (layer.out_features,):
            raise InsumShapeError(f"bias must have shape ({layer.out_features},), got {tuple(bias.shape)}")
        rows = slice(layer.out_rows.start, layer.out_rows.stop)
        layer.local = SparseLinear.from_dense(
            weight.detach()[rows],
            None if bias is None else bias.detach()[rows],
            format,
            backend=backend,
            precision=precision,
            **format_params,
        )
        return layer

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, format: str = "GroupCOO", *, sparsity: float = 0.0, **kwargs: Any
    ) -> DistributedSparseLinear:
        """Prune an nn.Linear (the same on every rank) by magnitude and keep this rank's rows."""
        return cls.from_dense(*pruned_linear(linear, format, sparsity, kwargs), format, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise InsumShapeError(
                f"DistributedSparseLinear: x has shape {tuple(x.shape)}; its last dimension must "
                f"be in_features={self.in_features}"
            )
        if self.input_is_sharded:
            if x.dim() < 2:
                raise InsumShapeError("DistributedSparseLinear: a sharded input needs a batch dimension")
            lead = (self.world_size * x.shape[0], *x.shape[1:-1])
            x2 = _GatherRows.apply(x.reshape(-1, self.in_features), self.group, self.world_size)
        else:
            lead = x.shape[:-1]
            x2 = _CopyToRanks.apply(x.reshape(-1, self.in_features), self.group)
        y = self.local(x2)  # (rows, this rank's features)
        if self.gather_output:
            y = _GatherFeatures.apply(y, self.group, self.ranges, self.rank)
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.rank}/{self.world_size}, out_rows={self.out_rows.start}:{self.out_rows.stop}, "
            f"input_is_sharded={self.input_is_sharded}, gather_output={self.gather_output}"
        )
