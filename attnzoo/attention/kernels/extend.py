"""Paged extend (prefill) attention: new tokens of each request over its cached prefix and themselves.

The layer has already stored this step's k/v in the pool, so every key is read from the paged cache
through the block table. Flash-attention style: one program per (request, KV head, block of rows), a
running softmax over key blocks in float32. A row is one (new token, query head of the KV head's group)
pair, tokens major: the query heads sharing a KV head read each key block once together, which matters
for short extends over long prefixes and for MLA's 128 heads on one latent KV head.

A program only visits the keys some row of its block can see: up to its last row's position (causal),
and from its first row's position minus the window (sliding window).

Cascade (``cascade_extend_attention``, MLA): where every request of the step starts with the same cached
pages, the tokens attend to them all at once as GEMMs (``cascade_gemm``), and the kernel then covers only
each request's keys after them, merging the two parts by log-sum-exp before it writes.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attnzoo.attention.kernels import cascade_gemm
from attnzoo.attention.kernels.common import (
    add_sinks,
    attend,
    check_kernel_dtypes,
    dot_args,
    head_dim_tiles,
    launch,
    value_tile,
    values_in_key,
)
from attnzoo.errors import BackendError


# the shared prefix's length and the block table's width change from step to step: not specialized on (each
# change of class compiled a variant mid-run: benchmarks/mid_run_compiles.py)
@triton.jit(do_not_specialize=["stride_btb", "kv_skip"])
def _extend_kernel(
    Q, K, V, BT, Q_INDPTR, PREFIX_LENS, O, SINKS, PRIOR_LSE,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_btb,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    sm_scale, softcap, window, v_scale, kv_skip,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_PRIOR: tl.constexpr,
    V_FROM_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    mblk = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(Q_INDPTR + b)
    q_len = tl.load(Q_INDPTR + b + 1) - q_start
    num_rows = q_len * GROUP
    if mblk * BLOCK_M >= num_rows:
        return
    prefix = tl.load(PREFIX_LENS + b)

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < num_rows
    # Rows past the end repeat the last row: every row then sees >= 1 key and stays finite.
    rows = tl.minimum(offs_m, num_rows - 1)
    tok = rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    pos = prefix + tok  # [BLOCK_M] absolute positions
    offs_dv = tl.arange(0, BLOCK_DV)

    first_pos = prefix + (mblk * BLOCK_M) // GROUP
    last_pos = prefix + (tl.minimum(mblk * BLOCK_M + BLOCK_M, num_rows) - 1) // GROUP
    hi = last_pos + 1
    lo = kv_skip  # cascade: the keys before it were attended by the shared pass (HAS_PRIOR)
    seen = 0  # the first key any row of the block sees
    if HAS_WINDOW:
        seen = tl.maximum(first_pos - window + 1, 0)
        lo = (seen // BLOCK_N) * BLOCK_N

    acc, m_i, l_i = attend(
        Q, (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh, row_ok, K, V, BT + b * stride_btb, kvh,
        lo, hi,
        stride_qd, stride_kp, stride_kh, stride_kt, stride_kd, stride_vp, stride_vh, stride_vt, stride_vd,
        sm_scale, softcap, pos, seen, window,
        HEAD_DIM, V_DIM, BLOCK_D, BLOCK_DR, BLOCK_DV, BLOCK_M, BLOCK_N, PAGE_SIZE, HAS_SOFTCAP, V_FROM_K,
        DOT_DTYPE, DOT_PREC, True, HAS_WINDOW,
    )

    o_ptrs = O + (q_start + tok).to(tl.int64)[None, :] * stride_ot + heads[None, :] * stride_oh + offs_dv[:, None] * stride_od
    o_mask = row_ok[None, :] & (offs_dv[:, None] < V_DIM)
    if HAS_PRIOR:  # O holds the rows' normalised attention to the keys before kv_skip, PRIOR_LSE its log2-LSE
        lse_p = tl.load(PRIOR_LSE + (q_start + tok).to(tl.int64) * stride_lt + heads * stride_lh, mask=row_ok,
                        other=0.0)
        o_p = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, lse_p)
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(lse_p - m_new)
        acc = acc * alpha[None, :] + o_p * beta[None, :]
        l_i = l_i * alpha + beta
        m_i = m_new
    if HAS_SINKS:  # each head's sink logit joins the denominator: a key of value zero
        acc, l_i = add_sinks(SINKS, heads, row_ok, acc, m_i, l_i)
    out = acc * (v_scale / l_i)[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)


@functools.lru_cache(maxsize=None)  # callers copy the dict before changing it
def extend_launch_config(head_dim: int, v_head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes tuned on an H100 for causal prefill (benchmarks/attention_triton.py). The float32 accumulator
    [v_dim, BLOCK_M] and the k/v tiles bound the tiles as head dims grow; smaller GPUs shrink them at launch
    (``common.launch``)."""
    bd, bdr = head_dim_tiles(head_dim)
    width = max(bd + bdr, value_tile(v_head_dim))
    if width <= 128:
        cfg = (128, 32, 4, 3)
    elif width <= 256:
        cfg = (64, 32, 4, 2)
    else:
        cfg = (32, 128, 8, 1)
    block_m, block_n, warps, stages = cfg
    if dtype == torch.float32:
        block_m, block_n = max(16, block_m // 2), max(16, block_n // 2)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def cascade_rest_launch_config(head_dim: int, v_head_dim: int, dtype: torch.dtype) -> dict:
    """The cascade's second half (each request's own keys after the shared prefix: a question's worth) at MLA's
    widths: 32-key blocks waste less of the causal mask than 128 and leave room for two stages (measured on an
    H100: benchmarks/results/cascade_extend_mla_nvidia_h100.txt); otherwise the extend tiles."""
    cfg = dict(extend_launch_config(head_dim, v_head_dim, dtype))
    if sum(head_dim_tiles(head_dim)) > 256 and dtype != torch.float32:
        cfg.update(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    return cfg


def extend_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the new tokens of all requests, packed
    k_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim], new tokens already stored
    v_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, v_head_dim] (may be a view of k_cache)
    block_tables: torch.Tensor,  # [num_reqs, max_pages] int32
    q_indptr: torch.Tensor,  # [num_reqs + 1] int32: request i owns rows q_indptr[i]:q_indptr[i+1]
    prefix_lens: torch.Tensor,  # [num_reqs] int32: cached tokens before the new ones
    *,
    max_q_len: int,  # host int: the longest request's new-token count (sizes the grid, no device sync)
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] attention-sink logits (gpt-oss)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, v_head_dim], q's dtype
    launch_config: dict | None = None,  # override the tile sizes (benchmarks and tuning)
    k_scale: float = 1.0,  # fp8 caches: folded into the softmax scale, as in decode.py
    v_scale: float = 1.0,  # fp8 caches: multiplies the normalised output
) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
    out = _check(q, k_cache, v_cache, q_indptr, out)
    _launch(q, k_cache, v_cache, block_tables, q_indptr, prefix_lens, out, max_q_len=max_q_len, scale=scale,
            sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks, launch_config=launch_config,
            k_scale=k_scale, v_scale=v_scale)
    return out


