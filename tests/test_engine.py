"""Engine behaviour on CPU: continuous batching, shared-prefix reuse, KV pressure, bad input."""
import pytest
import torch

import attnzoo
import attnzoo.errors
from attnzoo.errors import KVCacheFullError, ModelLoadError, RequestError, UnsupportedArchitectureError
from helpers import random_prompts, save_checkpoint
from test_llama import tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_engine")
    save_checkpoint(tiny_llama(kv_heads=2, heads=4), d)
    return d


def test_continuous_batching_matches_one_at_a_time(tiny_dir):
    # A small token budget forces chunked prefill mixed with decode steps of other requests.
    llm = attnzoo.load_model(tiny_dir, page_size=4, max_batch_tokens=7, prefix_caching=False)
    prompts = random_prompts(160, [12, 3, 25, 8, 1], seed=1)
    batched = llm.generate(prompts, max_new_tokens=9, ignore_eos=True)
    single = [llm.generate([p], max_new_tokens=9, ignore_eos=True)[0] for p in prompts]
    assert [c.token_ids for c in batched] == [c.token_ids for c in single]


def test_shared_prefix_pages_allocated_once(tiny_dir):
    ps = 4
    prefix = random_prompts(160, [40], seed=5)[0]  # 10 full pages
    tails = random_prompts(160, [3, 6, 2, 5], seed=6)
    prompts = [prefix + t for t in tails]
    plain = attnzoo.load_model(tiny_dir, page_size=ps, prefix_caching=False)
    ref = plain.generate(prompts, max_new_tokens=6, ignore_eos=True)

    llm = attnzoo.load_model(tiny_dir, page_size=ps, prefix_caching=True)
    llm.engine.graph_extend_tokens = 0  # the extend path's tokens, also where a GPU's graphs would take the tails
    allocated = []
    real_alloc = llm.engine.allocator.alloc

    def counting_alloc(n):
        allocated.append(n)
        return real_alloc(n)

    llm.engine.allocator.alloc = counting_alloc
    got = llm.generate(prompts, max_new_tokens=6, ignore_eos=True)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    # The cache holds prompt + 5 tokens per request (the 6th new token is never fed back). Without
    # sharing every request would allocate all its pages; with sharing the 10 prefix pages are
    # allocated once, by the first request, and the others allocate only their own.
    own = sum(-(-(len(p) + 5) // ps) - 10 for p in prompts)
    assert sum(allocated) == 10 + own
    # and a later request reuses the cached prefix: it allocates only its own pages (43 + 3 tokens
    # kept = 12 pages, 10 of them cached) and computes only the tokens after the prefix
    allocated.clear()
    computed = []
    runner = llm.engine.runner
    real_launch = runner.launch
    runner.launch = lambda prep, ids: computed.append(len(ids)) or real_launch(prep, ids)
    again = llm.generate([prefix + [7, 8, 9]], max_new_tokens=4, ignore_eos=True)
    assert again[0].token_ids == plain.generate([prefix + [7, 8, 9]], max_new_tokens=4, ignore_eos=True)[0].token_ids
    assert sum(allocated) == 2 and computed[0] == 3


def test_n_in_n_out_under_kv_pressure(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, page_size=4, kv_cache_tokens=48)
    prompts = random_prompts(160, [5, 17, 9, 30, 2, 11, 23, 4, 13], seed=9)
    outs = llm.generate(prompts, max_new_tokens=8, ignore_eos=True)
    assert len(outs) == len(prompts)
    assert [len(o.token_ids) for o in outs] == [8] * len(prompts)
    assert [o.prompt_token_ids for o in outs] == prompts


def test_bad_input_is_rejected_before_work(tiny_dir, tmp_path):
    llm = attnzoo.load_model(tiny_dir, kv_cache_tokens=64, page_size=16)
    free = llm.engine.allocator.num_free
    cases = [
        (RequestError, lambda: llm.generate([])),
        (RequestError, lambda: llm.generate("")),
        (RequestError, lambda: llm.generate([[5, 6]], temperature=-1)),
        (RequestError, lambda: llm.generate([[5, 6]], top_p=0)),
        (RequestError, lambda: llm.generate([[5, 6]], top_k=-2)),
        (RequestError, lambda: llm.generate([[5, 6]], max_new_tokens=0)),
        (RequestError, lambda: llm.generate([[5, 10_000]])),
        (RequestError, lambda: llm.generate([[5] * 600])),  # longer than the 512-token context
        (KVCacheFullError, lambda: llm.generate([[5, 6], [5] * 100], max_new_tokens=8)),  # can never fit
    ]
    for exc, call in cases:
        with pytest.raises(exc) as info:
            call()
        assert "Fix:" in str(info.value)
        assert llm.engine.allocator.num_free == free  # nothing half-done is left behind


def test_bad_checkpoints(tmp_path, tiny_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        attnzoo.load_model(tmp_path / "nope")
    import json, shutil
    d = tmp_path / "weird"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    # An unknown name with Llama's layers loads as Llama (tests/test_policy_kinds.py); with experts it is refused.
    cfg.update(architectures=["FancyNetForCausalLM"], num_local_experts=4)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        attnzoo.load_model(d)


def test_missing_and_misshaped_weights(tmp_path):
    from safetensors.torch import load_file, save_file
    hf = tiny_llama()
    d = save_checkpoint(hf, tmp_path / "ck")
    f = d / "model.safetensors"
    sd = load_file(f)
    name = "model.layers.1.mlp.up_proj.weight"
    sd2 = {k: v for k, v in sd.items() if k != name}
    save_file(sd2, f, metadata={"format": "pt"})
    with pytest.raises(attnzoo.errors.WeightError, match="missing"):
        attnzoo.load_model(d)
    sd[name] = torch.zeros(3, 3)
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(attnzoo.errors.WeightError, match="up_proj"):
        attnzoo.load_model(d)


def test_hub_id_offline_and_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        attnzoo.load_model("someorg/not-a-cached-model")


def test_random_weights_from_config():
    cfg = tiny_llama().config
    llm = attnzoo.load_model(cfg, load_format="random")
    out = llm.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)
    assert len(out[0].token_ids) == 3
    with pytest.raises(ModelLoadError, match="load_format"):
        attnzoo.load_model(cfg)


def test_failed_step_leaves_no_unwritten_prefix_in_the_cache(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, page_size=4)
    prompt = random_prompts(160, [42], seed=8)[0]
    real_forward = llm.engine.runner.forward

    def failing_forward(ids, meta, plan):
        raise RuntimeError("injected failure")

    llm.engine.runner.forward = failing_forward
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([prompt], max_new_tokens=4, ignore_eos=True)
    llm.engine.runner.forward = real_forward
    assert llm.engine.allocator.num_free == llm.engine.allocator.capacity
    assert len(llm.engine.prefix_cache) == 0
    # the same prefix runs normally afterwards
    ref = attnzoo.load_model(tiny_dir, page_size=4, prefix_caching=False)
    got = llm.generate([prompt + [5]], max_new_tokens=4, ignore_eos=True)
    assert got[0].token_ids == ref.generate([prompt + [5]], max_new_tokens=4, ignore_eos=True)[0].token_ids


def test_logits_evict_cached_prefix_pages_when_short(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, page_size=4, kv_cache_tokens=64)
    llm.generate(random_prompts(160, [30, 30], seed=2), max_new_tokens=2, ignore_eos=True)
    assert llm.engine.prefix_cache.evictable() > 0
    assert llm.logits(random_prompts(160, [40], seed=3)[0]).shape == (40, 160)


@pytest.mark.parametrize("kw", [dict(max_running=0), dict(max_batch_tokens=0), dict(max_batch_tokens=-1),
                                dict(kv_cache_tokens=0), dict(cuda_graph_batch_sizes=[1, 0]),
                                dict(cuda_graph_batch_sizes="8")])
def test_invalid_engine_settings_are_named(tiny_dir, kw):
    with pytest.raises(ModelLoadError, match=f"{next(iter(kw))} must be a .*positive integer"):
        attnzoo.load_model(tiny_dir, **kw)


def test_out_of_memory_in_graph_capture_names_the_kv_cache_and_the_fix(tiny_dir, monkeypatch):
    """A decode step's activations that do not fit beside the default-sized KV cache: a load error that
    says what took the memory and what to pass, not torch's bare OutOfMemoryError."""
    from attnzoo.engine import build
    from attnzoo.engine.engine import Engine

    def capture(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 160.00 MiB")

    monkeypatch.setattr(build, "_check_graph_and_cascade", lambda *args: None)  # graphs on the CPU: capture fails
    monkeypatch.setattr(Engine, "enable_cuda_graphs", capture)
    with pytest.raises(ModelLoadError, match=r"capturing the decode CUDA graphs .* the default") as e:
        attnzoo.load_model(tiny_dir, cuda_graph=True)
    assert "gpu_memory_utilization=0.8" in str(e.value) and isinstance(e.value.__cause__, torch.OutOfMemoryError)
    with pytest.raises(ModelLoadError, match=r"GiB \(as asked\)"):
        attnzoo.load_model(tiny_dir, cuda_graph=True, kv_cache_tokens=256)


def test_shared_prefix_pages_of_a_decode_batch():
    from attnzoo.attention.metadata import build_metadata, shared_prefix_pages

    # Pages 1, 2 shared by all; request 1 diverges at its third page; the page being written never counts.
    tables = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 7]]
    assert shared_prefix_pages(tables, [60, 60, 60], 16) == 2
    assert shared_prefix_pages([[1, 2, 3, 4], [1, 2, 3, 9]], [60, 60], 16) == 3
    assert shared_prefix_pages([[1, 2, 3, 4], [1, 2, 3, 9]], [60, 33], 16) == 2  # 33 cached: page 3 is being written
    assert shared_prefix_pages([[1, 2, 3]], [40], 16) == 0  # one request shares with nobody
    assert shared_prefix_pages([[8, 2], [1, 2]], [30, 30], 16) == 0  # a shared page after a different one is not a prefix
    meta = build_metadata(prefix_lens=[59, 59, 59], q_lens=[1, 1, 1], block_tables=tables, page_size=16,
                          device="cpu", detect_shared_prefix=True)
    assert meta.shared_prefix_len == 32
    extend = build_metadata(prefix_lens=[40, 40], q_lens=[3, 1], block_tables=tables[:2], page_size=16,
                            device="cpu", detect_shared_prefix=True)
    assert extend.shared_prefix_len == 32  # new tokens after two shared cached pages
    extend = build_metadata(prefix_lens=[40, 20], q_lens=[3, 30], block_tables=tables[:2], page_size=16,
                            device="cpu", detect_shared_prefix=True)
    assert extend.shared_prefix_len == 16  # request 1 writes its second page in this step


def test_metadata_of_a_mixed_step_from_lists_or_arrays():
    """Positions, slots and the padded table, checked token by token; the engine's per-request int32
    page arrays give the same metadata as lists."""
    import numpy as np

    from attnzoo.attention.metadata import build_metadata

    tables = [[7, 3, 9], [4], [7, 3, 5, 6, 8]]
    prefix, q_lens, ps = [9, 0, 33], [1, 3, 7], 8
    metas = [build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=t, page_size=ps, device="cpu",
                            detect_shared_prefix=True)
             for t in (tables, [np.asarray(t, dtype=np.int32) for t in tables])]
    positions = [p for p0, q in zip(prefix, q_lens) for p in range(p0, p0 + q)]
    slots = [bt[p // ps] * ps + p % ps for bt, p0, q in zip(tables, prefix, q_lens) for p in range(p0, p0 + q)]
    for m in metas:
        assert m.positions.tolist() == positions and m.slot_mapping.tolist() == slots
        assert m.block_tables.tolist() == [[7, 3, 9, 0, 0], [4, 0, 0, 0, 0], [7, 3, 5, 6, 8]]
        assert m.q_indptr.tolist() == [0, 1, 4, 11] and m.last_token_rows.tolist() == [0, 3, 10]
        assert m.seq_lens_cpu == [10, 3, 40] and m.seq_lens.tolist() == [10, 3, 40]
        assert m.shared_prefix_len == 0 and not m.is_decode  # request 1 shares nothing
    with pytest.raises(ValueError, match="request 1: 1 pages of 8 cannot hold 9 tokens"):
        build_metadata(prefix_lens=[9, 0], q_lens=[1, 9], block_tables=tables[:2], page_size=ps, device="cpu")


def test_cascade_is_explained_and_refused_where_it_cannot_run(tiny_dir):
    llm = attnzoo.load_model(tiny_dir, backend="torch", dtype="float32")
    assert llm.info()["cascade"] == "off: decode backend 'torch' has no cascade path"
    llm.engine.cascade_extend = True  # a prefill backend that cascades extend steps (trtllm_mha's off Blackwell)
    assert llm.info()["cascade"].endswith("; extend steps: on (prefill backend 'torch')")
    with pytest.raises(attnzoo.errors.BackendError, match="cascade attention needs prefix caching") as e:
        attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", cascade=True)
    assert "Fix:" in str(e.value)


def test_cascade_decode_through_the_engine_matches_plain(tiny_dir):
    """Triton (interpreter on CPU) with the shared prompt prefix read once per decode step: the torch
    backend's greedy tokens, and the step log says which steps read a shared prefix."""
    prefix = random_prompts(160, [20], seed=3)[0]
    prompts = [prefix + p for p in random_prompts(160, [2, 5, 3], seed=4)]
    ref = attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", page_size=4)
    tri = attnzoo.load_model(tiny_dir, backend="triton", dtype="float32", page_size=4)
    assert tri.info()["cascade"].startswith("on")
    tri.engine.cascade_min_saved_tokens = 1  # a tiny batch: cascade every step that shares a page
    tri.engine.graph_extend_tokens = 0  # on a GPU the prompt tails would run as token rows, which never cascade
    tri.engine.step_log = []
    a = ref.generate(prompts, max_new_tokens=6, ignore_eos=True)
    b = tri.generate(prompts, max_new_tokens=6, ignore_eos=True)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    shared = [s["shared_prefix_len"] for s in tri.engine.step_log if s["new_tokens"] == s["num_reqs"]]
    assert shared and all(n == 20 for n in shared)  # every decode step shares the 5 full pages of the prefix
    assert tri.engine.graph_stats["cascade"] == len(shared)


def test_cascade_extend_through_the_engine_matches_plain(tiny_dir):
    """Extend steps after a cached prefix (prompt chunks beside decode rows): a prefill backend that reads
    the step's shared pages once, for all its queries and without a causal mask, then each request's own
    pages causally, merged by log-sum-exp, gives the plain torch backend's tokens and logits. A shared
    page the engine reported wrongly (one some query may not see yet) would change them."""
    from attnzoo.attention.backends.torch_ref import TorchBackend, gather_kv

    def partial(q, k, v, visible, scale):  # -> out [q, H, dv], lse [q, H]
        group = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, 1)) * scale
        s = s.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, -1)
        o = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v.float().repeat_interleave(group, 1))
        return o, lse.transpose(0, 1)

    class CascadeExtend(TorchBackend):
        supports_cascade_extend = True
        cascade_steps = 0

        def extend(self, layer, q, meta, plan):
            n = meta.shared_prefix_len
            if not n:
                return super().extend(layer, q, meta, plan)
            CascadeExtend.cascade_steps += layer.layer_id == 0
            kc, vc, ps = self.pool.k(layer.layer_id), self.pool.v(layer.layer_id), meta.page_size
            shared = meta.block_tables[0, : n // ps]
            everyone = torch.ones(1, q.shape[0], n, dtype=torch.bool)  # no mask: all queries follow the prefix
            o_a, s_a = partial(q, gather_kv(kc, shared, n), gather_kv(vc, shared, n), everyone, layer.scale)
            outs, lses, start = [], [], 0
            for i, (seq, ql) in enumerate(zip(meta.seq_lens_cpu, meta.q_lens_cpu)):
                pages = meta.block_tables[i, : -(-seq // ps)]
                k, v = gather_kv(kc, pages, seq)[n:], gather_kv(vc, pages, seq)[n:]
                visible = torch.arange(n, seq)[None, :] <= torch.arange(seq - ql, seq)[:, None]
                o, s = partial(q[start : start + ql], k, v, visible[None], layer.scale)
                outs.append(o), lses.append(s)
                start += ql
            o_b, s_b = torch.cat(outs), torch.cat(lses)
            s = torch.logaddexp(s_a, s_b)[..., None]
            return (o_a * torch.exp(s_a[..., None] - s) + o_b * torch.exp(s_b[..., None] - s)).to(q.dtype)

    prefix = random_prompts(160, [21], seed=11)[0]
    prompts = [prefix + p for p in random_prompts(160, [9, 2, 14, 5, 1], seed=12)]
    # A small token budget: the tails arrive in chunks, beside decode rows of requests already done.
    ref = attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", page_size=4, max_batch_tokens=10)
    llm = attnzoo.load_model(tiny_dir, backend="torch", dtype="float32", page_size=4, max_batch_tokens=10)
    assert not llm.engine.cascade_extend  # the torch backend has no cascade path
    e = llm.engine
    e.backends.prefill_backend, e.cascade_extend, e.cascade_min_saved_tokens = CascadeExtend(llm.pool), True, 1
    e.step_log = []
    a = ref.generate(prompts, max_new_tokens=5, ignore_eos=True, return_logits=True)
    b = llm.generate(prompts, max_new_tokens=5, ignore_eos=True, return_logits=True)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    for x, y in zip(a, b):
        assert (x.logits - y.logits).abs().max().item() < 1e-4
    extend = [s for s in e.step_log if s["new_tokens"] != s["num_reqs"]]
    mixed = [s for s in extend if s["shared_prefix_len"]]
    assert len(mixed) == CascadeExtend.cascade_steps >= 2 and all(s["shared_prefix_len"] == 20 for s in mixed)
    assert extend[0]["shared_prefix_len"] == 0  # the step that computes the prefix shares nothing yet


def test_overlap_prepares_the_next_decode_step_without_changing_results(tiny_dir):
    """With ``overlap`` the next decode step is prepared before this step's tokens are read back; a request
    that stops on EOS, one that ends by length and one that joins from the queue change the running set,
    and the prepared step is then dropped. With ``early_launch`` a step nobody can join is launched on the
    device tokens before the read-back; the EOS stop then lands in a launched step, whose row for it is
    dropped. Tokens and logits equal those of the engine without overlap."""
    from attnzoo.engine.sampling import SamplingParams

    prompts = random_prompts(160, [5, 9, 3, 14, 7, 2], seed=11)
    probe = attnzoo.load_model(tiny_dir, page_size=4).generate(prompts[:1], max_new_tokens=8, ignore_eos=True)
    eos = probe[0].token_ids[3]  # request 0 stops early on it, unannounced
    params = [SamplingParams(max_new_tokens=n) for n in (8, 3, 12, 6, 9, 5)]
    runs = {}
    for mode in ("serial", "overlap", "early"):
        llm = attnzoo.load_model(tiny_dir, page_size=4, max_running=3)  # three wait: they join mid-run
        llm.engine.overlap, llm.engine.early_launch, llm.engine.eos = mode != "serial", mode == "early", {eos}
        out = llm.engine.generate(prompts, params, return_logits=True)
        runs[mode] = (out, dict(llm.engine.overlap_stats), llm.engine)
    (off, off_stats, _), (on, on_stats, _) = runs["serial"], runs["overlap"]
    assert off_stats == {"prepared": 0, "launched": 0, "early": 0}
    assert 0 < on_stats["launched"] < on_stats["prepared"] and on_stats["early"] == 0  # some used, some dropped
    early, early_stats, engine = runs["early"]
    assert 0 < early_stats["early"] <= early_stats["launched"] < early_stats["prepared"]
    for out in (on, early):
        assert out[0].finish_reason == "stop" and len(out[0].token_ids) <= 4
        assert [c.token_ids for c in out] == [c.token_ids for c in off]
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(on, off))
    # An early step may hold the stopped request's row, and a join waits a step: the batches differ, so
    # float32 matmuls of other shapes round differently (1e-6 here), nothing more.
    assert max((a.logits - b.logits).abs().max().item() for a, b in zip(early, off)) < 1e-4
    # pages a dropped step took went back with their requests: only the prefix cache holds any
    assert engine.allocator.num_free + engine.prefix_cache.evictable() == engine.allocator.capacity
