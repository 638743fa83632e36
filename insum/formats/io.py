"""Readers for the sparse matrix files in ../shared/data: Matrix Market and DLMC .smtx.

Both return a float32 torch sparse CSR tensor (int64 indices), the layout every format's
`from_torch` accepts. Files may be gzip-compressed (detected from the content, not the
name). Pattern files have no values: they are drawn from a standard normal with a
`torch.Generator` seeded by `seed`, one per stored entry in file order (a mirrored
entry of a symmetric file shares its value), so a given seed always gives the same
matrix. A malformed file raises InsumError naming the line.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import warnings

import numpy as np
import torch

from ..errors import InsumError
from .coords import check_values

__all__ = ["load_mtx", "load_smtx"]

_FIELDS = ("real", "integer", "pattern")
_SYMMETRIES = ("general", "symmetric", "skew-symmetric")


def _read_text(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise InsumError(f"{path}: corrupt gzip data ({e})") from None
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError as e:
        raise InsumError(f"{path}: not a text file (byte {e.start} is not ASCII)") from None


def _pattern_values(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, generator=generator, dtype=torch.float64)


def _csr(shape: tuple[int, int], rows, cols, vals, dtype: torch.dtype) -> torch.Tensor:
    indices = torch.stack(
        [torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)]
    )
    values = torch.as_tensor(vals, dtype=torch.float64)
    coo = torch.sparse_coo_tensor(indices, values, shape, check_invariants=False)  # checked above
    return coo.coalesce().to(dtype).to_sparse_csr()  # duplicates are summed


# --------------------------------------------------------------------------- Matrix Market


def _entry_lines(lines: list[str], first: int) -> list[int]:
    """Line numbers (1-based) of the entry lines from index `first` on: the slow path."""
    return [
        i + 1
        for i in range(first, len(lines))
        if lines[i].strip() and not lines[i].lstrip().startswith("%")
    ]


def _bad_entry(path, lines: list[str], first: int, columns: int) -> InsumError:
    """Find the first entry line that does not parse; only called once parsing failed."""
    for number in _entry_lines(lines, first):
        tokens = lines[number - 1].split()
        if len(tokens) != columns:
            return InsumError(
                f"{path}, line {number}: expected {columns} numbers, found {len(tokens)}: {lines[number - 1]!r}"
            )
        try:
            [float(t) for t in tokens]
        except ValueError:
            return InsumError(f"{path}, line {number}: not a number in {lines[number - 1]!r}")
    return InsumError(f"{path}: entries do not parse")


def load_mtx(
    path: str | os.PathLike, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Read a Matrix Market coordinate file (real, integer or pattern; general, symmetric
    or skew-symmetric; plain or gzip) as a sparse CSR tensor.

    Symmetric files store one triangle: the other is mirrored (negated when skew). An
    entry above the diagonal of a symmetric file is an error, since mirroring it would
    double it. Duplicate entries are summed.

    >>> A = load_mtx("../shared/data/graphs/cora.mtx.gz")  # doctest: +SKIP
    >>> A.shape, A.layout  # doctest: +SKIP
    (torch.Size([2708, 2708]), torch.sparse_csr)
    """
    check_values(dtype, "loaded values would have")
    lines = _read_text(path).splitlines()
    if not lines:
        raise InsumError(f"{path}, line 1: empty file, expected a %%MatrixMarket header")
    header = lines[0].lower().split()
    if len(header) != 5 or header[0] != "%%matrixmarket" or header[1] != "matrix":
        raise InsumError(
            f"{path}, line 1: expected '%%MatrixMarket matrix coordinate <field> <symmetry>', found {lines[0]!r}"
        )
    layout, field, symmetry = header[2:]
    if layout != "coordinate":
        raise InsumError(
            f"{path}, line 1: only coordinate (sparse) files are supported, not {layout!r}"
        )
    if field not in _FIELDS:
        raise InsumError(
            f"{path}, line 1: field {field!r} is not supported; expected one of {', '.join(_FIELDS)}"
        )
    if symmetry not in _SYMMETRIES:
        raise InsumError(
            f"{path}, line 1: symmetry {symmetry!r} is not supported; expected one of {', '.join(_SYMMETRIES)}"
        )

    size_at = next(
        (
            i
            for i in range(1, len(lines))
            if lines[i].strip() and not lines[i].lstrip().startswith("%")
        ),
        None,
    )
    if size_at is None:
        raise InsumError(
            f"{path}, line {len(lines) + 1}: missing the size line 'rows cols nonzeros'"
        )
    try:
        n_rows, n_cols, nnz = (int(t) for t in lines[size_at].split())
        if min(n_rows, n_cols, nnz) < 0:
            raise ValueError
    except ValueError:
        raise InsumError(
            f"{path}, line {size_at + 1}: expected 'rows cols nonzeros' (three non-negative integers), "
            f"found {lines[size_at]!r}"
        ) from None
    if symmetry != "general" and n_rows != n_cols:  # (its mirrored entries would fall outside)
        raise InsumError(f"{path}, line {size_at + 1}: a {symmetry} matrix must be square, not {n_rows} x {n_cols}")

    columns = 2 if field == "pattern" else 3
    body = "\n".join(lines[size_at + 1 :])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data": nnz may be 0
            data = np.loadtxt(io.StringIO(body), comments="%", ndmin=2, dtype=np.float64)
    except ValueError:
        raise _bad_entry(path, lines, size_at + 1, columns) from None
    if data.size == 0:
        data = data.reshape(0, columns)
    if data.shape[1] != columns:
        raise _bad_entry(path, lines, size_at + 1, columns)
    if data.shape[0] != nnz:
        numbers = _entry_lines(lines, size_at + 1)
        where = (
            f"line {numbers[nnz]} is entry {nnz + 1}"
            if data.shape[0] > nnz
            else f"the file ends at line {len(lines)}"
        )
        raise InsumError(
            f"{path}, line {size_at + 1}: declares {nnz} entries but {data.shape[0]} are present ({where})"
        )

    rows, cols = data[:, 0], data[:, 1]
    outside = (
        (rows != np.floor(rows))
        | (cols != np.floor(cols))
        | (rows < 1)
        | (rows > n_rows)
        | (cols < 1)
        | (cols > n_cols)
    )
    upper = np.zeros_like(outside)
    if symmetry != "general":  # one triangle is stored; skew matrices have no diagonal
        upper = (cols >= rows) if symmetry == "skew-symmetric" else (cols > rows)
    if (outside | upper).any():
        entry = int(np.argmax(outside | upper))
        number = _entry_lines(lines, size_at + 1)[entry]
        reason = (
            f"index outside the {n_rows} x {n_cols} matrix (indices are 1-based integers)"
            if outside[entry]
            else f"entry not strictly below the diagonal of a {symmetry} matrix"
            if symmetry == "skew-symmetric"
            else f"entry above the diagonal of a {symmetry} matrix"
        )
        raise InsumError(f"{path}, line {number}: {reason}: {lines[number - 1]!r}")

    if field == "integer" and (data[:, 2] != np.floor(data[:, 2])).any():
        entry = int(np.argmax(data[:, 2] != np.floor(data[:, 2])))
        number = _entry_lines(lines, size_at + 1)[entry]
        raise InsumError(f"{path}, line {number}: an integer matrix holds a fractional value: {lines[number - 1]!r}")
    rows, cols = rows.astype(np.int64) - 1, cols.astype(np.int64) - 1
    vals = _pattern_values(nnz, seed) if field == "pattern" else torch.from_numpy(data[:, 2].copy())
    if symmetry != "general":
        off = rows != cols
        sign = -1.0 if symmetry == "skew-symmetric" else 1.0
        vals = torch.cat([vals, sign * vals[torch.from_numpy(off)]])
        rows, cols = np.concatenate([rows, cols[off]]), np.concatenate([cols, rows[off]])
    return _csr((n_rows, n_cols), rows, cols, vals, dtype)


