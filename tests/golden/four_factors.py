import triton
import triton.language as tl


@triton.jit
def insum_kernel(
    # pointers
    Z_ptr, CV_ptr, X_ptr, Y_ptr, W_ptr, CK_ptr, CI_ptr, CJ_ptr,
    # extents
    size_b, size_w, size_p, size_q, size_u, size_v,
    # strides
    stride_Z_0, stride_Z_1, stride_Z_2, stride_CV_0, stride_CV_1, stride_X_0, stride_X_1, stride_X_2, stride_Y_0, stride_Y_1, stride_Y_2, stride_W_0, stride_W_1, stride_W_2, stride_CK_0, stride_CI_0, stride_CI_1, stride_CJ_0, stride_CJ_1,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Z[b, w, CK[p]] += CV[p, q] * X[b, u, CI[p, q]] * Y[b, v, CJ[p, q]] * W[u, v, w]

    kind: dot (tl.dot)
    tiles: M=b, K=u, N=w
    grid variables: p
    loop variables: q, v
    left (M, K): CV[p, q] * X[b, u, CI[p, q]] * Y[b, v, CJ[p, q]]
    right (K, N): W[u, v, w]
    dot operands: fp32, tf32
    program order: groups of GROUP_M rows of (p, M tile), rows fastest
    accumulator: fp32
    output: atomic (tl.atomic_add: scattered contributions may collide)
    """
    stride_W_0 = stride_W_0 // 2 * 2  # (not multiples of 16: the vector width Triton cannot see)
    stride_X_0 = stride_X_0 // 4 * 4
    stride_X_1 = stride_X_1 // 4 * 4
    stride_Y_0 = stride_Y_0 // 2 * 2
    stride_Z_0 = stride_Z_0 // 4 * 4
    stride_Z_1 = stride_Z_1 // 4 * 4
    pid = tl.program_id(0)
    tiles_b = tl.cdiv(size_b, BLOCK_M)
    tiles_w = tl.cdiv(size_w, BLOCK_N)
    rows = tiles_b * size_p
    tile = pid
    group = GROUP_M * tiles_w
    first_b = (tile // group) * GROUP_M
    group_rows = tl.minimum(rows - first_b, GROUP_M)
    row = first_b + (tile % group) % group_rows
    pid_w = (tile % group) // group_rows
    pid_b = row % tiles_b
    pid = row // tiles_b
    offs_b = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)  # [b]
    mask_b = offs_b < size_b  # [b]
    offs_w = pid_w * BLOCK_N + tl.arange(0, BLOCK_N)  # [w]
    mask_w = offs_w < size_w  # [w]
    i_p = pid
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [b, w]
    steps_u = tl.cdiv(size_u, BLOCK_K)
    for step in range(0, size_q * size_v * steps_u):
        rest = step
        start_u = (rest % steps_u) * BLOCK_K
        rest = rest // steps_u
        i_v = rest % size_v
        rest = rest // size_v
        i_q = rest
        offs_u = start_u + tl.arange(0, BLOCK_K)  # [u]
        mask_u = offs_u < size_u  # [u]
        CV_val = tl.load(CV_ptr + i_p * stride_CV_0 + i_q * stride_CV_1)  # []
        CI_val = tl.load(CI_ptr + i_p * stride_CI_0 + i_q * stride_CI_1)  # []
        X_val = tl.load(X_ptr + offs_b[:, None] * stride_X_0 + offs_u[None, :] * stride_X_1 + CI_val * stride_X_2, mask=mask_b[:, None] & mask_u[None, :], other=0)  # [b, u]
        CJ_val = tl.load(CJ_ptr + i_p * stride_CJ_0 + i_q * stride_CJ_1)  # []
        Y_val = tl.load(Y_ptr + offs_b * stride_Y_0 + i_v * stride_Y_1 + CJ_val * stride_Y_2, mask=mask_b, other=0)  # [b]
        lhs = CV_val.to(tl.float32) * X_val.to(tl.float32) * Y_val[:, None].to(tl.float32)  # [b, u]
        W_val = tl.load(W_ptr + offs_u[:, None] * stride_W_0 + i_v * stride_W_1 + offs_w[None, :] * stride_W_2, mask=mask_u[:, None] & mask_w[None, :], other=0)  # [u, w]
        acc = tl.dot(lhs, W_val, acc, input_precision="tf32")  # [b, w]
    CK_val = tl.load(CK_ptr + i_p * stride_CK_0)  # []
    out_ptrs = Z_ptr + offs_b[:, None] * stride_Z_0 + offs_w[None, :] * stride_Z_1 + CK_val * stride_Z_2  # [b, w]
    tl.atomic_add(out_ptrs, acc.to(Z_ptr.dtype.element_ty), mask=mask_b[:, None] & mask_w[None, :], sem="relaxed")
