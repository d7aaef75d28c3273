"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM).

Multi-head latent attention (``attnzoo.attention.mla``) with or without a q low-rank path, YaRN RoPE
with its softmax-scale correction, dense first layers (``first_k_dense_replace``) then MoE layers with
shared experts. The two versions differ only in configuration-level choices, kept as class attributes:

  V2: softmax router scores, ``topk_method`` "greedy" or "group_limited_greedy" (groups ranked by
      their best expert), weights scaled by ``routed_scaling_factor``; RoPE on interleaved pairs.
  V3: sigmoid router scores plus ``e_score_correction_bias`` for the choice only, groups ranked by the
      sum of their two best experts, optional renormalisation (``norm_topk_prob``), then scaled; RoPE
      on interleaved pairs when ``rope_interleave`` (the default), else rotate-half.

The math follows transformers' ``models/deepseek_v2`` and ``models/deepseek_v3``.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from attnzoo.attention.layer import ForwardContext
from attnzoo.attention.mla import MLAAttention
from attnzoo.errors import ModelLoadError, WeightError
from attnzoo.layers import fused
from attnzoo.layers.moe import FusedMoE, arrivals_counter, route
from attnzoo.layers.parallel import SINGLE, ColumnParallelLinear, ParallelLMHead, RowParallelLinear, TPContext
from attnzoo.models.common import (
    DecoderLayer, DecoderLM, DecoderModel, GatedMLP, MergedLinear, RMSNorm, RotaryEmbedding,
)
from attnzoo.models import validate

log = logging.getLogger("attnzoo")

