"""The hybrid KV cache: a window page group for Gemma 4's sliding layers, released as windows move on.

Tiny Gemma 4 (window 8, pages of 4 tokens) generating far past its window: greedy tokens equal the
one-group path (window_kv_fraction=None) and transformers, on the torch backend and on triton (under
TRITON_INTERPRET=1 on CPU); window pages are released while generating; the same memory admits more long
requests at once; the prefix cache stays exact when windows have moved on or window pages were evicted;
models without sliding layers keep one group.
"""
import pytest
import torch
from transformers import Gemma4ForCausalLM, LlamaConfig, LlamaForCausalLM

import attnzoo
from attnzoo.attention.kv_cache import KVCacheSpec, KVPool, PageAllocator
from attnzoo.engine.prefix_cache import PrefixCache, window_start
from attnzoo.errors import ModelLoadError
from helpers import assert_greedy_close, assert_matches_hf, random_prompts, save_checkpoint
from test_gemma4 import VOCAB, WINDOW, randomize_scales_, text_config

PS = 4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Layers: sliding 0, 1, 3; global 2; 4 (sliding) and 5 (global) read the KV of 3 and 2."""
    cfg = text_config(num_key_value_heads=1, num_kv_shared_layers=2, hidden_size_per_layer_input=16)
    torch.manual_seed(3)
    hf = randomize_scales_(Gemma4ForCausalLM(cfg), seed=3)
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("gemma4_hybrid"))


def _load(path, **kw):
    return attnzoo.load_model(path, page_size=PS, **{"backend": "torch", "window_kv_fraction": 0.5, **kw})


def _tokens(llm, prompts, steps):
    return [o.token_ids for o in llm.generate(prompts, max_new_tokens=steps, ignore_eos=True)]


# ---------------------------------------------------------------- pool and allocator


def test_pool_groups_views_and_bytes():
    s, g = KVCacheSpec(2, 16, 16, sliding_window=8), KVCacheSpec(1, 32, 32)
    specs = [s, g, KVCacheSpec(2, 16, 16, shared_from=0, sliding_window=8), KVCacheSpec(1, 32, 32, shared_from=1)]
    pool = KVPool(specs, num_pages=10, page_size=PS, dtype=torch.float32, device="cpu", num_window_pages=3)
    assert pool.has_window_group and pool.window == 8
    assert [pool.in_window_group(i) for i in range(4)] == [True, False, True, False]
    assert pool.k(0).shape[0] == 3 and pool.k(1).shape[0] == 10 and pool.k(2) is pool.k(0)
    assert KVPool.bytes_per_page(specs, PS, torch.float32, group="window") == PS * 4 * 2 * 2 * 16
    assert KVPool.bytes_per_page(specs, PS, torch.float32, group="full") == PS * 4 * 2 * 32
    # a step without the window group's tables cannot run on it
    from attnzoo.attention.backends.torch_ref import TorchBackend
    from attnzoo.attention.layer import ForwardContext
    from attnzoo.attention.metadata import build_metadata
    from attnzoo.errors import BackendError

    meta = build_metadata(prefix_lens=[0], q_lens=[3], block_tables=[[1]], page_size=PS, device="cpu")
    with pytest.raises(BackendError, match="window block tables"):
        ForwardContext(meta, pool, TorchBackend(pool), TorchBackend(pool))
    one = KVPool(specs, num_pages=10, page_size=PS, dtype=torch.float32, device="cpu")
    assert not one.has_window_group and one.window is None and one.k(0).shape[0] == 10
    # a layer sharing a global layer's KV cannot slide over it (its pages are the producer's)
    bad = [g, KVCacheSpec(1, 32, 32, shared_from=0, sliding_window=8)]
    with pytest.raises(ModelLoadError, match="window"):
        KVPool(bad, num_pages=4, page_size=PS, dtype=torch.float32, device="cpu", num_window_pages=3)


def test_page_zero_entries_never_reach_a_result(gemma):
    """Released window pages read as page 0: fill page 0 of the window group with NaN and the greedy
    tokens stay the same: keys outside a window are not loaded, or enter as zeros."""
    prompts = random_prompts(VOCAB, [5, 22], seed=7)  # chunks of 8: the third starts past released pages
    want = _tokens(_load(gemma[1]), prompts, 24)
    for backend in ("torch", "triton"):
        llm = _load(gemma[1], backend=backend, max_batch_tokens=8)
        for lid in (0, 1, 3):
            assert llm.pool.in_window_group(lid)
            llm.pool.k(lid)[0].fill_(float("nan"))
            llm.pool.v(lid)[0].fill_(float("nan"))
        assert _tokens(llm, prompts, 24) == want, backend


# ---------------------------------------------------------------- generation


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hybrid_equals_one_group_and_transformers(gemma, backend):
    hf, path = gemma
    prompts = random_prompts(VOCAB, [3, 13, 22], seed=4)  # 22: chunks of 16 tokens, window 8
    one = _load(path, backend=backend, window_kv_fraction=None, max_batch_tokens=16)
    two = _load(path, backend=backend, max_batch_tokens=16)
    assert not one.pool.has_window_group and two.pool.has_window_group
    assert _tokens(two, prompts, 30) == _tokens(one, prompts, 30)
    if backend == "torch":
        assert_matches_hf(two, hf, prompts[1:], steps=30)
    e = two.engine
    assert e.window_allocator.num_free + e.prefix_cache.evictable_window() == e.window_allocator.capacity
    assert e.allocator.num_free + e.prefix_cache.evictable() == e.allocator.capacity


def test_window_pages_released_while_generating(gemma):
    llm = _load(gemma[1], prefix_caching=False)
    e = llm.engine
    held, advance = [], e.pages.window_advance

    def spy(wp, num_cached, end):
        new = advance(wp, num_cached, end)
        held.append((num_cached, len(wp.live()), e.window_allocator.num_free))
        return new

    e.pages.window_advance = spy
    llm.generate(random_prompts(VOCAB, [6], seed=1), max_new_tokens=60, ignore_eos=True)
    bound = -(-(WINDOW - 1 + 1) // PS) + 1  # decoding: the window and one page
    decoding = [h for n, h, _ in held if n >= 6]
    assert max(decoding) <= bound and len(decoding) == 59
    # 66 tokens span 17 pages; never more than the bound were held, so the others went back
    assert min(free for *_, free in held) >= e.window_allocator.capacity - bound
    assert e.window_allocator.num_free == e.window_allocator.capacity


def test_same_memory_admits_more_long_requests(gemma):
    # 20 + 60 tokens: 20 pages a request. One group: 5120 bytes a page, 50 pages, 2 requests at once.
    # Two: 2048 (the global layer) + 0.5 x 3072 (three sliding ones) a page: 72 full pages (3 requests)
    # and 36 window pages (a request holds at most 8: window 8 + a page + its 20-token prompt).
    prompts = random_prompts(VOCAB, [20] * 8, seed=2)
    running = {}
    for name, frac in (("one", None), ("two", 0.5)):
        llm = _load(gemma[1], window_kv_fraction=frac, kv_cache_memory=260_000, prefix_caching=False)
        llm.engine.step_log = []
        out = _tokens(llm, prompts, 60)
        running[name] = (max(s["num_reqs"] for s in llm.engine.step_log), out)
    assert running["two"][1] == running["one"][1]
    assert (running["one"][0], running["two"][0]) == (2, 3)


# ---------------------------------------------------------------- prefix cache


def test_prefix_reuse_after_release_and_window_eviction_stays_exact(gemma):
    prefix = random_prompts(VOCAB, [26], seed=9)[0]  # 6 full pages + 2 tokens: longer than the window
    prompts = [prefix + t for t in random_prompts(VOCAB, [3, 5], seed=10)]
    want = _tokens(_load(gemma[1], window_kv_fraction=None, prefix_caching=False), prompts, 20)
    llm = _load(gemma[1])
    e, cache = llm.engine, llm.engine.prefix_cache
    assert _tokens(llm, prompts[:1], 20) == want[:1]  # fills the cache; its window moved past the prefix
    full, wpages = cache.match(prompts[1])
    k = len(full)
    assert k == 6 and wpages[: window_start(k * PS, WINDOW, PS)] == [0, 0, 0, 0] and all(wpages[4:])
    e.pages.unmatch(full, wpages)
    assert _tokens(llm, prompts[1:], 20) == want[1:]  # reused 6 pages, window pages included
    # Window pages gone from the cache: only prefixes whose needed window pages remain are matched.
    cache.evict_window(e.window_allocator.capacity)
    assert cache.match(prompts[1]) == ([], [])
    assert _tokens(llm, prompts, 20) == want


def _cache_with(window_cols: list[bool]):
    """A cache holding a 25-token prompt's 6 pages (only the cache references them), with window pages at
    the columns marked True."""
    full, win = PageAllocator(20), PageAllocator(20)
    cache = PrefixCache(full, PS, win, window=8)
    prompt = list(range(100, 125))
    pages = full.alloc(6)
    wpages = [win.alloc(1)[0] if on else 0 for on in window_cols]
    cache.insert(prompt, pages, wpages)
    cache.mark_ready(pages, wpages)
    full.free(pages)
    win.free([p for p in wpages if p])
    return cache, prompt, pages, wpages


def test_prefix_cache_matches_the_longest_prefix_with_its_window_pages():
    # 6 pages (24 tokens) need window columns 4..5; 5 pages 3..4; 4 pages 2..3; 3 pages 1..2
    cache, prompt, pages, w = _cache_with([True] * 6)
    assert cache.match(prompt) == (pages, [0, 0, 0, 0] + w[4:])
    cache, prompt, pages, w = _cache_with([True] * 5 + [False])
    assert cache.match(prompt) == (pages[:5], [0, 0, 0] + w[3:5])
    cache, prompt, pages, w = _cache_with([True, True, True, False, True, False])
    got, gw = cache.match(prompt)
    assert (got, gw) == (pages[:3], [0] + w[1:3])
    assert [cache.allocator.refcount(p) for p in pages[:4]] == [2, 2, 2, 1]  # increfed for the caller
    # another writer's window page of the same tokens fills the hole, unready until it is written
    other = cache.window_allocator.alloc(1)[0]
    cache.insert(prompt, [0] * 6, [0, 0, 0, other, 0, 0])
    got, gw = cache.match(prompt)
    assert got == pages[:5] and gw == [0, 0, 0, other, w[4]] and not cache.all_ready(got, gw)
    cache.mark_ready([], [other])
    assert cache.all_ready(got, gw)
    # window pages go least recently used first; full pages stay and are matched as far as windows allow
    cache, prompt, pages, w = _cache_with([True] * 6)
    assert cache.evict_window(4) == 4 and cache.match(prompt)[0] == pages
    assert cache.evict_window(9) == 0  # the rest are held by the match above
    # evicting a full page drops its node's window page too
    cache, prompt, pages, w = _cache_with([True] * 6)
    assert cache.evict(6) == 6 and cache.window_allocator.num_free == cache.window_allocator.capacity


def test_eviction_passes_held_pages_once():
    # five one-page prompts, oldest first; a running request holds the two oldest pages
    full = PageAllocator(8)
    cache = PrefixCache(full, PS)
    prompts = [[i] * (PS + 1) for i in range(5)]
    pages = full.alloc(5)
    for prompt, page in zip(prompts, pages):
        cache.insert(prompt, [page])
    full.free(pages[2:])
    assert cache.evict(1) == 1 and cache.match(prompts[2]) == ([], [])  # the oldest one only the cache holds
    # the held pages were passed over once: now the most recently used, after the ones left to evict
    assert list(cache._pages.values()) == [pages[3], pages[4], pages[0], pages[1]]
    assert cache.evict(5) == 2 and len(cache) == 2 and cache.match(prompts[0]) == ([pages[0]], [])
    full.free([pages[0], pages[0], pages[1]])  # the match and the request let go: the cache holds the rest
    assert cache.evict(5) == 2 and full.num_free == full.capacity


def test_no_sliding_layers_or_short_context_keep_one_group(tmp_path, gemma):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    path = save_checkpoint(LlamaForCausalLM(cfg).eval(), tmp_path / "llama")
    a, b = _load(path), _load(path, window_kv_fraction=None)
    assert not a.pool.has_window_group and a.engine.window is None and a.pool.num_pages == b.pool.num_pages
    prompts = random_prompts(VOCAB, [5, 9], seed=3)
    ga = a.generate(prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
    gb = b.generate(prompts, max_new_tokens=12, ignore_eos=True, return_logits=True)
    assert all(torch.equal(x.logits, y.logits) for x, y in zip(ga, gb))
    assert a.info()["kv_page_groups"]["explain"] == "one group: no layer has a sliding window"
    torch.manual_seed(0)
    fits = save_checkpoint(Gemma4ForCausalLM(text_config(sliding_window=512)).eval(), tmp_path / "fits")
    short = _load(fits)
    assert not short.pool.has_window_group
    assert short.info()["kv_page_groups"]["explain"] == "one group: the context (512) fits the sliding window (512)"
    off = _load(gemma[1], window_kv_fraction=None)
    assert off.info()["kv_page_groups"]["explain"] == "one group: window_kv_fraction=None"
    auto = _load(gemma[1], window_kv_fraction="auto")  # the default: only layers that compress get a window group
    assert not auto.pool.has_window_group and "'auto' splits only" in auto.info()["kv_page_groups"]["explain"]
    groups = _load(gemma[1], kv_cache_tokens=400).info()["kv_page_groups"]
    assert groups["window"] == WINDOW and (groups["full"]["tokens"], groups["window_group"]["tokens"]) == (400, 200)
    with pytest.raises(ModelLoadError, match="window_kv_fraction"):
        _load(gemma[1], window_kv_fraction=1.5)


def test_flashinfer_plans_sliding_layers_over_the_window_table(monkeypatch):
    """FlashInfer replaced by a recorder (test_flashinfer_planning): a sliding layer's pages come from the
    window group's table (from its window's first page), a global layer's from the full one; a cascade
    step's shared segment for the sliding layer is read from the window table too."""
    from types import SimpleNamespace

    from attnzoo.attention.backends import flashinfer as fi
    from attnzoo.attention.layer import Attention
    from attnzoo.attention.metadata import build_metadata
    from test_flashinfer_planning import RecordingWrapper, merge_state

    fake = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=RecordingWrapper,
                           BatchDecodeWithPagedKVCacheWrapper=RecordingWrapper, merge_state=merge_state)
    monkeypatch.setattr(fi, "load_flashinfer", lambda name: fake)
    monkeypatch.setattr(fi, "compute_capability", lambda name, device: (9, 0))
    sliding, glob = Attention(0, 8, 2, 64, sliding_window=8), Attention(1, 8, 2, 64)
    pool = KVPool([sliding.kv_cache_spec(), glob.kv_cache_spec()], num_pages=16, page_size=PS, dtype=torch.bfloat16,
                  device="cpu", num_window_pages=16)
    be = fi.FlashInferBackend(pool)
    q = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    # decode at 13 and 14 cached tokens: the window (8) starts in column 1, column 0 is released
    meta = build_metadata(prefix_lens=[13, 14], q_lens=[1, 1], block_tables=[[1, 2, 3, 4], [5, 6, 7, 8]], page_size=PS,
                          device="cpu", window_block_tables=[[0, 2, 3, 4], [0, 5, 6, 7]])
    assert meta.window_slot_mapping.tolist() == [4 * PS + 1, 7 * PS + 2] and meta.slot_mapping.tolist() == [17, 34]
    plan = be.prepare(meta)
    for layer in (sliding, glob):
        be.decode(layer, q, meta, plan)
    plans = {sig.window: w.plans[-1] for sig, w in be._decode_wrappers.items()}
    assert plans[8]["indices"].tolist() == [2, 3, 4, 5, 6, 7]
    assert plans[None]["indices"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # cascade: 3 shared full pages; for the window layer the shared segment is column 2 (both windows see it)
    full, window = [[1, 2, 3, 9], [1, 2, 3, 10]], [[0, 5, 6, 11], [0, 5, 6, 12]]
    meta = build_metadata(prefix_lens=[13, 14], q_lens=[1, 1], block_tables=full, page_size=PS, device="cpu",
                          window_block_tables=window, detect_shared_prefix=True)
    assert meta.shared_prefix_len == 3 * PS
    plan = be.prepare(meta)
    be.decode(sliding, q, meta, plan)
    shared, rest = (next(iter(d.values())) for d in be._cascade_wrappers[fi.LayerSignature.of(sliding)])
    assert shared.plans[-1]["paged_kv_indices"].tolist() == [6]
    assert rest.plans[-1]["indices"].tolist() == [5, 11, 5, 12]
    # a live window column holding different pages (two writers of the same tokens) ends the shared prefix
    meta = build_metadata(prefix_lens=[13, 14], q_lens=[1, 1], block_tables=full, page_size=PS, device="cpu",
                          window_block_tables=[[0, 5, 6, 11], [0, 5, 13, 12]], detect_shared_prefix=True)
    assert meta.shared_prefix_len == 2 * PS


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["flashinfer", "trtllm_mha", "triton"])
def test_gpu_hybrid_equals_one_group_eager_graphs_and_cascade(tmp_path, backend):
    """Gemma-4-like (sliding d256 layers, window 16; global d512) in bf16, pages of 16, prompts chunked by
    a 64-token budget far past the window: the hybrid cache's greedy tokens follow one group's, eager, with
    CUDA graphs (replayed) and, on flashinfer, with cascade over a shared 100-token prefix.

    The two layouts run different kernel partitions (page lists start elsewhere; on CPU in float32 their
    logits differ by ~3e-6), so in bf16 a near tie may flip a late token (seen on the H200):
    ``assert_greedy_close``."""
    if backend != "triton":
        pytest.importorskip("flashinfer")
    from helpers import tiny_gemma4

    if backend == "trtllm_mha":
        from test_gpu_backends import XQA_OR_TRTLLM_GEN  # a module that needs FlashInfer: the triton case does not

        if not XQA_OR_TRTLLM_GEN:
            pytest.skip("trtllm_mha needs SM90, SM100/103 or SM120/121")
    path = tiny_gemma4(tmp_path / "gemma4", window=16)
    prefix = random_prompts(256, [100], seed=7)[0]
    prompts = random_prompts(256, [5, 90, 17], seed=4) + [prefix + p for p in random_prompts(256, [3, 20, 9], seed=8)]
    runs = {}
    cases = {"one": dict(window_kv_fraction=None, cuda_graph=False), "two": dict(cuda_graph=False, window_kv_fraction=0.5),
             "two_graph": dict(cuda_graph=True, window_kv_fraction=0.5)}
    if backend == "flashinfer":
        cases["one_cascade"] = dict(cuda_graph=False, cascade=True, window_kv_fraction=None)
        cases["two_cascade"] = dict(cuda_graph=False, cascade=True, window_kv_fraction=0.5)
    for name, kw in cases.items():
        llm = attnzoo.load_model(path, backend=backend, dtype="bfloat16", page_size=16, max_running=8,
                                 max_batch_tokens=64, **kw)
        assert llm.pool.has_window_group == name.startswith("two")
        llm.engine.cascade_min_saved_tokens = 1
        if "cascade" in name:
            # The prefix cached first: with two groups a prefix is matched only where its window pages are
            # written or being written, and requests admitted together with the writer of a prompt longer
            # than one chunk find none yet (the writer takes them chunk by chunk), so they would not share.
            llm.generate([prefix + [5]], max_new_tokens=1, ignore_eos=True)
        out = llm.generate(prompts, max_new_tokens=40, ignore_eos=True, return_logits=True)
        runs[name] = (out, dict(llm.engine.graph_stats))
    assert runs["two_graph"][1]["replayed"] > 0
    if "two_cascade" in runs:  # requests sharing a cached prefix cascade with either layout
        assert runs["two_cascade"][1]["cascade"] > 0 and runs["one_cascade"][1]["cascade"] > 0
    for name, (out, _) in runs.items():
        assert_greedy_close(out, runs["one"][0], 5e-2, name)
