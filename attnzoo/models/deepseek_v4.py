"""DeepSeek-V4 (DeepseekV4ForCausalLM): compressed sparse attention, hyper-connections, hash-routed MoE.

Attention (shared-KV MQA, head_dim 512): q from a low-rank path (``q_a_proj``, ``q_a_norm``, ``q_b_proj``,
then a weightless per-head RMSNorm), one key per token (``kv_proj``, ``kv_norm``) that is also the value,
interleaved RoPE on the trailing ``qk_rope_head_dim`` channels, a learned sink logit per head, the output's
rope channels un-rotated at the query position, and a grouped low-rank output projection (``o_a_proj``
per group of heads, then ``o_b_proj``). Each layer is one of three kinds (``layer_types``):
``sliding_attention`` (the raw window only, "main" RoPE), ``compressed_sparse_attention`` (window plus
the indexer's top-k of 4:1 compressed entries) and ``heavily_compressed_attention`` (window plus every
128:1 entry), the last two on the "compress" RoPE (its own base, YaRN). ``attention/compressed.py`` and
``attention/compressor.py`` hold the cache bookkeeping and the compressor math.

The residual is ``hc_mult`` streams mixed by manifold-constrained hyper-connections (mHC): per block a
projection of the normed streams gives ``pre`` (collapse the streams into the block input), ``post``
(spread the block output) and ``comb`` (mix the streams; Sinkhorn-projected to doubly stochastic).
MoE: sqrt-softplus scores; the first layers route by a fixed token-id table (``tid2eid``, hash MoE),
the rest by top-k of the biased scores; SwiGLU clamped at ``swiglu_limit``; one shared expert.

The math follows transformers' ``models/deepseek_v4``.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.attention.compressed import CompressedAttention
from attnzoo.attention.compressor import Compressor, CSACompressor, V4Rope
from attnzoo.attention.layer import ForwardContext
from attnzoo.errors import ModelLoadError
from attnzoo.layers import fused
from attnzoo.layers.moe import FusedMoE
from attnzoo.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from attnzoo.models.common import CausalLM, MergedLinear, RMSNorm

# DeepSeek's checkpoint names -> ours (transformers' names, its conversion_mapping "deepseek_v4"), in order.
RENAMES = [(r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
           (r"^embed\.", "embed_tokens."), (r"^head\.", "lm_head."), (r"^hc_head_(fn|base|scale)", r"hc_head.hc_\1"),
           (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
           (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
           (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
           (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."),
           (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
           (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
           (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
           (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
           (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
           (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
           (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj.")]
KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid,
          "softmax": lambda x: x.softmax(dim=-1)}
# Parameters the reference keeps in float32 whatever the model dtype (its _keep_in_fp32_modules_strict).
FLOAT32 = ("attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm.",
           "kv_norm.", "input_layernorm.", "post_attention_layernorm.", "model.norm.")


class DeepseekV4Attention(nn.Module):
    def __init__(self, config, layer_id: int, ropes: dict[str, V4Rope]):
        super().__init__()
        kind = config.layer_types[layer_id]
        h, self.heads, self.head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
        self.o_groups = config.o_groups
        self.rope = ropes["main" if kind == "sliding_attention" else "compress"]
        self.q_kv_proj = MergedLinear(h, {"q_a_proj": config.q_lora_rank, "kv_proj": self.head_dim})
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.q_b_norm = RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_a_proj = nn.Linear(self.heads * self.head_dim // self.o_groups, self.o_groups * config.o_lora_rank,
                                  bias=False)
        self.o_b_proj = nn.Linear(self.o_groups * config.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        index = {}
        if kind != "sliding_attention":
            rate = config.compress_rates[kind]
            if kind == "compressed_sparse_attention":
                self.compressor = CSACompressor(config, rate, self.rope)
                index = dict(index_dim=config.index_head_dim, index_n_heads=config.index_n_heads,
                             index_topk=config.index_topk)
            else:
                self.compressor = Compressor(h, self.head_dim, rate, overlap=False, eps=config.rms_norm_eps,
                                             rope=self.rope)
        c = self.compressor
        self.attn = CompressedAttention(
            layer_id, self.heads, self.head_dim, sliding_window=config.sliding_window, scale=self.head_dim**-0.5,
            compress_rate=c.rate if c else 0, overlap=bool(c and c.overlap), state_dim=c.state_dim if c else 0,
            **index)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = self.rope.tables(positions)
        q_a, kv = self.q_kv_proj.split(self.q_kv_proj(x))
        q_resid = self.q_a_norm(q_a)
        q = self.rope.apply(self.q_b_proj(q_resid).view(t, self.heads, self.head_dim), cos, sin, norm=self.q_b_norm)
        kv = self.rope.apply(kv, cos, sin, norm=self.kv_norm)
        extra = {}
        if self.compressor is not None:
            extra = dict(state=self.compressor.project(x), compress=self.compressor.pool)
            indexer = getattr(self.compressor, "indexer", None)
            if indexer is not None:
                extra["index_q"], extra["index_weights"] = indexer.query(x, q_resid, cos, sin)
        o = self.attn(q, kv, ctx, sinks=self.sinks, **extra)  # [T, H, D]
        o = self.rope.apply(o, cos, -sin).reshape(t, self.o_groups, -1)
        w = self.o_a_proj.weight.view(self.o_groups, -1, o.shape[-1])  # per group [o_lora_rank, H * D / G]
        return self.o_b_proj(torch.bmm(o.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(t, -1))


class HyperConnection(nn.Module):
    """mHC around one block: streams [T, N, hidden] -> (post [T, N], comb [T, N, N], block input [T, hidden])."""

    def __init__(self, config):
        super().__init__()
        self.n = n = config.hc_mult
        self.iters, self.eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor):
        n = self.n
        mixes = fused.hc_project(streams, self.fn, self.norm_eps)
        pre, post, comb = fused.hc_weights(mixes, self.scale, self.base, n=n, iters=self.iters, eps=self.eps)
        return post, comb, fused.hc_collapse(streams, pre)


class HyperHead(nn.Module):
    """The final collapse of the streams before the model's norm."""

    def __init__(self, config):
        super().__init__()
        n, self.eps, self.norm_eps = config.hc_mult, config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = fused.hc_project(streams, self.hc_fn, self.norm_eps)
        mixes = mixes * self.hc_scale.float() + self.hc_base.float()
        return fused.hc_collapse(streams, torch.sigmoid(mixes) + self.eps)


