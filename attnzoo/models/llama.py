"""Llama (LlamaForCausalLM): RMSNorm, RoPE (incl. llama3 scaling), GQA, SwiGLU, tied or untied head.

``LlamaAttention`` and the builder hooks of ``LlamaForCausalLM`` (``make_attention``, ``make_mlp``) are
what the Llama-like models (Qwen3, Qwen3-MoE, Gemma 3's attention) change."""
from __future__ import annotations

from torch import nn

from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.layers.parallel import SINGLE, ParallelLMHead, RowParallelLinear, TPContext
from attnzoo.models import validate
from attnzoo.models.common import (
    DecoderLayer, DecoderLM, DecoderModel, GatedMLP, MergedLinear, RotaryEmbedding, apply_rope_qk,
)


# transformers' activation names (ACT2FN) our gated-MLP kernel runs, and its name for each.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """q/k/v in one GEMM, RoPE on q and k, the shared attention layer, o_proj. ``scale`` None: 1/sqrt(d);
    ``sliding_window``: this layer's window, None for full attention."""

    def __init__(self, config, layer_id: int, tp: TPContext = SINGLE, *, scale: float | None = None,
                 sliding_window: int | None = None):
        super().__init__()
        h, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = head_dim_of(config)
        self.num_heads = tp.split(heads, "num_attention_heads")  # this rank's heads
        first_kv, self.num_kv_heads = tp.kv_heads(kv_heads, heads)
        kv_rows = (first_kv * d, self.num_kv_heads * d)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = MergedLinear(h, {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d},
                                     bias=bias, tp=tp, shards={"k_proj": kv_rows, "v_proj": kv_rows})
        self.o_proj = RowParallelLinear(heads * d, h, bias=bias, tp=tp)
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, scale=scale,
                              sliding_window=sliding_window)

    # Plain RoPE is the attention layer's to apply (with the key store, one launch); a subclass that normalises q
    # and k first sets this False and overrides ``rope``.
    rope_in_attention = True

    def rope(self, q, k, cos, sin):
        """q [T, H, d], k [T, Hk, d] -> roped q, k, where the model rotates them itself (rope_in_attention False)."""
        return apply_rope_qk(q, k, cos, sin)

    def forward(self, x, cos, sin, ctx: ForwardContext):
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.rope_in_attention:
            return self.o_proj(self.attn(q, k, v, ctx, rope=(cos, sin)))
        q, k = self.rope(q, k, cos, sin)
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaForCausalLM(DecoderLM):
    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        arch = type(self).__name__.removesuffix("ForCausalLM")
        validate.head_counts(config, arch=arch)
        validate.positive_int(config, "max_position_embeddings", arch=arch)
        rope_type = validate.rope_type(config.rope_parameters, validate.STATIC_ROPE - {"proportional"}, arch=arch)
        self.config = config
        layers = (DecoderLayer(config.hidden_size, config.rms_norm_eps, self.make_attention(config, i, tp),
                               self.make_mlp(config, i, tp)) for i in range(config.num_hidden_layers))
        self.model = DecoderModel(config, layers, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp=tp)
        self.tied_lm_head = bool(getattr(config, "tie_word_embeddings", False))
        self.rotary = RotaryEmbedding(config, rope_type=rope_type, head_dim=head_dim_of(config))

    def make_attention(self, config, layer_id: int, tp: TPContext) -> nn.Module:
        return LlamaAttention(config, layer_id, tp)

    def make_mlp(self, config, layer_id: int, tp: TPContext) -> nn.Module:
        act = validate.activation(config, "hidden_act", ACTIVATIONS, arch=type(self).__name__, default="silu")
        return GatedMLP(config.hidden_size, config.intermediate_size, act, tp=tp)
