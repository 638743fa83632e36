import triton
import triton.language as tl


@triton.jit
def insum_kernel(
    # pointers
    C_ptr, AV_ptr, B_ptr, AK_ptr,
    # extents
    size_rb, size_l, size_n, size_u,
    # strides
    stride_C_0, stride_C_1, stride_C_2, stride_AV_0, stride_AV_1, stride_AV_2, stride_B_0, stride_B_1, stride_AK_0, stride_AK_1,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[rb, l, n] = AV[rb, l, u] * B[AK[rb, u], n]

    kind: dot (tl.dot)
    tiles: M=l, K=u, N=n
    grid variables: rb
    loop variables: -
    left (M, K): AV[rb, l, u]
    right (K, N): B[AK[rb, u], n]
    dot operands: fp32, ieee
    program order: groups of GROUP_M rows of (rb, M tile), rows fastest
    accumulator: fp32
    output: store (one owner per element)
    """
    pid = tl.program_id(0)
    tiles_l = tl.cdiv(size_l, BLOCK_M)
    tiles_n = tl.cdiv(size_n, BLOCK_N)
    rows = tiles_l * size_rb
    tile = pid
    group = GROUP_M * tiles_n
    first_l = (tile // group) * GROUP_M
    group_rows = tl.minimum(rows - first_l, GROUP_M)
    row = first_l + (tile % group) % group_rows
    pid_n = (tile % group) // group_rows
    pid_l = row % tiles_l
    pid = row // tiles_l
    offs_l = pid_l * BLOCK_M + tl.arange(0, BLOCK_M)  # [l]
    mask_l = offs_l < size_l  # [l]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [n]
    mask_n = offs_n < size_n  # [n]
    i_rb = pid
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [l, n]
    for start_u in range(0, size_u, BLOCK_K):
        offs_u = start_u + tl.arange(0, BLOCK_K)  # [u]
        mask_u = offs_u < size_u  # [u]
        AV_val = tl.load(AV_ptr + i_rb * stride_AV_0 + offs_l[:, None] * stride_AV_1 + offs_u[None, :] * stride_AV_2, mask=mask_l[:, None] & mask_u[None, :], other=0)  # [l, u]
        AK_val = tl.load(AK_ptr + i_rb * stride_AK_0 + offs_u * stride_AK_1, mask=mask_u, other=0)  # [u]
        B_val = tl.trans(tl.load(B_ptr + AK_val[None, :] * stride_B_0 + offs_n[:, None] * stride_B_1, mask=mask_n[:, None] & mask_u[None, :], other=0))  # [u, n]
        acc = tl.dot(AV_val, B_val, acc, input_precision="ieee")  # [l, n]
    out_ptrs = C_ptr + i_rb * stride_C_0 + offs_l[:, None] * stride_C_1 + offs_n[None, :] * stride_C_2  # [l, n]
    tl.store(out_ptrs, acc.to(C_ptr.dtype.element_ty), mask=mask_l[:, None] & mask_n[None, :])