class Router(nn.Module):
    """-> (weights [T, k] float32, expert ids [T, k]): learned top-k, or a fixed table of the token ids."""

    def __init__(self, config, hashed: bool):
        super().__init__()
        self.top_k, self.scale, self.hashed = config.num_experts_per_tok, config.routed_scaling_factor, hashed
        if config.scoring_func not in SCORES:
            raise ModelLoadError(f"DeepSeek-V4 scoring_func {config.scoring_func!r} is not supported",
                                 fix=f"use one of {', '.join(SCORES)}")
        self.score = SCORES[config.scoring_func]
        std = getattr(config, "initializer_range", 0.02)
        self.weight = nn.Parameter(torch.randn(config.n_routed_experts, config.hidden_size) * std)
        if hashed:
            # Random until loaded, so that random-weight models (load_format="random") spread tokens.
            ids = torch.randint(0, config.n_routed_experts, (config.vocab_size, self.top_k))
            self.tid2eid = nn.Parameter(ids, requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        scores = self.score(F.linear(x, self.weight))
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return (w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale).float(), ids


class ClampedMLP(nn.Module):
    """The shared expert: down(silu(min(gate, limit)) * clamp(up, -limit, limit))."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inter, "up_proj": inter})
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.limit = limit

    def forward(self, x):
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit))


class DeepseekV4MoE(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.gate = Router(config, hashed=config.mlp_layer_types[layer_id] == "hash_moe")
        self.experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, "silu",
                                swiglu_limit=config.swiglu_limit, init_std=getattr(config, "initializer_range", 0.02))
        self.shared_experts = ClampedMLP(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return self.experts(x, weights, ids, shared=self.shared_experts)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, ropes: dict[str, V4Rope]):
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, layer_id, ropes)
        self.mlp = DeepseekV4MoE(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(config), HyperConnection(config)

    def forward(self, streams, positions, input_ids, ctx):
        post, comb, x = self.attn_hc(streams)
        streams = fused.hc_mix(streams, post, comb, self.self_attn(self.input_layernorm(x), positions, ctx))
        post, comb, x = self.ffn_hc(streams)
        return fused.hc_mix(streams, post, comb, self.mlp(self.post_attention_layernorm(x), input_ids))


class DeepseekV4Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        rope_dim = int(config.head_dim * config.partial_rotary_factor)
        self.ropes = nn.ModuleDict({label: V4Rope(config, label, rope_dim) for label in ("main", "compress")})
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i, self.ropes)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)


class DeepseekV4ForCausalLM(CausalLM):
    matrix_weights = ("o_a_proj",)  # the grouped output projection is a batched matmul over its weight

    def __init__(self, config):
        super().__init__()
        _check_config(config)
        self.config = config
        self.model = DeepseekV4Model(config)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tied_lm_head = bool(getattr(config, "tie_word_embeddings", False))

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must not round what the reference keeps in float32 (mHC, sinks, biases, norms).
        kept = {n: p.data for n, p in self.named_parameters() if any(k in n for k in FLOAT32)}
        super()._apply(fn, recurse)
        for n, p in self.named_parameters():
            if n in kept and p.dtype != torch.float32 and p.is_floating_point():
                p.data = p.data.float()
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            streams = layer(streams, positions, input_ids, ctx)
        return self.model.norm(self.model.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # in the head's dtype: consumers convert (CausalLM.compute_logits)

    def checkpoint_name(self, name: str) -> str | None:
        """DeepSeek's tensor names (``layers.0.attn.wq_a.weight``, with or without ``model.``) -> ours."""
        name = name.removeprefix("model.")
        parts = name.split(".")
        # The multi-token-prediction module (mtp.*, or layers past num_hidden_layers) is not used.
        if parts[0] == "mtp" or (parts[0] == "layers" and int(parts[1]) >= self.config.num_hidden_layers):
            return None
        for pattern, new in RENAMES:
            name = re.sub(pattern, new, name)
        return name if name.startswith("lm_head.") else "model." + name


def _check_config(config) -> None:
    bad = [t for t in config.layer_types if t not in KINDS]
    if bad:
        raise ModelLoadError(f"DeepSeek-V4 layer_types {bad} are not supported", fix=f"use layer types of {KINDS}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"DeepSeek-V4 hidden_act {config.hidden_act!r} is not supported",
                             fix="use a checkpoint with hidden_act 'silu'")
    if config.num_key_value_heads != 1:
        raise ModelLoadError(f"DeepSeek-V4 attention shares one KV head; the config has {config.num_key_value_heads}",
                             fix="set num_key_value_heads 1 in config.json")
    if config.num_attention_heads % config.o_groups:
        raise ModelLoadError(f"o_groups {config.o_groups} does not divide num_attention_heads "
                             f"{config.num_attention_heads}", fix="fix o_groups in config.json")
