"""Every format on real sparsity patterns from ../shared/data (DLMC weights, citation graphs).

Skipped with the reason when the data folder is absent. SpMM runs through the reference
lowering on the CPU in float32 and is compared with torch's CSR matmul.
"""

import pytest
import torch

from insum.formats import CELL, COO, ELL, NM, BlockGroupCOO, GroupCOO, load_mtx, load_smtx

pytestmark = pytest.mark.data

PATTERNS = [
    "graphs/cora.mtx.gz",
    "graphs/citeseer.mtx.gz",
    "dlmc/rn50/magnitude_pruning/0.8/bottleneck_1_block_group1_1_1.smtx.gz",
    "dlmc/rn50/magnitude_pruning/0.98/bottleneck_2_block_group3_1_1.smtx.gz",
    "dlmc/transformer/magnitude_pruning/0.9/body_decoder_layer_1_ffn_conv2_fully_connected.smtx.gz",
]

CONFIGS = [
    (COO, {}),
    (GroupCOO, {}),
    (GroupCOO, {"group_size": 16}),
    (ELL, {}),
    (BlockGroupCOO, {"block": 16}),
    (BlockGroupCOO, {"block": (32, 16), "group_size": 2}),
    (BlockGroupCOO, {"block": 16, "group_size": "row"}),
    (CELL, {}),
    (CELL, {"partitions": 4}),
]


def _load(data_dir, relative):
    path = data_dir / relative
    if not path.exists():
        pytest.skip(f"{path} not found")
    return (load_mtx if relative.endswith(".mtx.gz") else load_smtx)(path)


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: c[0].__name__ + "".join(f"-{v}" for v in c[1].values())
)
@pytest.mark.parametrize("relative", PATTERNS, ids=lambda p: p.split("/")[-1].split(".")[0][:32])
def test_real_pattern(data_dir, relative, config):
    A = _load(data_dir, relative)
    cls, params = config
    fmt = cls.from_torch(A, **params)
    dense = A.to_dense()
    assert torch.equal(fmt.to_dense(), dense)
    assert fmt.nnz == A._nnz()
    B = torch.randn(A.shape[1], 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fmt @ B, A @ B, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n, m, L", [(2, 4, 1), (1, 4, 16), (3, 8, 4)])
def test_nm_prunes_real_weights(data_dir, n, m, L):
    A = _load(data_dir, PATTERNS[4]).to_dense()
    fmt = NM.from_dense(A, n, m, L)
    pruned = fmt.to_dense()
    kept = pruned != 0
    assert torch.equal(pruned[kept], A[kept])  # kept entries are A's values
    B = torch.randn(A.shape[1], 16)
    torch.testing.assert_close(fmt @ B, pruned @ B, rtol=1e-4, atol=1e-4)
    # Round trip of the pruned pattern through from_mask and from_torch.
    assert torch.equal(NM.from_mask(A, kept, n, m, L).to_dense(), pruned)
    assert torch.equal(
        NM.from_torch(pruned.to_sparse_csr(), n=n, m=m, vector_len=L).to_dense(), pruned
    )
