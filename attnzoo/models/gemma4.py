"""Gemma 4 text model: Gemma4ForCausalLM, and the language model of Gemma4ForConditionalGeneration.

What differs from Llama, per transformers' ``models/gemma4/modeling_gemma4.py``:
- ``layer_types``: sliding layers use ``head_dim`` and ``num_key_value_heads``; full layers use the global
  head dim (512 in the released models) and, with ``attention_k_eq_v``, ``num_global_key_value_heads``
  and values taken from the key projection. Each layer type has its own RoPE (proportional partial RoPE
  on full layers).
- q/k RMSNorm and softmax scale 1.0; values are RMS-normalised without a weight.
- The last ``num_kv_shared_layers`` layers attend over the KV cache of the last earlier layer of the
  same type: they compute only q, own no KV memory and write none (optionally with a double-wide MLP).
- Per-layer input embeddings (PLE), an MoE block beside the dense MLP, a per-layer output scalar,
  sqrt(hidden) embedding scaling and final logit soft-capping.

Only text goes in: the engine feeds token ids, and vision/audio tower weights are skipped at load.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.errors import ModelLoadError, RequestError
from attnzoo.layers import fused
from attnzoo.layers.moe import FusedMoE
from attnzoo.layers.parallel import SINGLE, ParallelLMHead, RowParallelLinear, TPContext, VocabParallelEmbedding
from attnzoo.models import validate
from attnzoo.models.common import CausalLM, GatedMLP, MergedLinear, RMSNorm, RotaryEmbedding

log = logging.getLogger("attnzoo")

# Checkpoint prefixes of Gemma4ForConditionalGeneration's non-text parts.
_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_TEXT_PREFIX = "model.language_model."
_KV_WEIGHTS = ("k_proj", "v_proj", "k_norm", "v_norm")


def layer_attention_shape(cfg, layer_id: int) -> tuple[int, int]:
    """(head_dim, num_kv_heads) of one layer. transformers (>= 5.17) resolves config.json's
    ``global_head_dim`` / ``num_global_key_value_heads`` (the latter only with ``attention_k_eq_v``) into
    the full layers' entries of ``per_layer_config``."""
    lc = cfg.per_layer_config[layer_id] if getattr(cfg, "is_heterogeneous", False) else cfg
    return lc.head_dim, lc.num_key_value_heads


def kv_producers(cfg) -> list[int | None]:
    """For each layer, the layer whose KV cache it reads (None: its own)."""
    n = cfg.num_hidden_layers
    first_shared = n - (cfg.num_kv_shared_layers or 0)
    out: list[int | None] = [None] * n
    for i in range(first_shared, n):
        same = [j for j in range(first_shared) if cfg.layer_types[j] == cfg.layer_types[i]]
        if not same:
            raise ModelLoadError(
                f"layer {i} ({cfg.layer_types[i]}) shares KV but no earlier layer of that type produces it",
                fix="check layer_types and num_kv_shared_layers in config.json",
            )
        out[i] = same[-1]
    return out


def layer_type_rope(cfg, layer_type: str, head_dim: int) -> RotaryEmbedding:
    """This layer type's RoPE ("default" on sliding layers, "proportional" partial RoPE on full layers);
    transformers' init functions find the layer type's head dim through ``per_layer_config``."""
    rope_type = validate.rope_type((cfg.rope_parameters or {}).get(layer_type), validate.STATIC_ROPE, arch="Gemma 4",
                                   where=f"rope_parameters.{layer_type}")
    rope = RotaryEmbedding(cfg, rope_type=rope_type, layer_type=layer_type, head_dim=head_dim)
    if rope.inv_freq.numel() * 2 != head_dim:
        raise ModelLoadError(
            f"{layer_type} RoPE ({rope_type}) has {rope.inv_freq.numel()} frequencies for head dim {head_dim}",
            fix="check rope_parameters in config.json",
        )
    return rope