def gemm_cascade(q, k_cache, v_cache, shared_len: int, logit_softcap: float | None, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> bool:
    """Whether an extend step whose requests share ``shared_len`` cached tokens runs ``cascade_extend_attention``
    for this layer: where ``cascade_gemm.applies`` (MLA, 16-bit, enough token x head rows), else the plain kernel."""
    return cascade_gemm.applies(q, k_cache, values_in_key(k_cache, v_cache), shared_len, logit_softcap, k_scale,
                                v_scale, min_rows=cascade_gemm.EXTEND_MIN_ROWS)


def cascade_extend_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], as in extend_attention
    k_cache: torch.Tensor,  # [num_pages, 1, page_size, head_dim]: MLA's latent cache
    v_cache: torch.Tensor,  # its first v_head_dim channels (a view)
    block_tables: torch.Tensor,  # [num_reqs, max_pages] int32; the first shared_len / page_size columns equal
    q_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,  # [num_reqs] int32; each >= shared_len
    *,
    shared_len: int,  # leading keys every request reads from the same pages (block_tables[0]), whole pages
    max_q_len: int,
    scale: float,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    launch_config: dict | None = None,  # override the second half's tiles (benchmarks and tuning)
) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
    """``extend_attention`` (no window, no softcap, an unscaled cache) for a step whose requests all start with
    the same cached pages: every new token attends to them through ``cascade_gemm.extend_shared_pass`` (two
    GEMMs, the prefix read once for the whole step), then the extend kernel attends each token to its own
    request's keys after them and merges the two by log-sum-exp as it writes the output. For the layers
    ``cascade_gemm.applies`` admits; precondition, not checked (it would sync): every prefix length >=
    shared_len, as ``metadata.shared_prefix_pages`` guarantees."""
    out = _check(q, k_cache, v_cache, q_indptr, out)
    page_size = k_cache.shape[2]
    if shared_len <= 0 or shared_len % page_size or shared_len // page_size > block_tables.shape[1]:
        raise BackendError(
            f"cascade extend: shared_len {shared_len} is not a positive number of whole pages of "
            f"{page_size} within the block table ({block_tables.shape[1]} pages)",
            fix="use metadata.shared_prefix_len, and extend_attention when it is 0",
        )
    if shared_len > cascade_gemm.MAX_SHARED_LEN:
        raise BackendError(f"cascade extend: a shared prefix of {shared_len} tokens is longer than the GEMM pass's "
                           f"softmax tile ({cascade_gemm.MAX_SHARED_LEN})", fix="use extend_attention")
    if (k_cache.shape[1] != 1 or v_cache.data_ptr() != k_cache.data_ptr() or k_cache.dtype != q.dtype
            or not out.is_contiguous()):
        raise BackendError("cascade extend runs MLA layers only (one latent KV head, values inside the key, a "
                           "cache of the query's dtype), into a contiguous output",
                           fix="use extend_attention for other layers")
    if q.shape[0] == 0 or max_q_len == 0:
        return out
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    cascade_gemm.extend_shared_pass(q, k_cache, block_tables, out, lse, shared_len=shared_len, scale=scale)
    _launch(q, k_cache, v_cache, block_tables, q_indptr, prefix_lens, out, max_q_len=max_q_len, scale=scale,
            sinks=sinks, kv_skip=shared_len, prior_lse=lse,
            launch_config=launch_config or cascade_rest_launch_config(q.shape[-1], out.shape[-1], k_cache.dtype))
    return out


