"""Piecewise CUDA graphs (attnzoo.engine.piecewise): steps padded to a token bucket, every piece between two
attention calls replayed (on a CPU: run, ``emulate``), attention eager on the step's real rows in the gaps.
The same tokens and logits as eager steps, on dense, MLA, sliding-window and shared-KV models."""
import pytest
import torch

import attnzoo
from attnzoo.errors import BackendError, ModelLoadError
from helpers import random_prompts, save_checkpoint
from test_llama import tiny_llama
from test_token_rows import _family

GPU = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(tiny_llama(heads=4, kv_heads=2, head_dim=32), tmp_path_factory.mktemp("piecewise"))


def _prompts(vocab):
    prefix = random_prompts(vocab, [21], seed=1)[0]  # a prefix-cache hit for the later prompts: cached prefixes
    return [prefix + tail for tail in random_prompts(vocab, [9, 30, 4], seed=2)]


def _run(path, backend, pieces, device="cpu", buckets=(4, 8, 16), whole=False, **kw):
    """Greedy outputs of the prompts at once (mixed prompt and decode steps in a 16-token budget), and the stats;
    ``whole``: mixed steps captured whole where the backends can (engine.mixed_graphs), else pieces only."""
    llm = attnzoo.load_model(path, backend=backend, dtype="float32", page_size=4, device=device, max_batch_tokens=16,
                             **kw)
    llm.engine.graph_extend_tokens = 0  # the chunks that token rows would take stay steps of their own here
    if pieces and device == "cpu":
        llm.engine.runner.enable_piecewise_graphs(16, buckets=buckets, emulate=True, whole=whole)
    elif kw.get("piecewise_graph_tokens") and not whole:  # captured at load with the mixed-step graphs: pieces alone
        llm.engine.runner.enable_piecewise_graphs(kw["piecewise_graph_tokens"], whole=False)
    vocab = getattr(llm.config, "text_config", llm.config).vocab_size
    outs = llm.generate(_prompts(vocab), max_new_tokens=6, ignore_eos=True, return_logits=True)
    return outs, dict(llm.engine.graph_stats), llm


def _same(got, ref, tol=1e-4):
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for a, b in zip(got, ref):
        assert (a.logits - b.logits).abs().max().item() < tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pieces_give_the_eager_steps_tokens(tiny_dir, backend):
    (ref, off, _), (got, on, llm) = (_run(tiny_dir, backend, p) for p in (False, True))
    # every step fits 16 tokens and there are no decode graphs on a CPU: all of them ran as pieces
    assert off["piecewise"] == 0 and on["eager"] == 0 and on["piecewise"] == off["eager"] > 0
    assert llm.info()["piecewise_graphs"]["buckets"] == [4, 8, 16]
    _same(got, ref)


def test_a_step_pads_to_its_bucket_and_each_attention_call_is_a_gap(tiny_dir):
    from attnzoo.engine import piecewise

    sizes, calls = [], []
    forward, attend = piecewise.PiecewiseGraphs._forward, piecewise.PiecewiseGraphs._attend

    def spy_forward(self, bs, ctx):
        sizes.append(bs)
        return forward(self, bs, ctx)

    def spy_attend(cut, n, ctx):
        calls.append((cut.layer.layer_id, cut.q.shape[0], n))
        return attend(cut, n, ctx)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(piecewise.PiecewiseGraphs, "_forward", spy_forward)
        mp.setattr(piecewise.PiecewiseGraphs, "_attend", staticmethod(spy_attend))
        _, _, llm = _run(tiny_dir, "torch", True, buckets=(4, 8, 16))
    layers = llm.config.num_hidden_layers
    assert sizes[0] == 1  # the probe that sizes the slots
    assert set(sizes[1:]) <= {4, 8, 16} and len(calls) == layers * (len(sizes) - 1)
    assert all(bs >= n for _, bs, n in calls) and any(bs > n for _, bs, n in calls)  # padded rows were there
    assert [i for i, _, _ in calls[:layers]] == list(range(layers))


@pytest.mark.parametrize("family,window_kv_fraction", [("mla", None), ("sliding", 0.5), ("shared_kv", 0.5)])
def test_pieces_in_mla_sliding_and_shared_kv_models(tmp_path, family, window_kv_fraction):
    save_checkpoint(_family(family), tmp_path)
    kw = {} if window_kv_fraction is None else {"window_kv_fraction": window_kv_fraction}  # 0.5: a window page group
    (ref, _, _), (got, on, _) = (_run(tmp_path, "torch", p, **kw) for p in (False, True))
    assert on["piecewise"] > 0
    _same(got, ref)


