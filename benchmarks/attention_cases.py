"""The attention benchmarks' cases: real models' attention shapes, and one layer's pool, step metadata and
query for a (shape, mode, batch, context), with the bytes and FLOPs such a step must move and do. Shared by
attention.py and attention_triton.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention
from attnzoo.attention.metadata import ForwardMode, build_metadata


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None
    kind: str = "mha"
    source: str = ""


# Public configs: Llama-3.1-8B config.json; Gemma-4-31B text_config (num_attention_heads 32,
# num_key_value_heads 16 / head_dim 256 on sliding layers with sliding_window 1024,
# num_global_key_value_heads 4 / global_head_dim 512 on full-attention layers); DeepSeek-V3 absorbed
# MLA (128 heads, kv_lora_rank 512 + qk_rope_head_dim 64).
SHAPES = {
    s.name: s
    for s in (
        Shape("llama3.1-8b", 32, 8, 128, 128, source="meta-llama/Llama-3.1-8B"),
        Shape("gemma4-31b-global", 32, 4, 512, 512, source="google/gemma-4-31B-it full_attention"),
        Shape("gemma4-31b-sliding", 32, 16, 256, 256, window=1024, source="google/gemma-4-31B-it sliding_attention"),
        Shape("deepseek-v3-mla", 128, 1, 576, 512, kind="mla", source="deepseek-ai/DeepSeek-V3 absorbed MLA"),
    )
}
DEFAULT_SHAPES = ["llama3.1-8b", "gemma4-31b-global", "gemma4-31b-sliding"]


def layer_for(shape: Shape) -> Attention:
    return Attention(0, shape.heads, shape.kv_heads, shape.head_dim, v_head_dim=shape.v_head_dim,
                     sliding_window=shape.window, kind=shape.kind)


class Case:
    """One layer's pool, step metadata and query for (shape, mode, batch, context)."""

    def __init__(self, shape: Shape, mode: str, batch: int, ctx: int, page_size: int, dtype, device, seed=0):
        self.shape, self.mode, self.batch, self.ctx = shape, mode, batch, ctx
        self.layer = layer_for(shape)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        pages_per_req = -(-ctx // page_size)
        # Decode over a sliding window only reads the last `window` tokens: give the earlier positions
        # page 0 (reserved, never read by a correct kernel) so long contexts fit in memory.
        first_real = 0
        if mode == "decode" and shape.window:
            first_real = max(0, (ctx - shape.window) // page_size)
        real = pages_per_req - first_real
        num_pages = batch * real + 1
        self.pool = KVPool([self.layer.kv_cache_spec()], num_pages=num_pages, page_size=page_size,
                           dtype=dtype, device=device)
        self.pool.buffer.view(dtype).normal_()
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # fragmented, like a busy cache
        tables = [[0] * first_real + order[i * real:(i + 1) * real] for i in range(batch)]
        if mode == "decode":
            prefix, q_lens = [ctx - 1] * batch, [1] * batch
        else:
            prefix, q_lens = [0] * batch, [ctx] * batch
        self.meta = build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=tables, page_size=page_size,
                                   device=device, mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND)
        tokens = sum(q_lens)
        self.q = torch.randn(tokens, shape.heads, shape.head_dim, device=device, dtype=dtype)

    def run(self, backend, plan):
        if self.mode == "decode":
            return backend.decode(self.layer, self.q, self.meta, plan)
        return backend.extend(self.layer, self.q, self.meta, plan)

    def bytes_moved(self) -> int:
        """q read + the KV each query needs read once + output written."""
        s, elt = self.shape, self.q.element_size()
        tokens = self.q.shape[0]
        kv_tokens = self.batch * (min(self.ctx, s.window) if (s.window and self.mode == "decode") else self.ctx)
        per_kv_token = s.kv_heads * (s.head_dim + (0 if s.kind == "mla" else s.v_head_dim))
        return elt * (tokens * s.heads * s.head_dim + kv_tokens * per_kv_token + tokens * s.heads * s.v_head_dim)

    def flops(self) -> float:
        """2 * (head_dim + v_head_dim) per visible (query, key) pair and head."""
        s = self.shape
        if self.mode == "decode":
            pairs = self.batch * (min(self.ctx, s.window) if s.window else self.ctx)
        else:
            n, w = self.ctx, s.window or self.ctx
            full = n * (n + 1) / 2  # causal triangle
            if w < n:
                full -= (n - w) * (n - w + 1) / 2  # keys that fell out of every window
            pairs = self.batch * full
        return 2.0 * s.heads * (s.head_dim + s.v_head_dim) * pairs


def kv_bytes_needed(shape: Shape, mode: str, batch: int, ctx: int, page_size: int, elt: int) -> int:
    kv = shape.kv_heads * (shape.head_dim + (0 if shape.kind == "mla" else shape.v_head_dim)) * elt
    tokens_kept = min(ctx, shape.window + 2 * page_size) if (mode == "decode" and shape.window) else ctx
    q_and_out = (ctx if mode == "extend" else 1) * shape.heads * (shape.head_dim + shape.v_head_dim) * elt
    return batch * (tokens_kept * kv + q_and_out)