def _act(cfg) -> str:
    return validate.activation(cfg, "hidden_activation", {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"},
                               arch="Gemma 4")


class Gemma4Attention(nn.Module):
    def __init__(self, cfg, layer_id: int, kv_from: int | None, tp: TPContext = SINGLE):
        super().__init__()
        h, bias, heads = cfg.hidden_size, cfg.attention_bias, cfg.num_attention_heads
        self.full = cfg.layer_types[layer_id] == "full_attention"
        self.layer_type = cfg.layer_types[layer_id]
        self.head_dim, kv_heads = layer_attention_shape(cfg, layer_id)
        d = self.head_dim
        self.num_heads = tp.split(heads, "num_attention_heads")  # this rank's heads
        first_kv, self.num_kv_heads = tp.kv_heads(kv_heads, heads)  # replicated when fewer than ranks
        kv_rows = (first_kv * d, self.num_kv_heads * d)
        self.shared = kv_from is not None
        self.k_eq_v = bool(cfg.attention_k_eq_v) and self.full
        # One GEMM for q, k and v, as far as the layer has them (no k/v on KV-sharing layers, k == v).
        parts = {"q_proj": heads * d}
        if not self.shared:
            parts["k_proj"] = kv_heads * d
            if not self.k_eq_v:
                parts["v_proj"] = kv_heads * d
        self.qkv_proj = MergedLinear(h, parts, bias=bias, tp=tp, shards={"k_proj": kv_rows, "v_proj": kv_rows})
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        if not self.shared:
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)
        self.o_proj = RowParallelLinear(heads * d, h, bias=bias, tp=tp)
        self.attn = Attention(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
            scale=1.0,  # q and k are RMS-normalised: no 1/sqrt(d)
            sliding_window=None if self.full else cfg.sliding_window,
            kv_shared_from=kv_from,
        )

    def forward(self, x, cos, sin, ctx: ForwardContext):  # x [num_tokens, hidden]
        t = x.shape[0]
        qkv = self.qkv_proj.split(self.qkv_proj(x))
        q = qkv[0].view(t, self.num_heads, self.head_dim)
        if self.shared:
            q = fused.norm_rope(q, None, None, cos, sin, q_norm=self.q_norm)[0]
            return self.o_proj(self.attn(q, None, None, ctx))
        k = qkv[1].view(t, self.num_kv_heads, self.head_dim)
        v = k if self.k_eq_v else qkv[2].view(t, self.num_kv_heads, self.head_dim)
        # Three per-head norms and RoPE, one kernel on a GPU.
        q, k, v = fused.norm_rope(q, k, v, cos, sin, q_norm=self.q_norm, k_norm=self.k_norm, v_norm=self.v_norm)
        return self.o_proj(self.attn(q, k, v, ctx))


