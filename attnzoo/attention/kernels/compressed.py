"""Triton kernels for compressed (DeepSeek-V4) attention: the indexer's scores over a CSA layer's
compressed indexer keys, and attention over the raw window plus compressed entries in one kernel
(``attention/compressed.py`` says what is stored where; ``compressed_reference.py`` is the oracle).

``attend``: one program per (query token, block of heads), for prefill and decode alike (every query
token reads its own window and its own entries). It walks the token's raw window through the window
block table, then its compressed entries (HCA: every block that ended at or before it; CSA: the
indexer's picks, -1 = none) through the full block table, with one online softmax over both; the keys
are the values (one KV head). The per-head sink logit joins the softmax's denominator at the end.

``scores``: one program per (query token, block of entries): sum_h w_h relu(q_h . K(w) * scale), -inf
where the entry's block has not ended at the token (w >= (p + 1) // rate).

Tiles are keys-major (scores [keys, heads]) as in ``nsa.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnzoo.attention.kernels.common import MIN_TILE, dot_args, launch

LOG2E = 1.4426950408889634


def _tile(n: int) -> int:
    return max(MIN_TILE, triton.next_power_of_2(n))


@triton.jit
def _entry_slot(BT, req, w, stride_btb, RATE: tl.constexpr, PAGE_SIZE: tl.constexpr, EPP: tl.constexpr, ok):
    last = w * RATE + RATE - 1
    page = tl.load(BT + req * stride_btb + last // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    return page * EPP + (last % PAGE_SIZE) // RATE


@triton.jit
def _online(qk, keys, m_i, l_i, acc, ok, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
    qk = tl.where(ok[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 0))
    p = tl.exp2(qk - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 0)
    acc = acc * alpha[None, :] + tl.dot(tl.trans(keys), p.to(DOT_DTYPE), input_precision=DOT_PREC)
    return m_new, l_i, acc


# Per-step values (block-table widths, top-k widths) are not specialized on: each new 1 / multiple-of-16 case
# compiled a variant in the middle of a measured run.
@triton.jit(do_not_specialize=["stride_wtb", "stride_btb", "stride_it", "num_ids"])
def _attend_kernel(
    Q, RAW, COMP, SINKS, WT, BT, REQ, POS, IDS, O,
    stride_qt, stride_qh, stride_qd,
    stride_wtb, stride_btb, stride_it, stride_ik,
    stride_ot, stride_oh, stride_od,
    num_ids, qk_scale,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    RATE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    EPP: tl.constexpr,
    MODE: tl.constexpr,  # 0 sliding only, 1 every completed entry (HCA), 2 the indexer's picks (CSA)
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # The head blocks of one token are neighbours in launch order: they read the same keys, so the second
    # and later ones find them in L2.
    head_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    t = (tl.program_id(0) // head_blocks).to(tl.int64)  # t * stride_qt passes 2^31 at 65,536 V4 tokens
    heads = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    req = tl.load(REQ + t).to(tl.int64)
    pos = tl.load(POS + t)
    q = tl.load(Q + t * stride_qt + heads[None, :] * stride_qh + offs_d[:, None] * stride_qd,
                mask=h_ok[None, :] & d_ok[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_D, BLOCK_H]

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
    lo = tl.maximum(pos - WINDOW + 1, 0)
    for start in range(0, WINDOW, BLOCK_N):  # the raw window, through the window block table
        j = lo + start + tl.arange(0, BLOCK_N)
        ok = j <= pos
        page = tl.load(WT + req * stride_wtb + j // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + j % PAGE_SIZE
        keys = tl.load(RAW + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                       other=0.0).to(DOT_DTYPE)
        qk = tl.dot(keys, q, input_precision=DOT_PREC) * qk_scale
        m_i, l_i, acc = _online(qk, keys, m_i, l_i, acc, ok, DOT_DTYPE, DOT_PREC)
    if MODE != 0:
        n = (pos + 1) // RATE if MODE == 1 else num_ids
        for start in range(0, n, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            if MODE == 1:
                w = offs
                ok = offs < n
            else:
                w = tl.load(IDS + t * stride_it + offs * stride_ik, mask=offs < n, other=-1)
                ok = w >= 0
            w = tl.where(ok, w, 0)
            slot = _entry_slot(BT, req, w, stride_btb, RATE, PAGE_SIZE, EPP, ok)
            keys = tl.load(COMP + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                           other=0.0).to(DOT_DTYPE)
            qk = tl.dot(keys, q, input_precision=DOT_PREC) * qk_scale
            m_i, l_i, acc = _online(qk, keys, m_i, l_i, acc, ok, DOT_DTYPE, DOT_PREC)
    sink = tl.load(SINKS + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.exp2(sink - m_new)
    out = acc * alpha[None, :] / l_i[None, :]
    tl.store(O + t * stride_ot + heads[None, :] * stride_oh + offs_d[:, None] * stride_od,
             out.to(O.dtype.element_ty), mask=h_ok[None, :] & d_ok[:, None])


def attend(
    q: torch.Tensor,  # [T, H, D]
    raw: torch.Tensor,  # [num_window_pages * page_size, D]: raw keys (= values), flat by slot
    compressed: torch.Tensor | None,  # [num_pages * entries_per_page, D], flat by entry slot; None: sliding
    sinks: torch.Tensor,  # [H] float32
    window_tables: torch.Tensor,  # [num_reqs, cols] int32: the raw keys' page ids
    block_tables: torch.Tensor,  # [num_reqs, cols] int32: the full group's (entries)
    token_reqs: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [T] int64
    entry_ids: torch.Tensor | None,  # [T, k] int32 (CSA), -1 = none; None: every completed entry
    *,
    window: int,
    rate: int,
    page_size: int,
    scale: float,
    config: dict | None = None,  # a launch config (attend_tiles' keys); None: attend_tiles'
) -> torch.Tensor:  # [T, H, D] float32
    t, heads, dim = q.shape
    out = torch.empty(t, heads, dim, dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    mode = 0 if compressed is None else 1 if entry_ids is None else 2
    comp = raw if compressed is None else compressed
    ids = entry_ids if entry_ids is not None else positions.view(-1, 1)  # unread unless MODE 2
    args = (q, raw, comp, sinks.float().contiguous(), window_tables, block_tables, token_reqs, positions, ids, out,
            q.stride(0), q.stride(1), q.stride(2), window_tables.stride(0), block_tables.stride(0),
            ids.stride(0), ids.stride(1), out.stride(0), out.stride(1), out.stride(2),
            ids.shape[1] if mode == 2 else 0, float(scale) * LOG2E)
    constexprs = dict(NUM_HEADS=heads, HEAD_DIM=dim, WINDOW=window, RATE=max(rate, 1), PAGE_SIZE=page_size,
                      EPP=-(-page_size // max(rate, 1)), MODE=mode, BLOCK_D=_tile(dim), **dot_args(raw))
    launch(_attend_kernel, lambda c: (t * triton.cdiv(heads, c["BLOCK_H"]),), args, constexprs,
           dict(config or attend_tiles(heads, dim, q.device.type == "cuda")), tile_keys=("BLOCK_N", "BLOCK_H"))
    return out


def attend_tiles(heads: int, dim: int, on_cuda: bool) -> dict:
    """``attend``'s launch config: heads per program (BLOCK_H), keys per step (BLOCK_N), warps, stages.

    ``benchmarks/compressed_attend.py`` sweeps these at V4-Flash's shapes.
    """
    cfg = {"BLOCK_H": _tile(min(heads, 64)), "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    if not on_cuda:
        cfg["BLOCK_N"] = MIN_TILE
    elif dim > 256:  # V4's heads: all 64 in one program read each key once; two stages overlap the next gather
        cfg.update(num_warps=8, num_stages=2)
    return cfg


@triton.jit(do_not_specialize=["stride_btb", "stride_ot", "width"])
def _scores_kernel(
    Q, W, K, BT, REQ, POS, OUT,
    stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_btb, stride_ot,
    width, scale,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    RATE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    EPP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    t = tl.program_id(0)
    w = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < NUM_HEADS
    d_ok = offs_d < HEAD_DIM
    req = tl.load(REQ + t).to(tl.int64)
    pos = tl.load(POS + t)
    visible = w < (pos + 1) // RATE
    q = tl.load(Q + t * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None] * stride_qd,
                mask=h_ok[None, :] & d_ok[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_D, BLOCK_H]
    hw = tl.load(W + t * stride_wt + offs_h * stride_wh, mask=h_ok, other=0.0)
    slot = _entry_slot(BT, req, tl.where(visible, w, 0), stride_btb, RATE, PAGE_SIZE, EPP, visible)
    k = tl.load(K + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=visible[:, None] & d_ok[None, :],
                other=0.0).to(DOT_DTYPE)
    s = tl.dot(k, q, input_precision=DOT_PREC) * scale  # [BLOCK_N, BLOCK_H]
    score = tl.sum(tl.maximum(s, 0.0) * hw[None, :], 1)
    tl.store(OUT + t * stride_ot + w, tl.where(visible, score, float("-inf")), mask=w < width)


def scores(
    q: torch.Tensor,  # [T, Hi, Di], roped
    weights: torch.Tensor,  # [T, Hi] float32, already / sqrt(Hi)
    keys: torch.Tensor,  # [num_pages * entries_per_page, Di]: the indexer keys, flat by entry slot
    block_tables: torch.Tensor,  # [num_reqs, cols] int32 (full group)
    token_reqs: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [T] int64
    *,
    width: int,  # columns: the most entries any request of the step has
    rate: int,
    page_size: int,
    scale: float,
) -> torch.Tensor:  # [T, width] float32, -inf where not visible
    t, heads, dim = q.shape
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    weights = weights.float()
    block_n = MIN_TILE if q.device.type != "cuda" else 64
    args = (q, weights, keys, block_tables, token_reqs, positions, out,
            q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1), block_tables.stride(0),
            out.stride(0), width, float(scale))
    constexprs = dict(NUM_HEADS=heads, HEAD_DIM=dim, RATE=rate, PAGE_SIZE=page_size, EPP=-(-page_size // rate),
                      BLOCK_H=_tile(heads), BLOCK_D=_tile(dim), **dot_args(keys))
    launch(_scores_kernel, lambda c: (t, triton.cdiv(width, c["BLOCK_N"])), args, constexprs,
           {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}, tile_keys=("BLOCK_N",))
    return out
