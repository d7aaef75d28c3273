"""Reference attention math in plain float32 torch: the oracle every kernel is tested against.

It sits below the backends and the attention layers (the torch backend, the MLA and NSA layers and the
tests build on it) and imports nothing of attnzoo's but the batch metadata type, so no import circle
can pass through it: dense paged attention, and NSA's indexer scores, top-k selection and sparse MLA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo.attention.metadata import BatchMetadata


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_pages, heads, page_size, dim] pool view + a request's page ids -> [seq_len, heads, dim]."""
    g = cache[pages]  # [n, heads, page_size, dim]
    return g.permute(0, 2, 1, 3).reshape(-1, g.shape[1], g.shape[3])[:seq_len]


def attention_reference(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [kv_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [kv_len, num_kv_heads, v_head_dim]
    q_positions: torch.Tensor,  # [q_len] absolute positions of the queries (keys sit at 0..kv_len-1)
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head that joins every softmax denominator
) -> torch.Tensor:  # [q_len, num_heads, v_head_dim], float32
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [H, q, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [H, q, kv]
    if logit_softcap:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    kpos = torch.arange(k.shape[0], device=q.device)
    qpos = q_positions.to(q.device).view(-1, 1)
    visible = kpos.view(1, -1) <= qpos
    if sliding_window:
        visible &= kpos.view(1, -1) > qpos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(-1, 1, 1) if sinks is not None else None  # [H, 1, 1]
    return (softmax_with_sinks(scores, sink) @ vf).transpose(0, 1)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim; with ``sinks`` (float32, shaped to broadcast against ``scores[..., :1]``)
    each row's denominator also holds exp(sink): a virtual key whose value is zero (gpt-oss)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def padded_attention_reference(
    q: torch.Tensor,  # [b, q_max, num_heads, head_dim]: b requests' queries, each padded to q_max rows
    q_positions: torch.Tensor,  # [b, q_max] int64 absolute positions (padding rows: any position >= 0)
    k_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim]: the pool's view
    v_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, v_head_dim]
    tables: torch.Tensor,  # [b, n] page ids of each request; n pages hold kv_len tokens
    kv_len: int,  # keys read per request: the longest context among the b
    *,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]: attention sinks (see attention_reference)
) -> torch.Tensor:  # [b, q_max, num_heads, v_head_dim], float32
    """``attention_reference`` of b requests in one batch, in the same float32 operations: keys and values
    gathered from their pages and padded to ``kv_len``; keys past a request's context sit after all of
    its queries, so the causal mask hides them. A request costs no Python of its own, so a step of
    thousands of requests is a few dozen ops per layer on a GPU, not thousands."""
    b, q_max, h, d = q.shape
    hkv = k_cache.shape[1]

    def gather(cache, s):  # -> [num_kv_heads, b, kv_len, dim] float32; heads first: the gather is one copy
        g = dequantize(cache.transpose(0, 1)[:, tables], s).float()  # [Hkv, b, n, page_size, dim]
        return g.flatten(2, 3)[:, :, :kv_len]

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    # Keys no query of its request sees (past its context: table padding; before every query's window:
    # released pages) read page 0: they enter as zeros, so none of page 0 reaches the result (0 x NaN would).
    kpos = torch.arange(kv_len, device=q.device)
    live = kpos <= q_positions[:, -1:]  # [b, kv_len]; a request's last padded query is its last real one
    if sliding_window:
        live &= kpos > q_positions[:, :1] - sliding_window
    k, v = (torch.where(live[None, :, :, None], x, 0) for x in (k, v))
    # Query head i reads kv head i // group (attention_reference's repeat_interleave).
    qf = q.float().view(b, q_max, hkv, h // hkv, d).permute(2, 0, 3, 1, 4).reshape(hkv, b, -1, d)
    scores = (qf @ k.transpose(-1, -2)) * scale  # [Hkv, b, group * q_max, kv_len]
    if logit_softcap:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    qpos = q_positions.view(b, 1, q_max, 1)
    visible = kpos <= qpos  # [b, 1, q_max, kv_len]
    if sliding_window:
        visible &= kpos > qpos - sliding_window
    scores = scores.view(hkv, b, -1, q_max, kv_len).masked_fill(~visible, float("-inf"))
    # Head i = kv head i // group, group member i % group: the scores' [Hkv, b, group, q_max] rows.
    sink = sinks.float().view(hkv, 1, h // hkv, 1, 1) if sinks is not None else None
    out = softmax_with_sinks(scores, sink).flatten(2, 3) @ v  # [Hkv, b, group * q_max, Dv]
    return out.view(hkv, b, -1, q_max, v.shape[-1]).permute(1, 3, 0, 2, 4).reshape(b, q_max, h, -1)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A gathered fp8 pool slice as float32 values (other dtypes pass through)."""
    return x.float() * scale if x.dtype == torch.float8_e4m3fn else x


def token_requests(meta: BatchMetadata) -> torch.Tensor:
    """[num_tokens] int64: the request each row of the flat batch belongs to."""
    dev = meta.positions.device
    lens = torch.tensor(meta.q_lens_cpu, device=dev)
    return torch.repeat_interleave(torch.arange(meta.num_reqs, device=dev), lens, output_size=meta.num_tokens)


@dataclass
class NSAStepCache:
    """Matrices every NSA layer of one step reads alike, kept on the step's plan (``base.NSAPlan``) by
    the first layer that asks. Each is (tensor, made while a CUDA graph was being captured)."""

    visible: tuple[torch.Tensor, bool] | None = None  # visible_positions: [num_tokens, max_seq_len] int32, device
    visible_slots: tuple[torch.Tensor, bool] | None = None  # their pool slots: [num_tokens, max_seq_len] int64, device


def _step_cached(meta: BatchMetadata, cache: NSAStepCache | None, name: str, make):
    """``make()``, computed once per step and shared by its layers (``cache`` None: not kept). Not across
    a CUDA-graph capture's start: a decode graph is captured right after an eager warm-up of the same step,
    and a tensor cached there would be replayed with the warm-up's values; inside the capture it is
    recomputed (and recorded)."""
    if cache is None:
        return make()
    capturing = meta.positions.is_cuda and torch.cuda.is_current_stream_capturing()
    hit = getattr(cache, name)
    if hit is None or hit[1] != capturing:
        hit = (make(), capturing)
        setattr(cache, name, hit)
    return hit[0]


def visible_positions(meta: BatchMetadata, cache: NSAStepCache | None = None) -> torch.Tensor:
    """[num_tokens, max_seq_len] int32: every position a token sees (j <= its position), -1 beyond.
    Built once per step with ``cache`` (every layer of a short-context step asks for the same matrix)."""
    def make():
        j = torch.arange(meta.max_seq_len, device=meta.positions.device, dtype=torch.int32)
        return torch.where(j[None, :] <= meta.positions[:, None], j[None, :], -1)

    return _step_cached(meta, cache, "visible", make)


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Index scores [T, S] float32 (-inf where not visible) -> [T, min(topk, S)] int32 positions, the
    best first; -1 where fewer than topk tokens are visible."""
    vals, idx = scores.topk(min(topk, scores.shape[-1]), dim=-1)
    return idx.masked_fill(vals == float("-inf"), -1).to(torch.int32)


def positions_to_slots(positions: torch.Tensor, meta: BatchMetadata, token_reqs: torch.Tensor | None = None,
                       cache: NSAStepCache | None = None) -> torch.Tensor:
    """Positions [T, k] (-1 = none) -> pool slots [T, k] int64 (page * page_size + offset; -1 = none).
    ``token_reqs``: ``token_requests(meta)`` when the caller already has it; ``cache``: the step's, where
    the slots of ``visible_positions`` are kept for its other layers."""
    def make():
        ps = meta.page_size
        pos = positions.long()
        clamped = pos.clamp_min(0)
        reqs = token_requests(meta) if token_reqs is None else token_reqs
        pages = meta.block_tables.long()[reqs[:, None], clamped // ps]
        return torch.where(pos >= 0, pages * ps + clamped % ps, -1)

    if cache is not None and cache.visible is not None and positions is cache.visible[0]:
        return _step_cached(meta, cache, "visible_slots", make)  # the same for every layer of the step
    return make()


def indexer_scores_reference(
    index_k: torch.Tensor,  # [num_pages, page_size, D] the pool's indexer keys
    q: torch.Tensor,  # [T, Hi, D], roped
    weights: torch.Tensor,  # [T, Hi] float32, already / sqrt(Hi)
    meta: BatchMetadata,
    *,
    scale: float,  # 1 / sqrt(D)
) -> torch.Tensor:  # [T, max_seq_len] float32, -inf where not visible
    """The indexer's scores in float32, one request at a time, in the reference's order of operations."""
    ps = meta.page_size
    out = torch.full((q.shape[0], meta.max_seq_len), float("-inf"), dtype=torch.float32, device=q.device)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.q_lens_cpu)):
        pos = torch.arange(seq_len, device=q.device)
        keys = index_k[meta.block_tables[i].long()[pos // ps], pos % ps].float()  # [S, D]
        rows = slice(start, start + q_len)
        s = torch.relu(torch.matmul(q[rows].float(), keys.T) * scale)  # [q_len, Hi, S]
        scores = torch.matmul(weights[rows, None, :], s)[:, 0]  # [q_len, S]
        visible = pos[None, :] <= meta.positions[rows, None]
        out[rows, :seq_len] = scores.masked_fill(~visible, float("-inf"))
        start += q_len
    return out


def sparse_mla_reference(
    entries: torch.Tensor,  # [num_slots, rank + rope]: the cache's entries, flat by slot
    q: torch.Tensor,  # [T, H, rank + rope], absorbed
    slots: torch.Tensor,  # [T, k] int64 slots of the selected tokens, -1 = none
    *,
    rank: int,
    scale: float,
) -> torch.Tensor:  # [T, H, rank] float32
    """Absorbed MLA of each query over its selected entries only, in float32."""
    kv = entries[slots.clamp_min(0)].float()  # [T, k, rank + rope]
    s = torch.einsum("thd,tkd->thk", q.float(), kv) * scale
    s = s.masked_fill((slots < 0)[:, None, :], float("-inf"))
    return torch.einsum("thk,tkr->thr", torch.softmax(s, dim=-1), kv[..., :rank])


def entries_of(layer, pool) -> torch.Tensor:
    """The pool's MLA entries of ``layer``, flat by slot: [num_pages * page_size, rank + rope]."""
    return pool.k(layer.layer_id).view(-1, layer.head_dim)
