"""Triton kernels of the FP8 block-scaled layers (``attnzoo/layers/fp8.py`` imports this module on first
use, so CPU-only installs load FP8 checkpoints without triton; on CPU the interpreter must be chosen
first).

* ``quant_groups``: activation groups (one per tile row) -> e4m3 bytes and their scales (shared with the
  fused MoE's act-and-quantize kernel, so every FP8 activation is quantized by the same code);
* ``act_quant_kernel``: per-token-group activation quantization;
* ``block_matmul_kernel``: the w8a8 GEMM with 1x128 activation and 128x128 weight block scales.
"""
import triton
import triton.language as tl

# float32 -> e4m3 bytes with integer arithmetic: the interpreter's cast drops the rounding carry.
from attnzoo.attention.kernels.codec import fp8_bytes


@triton.jit
def quant_groups(x, MIN_AMAX: tl.constexpr, UE8M0: tl.constexpr):
    # x [G, GROUP] float32, one group per row. As fp8.act_quant_reference: scale = max(amax, MIN_AMAX) / 448
    # (a power of two, rounded up, under UE8M0), IEEE divisions, bytes rounded to nearest even and
    # saturated at +-448. -> (bytes [G, GROUP], scales [G]).
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), 448.0)
    if UE8M0:
        s = tl.exp2(tl.ceil(tl.log2(s)))
    return fp8_bytes(tl.math.div_rn(x, s[:, None])), s


@triton.jit
def act_quant_kernel(X, Y, S, K, stride_xm, stride_ym, stride_sm, stride_sg,
                     GROUP: tl.constexpr, GROUPS: tl.constexpr, UE8M0: tl.constexpr, MIN_AMAX: tl.constexpr):
    # Groups [program_id(1) * GROUPS, + GROUPS) of one row. Y holds bytes (a uint8 view of the float8 output).
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < K  # masked channels are 0 and do not move a group's maximum
    x = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    y, s = quant_groups(x, MIN_AMAX, UE8M0)
    tl.store(Y + row * stride_ym + offs, y, mask=mask)
    tl.store(S + row * stride_sm + g * stride_sg, s, mask=g * GROUP < K)


@triton.jit
def block_matmul_kernel(
    A, B, C, AS, BS, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cs, stride_cm, stride_cn,
    stride_as_m, stride_as_k, stride_bs_n, stride_bs_k,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # One K tile is one scale group (BLOCK_K == GROUP_K): each tile's partial product is scaled
    # by one activation factor per row and one weight factor per column before accumulation.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order: GROUP_M row tiles share each weight tile while it is in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, GROUP_K), SPLIT_K):
        k = kt * GROUP_K + offs_k
        mask_k = k < K
        a = tl.load(A + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(B + offs_n[None, :] * stride_bn + k[:, None] * stride_bk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a_s = tl.load(AS + offs_m * stride_as_m + kt * stride_as_k, mask=mask_m, other=0.0)
        b_s = tl.load(BS + (offs_n // GROUP_N) * stride_bs_n + kt * stride_bs_k, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c = C + pid_k * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
