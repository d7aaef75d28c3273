"""Triton kernels for sparse (NSA) attention: the indexer's scores over the paged indexer-key cache, and
sparse MLA over selected token slots (``attnzoo/attention/nsa.py`` has the math and the torch reference).

``index_scores``: one program per (query token, block of cached positions). It reads the token's
indexer query (all heads) once, its request's keys through the block table, and writes
sum_h w_h * relu(q_h . k * scale) per position, -inf where the position is not visible (j > p).

``sparse_mla``: one program per (query token, block of heads). It walks the token's selected slots
(-1 = none) in blocks, gathers those entries straight from the cache in its layout (model dtype, or fp8
decoded in registers), and runs an online softmax over them; values are the latent channels. The same
kernel serves prefill and decode: under sparse attention every query token is independent.

Tiles are keys-major (scores [keys, heads]) as in ``decode.py``, for the same Hopper reason.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnzoo.attention.kernels.common import MIN_TILE, dot_args, launch
from attnzoo.attention.kernels.codec import fp8_value
from attnzoo.attention.kv_cache import FP8_BLOCK, KVLayout
from attnzoo.errors import BackendError

_LAYOUT_ID = {KVLayout.BF16: 0, KVLayout.FP8_NOPE_SCALED_BF16_ROPE: 1}


def _tile(n: int) -> int:
    return max(MIN_TILE, triton.next_power_of_2(n))


@triton.jit
def _index_scores_kernel(
    Q, W, K, BT, REQ, POS, OUT,
    stride_qt, stride_qh, stride_qd,
    stride_wt, stride_wh,
    stride_kp, stride_kt, stride_kd,
    stride_btb, stride_ot,
    width, scale,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < NUM_HEADS
    d_ok = offs_d < HEAD_DIM
    req = tl.load(REQ + t)
    pos = tl.load(POS + t)
    visible = offs_n <= pos

    q_t = tl.load(Q + t * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None] * stride_qd,
                  mask=h_ok[None, :] & d_ok[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_D, BLOCK_H]
    w = tl.load(W + t * stride_wt + offs_h * stride_wh, mask=h_ok, other=0.0)  # [BLOCK_H] float32
    page = tl.load(BT + req * stride_btb + offs_n // PAGE_SIZE, mask=visible, other=0).to(tl.int64)
    k = tl.load(K + page[:, None] * stride_kp + (offs_n % PAGE_SIZE)[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=visible[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_N, BLOCK_D]
    s = tl.dot(k, q_t, input_precision=DOT_PREC) * scale  # [BLOCK_N, BLOCK_H]
    score = tl.sum(tl.maximum(s, 0.0) * w[None, :], 1)
    score = tl.where(visible, score, float("-inf"))
    tl.store(OUT + t * stride_ot + offs_n, score, mask=offs_n < width)


def index_scores(
    q: torch.Tensor,  # [T, Hi, D], roped
    weights: torch.Tensor,  # [T, Hi] float32, already / sqrt(Hi)
    index_k: torch.Tensor,  # [num_pages, page_size, D]
    block_tables: torch.Tensor,  # [num_reqs, max_pages] int32
    token_reqs: torch.Tensor,  # [T] int64: request of each query token
    positions: torch.Tensor,  # [T] int64: position of each query token
    *,
    width: int,  # columns of the output: the longest context in the batch
    scale: float,
) -> torch.Tensor:  # [T, width] float32
    t, heads, dim = q.shape
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    weights = weights.float()
    block_h, block_d = _tile(heads), _tile(dim)
    # Keys tile x (heads + dim) fits registers; wider indexer rows take fewer keys per program.
    block_n = 64 if block_h * block_d <= 64 * 128 else 32
    if q.device.type != "cuda":
        block_n = MIN_TILE  # the interpreter: the fewest padded positions
    args = (q, weights, index_k, block_tables, token_reqs, positions, out,
            q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
            index_k.stride(0), index_k.stride(1), index_k.stride(2), block_tables.stride(0), out.stride(0),
            width, float(scale))
    constexprs = dict(NUM_HEADS=heads, HEAD_DIM=dim, PAGE_SIZE=index_k.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
                      **dot_args(index_k))
    launch(_index_scores_kernel, lambda c: (t, triton.cdiv(width, c["BLOCK_N"])), args, constexprs,
           {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}, tile_keys=("BLOCK_N",))
    return out


@triton.jit
def _load_entries(KV, slot, ok, offs_r, offs_p, stride_kn, stride_kd,
                  LAYOUT: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, NB: tl.constexpr,
                  FP8_BLOCK_C: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Entries of ``slot`` [BLOCK_N] -> latent [BLOCK_N, BLOCK_R], rope [BLOCK_N, BLOCK_P] in DOT_DTYPE."""
    r_mask = ok[:, None] & (offs_r[None, :] < RANK)
    p_mask = ok[:, None] & (offs_p[None, :] < ROPE)
    row = KV + slot[:, None] * stride_kn
    if LAYOUT == 0:
        # Straight from memory in the cache dtype (a no-op cast on the GPU), as decode.py's tiles are.
        lat = tl.load(row + offs_r[None, :] * stride_kd, mask=r_mask, other=0.0).to(DOT_DTYPE)
        rope = tl.load(row + (RANK + offs_p[None, :]) * stride_kd, mask=p_mask, other=0.0).to(DOT_DTYPE)
    else:
        s = tl.load((row + RANK).to(tl.pointer_type(tl.float32)) + offs_r[None, :] // FP8_BLOCK_C,
                    mask=r_mask, other=0.0)
        lat = fp8_value(tl.load(row + offs_r[None, :], mask=r_mask, other=0)) * s
        rope = tl.load((row + RANK + 4 * NB).to(tl.pointer_type(tl.bfloat16)) + offs_p[None, :],
                       mask=p_mask, other=0.0).to(tl.float32)
    return lat.to(DOT_DTYPE), rope.to(DOT_DTYPE)


