"""A step of short prompt chunks run as decode rows, one per token (``Runner.graph_extend_tokens``): the same
tokens and logits as the extend step it replaces, on the torch reference and on the Triton kernels (CPU: the
interpreter), and through the decode CUDA graphs on a GPU."""
import pytest
import torch

import attnzoo
from attnzoo.engine.runner import Step, as_token_rows
from helpers import random_prompts, save_checkpoint
from test_llama import tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(tiny_llama(heads=4, kv_heads=2, head_dim=32), tmp_path_factory.mktemp("token_rows"))


def test_each_token_becomes_a_row_of_its_request():
    step = Step([5, 9], [3, 1], [[7, 8], [4]], ids=None, rows=[2, 3], keys=[0, 1], window_block_tables=[[7], [4]])
    rows = as_token_rows(step)
    assert rows.prefix_lens == [5, 6, 7, 9] and rows.q_lens == [1, 1, 1, 1]
    assert rows.block_tables == [[7, 8], [7, 8], [7, 8], [4]] and rows.window_block_tables == [[7], [7], [7], [4]]
    assert rows.rows == [2, 3] and rows.keys is None  # the flat token order (sampled rows, ids) is the step's own


def _shared_prefix_prompts():
    prefix = random_prompts(160, [37], seed=1)[0]  # not a whole number of pages: the rows start mid-page
    return [prefix + tail for tail in random_prompts(160, [9, 5, 12], seed=2)]


def _run(path, backend, rows_max, prompts, device="cpu", dtype="float32", **kw):
    llm = attnzoo.load_model(path, backend=backend, dtype=dtype, page_size=4, device=device, max_batch_tokens=16, **kw)
    llm.engine.graph_extend_tokens = rows_max
    outs = []
    for p in prompts:  # one at a time: each later prompt's 37-token prefix is a prefix-cache hit
        outs += llm.generate([p], max_new_tokens=5, ignore_eos=True, return_logits=True)
    return outs, dict(llm.engine.graph_stats)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_short_chunks_as_decode_rows_give_the_extend_steps_tokens(tiny_dir, backend):
    prompts = _shared_prefix_prompts()
    ref, off = _run(tiny_dir, backend, 0, prompts)
    got, on = _run(tiny_dir, backend, 16, prompts)
    assert off["token_rows"] == 0
    # the later prompts' tails (9, 5, 12 tokens after the cached prefix) and the first prompt's chunks after its
    # first 16 tokens (a 16-token budget: chunks of 16, 16 and 14)
    assert on["token_rows"] >= 5 + 12 + 9
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref):
        assert (a.logits - b.logits).abs().max().item() < 1e-4


def test_longer_chunks_and_first_chunks_stay_extend_steps(tiny_dir):
    prompts = _shared_prefix_prompts()
    _, stats = _run(tiny_dir, "torch", 4, prompts)
    assert stats["token_rows"] == 0  # every chunk here is over 4 tokens, and a first chunk has no prefix to sit on


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_token_rows_replay_the_decode_graphs(tiny_dir):
    prompts = _shared_prefix_prompts()
    ref, off = _run(tiny_dir, "triton", 0, prompts, device="cuda", dtype="float32")
    got, on = _run(tiny_dir, "triton", 16, prompts, device="cuda", dtype="float32")
    assert on["token_rows"] >= 5 + 12 + 9 and on["replayed"] > off["replayed"]  # the rows ran in the graphs
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref):
        assert (a.logits - b.logits).abs().max().item() < 1e-3


@pytest.mark.parametrize("family", ["nsa", "compressed"])
def test_nsa_and_compressed_layers_keep_their_extend_steps(tmp_path, family):
    """Their decode store and index take one new token per request: chunks there stay extend steps."""
    if family == "nsa":
        from test_nsa import tiny_v32 as build
        hf = build()
    else:
        from test_deepseek_v4 import MODELS, tiny_v4
        hf = tiny_v4(*MODELS["all-kinds"])
    save_checkpoint(hf, tmp_path)
    vocab = hf.config.vocab_size
    llm = attnzoo.load_model(tmp_path, backend="torch", device="cpu", page_size=4)
    llm.engine.graph_extend_tokens = 64
    prefix = random_prompts(vocab, [21], seed=3)[0]
    for tail in random_prompts(vocab, [6, 4], seed=4):
        llm.generate([prefix + tail], max_new_tokens=2, ignore_eos=True)
    assert llm.engine.scheduler.cached_tokens > 0 and llm.engine.graph_stats["token_rows"] == 0


def _family(name):
    if name == "mla":
        from test_deepseek import tiny_v2
        return tiny_v2()
    if name == "sliding":
        from test_gemma3 import tiny_text
        return tiny_text()
    from test_gemma4 import e2b_like  # sliding layers and layers reading another layer's KV
    return e2b_like()


@pytest.mark.parametrize("family,backend", [("mla", "torch"), ("sliding", "torch"), ("sliding", "triton"),
                                            ("shared_kv", "torch")])
def test_token_rows_in_mla_sliding_and_shared_kv_models(tmp_path, family, backend):
    hf = _family(family)
    save_checkpoint(hf, tmp_path)
    vocab = getattr(hf.config, "text_config", hf.config).vocab_size
    prefix = random_prompts(vocab, [37], seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts(vocab, [9, 12], seed=6)]
    (ref, off), (got, on) = (_run(tmp_path, backend, n, prompts) for n in (0, 16))
    assert off["token_rows"] == 0 and on["token_rows"] >= 9 + 12
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref):
        assert (a.logits - b.logits).abs().max().item() < 1e-4, family
