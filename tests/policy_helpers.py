"""What the policy tests share: no user policy file from the environment, the FlashInfer package present or absent as
the test says, policy files written to a temporary folder, and model profiles."""
from __future__ import annotations

from pathlib import Path

import pytest

from attnzoo.attention.backends import capabilities as caps_mod
from attnzoo.policy import ModelProfile


# Every architecture the shipped table names, by its family.
ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "DeepseekV2ForCausalLM": "deepseek_mla",
    "DeepseekV3ForCausalLM": "deepseek_mla",
    "DeepseekV32ForCausalLM": "deepseek_nsa",
    "Kimi_K25ForConditionalGeneration": "deepseek_mla",
    "KimiK25ForConditionalGeneration": "deepseek_mla",
    "Mistral4ForCausalLM": "deepseek_mla",
    "Mistral3ForConditionalGeneration": "deepseek_mla",
    "GlmMoeDsaForCausalLM": "deepseek_nsa",
    "MistralLarge4ForConditionalGeneration": "deepseek_nsa",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}


@pytest.fixture(autouse=True)
def _no_user_policy(monkeypatch):
    monkeypatch.delenv("ATTNZOO_POLICY", raising=False)


def pretend_modules(monkeypatch, **present: bool):
    real = caps_mod.module_available
    monkeypatch.setattr(caps_mod, "module_available", lambda m: present.get(m, real(m)) if m else True)


@pytest.fixture
def flashinfer_installed(monkeypatch):
    pretend_modules(monkeypatch, flashinfer=True)


@pytest.fixture
def flashinfer_missing(monkeypatch):
    pretend_modules(monkeypatch, flashinfer=False)


def write(tmp_path: Path, text: str, name: str = "policy.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def line_of(text: str, needle: str) -> int:
    return next(i for i, l in enumerate(text.splitlines(), 1) if needle in l)


def profile(arch="LlamaForCausalLM", family="llama", kind="mha", dims=(128,), vdims=None, **kw) -> ModelProfile:
    return ModelProfile(architecture=arch, family=family, kind=kind, head_dims=frozenset(dims),
                        v_head_dims=frozenset(vdims or dims), **kw)


# A user policy file with an entry at every level (family GPU row, architecture, model-id patterns).
USER_POLICY = """\
schema = 1

[family.gemma4.gpu.sm90]
page_size = 32
reason = "family entry, GPU row"

[family.gemma4.arch.Gemma4ForConditionalGeneration]
decode = "torch"
reason = "arch entry, all GPUs"

[models."google/gemma-4-*"]
prefill = "torch"

[models."google/gemma-4-31B-*".gpu.sm90]
page_size = 8
"""


SMALL_TABLE = """\
schema = 1
[family.llama]
fallback = ["triton", "torch"]
profile = { kind = "mha", head_dims = [128], num_kv_heads = [8] }
[family.llama.gpu.sm90]
prefill = "triton"
decode = "triton"
page_size = 16
reason = "family default"
[family.llama.arch.LlamaForCausalLM.gpu.sm90]
decode = "torch"
reason = "arch entry"
[family.llama.arch.LlamaForCausalLM.gpu.sm100]
backend = "trtllm_mha"
page_size = 8
reason = "arch entry naming trtllm_mha with a page size it cannot take"
"""


def tiny_configs():
    """A tiny transformers config of each architecture the table names (transformers imported on call)."""
    from transformers import (DeepseekV2Config, DeepseekV3Config, DeepseekV32Config, Gemma3Config,
                              Gemma3TextConfig, Gemma4Config, Gemma4TextConfig, LlamaConfig, Qwen3Config,
                              Qwen3MoeConfig)

    gemma_text = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, global_head_dim=64, attention_k_eq_v=True, num_global_key_value_heads=1,
                      sliding_window=16, vocab_size=128, vocab_size_per_layer_input=128)
    mla = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
               qk_nope_head_dim=16, v_head_dim=16, vocab_size=128)
    qwen = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=2,
                vocab_size=128)
    gemma3 = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  sliding_window=16, vocab_size=128)
    cfgs = {
        "LlamaForCausalLM": LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, vocab_size=128),
        "Qwen3ForCausalLM": Qwen3Config(**qwen),
        "Qwen3MoeForCausalLM": Qwen3MoeConfig(**qwen, num_experts=4, moe_intermediate_size=32),
        "Gemma3ForCausalLM": Gemma3TextConfig(**gemma3),
        "Gemma3ForConditionalGeneration": Gemma3Config(text_config=gemma3),
        "Gemma4ForCausalLM": Gemma4TextConfig(**gemma_text),
        "Gemma4ForConditionalGeneration": Gemma4Config(text_config=gemma_text),
        "DeepseekV2ForCausalLM": DeepseekV2Config(**mla),
        "DeepseekV3ForCausalLM": DeepseekV3Config(**mla),
        "DeepseekV32ForCausalLM": DeepseekV32Config(**mla, index_topk=8, index_head_dim=16, index_n_heads=2),
    }
    for arch, c in cfgs.items():
        c.architectures = [arch]
    return cfgs
