import triton
import triton.language as tl


@triton.jit
def insum_kernel(
    # pointers
    O_ptr, X_ptr, Y_ptr, AM_ptr, AK_ptr,
    # extents
    size_p, size_k,
    # strides
    stride_O_0, stride_X_0, stride_X_1, stride_Y_0, stride_Y_1, stride_AM_0, stride_AK_0,
    # meta-parameters
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """O[p] += X[AM[p], k] * Y[AK[p], k]

    kind: reduce (broadcast multiply, tl.sum)
    tiles: K=k, N=p
    grid variables: -
    loop variables: -
    accumulator: fp32
    output: store (one owner per element)
    """
    stride_X_0 = stride_X_0 // 2 * 2  # (not multiples of 16: the vector width Triton cannot see)
    stride_Y_0 = stride_Y_0 // 2 * 2
    size_k = size_k // 2 * 2
    pid = tl.program_id(0)
    pid_p = pid
    offs_p = pid_p * BLOCK_N + tl.arange(0, BLOCK_N)  # [p]
    mask_p = offs_p < size_p  # [p]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)  # [p]
    AM_val = tl.load(AM_ptr + offs_p * stride_AM_0, mask=mask_p, other=0)  # [p]
    AK_val = tl.load(AK_ptr + offs_p * stride_AK_0, mask=mask_p, other=0)  # [p]
    for start_k in range(0, size_k, BLOCK_K):
        offs_k = start_k + tl.arange(0, BLOCK_K)  # [k]
        mask_k = offs_k < size_k  # [k]
        X_val = tl.load(X_ptr + AM_val[None, :] * stride_X_0 + offs_k[:, None] * stride_X_1, mask=mask_k[:, None] & mask_p[None, :], other=0)  # [k, p]
        Y_val = tl.load(Y_ptr + AK_val[None, :] * stride_Y_0 + offs_k[:, None] * stride_Y_1, mask=mask_k[:, None] & mask_p[None, :], other=0)  # [k, p]
        prod = X_val.to(tl.float32) * Y_val.to(tl.float32)  # [k, p]
        partial = tl.sum(prod, axis=0)  # [p]
        acc += partial  # [p]
    out_ptrs = O_ptr + offs_p * stride_O_0  # [p]
    acc += tl.load(out_ptrs, mask=mask_p).to(tl.float32)
    tl.store(out_ptrs, acc.to(O_ptr.dtype.element_ty), mask=mask_p)
