"""gpt-oss (GptOssForCausalLM): GQA with attention sinks (a learned logit per query head in every softmax
denominator), sliding-window and full layers alternating (``layer_types``), YaRN RoPE, q/k/v/o biases,
and a top-k MoE with a biased router, biased experts and a clamped SwiGLU on every layer.

transformers' ``gpt_oss`` is the reference. The checkpoint stacks each layer's experts as
``mlp.experts.gate_up_proj`` [E, H, 2I] (gate and up interleaved along 2I), ``down_proj`` [E, I, H] and
their biases; the official checkpoints store the two weights MXFP4 (``*_blocks`` / ``*_scales``), which
``models.mxfp4`` dequantizes at load to the model dtype.
"""
from __future__ import annotations

from torch import nn

from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.errors import ModelLoadError
from attnzoo.layers.moe import FusedMoE, select_experts
from attnzoo.layers.parallel import (
    SINGLE, ParallelLMHead, RowParallelLinear, TPContext, mark_shard, narrow,
)
from attnzoo.models.common import (
    DecoderLayer, DecoderLM, DecoderModel, MergedLinear, RotaryEmbedding, apply_rope_qk,
)


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPContext = SINGLE):
        super().__init__()
        h, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.num_heads = tp.split(heads, "num_attention_heads")
        first_kv, self.num_kv_heads = tp.kv_heads(kv_heads, heads)
        kv_rows = (first_kv * d, self.num_kv_heads * d)
        bias = config.attention_bias
        self.qkv_proj = MergedLinear(h, {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d},
                                     bias=bias, tp=tp, shards={"k_proj": kv_rows, "v_proj": kv_rows})
        self.o_proj = RowParallelLinear(heads * d, h, bias=bias, tp=tp)
        sliding = config.layer_types[layer_id] == "sliding_attention"
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, d,
                              sliding_window=config.sliding_window if sliding else None, sinks=True)
        if tp.world_size > 1:  # this rank's query heads' sinks
            mark_shard(self.attn.sinks, narrow(0, tp.rank * self.num_heads, self.num_heads, heads))

    def forward(self, x, cos, sin, ctx: ForwardContext):
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = apply_rope_qk(q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                             cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, ctx))


class GptOssMLP(nn.Module):
    """Router logits (with bias) -> top-k, softmax over the k chosen logits (= the renormalised top-k of
    the full softmax) -> experts with biases and the clamped SwiGLU. Under tensor parallelism each rank
    holds whole experts (expert parallel) and the partial sums are all-reduced."""

    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        first, local = tp.shard(config.num_local_experts, "num_local_experts")
        if (config.swiglu_alpha, config.swiglu_limit) != (1.702, 7.0):
            raise ModelLoadError(f"swiglu_alpha {config.swiglu_alpha} / swiglu_limit {config.swiglu_limit} differ from "
                                 "gpt-oss's 1.702 / 7.0, the constants of the fused activation",
                                 fix="use a gpt-oss config with the released swiglu_alpha and swiglu_limit")
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                "swiglu_clamped", experts=range(first, first + local), bias=True,
                                stacked_layout="interleaved_t", init_std=config.initializer_range)
        self.tp = tp

    def forward(self, x):
        w, idx = select_experts(self.router(x).float(), top_k=self.top_k, sigmoid=False, renormalize=True)
        return self.tp.all_reduce(self.experts(x, w, idx))


class GptOssForCausalLM(DecoderLM):
    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        layers = (DecoderLayer(h, eps, GptOssAttention(config, i, tp), GptOssMLP(config, tp))
                  for i in range(config.num_hidden_layers))
        self.model = DecoderModel(config, layers, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp=tp)
        self.tied_lm_head = bool(getattr(config, "tie_word_embeddings", False))
        rope_type = config.rope_parameters.get("rope_type", "default")
        self.rotary = RotaryEmbedding(config, rope_type=rope_type, head_dim=config.head_dim)

    def checkpoint_name(self, name: str) -> str | None:
        # The sinks live on the shared attention layer, which the backends read.
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")

