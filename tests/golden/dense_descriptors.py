import triton
import triton.language as tl


@triton.jit
def insum_kernel(
    # pointers
    C_ptr,
    # tensor descriptors (made on the host)
    A_desc, B_desc,
    # extents
    size_m, size_n, size_k,
    # strides
    stride_C_0, stride_C_1,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[m, n] = A[m, k] * B[k, n]

    kind: dot (tl.dot)
    tiles: M=m, K=k, N=n
    grid variables: -
    loop variables: -
    left (M, K): A[m, k]
    right (K, N): B[k, n]
    dot operands: fp16
    tensor descriptors: A[m, k], B[k, n]
    programs: persistent (one per SM, striding over the tiles)
    accumulator: fp32
    output: store (one owner per element)
    """
    for task in tl.range(tl.program_id(0), tl.cdiv(size_m, BLOCK_M) * tl.cdiv(size_n, BLOCK_N), tl.num_programs(0), flatten=True):
        pid = task
        tiles_m = tl.cdiv(size_m, BLOCK_M)
        tiles_n = tl.cdiv(size_n, BLOCK_N)
        tile = pid
        group = GROUP_M * tiles_n
        first_m = (tile // group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % group_rows
        pid_n = (tile % group) // group_rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [m]
        mask_m = offs_m < size_m  # [m]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [n]
        mask_n = offs_n < size_n  # [n]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [m, n]
        for start_k in range(0, size_k, BLOCK_K):
            A_val = A_desc.load([pid_m * BLOCK_M, start_k])  # [m, k]
            B_val = B_desc.load([start_k, pid_n * BLOCK_N])  # [k, n]
            acc = tl.dot(A_val, B_val, acc)  # [m, n]
        out_ptrs = C_ptr + offs_m[:, None] * stride_C_0 + offs_n[None, :] * stride_C_1  # [m, n]
        tl.store(out_ptrs, acc.to(C_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