# --------------------------------------------------------------------------- DLMC .smtx


def _integers(path, lines: list[str], index: int, what: str) -> np.ndarray:
    line = lines[index] if index < len(lines) else ""
    tokens = line.split()
    try:
        return np.array(tokens, dtype=np.int64) if tokens else np.zeros(0, dtype=np.int64)
    except (ValueError, OverflowError):
        position = next((i for i, t in enumerate(tokens) if not re.fullmatch(r"[+-]?\d+", t)), None)
        if position is None:  # every token an integer: one past int64
            position = next(i for i, t in enumerate(tokens) if not -(2**63) <= int(t) < 2**63)
            problem = "is out of the int64 range"
        else:
            problem = "is not an integer"
        raise InsumError(
            f"{path}, line {index + 1}: {what} must be integers; token {position + 1}, {tokens[position]!r}, {problem}"
        ) from None


def load_smtx(
    path: str | os.PathLike, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Read a DLMC .smtx file (plain or gzip) as a sparse CSR tensor with drawn values.

    The format: line 1 `nrows, ncols, nnz`; line 2 the nrows + 1 row offsets; line 3 the
    nnz column indices (0-based). There are no values: see the module docstring.

    >>> A = load_smtx("../shared/data/dlmc/rn50/magnitude_pruning/0.8/bottleneck_1_block_group1_1_1.smtx.gz")  # doctest: +SKIP
    >>> A.shape, A._nnz()  # doctest: +SKIP
    (torch.Size([64, 256]), 3276)
    """
    check_values(dtype, "loaded values would have")
    lines = _read_text(path).splitlines()
    if not lines:
        raise InsumError(f"{path}, line 1: empty file, expected 'nrows, ncols, nnz'")
    try:
        n_rows, n_cols, nnz = (int(t) for t in re.split(r"[,\s]+", lines[0].strip()))
        if min(n_rows, n_cols, nnz) < 0:
            raise ValueError
    except ValueError:
        raise InsumError(
            f"{path}, line 1: expected 'nrows, ncols, nnz' (non-negative integers), found {lines[0]!r}"
        ) from None
    if len(lines) < 2:
        raise InsumError(f"{path}, line 2: missing the {n_rows + 1} row offsets")
    offsets = _integers(path, lines, 1, "row offsets")
    if offsets.size != n_rows + 1:
        raise InsumError(
            f"{path}, line 2: expected {n_rows + 1} row offsets (nrows + 1), found {offsets.size}"
        )
    steps = np.diff(offsets)
    if offsets[0] != 0 or offsets[-1] != nnz or (steps < 0).any():
        raise InsumError(
            f"{path}, line 2: row offsets must start at 0, never decrease and end at nnz={nnz} "
            f"(they start at {offsets[0]} and end at {offsets[-1]}"
            + (
                f"; token {int(np.argmax(steps < 0)) + 2} is below the one before it)"
                if (steps < 0).any()
                else ")"
            )
        )
    if len(lines) < 3 and nnz:
        raise InsumError(f"{path}, line 3: missing the {nnz} column indices")
    cols = _integers(path, lines, 2, "column indices")
    if cols.size != nnz:
        raise InsumError(f"{path}, line 3: expected {nnz} column indices, found {cols.size}")
    if cols.size and (cols.min() < 0 or cols.max() >= n_cols):
        bad = int(np.argmax((cols < 0) | (cols >= n_cols)))
        raise InsumError(
            f"{path}, line 3: column index {cols[bad]} (token {bad + 1}) outside 0..{n_cols - 1}"
        )
    extra = next((i for i in range(3, len(lines)) if lines[i].strip()), None)
    if extra is not None:
        raise InsumError(
            f"{path}, line {extra + 1}: unexpected content after the three lines of an .smtx file"
        )
    rows = np.repeat(np.arange(n_rows, dtype=np.int64), steps)
    return _csr((n_rows, n_cols), rows, cols, _pattern_values(nnz, seed), dtype)
