"""A step of short prompt chunks run as decode rows, one per token (``Runner.graph_extend_tokens``): the same
tokens and logits as the extend step it replaces, on the torch reference and on the Triton kernels (CPU: the
interpreter), and through the decode CUDA graphs on a GPU."""
import pytest
import torch

import attnzoo
from attnzoo.engine.runner import GRAPH_EXTEND_TOKENS, Step, as_token_rows, row_context_tokens, step_weight_bytes
from helpers import random_prompts, save_checkpoint
from test_llama import tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(tiny_llama(heads=4, kv_heads=2, head_dim=32), tmp_path_factory.mktemp("token_rows"))


def test_each_token_becomes_a_row_of_its_request():
    # page size 4; request 0 holds its whole prompt's pages (3) but this chunk reaches only 2
    step = Step([5, 9], [3, 1], [[7, 8, 6], [4, 2, 1]], ids=None, rows=[2, 3], keys=[0, 1],
                window_block_tables=[[7, 8, 6], [4, 2, 1]])
    rows = as_token_rows(step, 4)
    assert rows.prefix_lens == [5, 6, 7, 9] and rows.q_lens == [1, 1, 1, 1]
    assert rows.block_tables == [[7, 8], [7, 8], [7, 8], [4, 2, 1]] and rows.window_block_tables == rows.block_tables
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
    # the first prompt's chunks after its first (a 16-token budget: 16 + 14 of 46), then the later prompts' tails
    # after the 36 cached tokens (6 and 13): a first chunk has no prefix and stays an extend step
    assert on["token_rows"] == 16 + 14 + 6 + 13
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref):
        assert (a.logits - b.logits).abs().max().item() < 1e-4


def test_the_kv_a_chunk_reads_as_rows():
    # a chunk of 3 after 5 cached tokens reads 6 + 7 + 8; a decode row reads what it reads anyway: not counted
    assert row_context_tokens([5, 9], [3, 1]) == 6 + 7 + 8
    assert row_context_tokens([5, 9], [3, 1], window=6) == 6 + 6 + 6  # a sliding layer sees its window at most


def test_the_weights_a_row_reads_leave_out_an_untied_embedding_table(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, backend="torch", device="cpu")
    total = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    table = llm.model.model.embed_tokens.weight
    tied = any(p is table for n, p in llm.model.named_parameters(remove_duplicate=False) if "embed" not in n)
    assert step_weight_bytes(llm.model) == total - (0 if tied else table.numel() * table.element_size())


def test_default_is_off_without_graphs_and_info_says_why(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, backend="torch", device="cpu", page_size=4)
    assert llm.engine.graph_extend_tokens is None
    n, why = llm.info()["token_rows"]
    assert n == 0 and "no decode CUDA graphs" in why
    llm.engine.graph_extend_tokens = 16
    assert llm.info()["token_rows"][0] == 16
    llm.engine.graph_extend_tokens = 0
    assert llm.info()["token_rows"] == [0, "off (graph_extend_tokens=0)"]


def test_chunks_whose_rows_would_read_too_much_kv_stay_extend_steps(tiny_dir):
    """Each row reads its whole context: past the cap on those reads (a multiple of the weights' bytes) the
    chunk runs as the extend step, which reads the context once."""
    prompts = _shared_prefix_prompts()
    llm = attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", page_size=4, device="cpu", max_batch_tokens=16)
    runner = llm.engine.runner
    llm.engine.graph_extend_tokens = 16
    # just under what the first prompt's third chunk (14 new after 32) reads as rows
    runner._row_reads_cap = row_context_tokens([32], [14]) * runner._row_read_bytes[None] - 1
    for p in prompts:
        llm.generate([p], max_new_tokens=2, ignore_eos=True)
    # in: its second chunk (16 after 16, 392 KV tokens) and the 6-token tail (237); out: that chunk (553) and
    # the 13-token tail after 36 (559)
    assert llm.engine.graph_stats["token_rows"] == 16 + 6


