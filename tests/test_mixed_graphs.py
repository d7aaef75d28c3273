"""Mixed steps captured whole (attnzoo.engine.mixed_graphs): decode rows and prompt chunks padded to a token bucket,
attention inside, over static metadata (on a CPU: run, ``emulate``). The same tokens and logits as eager steps, on
dense, sliding-window and MLA models; steps it does not fit run as pieces."""
import pytest
import torch

import attnzoo
from attnzoo.engine import mixed_graphs
from helpers import random_prompts, save_checkpoint
from test_piecewise import _run, _same
from test_token_rows import _family as family_of

GPU = torch.cuda.is_available()


def _family(name):
    if name == "dense":
        from test_llama import tiny_llama
        return tiny_llama(heads=4, kv_heads=2, head_dim=32)
    return family_of(name)


def _load(path, backend, whole=True):
    """A tiny model with emulated piecewise graphs and, where ``whole`` and the backends allow, mixed-step graphs."""
    llm = attnzoo.load_model(path, backend=backend, dtype="float32", page_size=4, device="cpu", max_batch_tokens=16)
    llm.engine.runner.enable_piecewise_graphs(16, buckets=(4, 8, 16), emulate=True, whole=whole)
    return llm


# MLA runs on the GPU only (its CPU run adds 18 s to CI and no path the others miss)
@pytest.mark.parametrize("family,window_kv_fraction", [("dense", None), ("sliding", 0.5)])
def test_whole_mixed_steps_give_the_eager_steps_tokens(tmp_path, family, window_kv_fraction, monkeypatch):
    save_checkpoint(_family(family), tmp_path)
    kw = {} if window_kv_fraction is None else {"window_kv_fraction": window_kv_fraction}
    ref, off, _ = _run(tmp_path, "torch", False, **kw)  # the reference backend's eager steps
    pieces = spy_pieces(monkeypatch)
    got, on, llm = _run(tmp_path, "triton", True, whole=True, **kw)
    # no decode graphs on a CPU: the decode-only steps run as pieces, every other step whole
    assert all(pieces) and on["mixed"] == off["eager"] - len(pieces) > 0 and on["piecewise"] == len(pieces)
    assert llm.info()["piecewise_graphs"]["whole_steps"][0] == mixed_graphs.MAX_CHUNKS
    _same(got, ref)


def spy_pieces(monkeypatch) -> list[bool]:
    """Whether each step replayed as pieces from here on was a decode-only step."""
    from attnzoo.engine.piecewise import PiecewiseGraphs

    seen, launch = [], PiecewiseGraphs.launch
    monkeypatch.setattr(PiecewiseGraphs, "launch", lambda self, ids, meta, plan: seen.append(meta.is_decode)
                        or launch(self, ids, meta, plan))
    return seen


def test_steps_past_the_chunk_slots_run_as_pieces(tmp_path, monkeypatch):
    """Four prompts at once: their first step holds four chunks, past one slot, and runs as pieces; the longest
    prompt's next chunk beside the decode rows runs whole."""
    save_checkpoint(_family("dense"), tmp_path)
    monkeypatch.setattr(mixed_graphs, "MAX_CHUNKS", 1)  # read when the graphs are made
    outs, pieces = {}, []
    for backend in ("torch", "triton"):
        llm = _load(tmp_path, backend)
        if backend == "triton":
            pieces = spy_pieces(monkeypatch)
        prompts = random_prompts(llm.config.vocab_size, [5, 6, 4, 24], seed=3)
        outs[backend] = llm.generate(prompts, max_new_tokens=4, ignore_eos=True, return_logits=True)
    assert llm.engine.runner.mixed.max_chunks == 1 and llm.engine.graph_stats["mixed"] > 0
    assert not all(pieces)  # a step of chunks ran as pieces
    _same(outs["triton"], outs["torch"])


