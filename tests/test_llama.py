"""Llama end to end on CPU against transformers: logits, greedy decode, page sizes, batching."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnzoo
from helpers import assert_matches_hf, random_prompts, save_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def tiny_llama(*, heads=4, kv_heads=1, head_dim=32, tied=False, rope=None, vocab=160, layers=2):
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=512, tie_word_embeddings=tied,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


SHAPES = {
    "mha-d32-untied": dict(heads=4, kv_heads=4, head_dim=32),
    "gqa4-d64-tied": dict(heads=4, kv_heads=1, head_dim=64, tied=True),
    "gqa4-d32-llama3": dict(heads=8, kv_heads=2, head_dim=32, rope=LLAMA3_ROPE),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_transformers(tmp_path, shape):
    hf = tiny_llama(**SHAPES[shape])
    save_checkpoint(hf, tmp_path)
    llm = attnzoo.load_model(tmp_path, page_size=16)
    assert_matches_hf(llm, hf, random_prompts(160, [7, 21]), steps=32)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    save_checkpoint(tiny_llama(kv_heads=1, rope=LLAMA3_ROPE), d)
    return d


def test_page_sizes_agree(tiny_dir):
    prompts = random_prompts(160, [1, 5, 17, 40])
    results = {}
    for ps in (1, 16, 64):
        llm = attnzoo.load_model(tiny_dir, page_size=ps)
        results[ps] = [c.token_ids for c in llm.generate(prompts, max_new_tokens=12, ignore_eos=True)]
    assert results[1] == results[16] == results[64]


def test_batch_equals_one_at_a_time(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, page_size=4)
    prompts = random_prompts(160, [3, 30, 9, 1, 14])
    batched = llm.generate(prompts, max_new_tokens=10, ignore_eos=True)
    single = [llm.generate([p], max_new_tokens=10, ignore_eos=True)[0] for p in prompts]
    assert [c.token_ids for c in batched] == [c.token_ids for c in single]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 10 for c in batched)


def test_more_requests_than_cache_holds_run_in_waves(tiny_dir):
    # 4 pages of 8 tokens: each request (10 prompt + 6 new) needs 2 pages, so at most 2 run at once.
    llm = attnzoo.load_model(tiny_dir, page_size=8, kv_cache_tokens=32)
    prompts = random_prompts(160, [10] * 7, seed=3)
    waves = llm.generate(prompts, max_new_tokens=6, ignore_eos=True)
    ref = attnzoo.load_model(tiny_dir, page_size=8).generate(prompts, max_new_tokens=6, ignore_eos=True)
    assert [c.token_ids for c in waves] == [c.token_ids for c in ref]
    # every page is free again except those the prefix cache keeps (and could evict)
    assert llm.engine.allocator.num_free + llm.engine.prefix_cache.evictable() == llm.engine.allocator.capacity


def test_string_prompts_stop_strings_and_sampling(tiny_dir):
    llm = attnzoo.load_model(tiny_dir)
    text = "w5 w9 w11 w40"
    greedy = llm.generate(text, max_new_tokens=8, ignore_eos=True)[0]
    assert greedy.token_ids[:1] and greedy.text.split()[0].startswith("w")
    stop_word = greedy.text.split()[2]
    cut = llm.generate(text, max_new_tokens=8, ignore_eos=True, stop=[stop_word])[0]
    assert cut.finish_reason == "stop" and stop_word not in cut.text
    assert greedy.text.startswith(cut.text.rstrip())
    a = llm.generate([text] * 2, max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    b = llm.generate([text] * 2, max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_info_reports_kv_and_decision(tiny_dir):
    info = attnzoo.load_model(tiny_dir, page_size=16).info()
    # 2 layers x (k + v) x 1 kv head x 32 dims x 4 bytes
    assert info["kv_bytes_per_token"] == 2 * 2 * 1 * 32 * 4
    assert info["page_size"] == 16 and info["prefill_backend"] == "torch"
    assert info["decision"]["page_size"] == 16
