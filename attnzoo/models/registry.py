"""Hugging Face ``architectures`` name -> our model class, imported only when asked for."""
from __future__ import annotations

import logging

from attnzoo.errors import UnsupportedArchitectureError
from attnzoo.lazy import import_object

log = logging.getLogger(__name__)

# architecture -> (our class, config.json's model_type): configs read from GGUF files name only a
# model_type, and a config.json dict becomes its transformers config class through the model_type.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("attnzoo.models.llama:LlamaForCausalLM", "llama"),
    "DeepseekV2ForCausalLM": ("attnzoo.models.deepseek_v2:DeepseekV2ForCausalLM", "deepseek_v2"),
    "DeepseekV3ForCausalLM": ("attnzoo.models.deepseek_v2:DeepseekV3ForCausalLM", "deepseek_v3"),
    "DeepseekV32ForCausalLM": ("attnzoo.models.deepseek_v32:DeepseekV32ForCausalLM", "deepseek_v32"),
    "GlmMoeDsaForCausalLM": ("attnzoo.models.glm_moe_dsa:GlmMoeDsaForCausalLM", "glm_moe_dsa"),
    # The released Kimi K2.5 config.json names the class without transformers' underscore.
    "KimiK25ForConditionalGeneration": ("attnzoo.models.kimi_mistral:KimiK25ForConditionalGeneration", "kimi_k25"),
    "Kimi_K25ForConditionalGeneration": ("attnzoo.models.kimi_mistral:KimiK25ForConditionalGeneration", "kimi_k25"),
    "Mistral4ForCausalLM": ("attnzoo.models.kimi_mistral:Mistral4ForCausalLM", "mistral4"),
    # Mistral Small 4: Mistral 4 text inside Mistral 3's multimodal wrapper (other text models are refused).
    "Mistral3ForConditionalGeneration": ("attnzoo.models.kimi_mistral:Mistral3ForConditionalGeneration", "mistral3"),
    "Qwen3ForCausalLM": ("attnzoo.models.qwen3:Qwen3ForCausalLM", "qwen3"),
    "Qwen3MoeForCausalLM": ("attnzoo.models.qwen3:Qwen3MoeForCausalLM", "qwen3_moe"),
    "Gemma3ForCausalLM": ("attnzoo.models.gemma3:Gemma3ForCausalLM", "gemma3_text"),
    "Gemma3ForConditionalGeneration": ("attnzoo.models.gemma3:Gemma3ForCausalLM", "gemma3"),
    "DeepseekV4ForCausalLM": ("attnzoo.models.deepseek_v4:DeepseekV4ForCausalLM", "deepseek_v4"),
    "Gemma4ForCausalLM": ("attnzoo.models.gemma4:Gemma4ForCausalLM", "gemma4_text"),
    "Gemma4ForConditionalGeneration": ("attnzoo.models.gemma4:Gemma4ForCausalLM", "gemma4"),
    "GptOssForCausalLM": ("attnzoo.models.gpt_oss:GptOssForCausalLM", "gpt_oss"),
}
_ARCH_OF_MODEL_TYPE = {model_type: arch for arch, (_, model_type) in _MODELS.items()}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


# Keys whose presence means the layers are not Llama's (latent or sparse attention, experts, biases, norms).
_NOT_LLAMA = ("kv_lora_rank", "q_lora_rank", "index_topk", "num_experts", "n_routed_experts", "num_local_experts",
              "attn_logit_softcapping", "qk_norm", "use_qk_norm", "layer_types", "mlp_bias", "attention_bias")


def llama_shaped(config) -> bool:
    """Whether a config for an unknown architecture describes Llama's layers: dense GQA attention with RoPE
    and a SwiGLU MLP, nothing the Llama model would silently drop."""
    text = _get(config, "text_config")
    if text is not None:
        return False
    need = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
    return (all(_get(config, k) for k in need) and not any(_get(config, k) for k in _NOT_LLAMA)
            and _get(config, "hidden_act") in (None, "silu") and not _get(config, "sliding_window"))


def model_class(architecture: str, config=None):
    """Our class for ``architecture``; an unknown one whose ``config`` is Llama-shaped loads as Llama."""
    if architecture not in _MODELS:
        if config is not None and llama_shaped(config):
            log.info("architecture %s is not in attnzoo's registry; its config is Llama-shaped: loading it with "
                     "the Llama model", architecture)
            return import_object(_MODELS["LlamaForCausalLM"][0])
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not implemented in attnzoo",
            fix=f"use a checkpoint of one of: {', '.join(supported_architectures())} (or any config with "
                "Llama-shaped layers)",
        )
    return import_object(_MODELS[architecture][0])


def _get(config, name: str):
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def architecture_of(config) -> str | None:
    """``architectures[0]`` of a config (object or config.json dict), else the one causal-LM class of its
    model_type (GGUF configs carry no architectures), else None."""
    archs = _get(config, "architectures") or []
    return archs[0] if archs else _ARCH_OF_MODEL_TYPE.get(str(_get(config, "model_type") or ""))


def config_object(config, architecture: str):
    """A transformers config object for a config.json dict (what the policy CLI reads); objects pass."""
    if not isinstance(config, dict):
        return config
    from transformers import AutoConfig

    from transformers import CONFIG_MAPPING, LlamaConfig

    model_type = config.get("model_type") or _MODELS.get(architecture, ("", "llama"))[1]
    kw = {k: v for k, v in config.items() if k != "model_type"}
    if model_type not in CONFIG_MAPPING and llama_shaped(config):  # an unknown family with Llama's layers
        return LlamaConfig(**kw)
    return AutoConfig.for_model(model_type, **kw)
