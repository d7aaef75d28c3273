"""Gemma 3 end to end on CPU against transformers: tiny text models (local/global RoPE bases, linear RoPE
scaling on full layers, query_pre_attn_scalar, sandwich (1 + w) norms, sliding windows the prompts cross),
the text part of Gemma3ForConditionalGeneration, and the sliding windows through the Triton kernels
(under the interpreter on CPU)."""
import logging

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

import attnzoo
from attnzoo.errors import RequestError
from helpers import assert_matches_hf, random_prompts, save_checkpoint

VOCAB = 160
WINDOW = 8  # prompts of 7 and 21 tokens plus 32 decode steps cross it many times
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}


def text_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                sliding_window_pattern=2, max_position_embeddings=512, rope_parameters=ROPE,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return Gemma3TextConfig(**base)


def randomize_norms_(model, seed):
    """Norm weights are stored minus one and initialised to 0; random values make the test see them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=g))
    return model.eval()


def tiny_text(**kw):
    torch.manual_seed(0)
    return randomize_norms_(Gemma3ForCausalLM(text_config(**kw)), 0)


def tiny_multimodal():
    cfg = Gemma3Config(text_config=text_config().to_dict(), image_token_id=VOCAB - 1,
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=28, patch_size=14),
                       mm_tokens_per_image=4)
    torch.manual_seed(1)
    return randomize_norms_(Gemma3ForConditionalGeneration(cfg), 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, make in (("text", tiny_text), ("multimodal", tiny_multimodal)):
        hf = make()
        out[name] = (hf, save_checkpoint(hf, tmp_path_factory.mktemp(name)))
    return out


@pytest.mark.parametrize("name", ["text", "multimodal"])
def test_matches_transformers(checkpoints, name):
    hf, path = checkpoints[name]
    llm = attnzoo.load_model(path, backend="torch", page_size=4)
    layers = llm.model.attention_layers()
    assert [a.sliding_window for a in layers] == [WINDOW, None, WINDOW, None]
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [7, 21], seed=5), steps=32)


def test_untied_head_and_odd_pattern(tmp_path):
    hf = tiny_text(tie_word_embeddings=False, num_hidden_layers=3, sliding_window_pattern=3)
    llm = attnzoo.load_model(save_checkpoint(hf, tmp_path), backend="torch", page_size=16)
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [13], seed=6), steps=16)


def test_tower_skipped_and_image_tokens_rejected(checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="attnzoo"):
        llm = attnzoo.load_model(checkpoints["multimodal"][1], backend="torch")
    assert any("vision tower" in r.getMessage() for r in caplog.records)
    assert all("vision" not in n for n, _ in llm.model.named_parameters())
    with pytest.raises(RequestError, match="image placeholder"):
        llm.generate([[5, 6, VOCAB - 1, 7]], max_new_tokens=2)


def test_triton_backend_matches_transformers(checkpoints):
    """The sliding windows through attnzoo's Triton kernels (the interpreter on CPU)."""
    from attnzoo.attention.backends import backend_names

    if "triton" not in backend_names():
        pytest.skip("the triton attention backend is not registered in attnzoo.attention.backends")
    hf, path = checkpoints["text"]
    llm = attnzoo.load_model(path, backend="triton", page_size=4)
    assert llm.info()["decode_backend"] == "triton"
    assert_matches_hf(llm, hf, random_prompts(VOCAB, [13], seed=9), steps=12)
