"""GLM-5 (GlmMoeDsaForCausalLM, transformers' ``glm_moe_dsa``): DeepSeek-V3.2's MLA + DeepSeek Sparse
Attention on the V3.2 code (``attnzoo.models.deepseek_v32``, ``attnzoo.attention.nsa``).

What differs from V3.2:

- Indexer RoPE: the indexer's query and key rotate their first ``qk_rope_head_dim`` channels on
  interleaved pairs (V3.2: rotate-half). Its shapes are V3.2's (``wq_b`` on the q low-rank residual,
  ``wk`` + LayerNorm key, float32 ``weights_proj``); GLM-5 sizes them 32 heads x 128.
- Cross-layer top-k sharing: ``indexer_types[i]`` is "full" (the layer runs its own indexer) or "shared"
  (no indexer weights and no indexer key cache; the layer attends over the positions the previous full
  layer of the same step selected, ``ForwardContext.nsa_positions``). The config derives it from
  ``index_topk_freq`` / ``index_skip_topk_offset`` or ``index_topk_pattern``; GLM-5's defaults make every
  layer "full".
- MLA: always q low-rank, RoPE on interleaved pairs (no ``rope_interleave`` switch), head dims 192 nope +
  64 rope, values 256 (the absorbed form is DeepSeek's: 576 / 512, 64 heads).
- Routing: DeepSeek-V3's sigmoid scores with ``e_score_correction_bias``, renormalised, scaled by
  ``routed_scaling_factor`` (2.5); one expert group (n_group = topk_group = 1).
- Dense first layers: ``first_k_dense_replace`` (3) or ``mlp_layer_types``, which must agree.
- MTP: the checkpoint's multi-token-prediction layers (``model.layers.<num_hidden_layers>...``) are
  skipped at load, with a log line (``DeepseekV2ForCausalLM.checkpoint_name``).

The math follows transformers' ``models/glm_moe_dsa``.
"""
from __future__ import annotations

from attnzoo.errors import ModelLoadError
from attnzoo.layers.parallel import SINGLE, TPContext
from attnzoo.models.deepseek_v32 import DeepseekV32Attention, DeepseekV32ForCausalLM

INDEXER_TYPES = ("full", "shared")


class GlmMoeDsaAttention(DeepseekV32Attention):
    indexer_interleaved_rope = True

    @staticmethod
    def has_indexer(config, layer_id: int) -> bool:
        return config.indexer_types[layer_id] == "full"


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    attention_cls = GlmMoeDsaAttention

    def __init__(self, config, tp: TPContext = SINGLE):
        _check_indexer_types(config)
        super().__init__(config, tp)


def _check_indexer_types(config) -> None:
    types = getattr(config, "indexer_types", None)
    n = config.num_hidden_layers
    if types is None or len(types) != n or any(t not in INDEXER_TYPES for t in types):
        raise ModelLoadError(
            f"GLM-5 indexer_types must list 'full' or 'shared' for each of the {n} layers, the config has {types!r}",
            fix="fix indexer_types (or index_topk_pattern / index_topk_freq) in config.json",
        )
    if types[0] != "full":
        raise ModelLoadError("GLM-5 indexer_types[0] is 'shared', but a shared layer reuses the selection of an "
                             "earlier full layer and layer 0 has none",
                             fix="make the first entry of indexer_types 'full'")
