"""BlockGroupCOO: dense bm x bk blocks, grouped along block rows (InSum §4.1).

Blocks turn the per-nonzero product into a (bm x bk) @ (bk x N) tile product, which the
generated kernel runs on tensor cores with `tl.dot`; grouping g blocks of one block row
lets a program accumulate them before a single scatter.

A matrix whose size is not a multiple of the block is padded with zero rows/columns up
to the next multiple. `spmm` hides this: it pads B with zero rows to K' = ceil(K/bk)*bk
when needed and returns only the first M rows of the (M' x N) result.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InsumError
from .base import (
    Coords,
    SparseFormat,
    check_positive_int,
    default_group_size,
    first_in_group,
    group_along_rows,
    index_dtype_for,
)

__all__ = ["BlockGroupCOO"]


def _block_of(block: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(block, int) and not isinstance(block, bool):
        block = (block, block)
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise InsumError(f"block must be an integer or a pair (bm, bk), got {block!r}")
    return check_positive_int("block bm", block[0]), check_positive_int("block bk", block[1])


class BlockGroupCOO(SparseFormat):
    """Block-grouped COO: AM[G] block rows, AK[G, g] block columns, AV[G, g, bm, bk] blocks.

    block: (bm, bk) or one integer for square blocks; default (16, 16), the smallest
    tile `tl.dot` accepts. `from_torch` of a BSR tensor defaults to its own blocksize.
    group_size: blocks per group; None for the paper's rule applied to block rows.
    pad: allow sizes that are not multiples of the block (zero padding); with pad=False
    such a matrix raises InsumError.

    >>> A = torch.zeros(4, 4); A[0, 0] = 1.0; A[3, 2] = 2.0
    >>> F = BlockGroupCOO.from_dense(A, block=2, group_size=1)
    >>> F.AM.tolist(), F.AK.tolist(), tuple(F.AV.shape)
    ([0, 1], [[0], [1]], (2, 1, 2, 2))
    """

    name = "blockgroupcoo"
    expression = "C[AM[p],m,n] += AV[p,q,m,k]*B[AK[p,q],k,n]"
    _value_names = ("AV",)

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
        group_size: int | None = None,
        pad: bool = True,
        index_dtype: torch.dtype | None = None,
    ) -> BlockGroupCOO:
        bm, bk = _block_of(block)
        M, K = coords.shape
        if not pad and (M % bm or K % bk):
            raise InsumError(
                f"block ({bm}, {bk}) does not divide the matrix shape ({M}, {K}); pass pad=True "
                "to pad it with zeros"
            )
        MB, KB = -(-M // bm), -(-K // bk)
        itype = index_dtype_for(MB, KB, requested=index_dtype)
        device = coords.device

        # Nonzero blocks, row-major: unique block keys and each nonzero's block.
        key = (coords.rows // bm) * KB + coords.cols // bk
        keys, which = torch.unique(key, sorted=True, return_inverse=True)
        blocks = torch.zeros(keys.numel(), bm, bk, dtype=coords.dtype, device=device)
        blocks[which, coords.rows % bm, coords.cols % bk] = coords.vals
        block_rows, block_cols = keys // KB, keys % KB

        if group_size is None:
            group_size = default_group_size(torch.bincount(block_rows, minlength=MB))
        check_positive_int("group_size", group_size)
        grouping = group_along_rows(block_rows, MB, group_size)
        G, g = grouping.size, group_size
        AK = first_in_group(grouping.group, grouping.slot, block_cols, G).unsqueeze(1).repeat(1, g)
        AK[grouping.group, grouping.slot] = block_cols
        AV = torch.zeros(G, g, bm, bk, dtype=coords.dtype, device=device)
        AV[grouping.group, grouping.slot] = blocks
        tensors = {"AM": grouping.group_row.to(itype), "AK": AK.to(itype), "AV": AV}
        params = {"block": (bm, bk), "group_size": g, "blocks": int(keys.numel())}
        return cls._packed(coords, tensors, itype, params)

    @property
    def block(self) -> tuple[int, int]:
        return (int(self.AV.shape[2]), int(self.AV.shape[3]))

    @property
    def group_size(self) -> int:
        return int(self.AK.shape[1])

    @property
    def padded_shape(self) -> tuple[int, int]:
        """The shape rounded up to whole blocks, which the kernel works on."""
        (bm, bk), (M, K) = self.block, self.shape
        return (-(-M // bm) * bm, -(-K // bk) * bk)

    def to_dense(self) -> torch.Tensor:
        (bm, bk), (Mp, Kp) = self.block, self.padded_shape
        G, g = self.AK.shape
        tiles = torch.zeros(Mp // bm, Kp // bk, bm, bk, dtype=self.dtype, device=self.device)
        rows = self.AM.long().unsqueeze(1).expand(G, g)
        tiles.index_put_((rows, self.AK.long()), self.AV, accumulate=True)
        dense = tiles.permute(0, 2, 1, 3).reshape(Mp, Kp)
        return dense[: self.shape[0], : self.shape[1]].contiguous()

    def _spmm(self, B, compute, acc, backend, precision) -> torch.Tensor:
        (bm, bk), (Mp, Kp) = self.block, self.padded_shape
        N = B.shape[1]
        if Kp != B.shape[0]:
            B = torch.cat([B, B.new_zeros(Kp - B.shape[0], N)])
        C = torch.zeros(Mp // bm, bm, N, dtype=acc, device=B.device)
        self._run(
            self.expression,
            backend,
            precision,
            C=C,
            B=B.view(Kp // bk, bk, N),
            **self._values(compute),
        )
        return C.view(Mp, N)[: self.shape[0]]

    def _describe(self) -> dict[str, Any]:
        return {
            "block": self.block,
            "group_size": self.group_size,
            "blocks": self.params.get("blocks"),
        }
