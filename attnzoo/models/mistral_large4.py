"""Mistral Large 4 (MistralLarge4ForConditionalGeneration, transformers' ``mistral_large4``): the text model,
GLM-5's MLA + DeepSeek Sparse Attention (``attnzoo.models.glm_moe_dsa``) with Mistral's changes:

- No q low-rank path: ``q_proj`` reads the hidden states (as DeepSeek-V2-Lite); the latent norm uses
  ``rms_norm_eps`` (DeepSeek: 1e-6).
- NoPE layers (``no_rope_layers[i] == 0``, every 4th by default): the layer's RoPE width is 0, its
  query and key channels all nope (``q_proj`` H x 128, ``kv_a`` rank wide, ``kv_b`` H x (128 + v)), and its
  indexer ropes nothing. The cache entry keeps the model's width with zero rope channels (they add
  nothing to a score): one entry shape for every layer, so every MLA/NSA kernel serves NoPE layers.
- Cross-layer latent sharing (``kv_source_layers[i] != i``): the layer has no ``kv_a_proj_with_mqa`` and
  attends over its source layer's cached latent with its own ``kv_b`` (the pool's ``kv_shared_from``:
  no entry of its own; its indexer keys, if it indexes, are its own). transformers looks the source up
  by RoPE kind (the latest earlier sharing layer of that kind); configs where that is not
  ``kv_source_layers[i]`` are refused.
- LeRoPE: YaRN over ``qk_rope_head_dim`` with each inverse frequency times exp(alpha), alpha learned
  (``lerope.alpha``); RoPE on interleaved pairs, in attention and indexer (as GLM-5).
- A learned per-head query scale ``s_h * log(p + 1) + b_h`` at position p (``ssmax_scaling``), on the
  attention query (after RoPE) and on the indexer query.
- Indexer query from the hidden states: LayerNorm (``q_input_norm``), ``wq_b`` (hidden -> Hi x D).
- Routing: softmax scores in float32, groups by their two best scores, always renormalised, scaled.
- Final logits soft-capped: cap * tanh(logits / cap), cap = ``final_logit_softcapping`` (30).
- Checkpoint names are Mistral's (transformers saves them so): ``layers.N.attention.wq``, ``wkv_a_with_mqa``,
  ``experts.E.w1`` ...; transformers' in-memory names (``model.language_model.*``) load too. The vision
  tower, projector and the MTP draft head (``mtp_dspark.*``) are skipped with a log line; image
  placeholder ids in a prompt are refused.

The math follows transformers' ``models/mistral_large4``.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from attnzoo.attention.layer import ForwardContext
from attnzoo.errors import ModelLoadError
from attnzoo.layers import fused
from attnzoo.layers.parallel import SINGLE, TPContext, mark_shard, narrow
from attnzoo.models.common import RotaryEmbedding, apply_rope, apply_rope_qk
from attnzoo.models.deepseek_v32 import DeepseekV32Indexer
from attnzoo.models.glm_moe_dsa import GlmMoeDsaAttention, GlmMoeDsaForCausalLM
from attnzoo.models.kimi_mistral import _TextOfMultimodal

log = logging.getLogger("attnzoo")

# Mistral's tensor names -> ours, applied in order to names under Mistral's roots.
_ROOTS = ("layers.", "tok_embeddings.", "norm.", "output.", "lerope.")
_RENAMES = tuple((re.compile(p), r) for p, r in (
    (r"^tok_embeddings\.", "model.embed_tokens."), (r"^norm\.", "model.norm."), (r"^output\.", "lm_head."),
    (r"^lerope\.alpha$", "rotary.alpha"), (r"^layers\.", "model.layers."),
    (r"\.attention_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attention\.", ".self_attn."), (r"\.wq\.", ".q_proj."), (r"\.wkv_a_with_mqa\.", ".kv_a_proj_with_mqa."),
    (r"\.wkv_b\.", ".kv_b_proj."), (r"\.wo\.", ".o_proj."), (r"\.kv_a_norm\.", ".kv_a_layernorm."),
    (r"\.ssmax_scaling\.s$", ".softmax_scaling.scale"), (r"\.ssmax_scaling\.b$", ".softmax_scaling.bias"),
    (r"\.feed_forward\.", ".mlp."), (r"\.(gate|experts|shared_experts)\.", r".mlp.\1."),
    (r"\.w1\.", ".gate_proj."), (r"\.w2\.", ".down_proj."), (r"\.w3\.", ".up_proj."),
))


class LeRoPE(RotaryEmbedding):
    """The config's RoPE tables with each inverse frequency scaled by exp(alpha), alpha learned."""

    def __init__(self, config, *, rope_type: str, head_dim: int):
        super().__init__(config, rope_type=rope_type, head_dim=head_dim)
        self.alpha = nn.Parameter(torch.zeros_like(self.inv_freq))  # exp(0) = 1: plain RoPE until loaded

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must not round alpha (transformers keeps the rotary embedding in float32).
        super()._apply(fn, recurse)
        if self.alpha.dtype != torch.float32:
            self.alpha.data = self.alpha.data.float()
        return self

    def frequencies(self, device: torch.device) -> torch.Tensor:
        return super().frequencies(device) * self.alpha.float().exp()