def warm_up_cascade(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, *, scale: float,
                    sinks: torch.Tensor | None = None) -> int:
    """Compile what the GEMM cascade of a layer of this shape runs (the extend kernel's merging variant, the row
    softmax at each prefix length class up to MAX_SHARED_LEN, which decode's GEMM pass shares) before a large
    step needs it, on one request of two tokens reading only page 0 (the pool's padding page: nothing is
    written to the cache). -> the calls made: 0 where the layer does not qualify (``cascade_gemm.layer_qualifies``)."""
    if not cascade_gemm.layer_qualifies(k_cache.dtype, k_cache.dtype, k_cache.shape[-1], k_cache.shape[1],
                                        values_in_key(k_cache, v_cache)):
        return 0
    page, dev = k_cache.shape[2], k_cache.device
    q = k_cache.new_zeros(2, num_heads, k_cache.shape[-1])
    indptr = torch.tensor([0, 2], dtype=torch.int32, device=dev)
    calls, shared = 0, page
    while shared <= cascade_gemm.MAX_SHARED_LEN:
        tables = torch.zeros(1, -(-(shared + 2) // page), dtype=torch.int32, device=dev)
        prefix = torch.tensor([shared], dtype=torch.int32, device=dev)
        cascade_extend_attention(q, k_cache, v_cache, tables, indptr, prefix, shared_len=shared, max_q_len=2,
                                 scale=scale, sinks=sinks)
        calls, shared = calls + 1, shared * 2
    return calls


def _check(q, k_cache, v_cache, q_indptr, out) -> torch.Tensor:
    """The inputs agree; -> ``out``, allocated when None."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, k_dim = k_cache.shape[1], k_cache.shape[3]
    if k_dim != head_dim or v_cache.shape[:3] != k_cache.shape[:3]:
        raise BackendError(
            f"extend: q {tuple(q.shape)}, k cache {tuple(k_cache.shape)} and v cache {tuple(v_cache.shape)} disagree",
            fix="pass the layer's pool views and a query with the layer's head dim",
        )
    if num_heads % num_kv_heads:
        raise BackendError(f"extend: {num_heads} query heads is not a multiple of {num_kv_heads} KV heads",
                           fix="check the layer's head counts")
    check_kernel_dtypes(q, k_cache, v_cache)
    if out is None:
        out = torch.empty(num_tokens, num_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    return out


def _launch(q, k_cache, v_cache, block_tables, q_indptr, prefix_lens, out, *, max_q_len, scale, sliding_window=None,
            logit_softcap=None, sinks=None, launch_config=None, k_scale=1.0, v_scale=1.0, kv_skip=0, prior_lse=None):
    # kv_skip / prior_lse: the cascade's second half (out already holds the shared pass's output); a window would
    # move the first key below kv_skip and count the shared keys twice
    if prior_lse is not None and sliding_window:
        raise BackendError("cascade extend has no sliding-window path", fix="use extend_attention for windowed layers")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_cache.shape[1], v_cache.shape[-1]
    num_reqs = q_indptr.shape[0] - 1
    if num_tokens == 0 or num_reqs == 0 or max_q_len == 0:
        return
    group = num_heads // num_kv_heads
    bd, bdr = head_dim_tiles(head_dim)
    bdv = value_tile(v_dim)
    v_from_k = values_in_key(k_cache, v_cache)
    lse = out if prior_lse is None else prior_lse
    cfg = dict(launch_config or extend_launch_config(head_dim, v_dim, k_cache.dtype))
    launch(
        _extend_kernel,
        lambda c: (triton.cdiv(max_q_len * group, c["BLOCK_M"]), num_kv_heads, num_reqs),
        (
            q, k_cache, v_cache, block_tables, q_indptr, prefix_lens, out, out if sinks is None else sinks, lse,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
            lse.stride(0), lse.stride(1),
            float(scale * k_scale), float(logit_softcap or 0.0), int(sliding_window or 0), float(v_scale),
            int(kv_skip),
        ),
        dict(
            GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_D=bd, BLOCK_DR=bdr, BLOCK_DV=bdv,
            PAGE_SIZE=k_cache.shape[2], HAS_SOFTCAP=bool(logit_softcap), HAS_WINDOW=bool(sliding_window),
            HAS_SINKS=sinks is not None, HAS_PRIOR=prior_lse is not None, V_FROM_K=v_from_k, **dot_args(k_cache),
        ),
        cfg,
        tile_keys=("BLOCK_M", "BLOCK_N"),
    )
