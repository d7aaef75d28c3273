"""Triton kernels behind ``attnzoo.layers.fused``'s DeepSeek-V4 ops (``fused`` holds their torch references
and picks one): the hyper-connections' projection of the normed streams, their weights (pre, post, Sinkhorn
comb), the streams' collapse and mix, and the compressor's gated pooling. Rounding points as in
``fused_kernels``; importing this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnzoo.attention.kernels.common import next_pow2
from attnzoo.layers.fused_kernels import ROUND_OF, rounded


@triton.jit
def _hc_project_kernel(X, W, OUT, T, K, K_SPLIT, stride_xt, stride_wn, stride_os, stride_ot, eps,
                       N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       FINAL: tl.constexpr):
    # BLOCK_M rows of x [T, K] over one K_SPLIT-wide slice, read once: their product with W [N, K] and their sum
    # of squares in column N. tf32x3 (three TF32 tensor-core products) keeps float32's accuracy at tensor-core
    # speed; float32 FMAs made this kernel compute-bound, far from reading x at memory speed. FINAL (one slice): scaled by rsqrt(mean(x^2) + eps) and
    # stored as [T, N]; else the partial [T, N + 1] of this slice, summed by the caller. K_SPLIT is a runtime
    # value: the split follows T, and a constexpr would compile a kernel per prefill size.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < T
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    k0 = tl.program_id(1) * K_SPLIT
    for kk in range(0, K_SPLIT, BLOCK_K):
        k = k0 + kk + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xt + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(W + n[None, :] * stride_wn + k[:, None], mask=(n < N)[None, :] & k_ok[:, None], other=0.0)
        ss += tl.sum(x * x, axis=1)
        acc += tl.dot(x, w, input_precision="tf32x3")
    if FINAL:
        y = acc * tl.rsqrt(ss / K + eps)[:, None]
        tl.store(OUT + rows[:, None] * stride_ot + n[None, :], y, mask=r_ok[:, None] & (n < N)[None, :])
    else:
        y = tl.where(n[None, :] == N, ss[:, None], acc)
        tl.store(OUT + tl.program_id(1) * stride_os + rows[:, None] * stride_ot + n[None, :], y,
                 mask=r_ok[:, None] & (n <= N)[None, :])


def hc_project(streams, fn, eps: float, *, splits: int | None = None):
    """streams [T, n, H] -> float32 [T, M] = rms_norm(streams as [T, n H], float32) @ fn.T, fn [M, n H] float32.

    ``splits``: K slices (None: enough programs for the GPU at few rows); more than one leaves a partial per
    slice, summed here in a fixed order (no atomics: the same bits every run)."""
    t, k = streams.shape[0], streams.shape[1] * streams.shape[2]
    x = streams.reshape(t, k)
    x = x if x.stride(-1) == 1 else x.contiguous()
    fn = fn.float().contiguous()
    m = fn.shape[0]
    block_m = 16 if t <= 256 else 64
    block_k = 128
    if splits is None:  # at few rows, K split until there are two programs per SM
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132  # CPU: an H100's
        splits = max(1, min(16, 2 * sms // triton.cdiv(max(t, 1), block_m), triton.cdiv(k, block_k)))
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_split)
    final = splits == 1
    out = torch.empty((t, m) if final else (splits, t, m + 1), dtype=torch.float32, device=streams.device)
    if t:
        _hc_project_kernel[(triton.cdiv(t, block_m), splits)](
            x, fn, out, t, k, k_split, x.stride(0), fn.stride(0), 0 if final else out.stride(0), out.stride(-2),
            float(eps), N=m, BLOCK_M=block_m, BLOCK_N=max(16, next_pow2(m + 1)), BLOCK_K=block_k,
            FINAL=final, num_warps=4)
    if final:
        return out
    total = out.sum(dim=0)
    return total[:, :m] * torch.rsqrt(total[:, m:] / k + eps)


@triton.jit
def _hc_weights_kernel(MIX, SCALE, BASE, PRE, POST, COMB, T, stride_m, eps, iters,
                       N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    # BLOCK_T rows of mixes -> pre, post [T, N] and comb [T, N, N] (fused.hc_weights_ref); NP = N padded to a
    # power of two, the padding masked out of every softmax and Sinkhorn sum.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    j = tl.arange(0, NP)
    m = r_ok[:, None] & (j < N)[None, :]
    s0, s1, s2 = tl.load(SCALE), tl.load(SCALE + 1), tl.load(SCALE + 2)
    row = MIX + rows.to(tl.int64)[:, None] * stride_m
    pre = tl.load(row + j[None, :], mask=m, other=0.0) * s0 + tl.load(BASE + j, mask=j < N, other=0.0)[None, :]
    tl.store(PRE + rows[:, None] * N + j[None, :], tl.sigmoid(pre) + eps, mask=m)
    post = tl.load(row + N + j[None, :], mask=m, other=0.0) * s1 + tl.load(BASE + N + j, mask=j < N, other=0.0)[None, :]
    tl.store(POST + rows[:, None] * N + j[None, :], 2 * tl.sigmoid(post), mask=m)
    a = tl.arange(0, NP)[:, None]
    b = tl.arange(0, NP)[None, :]
    ab_ok = (a < N) & (b < N)  # [NP, NP]
    off = 2 * N + a * N + b
    c = tl.load(row[:, :, None] + off[None, :, :], mask=r_ok[:, None, None] & ab_ok[None, :, :], other=0.0)
    c = c * s2 + tl.load(BASE + off, mask=ab_ok, other=0.0)[None, :, :]
    c = tl.where(ab_ok[None, :, :], c, -1e30)  # finite: a padding row's max is then no -inf (no inf - inf)
    e = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = tl.where(ab_ok[None, :, :], e / tl.sum(e, axis=2)[:, :, None] + eps, 0.0)
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    tl.store(COMB + rows[:, None, None] * (N * N) + (a * N + b)[None, :, :], c,
             mask=r_ok[:, None, None] & ab_ok[None, :, :])


def hc_weights(mixes, scale, base, n: int, iters: int, eps: float):
    """mixes [T, (2 + n) n] float32 -> (pre [T, n], post [T, n], comb [T, n, n]), float32."""
    mixes = mixes if mixes.stride(-1) == 1 else mixes.contiguous()
    t = mixes.shape[0]
    pre = torch.empty(t, n, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=mixes.device)
    if t:
        block_t = 32
        _hc_weights_kernel[(triton.cdiv(t, block_t),)](
            mixes, scale.float().contiguous(), base.float().contiguous(), pre, post, comb, t, mixes.stride(0),
            float(eps), int(iters), N=n, NP=next_pow2(n), BLOCK_T=block_t, num_warps=4)
    return pre, post, comb


@triton.jit
def _hc_streams_kernel(S, PRE, COMB, O, OUT, H, stride_st, stride_sn, stride_ot, stride_outt, stride_outn,
                       N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr, MIX: tl.constexpr,
                       ROUND: tl.constexpr):
    # One token's streams over BLOCK channels. MIX: OUT[k] = PRE[k] * O + sum_j COMB[j, k] S[j] with the
    # reference's rounding points (weights, product and matmul in bf16 when the streams are); else the collapse
    # OUT = sum_j PRE[j] S[j] in float32.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h_ok = h < H
    j = tl.arange(0, NP)
    m = (j < N)[:, None] & h_ok[None, :]
    s = tl.load(S + t * stride_st + j[:, None] * stride_sn + h[None, :], mask=m, other=0.0)  # [NP, BLOCK]
    pre = tl.load(PRE + t * N + j, mask=j < N, other=0.0)  # [NP]
    if MIX:
        a = tl.arange(0, NP)[:, None]
        b = tl.arange(0, NP)[None, :]
        comb = rounded(tl.load(COMB + t * (N * N) + a * N + b, mask=(a < N) & (b < N), other=0.0), ROUND)
        mixed = rounded(tl.sum(comb[:, :, None] * s.to(tl.float32)[:, None, :], axis=0), ROUND)  # [NP (k), BLOCK]
        o = tl.load(O + t * stride_ot + h, mask=h_ok, other=0.0)
        spread = rounded(rounded(pre, ROUND)[:, None] * o.to(tl.float32)[None, :], ROUND)
        new = spread + mixed
        tl.store(OUT + t * stride_outt + j[:, None] * stride_outn + h[None, :], new.to(OUT.dtype.element_ty), mask=m)
    else:
        x = tl.sum(pre[:, None] * s.to(tl.float32), axis=0)
        tl.store(OUT + t * stride_outt + h, x.to(OUT.dtype.element_ty), mask=h_ok)


def _hc_streams(streams, pre, comb, out):
    streams = streams if streams.stride(-1) == 1 else streams.contiguous()
    t, n, hidden = streams.shape
    block = min(512, next_pow2(hidden))
    mix = comb is not None
    res = torch.empty_like(streams) if mix else torch.empty(t, hidden, dtype=streams.dtype, device=streams.device)
    if t:
        o = out.contiguous() if mix else streams
        _hc_streams_kernel[(t, triton.cdiv(hidden, block))](
            streams, pre.float().contiguous(), comb.float().contiguous() if mix else pre, o, res, hidden,
            streams.stride(0), streams.stride(1), o.stride(0), res.stride(0), res.stride(1) if mix else 0,
            N=n, NP=next_pow2(n), BLOCK=block, MIX=mix,
            ROUND=ROUND_OF.get(streams.dtype, ""), num_warps=4)
    return res


def hc_collapse(streams, pre):
    """streams [T, n, H], pre [T, n] -> [T, H]."""
    return _hc_streams(streams, pre, None, None)


def hc_mix(streams, post, comb, out):
    """streams [T, n, H], post [T, n], comb [T, n, n], out [T, H] -> [T, n, H]."""
    return _hc_streams(streams, post, comb, out)


@triton.jit
def _gated_pool_kernel(ROWS, SLOTS, V, B, OUT, SPAN, D, W, R, stride_r, stride_b,
                       SP: tl.constexpr, BLOCK_D: tl.constexpr, OVERLAP: tl.constexpr, ROUND: tl.constexpr):
    # One block's BLOCK_D channels: its whole span at once (SP = SPAN padded to a power of two), each span
    # position's state row read where the pool keeps it. With OVERLAP the previous block's positions (j < R)
    # read the first D channels of kv, gate and bias, this block's the next D.
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, SP)
    ok = (j < SPAN) & (tl.load(V + n * SPAN + j, mask=j < SPAN, other=0) != 0)
    m = ok[:, None] & (d < D)[None, :]
    row = tl.load(SLOTS + n * SPAN + j, mask=j < SPAN, other=0).to(tl.int64)
    if OVERLAP:
        half = (j >= R).to(tl.int32)
    else:
        half = tl.zeros([SP], dtype=tl.int32)
    col = (half * D)[:, None] + d[None, :]
    at = ROWS + row[:, None] * stride_r + col
    g = tl.load(at + W, mask=m, other=0.0).to(tl.float32)
    g = g + tl.load(B + (j - half * R)[:, None] * stride_b + col, mask=m, other=0.0)
    g = tl.where(m, g, -1e30)  # finite: a padding channel's max is then no -inf (no inf - inf)
    e = tl.exp(g - tl.max(g, axis=0)[None, :])
    kv = tl.load(at, mask=m, other=0.0)
    w = rounded(e / tl.sum(e, axis=0)[None, :], ROUND)
    prod = rounded(kv.to(tl.float32) * w, ROUND)
    tl.store(OUT + n * D + d, tl.sum(prod, axis=0).to(OUT.dtype.element_ty), mask=d < D)


def gated_pool(rows, slots, valid, bias, dim, rate, overlap):
    """rows [S, 2W] (unit channel stride), slots and valid [n, span], bias [rate, W] -> [n, dim] in rows' dtype."""
    n, span = slots.shape
    width = rows.shape[1] // 2
    slots, valid, bias = slots.contiguous(), valid.to(torch.int8).contiguous(), bias.float().contiguous()
    out = torch.empty(n, dim, dtype=rows.dtype, device=rows.device)
    sp = next_pow2(span)
    block_d = max(16, min(128, next_pow2(dim), 8192 // sp))
    if n:
        _gated_pool_kernel[(n, triton.cdiv(dim, block_d))](
            rows, slots, valid, bias, out, span, dim, width, rate, rows.stride(0), bias.stride(0), SP=sp,
            BLOCK_D=block_d, OVERLAP=overlap, ROUND=ROUND_OF.get(rows.dtype, ""), num_warps=4)
    return out
