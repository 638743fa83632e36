"""Every format's statement through the generated Triton kernel (backend="triton").

On a CPU-only machine the kernels run in the Triton interpreter (TRITON_INTERPRET=1 is set
by kernel_env.py, as for test_codegen.py); on a CUDA machine they run compiled, also in half precision,
and GroupCOO's group_size="tune" times real kernels.
"""


import pytest
import torch
from kernel_env import (  # before insum: the interpreter on CPU-only machines
    CUDA,
    DEVICE,
    KERNEL_MARK,
)

from insum import insum
from insum.errors import InsumShapeError, InsumTypeError
from insum.formats import CELL, COO, ELL, NM, BlockGroupCOO, GroupCOO, power_law_matrix

pytestmark = KERNEL_MARK
# The interpreter has no bf16 and its fp16 atomics fail: half precision runs on the GPU only.
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if CUDA else [torch.float32]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}

CONFIGS = [
    (COO, {}),
    (GroupCOO, {}),
    (GroupCOO, {"group_size": 8}),
    (ELL, {}),
    (BlockGroupCOO, {}),
    (BlockGroupCOO, {"block": (16, 32), "group_size": 2}),
    (BlockGroupCOO, {"group_size": "row"}),  # Block-ELL: direct output, no atomics
    (BlockGroupCOO, {"block": (16, 32), "group_size": "row"}),
    (CELL, {}),
    (CELL, {"partitions": 3, "max_width": 4}),
]


def _matrix(dtype):
    A = power_law_matrix(70, 45, 6.0, alpha=1.2, seed=3).to_dense()
    A[[0, 9, 69]] = 0  # empty rows, first and last included
    return A.to(DEVICE, dtype)


def _check(C, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        C.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item()
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: c[0].__name__ + "".join(f"-{v}" for v in c[1].values())
)
def test_format_kernel_matches_dense(config, index_dtype, dtype):
    cls, params = config
    A = _matrix(dtype)
    fmt = cls.from_dense(A, index_dtype=index_dtype, **params)
    B = torch.randn(A.shape[1], 16, device=DEVICE).to(dtype)
    C = fmt.spmm(B, backend="triton", precision="ieee")
    assert C.dtype == dtype and C.shape == (A.shape[0], 16)
    _check(C, A.double() @ B.double(), dtype)


#: Formats whose product is one statement over C's rows: the bias in its epilogue.
FUSED_BIAS = {"ELL", "BlockGroupCOO-row", "BlockGroupCOO-(16, 32)-row", "NM-2-4-8"}


def _name(config) -> str:
    return config[0].__name__ + "".join(f"-{v}" for v in config[1].values())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "config", [*CONFIGS, (NM, {"n": 2, "m": 4, "vector_len": 8})], ids=_name)
