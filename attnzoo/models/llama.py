"""Llama (LlamaForCausalLM): RMSNorm, RoPE (incl. llama3 scaling), GQA, SwiGLU, tied or untied head."""
from __future__ import annotations

import torch
from torch import nn

from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.models.common import CausalLM, GatedMLP, MergedLinear, RMSNorm, RotaryEmbedding, apply_rope_qk


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        bias = getattr(config, "attention_bias", False)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(h, {"q_proj": q, "k_proj": kv, "v_proj": kv}, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, ctx: ForwardContext):
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = apply_rope_qk(q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                             cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, ctx):
        """x: the previous layer's output; residual: the stream before it (None in the first layer).
        -> this layer's output and the stream before it: each add is fused with the norm after it."""
        x, residual = self.input_layernorm.add_and_norm(x, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(x, cos, sin, ctx), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied_lm_head = bool(getattr(config, "tie_word_embeddings", False))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope_type = config.rope_parameters.get("rope_type", "default")
        self.rotary = RotaryEmbedding(config, rope_type=rope_type, head_dim=head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        cos, sin = self.rotary(positions)
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
