"""Hugging Face ``architectures`` name -> our model class, imported only when asked for."""
from __future__ import annotations

from attnzoo.errors import UnsupportedArchitectureError
from attnzoo.lazy import import_object

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "attnzoo.models.llama:LlamaForCausalLM",
    "DeepseekV2ForCausalLM": "attnzoo.models.deepseek_v2:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "attnzoo.models.deepseek_v2:DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": "attnzoo.models.deepseek_v32:DeepseekV32ForCausalLM",
    "Gemma4ForCausalLM": "attnzoo.models.gemma4:Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration": "attnzoo.models.gemma4:Gemma4ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str):
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not implemented in attnzoo",
            fix=f"use a checkpoint of one of: {', '.join(supported_architectures())}",
        )
    return import_object(_MODELS[architecture])