@triton.jit
def _sparse_mla_kernel(
    Q, KV, SLOTS, O,
    stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kd,
    stride_st, stride_sk,
    stride_ot, stride_oh, stride_od,
    num_selected, sm_scale,
    NUM_HEADS: tl.constexpr,
    LAYOUT: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    NB: tl.constexpr,
    FP8_BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    q_row = Q + t * stride_qt + heads[None, :] * stride_qh
    q_lat = tl.load(q_row + offs_r[:, None] * stride_qd, mask=h_ok[None, :] & (offs_r[:, None] < RANK),
                    other=0.0).to(DOT_DTYPE)  # [BLOCK_R, BLOCK_H]
    q_rope = tl.load(q_row + (RANK + offs_p[:, None]) * stride_qd, mask=h_ok[None, :] & (offs_p[:, None] < ROPE),
                     other=0.0).to(DOT_DTYPE)  # [BLOCK_P, BLOCK_H]

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp
    for start in range(0, num_selected, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        slot = tl.load(SLOTS + t * stride_st + offs_n * stride_sk, mask=offs_n < num_selected, other=-1)
        ok = slot >= 0
        lat, rope = _load_entries(KV, tl.where(ok, slot, 0).to(tl.int64), ok, offs_r, offs_p, stride_kn, stride_kd,
                                  LAYOUT, RANK, ROPE, NB, FP8_BLOCK_C, DOT_DTYPE)
        qk = tl.dot(lat, q_lat, input_precision=DOT_PREC)
        qk += tl.dot(rope, q_rope, input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_H]
        qk = tl.where(ok[:, None], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 0))
        p = tl.exp2(qk - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(lat), p.to(DOT_DTYPE), input_precision=DOT_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[None, :]
    tl.store(O + t * stride_ot + heads[None, :] * stride_oh + offs_r[:, None] * stride_od,
             out.to(O.dtype.element_ty), mask=h_ok[None, :] & (offs_r[:, None] < RANK))


def sparse_mla(
    q: torch.Tensor,  # [T, H, rank + rope], absorbed
    kv: torch.Tensor,  # BF16 layout: [num_slots, rank + rope] model dtype; else [num_slots, row_bytes] uint8
    slots: torch.Tensor,  # [T, k] int64, -1 = none
    layout: KVLayout,
    *,
    rank: int,
    scale: float,
) -> torch.Tensor:  # [T, H, rank], q's dtype
    t, heads, dim = q.shape
    rope = dim - rank
    layout.check(rank, rope)
    if (layout is KVLayout.BF16) != (kv.dtype != torch.uint8):
        raise BackendError(f"sparse_mla got a {kv.dtype} cache for KV layout {layout.value}",
                           fix="pass the pool's entries for bf16, the LayoutCache rows for the fp8 layouts")
    out = torch.empty(t, heads, rank, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    block_h = _tile(min(heads, 64))
    wide = rank >= 256
    block_n = 32 if wide else 64
    if q.dtype == torch.float32 or q.device.type != "cuda":
        block_n = MIN_TILE
    args = (q, kv, slots, out, q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
            slots.stride(0), slots.stride(1), out.stride(0), out.stride(1), out.stride(2),
            slots.shape[1], float(scale))
    constexprs = dict(NUM_HEADS=heads, LAYOUT=_LAYOUT_ID[layout], RANK=rank, ROPE=rope, NB=rank // FP8_BLOCK,
                      FP8_BLOCK_C=FP8_BLOCK, BLOCK_R=_tile(rank), BLOCK_P=_tile(rope), **dot_args(q))
    cfg = {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": 8 if wide and block_h > MIN_TILE else 4,
           "num_stages": 2 if wide else 1}
    launch(_sparse_mla_kernel, lambda c: (t, triton.cdiv(heads, c["BLOCK_H"])), args, constexprs, cfg,
           tile_keys=("BLOCK_N", "BLOCK_H"))
    return out