def mla_softmax_scale(config) -> float:
    """1/sqrt(qk_head_dim), times mscale^2 when YaRN gives ``mscale_all_dim`` (as the reference does)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters
    if rope.get("rope_type", "default") != "default":
        mscale_all_dim = rope.get("mscale_all_dim", 0)
        factor = rope.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


def _mlp(hidden: int, intermediate: int, bias: bool, tp: TPContext = SINGLE, reduce: bool = True) -> GatedMLP:
    # bias: V2's mlp_bias (dense and shared-expert MLPs; routed experts never have biases)
    return GatedMLP(hidden, intermediate, bias=bias, tp=tp, reduce=reduce)


class DeepseekAttention(nn.Module):
    """MLA projections (named as in the checkpoints) around the shared ``MLAAttention`` core.

    V3.2 builds on this: ``project`` also returns the q low-rank residual its indexer reads, and
    ``index_head_dim`` reserves the indexer key cache beside the MLA entry.
    """

    @staticmethod
    def owns_latent(config, layer_id: int) -> bool:
        return True  # Mistral Large 4's KV-sharing layers read an earlier layer's latent instead

    def __init__(self, config, layer_id: int, *, interleaved_rope: bool, index_head_dim: int = 0,
                 tp: TPContext = SINGLE):
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        # Tensor parallel: heads split across ranks; the latent (q_a, kv_a) is computed and cached whole
        # on every rank, since each rank's heads read all of it.
        self.num_heads = tp.split(heads, "num_attention_heads")
        self.q_lora_rank = getattr(config, "q_lora_rank", None)  # Mistral Large 4's config has no such key
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.interleaved_rope = interleaved_rope
        bias = bool(getattr(config, "attention_bias", False))
        # q (or its low-rank latent) and the KV latent read the same x: one GEMM, one FP8 quantization of x.
        # q_proj is split over the ranks by heads; the latents are computed whole on every rank.
        kv_a = self.kv_lora_rank + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            parts, shards = {"q_proj": heads * self.qk_head_dim}, {}
        else:
            parts = {"q_a_proj": self.q_lora_rank}
            shards = {"q_a_proj": (0, self.q_lora_rank)}
            # The latent norms use RMSNorm's default eps in the reference, not config.rms_norm_eps.
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * self.qk_head_dim, bias=False, tp=tp)
        self.kv_a_layernorm = None
        if self.owns_latent(config, layer_id):
            parts["kv_a_proj_with_mqa"], shards["kv_a_proj_with_mqa"] = kv_a, (0, kv_a)
            self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.q_kv_a_proj = MergedLinear(h, parts, bias=bias, tp=tp, shards=shards)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False, tp=tp
        )
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, h, bias=bias, tp=tp)
        self.mla = MLAAttention(
            layer_id, self.num_heads, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, scale=mla_softmax_scale(config),
            index_head_dim=index_head_dim,
        )

    def project(self, x, cos, sin):
        """x [T, hidden] -> q_nope [T, H, nope], roped q_pe [T, H, rope], q low-rank residual [T, q_lora] or None,
        normalized latent [T, kv_lora_rank], roped shared key [T, rope]."""
        q, kv = self.q_kv_a_proj.split(self.q_kv_a_proj(x))
        q_resid = None
        if self.q_lora_rank is not None:
            q_resid = self.q_a_layernorm(q)
            q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(x.shape[0], self.num_heads, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # Interleaved: pairs (x0, x1), (x2, x3), ... rotated, written de-interleaved (the same for q and k).
        # The entry holds the normed latent, then the roped key: the cache entry as it is stored.
        q_pe, entry = fused.mla_entry(q_pe, kv, self.kv_a_layernorm, cos, sin, interleaved=self.interleaved_rope,
                                      q_out=self.mla.rope_slot(x.shape[0], q_pe))
        latent, k_pe = entry.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return q_nope, q_pe, q_resid, latent, k_pe

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q_nope, q_pe, _, latent, k_pe = self.project(x, cos, sin)
        return self.o_proj(self.mla(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, ctx, q_pe_in_slot=True))


class DeepseekRouter(nn.Module):
    """Top-k expert choice per token -> (weights [T, k] float32, expert ids [T, k])."""

    def __init__(self, config, scoring: str):
        super().__init__()
        self.scoring = scoring  # "softmax" (V2), "sigmoid" (V3) or "softmax_top2" (Mistral 4)
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        # Initialised (not empty) so that random-weight models (load_format="random") route sensibly.
        # float32 whatever the model dtype: the reference scores in float32 (no cast per call).
        std = getattr(config, "initializer_range", 0.02)
        self.weight = nn.Parameter(torch.randn(self.num_experts, config.hidden_size, dtype=torch.float32) * std)
        self.register_buffer("arrivals", arrivals_counter(), persistent=False)  # route's, zero between launches
        if scoring == "softmax":
            self.topk_method = config.topk_method
            if self.topk_method not in ("greedy", "group_limited_greedy"):
                raise ModelLoadError(
                    f"DeepSeek-V2 topk_method {self.topk_method!r} is not supported",
                    fix="use a config with topk_method 'greedy' or 'group_limited_greedy'",
                )
        else:
            # Mistral Large 4's config has no switch: it always renormalises.
            self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", True))
        if scoring == "sigmoid":
            # float32 whatever the model dtype, as in the reference: rounded to bf16 it would change
            # which experts win close calls.
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False
            )
        if scoring != "softmax" or self.topk_method == "group_limited_greedy":
            if not self.n_group or not self.topk_group or self.num_experts % self.n_group:
                raise ModelLoadError(
                    f"grouped routing needs n_group dividing n_routed_experts ({self.num_experts}) and topk_group;"
                    f" the config has n_group={self.n_group}, topk_group={self.topk_group}",
                    fix="fix n_group / topk_group in config.json",
                )

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must not round the router weight or the correction bias either.
        super()._apply(fn, recurse)
        for p in (self.weight, getattr(self, "e_score_correction_bias", None)):
            if p is not None and p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 logits whatever the model dtype: rounded, close calls between experts would flip
        if self.scoring == "softmax":
            # V2: softmax scores; group-limited greedy ranks groups by their best expert.
            grouped = self.topk_method == "group_limited_greedy"
            return route(x, self.weight, self.arrivals, top_k=self.top_k, sigmoid=False,
                         group_score="max" if grouped else None, n_group=self.n_group or 1,
                         topk_group=self.topk_group or 1, scale=self.routed_scaling_factor)
        # V3: sigmoid scores, biased for the choice only; groups ranked by the sum of their two best experts.
        # Mistral 4: the same with softmax scores and no bias.
        sigmoid = self.scoring == "sigmoid"
        return route(x, self.weight, self.arrivals, top_k=self.top_k, sigmoid=sigmoid, group_score="top2",
                     n_group=self.n_group, topk_group=self.topk_group,
                     correction_bias=self.e_score_correction_bias if sigmoid else None,
                     renormalize=self.norm_topk_prob, scale=self.routed_scaling_factor)


class DeepseekMoE(nn.Module):
    """Routed experts plus shared experts. Tensor parallel: expert parallel for the routed experts (each
    rank holds a contiguous range of E/tp whole experts), the shared experts split like a dense
    MLP; both partial sums go through one all-reduce."""

    def __init__(self, config, scoring: str, tp: TPContext = SINGLE):
        super().__init__()
        self.tp = tp
        self.gate = DeepseekRouter(config, scoring)
        first, local = tp.shard(config.n_routed_experts, "n_routed_experts")
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, "silu",
                                experts=range(first, first + local), init_std=getattr(config, "initializer_range", 0.02))
        self.shared_experts = _mlp(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
            bool(getattr(config, "mlp_bias", False)), tp, reduce=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        weights, ids = self.gate(x)  # [T, k] float32, [T, k]
        return self.tp.all_reduce(self.experts(x, weights, ids, shared=self.shared_experts))


class DeepseekV2ForCausalLM(DecoderLM):
    scoring = "softmax"
    attention_cls = DeepseekAttention  # V3.2 swaps in its indexer-carrying subclass
    matrix_weights = ("kv_b_proj",)  # absorbed MLA folds it into the query and the output

    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        _check_config(config)
        self.config, self.tp = config, tp
        interleaved = self.interleaved_rope(config)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        layers = (DecoderLayer(
            config.hidden_size, config.rms_norm_eps,
            self.attention_cls(config, i, interleaved_rope=interleaved, tp=tp),
            DeepseekMoE(config, self.scoring, tp) if i >= config.first_k_dense_replace
            else _mlp(config.hidden_size, config.intermediate_size, mlp_bias, tp),
        ) for i in range(config.num_hidden_layers))
        self.model = DecoderModel(config, layers, tp)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp=tp)
        self.tied_lm_head = bool(getattr(config, "tie_word_embeddings", False))
        rope_type = config.rope_parameters.get("rope_type", "default")
        self.rotary = RotaryEmbedding(config, rope_type=rope_type, head_dim=config.qk_rope_head_dim)
        self._skipped_mtp: set[int] = set()

    @staticmethod
    def interleaved_rope(config) -> bool:
        return True  # V2 rotates interleaved pairs (its complex-number form)

    def checkpoint_name(self, name: str) -> str | None:
        parts = name.split(".")
        layer = self.layer_index(name, parts) if parts[0] == "model" else None
        # V3 checkpoints append the multi-token-prediction module as extra layers; generation skips it.
        if layer is None:
            return name
        if layer >= self.config.num_hidden_layers:
            self._skipped_mtp.add(layer)
            return None
        if parts[3:5] == ["mlp", "experts"] and len(parts) > 5 and parts[5].isdigit():
            experts = getattr(self.model.layers[layer].mlp, "experts", None)
            if experts is None:
                raise WeightError(f"checkpoint tensor {name!r} is a routed expert of layer {layer}, which config.json "
                                  "makes a dense layer", fix="the checkpoint does not match its config.json "
                                  "(first_k_dense_replace)")
            # Expert parallel: another rank's expert (the FusedMoE says which it holds) is dropped here, before
            # an FP8 plan would dequantize it; one beyond the config's count goes on to be named. Stacked expert
            # tensors (gate_up_proj) are cut by the FusedMoE.
            if int(parts[5]) < experts.num_experts and not experts.holds(int(parts[5])):
                return None
        return name

    def after_weights_loaded(self) -> None:
        super().after_weights_loaded()
        if self._skipped_mtp:
            log.info("%s: skipped the multi-token-prediction layer(s) %s of the checkpoint (not used to generate)",
                     type(self).__name__, ", ".join(map(str, sorted(self._skipped_mtp))))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    scoring = "sigmoid"

    @staticmethod
    def interleaved_rope(config) -> bool:
        return bool(getattr(config, "rope_interleave", True))


def _check_config(config) -> None:
    validate.activation(config, "hidden_act", {"silu": "silu", "swish": "silu"}, arch="DeepSeek", default="silu")
    # YaRN's mscale is read by mla_softmax_scale; RotaryEmbedding computes the others' frequencies.
    validate.rope_type(config.rope_parameters, validate.STATIC_ROPE - {"proportional"}, arch="DeepSeek")
    validate.positive_int(config, "max_position_embeddings", arch="DeepSeek")
    if getattr(config, "attention_bias", False) and config.q_lora_rank is None:
        raise ModelLoadError("attention_bias without q_lora_rank is not supported (q_proj has no bias, "
                             "kv_a_proj_with_mqa would have one)", fix="use attention_bias false, as DeepSeek-V2")
    freq = getattr(config, "moe_layer_freq", 1)
    if freq != 1:
        raise ModelLoadError(
            f"moe_layer_freq={freq} is not supported (every layer from first_k_dense_replace on is MoE)",
            fix="use a config with moe_layer_freq 1, as all released DeepSeek-V2/V3 models have",
        )
