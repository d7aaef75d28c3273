"""Hugging Face ``architectures`` name -> our model class, imported only when asked for."""
from __future__ import annotations

from attnzoo.errors import UnsupportedArchitectureError
from attnzoo.lazy import import_object

# architecture -> (our class, config.json's model_type): configs read from GGUF files name only a
# model_type, and a config.json dict becomes its transformers config class through the model_type.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("attnzoo.models.llama:LlamaForCausalLM", "llama"),
    "DeepseekV2ForCausalLM": ("attnzoo.models.deepseek_v2:DeepseekV2ForCausalLM", "deepseek_v2"),
    "DeepseekV3ForCausalLM": ("attnzoo.models.deepseek_v2:DeepseekV3ForCausalLM", "deepseek_v3"),
    "DeepseekV32ForCausalLM": ("attnzoo.models.deepseek_v32:DeepseekV32ForCausalLM", "deepseek_v32"),
    "DeepseekV4ForCausalLM": ("attnzoo.models.deepseek_v4:DeepseekV4ForCausalLM", "deepseek_v4"),
    "Gemma4ForCausalLM": ("attnzoo.models.gemma4:Gemma4ForCausalLM", "gemma4_text"),
    "Gemma4ForConditionalGeneration": ("attnzoo.models.gemma4:Gemma4ForCausalLM", "gemma4"),
}
_ARCH_OF_MODEL_TYPE = {model_type: arch for arch, (_, model_type) in _MODELS.items()}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str):
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not implemented in attnzoo",
            fix=f"use a checkpoint of one of: {', '.join(supported_architectures())}",
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

    model_type = config.get("model_type") or _MODELS[architecture][1]
    return AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
