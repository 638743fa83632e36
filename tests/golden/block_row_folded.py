import triton
import triton.language as tl


@triton.jit
def insum_kernel(
    # pointers
    C_ptr, AV_ptr, B_ptr, AK_ptr,
    # extents
    size_p, size_m, size_n, size_q, size_k,
    # strides
    stride_C_0, stride_C_1, stride_C_2, stride_AV_0, stride_AV_1, stride_AV_2, stride_AV_3, stride_B_0, stride_B_1, stride_B_2, stride_AK_0, stride_AK_1,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[p, m, n] = AV[p, q, m, k] * B[AK[p, q], k, n]

    kind: dot (tl.dot)
    tiles: M=n, K=(q, k), N=m
    grid variables: p
    loop variables: -
    left (M, K): B[AK[p, q], k, n]
    right (K, N): AV[p, q, m, k]
    dot operands: fp16
    program order: groups of GROUP_M M tiles, columns of (p, N tile)
    accumulator: fp32
    output: store (one owner per element)
    """
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(size_n, BLOCK_M)
    tiles_m = tl.cdiv(size_m, BLOCK_N)
    columns = tiles_m * size_p
    tile = pid
    group = GROUP_M * columns
    first_n = (tile // group) * GROUP_M
    group_rows = tl.minimum(tiles_n - first_n, GROUP_M)
    pid_n = first_n + (tile % group) % group_rows
    column = (tile % group) // group_rows
    pid_m = column % tiles_m
    pid = column // tiles_m
    offs_n = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)  # [n]
    mask_n = offs_n < size_n  # [n]
    offs_m = pid_m * BLOCK_N + tl.arange(0, BLOCK_N)  # [m]
    mask_m = offs_m < size_m  # [m]
    i_p = pid
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [n, m]
    for start_k in range(0, size_q * size_k, BLOCK_K):
        offs_qk = start_k + tl.arange(0, BLOCK_K)  # [(q, k)]
        mask_k = offs_qk < size_q * size_k  # [(q, k)]
        offs_k = offs_qk % size_k  # [(q, k)]
        offs_q = offs_qk // size_k  # [(q, k)]
        AK_val = tl.load(AK_ptr + i_p * stride_AK_0 + offs_q * stride_AK_1, mask=mask_k, other=0)  # [(q, k)]
        B_val = tl.load(B_ptr + AK_val[None, :] * stride_B_0 + offs_k[None, :] * stride_B_1 + offs_n[:, None] * stride_B_2, mask=mask_n[:, None] & mask_k[None, :], other=0)  # [n, (q, k)]
        AV_val = tl.load(AV_ptr + i_p * stride_AV_0 + offs_q[:, None] * stride_AV_1 + offs_m[None, :] * stride_AV_2 + offs_k[:, None] * stride_AV_3, mask=mask_k[:, None] & mask_m[None, :], other=0)  # [(q, k), m]
        acc = tl.dot(B_val, AV_val, acc)  # [n, m]
    out_ptrs = C_ptr + i_p * stride_C_0 + offs_m[None, :] * stride_C_1 + offs_n[:, None] * stride_C_2  # [n, m]
    tl.store(out_ptrs, acc.to(C_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
