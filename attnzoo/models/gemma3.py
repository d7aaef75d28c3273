"""Gemma 3 text model: Gemma3ForCausalLM, and the language model of Gemma3ForConditionalGeneration.

What differs from Llama, per transformers' ``models/gemma3/modeling_gemma3.py``:
- ``layer_types`` (from ``sliding_window_pattern``: five sliding layers, then one full): sliding layers
  attend over the last ``sliding_window`` tokens (512 in the 270M/1B models) and use the local RoPE base
  (``rope_parameters["sliding_attention"]``, 10k), full layers the global one (1M, linearly scaled in
  the larger models).
- q/k RMSNorm per head before RoPE (Qwen3's QK-norm) and softmax scale ``query_pre_attn_scalar**-0.5``.
- Sandwich norms: the attention and MLP outputs are normed before their residual adds, and every norm
  computes x / rms(x) * (1 + weight) (weights stored minus one).
- GeGLU MLP (tanh gelu), embeddings scaled by sqrt(hidden), tied head.

Only text goes in: vision tower and projector weights are skipped at load.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from attnzoo.attention.layer import ForwardContext
from attnzoo.errors import ModelLoadError, RequestError
from attnzoo.layers import fused
from attnzoo.layers.parallel import SINGLE, ParallelLMHead, TPContext
from attnzoo.models.common import CausalLM, DecoderModel, GatedMLP, RMSNorm
from attnzoo.models.gemma4 import layer_type_rope
from attnzoo.models.qwen3 import QKNormAttention

log = logging.getLogger("attnzoo")

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# Checkpoint prefixes of Gemma3ForConditionalGeneration: its text model (transformers >= 5 names, then the
# released checkpoints' names) and the parts attnzoo does not run.
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_TOWER_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def _check(cfg) -> None:
    if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"Gemma 3 hidden_activation {cfg.hidden_activation!r} is not supported",
                             fix="use a checkpoint with gelu_pytorch_tanh")
    if cfg.attn_logit_softcapping is not None:
        raise ModelLoadError("Gemma 3 with attn_logit_softcapping is not supported (the released models have none)",
                             fix="set attn_logit_softcapping to null in config.json")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ModelLoadError("this Gemma 3 checkpoint uses bidirectional attention (an embedding model)",
                             fix="use a causal (generative) Gemma 3 checkpoint")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int, tp: TPContext = SINGLE):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_id]
        window = cfg.sliding_window if self.layer_type == "sliding_attention" else None
        self.self_attn = QKNormAttention(cfg, layer_id, tp, norm_offset=1.0, scale=cfg.query_pre_attn_scalar**-0.5,
                                         sliding_window=window)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act="gelu_tanh", tp=tp)
        for name in _NORMS:
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0))

    def forward(self, normed, x, cos, sin, ctx, next_norm: RMSNorm):
        """x [T, hidden]: the residual stream; normed: input_layernorm(x), made by the previous layer's last
        kernel. -> (next_norm(x'), x') for this layer's output x' (next_norm: the next layer's input norm,
        or the final norm). Each residual add is one kernel with the post-norm before it and the norm after."""
        h = self.self_attn(normed, cos, sin, ctx)
        normed, x = self.pre_feedforward_layernorm.add_and_norm(h, x, x_norm=self.post_attention_layernorm)
        return next_norm.add_and_norm(self.mlp(normed), x, x_norm=self.post_feedforward_layernorm)


class Gemma3ForCausalLM(CausalLM):
    """Serves both Gemma3ForCausalLM and Gemma3ForConditionalGeneration checkpoints (text path)."""

    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__()
        cfg = config.get_text_config()
        _check(cfg)
        self.config, self.cfg = config, cfg
        layers = (Gemma3DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.model = DecoderModel(cfg, layers, tp, norm_offset=1.0)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp=tp)
        self.tied_lm_head = bool(getattr(config, "tie_word_embeddings", True))
        self.softcap = cfg.final_logit_softcapping
        # A tensor of the model's dtype: rounded like the reference (sqrt(640) in bf16), no per-step copy.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        head_dim = self.model.layers[0].self_attn.head_dim
        self.ropes = nn.ModuleDict({lt: layer_type_rope(cfg, lt, head_dim) for lt in dict.fromkeys(cfg.layer_types)})
        self.multimodal = cfg is not config
        image = getattr(config, "image_token_id", None) if self.multimodal else None
        self.image_token_id = image
        self._skipped_tower_tensors = 0

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_TOWER_PREFIXES):
            self._skipped_tower_tensors += 1
            return None
        for prefix, ours in _TEXT_PREFIXES.items():
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return name

    def after_weights_loaded(self) -> None:
        super().after_weights_loaded()
        if self._skipped_tower_tensors:
            log.info("Gemma 3: skipped %d vision tower / projector tensors (attnzoo serves the text model only)",
                     self._skipped_tower_tensors)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if self.image_token_id is not None and self.image_token_id in token_ids:
            raise RequestError(
                f"the prompt contains token id {self.image_token_id}, the image placeholder: attnzoo serves the "
                "text part of Gemma 3 only and accepts no image input",
                fix="pass text or token ids without image placeholders",
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        x = x * self.embed_scale.to(x.dtype)
        rope = {lt: r(positions) for lt, r in self.ropes.items()}
        layers = self.model.layers
        normed = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            normed, x = layer(normed, x, *rope[layer.layer_type], ctx, next_norm)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return fused.softcap(logits, self.softcap) if self.softcap else logits