class Gemma4Router(nn.Module):
    """Softmax router over RMS-normalised, rescaled input; top-k renormalised, times a per-expert scale."""

    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.root = cfg.hidden_size**-0.5

    def forward(self, x):  # [num_tokens, hidden] -> weights float32 [num_tokens, k], experts [num_tokens, k]
        probs = F.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int, kv_from: int | None, tp: TPContext = SINGLE):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, layer_id, kv_from, tp)
        wide = 2 if cfg.use_double_wide_mlp and kv_from is not None else 1
        # With experts, the dense MLP's partial sum is reduced together with theirs (forward).
        self.mlp = GatedMLP(h, cfg.intermediate_size * wide, act=_act(cfg), tp=tp, reduce=not cfg.enable_moe_block)
        self.tp = tp
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(h, eps))
        # A checkpoint tensor (a buffer in transformers): the whole residual stream is scaled by it.
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.moe = bool(cfg.enable_moe_block)
        if self.moe:
            self.router = Gemma4Router(cfg)
            first, local = tp.shard(cfg.num_experts, "num_experts")  # expert parallel: whole experts per rank
            self.experts = FusedMoE(cfg.num_experts, h, cfg.moe_intermediate_size, _act(cfg),
                                    experts=range(first, first + local), init_std=cfg.initializer_range)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.ple = bool(cfg.hidden_size_per_layer_input)
        if self.ple:
            self.per_layer_input_gate = nn.Linear(h, cfg.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(cfg.hidden_size_per_layer_input, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)

    def forward(self, normed, x, cos, sin, ple, ctx, next_norm: RMSNorm):
        """x [T, hidden]: the residual stream; normed: input_layernorm(x), made by the previous layer's last
        kernel; ple [T, ple_dim] or None. -> (next_norm(x'), x') for this layer's output x' (next_norm: the
        next layer's input norm, or the final norm)."""
        h = self.self_attn(normed, cos, sin, ctx)
        # x + post_attention_layernorm(h), and its pre-feed-forward norm, in one kernel on a GPU.
        normed, x = self.pre_feedforward_layernorm.add_and_norm(h, x, x_norm=self.post_attention_layernorm)
        h = self.mlp(normed)
        if self.moe:
            w, idx = self.router(x)  # routed on the MLP's input residual, not its output
            moe = self.experts(self.pre_feedforward_layernorm_2(x), w, idx)
            if self.tp.world_size > 1:  # one all-reduce for both partial sums; their norms come after it
                h, moe = self.tp.all_reduce(torch.stack((h, moe))).unbind(0)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        if not self.ple:  # (x + post_ffn_norm(h)) * layer_scalar and the next norm, one kernel on a GPU
            return next_norm.add_and_norm(h, x, x_norm=self.post_feedforward_layernorm, scale=self.layer_scalar)
        x = x + self.post_feedforward_layernorm(h)
        g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * ple
        x = (x + self.post_per_layer_input_norm(self.per_layer_projection(g))) * self.layer_scalar
        return next_norm(x), x


class Gemma4Model(nn.Module):
    def __init__(self, cfg, tp: TPContext = SINGLE):
        super().__init__()
        producers = kv_producers(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i, producers[i], tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ple_dim = cfg.hidden_size_per_layer_input or 0
        if self.ple_dim:
            width = cfg.num_hidden_layers * self.ple_dim
            self.embed_tokens_per_layer = VocabParallelEmbedding(cfg.vocab_size_per_layer_input, width, tp=tp)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.ple_dim, cfg.rms_norm_eps)


class Gemma4ForCausalLM(CausalLM):
    """Serves both Gemma4ForCausalLM and Gemma4ForConditionalGeneration checkpoints (text path)."""

    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        cfg = config.get_text_config()
        if getattr(cfg, "use_bidirectional_attention", None) == "all":
            raise ModelLoadError("this Gemma 4 checkpoint uses bidirectional attention over all tokens",
                                 fix="use a causal (generative) Gemma 4 checkpoint")
        validate.positive_int(cfg, "max_position_embeddings", arch="Gemma 4")
        self.config, self.cfg = config, cfg
        self.model = Gemma4Model(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp=tp)
        self.tied_lm_head = bool(getattr(config, "tie_word_embeddings", True))
        self.softcap = cfg.final_logit_softcapping
        # Scales as tensors of the model's dtype: rounded like the reference (sqrt(5376) -> 73.5 in bf16),
        # and no host-to-device copy per step (CUDA-graph safe).
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        self.register_buffer("ple_scale", torch.tensor(float(cfg.hidden_size_per_layer_input or 1) ** 0.5),
                             persistent=False)
        self.ropes = nn.ModuleDict()
        for i, lt in enumerate(cfg.layer_types):
            if lt not in self.ropes:
                self.ropes[lt] = layer_type_rope(cfg, lt, layer_attention_shape(cfg, i)[0])
        self.consumers = {i for i, p in enumerate(kv_producers(cfg)) if p is not None}
        self.multimodal = cfg is not config
        # Placeholder ids that only mean something with image/audio/video features attached.
        ids = [getattr(config, n, None) for n in ("image_token_id", "video_token_id", "audio_token_id")]
        self.register_buffer("mm_token_ids", torch.tensor([i for i in ids if i is not None] if self.multimodal else [],
                                                          dtype=torch.int64), persistent=False)
        self.pad_token_id = cfg.pad_token_id or 0
        self._skipped_tower_tensors = 0

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_TOWER_PREFIXES):
            self._skipped_tower_tensors += 1
            return None
        if name.startswith(_TEXT_PREFIX):
            name = "model." + name[len(_TEXT_PREFIX):]
        parts = name.split(".")
        # Converted checkpoints keep k/v weights on KV-sharing layers, which never use them.
        if self.layer_index(name, parts) in self.consumers and parts[3:4] == ["self_attn"] \
                and parts[4:5] and parts[4] in _KV_WEIGHTS:
            return None
        return name

    def after_weights_loaded(self) -> None:
        super().after_weights_loaded()
        if self._skipped_tower_tensors:
            log.info("Gemma 4: skipped %d vision/audio tower tensors (attnzoo serves the text model only)",
                     self._skipped_tower_tensors)

    def _per_layer_inputs(self, ids, x):  # -> [T, num_layers, ple_dim]
        m, t = self.model, ids.shape[0]
        tok = m.embed_tokens_per_layer(ids) * self.ple_scale.to(x.dtype)
        proj = m.per_layer_model_projection(x) * self.cfg.hidden_size**-0.5
        proj = m.per_layer_projection_norm(proj.view(t, -1, m.ple_dim))
        return (proj + tok.view(t, -1, m.ple_dim)) * 2.0**-0.5

    def validate_prompt(self, token_ids: list[int]) -> None:
        bad = set(token_ids) & set(self.mm_token_ids.tolist())
        if bad:
            raise RequestError(
                f"the prompt contains token id {min(bad)}, an image/audio/video placeholder: attnzoo serves the text "
                "part of Gemma 4 only and accepts no image, audio or video input",
                fix="pass text or token ids without multimodal placeholders",
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.mm_token_ids.numel():
            # Prompts were checked by validate_prompt; generated placeholders read as padding, as in
            # transformers' text-only path.
            input_ids = torch.where(torch.isin(input_ids, self.mm_token_ids), self.pad_token_id, input_ids)
        x = self.model.embed_tokens(input_ids)
        x = x * self.embed_scale.to(x.dtype)
        ple = self._per_layer_inputs(input_ids, x) if self.model.ple_dim else None
        rope = {lt: r(positions) for lt, r in self.ropes.items()}
        layers = self.model.layers
        normed = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            cos, sin = rope[layer.self_attn.layer_type]
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            normed, x = layer(normed, x, cos, sin, None if ple is None else ple[:, i], ctx, next_norm)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return fused.softcap(logits, self.softcap) if self.softcap else logits
