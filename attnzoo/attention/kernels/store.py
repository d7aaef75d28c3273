"""Writing a step's new k/v into the paged pool at their slots (``slot = page * page_size + offset``).

One program per (token, group of KV heads) copies those heads' key rows and, in the same program, their value
rows: one launch per layer instead of the two scatter kernels (plus index arithmetic) of torch indexing. A group is
one head while that leaves few programs (a batch-1 step's 40 programs of one head run side by side); a larger step
groups heads (``heads_per_program``), where a program per head took several times what its bytes take.
Destinations are addressed through the pool views' strides, so MLA's strided value view and NSA's
indexer keys (one "head") go through the same kernel.

An fp8 (e4m3) cache stores row / scale, saturated to +-448 and rounded to nearest even (NaN kept), as
``kv_cache.quantize_fp8`` does on the CPU.

With ``rope`` (``store_rope.RoPE``), the same launch applies RoPE first (``fused.rope``'s arithmetic: float32,
rounded to the rows' dtype): the keys are rotated before they are stored, and written back rotated, and the query's
heads, grouped alike in programs of their own, are rotated in place. A decode step then spends one launch, not two,
between the QKV projection and attention.
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

# Heads are grouped while at least this many programs (about four an SM of an H200) remain: on an H200 (CUDA-graph
# replays of the launch alone) its time went with its programs down to 8 heads a program (1319 tokens, 8 KV + 32
# query heads: 64 us one head a program, 8.7 us eight), while a batch-1 step's 40 programs took 1.3 us, 1.5 by 8.
MIN_PROGRAMS = 512
MAX_HEADS_PER_PROG = 8


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
    HEADS: tl.constexpr,  # KV heads: programs past theirs (ROPE only) rotate query heads
    Q_HEADS: tl.constexpr,
    ROPE: tl.constexpr,
    HALF: tl.constexpr,  # rotary pairs of a head (its first 2 HALF channels rotate)
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,  # a power of two; the last group of the KV (or query) heads masked past them
    PDL: tl.constexpr,
):
    prior_done(PDL)
    t = tl.program_id(0)
    g = tl.program_id(1)
    t64 = t.to(tl.int64)
    kv_groups: tl.constexpr = (HEADS + HEADS_PER_PROG - 1) // HEADS_PER_PROG
    h0 = g * HEADS_PER_PROG
    if ROPE:  # query heads (the programs past the KV heads' groups) or these key heads rotated in place
        if g >= kv_groups:
            rope_tile(Q, Q, COS, SIN, Q, t64, (g - kv_groups) * HEADS_PER_PROG, stride_qt, stride_qh, 0, 0,
                      stride_ct, 0.0, 0.0, Q_HEADS, K_DIM, HALF, HALF_PAD, 0, HEADS_PER_PROG, INTERLEAVED,
                      False, False, True, False, True)
            return
        rope_tile(K, K, COS, SIN, K, t64, h0, stride_kt, stride_kh, 0, 0, stride_ct, 0.0, 0.0,
                  HEADS, K_DIM, HALF, HALF_PAD, 0, HEADS_PER_PROG, INTERLEAVED, False, False, True, False, True)
        tl.debug_barrier()  # the rows are read back below by other threads than the ones that wrote them
    slot = tl.load(SLOTS + t).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    heads = (h0 + tl.arange(0, HEADS_PER_PROG))[:, None]
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    mask_k = (heads < HEADS) & (offs_k < K_DIM)
    k = tl.load(K + t64 * stride_kt + heads * stride_kh + offs_k * stride_kd, mask=mask_k)
    dst = K_CACHE + page * stride_cp + heads * stride_ch + off * stride_cs + offs_k * stride_cd
    tl.store(dst, _cache_value(k, k_inv_scale, FP8, K_CACHE), mask=mask_k)
    if HAS_V:
        offs_v = tl.arange(0, BLOCK_V)[None, :]
        mask_v = (heads < HEADS) & (offs_v < V_DIM)
        v = tl.load(V + t64 * stride_vt + heads * stride_vh + offs_v * stride_vd, mask=mask_v)
        dst_v = V_CACHE + page * stride_dp + heads * stride_dh + off * stride_ds + offs_v * stride_dd
        tl.store(dst_v, _cache_value(v, v_inv_scale, FP8, V_CACHE), mask=mask_v)


def _groups(heads: int, per_prog: int) -> int:
    return -(-heads // per_prog)


def _warps(heads_per_prog: int, width: int) -> int:
    # a warp per 512 elements of a grouped tile (8 heads of 256: 12 us on one warp, 9 us on four, at 1319 tokens)
    return min(4, max(1 if width <= 256 else 2, heads_per_prog * next_pow2(width) // 512))


def heads_per_program(num_tokens: int, heads: int, q_heads: int = 0) -> int:
    """Heads one program of ``_store_kernel`` takes: 1 (a program per token and head, what keeps a small step's
    launch short) unless there are programs to spare, then the largest power of two, at most MAX_HEADS_PER_PROG,
    that still leaves MIN_PROGRAMS programs, doubled only while that means fewer programs."""
    per_prog = 1
    # the constants read here, not bound as defaults: a driver that changes them changes the choice
    while per_prog < MAX_HEADS_PER_PROG:
        now = num_tokens * (_groups(heads, per_prog) + _groups(q_heads, per_prog))
        grouped = num_tokens * (_groups(heads, 2 * per_prog) + _groups(q_heads, 2 * per_prog))
        if grouped >= now or grouped < MIN_PROGRAMS:
            break
        per_prog *= 2
    return per_prog


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
    heads_per_prog: int | None = None,  # None: heads_per_program's choice; tests force a power of two
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
    q_heads = q.shape[1] if rotate else 0
    if heads_per_prog is None:
        heads_per_prog = heads_per_program(num_tokens, heads, q_heads)
    elif heads_per_prog < 1 or heads_per_prog & (heads_per_prog - 1):
        raise BackendError(f"store: heads_per_prog {heads_per_prog} is not a power of two",
                           fix="pass 1, 2, 4, ... or None for the launch's own choice")
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
    groups = _groups(heads, heads_per_prog) + _groups(q_heads, heads_per_prog)
    _store_kernel[(num_tokens, groups)](
        slot_mapping, k, v_arg, k_cache, vc_arg, q_arg, cos_arg, sin_arg,
        *k.stride(), *v_arg.stride(), *k_cache.stride(), *vc_arg.stride(), q_arg.stride(0), q_arg.stride(1),
        cos_arg.stride(0),
        1.0 / k_scale, 1.0 / v_scale,
        PAGE_SIZE=k_cache.shape[2], K_DIM=k_dim, V_DIM=v_arg.shape[2],
        BLOCK_K=next_pow2(k_dim), BLOCK_V=next_pow2(v_arg.shape[2]), HAS_V=has_v,
        FP8=fp8, HEADS=heads, Q_HEADS=q_heads, ROPE=rotate, HALF=half,
        HALF_PAD=max(16, next_pow2(half)), INTERLEAVED=rotate and rope.interleaved, HEADS_PER_PROG=heads_per_prog,
        num_warps=_warps(heads_per_prog, max(k_dim, v_arg.shape[2])), **pdl.launch_args(k),
    )


def store_rows(
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    rows: torch.Tensor,  # [num_tokens, dim]
    cache: torch.Tensor,  # [num_pages, page_size, dim]: a cache without a head axis (NSA indexer keys)
) -> None:
    store_kv(slot_mapping, rows.unsqueeze(1), cache.unsqueeze(1))
