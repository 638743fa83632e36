import triton
import triton.language as tl


@triton.jit
def insum_kernel(
    # pointers
    C_ptr, AV_ptr, B_ptr, AM_ptr, AK_ptr,
    # extents
    size_p, size_m, size_n, size_q, size_k,
    # strides
    stride_C_0, stride_C_1, stride_C_2, stride_AV_0, stride_AV_1, stride_AV_2, stride_AV_3, stride_B_0, stride_B_1, stride_B_2, stride_AM_0, stride_AK_0, stride_AK_1,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[AM[p], m, n] += AV[p, q, m, k] * B[AK[p, q], k, n]

    kind: dot (tl.dot)
    tiles: M=m, K=k, N=n
    grid variables: p
    loop variables: q
    left (M, K): AV[p, q, m, k]
    right (K, N): B[AK[p, q], k, n]
    dot operands: fp32, tf32
    program order: groups of GROUP_M rows of (p, M tile), rows fastest
    accumulator: fp32
    output: atomic (tl.atomic_add: scattered contributions may collide)
    """
    stride_AV_0 = stride_AV_0 // 2 * 2  # (not multiples of 16: the vector width Triton cannot see)
    stride_AV_1 = stride_AV_1 // 2 * 2
    stride_C_0 = stride_C_0 // 2 * 2
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(size_m, BLOCK_M)
    tiles_n = tl.cdiv(size_n, BLOCK_N)
    rows = tiles_m * size_p
    tile = pid
    group = GROUP_M * tiles_n
    first_m = (tile // group) * GROUP_M
    group_rows = tl.minimum(rows - first_m, GROUP_M)
    row = first_m + (tile % group) % group_rows
    pid_n = (tile % group) // group_rows
    pid_m = row % tiles_m
    pid = row // tiles_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [m]
    mask_m = offs_m < size_m  # [m]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [n]
    mask_n = offs_n < size_n  # [n]
    i_p = pid
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [m, n]
    steps_k = tl.cdiv(size_k, BLOCK_K)
    for step in range(0, size_q * steps_k):
        rest = step
        start_k = (rest % steps_k) * BLOCK_K
        rest = rest // steps_k
        i_q = rest
        offs_k = start_k + tl.arange(0, BLOCK_K)  # [k]
        mask_k = offs_k < size_k  # [k]
        AV_val = tl.load(AV_ptr + i_p * stride_AV_0 + i_q * stride_AV_1 + offs_m[:, None] * stride_AV_2 + offs_k[None, :] * stride_AV_3, mask=mask_m[:, None] & mask_k[None, :], other=0)  # [m, k]
        AK_val = tl.load(AK_ptr + i_p * stride_AK_0 + i_q * stride_AK_1)  # []
        B_val = tl.load(B_ptr + AK_val * stride_B_0 + offs_k[:, None] * stride_B_1 + offs_n[None, :] * stride_B_2, mask=mask_k[:, None] & mask_n[None, :], other=0)  # [k, n]
        acc = tl.dot(AV_val, B_val, acc, input_precision="tf32")  # [m, n]
    AM_val = tl.load(AM_ptr + i_p * stride_AM_0)  # []
    out_ptrs = C_ptr + AM_val * stride_C_0 + offs_m[:, None] * stride_C_1 + offs_n[None, :] * stride_C_2  # [m, n]
    tl.atomic_add(out_ptrs, acc.to(C_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :], sem="relaxed")
