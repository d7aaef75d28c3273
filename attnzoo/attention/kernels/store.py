"""Writing a step's new k/v into the paged pool at their slots (``slot = page * page_size + offset``).

One program per (token, KV head) copies that head's key row and, in the same program, its value row:
one launch per layer instead of the two scatter kernels (plus index arithmetic) of torch indexing.
Destinations are addressed through the pool views' strides, so MLA's strided value view and NSA's
indexer keys (one "head") go through the same kernel.

An fp8 (e4m3) cache stores row / scale, saturated to +-448 and rounded to nearest even (NaN kept), as
``kv_cache.quantize_fp8`` does on the CPU.

With ``rope`` (``store_rope.RoPE``), the same launch applies RoPE first (``fused.rope``'s arithmetic: float32,
rounded to the rows' dtype): the keys are rotated before they are stored, and written back rotated, and the query's
heads, a program each, are rotated in place. A decode step then spends one launch, not two, between the QKV
projection and attention.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnzoo import pdl
from attnzoo.attention.kernels.common import next_pow2, prior_done
from attnzoo.attention.kernels.codec import fp8_bytes
from attnzoo.attention.store_rope import RoPE
from attnzoo.layers.fused_kernels import rope_tile
from attnzoo.errors import BackendError


@triton.jit
def _cache_value(x, inv_scale, FP8: tl.constexpr, CACHE):
    # bytes by integer arithmetic into a uint8 view: the interpreter's fp8 casts mis-round and lose NaN
    if FP8:
        x = fp8_bytes(x.to(tl.float32) * inv_scale)
    return x.to(CACHE.dtype.element_ty)


@triton.jit
def _store_kernel(
    SLOTS, K, V, K_CACHE, V_CACHE, Q, COS, SIN,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cp, stride_ch, stride_cs, stride_cd,
    stride_dp, stride_dh, stride_ds, stride_dd,
    stride_qt, stride_qh, stride_ct,
    k_inv_scale, v_inv_scale,
    PAGE_SIZE: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_V: tl.constexpr,
    FP8: tl.constexpr,
    HEADS: tl.constexpr,  # KV heads: programs past them (ROPE only) rotate a query head each
    Q_HEADS: tl.constexpr,
    ROPE: tl.constexpr,
    HALF: tl.constexpr,  # rotary pairs of a head (its first 2 HALF channels rotate)
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PDL: tl.constexpr,
):
    prior_done(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    t64 = t.to(tl.int64)
    if ROPE:  # a query head (the programs past the KV heads) or this key head rotated in place
        if h >= HEADS:
            rope_tile(Q, Q, COS, SIN, Q, t64, h - HEADS, stride_qt, stride_qh, 0, 0, stride_ct, 0.0, 0.0,
                      Q_HEADS, K_DIM, HALF, HALF_PAD, 0, 1, INTERLEAVED, False, False, True, False, True)
            return
        rope_tile(K, K, COS, SIN, K, t64, h, stride_kt, stride_kh, 0, 0, stride_ct, 0.0, 0.0,
                  HEADS, K_DIM, HALF, HALF_PAD, 0, 1, INTERLEAVED, False, False, True, False, True)
        tl.debug_barrier()  # the row is read back below by other threads than the ones that wrote it
    slot = tl.load(SLOTS + t).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    offs_k = tl.arange(0, BLOCK_K)
    k = tl.load(K + t64 * stride_kt + h * stride_kh + offs_k * stride_kd, mask=offs_k < K_DIM)
    dst = K_CACHE + page * stride_cp + h * stride_ch + off * stride_cs + offs_k * stride_cd
    tl.store(dst, _cache_value(k, k_inv_scale, FP8, K_CACHE), mask=offs_k < K_DIM)
    if HAS_V:
        offs_v = tl.arange(0, BLOCK_V)
        v = tl.load(V + t64 * stride_vt + h * stride_vh + offs_v * stride_vd, mask=offs_v < V_DIM)
        dst_v = V_CACHE + page * stride_dp + h * stride_dh + off * stride_ds + offs_v * stride_dd
        tl.store(dst_v, _cache_value(v, v_inv_scale, FP8, V_CACHE), mask=offs_v < V_DIM)


def store_kv(
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim]
    v: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, v_head_dim]
    v_cache: torch.Tensor | None = None,  # [num_pages, num_kv_heads, page_size, v_head_dim]
    *,
    k_scale: float = 1.0,  # fp8 caches: what is stored is k / k_scale
    v_scale: float = 1.0,
    rope: RoPE | None = None,  # q [T, H, head_dim] and k rotated in place first, by cos/sin [T, R] float32
) -> None:
    """cache[slot // page_size, :, slot % page_size] = row, for k (and v), cast to the cache dtype
    (quantized by the scale for an fp8 cache). With ``rope``: k's and q's first R channels are rotated first, in
    place (``fused.rope``'s RoPE, interleaved or not), and the rotated keys stored."""
    num_tokens, heads, k_dim = k.shape
    if rope is not None and (problem := rope.problem(k, v)):
        raise BackendError(f"store with RoPE: {problem}",
                           fix="pass q [tokens, heads, head_dim] and k with unit-stride channels, apart from each "
                               "other and from v, and float32 cos/sin [tokens, R] with R even, at most head_dim")
    rotate = rope is not None
    q, cos, sin = (rope.q, rope.cos, rope.sin) if rotate else (None, None, None)
    if k_cache.dim() != 4 or k_cache.shape[1] != heads or k_cache.shape[3] != k_dim:
        raise BackendError(f"store: k {tuple(k.shape)} does not fit the cache {tuple(k_cache.shape)}",
                           fix="pass [tokens, kv_heads, head_dim] rows for this layer's cache")
    if slot_mapping.shape[0] != num_tokens:
        raise BackendError(f"store: {slot_mapping.shape[0]} slots for {num_tokens} tokens",
                           fix="pass one slot per new token (BatchMetadata.slot_mapping)")
    has_v = v is not None
    if has_v:
        if v_cache is None or v.shape[:2] != k.shape[:2] or v_cache.shape[:3] != k_cache.shape[:3] \
                or v_cache.shape[3] != v.shape[2]:
            raise BackendError(f"store: v {tuple(v.shape)} does not fit the cache "
                               f"{None if v_cache is None else tuple(v_cache.shape)}",
                               fix="pass [tokens, kv_heads, v_head_dim] rows and the layer's v cache")
    if num_tokens == 0:
        return
    v_arg, vc_arg = (v, v_cache) if has_v else (k, k_cache)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if vc_arg.dtype != k_cache.dtype:
        raise BackendError(f"store: the k cache is {k_cache.dtype} and the v cache {vc_arg.dtype}",
                           fix="pass the k and v views of one pool (one dtype)")
    if fp8:  # the kernel writes the bytes (fp8_bytes)
        k_cache, vc_arg = k_cache.view(torch.uint8), vc_arg.view(torch.uint8)
    if rotate and (cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    q_arg, cos_arg, sin_arg = (q, cos, sin) if rotate else (k, k, k)  # unread without RoPE
    half = cos.shape[1] // 2 if rotate else 0
    _store_kernel[(num_tokens, heads + (q.shape[1] if rotate else 0))](
        slot_mapping, k, v_arg, k_cache, vc_arg, q_arg, cos_arg, sin_arg,
        *k.stride(), *v_arg.stride(), *k_cache.stride(), *vc_arg.stride(), q_arg.stride(0), q_arg.stride(1),
        cos_arg.stride(0),
        1.0 / k_scale, 1.0 / v_scale,
        PAGE_SIZE=k_cache.shape[2], K_DIM=k_dim, V_DIM=v_arg.shape[2],
        BLOCK_K=next_pow2(k_dim), BLOCK_V=next_pow2(v_arg.shape[2]), HAS_V=has_v,
        FP8=fp8, HEADS=heads, Q_HEADS=q.shape[1] if rotate else 0, ROPE=rotate, HALF=half,
        HALF_PAD=max(16, next_pow2(half)), INTERLEAVED=rotate and rope.interleaved,
        num_warps=1 if max(k_dim, v_arg.shape[2]) <= 256 else 2, **pdl.launch_args(k),
    )


def store_rows(
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    rows: torch.Tensor,  # [num_tokens, dim]
    cache: torch.Tensor,  # [num_pages, page_size, dim]: a cache without a head axis (NSA indexer keys)
) -> None:
    store_kv(slot_mapping, rows.unsqueeze(1), cache.unsqueeze(1))