def load_beyond_the_layer(family, path):
    """A tiny model whose attention is more than the shared layer's call (``layer.beyond_the_layer``): NSA
    (DeepSeek-V3.2: its indexer), or DeepSeek-V4 on sliding-only layers (its attention's own forward)."""
    if family == "nsa":
        from test_nsa import tiny_v32
        hf = tiny_v32()
    else:
        from test_deepseek_v4 import tiny_v4
        hf = tiny_v4(["sliding_attention"] * 2, ["moe"] * 2)
    save_checkpoint(hf, path)
    return attnzoo.load_model(path, backend="torch", device="cpu", page_size=4)


@pytest.mark.parametrize("family", ["nsa", "v4_sliding"])
def test_refused_where_attention_is_not_the_one_layers_call(tmp_path, family, monkeypatch):
    """NSA's indexer and DeepSeek-V4's attention (its own forward, even on sliding-only layers) run outside the
    split: captured into a piece, they would read the dummy step's metadata."""
    from attnzoo.attention import layer

    llm = load_beyond_the_layer(family, tmp_path)
    with pytest.raises(BackendError, match="its nsa layers' attention" if family == "nsa" else "runs its own forward"):
        llm.engine.runner.enable_piecewise_graphs(16, emulate=True)
    if family == "nsa":  # past the kinds' gate, the probe sees the indexer's layers never reach the split
        monkeypatch.setattr(layer, "PLAIN_KINDS", layer.PLAIN_KINDS | {"nsa"})
        with pytest.raises(BackendError, match="attention layers reached the split"):
            llm.engine.runner.enable_piecewise_graphs(16, emulate=True)


def test_default_buckets_pad_by_a_quarter_at_most_from_32_tokens():
    from attnzoo.engine.piecewise import default_buckets

    b = default_buckets(2048)
    assert b[:4] == [16, 24, 32, 40] and 512 in b and b[-1] == 2048 and default_buckets(100)[-1] == 100
    assert all(hi <= lo * 1.25 for lo, hi in zip(b[2:], b[3:]))
    assert all(hi <= lo * 1.125 for lo, hi in zip(b, b[1:]) if lo >= 512)


def test_load_keyword_checks(tiny_dir):
    with pytest.raises(ModelLoadError, match="piecewise_graph_tokens must be an integer >= 0"):
        attnzoo.load_model(tiny_dir, backend="torch", device="cpu", piecewise_graph_tokens=-1)
    with pytest.raises(ModelLoadError, match="not supported under tensor parallelism"):
        attnzoo.load_model(tiny_dir, backend="torch", device="cpu", piecewise_graph_tokens=16, tensor_parallel_size=2)
    with pytest.raises(BackendError, match="need a CUDA device"):
        attnzoo.load_model(tiny_dir, backend="torch", device="cpu", piecewise_graph_tokens=16)
    llm = attnzoo.load_model(tiny_dir, backend="torch", device="cpu")
    assert llm.info()["piecewise_graphs"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family,window_kv_fraction", [("dense", None), ("mla", None), ("sliding", 0.5),
                                                       ("shared_kv", 0.5)])
def test_gpu_pieces_replay_with_the_eager_steps_tokens(tiny_dir, tmp_path, family, window_kv_fraction):
    path = tiny_dir if family == "dense" else save_checkpoint(_family(family), tmp_path)
    kw = {} if window_kv_fraction is None else {"window_kv_fraction": window_kv_fraction}
    ref, off, _ = _run(path, "triton", False, device="cuda", **kw)
    got, on, llm = _run(path, "triton", False, device="cuda", piecewise_graph_tokens=16, **kw)
    assert llm.info()["piecewise_graphs"]["buckets"] == [16] and llm.engine.runner.pieces.num_graphs > 1
    # the prompts' chunks (the decode steps replay the decode graphs), as many as ran eagerly without (whole mixed
    # steps set aside: tests/test_mixed_graphs.py)
    assert on["piecewise"] == off["eager"] > 0 and on["eager"] == 0 and on["replayed"] == off["replayed"]
    _same(got, ref, tol=1e-3)
    # three buckets share one pool: capture them in place of the one, then the same tokens again
    llm.engine.runner.enable_piecewise_graphs(16, buckets=(4, 8, 16), whole=False)
    vocab = getattr(llm.config, "text_config", llm.config).vocab_size
    again = llm.generate(_prompts(vocab), max_new_tokens=6, ignore_eos=True, return_logits=True)
    assert [c.token_ids for c in again] == [c.token_ids for c in ref]
