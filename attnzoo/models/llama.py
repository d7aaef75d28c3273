"""Llama (LlamaForCausalLM): RMSNorm, RoPE (incl. llama3 scaling), GQA, SwiGLU, tied or untied head."""
from __future__ import annotations

from torch import nn

from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.layers.parallel import SINGLE, ParallelLMHead, RowParallelLinear, TPContext, VocabParallelEmbedding
from attnzoo.models import validate
from attnzoo.models.common import (
    GatedMLP, MergedLinear, PreNormDecoderLayer, RMSNorm, RotaryDecoderLM, RotaryEmbedding, apply_rope_qk,
)

# transformers' activation names (ACT2FN) our gated-MLP kernel runs, and its name for each.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPContext = SINGLE):
        super().__init__()
        h, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = getattr(config, "head_dim", None) or h // heads
        self.num_heads = tp.split(heads, "num_attention_heads")  # this rank's heads
        first_kv, self.num_kv_heads = tp.kv_heads(kv_heads, heads)
        kv_rows = (first_kv * d, self.num_kv_heads * d)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = MergedLinear(h, {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d},
                                     bias=bias, tp=tp, shards={"k_proj": kv_rows, "v_proj": kv_rows})
        self.o_proj = RowParallelLinear(heads * d, h, bias=bias, tp=tp)
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, ctx: ForwardContext):
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = apply_rope_qk(q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                             cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_id: int, tp: TPContext = SINGLE):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, validate.activation(
            config, "hidden_act", ACTIVATIONS, arch="Llama", default="silu"), tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(RotaryDecoderLM):
    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        validate.head_counts(config, arch="Llama")
        validate.positive_int(config, "max_position_embeddings", arch="Llama")
        rope_type = validate.rope_type(config.rope_parameters, validate.STATIC_ROPE - {"proportional"}, arch="Llama")
        self.config = config
        self.model = LlamaModel(config, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp=tp)
        self.tied_lm_head = bool(getattr(config, "tie_word_embeddings", False))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, rope_type=rope_type, head_dim=head_dim)

