"""Paged decode attention: one query token per request, split-K over the context, GQA-grouped.

Stage 1 runs one program per (request, KV head, block of query heads sharing that KV head, KV split):
it streams its split of the request's keys/values once through the block table and keeps a running
softmax for all the query heads of its block together, so a KV head is read once per head block rather
than once per query head (MLA: 128 query heads on one latent KV head). With one split, stage 1 writes
the final output directly; otherwise it writes normalised partial outputs and their log-sum-exp, and
stage 2 merges the splits. Splitting lets a small batch with a long context still fill the GPU.

Cascade (``cascade_decode_attention``): when every request's first pages are the same pages (a shared
few-shot prompt), stage 1 covers only each request's keys after them, and ``_cascade_shared`` attends
the shared keys once per KV head for all (request, query head) rows together, a prefill-like tile of
rows x keys. Both write split-K partials into one scratch (suffix splits, then shared splits), which
the unchanged stage 2 merges: the shared pages are read once per block of rows, not once per request.

fp8 (e4m3) caches: the tiles are widened to the dot dtype on load; the key scale is folded into the
softmax scale and the value scale multiplies the normalised output (softmax and the split merge are
linear in the values), so a scale costs one multiply per score tile and per output row.

Every tensor is addressed through its strides: pool views may be strided (MLA values are the first
channels of the stored key), and q may be a view of a fused projection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnzoo.attention.kernels.common import (
    add_sinks,
    attend,
    check_kernel_dtypes,
    dot_args,
    head_dim_tiles,
    launch,
    next_pow2,
    prior_done,
    value_tile,
    values_in_key,
)
from attnzoo.attention.kernels import cascade_gemm, cascade_sdpa
from attnzoo.attention.kernels.decode_launch import (
    MAX_KV_SPLITS,
    WAVE_TILE_N,
    cascade_launch_config,
    cascade_own_launch_config,
    decode_launch_config,
    fill_waves,
)
from attnzoo import pdl
from attnzoo.errors import BackendError

# Stage 2 merges up to this many splits in one compiled variant (masked): a power of two per count compiled mid-run.
MIN_MERGED_SPLITS = 16
# Up to FEW_SPLITS splits (large batches, cascade steps) the merge takes a tile of them for several heads, at most
# MERGE_TILE partial values a program: one head a program left each program too little work at large batches
# (benchmarks/results/cascade_sweep_nvidia_h100.txt).
FEW_SPLITS = 4
MERGE_TILE = 8192
# Past FEW_SPLITS, a merge of fewer programs than SMs splits each head's values into up to MERGE_CHUNKS chunks of
# at least MIN_MERGE_CHUNK values: one program a head left MLA's 512 values x 64 splits to 16 programs at batch 1,
# latency-bound; more, narrower chunks measured slower end to end (results/batch1_rope_store_merge_chunks_*).
MERGE_CHUNKS = 4
MIN_MERGE_CHUNK = 64


@triton.jit
def _finish(O, LSE, o_rows, lse_rows, row_ok, acc, m_i, l_i, stride_od, v_scale,
            V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, DIRECT: tl.constexpr):
    """Store the normalised output of each row at O + o_rows; unless DIRECT, also its log2-LSE (-inf
    for a row that saw no key, so that the merge weighs it 0)."""
    offs_dv = tl.arange(0, BLOCK_DV)
    has_keys = l_i > 0.0
    out = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[None, :]
    o_ptrs = O + o_rows[None, :] + offs_dv[:, None] * stride_od
    o_mask = row_ok[None, :] & (offs_dv[:, None] < V_DIM)
    if DIRECT:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, out, mask=o_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(LSE + lse_rows, lse, mask=row_ok)


# Values that change from step to step (the split count follows the batch, the table width the longest request, the
# cascade's prefix its length) are runtime arguments Triton does not specialize on: as constexprs or specialized
# ints, each new one compiled a variant in the middle of a run (benchmarks/mid_run_compiles.py). The lse scratch's
# strides follow the split count too, and its divisibility by 16 with them.
@triton.jit(do_not_specialize=["stride_btb", "stride_lb", "stride_lh", "kv_skip", "num_splits"])
def _decode_stage1(
    Q, K, V, BT, SEQ_LENS, O, LSE, SINKS,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_btb,
    stride_ob, stride_oh, stride_os, stride_od,  # O: out [b, h, d] (stride_os 0) or partial [b, h, s, d]
    stride_lb, stride_lh, stride_ls,
    sm_scale, softcap, window,
    kv_skip,  # keys before this are left out (cascade: the shared prefix, attended separately)
    v_scale, num_splits,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,  # DIRECT only: split outputs take their sinks in stage 2
    V_FROM_K: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    prior_done(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hblk = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    offs_g = hblk * BLOCK_H + tl.arange(0, BLOCK_H)  # index inside the KV head's group
    head_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g

    seq_len = tl.load(SEQ_LENS + b)
    kv_start = kv_skip
    if HAS_WINDOW:
        kv_start = tl.maximum(seq_len - window, kv_start)
    span = seq_len - kv_start
    split_len = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    lo = kv_start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    acc, m_i, l_i = attend(
        Q, b * stride_qb + heads * stride_qh, head_ok, K, V, BT + b * stride_btb, kvh, lo, hi,
        stride_qd, stride_kp, stride_kh, stride_kt, stride_kd, stride_vp, stride_vh, stride_vt, stride_vd,
        sm_scale, softcap, 0, 0, 0,
        HEAD_DIM, V_DIM, BLOCK_D, BLOCK_DR, BLOCK_DV, BLOCK_H, BLOCK_N, PAGE_SIZE, HAS_SOFTCAP, V_FROM_K,
        DOT_DTYPE, DOT_PREC, False, False,
    )
    if HAS_SINKS:
        acc, l_i = add_sinks(SINKS, heads, head_ok, acc, m_i, l_i)
    _finish(O, LSE, b * stride_ob + heads * stride_oh + split * stride_os,
            b * stride_lb + heads * stride_lh + split * stride_ls, head_ok, acc, m_i, l_i, stride_od, v_scale,
            V_DIM, BLOCK_DV, DIRECT)


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "shared_len", "batch", "split_base", "num_splits"])
def _cascade_shared(
    Q, K, V, BT, O, LSE,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_kh, stride_kt, stride_kd,
    stride_vp, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,  # O: the partial [b, h, s, d]; the shared splits' slots
    stride_lb, stride_lh, stride_ls,  # start at split_base (an offset, not a sliced pointer, whose alignment varies)
    sm_scale, softcap, shared_len, batch, v_scale, split_base, num_splits,
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
    V_FROM_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    prior_done(PDL)
    # Rows are (request, query head of this KV head's group) pairs, request-major: every row sees the
    # same keys [0, shared_len) through request 0's pages, so one K/V tile serves BLOCK_M rows.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row_ok = rows < batch * GROUP
    b = rows // GROUP
    heads = kvh * GROUP + rows % GROUP

    split_len = tl.cdiv(tl.cdiv(shared_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, shared_len)

    acc, m_i, l_i = attend(
        Q, b * stride_qb + heads * stride_qh, row_ok, K, V, BT, kvh, lo, hi,
        stride_qd, stride_kp, stride_kh, stride_kt, stride_kd, stride_vp, stride_vh, stride_vt, stride_vd,
        sm_scale, softcap, 0, 0, 0,
        HEAD_DIM, V_DIM, BLOCK_D, BLOCK_DR, BLOCK_DV, BLOCK_M, BLOCK_N, PAGE_SIZE, HAS_SOFTCAP, V_FROM_K,
        DOT_DTYPE, DOT_PREC, False, False,
    )
    slot = split_base + split
    _finish(O, LSE, b * stride_ob + heads * stride_oh + slot * stride_os,
            b * stride_lb + heads * stride_lh + slot * stride_ls, row_ok, acc, m_i, l_i, stride_od, v_scale,
            V_DIM, BLOCK_DV, False)


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "num_splits"])
def _decode_stage2(
    PARTIAL, LSE, O, SINKS,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    num_heads, num_splits,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    prior_done(PDL)
    # One program merges BLOCK_H heads of one request, BLOCK_DV of their values (the chunk program_id(2)):
    # a [BLOCK_H, BLOCK_S, BLOCK_DV] tile of partials.
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    h_ok = offs_h < num_heads
    s_ok = h_ok[:, None] & (offs_s[None, :] < num_splits)
    # lse is in log2 units; empty splits carry -inf and weigh 0. A row of length 0 (a mixed-step graph's row that is
    # not a decode row) has only empty splits and merges to 0, as a direct write of it is.
    lse = tl.load(LSE + b * stride_lb + offs_h[:, None] * stride_lh + offs_s[None, :] * stride_ls, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 1)
    if HAS_SINKS:  # the head's sink logit joins the merged denominator (log2 units, as lse)
        sink = tl.load(SINKS + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(h_ok & (m > float("-inf")), m, 0.0)  # heads past the last, rows of no key: no -inf - -inf
    w = tl.exp2(lse - m[:, None])
    denom = tl.sum(w, 1)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    part = tl.load(
        PARTIAL + b * stride_pb + offs_h[:, None, None] * stride_ph + offs_s[None, :, None] * stride_ps
        + offs_d[None, None, :] * stride_pd,
        mask=s_ok[:, :, None] & (offs_d[None, None, :] < V_DIM),
        other=0.0,
    )
    out = tl.sum(part * w[:, :, None], 1) / tl.where(h_ok & (denom > 0.0), denom, 1.0)[:, None]
    tl.store(O + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=h_ok[:, None] & (offs_d[None, :] < V_DIM))


def _check(name: str, q, k_cache, v_cache, splits: int) -> None:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, k_dim = k_cache.shape[1], k_cache.shape[3]
    if k_dim != head_dim or v_cache.shape[:3] != k_cache.shape[:3]:
        raise BackendError(
            f"{name}: q {tuple(q.shape)}, k cache {tuple(k_cache.shape)} and v cache {tuple(v_cache.shape)} disagree",
            fix="pass the layer's pool views and a query with the layer's head dim",
        )
    if num_heads % num_kv_heads:
        raise BackendError(f"{name}: {num_heads} query heads is not a multiple of {num_kv_heads} KV heads",
                           fix="check the layer's head counts")
    if not 1 <= splits <= MAX_KV_SPLITS:
        raise BackendError(f"{name}: {splits} KV splits outside 1..{MAX_KV_SPLITS}",
                           fix="choose them with choose_num_kv_splits / choose_num_shared_splits")
    check_kernel_dtypes(q, k_cache, v_cache)


def shared_pass_kind(q, k_cache, v_cache, shared_len: int, logit_softcap: float | None, k_scale: float = 1.0,
                     v_scale: float = 1.0, *, graph: bool = False) -> str:
    """Which kernel runs the shared pass of ``cascade_decode_attention`` with one shared split and no
    ``launch_config``: "gemm" (``cascade_gemm``: MLA at a large batch), "cudnn" (``cascade_sdpa``: MHA and GQA at a
    large batch in a CUDA graph's step) or "triton" (``_cascade_shared``)."""
    v_from_k = values_in_key(k_cache, v_cache)
    if cascade_gemm.applies(q, k_cache, v_from_k, shared_len, logit_softcap, k_scale, v_scale):
        return "gemm"
    if cascade_sdpa.applies(q, k_cache, v_cache, v_from_k, shared_len, logit_softcap, k_scale, v_scale,
                            graph=graph):
        return "cudnn"
    return "triton"


def _split_scratch(q, v_dim, splits, partial, lse):
    batch, num_heads = q.shape[:2]
    if partial is None:
        partial = torch.empty(batch, num_heads, splits, v_dim, dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    if partial.shape != (batch, num_heads, splits, v_dim) or lse.shape != (batch, num_heads, splits):
        raise BackendError("decode: split-K scratch has the wrong shape",
                           fix=f"size it [batch, heads, {splits} splits, v_dim] and [batch, heads, {splits}]")
    return partial, lse


def _stage1(q, k_cache, v_cache, block_tables, seq_lens, dest, lse, *, direct, num_kv_splits, scale,
            sliding_window, logit_softcap, kv_skip, launch_config, k_scale=1.0, v_scale=1.0, sinks=None):
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    v_dim = v_cache.shape[-1]
    group = num_heads // num_kv_heads
    bd, bdr = head_dim_tiles(head_dim)
    cfg = dict(launch_config or decode_launch_config(head_dim, v_dim, group, k_cache.dtype))
    block_h = cfg.pop("BLOCK_H")
    head_blocks = -(-group // block_h)
    if direct:  # stage 1 writes the output itself; no split slot, no lse
        d_strides, l_strides = (dest.stride(0), dest.stride(1), 0, dest.stride(2)), (0, 0, 0)
    else:
        d_strides, l_strides = dest.stride(), lse.stride()
    grid = lambda c: (batch, num_kv_heads * head_blocks, num_kv_splits)
    args = (
        q, k_cache, v_cache, block_tables, seq_lens, dest, lse, dest if sinks is None else sinks,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        *d_strides, *l_strides,
        float(scale * k_scale), float(logit_softcap or 0.0), int(sliding_window or 0), int(kv_skip),
        float(v_scale), num_kv_splits,
    )
    constexprs = dict(
        GROUP=group, HEAD_BLOCKS=head_blocks,
        HEAD_DIM=head_dim, V_DIM=v_dim, BLOCK_D=bd, BLOCK_DR=bdr, BLOCK_DV=value_tile(v_dim), BLOCK_H=block_h,
        PAGE_SIZE=page_size, HAS_SOFTCAP=bool(logit_softcap), HAS_WINDOW=bool(sliding_window),
        HAS_SINKS=direct and sinks is not None,
        V_FROM_K=values_in_key(k_cache, v_cache), DIRECT=direct, **dot_args(k_cache), **pdl.launch_args(q),
    )
    if launch_config is None and q.is_cuda and cfg["BLOCK_N"] > WAVE_TILE_N:
        cfg = fill_waves(_decode_stage1, grid, args, constexprs, cfg, batch * num_kv_heads * head_blocks * num_kv_splits)
    launch(_decode_stage1, grid, args, constexprs, cfg, tile_keys=("BLOCK_N",))


def _sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 0 elsewhere (the interpreter's merge keeps one program a head)."""
    return pdl.sm_count(device.index or 0) if device.type == "cuda" else 0


def _stage2(partial, lse, out, sinks=None):
    batch, heads, splits, v_dim = partial.shape
    bdv = value_tile(v_dim)
    if splits <= FEW_SPLITS:  # large batches: several heads a program, or one program per head does too little
        block_s, block_h = FEW_SPLITS, min(next_pow2(heads), max(1, MERGE_TILE // (FEW_SPLITS * bdv)))
    else:
        block_s, block_h = max(MIN_MERGED_SPLITS, next_pow2(splits)), 1
    chunks = 1
    if block_h == 1 and batch * heads < _sms(partial.device):
        chunks = max(1, min(MERGE_CHUNKS, bdv // MIN_MERGE_CHUNK))
        bdv //= chunks
    _decode_stage2[(batch, -(-heads // block_h), chunks)](
        partial, lse, out, out if sinks is None else sinks,
        *partial.stride(), *lse.stride(), *out.stride(), heads, splits,
        BLOCK_H=block_h, BLOCK_S=block_s, V_DIM=v_dim, BLOCK_DV=bdv, HAS_SINKS=sinks is not None,
        num_warps=4 if bdv <= 256 else 8, **pdl.launch_args(partial),
    )


def decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim]
    v_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, v_head_dim] (may be a view of k_cache)
    block_tables: torch.Tensor,  # [batch, max_pages] int32
    seq_lens: torch.Tensor,  # [batch] int32: keys per request, including this step's token
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    num_kv_splits: int = 1,
    sinks: torch.Tensor | None = None,  # [num_heads] attention-sink logits (gpt-oss)
    out: torch.Tensor | None = None,  # [batch, num_heads, v_head_dim], q's dtype
    partial: torch.Tensor | None = None,  # [batch, num_heads, num_kv_splits, v_head_dim] float32 scratch
    lse: torch.Tensor | None = None,  # [batch, num_heads, num_kv_splits] float32 scratch
    launch_config: dict | None = None,  # override decode_launch_config (benchmarks and tuning)
    k_scale: float = 1.0,  # fp8 caches: stored k times k_scale is the key
    v_scale: float = 1.0,
) -> torch.Tensor:  # [batch, num_heads, v_head_dim]
    """Attention of each request's one new token over its cached keys (all on q's device, no host sync)."""
    _check("decode", q, k_cache, v_cache, num_kv_splits)
    batch, num_heads = q.shape[:2]
    if out is None:
        out = torch.empty(batch, num_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    direct = num_kv_splits == 1
    if direct:
        dest = lse = out  # lse is not written when DIRECT
    else:
        dest, lse = _split_scratch(q, v_cache.shape[-1], num_kv_splits, partial, lse)
    if batch == 0:
        return out
    _stage1(q, k_cache, v_cache, block_tables, seq_lens, dest, lse, direct=direct, num_kv_splits=num_kv_splits,
            scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap, kv_skip=0,
            launch_config=launch_config, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    if not direct:
        _stage2(dest, lse, out, sinks)
    return out


def cascade_decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim]
    v_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, v_head_dim] (may be a view of k_cache)
    block_tables: torch.Tensor,  # [batch, max_pages] int32; the first shared_len / page_size columns equal
    seq_lens: torch.Tensor,  # [batch] int32: keys per request, including this step's token; each > shared_len
    *,
    shared_len: int,  # leading keys every request reads from the same pages (block_tables[0]), whole pages
    scale: float,
    logit_softcap: float | None = None,
    num_kv_splits: int = 1,  # splits of each request's own keys [shared_len, seq_len)
    num_shared_splits: int = 1,  # splits of the shared keys [0, shared_len)
    sinks: torch.Tensor | None = None,  # [num_heads]: joins the merge's denominator once (stage 2)
    out: torch.Tensor | None = None,  # [batch, num_heads, v_head_dim], q's dtype
    partial: torch.Tensor | None = None,  # [batch, num_heads, num_kv_splits + num_shared_splits, v_head_dim] float32
    lse: torch.Tensor | None = None,  # [batch, num_heads, num_kv_splits + num_shared_splits] float32
    launch_config: dict | None = None,  # override cascade_launch_config for the shared pass (and run it in Triton)
    graph: bool = False,  # the step is being captured as a CUDA graph (shared_pass_kind)
    k_scale: float = 1.0,  # fp8 caches, as in decode_attention
    v_scale: float = 1.0,
) -> torch.Tensor:  # [batch, num_heads, v_head_dim]
    """``decode_attention`` (no sliding window) for a batch whose requests share a prefix of pages, reading
    the shared pages once per KV head and block of rows instead of once per request.

    Stage 1 attends each request to its own keys after the prefix, into split slots [0, num_kv_splits);
    the shared pass attends all (request, query head) rows of a KV head to the prefix together, into the
    slots after them; stage 2 merges every slot by log-sum-exp. Precondition, not checked (it would
    sync): every request has a key beyond the prefix (its new token), as ``metadata.shared_prefix_pages``
    guarantees.
    """
    splits = num_kv_splits + num_shared_splits
    _check("cascade decode", q, k_cache, v_cache, splits)
    if num_kv_splits < 1 or num_shared_splits < 1:
        raise BackendError("cascade decode: each part needs at least one split", fix="pass splits >= 1")
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    v_dim = v_cache.shape[-1]
    if shared_len <= 0 or shared_len % page_size or shared_len // page_size > block_tables.shape[1]:
        raise BackendError(
            f"cascade decode: shared_len {shared_len} is not a positive number of whole pages of "
            f"{page_size} within the block table ({block_tables.shape[1]} pages)",
            fix="use metadata.shared_prefix_len, and decode_attention when it is 0",
        )
    if out is None:
        out = torch.empty(batch, num_heads, v_dim, dtype=q.dtype, device=q.device)
    partial, lse = _split_scratch(q, v_dim, splits, partial, lse)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    _stage1(q, k_cache, v_cache, block_tables, seq_lens, partial, lse, direct=False, num_kv_splits=num_kv_splits,
            scale=scale, sliding_window=None, logit_softcap=logit_softcap, kv_skip=shared_len,
            launch_config=cascade_own_launch_config(head_dim, v_dim, group, k_cache.dtype),
            k_scale=k_scale, v_scale=v_scale)

    kind = "triton"
    if launch_config is None and num_shared_splits == 1:
        kind = shared_pass_kind(q, k_cache, v_cache, shared_len, logit_softcap, k_scale, v_scale, graph=graph)
    if kind == "gemm":
        cascade_gemm.shared_pass(q, k_cache, block_tables, partial, lse, slot=num_kv_splits, shared_len=shared_len,
                                 scale=scale, v_dim=v_dim)
    elif kind == "cudnn":
        cascade_sdpa.shared_pass(q, k_cache, v_cache, block_tables, partial, lse, slot=num_kv_splits,
                                 shared_len=shared_len, scale=scale)
    if kind != "triton":
        _stage2(partial, lse, out, sinks)
        return out
    bd, bdr = head_dim_tiles(head_dim)
    cfg = dict(launch_config or cascade_launch_config(head_dim, v_dim, k_cache.dtype))
    launch(
        _cascade_shared,
        lambda c: (-(-batch * group // c["BLOCK_M"]), num_kv_heads, num_shared_splits),
        (
            q, k_cache, v_cache, block_tables, partial, lse,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *partial.stride(), *lse.stride(),
            float(scale * k_scale), float(logit_softcap or 0.0), int(shared_len), batch, float(v_scale),
            num_kv_splits, num_shared_splits,
        ),
        dict(
            GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim,
            BLOCK_D=bd, BLOCK_DR=bdr, BLOCK_DV=value_tile(v_dim), PAGE_SIZE=page_size,
            HAS_SOFTCAP=bool(logit_softcap), V_FROM_K=values_in_key(k_cache, v_cache), **dot_args(k_cache),
            **pdl.launch_args(q),
        ),
        cfg,
        tile_keys=("BLOCK_M", "BLOCK_N"),
    )
    _stage2(partial, lse, out, sinks)
    return out
