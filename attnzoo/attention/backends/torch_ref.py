"""The torch reference backend: exact attention in float32 over the gathered pages.

It is the oracle every other backend is tested against, on CPU and GPU, so it favours plainness over
speed: one request at a time, the whole score matrix materialised. An fp8 pool is read by
dequantizing (value times the pool's per-tensor scale, in float32): quantize-dequantize, so the fp8
KV cache runs, and is checked, on the CPU.
"""
from __future__ import annotations

import torch

from attnzoo.attention.backends.base import NSABackend, NSAPlan, StepPlan
from attnzoo.attention.backends.capabilities import ALL_DTYPES, FP8_KV, GPUS, BackendCapabilities, Kernel
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.attention.reference import (
    attention_reference,
    dequantize,
    entries_of,
    gather_kv,
    indexer_scores_reference,
    positions_to_slots,
    select_topk,
    sparse_mla_reference,
)


class TorchBackend(NSABackend):
    capabilities = BackendCapabilities(
        name="torch",
        description="exact float32-accumulating reference over gathered pages; the correctness oracle",
        kinds=frozenset({"mha", "mla", "nsa"}),
        prefill=(Kernel("torch reference", frozenset(GPUS)),),
        decode=(Kernel("torch reference", frozenset(GPUS)),),
        max_head_dim=1024,
        kv_dtypes=ALL_DTYPES | FP8_KV,
        sliding_window=True,
        logit_softcap=True,
        module="torch",
        mla_kv_layout="bf16",  # NSA layers: it reads the pool's own entries
        notes=("fp8_e4m3 KV cache: quantize-dequantize in float32 (per-tensor scales)",),
    )

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        self.require_pool()

    def _run(self, layer, q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        k_cache, v_cache = self.pool.k(layer.layer_id), self.pool.v(layer.layer_id)
        ps = meta.page_size
        out = torch.empty(q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device)
        start = 0
        for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.q_lens_cpu)):
            pages = meta.block_tables_for(layer.sliding_window)[i, : -(-seq_len // ps)]
            k = dequantize(gather_kv(k_cache, pages, seq_len), self.pool.k_scale)
            v = dequantize(gather_kv(v_cache, pages, seq_len), self.pool.v_scale)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            if layer.sliding_window:  # keys before every query's window (released pages read page 0): zeros
                seen = torch.arange(seq_len, device=q.device) > seq_len - q_len - layer.sliding_window
                k, v = torch.where(seen[:, None, None], k, 0), torch.where(seen[:, None, None], v, 0)
            o = attention_reference(
                q[start : start + q_len], k, v, q_pos,
                scale=layer.scale, sliding_window=layer.sliding_window, logit_softcap=layer.logit_softcap,
            )
            out[start : start + q_len] = o.to(q.dtype)
            start += q_len
        return out

    def extend(self, layer, q, meta, plan: StepPlan):
        self.check_layer("prefill", layer)
        return self._run(layer, q, meta)

    def decode(self, layer, q, meta, plan: StepPlan):
        """All requests at once (one query each), padded to the longest context and masked."""
        self.check_layer("decode", layer)
        k_cache, v_cache = self.pool.k(layer.layer_id), self.pool.v(layer.layer_id)
        b, max_len = q.shape[0], meta.max_seq_len
        pages = meta.block_tables_for(layer.sliding_window)[:, : -(-max_len // meta.page_size)]  # [B, n]

        def gather(cache, scale):  # -> [B, Hkv, max_len, dim] float32
            g = dequantize(cache[pages], scale).float()  # [B, n, Hkv, page_size, dim]
            return g.transpose(1, 2).reshape(b, g.shape[2], -1, g.shape[-1])[:, :, :max_len]

        k, v = gather(k_cache, self.pool.k_scale), gather(v_cache, self.pool.v_scale)
        kpos = torch.arange(max_len, device=q.device).view(1, -1)
        qpos = (meta.seq_lens.long() - 1).view(-1, 1)
        visible = kpos <= qpos
        if layer.sliding_window:
            visible &= kpos > qpos - layer.sliding_window
            # keys outside the window (released pages read page 0) enter as zeros, not as page 0's entries
            k, v = (torch.where(visible[:, None, :, None], x, 0) for x in (k, v))
        qg = q.float().view(b, layer.num_kv_heads, -1, q.shape[-1])  # [B, Hkv, group, D]
        scores = (qg @ k.transpose(-1, -2)) * layer.scale  # [B, Hkv, group, max_len]
        if layer.logit_softcap:
            scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [B, Hkv, group, Dv]
        return out.reshape(b, layer.num_heads, layer.v_head_dim).to(q.dtype)

    # ---- NSA (DeepSeek-V3.2) layers: the reference indexer and sparse MLA (attention/reference.py) ----
    def nsa_topk(self, layer, q, weights, meta, plan: NSAPlan, *, topk, scale):
        scores = indexer_scores_reference(self.pool.index_k(layer.layer_id), q, weights, meta, scale=scale)
        return select_topk(scores, topk)

    def nsa_sparse_mla(self, layer, q, positions, meta, plan: NSAPlan):
        slots = positions_to_slots(positions, meta, plan.token_reqs, plan.shared)
        entries = entries_of(layer, self.pool)
        return sparse_mla_reference(entries, q, slots, rank=layer.v_head_dim, scale=layer.scale).to(q.dtype)
