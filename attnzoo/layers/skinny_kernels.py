"""Triton kernel behind ``attnzoo.layers.skinny``: y = x W^T (+ b) for a few rows of x.

Decode at batch 1-16 is bound by reading W once. Each program owns ``BLOCK_N`` output features and
streams their rows of W over the whole K (no split-K, so no second reduction kernel); the few rows of x
are padded to the tile's ``block_m`` (16) in registers so the product runs on tensor cores, as x W^T or
as W x^T (``swap``: W's rows on the tensor cores' 64-deep side, the faster at 2-16 rows on narrow
projections). A gated MLP's gate_up projection can end in its activation (act(gate) * up), one launch
instead of two. A second grid axis runs one such
projection per head (``batched``: MLA's per-head absorptions, W [H, N, K] of any strides). Importing this
module imports triton; on a CPU it runs only under Triton's interpreter.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from attnzoo import pdl
from attnzoo.attention.kernels.common import l2_prefetch, prior_done
from attnzoo.layers.fused_kernels import ACTIVATIONS, ROUND_OF, rounded, tanh

BLOCK_M = 16  # the fewest rows of x a program multiplies, padded (tensor-core tiles are 16 deep)
# Bytes of W a program asks L2 for before it waits: more queued ahead of the stream slowed it, and the gated
# gate_up launch (several waves of programs) gained nothing (benchmarks/skinny_prefetch.py).
PREFETCH_BUDGET = 16 * 1024


class Config(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int
    block_m: int = BLOCK_M  # rows of x a program holds (all of them: W is read once)
    swap: bool = False  # the product as W x^T, so that W's rows fill the tensor cores' wide side


@triton.jit
def _mac(acc, x, w, SWAP: tl.constexpr):
    """acc + x w^T, or its transpose (acc [N, M]) under SWAP."""
    if SWAP:
        acc += tl.dot(w, tl.trans(x), input_precision="ieee")
    else:
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    return acc


@triton.jit
def _skinny_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   stride_xh, stride_wh, stride_wk, stride_yh,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, F32_DOT: tl.constexpr,
                   GATED: tl.constexpr, ACT: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr,
                   PREFETCH: tl.constexpr, SWAP: tl.constexpr = False):
    # GATED: W [2N, K] is gate rows then up rows, and the output act(gate) * up, rounded as the two-kernel path
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # int64: heads of a large W pass 2**31 elements
    X += head * stride_xh
    W += head * stride_wh
    Y += head * stride_yh
    rn = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # int64: a vocabulary-sized W passes 2**31 elements
    if PDL and PREFETCH > 0:
        # Launched early by PDL, the programs ask for the start of their rows of W while the kernel before runs
        # (norms, attention: too short to use the bandwidth), so that the stream below starts from L2.
        rows = W + tl.minimum(rn, N - 1) * stride_wn
        l2_prefetch(rows, PREFETCH)
    prior_done(PDL)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    x_ptr = X + rm[:, None] * stride_xm + rk[None, :]
    w_ptr = W + rn[:, None] * stride_wn + rk[None, :] * stride_wk  # a stride of 1 is specialized: plain W loads stay vectorised
    up_ptr = w_ptr + N * stride_wn
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:  # N and K whole tiles: unmasked, vectorised loads of W
            w = tl.load(w_ptr)
            x = tl.load(x_ptr, mask=rm[:, None] < M, other=0.0)
            if GATED:
                wu = tl.load(up_ptr)
        else:
            w_ok = (rn[:, None] < N) & ((k0 + rk) < K)[None, :]
            w = tl.load(w_ptr, mask=w_ok, other=0.0)
            x = tl.load(x_ptr, mask=(rm[:, None] < M) & ((k0 + rk) < K)[None, :], other=0.0)
            if GATED:
                wu = tl.load(up_ptr, mask=w_ok, other=0.0)
        if F32_DOT:  # float32 weights; the interpreter, whose dot reads bfloat16 as raw integers
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = _mac(acc, x, w, SWAP)
        if GATED:
            if F32_DOT:
                wu = wu.to(tl.float32)
            acc_up = _mac(acc_up, x, wu, SWAP)
            up_ptr += BLOCK_K * stride_wk
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K * stride_wk
    if SWAP:
        acc, acc_up = tl.trans(acc), tl.trans(acc_up)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(B + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        g = rounded(acc, ROUND)
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))
        else:
            a = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
        acc = rounded(a, ROUND) * rounded(acc_up, ROUND)
    acc = rounded(acc, ROUND)  # to nearest, also under the interpreter, whose casts truncate
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def prefetch_bytes(weight: torch.Tensor, block_n: int, budget: int) -> int:
    """Bytes of each of a program's ``block_n`` rows of ``weight`` it prefetches (``budget`` bytes a program, at
    most a row; 0 where a row does not start on 16 bytes, which the bulk prefetch needs)."""
    row = weight.shape[1] * weight.element_size()
    if weight.data_ptr() % 16 or (weight.stride(0) * weight.element_size()) % 16 or budget <= 0:
        return 0
    return min(row, budget // block_n) // 16 * 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, config: Config,
           act: str | None = None, prefetch: int = PREFETCH_BUDGET) -> torch.Tensor:
    """x [M, K] (M <= ``config.block_m``, unit stride along K), weight [N, K] contiguous, bias [N] or None ->
    [M, N] in x's dtype.
    ``act`` ("silu", "gelu_tanh"): weight is [2I, K] (gate rows, then up rows) and the result act(gate) * up
    [M, I], ``config.block_n`` rows of each per program. ``prefetch``: bytes of W each program of a plain
    projection asks L2 for before it waits on the kernel before it (PDL launches only)."""
    m, k = x.shape
    if m > config.block_m:
        raise ValueError(f"the skinny kernel's tile holds {config.block_m} rows, got {m}: pick a config by the rows")
    n = weight.shape[0] if act is None else weight.shape[0] // 2
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    c = config
    even = n % c.block_n == 0 and k % c.block_k == 0
    grid = triton.cdiv(n, c.block_n)
    _skinny_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        0, 0, 1, 0, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, HAS_BIAS=bias is not None, EVEN=even,
        F32_DOT=weight.dtype == torch.float32 or not x.is_cuda, GATED=act is not None, ACT=ACTIVATIONS.get(act, 0),
        ROUND=ROUND_OF.get(y.dtype, ""),
        PREFETCH=0 if act else prefetch_bytes(weight, c.block_n, prefetch), SWAP=c.swap,
        num_warps=c.warps, num_stages=c.stages, **pdl.launch_args(x, grid))
    return y


def batched(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, config: Config) -> torch.Tensor:
    """out[:, h] = x[:, h] @ weight[h]^T for every head h: x [M, H, K] (M <= ``config.block_m``, unit stride along K), weight
    [H, N, K] of any strides (MLA's W_UK is read along N), out [M, H, N] with unit stride along N (a view into
    a larger buffer allowed). One launch, a program per (block of N, head)."""
    m, h, k = x.shape
    n = weight.shape[1]
    c = config
    if m > c.block_m or x.stride(2) != 1 or out.stride(2) != 1 or out.shape != (m, h, n):
        raise ValueError(f"batched: at most {c.block_m} rows with unit strides along K and N and out [{m}, {h}, {n}], "
                         f"got x {tuple(x.shape)} strides {x.stride()}, out {tuple(out.shape)} strides {out.stride()}")
    even = n % c.block_n == 0 and k % c.block_k == 0
    grid = (triton.cdiv(n, c.block_n), h)
    _skinny_kernel[grid](
        x, weight, weight, out, m, n, k, x.stride(0), weight.stride(1), out.stride(0),
        x.stride(1), weight.stride(0), weight.stride(2), out.stride(1),
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, HAS_BIAS=False, EVEN=even,
        F32_DOT=weight.dtype == torch.float32 or not x.is_cuda, GATED=False, ACT=0, ROUND=ROUND_OF.get(out.dtype, ""),
        PREFETCH=0, SWAP=c.swap, num_warps=c.warps, num_stages=c.stages, **pdl.launch_args(x, grid[0] * grid[1]))
    return out
