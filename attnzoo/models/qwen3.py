"""Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM), per transformers' ``models/qwen3`` and
``models/qwen3_moe``: Llama with a per-head RMSNorm on q and k before RoPE (QK-norm, GQA).

Qwen3-MoE replaces the MLP of its sparse layers with routed experts: softmax over the router logits,
top ``num_experts_per_tok``, renormalised to sum 1 when ``norm_topk_prob``; no shared expert. A layer
is sparse unless listed in ``mlp_only_layers``, and only every ``decoder_sparse_step``-th layer is.
Sliding windows (``use_sliding_window``, off in the released models) follow the config as transformers
reads it: per ``layer_types`` for Qwen3, every layer for Qwen3-MoE.
"""
from __future__ import annotations

from torch import nn

from attnzoo.errors import ModelLoadError
from attnzoo.layers import fused
from attnzoo.layers.moe import FusedMoE, select_experts
from attnzoo.layers.parallel import SINGLE, TPContext
from attnzoo.models.common import GatedMLP, RMSNorm
from attnzoo.models.llama import LlamaAttention, LlamaForCausalLM


class QKNormAttention(LlamaAttention):
    """Llama attention with q and k RMS-normalised per head before RoPE (one kernel on a GPU).
    ``norm_offset`` 1: Gemma-style norms that store weight - 1."""

    rope_in_attention = False  # the norms come first: norm and RoPE are one kernel here

    def __init__(self, config, layer_id: int, tp: TPContext = SINGLE, *, norm_offset: float = 0.0, **kw):
        super().__init__(config, layer_id, tp, **kw)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=norm_offset)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=norm_offset)

    def rope(self, q, k, cos, sin):
        return fused.norm_rope(q, k, None, cos, sin, q_norm=self.q_norm, k_norm=self.k_norm)[:2]


class Qwen3MoeBlock(nn.Module):
    """Routed experts only. Tensor parallel: expert parallel (each rank holds a contiguous range of whole
    experts), the partial sums all-reduced."""

    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        self.tp, self.top_k, self.renormalize = tp, config.num_experts_per_tok, bool(config.norm_topk_prob)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        first, local = tp.shard(config.num_experts, "num_experts")
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size, "silu",
                                experts=range(first, first + local), init_std=config.initializer_range)

    def forward(self, x):
        # Logits in the model dtype, scored in float32, as the reference router.
        w, ids = select_experts(self.gate(x).float(), top_k=self.top_k, sigmoid=False, renormalize=self.renormalize)
        return self.tp.all_reduce(self.experts(x, w, ids))


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, tp: TPContext = SINGLE):
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ModelLoadError(f"Qwen3 hidden_act {config.hidden_act!r} is not supported",
                                 fix="use a checkpoint with hidden_act 'silu'")
        super().__init__(config, tp)

    def sliding_window(self, config, layer_id: int) -> int | None:
        types = getattr(config, "layer_types", None)
        return config.sliding_window if types and types[layer_id] == "sliding_attention" else None

    def make_attention(self, config, layer_id: int, tp: TPContext) -> nn.Module:
        return QKNormAttention(config, layer_id, tp, sliding_window=self.sliding_window(config, layer_id))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def sliding_window(self, config, layer_id: int) -> int | None:
        return config.sliding_window  # None unless use_sliding_window (transformers: every layer)

    @staticmethod
    def is_sparse(config, layer_id: int) -> bool:
        return (layer_id not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (layer_id + 1) % config.decoder_sparse_step == 0)

    def make_mlp(self, config, layer_id: int, tp: TPContext) -> nn.Module:
        if self.is_sparse(config, layer_id):
            return Qwen3MoeBlock(config, tp)
        return GatedMLP(config.hidden_size, config.intermediate_size, tp=tp)

    def checkpoint_name(self, name: str) -> str | None:
        parts = name.split(".")
        # Expert parallel: another rank's expert is dropped before it is read.
        if parts[3:5] == ["mlp", "experts"] and parts[5:6] and parts[5].isdigit() \
                and not self.model.layers[int(parts[2])].mlp.experts.holds(int(parts[5])):
            return None
        return name


