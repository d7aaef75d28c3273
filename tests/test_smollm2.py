"""The embedded default model (SmolLM2-135M-Instruct, GGUF): greedy chat generations equal transformers'."""
import pytest
import torch

import attnzoo
from attnzoo.errors import ModelLoadError
from attnzoo.models.loader import default_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a GPU is.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def ours():
    try:
        default_model_path()  # installed, cached, or downloaded once
    except ModelLoadError as e:
        pytest.skip(str(e))
    return attnzoo.load_model(page_size=16)  # no name: the embedded default model


def test_default_model_greedy_chat_equals_transformers(ours):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    got = ours.generate(chats, max_new_tokens=48)
    for chat, completion in zip(chats, got):
        ids = ours.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)["input_ids"]
        assert ids[0].tolist() == completion.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
        n = len(completion.token_ids)
        assert completion.token_ids == ref[:n], f"{chat[0]['content']!r}: {completion.text!r}"
        # we stop at EOS like transformers does (it pads after EOS)
        assert n == len(ref) or completion.finish_reason == "stop"


def test_default_model_info(ours):
    info = ours.info()
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["prefill_backend"] == "torch" and info["device"] == "cpu"
    # 30 layers x (k + v) x 3 KV heads x 64 dims x 4 bytes (float32)
    assert info["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
