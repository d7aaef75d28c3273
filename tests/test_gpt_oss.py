"""gpt-oss on CPU against transformers: attention sinks, alternating sliding/full layers, YaRN, biases and
the clamped-SwiGLU MoE; the MXFP4 dequantizer; sinks through the Triton kernels; tensor parallel."""
import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

import attnzoo
from helpers import assert_matches_hf, random_prompts, save_checkpoint

VOCAB = 160
WINDOW = 8  # smaller than the prompts: the sliding layers' windows matter


def tiny_gpt_oss(*, layers=2, heads=4, kv_heads=2, experts=4, top_k=2):
    cfg = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=layers, head_dim=16,
        num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=experts,
        num_experts_per_tok=top_k, sliding_window=WINDOW, max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises biases and sinks to zero or near it: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 2.0)
            elif "bias" in name:
                p.copy_(torch.randn_like(p) * 0.1)
            elif "experts" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    return hf


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss")
    hf = tiny_gpt_oss()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    save_checkpoint(hf, d)
    return d, hf


def test_matches_transformers(tiny_dir):
    d, hf = tiny_dir
    llm = attnzoo.load_model(d, page_size=4)
    assert llm.decision.prefill_backend == "torch"
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [5, 21]), steps=16)
