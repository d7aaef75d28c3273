"""vLLM's and transformers' spellings of the API give the tokens of today's keywords and of transformers itself
(tiny random Llama, torch backend, CPU)."""
import json
import shutil

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import attnzoo
from attnzoo import LLM, SamplingParams, load_model
from attnzoo.errors import ModelLoadError, RequestError
from tests.helpers import tiny_tokenizer

VOCAB = 96
CHAT = "{% for m in messages %}<s> w3 {{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}w4 {% endif %}"
PROMPT = "w5 w9 w17 w33 w60"
LOAD = dict(device="cpu", dtype="float32", backend="torch", progress=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, initializer_range=0.2)
    hf = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(path)
    tok = tiny_tokenizer(VOCAB)
    tok.chat_template = CHAT
    tok.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=str(ckpt[0]), **LOAD)


def test_vllm_constructor_takes_engine_args(ckpt):
    got = LLM(str(ckpt[0]), max_model_len=64, gpu_memory_utilization=0.5, enforce_eager=True, max_num_seqs=3,
              block_size=8, dtype="auto", device="cpu", backend="torch", progress=False)
    info = got.info()
    assert isinstance(got, LLM) and info["context_len"] == 64 and info["max_running"] == 3 and info["page_size"] == 8
    out = got.generate([list(range(3, 63))], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"  # 60 + 4 = max_model_len
    with pytest.raises(ModelLoadError, match="max_model_len=512 exceeds"):
        LLM(str(ckpt[0]), max_model_len=512, **LOAD)
    with pytest.raises(ModelLoadError, match="does not know swap_space"):
        LLM(str(ckpt[0]), swap_space=4, **LOAD)
    with pytest.raises(ModelLoadError, match="gpu_memory_utilization"):
        LLM(str(ckpt[0]), gpu_memory_utilization=1.5, **LOAD)


def test_greedy_in_every_spelling_is_transformers_greedy(ckpt, llm):
    _, hf = ckpt
    ids = llm.tokenizer.encode(PROMPT)
    hf_tokens = hf.generate(torch.tensor([ids]), generation_config=GenerationConfig(
        max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0))[0, len(ids):].tolist()
    keywords = llm.generate(PROMPT, max_new_tokens=10, ignore_eos=True)[0].token_ids
    vllm = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    transformers = llm.generate(PROMPT, generation_config=GenerationConfig(max_new_tokens=10, do_sample=False), ignore_eos=True)
    assert keywords == hf_tokens
    assert isinstance(vllm[0], attnzoo.RequestOutput) and vllm[0].outputs[0].token_ids == hf_tokens
    assert vllm[0].prompt == PROMPT and vllm[0].prompt_token_ids == ids
    assert transformers[0].token_ids == hf_tokens
    # vLLM's token-id prompt form, and a keyword overriding the GenerationConfig as in transformers
    assert llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0] \
        .outputs[0].token_ids == hf_tokens
    shorter = llm.generate(PROMPT, generation_config=GenerationConfig(max_new_tokens=10), max_new_tokens=4, ignore_eos=True)
    assert shorter[0].token_ids == hf_tokens[:4]


def test_sampling_in_every_spelling_gives_the_same_tokens(llm):
    prompts = [PROMPT, "w7 w8 w9"]
    sp = SamplingParams(n=3, max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=5, repetition_penalty=1.3,
                        ignore_eos=True)
    vllm = llm.generate(prompts, sp)
    keywords = llm.generate(prompts, max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=[5, 6, 7, 5, 6, 7],
                            repetition_penalty=1.3, num_return_sequences=3, ignore_eos=True)
    gc = GenerationConfig(do_sample=True, max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.3,
                          num_return_sequences=3)
    transformers = llm.generate(prompts, generation_config=gc, seed=[5, 6, 7, 5, 6, 7], ignore_eos=True)
    assert [len(r.outputs) for r in vllm] == [3, 3] and [o.index for o in vllm[1].outputs] == [0, 1, 2]
    flat = [o.token_ids for r in vllm for o in r.outputs]
    assert flat == [c.token_ids for c in keywords] == [c.token_ids for c in transformers]
    assert len({tuple(t) for t in flat[:3]}) > 1  # the n samples of one prompt differ


def test_logprobs_are_the_log_softmax_of_the_logits(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0].outputs[0]
    ids = llm.tokenizer.encode(PROMPT)
    ref = torch.log_softmax(llm.logits(ids + out.token_ids[:-1])[len(ids) - 1:], dim=-1)
    assert len(out.logprobs) == 5
    for step, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        best = torch.topk(ref[step], 3)
        assert list(position)[:3] == best.indices.tolist() and position[token].rank == 1  # greedy: the best token
        for tok, lp in position.items():
            assert abs(lp.logprob - ref[step, tok].item()) < 1e-4
    assert abs(out.cumulative_logprob - sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs))) < 1e-6


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "w11 w12"}]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.chat(messages, sp)
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert got[0].prompt_token_ids == ids
    assert got[0].outputs[0].token_ids == llm.generate([ids], max_new_tokens=6, ignore_eos=True)[0].token_ids
    assert len(llm.chat([messages, messages], sp)) == 2
    with pytest.raises(RequestError, match="conversation"):
        llm.chat("w3 w4", sp)


def test_generation_config_json_gives_eos_and_defaults(ckpt, llm, tmp_path):
    plain = llm.generate(PROMPT, max_new_tokens=12, ignore_eos=True)[0].token_ids
    # the first token not seen before it and not already an EOS id: generation must stop on it
    k = next(i for i, t in enumerate(plain) if i >= 2 and t not in plain[:i] and t not in llm.engine.eos)
    path = tmp_path / "with_gc"
    shutil.copytree(ckpt[0], path)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, plain[k]], "do_sample": True, "temperature": 0.6, "top_k": 7, "top_p": 0.95,
         "max_new_tokens": 11}))
    other = load_model(str(path), **LOAD)
    stopped = other.generate(PROMPT, max_new_tokens=12)[0]
    assert stopped.token_ids == plain[: k + 1] and stopped.finish_reason == "stop"
    d = other.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens) == (0.6, 7, 0.95, 11)
    # transformers' order: an explicit GenerationConfig over the checkpoint's; the checkpoint's over the defaults
    gc = GenerationConfig(do_sample=True, top_k=5)
    merged = other.generate(PROMPT, generation_config=gc, seed=3, ignore_eos=True)[0]
    same = other.generate(PROMPT, max_new_tokens=11, temperature=0.6, top_k=5, top_p=0.95, seed=3, ignore_eos=True)[0]
    assert merged.token_ids == same.token_ids and len(merged.token_ids) == 11


def test_wrong_mixes_are_refused(llm):
    with pytest.raises(RequestError, match="sampling_params and also temperature"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2), temperature=0.5)
    with pytest.raises(RequestError, match="num_beams"):
        llm.generate(PROMPT, generation_config=GenerationConfig(num_beams=2, max_new_tokens=2))
    with pytest.raises(RequestError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(RequestError, match="EOS ids"):
        llm.generate(PROMPT, generation_config=GenerationConfig(max_new_tokens=2, eos_token_id=50))
