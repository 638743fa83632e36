"""Matrix Market and DLMC .smtx readers: good files, every kind of malformed file, real data."""

import gzip

import pytest
import torch

from insum.errors import InsumError, InsumTypeError
from insum.formats import load_mtx, load_smtx


def _write(tmp_path, name, text, compress=False):
    path = tmp_path / name
    data = text.encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


# --------------------------------------------------------------------------- Matrix Market

REAL_GENERAL = """%%MatrixMarket matrix coordinate real general
% a comment
3 4 4
1 1 1.5
% a comment between entries
2 4 -2
3 2 3e-1
1 1 0.5
"""


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_mtx_real_general(tmp_path, compress):
    A = load_mtx(_write(tmp_path, "a.mtx", REAL_GENERAL, compress))
    assert A.layout == torch.sparse_csr and A.dtype == torch.float32
    expected = torch.zeros(3, 4)
    expected[0, 0] = 2.0  # duplicates are summed
    expected[1, 3] = -2.0
    expected[2, 1] = 0.3
    torch.testing.assert_close(A.to_dense(), expected)


def test_mtx_integer_symmetric(tmp_path):
    text = "%%MatrixMarket matrix coordinate integer symmetric\n3 3 3\n1 1 5\n2 1 7\n3 2 -1\n"
    A = load_mtx(_write(tmp_path, "s.mtx", text)).to_dense()
    expected = torch.tensor([[5.0, 7, 0], [7, 0, -1], [0, -1, 0]])
    torch.testing.assert_close(A, expected)


def test_mtx_skew_symmetric(tmp_path):
    text = "%%MatrixMarket matrix coordinate real skew-symmetric\n2 2 1\n2 1 4\n"
    torch.testing.assert_close(
        load_mtx(_write(tmp_path, "k.mtx", text)).to_dense(), torch.tensor([[0.0, -4], [4, 0]])
    )


def test_mtx_pattern_values_are_seeded(tmp_path):
    text = "%%MatrixMarket matrix coordinate pattern symmetric\n4 4 3\n2 1\n3 1\n4 4\n"
    path = _write(tmp_path, "p.mtx", text)
    A = load_mtx(path).to_dense()
    assert torch.equal(
        A != 0, torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]]).bool()
    )
    assert torch.equal(A, A.T)  # a mirrored entry shares its value
    assert torch.equal(load_mtx(path, seed=0).to_dense(), A)
    assert not torch.equal(load_mtx(path, seed=1).to_dense(), A)
    assert load_mtx(path, dtype=torch.float64).dtype == torch.float64


def test_mtx_empty_matrix(tmp_path):
    A = load_mtx(
        _write(tmp_path, "e.mtx", "%%MatrixMarket matrix coordinate real general\n5 6 0\n")
    )
    assert A.shape == (5, 6) and A._nnz() == 0


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "line 1: empty file"),
        ("%%MatrixMarket matrix coordinate real\n1 1 0\n", "line 1: expected '%%MatrixMarket"),
        ("%%MatrixMarket matrix array real general\n2 2\n1\n2\n3\n4\n", "line 1: only coordinate"),
        (
            "%%MatrixMarket matrix coordinate complex general\n1 1 1\n1 1 1 0\n",
            "line 1: field 'complex'",
        ),
        (
            "%%MatrixMarket matrix coordinate real hermitian\n1 1 0\n",
            "line 1: symmetry 'hermitian'",
        ),
        (
            "%%MatrixMarket matrix coordinate real general\n% only comments\n",
            "missing the size line",
        ),
        (
            "%%MatrixMarket matrix coordinate real general\n% c\n3 3\n",
            "line 3: expected 'rows cols nonzeros'",
        ),
        (
            "%%MatrixMarket matrix coordinate real general\n3 3 x\n",
            "line 2: expected 'rows cols nonzeros'",
        ),
        (
            "%%MatrixMarket matrix coordinate real general\n3 3 2\n1 1 1\n2 2\n",
            "line 4: expected 3 numbers, found 2",
        ),
        (
            "%%MatrixMarket matrix coordinate real general\n3 3 2\n1 1 1\n% c\n2 2 y\n",
            "line 5: not a number",
        ),
        (
            "%%MatrixMarket matrix coordinate pattern general\n3 3 1\n1 1 1\n",
            "line 3: expected 2 numbers, found 3",
        ),
        (
            "%%MatrixMarket matrix coordinate real general\n3 3 2\n1 1 1\n% c\n4 1 1\n",
            "line 5: index outside the 3 x 3",
        ),
        ("%%MatrixMarket matrix coordinate real general\n3 3 1\n0 1 1\n", "line 3: index outside"),
        (
            "%%MatrixMarket matrix coordinate real general\n3 3 1\n1.5 1 1\n",
            "line 3: index outside",
        ),
        (
            "%%MatrixMarket matrix coordinate real general\n3 3 3\n1 1 1\n2 2 2\n",
            "declares 3 entries but 2",
        ),
        (
            "%%MatrixMarket matrix coordinate real general\n3 3 1\n1 1 1\n2 2 2\n",
            "line 4 is entry 2",
        ),
        (
            "%%MatrixMarket matrix coordinate real symmetric\n3 3 2\n2 1 1\n1 3 1\n",
            "line 4: entry above the diagonal",
        ),
        (
            "%%MatrixMarket matrix coordinate real skew-symmetric\n3 3 1\n2 2 1\n",
            "line 3: entry not strictly below",
        ),
        # Found by fuzzing: read as 3 x 2, its mirrored entry (1, 3) fell outside the matrix.
        ("%%MatrixMarket matrix coordinate real symmetric\n3 2 1\n3 1 5\n", "line 2: a symmetric matrix must be square"),
        ("%%MatrixMarket matrix coordinate real skew-symmetric\n2 3 0\n", "line 2: a skew-symmetric matrix must be square"),
    ],
)
def test_mtx_malformed(tmp_path, text, message):
    with pytest.raises(InsumError) as info:
        load_mtx(_write(tmp_path, "bad.mtx", text))
    assert message in str(info.value)
    assert "bad.mtx" in str(info.value)