def test_prompt_logprobs_of_chunks_run_as_rows(tiny_dir):
    """A request asking for its prompt's log-probabilities (the server's echo, lm-eval's loglikelihood) gets a
    logit for every prompt token: its later chunks as token rows give the extend steps' values."""
    prompts = _shared_prefix_prompts()
    sp = attnzoo.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    runs = []
    for rows_max in (0, 16):
        llm = attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", page_size=4, device="cpu",
                                 max_batch_tokens=16)
        llm.engine.graph_extend_tokens = rows_max
        runs.append(([c for p in prompts for c in llm.generate([p], sampling_params=sp)], llm.engine.graph_stats))
    (ref, off), (got, on) = runs
    assert off["token_rows"] == 0 and on["token_rows"] > 0
    for a, b in zip(got, ref):  # vLLM's shapes: per prompt token {token id: Logprob}, None for the first
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_longer_chunks_stay_extend_steps(tiny_dir):
    _, stats = _run(tiny_dir, "torch", 4, _shared_prefix_prompts())
    assert stats["token_rows"] == 0  # every chunk here is over 4 tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_token_rows_replay_the_decode_graphs(tiny_dir):
    prompts = _shared_prefix_prompts()
    ref, off = _run(tiny_dir, "triton", 0, prompts, device="cuda", dtype="float32")
    got, on = _run(tiny_dir, "triton", 16, prompts, device="cuda", dtype="float32")
    assert on["token_rows"] == 16 + 14 + 6 + 13 and on["replayed"] > off["replayed"]  # the rows ran in the graphs
    _, default = _run(tiny_dir, "triton", None, prompts, device="cuda", dtype="float32")
    assert GRAPH_EXTEND_TOKENS >= 16 and default["token_rows"] == on["token_rows"]  # on by default with graphs
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref):
        assert (a.logits - b.logits).abs().max().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_token_rows_of_a_prompt_longer_than_the_graphs_context(tiny_dir):
    """A request holds its whole prompt's pages, wider than the graphs' tables: chunks within their context
    replay the graphs, the rest stay extend steps, with the tokens of extend steps throughout."""
    prompts = [random_prompts(160, [100], seed=7)[0]]
    kw = dict(device="cuda", dtype="float32", cuda_graph_max_context=64)
    (ref, _), (got, on) = (_run(tiny_dir, "triton", n, prompts, **kw) for n in (0, 16))
    assert on["token_rows"] == 16 * 3  # chunks 2-4 end within 64 tokens; chunks 5-7 run as extend steps
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]


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
    n, why = llm.info()["token_rows"]
    assert n == 0 and "NSA or compressed" in why


def _family(name):
    if name == "mla":
        from test_deepseek import tiny_v2
        return tiny_v2()
    if name == "sliding":
        from test_gemma3 import tiny_text
        return tiny_text()
    from test_gemma4 import e2b_like  # sliding layers and layers reading another layer's KV
    return e2b_like()


@pytest.mark.parametrize("family,backend,window_kv_fraction", [
    ("mla", "torch", None), ("sliding", "torch", None), ("sliding", "triton", 0.5), ("shared_kv", "torch", 0.5)])
def test_token_rows_in_mla_sliding_and_shared_kv_models(tmp_path, family, backend, window_kv_fraction):
    hf = _family(family)
    save_checkpoint(hf, tmp_path)
    vocab = getattr(hf.config, "text_config", hf.config).vocab_size
    prefix = random_prompts(vocab, [37], seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts(vocab, [9, 12], seed=6)]
    kw = {} if window_kv_fraction is None else {"window_kv_fraction": window_kv_fraction}  # 0.5: a window page group
    (ref, off), (got, on) = (_run(tmp_path, backend, n, prompts, **kw) for n in (0, 16))
    assert off["token_rows"] == 0 and on["token_rows"] >= 9 + 12
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref):
        assert (a.logits - b.logits).abs().max().item() < 1e-4, family


def test_the_limit_is_cut_to_the_largest_graph_bucket_a_step_may_use(tiny_dir):
    """With decode graphs of at most 8 rows (max_running 8), the default 64 would build rows no graph takes."""
    from types import SimpleNamespace

    llm = attnzoo.load_model(tiny_dir, backend="torch", device="cpu", page_size=4)
    runner = llm.engine.runner
    runner.graphs = SimpleNamespace(exact_from=256, max_batch=8, max_context=64)
    n, why = runner.token_rows_limit()
    assert n == 8 and "graph_extend_tokens=64" in why
    runner.graph_extend_tokens = 4
    assert runner.token_rows_limit()[0] == 4
    runner.graph_extend_tokens = 0
    assert runner.token_rows_limit()[0] == 0