class PositionQueryScale(nn.Module):
    """The per-head query multiplier scale_h * log(p + 1) + bias_h at position p; heads split as q_proj's."""

    def __init__(self, num_heads: int, tp: TPContext = SINGLE):
        super().__init__()
        first, local = tp.shard(num_heads, "num_attention_heads")
        cut = narrow(0, first, local, num_heads)
        # 0 and 1: no scaling until loaded
        self.scale = mark_shard(nn.Parameter(torch.zeros(local)), cut)
        self.bias = mark_shard(nn.Parameter(torch.ones(local)), cut)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> [T, heads, 1] in the parameters' dtype (the reference's: the query's)."""
        log_pos = (positions + 1).float().log().to(self.scale.dtype)
        return (self.scale[None, :] * log_pos[:, None] + self.bias[None, :])[..., None]


class MistralLarge4Indexer(DeepseekV32Indexer):
    """V3.2's indexer with its query read from the hidden states: LayerNorm, wq_b, the position scale."""

    @staticmethod
    def query_input_dim(config) -> int:
        return config.hidden_size

    def __init__(self, config, *, interleaved_rope: bool):
        super().__init__(config, interleaved_rope=interleaved_rope)
        self.q_input_norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.softmax_scaling = PositionQueryScale(self.n_heads)  # replicated, as the indexer

    def forward(self, x, positions, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q [T, Hi, D] and k [T, D], roped unless NoPE; weights [T, Hi] float32."""
        t = x.shape[0]
        q = self.wq_b(self.q_input_norm(x)).view(t, self.n_heads, self.head_dim) * self.softmax_scaling(positions)
        k = self.k_norm(self.wk(x))
        if self.rope_dim:
            q, k = self._rope(q, cos, sin), self._rope(k[:, None, :], cos, sin)[:, 0]
        return q, k, self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()


class _NoPEConfig:
    """A NoPE layer's view of the config: every query/key channel nope, as transformers sizes its projections."""

    def __init__(self, config):
        self._config = config
        self.qk_nope_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.qk_rope_head_dim = 0

    def __getattr__(self, name):
        return getattr(self._config, name)


class MistralLarge4Attention(GlmMoeDsaAttention):
    indexer_cls = MistralLarge4Indexer

    @staticmethod
    def owns_latent(config, layer_id: int) -> bool:
        return config.kv_source_layers[layer_id] == layer_id

    def __init__(self, config, layer_id: int, *, interleaved_rope: bool, tp: TPContext = SINGLE):
        # Plain ints before Module.__init__: nsa_core, called from the base's __init__, reads them.
        self.entry_rope_dim, self.kv_source = config.qk_rope_head_dim, config.kv_source_layers[layer_id]
        nope = not config.no_rope_layers[layer_id]
        super().__init__(_NoPEConfig(config) if nope else config, layer_id, interleaved_rope=interleaved_rope, tp=tp)
        if self.kv_a_layernorm is not None:
            self.kv_a_layernorm.eps = config.rms_norm_eps
        self.softmax_scaling = PositionQueryScale(config.num_attention_heads, tp)

    def nsa_core(self, config, layer_id: int, own_indexer: bool, **overrides):
        shared = None if self.kv_source == layer_id else self.kv_source
        return super().nsa_core(config, layer_id, own_indexer, qk_rope_head_dim=self.entry_rope_dim,
                                kv_shared_from=shared, **overrides)

    def project(self, x, cos, sin, positions):
        """-> scaled q_nope [T, H, nope], scaled roped q_pe [T, H, entry rope]; the normalized latent
        [T, rank] and roped k_pe [T, entry rope], both None on a KV-sharing layer."""
        t, h = x.shape[0], self.num_heads
        q, *kv = self.q_kv_a_proj.split(self.q_kv_a_proj(x))
        q_nope, q_pe = q.view(t, h, self.qk_head_dim).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent = k_pe = None
        if kv:
            latent, k_pe = kv[0].split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            latent = self.kv_a_layernorm(latent)
        if not self.qk_rope_head_dim:  # NoPE
            q_pe = q.new_zeros(t, h, self.entry_rope_dim)
            k_pe = None if latent is None else q.new_zeros(t, self.entry_rope_dim)
        elif k_pe is None:  # the source layer roped the shared key
            q_pe = apply_rope(q_pe, cos, sin, interleaved=self.interleaved_rope)
        else:
            q_pe, k_pe = apply_rope_qk(q_pe, k_pe[:, None, :], cos, sin, interleaved=self.interleaved_rope)
            k_pe = k_pe[:, 0]
        s = self.softmax_scaling(positions)
        return q_nope * s, q_pe * s, latent, k_pe

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        positions = ctx.meta.positions
        q_nope, q_pe, latent, k_pe = self.project(x, cos, sin, positions)
        iq = ik = iw = None  # no indexer: the step's last selection is reused
        if self.indexer is not None:
            iq, ik, iw = self.indexer(x, positions, cos, sin)
        out = self.mla(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, ctx, index_q=iq, index_k=ik, index_weights=iw)
        return self.o_proj(out)


class MistralLarge4ForConditionalGeneration(_TextOfMultimodal, GlmMoeDsaForCausalLM):
    label = "Mistral Large 4"
    towers = ("vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter.",
              "model.vision_tower.", "model.multi_modal_projector.")
    placeholders = ("image_token_id",)
    scoring = "softmax_top2"
    attention_cls = MistralLarge4Attention

    def __init__(self, config, tp: TPContext = SINGLE):
        text = config.get_text_config()
        _check_config(text)
        super().__init__(config, tp)
        self.rotary = LeRoPE(text, rope_type=text.rope_parameters.get("rope_type", "default"),
                             head_dim=text.qk_rope_head_dim)
        self.softcap = text.final_logit_softcapping
        self._skipped_draft: set[str] = set()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return fused.softcap(logits, self.softcap) if self.softcap else logits

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith("mtp_dspark."):  # the multi-token-prediction draft head
            self._skipped_draft.add(name)
            return None
        if name.startswith(_ROOTS):
            for pattern, repl in _RENAMES:
                name = pattern.sub(repl, name)
        name = super().checkpoint_name(name)
        return "rotary.alpha" if name == "model.rotary_emb.alpha" else name  # transformers' in-memory name

    def after_weights_loaded(self) -> None:
        super().after_weights_loaded()
        if self._skipped_draft:
            log.info("%s: skipped %d tensors of the multi-token-prediction draft head (not used to generate)",
                     self.label, len(self._skipped_draft))


def _check_config(config) -> None:
    n, sources = config.num_hidden_layers, list(config.kv_source_layers)
    if len(sources) != n or len(config.no_rope_layers) < n:
        raise ModelLoadError(f"kv_source_layers ({len(sources)}) and no_rope_layers ({len(config.no_rope_layers)}) "
                             f"must have an entry per layer ({n})", fix="fix them in config.json")
    latest: dict[bool, int] = {}  # RoPE kind -> the latest layer that shares its latent
    for i, src in enumerate(sources):
        rope = bool(config.no_rope_layers[i])
        if src != i and latest.get(rope) != src:
            raise ModelLoadError(
                f"layer {i} reads the latent of layer {src}, but transformers would give it that of layer "
                f"{latest.get(rope)} (the latest earlier layer of its RoPE kind that shares its latent)",
                fix="make kv_source_layers name, for each sharing layer, the latest earlier producer of its RoPE kind")
        if src == i and i in sources[i + 1:]:
            latest[rope] = i
