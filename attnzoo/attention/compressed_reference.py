"""Compressed attention (DeepSeek-V4) in plain float32 torch, one request at a time: the oracle the
torch backend runs and the Triton kernels are tested against (``attention/compressed.py`` says what is
stored where). Imports nothing of attnzoo's but the batch metadata."""
from __future__ import annotations

import torch

from attnzoo.attention.metadata import BatchMetadata


def entry_slots(block_tables: torch.Tensor, reqs: torch.Tensor, w: torch.Tensor, rate: int, page_size: int):
    """Flat slots of entries ``w`` (any shape, int64, >= 0) of requests ``reqs`` (broadcast): the page of
    the block's last token, ``entries_per_page`` slots per page."""
    epp = -(-page_size // rate)
    last = w * rate + rate - 1
    return block_tables.long()[reqs, last // page_size] * epp + (last % page_size) // rate


def _requests(meta: BatchMetadata):
    """(request, its rows of the flat batch, positions of those rows) per request."""
    start = 0
    for i, q_len in enumerate(meta.q_lens_cpu):
        rows = slice(start, start + q_len)
        yield i, rows, meta.positions[rows]
        start += q_len


def topk_reference(
    index_keys: torch.Tensor,  # [num_pages, entries_per_page, Di]: the pool's indexer keys of the layer
    q: torch.Tensor,  # [T, Hi, Di], roped
    weights: torch.Tensor,  # [T, Hi] float32, already / sqrt(Hi)
    meta: BatchMetadata,
    *,
    rate: int,
    topk: int,
    scale: float,
) -> torch.Tensor:  # [T, k] int32 entry numbers, -1 = none
    """Scores I(p, w) = sum_h w_h(p) relu(q_h(p) . K(w)) * scale over the entries w < (p + 1) // rate of
    the request, and the ``topk`` best of them (torch.topk's order and ties, as the reference)."""
    dev = q.device
    width = min(topk, max(meta.seq_lens_cpu) // rate)
    out = torch.full((q.shape[0], width), -1, dtype=torch.int32, device=dev)
    if width == 0:
        return out
    flat = index_keys.reshape(-1, index_keys.shape[-1])
    for i, rows, pos in _requests(meta):
        n = meta.seq_lens_cpu[i] // rate
        if n == 0:
            continue
        w = torch.arange(n, device=dev)
        keys = flat[entry_slots(meta.block_tables, torch.full_like(w, i), w, rate, meta.page_size)].float()
        s = torch.relu(torch.einsum("thd,nd->thn", q[rows].float(), keys)) * scale
        scores = (s * weights[rows, :, None].float()).sum(1)  # [q, n]
        scores = scores.masked_fill(w[None, :] >= ((pos + 1) // rate)[:, None], float("-inf"))
        vals, idx = scores.topk(min(topk, n), dim=-1)
        out[rows, : idx.shape[1]] = idx.masked_fill(vals == float("-inf"), -1).to(torch.int32)
    return out


def attend_reference(
    window_k: torch.Tensor,  # [num_pages, 1, page_size, D]: the layer's raw keys (= values)
    compressed: torch.Tensor | None,  # [num_pages, entries_per_page, D]; None: a sliding-only layer
    q: torch.Tensor,  # [T, H, D]
    sinks: torch.Tensor,  # [H] float32
    entry_ids: torch.Tensor | None,  # [T, k] int32 (CSA), -1 = none; None: every completed entry (HCA)
    meta: BatchMetadata,
    *,
    window: int,
    rate: int,
    scale: float,
) -> torch.Tensor:  # [T, H, D] float32
    dev, ps, d = q.device, meta.page_size, q.shape[-1]
    out = torch.empty(q.shape, dtype=torch.float32, device=dev)
    raw_flat = window_k.reshape(-1, d)
    comp_flat = compressed.reshape(-1, d) if compressed is not None else None
    tables = meta.block_tables_for(window)
    for i, rows, pos in _requests(meta):
        seq = meta.seq_lens_cpu[i]
        lo = max(0, seq - meta.q_lens_cpu[i] - window + 1)  # the first key any query of the request sees
        j = torch.arange(lo, seq, device=dev)
        keys = raw_flat[tables[i].long()[j // ps] * ps + j % ps].float()  # [L, D]
        qf = q[rows].float()
        logits = [torch.einsum("thd,ld->thl", qf, keys).masked_fill(
            ((j[None, :] > pos[:, None]) | (j[None, :] <= pos[:, None] - window))[:, None, :], float("-inf"))]
        values = [keys.expand(qf.shape[0], -1, -1)]
        if comp_flat is not None and seq // rate:
            if entry_ids is None:
                w = torch.arange(seq // rate, device=dev)
                ck = comp_flat[entry_slots(meta.block_tables, torch.full_like(w, i), w, rate, ps)].float()
                hidden = w[None, :] >= ((pos + 1) // rate)[:, None]  # [q, n]
                ck = ck.expand(qf.shape[0], -1, -1)
            else:
                ids = entry_ids[rows].long()
                ck = comp_flat[entry_slots(meta.block_tables, torch.full_like(ids, i), ids.clamp_min(0), rate, ps)]
                ck, hidden = ck.float(), ids < 0
            logits.append(torch.einsum("thd,tnd->thn", qf, ck).masked_fill(hidden[:, None, :], float("-inf")))
            values.append(ck)
        scores = torch.cat(logits, dim=-1) * scale
        sink = sinks.float()[None, :, None].expand(qf.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[rows] = torch.einsum("thl,tld->thd", probs, torch.cat(values, dim=1))
    return out
