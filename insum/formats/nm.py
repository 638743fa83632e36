"""Vector-wise N:M sparsity as NM-SpMM defines it (any N <= M, vector length L).

A *vector* is L consecutive rows of one column; along K, every window of M consecutive
vectors keeps N of them. All L rows of a row block share the kept columns, so one index
row AK[rb, :] serves L rows of values: with L >= 16 the kernel multiplies a row block
with `tl.dot`, and every output row has one owner (no atomics). 2:4 with L = 1 is the
element-wise pattern of sparse tensor cores.

Sizes that are not multiples are padded, as in the paper: rows up to a multiple of L,
columns up to a multiple of M. Padded columns carry value 0 and are clamped to column
K - 1, so every index is valid for the unpadded B; `spmm` returns the first R rows.
AV's and AK's rows are stored 16 elements apart in memory (`base.aligned_rows`), whatever
K * n / m is, so that the kernel loads their tiles as vectors.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..arith import cdiv
from ..dtypes import as_dtype, promoted
from ..errors import InsumError, InsumShapeError
from .base import SparseFormat, pad_rows
from .coords import Coords, check_positive_int, check_values, index_dtype_for
from .repeat import run_repeated
from .transposed import with_zero_slot

__all__ = ["NM"]

_GRADIENT_VARYING = frozenset({"DX", "WT", "DY"})  # what changes between x's gradient calls


def _check_nm(n: int, m: int, vector_len: int) -> None:
    check_positive_int("n", n)
    check_positive_int("m", m)
    check_positive_int("vector_len", vector_len)
    if n > m:
        raise InsumError(f"n={n} > m={m}: an N:M pattern keeps at most M of every M vectors")


def _dense_matrix(A: torch.Tensor) -> torch.Tensor:
    if not isinstance(A, torch.Tensor):
        raise InsumError(f"expected a torch.Tensor, got {type(A).__name__}")
    if A.dim() != 2:
        raise InsumShapeError(f"formats pack matrices; got a tensor of shape {tuple(A.shape)}")
    check_values(A.dtype)
    return A.to_dense() if A.layout != torch.strided else A


class NM(SparseFormat):
    """Vector-wise N:M: AK[R'/L, K'N/M] kept columns, AV[R'/L, L, K'N/M] their values.

    R' and K' are R and K rounded up to multiples of L and M. `AV.reshape(R', -1)` is the
    row-major (R', K'N/M) view. Build with `from_dense` (prune by magnitude), `from_mask`
    (a given pattern) or `from_torch` (the stored entries are the pattern).

    >>> A = torch.tensor([[1.0, 0.0, 0.0, 2.0], [0.0, 3.0, 0.0, 0.0]])
    >>> F = NM.from_dense(A, n=2, m=4, vector_len=1)
    >>> F.AK.tolist()  # row 1 keeps column 1 and, at a tie of zeros, column 0
    [[0, 3], [0, 1]]
    """

    name = "nm"
    expression = "C[rb,l,n] += AV[rb,l,u]*B[AK[rb,u],n]"
    input_gradient_expression = "DX[k, n] += WT[IU[rb, k], l] * DY[rb, l, n]"
    _value_names = ("AV",)
    aligned_tensors = ("AV", "AK")  # rows K * n / m wide, loaded as dot tiles

    @classmethod
    def from_dense(
        cls,
        A: torch.Tensor,
        n: int = 2,
        m: int = 4,
        vector_len: int = 16,
        *,
        index_dtype: torch.dtype | None = None,
        **unknown: Any,
    ) -> NM:
        """Prune A by magnitude: in each window keep the n vectors of largest L2 norm."""
        if unknown:
            raise InsumError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))} for NM.from_dense; "
                "valid: n, m, vector_len, index_dtype"
            )
        A = _dense_matrix(A)
        _check_nm(n, m, vector_len)
        blocks = cls._padded(A, m, vector_len)
        norms = blocks.double().norm(dim=1)  # (R'/L, K'/m, m)
        return cls._build(A.shape, blocks, norms, n, m, vector_len, index_dtype)

    @classmethod
    def from_mask(
        cls,
        A: torch.Tensor,
        mask: torch.Tensor,
        n: int = 2,
        m: int = 4,
        vector_len: int = 16,
        *,
        index_dtype: torch.dtype | None = None,
    ) -> NM:
        """Pack A under a given pattern; a window keeping more than n vectors is an error.

        mask is (R, K) per element or (ceil(R/L), K) per vector; nonzero means kept. A
        vector is kept when any of its elements is; elements outside the mask are zeroed.
        """
        A = _dense_matrix(A)
        _check_nm(n, m, vector_len)
        R, K = A.shape
        RB = cdiv(R, vector_len)
        mask = torch.as_tensor(mask, device=A.device)
        mask = mask.to_dense() if mask.layout != torch.strided else mask
        mask = mask != 0
        if tuple(mask.shape) == (RB, K) and (RB, K) != (R, K):
            mask = mask.repeat_interleave(vector_len, dim=0)[:R]
        if tuple(mask.shape) != (R, K):
            raise InsumShapeError(
                f"mask has shape {tuple(mask.shape)}; expected ({R}, {K}) per element or "
                f"({RB}, {K}) per vector of length {vector_len}"
            )
        blocks = cls._padded(torch.where(mask, A, 0), m, vector_len)  # (not A * mask: inf * 0 is nan)
        kept = cls._padded(mask, m, vector_len).any(dim=1)  # (RB, K'/m, m)
        per_window = kept.sum(dim=2)
        bad = (per_window > n).nonzero()
        if bad.numel():
            rb, w = bad[0].tolist()
            L = vector_len
            raise InsumError(
                f"mask window at row block {rb} (rows {rb * L}..{min(rb * L + L, R) - 1}), "
                f"columns {w * m}..{min(w * m + m, K) - 1} keeps {int(per_window[rb, w])} vectors; "
                f"a {n}:{m} pattern keeps at most {n} ({bad.shape[0]} window(s) violate it)"
            )
        # nnz counts the mask's entries (the pattern), whatever their values: a mask packed over
        # zeros whose values are filled in afterwards is a pattern, not an empty matrix.
        return cls._build(A.shape, blocks, kept.float(), n, m, vector_len, index_dtype, nnz=int(mask.sum()))

    @classmethod
    def _pack(
        cls,
        coords: Coords,
        *,
        n: int = 2,
        m: int = 4,
        vector_len: int = 16,
        index_dtype: torch.dtype | None = None,
    ) -> NM:
        """from_torch: the stored entries are the pattern (checked like from_mask)."""
        coords = coords.checked()
        dense = torch.zeros(coords.shape, dtype=coords.dtype, device=coords.device)
        dense[coords.rows, coords.cols] = coords.vals
        mask = torch.zeros(coords.shape, dtype=torch.bool, device=coords.device)
        mask[coords.rows, coords.cols] = True
        return cls.from_mask(dense, mask, n, m, vector_len, index_dtype=index_dtype)

    @staticmethod
    def _padded(A: torch.Tensor, m: int, L: int) -> torch.Tensor:
        """A zero-padded to whole vectors and windows, viewed (R'/L, L, K'/m, m)."""
        R, K = A.shape
        Rp, Kp = cdiv(R, L) * L, cdiv(K, m) * m
        if A.dtype == torch.bool:
            A = A.to(torch.uint8)
        padded = F.pad(A, (0, Kp - K, 0, Rp - R))
        return padded.view(Rp // L, L, Kp // m, m)

    @staticmethod
    def _padded_columns(K: int, m: int, device: torch.device) -> torch.Tensor:
        Kp = cdiv(K, m) * m
        return (torch.arange(Kp, device=device) >= K).view(1, Kp // m, m)

    @classmethod
    def _build(cls, shape, blocks, score, n: int, m: int, L: int, index_dtype, nnz: int | None = None) -> NM:
        R, K = int(shape[0]), int(shape[1])
        RB, _, KW, _ = blocks.shape
        itype = index_dtype_for(R, K, requested=index_dtype)
        # At equal (zero) score prefer real columns to padded ones: fewer clamped indices.
        score = score.double() - 0.5 * cls._padded_columns(K, m, blocks.device).double() * (
            score == 0
        )
        # The n best of each window, ties to the lower column (deterministic on any device).
        order = torch.sort(score, dim=2, descending=True, stable=True).indices
        choice = order[..., :n].sort(dim=2).values  # (RB, KW, n)
        columns = choice + (torch.arange(KW, device=blocks.device) * m).view(1, KW, 1)
        AK = columns.reshape(RB, KW * n).clamp(max=max(K - 1, 0))
        gathered = blocks.gather(3, choice.unsqueeze(1).expand(RB, L, KW, n))
        AV = gathered.reshape(RB, L, KW * n).contiguous()
        params = {"n": n, "m": m, "vector_len": L}
        return cls(
            (R, K),
            cls.with_aligned_rows({"AK": AK.to(itype), "AV": AV}),
            nnz=int(torch.count_nonzero(AV)) if nnz is None else nnz,
            dtype=AV.dtype,
            index_dtype=itype,
            device=AV.device,
            params=params,
        )

    @property
    def padded_rows(self) -> int:
        return int(self.AV.shape[0] * self.AV.shape[1])

    def _dense(self) -> torch.Tensor:
        RB, L, U = self.AV.shape
        R, K = self.shape
        dense = torch.zeros(RB, K, L, dtype=self.dtype, device=self.device)
        blocks = torch.arange(RB, device=self.device).unsqueeze(1).expand(RB, U)
        dense.index_put_((blocks, self.AK.long()), self.AV.transpose(1, 2), accumulate=True)
        return dense.transpose(1, 2).reshape(RB * L, K)[:R].contiguous()

    @property
    def fan_in(self) -> int:
        """Every output row has one owner."""
        return 1

    def output_shape(self, N: int) -> tuple[int, ...]:
        RB, L, _ = self.AV.shape
        return (RB, L, N)

    def result(self, C: torch.Tensor) -> torch.Tensor:
        return C.view(self.padded_rows, -1)[: self.shape[0]]

    def output_view(self, dC: torch.Tensor) -> torch.Tensor:
        return pad_rows(dC, self.padded_rows).reshape(self.output_shape(dC.shape[1]))

    @classmethod
    def row_granule(cls, params: Mapping[str, Any]) -> int:
        """A vector of vector_len rows keeps one n:m choice of columns."""
        return params.get("vector_len", inspect.signature(cls._pack).parameters["vector_len"].default)

    @classmethod
    def pruning_block(cls, params: Mapping[str, Any]) -> tuple[int, int] | None:
        raise InsumError("NM prunes to its own n:m pattern; pass n=, m= instead of sparsity=")

    def transposed_pattern(self) -> dict[str, torch.Tensor] | None:
        """Per row block, the slot of every column (a zero slot where it keeps none): B's
        gradient is then a dense-shaped tl.dot with no scatter at all."""
        AK = self.AK.long()
        RB, U = AK.shape
        if U > 1 and bool((AK[:, 1:] == AK[:, :-1]).any()):
            return None  # clamped padding columns repeat an index: one slot per column fails
        IU = torch.full((RB, self.shape[1]), RB * U, dtype=torch.int64, device=AK.device)
        IU.scatter_(1, AK, torch.arange(RB * U, device=AK.device).view(RB, U))
        return {"IU": IU.to(self.index_dtype)}

    def input_gradient(self, pattern, dC, backend, precision) -> torch.Tensor:
        RB, L, U = self.AV.shape
        WT = with_zero_slot(as_dtype(self.AV, dC.dtype).transpose(1, 2).reshape(RB * U, L))
        DX = torch.zeros(self.shape[1], dC.shape[-1], dtype=promoted(WT.dtype, dC.dtype), device=dC.device)
        run_repeated(self, self.input_gradient_expression, {"DX": DX, "WT": WT, "DY": dC, **pattern}, {},
                     _GRADIENT_VARYING, backend=backend, precision=precision)
        return DX

    def _describe(self) -> dict[str, Any]:
        return dict(self.params)
