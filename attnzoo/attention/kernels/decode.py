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

import functools

import torch
import triton
import triton.language as tl

from attnzoo.attention.kernels.common import (
    MIN_TILE,
    OutOfResources,
    add_sinks,
    attend,
    check_kernel_dtypes,
    dot_args,
    head_dim_tiles,
    launch,
    next_pow2,
    resident_ctas,
    value_tile,
)
from attnzoo.attention.kernels.extend import extend_launch_config
from attnzoo.errors import BackendError

MAX_KV_SPLITS = 64
# A split shorter than this spends more on the merge than it saves.
MIN_TOKENS_PER_SPLIT = 256
# Stage 2 merges up to this many splits in one compiled variant (masked): a power of two per count compiled mid-run.
MIN_MERGED_SPLITS = 16
# Up to FEW_SPLITS splits (large batches, cascade steps) the merge takes a tile of them for several heads, at most
# MERGE_TILE partial values a program: one head a program left each program too little work at large batches
# (benchmarks/results/cascade_sweep_nvidia_h100.txt).
FEW_SPLITS = 4
MERGE_TILE = 8192
# Stage-1 tiles tried beside the default (``_fill_waves``): 32 keys a step take fewer registers than 64, so
# more programs share an SM; the default keeps a batch whose programs fill their waves.
WAVE_TILE_N = 32
WAVE_TILES = ({"BLOCK_N": WAVE_TILE_N, "num_stages": 2}, {"BLOCK_N": WAVE_TILE_N, "num_stages": 3})
WAVE_GAIN = 1.1


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
):
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
):
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
):
    # One program merges BLOCK_H heads of one request: a [BLOCK_H, BLOCK_S, BLOCK_DV] tile of partials.
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    h_ok = offs_h < num_heads
    s_ok = h_ok[:, None] & (offs_s[None, :] < num_splits)
    # lse is in log2 units; empty splits carry -inf and weigh 0. Split 0 is never empty.
    lse = tl.load(LSE + b * stride_lb + offs_h[:, None] * stride_lh + offs_s[None, :] * stride_ls, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 1)
    if HAS_SINKS:  # the head's sink logit joins the merged denominator (log2 units, as lse)
        sink = tl.load(SINKS + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(h_ok, m, 0.0)  # heads past the last: no -inf - -inf
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
    out = tl.sum(part * w[:, :, None], 1) / tl.where(h_ok, denom, 1.0)[:, None]
    tl.store(O + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=h_ok[:, None] & (offs_d[None, :] < V_DIM))


@functools.cache  # callers copy the dict before changing it
def decode_launch_config(head_dim: int, v_head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """Tile sizes for stage 1, tuned on an H100 for KV bandwidth, which bounds the kernel
    (benchmarks/attention_triton.py). Smaller GPUs shrink them at launch (``common.launch``)."""
    bd, bdr = head_dim_tiles(head_dim)
    width = bd + bdr + value_tile(v_head_dim)
    block_h = MIN_TILE if group <= MIN_TILE else min(64, 1 << (group - 1).bit_length())
    if width <= 256:
        block_n, warps, stages = 64, 4, 1
    elif width <= 512:
        block_n, warps, stages = 32, 4, 2
    else:
        block_n, warps, stages = 32, 4, 3
    if block_h > MIN_TILE:  # MLA-like groups: 64 heads x 512 channels of accumulator
        warps, stages = 8, 2
    if dtype == torch.float32:
        block_n = max(MIN_TILE, block_n // 2)
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def choose_num_kv_splits(
    *, batch: int, num_kv_heads: int, group: int, max_kv_len: int, num_sms: int, block_h: int = MIN_TILE
) -> int:
    """How many KV splits make ``batch`` decode programs fill ``num_sms`` multiprocessors (host ints only)."""
    head_blocks = -(-group // block_h)
    programs = batch * num_kv_heads * head_blocks
    want = -(-2 * num_sms // programs)
    longest = max(1, max_kv_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, longest, MAX_KV_SPLITS))


def choose_num_shared_splits(
    *, batch: int, num_kv_heads: int, group: int, shared_len: int, num_sms: int, block_m: int,
    max_splits: int = MAX_KV_SPLITS,
) -> int:
    """How many splits of the shared prefix make the cascade's shared pass fill ``num_sms``
    multiprocessors: it runs ceil(batch * group / block_m) row blocks per KV head (host ints only)."""
    row_blocks = -(-batch * group // block_m)
    splits = choose_num_kv_splits(batch=row_blocks, num_kv_heads=num_kv_heads, group=1, block_h=1,
                                  max_kv_len=shared_len, num_sms=num_sms)
    return max(1, min(splits, max_splits))


@functools.cache  # read per layer and step; callers copy the dict before changing it
def cascade_launch_config(head_dim: int, v_head_dim: int, dtype: torch.dtype) -> dict:
    """Tiles of the cascade's shared pass. Its rows are (request, group head) pairs over the same keys,
    as extend's are (token, group head) pairs: extend's tiles, whatever the batch, but for widths up to 128
    64 rows in 2 stages, the sweep's best at large batches (benchmarks/results/cascade_sweep_nvidia_h100.txt).
    A BLOCK_M narrowed to small batches compiled a variant mid-run whenever the batch crossed a class, and
    measured no faster at 2-16 requests (benchmarks/results/cascade_tiles_nvidia_h100.txt)."""
    cfg = dict(extend_launch_config(head_dim, v_head_dim, dtype))
    bd, bdr = head_dim_tiles(head_dim)
    if max(bd + bdr, value_tile(v_head_dim)) <= 128 and dtype != torch.float32:
        cfg.update(BLOCK_M=64, num_stages=2)
    return cfg


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


def _v_from_k(k_cache, v_cache) -> bool:
    # MLA: values are the key's first channels. Reusing the key tile needs the value tile to be exactly
    # the key's main tile, unpadded.
    v_dim = v_cache.shape[-1]
    return (
        v_cache.data_ptr() == k_cache.data_ptr()
        and v_cache.stride() == k_cache.stride()
        and v_dim == head_dim_tiles(k_cache.shape[-1])[0] == value_tile(v_dim)
    )


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
        V_FROM_K=_v_from_k(k_cache, v_cache), DIRECT=direct, **dot_args(k_cache),
    )
    if launch_config is None and q.is_cuda and cfg["BLOCK_N"] > WAVE_TILE_N:
        cfg = _fill_waves(grid, args, constexprs, cfg, batch * num_kv_heads * head_blocks * num_kv_splits)
    launch(_decode_stage1, grid, args, constexprs, cfg, tile_keys=("BLOCK_N",))


def wave_fill(programs: int, slots: int) -> float:
    """The share of the launched waves' program slots that ``programs`` fill (the last wave may be part-empty)."""
    return programs / (-(-programs // slots) * slots)


# (device, cache dtypes, constexprs, default config, programs) -> the stage-1 config launched; and
# (device, cache dtypes, constexprs, config) -> programs an SM holds (None: the config does not fit the GPU)
_WAVE_PICKS: dict[tuple, dict] = {}
_RESIDENT: dict[tuple, int | None] = {}


def _fill_waves(grid, args, constexprs: dict, cfg: dict, programs: int) -> dict:
    """The default tile, or a narrower one where the default's programs spill into a mostly empty last wave
    that the narrower tile's (more of them fit an SM) avoid: stage 1 is bound by KV bandwidth only while every
    SM streams (benchmarks/results/decode_splits_nvidia_h100.json). Decided once per shape and program count;
    each tile's occupancy is read once per shape (the first graph capture of a spilling batch compiles them)."""
    q, k_cache = args[0], args[1]
    shape = (q.device.index, q.dtype, k_cache.dtype, tuple(constexprs.values()))
    key = (*shape, tuple(cfg.items()), programs)
    if key in _WAVE_PICKS:
        return _WAVE_PICKS[key]

    def slots(c: dict) -> int | None:
        rkey = (*shape, tuple(c.items()))
        if rkey not in _RESIDENT:
            try:
                _RESIDENT[rkey] = resident_ctas(_decode_stage1, grid, args, constexprs, c)
            except OutOfResources:  # a GPU with less shared memory: launch() shrinks the default as before
                _RESIDENT[rkey] = None
        n = _RESIDENT[rkey]
        return None if n is None else n * torch.cuda.get_device_properties(q.device).multi_processor_count

    best, base = cfg, slots(cfg)
    if base is not None and programs > base:
        best_fill = wave_fill(programs, base)
        for alt in WAVE_TILES if best_fill < 1 / WAVE_GAIN else ():
            c = dict(cfg, **alt)
            n = slots(c)
            if n is not None and wave_fill(programs, n) > best_fill * WAVE_GAIN:
                best, best_fill = c, wave_fill(programs, n)
    _WAVE_PICKS[key] = best
    return best


def _stage2(partial, lse, out, sinks=None):
    batch, heads, splits, v_dim = partial.shape
    bdv = value_tile(v_dim)
    if splits <= FEW_SPLITS:  # large batches: several heads a program, or one program per head does too little
        block_s, block_h = FEW_SPLITS, min(next_pow2(heads), max(1, MERGE_TILE // (FEW_SPLITS * bdv)))
    else:
        block_s, block_h = max(MIN_MERGED_SPLITS, next_pow2(splits)), 1
    _decode_stage2[(batch, -(-heads // block_h))](
        partial, lse, out, out if sinks is None else sinks,
        *partial.stride(), *lse.stride(), *out.stride(), heads, splits,
        BLOCK_H=block_h, BLOCK_S=block_s, V_DIM=v_dim, BLOCK_DV=bdv, HAS_SINKS=sinks is not None,
        num_warps=4 if bdv <= 256 else 8,
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
    launch_config: dict | None = None,  # override cascade_launch_config for the shared pass
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
    _stage1(q, k_cache, v_cache, block_tables, seq_lens, partial, lse, direct=False, num_kv_splits=num_kv_splits,
            scale=scale, sliding_window=None, logit_softcap=logit_softcap, kv_skip=shared_len, launch_config=None,
            k_scale=k_scale, v_scale=v_scale)

    group = num_heads // num_kv_heads
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
            HAS_SOFTCAP=bool(logit_softcap), V_FROM_K=_v_from_k(k_cache, v_cache), **dot_args(k_cache),
        ),
        cfg,
        tile_keys=("BLOCK_M", "BLOCK_N"),
    )
    _stage2(partial, lse, out, sinks)
    return out
