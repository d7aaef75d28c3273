"""Shared test helpers: tiny tokenizers and checkpoints written with transformers, and the parity check
of our model against the transformers reference (float32 logits, greedy tokens)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer over words w0..w{n-1}; ids 0/1/2 are <unk>/<s>/</s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_checkpoint(hf_model, path: Path, *, with_tokenizer: bool = True) -> Path:
    hf_model.save_pretrained(path)
    if with_tokenizer:
        vocab = getattr(hf_model.config, "text_config", hf_model.config).vocab_size
        tiny_tokenizer(vocab).save_pretrained(path)
    return path


def random_prompts(vocab_size: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], steps: int):
    """transformers' greedy continuation and its raw per-step logits [steps, vocab]."""
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    out = hf_model.generate(
        torch.tensor([prompt], device=hf_model.device), max_new_tokens=steps, min_new_tokens=0, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0].float().cpu()


@torch.no_grad()
def assert_matches_hf(llm, hf_model, prompts: list[list[int]], *, steps: int = 32, atol: float = 1e-4) -> None:
    """Prefill logits and every step of a greedy decode equal transformers' within ``atol`` (transformers run
    where ``hf_model`` is: compare on the same device, where top-k ties break the same way)."""
    hf_model.eval()
    ours = llm.generate(prompts, max_new_tokens=steps, ignore_eos=True, return_logits=True)
    for prompt, got in zip(prompts, ours):
        ref_prefill = hf_model(torch.tensor([prompt], device=hf_model.device)).logits[0].float().cpu()
        diff = (llm.logits(prompt).cpu() - ref_prefill).abs().max().item()
        assert diff <= atol, f"prefill logits differ by {diff}"
        ref_tokens, ref_logits = hf_greedy(hf_model, prompt, steps)
        assert got.token_ids == ref_tokens, "greedy tokens differ from transformers"
        diff = (got.logits.cpu() - ref_logits).abs().max().item()
        assert diff <= atol, f"decode logits differ by {diff}"


def assert_greedy_close(outs, ref_outs, tol: float, label="") -> None:
    """Two bf16 runs of the same requests agree up to a near tie: logits within ``tol`` at every step up to
    and including each request's first differing token (after it the continuations differ). Different
    kernel partitions round differently, so a late near tie may flip; a wrong page or length read moves the
    logits by whole units long before that."""
    assert len(outs) == len(ref_outs), label
    for i, (x, y) in enumerate(zip(outs, ref_outs)):
        first = next((j for j, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), len(x.token_ids) - 1)
        diff = (x.logits[: first + 1] - y.logits[: first + 1]).abs().max().item()
        assert diff < tol, f"{label}: request {i}, logits differ by {diff:.3g} before its first differing token {first}"


def greedy_logit_gap(outs, ref_outs) -> float:
    """The largest logit difference of two runs at the steps ``assert_greedy_close`` compares."""
    gap = 0.0
    for x, y in zip(outs, ref_outs):
        first = next((j for j, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), len(x.token_ids) - 1)
        gap = max(gap, (x.logits[: first + 1].float() - y.logits[: first + 1].float()).abs().max().item())
    return gap


def fresh_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter that imports this checkout's attnzoo (stdout, stderr captured)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


def tiny_gemma4(path, window=16):
    """31B-like in miniature: sliding d256 layers (window 16) and global d512 layers with k == v.

    Gemma 4 attends with scale 1.0 after q/k RMSNorm; with the norms' initial weight 1 the scores of a
    random model have a standard deviation of sqrt(head_dim) (16 to 23), a near one-hot softmax that
    turns bf16 rounding in one layer into whole units of logit difference a few layers on (measured:
    0.7 between two correct backends). Trained models learn small q_norm weights; here they are set to
    head_dim ** -0.5, which keeps the scores at unit scale and the test sensitive to real errors."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    s, f = "sliding_attention", "full_attention"
    cfg = Gemma4TextConfig(
        vocab_size=256, vocab_size_per_layer_input=256, hidden_size=128, intermediate_size=256,
        num_hidden_layers=4, layer_types=[s, f, s, f], num_attention_heads=4, num_key_value_heads=2,
        head_dim=256, global_head_dim=512, attention_k_eq_v=True, num_global_key_value_heads=1,
        sliding_window=window, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
        max_position_embeddings=1024, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            q_norm = layer.self_attn.q_norm.weight
            q_norm.fill_(q_norm.shape[0] ** -0.5)
    return save_checkpoint(model, path)