def test_mtx_not_text_and_corrupt_gzip(tmp_path):
    binary = tmp_path / "b.mtx"
    binary.write_bytes(b"%%MatrixMarket \xff\xfe")
    with pytest.raises(InsumError, match="not a text file"):
        load_mtx(binary)
    broken = tmp_path / "g.mtx.gz"
    broken.write_bytes(gzip.compress(REAL_GENERAL.encode())[:20])
    with pytest.raises(InsumError, match="corrupt gzip"):
        load_mtx(broken)


# --------------------------------------------------------------------------- DLMC .smtx

SMTX = "3, 5, 4\n0 2 2 4\n1 4 0 3\n"


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_smtx(tmp_path, compress):
    A = load_smtx(_write(tmp_path, "a.smtx", SMTX, compress))
    assert A.layout == torch.sparse_csr and A.shape == (3, 5) and A._nnz() == 4
    pattern = torch.zeros(3, 5, dtype=torch.bool)
    pattern[0, [1, 4]] = True
    pattern[2, [0, 3]] = True
    assert torch.equal(A.to_dense() != 0, pattern)
    assert torch.equal(load_smtx(_write(tmp_path, "b.smtx", SMTX), seed=0).to_dense(), A.to_dense())
    assert not torch.equal(
        load_smtx(_write(tmp_path, "b.smtx", SMTX), seed=5).to_dense(), A.to_dense()
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "line 1: empty file"),
        ("3 5\n0 0 0 0\n\n", "line 1: expected 'nrows, ncols, nnz'"),
        ("3, 5, 4\n", "line 2: missing"),
        ("3, 5, 4\n0 2 4\n1 4 0 3\n", "line 2: expected 4 row offsets"),
        ("3, 5, 4\n0 2 x 4\n1 4 0 3\n", "line 2: row offsets must be integers; token 3, 'x', is not an integer"),
        # (found by fuzzing: a bare StopIteration)
        ("3, 5, 4\n0 2 2 4\n1 99999999999999999999999 0 3\n",
         "line 3: column indices must be integers; token 2, '99999999999999999999999', is out of the int64 range"),
        ("3, 5, 4\n0 3 2 4\n1 4 0 3\n", "token 3 is below the one before it"),
        ("3, 5, 4\n1 2 2 4\n1 4 0 3\n", "must start at 0"),
        ("3, 5, 4\n0 2 2 3\n1 4 0 3\n", "end at nnz=4"),
        ("3, 5, 4\n0 2 2 4\n", "line 3: missing"),
        ("3, 5, 4\n0 2 2 4\n1 4 0\n", "line 3: expected 4 column indices, found 3"),
        ("3, 5, 4\n0 2 2 4\n1 5 0 3\n", "line 3: column index 5 (token 2) outside 0..4"),
        ("3, 5, 4\n0 2 2 4\n1 4 0 3\n7\n", "line 4: unexpected content"),
    ],
)
def test_smtx_malformed(tmp_path, text, message):
    with pytest.raises(InsumError) as info:
        load_smtx(_write(tmp_path, "bad.smtx", text))
    assert message in str(info.value)


# --------------------------------------------------------------------------- real files


@pytest.mark.data
@pytest.mark.parametrize(
    "name, nodes, nnz", [("cora", 2708, 10556), ("citeseer", 3327, 9104), ("pubmed", 19717, 88648)]
)
def test_real_graphs(data_dir, name, nodes, nnz):
    A = load_mtx(data_dir / "graphs" / f"{name}.mtx.gz")
    assert A.shape == (nodes, nodes) and A._nnz() == nnz
    pattern = A.to_sparse_coo().coalesce().indices()
    flipped = (
        torch.sparse_coo_tensor(pattern.flip(0), torch.ones(nnz), A.shape).coalesce().indices()
    )
    assert torch.equal(pattern, flipped)  # the adjacency is symmetric
    assert not bool((pattern[0] == pattern[1]).any())  # self-loops removed


@pytest.mark.data
def test_real_dlmc(data_dir):
    files = sorted((data_dir / "dlmc").rglob("*.smtx.gz"))
    assert files, "no .smtx.gz files under dlmc/"
    for path in files[:: max(1, len(files) // 6)]:
        with gzip.open(path, "rt") as f:
            rows, cols, nnz = (int(t) for t in f.readline().split(","))
        A = load_smtx(path)
        assert A.shape == (rows, cols) and A._nnz() == nnz, path.name


def test_mtx_integer_field_and_value_dtype(tmp_path):
    """Found by fuzzing: an integer file's fractional value was read as it was, and an integer
    dtype was accepted for the values."""
    path = _write(tmp_path, "frac.mtx", "%%MatrixMarket matrix coordinate integer general\n2 2 1\n1 1 2.5\n")
    with pytest.raises(InsumError, match="line 3: an integer matrix holds a fractional value"):
        load_mtx(path)
    good = _write(tmp_path, "int.mtx", "%%MatrixMarket matrix coordinate integer general\n2 2 1\n1 1 3\n")
    assert load_mtx(good).to_dense().tolist() == [[3.0, 0.0], [0.0, 0.0]]
    with pytest.raises(InsumTypeError, match="loaded values would have dtype torch.int64"):
        load_mtx(good, dtype=torch.int64)
