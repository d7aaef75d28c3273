"""DeepSeek-V3-shaped text models under other names, on the DeepSeek-V3 code (``attnzoo.models.deepseek_v2``).

Kimi K2.5 (Kimi_K25ForConditionalGeneration, transformers' ``kimi_k25``): its ``text_config`` is a
``deepseek_v3`` config and the text model is DeepSeek-V3 unchanged. Only the checkpoint names differ:
``language_model.model.*`` (transformers' own save writes ``language_model.model.blocks.<i>``, the
released checkpoints ``layers.<i>``) and ``language_model.lm_head``, or ``model.language_model.*`` as
transformers holds them; the vision tower and ``mm_projector`` are skipped. Placeholders embed as token 0.

Mistral 4 (Mistral4ForCausalLM, transformers' ``mistral4``; Mistral Small 4 ships it as the text part of
Mistral3ForConditionalGeneration, whose vision tower and projector are skipped). What differs from V3:

- Routing: softmax scores (V3: sigmoid), no correction bias, groups ranked by their two best scores,
  renormalised (``norm_topk_prob``), scaled. transformers routes in the model dtype; this model, as V3,
  in float32 (the same in float32).
- Queries: multiplied per token by Llama 4's ``1 + beta * log(1 + floor(pos / original_max))``
  (``rope_parameters.llama_4_scaling_beta``, ``original_max_position_embeddings``).
- RoPE: transformers' Llama rotary over ``partial_rotary_factor`` of the head: the same frequencies as
  DeepSeek's over ``qk_rope_head_dim``; interleaved pairs when ``rope_interleave``.

Both wrappers serve text only: a prompt holding an image/video placeholder id is refused (as Gemma 4).
The lm_head is tied to the embeddings when the outer config's ``tie_word_embeddings`` says so (the one
transformers reads).
"""
from __future__ import annotations

import logging

import torch

from attnzoo.attention.layer import ForwardContext
from attnzoo.errors import ModelLoadError, RequestError
from attnzoo.layers.parallel import SINGLE, TPContext
from attnzoo.models.deepseek_v2 import DeepseekAttention, DeepseekV3ForCausalLM

log = logging.getLogger("attnzoo")


class Mistral4Attention(DeepseekAttention):
    """V3's MLA with Llama 4's position-dependent query scale."""

    def __init__(self, config, layer_id: int, *, interleaved_rope: bool, tp: TPContext = SINGLE):
        super().__init__(config, layer_id, interleaved_rope=interleaved_rope, tp=tp)
        rope = config.rope_parameters
        self.beta = rope.get("llama_4_scaling_beta")
        self.original_max = rope.get("original_max_position_embeddings") or config.max_position_embeddings

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q_nope, q_pe, _, latent, k_pe = self.project(x, cos, sin)
        if self.beta:
            pos = ctx.meta.positions.float()
            s = (1 + self.beta * torch.log(1 + torch.floor(pos / self.original_max)))[:, None, None].to(q_nope.dtype)
            q_nope = q_nope * s  # the whole query, as the reference scales it; q_pe where it sits (its rope_slot)
            q_pe.mul_(s)
        return self.o_proj(self.mla(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, ctx, q_pe_in_slot=True))


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    scoring = "softmax_top2"
    attention_cls = Mistral4Attention


class _TextOfMultimodal:
    """A DeepSeek-V3-shaped text model read out of a multimodal checkpoint (mixed in before the model class)."""

    label = ""
    towers: tuple[str, ...] = ()  # checkpoint prefixes of the non-text parts
    placeholders: tuple[str, ...] = ()  # config keys of the image/video placeholder ids
    placeholder_embeds_as: int | None = None  # the reference's text path embeds placeholders as this id

    def __init__(self, config, tp: TPContext = SINGLE):
        super().__init__(config.get_text_config(), tp)
        self.tied_lm_head = bool(getattr(config, "tie_word_embeddings", False))
        ids = [getattr(config, k, None) for k in self.placeholders]
        self.register_buffer("mm_token_ids", torch.tensor([i for i in ids if i is not None], dtype=torch.int64),
                             persistent=False)
        self._skipped_towers: set[str] = set()  # a set: the FP8 plan asks about a name more than once

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(self.towers):
            self._skipped_towers.add(name)
            return None
        for old, new in (("language_model.model.", "model."), ("model.language_model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith("model.blocks."):  # transformers' reverse of its vision "blocks" -> "layers" rename
            name = "model.layers." + name[len("model.blocks."):]
        return super().checkpoint_name(name)

    def after_weights_loaded(self) -> None:
        super().after_weights_loaded()
        if self._skipped_towers:
            log.info("%s: skipped %d vision tower/projector tensors (attnzoo serves the text model only)",
                     self.label, len(self._skipped_towers))

    def validate_prompt(self, token_ids: list[int]) -> None:
        bad = set(token_ids) & set(self.mm_token_ids.tolist())
        if bad:
            raise RequestError(
                f"the prompt contains token id {min(bad)}, an image/video placeholder: attnzoo serves the text part "
                f"of {self.label} only and accepts no image or video input",
                fix="pass text or token ids without multimodal placeholders",
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.placeholder_embeds_as is not None and self.mm_token_ids.numel():
            # Prompts were checked by validate_prompt; a generated placeholder embeds as the reference's does.
            input_ids = torch.where(torch.isin(input_ids, self.mm_token_ids), self.placeholder_embeds_as, input_ids)
        return super().forward(input_ids, positions, ctx)


class KimiK25ForConditionalGeneration(_TextOfMultimodal, DeepseekV3ForCausalLM):
    label = "Kimi K2.5"
    towers = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")
    placeholders = ("image_token_id", "video_token_id")
    placeholder_embeds_as = 0


class Mistral3ForConditionalGeneration(_TextOfMultimodal, Mistral4ForCausalLM):
    """Mistral Small 4's checkpoint: Mistral 4 text inside Mistral 3's multimodal wrapper."""

    label = "Mistral 4"
    towers = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
    placeholders = ("image_token_id",)

    def __init__(self, config, tp: TPContext = SINGLE):
        text_type = getattr(config.get_text_config(), "model_type", None)
        if text_type != "mistral4":
            raise ModelLoadError(
                f"Mistral3ForConditionalGeneration with a {text_type!r} text model is not implemented in attnzoo "
                "(only Mistral 4's MLA text model, as in Mistral Small 4)",
                fix="use a Mistral Small 4 checkpoint (text_config.model_type 'mistral4')",
            )
        super().__init__(config, tp)
