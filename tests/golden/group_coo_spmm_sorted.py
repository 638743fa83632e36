import triton
import triton.language as tl


@triton.jit
def _segment_add(key_a, acc_a, key_b, acc_b):
    """Segmented sum: b adds a's running sum when both lanes belong to one output row."""
    return key_b, acc_b + tl.where(key_a == key_b, acc_a, 0)


@triton.jit
def insum_kernel(
    # pointers
    C_ptr, AV_ptr, B_ptr, AM_ptr, AK_ptr,
    # extents
    size_p, size_n, size_q,
    # strides
    stride_C_0, stride_C_1, stride_AV_0, stride_AV_1, stride_B_0, stride_B_1, stride_AM_0, stride_AK_0, stride_AK_1,
    # meta-parameters
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """C[AM[p], n] += AV[p, q] * B[AK[p, q], n]

    kind: reduce (broadcast multiply, tl.sum)
    tiles: M=p, K=q, N=n
    grid variables: -
    loop variables: -
    accumulator: fp32
    output: segment (sorted scatter index: equal rows summed in registers, one tl.atomic_add per segment)
    """
    pid = tl.program_id(0)
    pid_n = pid % tl.cdiv(size_n, BLOCK_N)
    pid = pid // tl.cdiv(size_n, BLOCK_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [n]
    mask_n = offs_n < size_n  # [n]
    pid_p = pid
    offs_p = pid_p * BLOCK_M + tl.arange(0, BLOCK_M)  # [p]
    mask_p = offs_p < size_p  # [p]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [p, n]
    for start_q in range(0, size_q, BLOCK_K):
        offs_q = start_q + tl.arange(0, BLOCK_K)  # [q]
        mask_q = offs_q < size_q  # [q]
        AV_val = tl.load(AV_ptr + offs_p[:, None] * stride_AV_0 + offs_q[None, :] * stride_AV_1, mask=mask_p[:, None] & mask_q[None, :], other=0)  # [p, q]
        AK_val = tl.load(AK_ptr + offs_p[:, None] * stride_AK_0 + offs_q[None, :] * stride_AK_1, mask=mask_p[:, None] & mask_q[None, :], other=0)  # [p, q]
        B_val = tl.load(B_ptr + AK_val[:, :, None] * stride_B_0 + offs_n[None, None, :] * stride_B_1, mask=mask_p[:, None, None] & mask_q[None, :, None] & mask_n[None, None, :], other=0)  # [p, q, n]
        prod = AV_val[:, :, None].to(tl.float32) * B_val.to(tl.float32)  # [p, q, n]
        partial = tl.sum(prod, axis=1)  # [p, n]
        acc += partial  # [p, n]
    AM_val = tl.load(AM_ptr + offs_p * stride_AM_0, mask=mask_p, other=0)  # [p]
    out_ptrs = C_ptr + AM_val[:, None] * stride_C_0 + offs_n[None, :] * stride_C_1  # [p, n]
    seg_key = tl.where(mask_p, AM_val, -1)  # [p]
    next_key = tl.load(AM_ptr + (offs_p + 1) * stride_AM_0, mask=offs_p + 1 < size_p, other=-1)  # [p]
    seg_tail = (next_key != seg_key) | (tl.arange(0, BLOCK_M) == BLOCK_M - 1)  # [p]
    _, acc = tl.associative_scan((tl.broadcast_to(seg_key[:, None], (BLOCK_M, BLOCK_N)), acc), 0, _segment_add)  # [p, n]
    tl.atomic_add(out_ptrs, acc.to(C_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_n[None, :] & seg_tail[:, None], sem="relaxed")