def test_staging_pads_to_the_bucket(tmp_path):
    """A step of 2 decode rows and a 5-token chunk in the 8-token bucket, staged after a larger step: rows past the
    step store into page 0; every row but the decode rows has length 0 in the decode part; the chunk slots past the
    one are empty at the step's end; a table wider than the graphs' is cut to their columns."""
    from attnzoo.attention.metadata import build_metadata

    save_checkpoint(_family("dense"), tmp_path)
    mixed = _load(tmp_path, "triton").engine.runner.mixed
    big = build_metadata(prefix_lens=[4] * 6 + [2, 2], q_lens=[1] * 6 + [3, 2], block_tables=[[9, 10]] * 8,
                         page_size=4, device="cpu")
    mixed.stage(big)  # fills the buffers the small step must overwrite or clear
    wide = [[6, 7] + [8] * (mixed.max_pages + 3)]
    meta = build_metadata(prefix_lens=[5, 9, 3], q_lens=[1, 1, 5], block_tables=[[1, 2], [3, 4, 5]] + wide,
                          page_size=4, device="cpu")
    assert mixed.fits(meta) and meta.leading_decode_rows() == 2
    staged = mixed.stage(meta)
    assert (staged.num_tokens, staged.bucket) == (7, 8)
    assert mixed.dec_seq_lens[:8].tolist() == [6, 10] + [0] * 6
    assert mixed.dec_tables[:2, :3].tolist() == [[1, 2, 0], [3, 4, 5]]
    assert mixed.slots[7].item() == 0 and mixed.slots[:7].tolist() == meta.slot_mapping.tolist()
    assert mixed.ext_indptr.tolist() == [2, 7] + [7] * (mixed.max_chunks - 1)
    assert mixed.ext_prefix[0].item() == 3 and mixed.ext_seq_lens[0].item() == 8
    assert mixed.ext_tables[0].tolist() == wide[0][: mixed.max_pages]
    shared = build_metadata(prefix_lens=[8, 8], q_lens=[1, 3], block_tables=[[1, 2, 3], [1, 2, 4]], page_size=4,
                            device="cpu", detect_shared_prefix=True)
    assert shared.shared_prefix_len and not mixed.fits(shared)  # a shared prefix: cascade's, as pieces
    assert not mixed.fits(build_metadata(prefix_lens=[mixed.max_context], q_lens=[1] * 1, block_tables=wide,
                                         page_size=4, device="cpu", mode=None))  # past max_context


def test_whole_steps_refused_with_their_reason(tmp_path):
    save_checkpoint(_family("dense"), tmp_path)
    llm = _load(tmp_path, "torch")
    assert llm.engine.runner.mixed is None
    assert llm.info()["piecewise_graphs"]["whole_steps"] == [None, "backend 'torch' does not declare captures_mixed_steps"]
    assert _load(tmp_path, "triton", whole=False).info()["piecewise_graphs"]["whole_steps"] == [None, "off (whole=False)"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family,window_kv_fraction", [("dense", None), ("sliding", 0.5), ("mla", None),
                                                       ("shared_kv", 0.5)])
def test_gpu_whole_mixed_steps_replay_with_the_eager_steps_tokens(tmp_path, family, window_kv_fraction, monkeypatch):
    save_checkpoint(_family(family), tmp_path)
    kw = {} if window_kv_fraction is None else {"window_kv_fraction": window_kv_fraction}
    ref, off, eager = _run(tmp_path, "triton", False, device="cuda", **kw)
    got, on, llm = _run(tmp_path, "triton", False, device="cuda", piecewise_graph_tokens=16, whole=True, **kw)
    assert llm.engine.runner.mixed is not None and len(llm.engine.runner.mixed.graphs) == 1
    assert on["mixed"] == off["eager"] > 0 and on["piecewise"] == 0 and on["eager"] == 0
    _same(got, ref, tol=1e-3)
    # with 1 chunk slot, new prompts (none cached): their first step of three chunks runs as pieces, the long one's
    # later chunks beside the decode rows whole; the eager steps' tokens
    monkeypatch.setattr(mixed_graphs, "MAX_CHUNKS", 1)
    llm.engine.runner.enable_piecewise_graphs(16, buckets=(4, 8, 16))
    fresh = random_prompts(getattr(llm.config, "text_config", llm.config).vocab_size, [5, 6, 40], seed=7)
    want = eager.generate(fresh, max_new_tokens=6, ignore_eos=True, return_logits=True)
    before = dict(llm.engine.graph_stats)
    _same(llm.generate(fresh, max_new_tokens=6, ignore_eos=True, return_logits=True), want, tol=1e-3)
    after = llm.engine.graph_stats
    assert after["piecewise"] > before["piecewise"] and after["mixed"] > before["mixed"]