def test_product_with_a_bias_matches_dense(config, dtype):
    """`fmt.spmm(B, bias=b)` is A @ B + b[:, None] on every format: in the product's epilogue
    where the format has one statement over C's rows, else added after it. Repeated, so that
    the pinned launch runs too; a vector B and a format with no entries as well."""
    cls, params = config
    A = _matrix(dtype)
    fmt = cls.from_dense(A, **params)
    A = fmt.to_dense()  # (NM prunes)
    bias = torch.randn(A.shape[0], device=DEVICE).to(dtype)
    name = _name(config)
    assert (fmt.bias_expression() is not None) == (name in FUSED_BIAS)
    for seed in range(3):
        B = torch.randn(A.shape[1], 16, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
        C = fmt.spmm(B, bias=bias, backend="triton", precision="ieee")
        assert C.dtype == dtype and C.shape == (A.shape[0], 16)
        _check(C, A.double() @ B.double() + bias.double()[:, None], dtype)
    (plan,) = fmt.__dict__["_spmm_plans"].values()
    assert plan.fused == (name in FUSED_BIAS) and plan.pinned is not None
    v = fmt.spmm(B[:, 0], bias=bias, backend="triton", precision="ieee")
    _check(v, A.double() @ B[:, 0].double() + bias.double(), dtype)
    empty = cls.from_dense(torch.zeros_like(A), **params)
    _check(empty.spmm(B, bias=bias, backend="triton"), bias.double()[:, None].expand(-1, 16), dtype)


def test_product_bias_is_checked():
    fmt = ELL.from_dense(_matrix(torch.float32))
    B = torch.randn(fmt.shape[1], 4, device=DEVICE)
    with pytest.raises(InsumShapeError, match=r"one value per row, \(70,\)"):
        fmt.spmm(B, bias=torch.zeros(69, device=DEVICE))
    with pytest.raises(InsumTypeError, match="dense torch.Tensor"):
        fmt.spmm(B, bias=[0.0] * 70)
    with pytest.raises(InsumTypeError, match="bias"):
        fmt.spmm(B, bias=torch.zeros(70, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, m, L", [(2, 4, 1), (2, 4, 16), (3, 8, 4)])
def test_nm_kernel_matches_dense(n, m, L, dtype):
    A = torch.randn(37, 29, device=DEVICE).to(dtype)
    fmt = NM.from_dense(A, n, m, L)
    B = torch.randn(29, 16, device=DEVICE).to(dtype)
    C = fmt.spmm(B, backend="triton", precision="ieee")
    _check(C, fmt.to_dense().double() @ B.double(), dtype)


@pytest.mark.skipif(not CUDA, reason="timing the neighbouring group sizes needs compiled kernels")
def test_group_size_tune_on_gpu():
    A = power_law_matrix(4096, 4096, 16.0, alpha=1.0, seed=0).to(DEVICE)
    fmt = GroupCOO.from_torch(A, group_size="tune", tune_cols=64)
    assert fmt.group_size in fmt.params["tuned_seconds"]
    B = torch.randn(4096, 64, device=DEVICE)
    _check(fmt @ B, A.to_dense().double() @ B.double(), torch.float32)


def _poisoned_block_ell(dtype=torch.float32, index_dtype=None):
    """A Block-ELL matrix A packed from its block pattern `keep` (an empty block row, a
    one-block row, a row of every block column: a non-power-of-two width), its padding slots
    poisoned with NaN after packing (a product that reads them is not finite). Returns the
    format, keep, A and the generator, for B."""
    gen = torch.Generator().manual_seed(5)
    bm, bk, MB, KB = 16, 16, 6, 7
    keep = torch.rand(MB, KB, generator=gen) < 0.45
    keep[1] = False  # an empty block row
    keep[2] = False
    keep[2, 3] = True  # one block
    keep[4] = True  # the longest row: every block column
    A = torch.randn(MB * bm, KB * bk, generator=gen) * keep.repeat_interleave(bm, 0).repeat_interleave(bk, 1)
    fmt = BlockGroupCOO.from_dense(A.to(dtype), block=(bm, bk), group_size="row", index_dtype=index_dtype).to(DEVICE)
    padding = torch.arange(fmt.AK.shape[1], device=DEVICE) >= fmt.declared_lengths()["q[p]"][:, None]
    assert bool(padding.any())
    with torch.no_grad():
        fmt.AV[padding] = float("nan")
    return fmt, keep, A, gen


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_ell_skips_its_padding(index_dtype, dtype):
    """Block-ELL rows declare their block counts (`declared_lengths`), so the kernel stops
    each block row there: padding poisoned with NaN after packing leaves the product exact
    (empty and single-block rows, a non-power-of-two width, a non-contiguous B)."""
    fmt, keep, A, gen = _poisoned_block_ell(dtype, index_dtype)
    counts = fmt.declared_lengths()["q[p]"]
    assert counts.dtype == index_dtype
    assert counts.cpu().tolist() == keep.sum(1).tolist()  # 0 for the empty block row
    B = torch.randn(24, A.shape[1], generator=gen).to(dtype).to(DEVICE).t()  # non-contiguous
    expected = A.double() @ B.double().cpu()
    for _ in range(3):  # the first call, then the pinned repeats
        C = fmt.spmm(B, backend="triton", precision="ieee")
        assert bool(torch.isfinite(C).all())
        assert (C.double().cpu() - expected).norm() / expected.norm() <= TOLERANCE[dtype]


def _assert_product(C, expected):
    assert bool(torch.isfinite(C).all())
    C = C.double().cpu()
    assert (C - expected).norm() / expected.norm() <= 1e-5


def test_block_ell_skips_its_padding_under_torch_compile():
    """The declared lengths reach the kernel through torch.compile's custom operator: the
    compiled product (and a compiled `insum()` given `lengths=`) never reads the NaN padding."""
    torch._dynamo.reset()
    fmt, _, A, gen = _poisoned_block_ell()
    B = torch.randn(A.shape[1], 20, generator=gen).to(DEVICE)
    expected = A.double() @ B.double().cpu()
    compiled = torch.compile(lambda B: fmt.spmm(B, backend="triton", precision="ieee"), fullgraph=True)
    _assert_product(compiled(B), expected)

    AL = fmt.declared_lengths()["q[p]"]

    def product(B):
        C = insum(BlockGroupCOO.row_expression, AV=fmt.AV, AK=fmt.AK, B=fmt.operand(B), lengths={"q[p]": AL},
                  backend="triton", precision="ieee")
        return fmt.result(C)

    _assert_product(torch.compile(product, fullgraph=True)(B), expected)
