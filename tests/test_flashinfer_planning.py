"""The flashinfer backend's planning, on CPU with FlashInfer replaced by a recorder.

The kernels themselves are checked on a GPU (test_gpu_backends.py); here we check what the backend asks
them to do: which pages each wrapper is planned over, causal or not, and how a cascade step splits
the shared prefix from each request's own pages. The page-index kernel runs in the Triton interpreter.
"""
import sys
from types import SimpleNamespace

import pytest
import torch

from attnzoo.attention.backends import flashinfer as fi_backend
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention
from attnzoo.attention.metadata import build_metadata
from attnzoo.errors import BackendError


class RecordingWrapper:
    """Stands in for a FlashInfer plan/run wrapper: records plans, returns zeros and a known LSE."""

    def __init__(self, **kwargs):
        self.kwargs, self.plans = kwargs, []

    def plan(self, **kwargs):
        self.plans.append(kwargs)

    def reset_workspace_buffer(self, *, float_workspace_buffer, int_workspace_buffer):
        self.kwargs["float_workspace_buffer"], self.int_workspace = float_workspace_buffer, int_workspace_buffer

    def run(self, *, q, paged_kv_cache, return_lse=False, **scales):
        self.scales = scales
        out = torch.zeros_like(q)
        return (out, torch.zeros(q.shape[:2])) if return_lse else out


def merge_state(*, v_a, s_a, v_b, s_b):
    return v_a + v_b, torch.logaddexp(s_a, s_b)


def make_backend(monkeypatch, layer, num_pages, page_size):
    fake = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=RecordingWrapper,
                           BatchDecodeWithPagedKVCacheWrapper=RecordingWrapper, merge_state=merge_state)
    monkeypatch.setattr(fi_backend, "load_flashinfer", lambda name: fake)
    monkeypatch.setattr(fi_backend, "compute_capability", lambda name, device: (9, 0))
    layers = layer if isinstance(layer, list) else [layer]
    pool = KVPool([x.kv_cache_spec() for x in layers], num_pages=num_pages, page_size=page_size, dtype=torch.bfloat16,
                  device="cpu")
    return fi_backend.FlashInferBackend(pool)


def test_cascade_step_plans_shared_pages_once_and_the_rest_per_request(monkeypatch):
    layer = Attention(0, 8, 2, 64)
    tables = [[3, 4, 5, 9], [3, 4, 5, 10, 11], [3, 4, 5, 12]]  # pages 3, 4, 5 shared (16 tokens each)
    seq = [50, 70, 49]
    be = make_backend(monkeypatch, layer, 16, 16)
    meta = build_metadata(prefix_lens=[s - 1 for s in seq], q_lens=[1, 1, 1], block_tables=tables, page_size=16,
                          device="cpu", detect_shared_prefix=True)
    assert meta.shared_prefix_len == 48
    out = be.decode(layer, torch.randn(3, 8, 64, dtype=torch.bfloat16), meta, be.prepare(meta))
    assert out.shape == (3, 8, 64)

    (shared_w, rest_w) = (next(iter(d.values())) for d in be._cascade_wrappers[fi_backend.LayerSignature.of(layer)])
    shared = shared_w.plans[-1]
    assert shared["qo_indptr"].tolist() == [0, 3]  # all three queries as one request
    assert shared["causal"] is False
    assert shared["paged_kv_indptr"].tolist() == [0, 3]
    assert shared["paged_kv_indices"].tolist() == [3, 4, 5]
    assert shared["paged_kv_last_page_len"].tolist() == [16]
    rest = rest_w.plans[-1]
    assert rest["indptr"].tolist() == [0, 1, 3, 4]  # request 1 owns two pages beyond the prefix
    assert rest["indices"].tolist() == [9, 10, 11, 12]
    assert rest["last_page_len"].tolist() == [2, 6, 1]
    assert rest["is_causal"] is False and rest["sm_scale"] == layer.scale
    assert not be._decode_wrappers  # the plain decode wrapper was not needed
    # The shared part may run beside the rest (a second stream on CUDA): their split-KV partials never share memory.
    assert shared_w.kwargs["float_workspace_buffer"] is fi_backend.workspace(torch.device("cpu"), "cascade_shared")
    assert rest_w.kwargs["float_workspace_buffer"] is fi_backend.workspace(torch.device("cpu"), "wrappers")
    assert be._side_stream() is None  # a CPU pool: one after the other

    # The same batch without a shared prefix plans one decode over every page of every request.
    plain = build_metadata(prefix_lens=[s - 1 for s in seq], q_lens=[1, 1, 1], block_tables=tables,
                           page_size=16, device="cpu")
    be.decode(layer, torch.randn(3, 8, 64, dtype=torch.bfloat16), plain, be.prepare(plain))
    full = next(iter(be._decode_wrappers.values())).plans[-1]
    assert full["indptr"].tolist() == [0, 4, 9, 13]
    assert full["indices"].tolist() == [3, 4, 5, 9, 3, 4, 5, 10, 11, 3, 4, 5, 12]


def test_sliding_window_layers_past_the_prefix_keep_the_plain_path(monkeypatch):
    layer = Attention(0, 4, 4, 64, sliding_window=20)
    tables = [[1, 2, 3], [1, 2, 4]]
    be = make_backend(monkeypatch, layer, 8, 16)
    meta = build_metadata(prefix_lens=[40, 35], q_lens=[1, 1], block_tables=tables, page_size=16, device="cpu",
                          detect_shared_prefix=True)
    assert meta.shared_prefix_len == 32
    be.decode(layer, torch.randn(2, 4, 64, dtype=torch.bfloat16), meta, be.prepare(meta))
    assert not be._cascade_wrappers  # request 0's window starts at key 22: no shared page in every window
    plan = next(iter(be._decode_wrappers.values())).plans[-1]
    # Only pages a query can see under the window: keys from position 41 - 20 + 1 = 22 (page 1) onwards.
    assert plan["indices"].tolist() == [2, 3, 2, 4] and plan["window_left"] == 19


@pytest.mark.parametrize("extend", [False, True])
def test_sliding_window_cascade_plans_the_shared_segment_once(monkeypatch, extend):
    """A window of 40 over a 5-page shared prefix (page size 8): pages 2..4 are in every query's window
    (the longest request, 50 tokens, sees keys from 11: page 1 is partly out), the rest of each request is
    its pages from its own window start up to page 2, then its pages after the prefix, window_left 39 - 24."""
    layer = Attention(0, 4, 2, 64, sliding_window=40)
    tables = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7, 8], [1, 2, 3, 4, 5, 9]]
    prefix, q_lens = ([41, 49, 40], [1, 1, 1]) if not extend else ([41, 45, 40], [1, 5, 3])
    be = make_backend(monkeypatch, layer, 12, 8)
    meta = build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=tables, page_size=8, device="cpu",
                          detect_shared_prefix=True)
    assert meta.shared_prefix_len == 40
    q = torch.randn(sum(q_lens), 4, 64, dtype=torch.bfloat16)
    (be.extend if extend else be.decode)(layer, q, meta, be.prepare(meta))
    sig = fi_backend.LayerSignature.of(layer)
    shared = be._cascade_wrappers[sig][0][sig].plans[-1]
    assert shared["paged_kv_indices"].tolist() == [3, 4, 5] and shared["paged_kv_indptr"].tolist() == [0, 3]
    assert shared["causal"] is False and shared["window_left"] == 39
    assert shared["qo_indptr"].tolist() == [0, sum(q_lens)]
    rest_w = be._cascade_extend_rest[sig] if extend else be._cascade_wrappers[sig][1][sig]
    rest = rest_w.plans[-1]
    # window starts of the first queries: keys 2, 10 (extend: 6), 1 -> pages 0, 1 (0), 0
    if extend:
        assert rest["paged_kv_indices"].tolist() == [1, 2, 6, 1, 2, 7, 8, 1, 2, 9]
        assert rest["paged_kv_indptr"].tolist() == [0, 3, 7, 10] and rest["causal"] is True
        assert rest["qo_indptr"].tolist() == [0, 1, 6, 9]
    else:
        assert rest["indices"].tolist() == [1, 2, 6, 2, 7, 8, 1, 2, 9]
        assert rest["indptr"].tolist() == [0, 3, 6, 9]
    assert rest["window_left"] == 39 - 3 * 8
    assert not be._decode_wrappers and not be._prefill_wrappers


@pytest.mark.parametrize("name,cc,page_size,columns", [("trtllm_mha", (9, 0), 16, 6), ("trtllm_mla", (10, 0), 32, 8)])
def test_trtllm_graph_block_table_is_refilled_in_place(monkeypatch, name, cc, page_size, columns):
    """CUDA-graph replays read one static block table: each step's rows land in the same buffer,
    padded with page 0; trtllm_mla's columns are padded to a multiple of 128 tokens."""
    from attnzoo.attention.backends import get_backend_class

    module = sys.modules[get_backend_class(name).__module__]
    fake = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=RecordingWrapper,
                           BatchDecodeWithPagedKVCacheWrapper=RecordingWrapper, merge_state=merge_state)
    for mod in (module, fi_backend):
        monkeypatch.setattr(mod, "load_flashinfer", lambda n: fake)
        monkeypatch.setattr(mod, "compute_capability", lambda n, device: cc)
    layer = Attention(0, 8, 1, 576, v_head_dim=512, kind="mla") if name == "trtllm_mla" else Attention(0, 8, 2, 64)
    pool = KVPool([layer.kv_cache_spec()], num_pages=12, page_size=page_size, dtype=torch.bfloat16, device="cpu")
    be = get_backend_class(name)(pool)
    be.init_graph_state(max_batch_size=4, max_pages_per_req=6)
    tables = [[3, 4], [5], [6, 7, 8]]
    seq = [page_size + 1, 2, 2 * page_size + 3]
    for step in range(2):
        meta = build_metadata(prefix_lens=[s - 1 for s in seq], q_lens=[1] * 3, block_tables=tables,
                              page_size=page_size, device="cpu")
        state = be.prepare_graph(meta, capturing=step == 0)
        assert state.block_table.data_ptr() == be._graph.table.data_ptr()
        assert state.block_table.shape == (3, columns)
        assert state.block_table.tolist() == [row + [0] * (columns - len(row)) for row in tables]
        assert state.max_seq_len == 6 * page_size
        tables, seq = [[9], [10, 11], [3]], [2, page_size + 5, 4]  # the next step: other pages, same buffer
    extend = build_metadata(prefix_lens=[0], q_lens=[3], block_tables=[[1]], page_size=page_size, device="cpu")
    with pytest.raises(BackendError, match="captures decode steps only"):
        be.prepare_graph(extend, capturing=False)


def test_cascade_extend_plans_shared_pages_once_and_the_rest_causal(monkeypatch):
    """An extend step after a cached prefix (a decode row and two prompt chunks): every query over the
    shared pages as one non-causal request, each request's own pages causal through FA2, merged."""
    layer = Attention(0, 8, 2, 64)
    tables = [[3, 4, 5, 9], [3, 4, 5, 10, 11], [3, 4, 5, 12]]  # pages 3, 4, 5 shared (16 tokens each)
    prefix, q_lens = [60, 48, 48], [1, 20, 5]
    be = make_backend(monkeypatch, layer, 16, 16)
    meta = build_metadata(prefix_lens=prefix, q_lens=q_lens, block_tables=tables, page_size=16, device="cpu",
                          detect_shared_prefix=True)
    assert not meta.is_decode and meta.shared_prefix_len == 48
    out = be.extend(layer, torch.randn(26, 8, 64, dtype=torch.bfloat16), meta, be.prepare(meta))
    assert out.shape == (26, 8, 64)

    sig = fi_backend.LayerSignature.of(layer)
    shared_w = be._cascade_wrappers[sig][0][sig]
    shared = shared_w.plans[-1]
    assert shared["qo_indptr"].tolist() == [0, 26] and shared["causal"] is False  # all 26 rows follow the prefix
    assert shared["paged_kv_indptr"].tolist() == [0, 3] and shared["paged_kv_indices"].tolist() == [3, 4, 5]
    assert shared_w.kwargs["backend"] == "fa3"
    rest_w = be._cascade_extend_rest[sig]
    rest = rest_w.plans[-1]
    assert rest_w.kwargs["backend"] == "fa2"
    assert rest["qo_indptr"].tolist() == [0, 1, 21, 26] and rest["causal"] is True
    assert rest["paged_kv_indptr"].tolist() == [0, 1, 3, 4]
    assert rest["paged_kv_indices"].tolist() == [9, 10, 11, 12]
    assert rest["paged_kv_last_page_len"].tolist() == [13, 4, 5]  # 61, 68 and 53 tokens
    assert not be._prefill_wrappers  # the plain prefill wrapper was not needed

    # A request still before the end of the shared pages (here: computing them) leaves the step plain.
    first = build_metadata(prefix_lens=[0, 48], q_lens=[50, 5], block_tables=tables[1:], page_size=16,
                           device="cpu", detect_shared_prefix=True)
    assert first.shared_prefix_len == 0
    be.extend(layer, torch.randn(55, 8, 64, dtype=torch.bfloat16), first, be.prepare(first))
    plain = next(iter(be._prefill_wrappers.values())).plans[-1]
    assert plain["paged_kv_indptr"].tolist() == [0, 4, 8] and plain["causal"] is True


def test_graph_steps_plan_bucket_wrappers_over_shared_static_buffers(monkeypatch):
    """prepare_graph plans the bucket's graph-mode wrappers from the step's padded host lengths (padding
    rows: one token in page 0); buckets share one set of static buffers per signature; a graph step whose
    meta says no shared prefix (the engine's choice) runs plain even where the tables share pages."""
    sliding, glob = Attention(0, 4, 2, 64, sliding_window=20), Attention(1, 4, 2, 64)
    be = make_backend(monkeypatch, [sliding, glob], 16, 16)
    be.init_graph_state(max_batch_size=4, max_pages_per_req=6)
    tables = [[3, 4, 5, 9], [3, 4, 5, 10, 11]]
    wrappers = {}
    for bucket in (4, 2):
        rows = tables + [[0]] * (bucket - 2)
        meta = build_metadata(prefix_lens=[50, 70] + [0] * (bucket - 2), q_lens=[1] * bucket, block_tables=rows,
                              page_size=16, device="cpu", mode=fi_backend.ForwardMode.DECODE)
        plan = be.prepare_graph(meta, capturing=bucket == 4)
        for layer in (sliding, glob):
            be.decode(layer, torch.randn(bucket, 4, 64, dtype=torch.bfloat16), meta, plan)
        assert not be._cascade_wrappers and not be._decode_wrappers  # plain, and only graph-mode wrappers
        wrappers[bucket] = be._graph.decode(bucket)
        for sig, w in wrappers[bucket].items():
            assert w.kwargs["use_cuda_graph"] is True
            assert w.kwargs["paged_kv_indptr_buffer"].shape == (bucket + 1,)
            assert w.kwargs["paged_kv_last_page_len_buffer"].shape == (bucket,)
            plan = w.plans[-1]
            assert plan["last_page_len"].tolist() == [3, 7] + [1] * (bucket - 2)
            if sig.window:  # keys from 50 - 20 + 1 = 31 and 51: pages 1.. and 3..
                assert plan["indices"].tolist() == [4, 5, 9, 10, 11] + [0] * (bucket - 2)
                assert plan["window_left"] == 19
            else:
                assert plan["indices"].tolist() == [3, 4, 5, 9, 3, 4, 5, 10, 11] + [0] * (bucket - 2)
    for sig in wrappers[4]:
        a, b = wrappers[4][sig], wrappers[2][sig]
        assert a is not b and a.int_workspace is b.int_workspace
        assert a.kwargs["paged_kv_indices_buffer"].data_ptr() == b.kwargs["paged_kv_indices_buffer"].data_ptr()


def test_fp8_pool_plans_fp8_kv_and_runs_with_the_pool_scales(monkeypatch):
    """fp8 KV: every wrapper (the cascade's shared and rest ones too) is planned with kv_data_type
    float8_e4m3fn and bf16 queries, and run with the pool's k_scale/v_scale (FlashInfer's run() keywords)."""
    layer = Attention(0, 8, 2, 64)
    fake = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=RecordingWrapper,
                           BatchDecodeWithPagedKVCacheWrapper=RecordingWrapper, merge_state=merge_state)
    monkeypatch.setattr(fi_backend, "load_flashinfer", lambda name: fake)
    monkeypatch.setattr(fi_backend, "compute_capability", lambda name, device: (9, 0))
    pool = KVPool([layer.kv_cache_spec()], num_pages=16, page_size=16, dtype=torch.bfloat16, device="cpu",
                  kv_cache_dtype="fp8_e4m3", k_scale=0.5, v_scale=2.0)
    with pytest.raises(BackendError, match="fp8 KV cache"):
        fi_backend.FlashInferBackend(pool, decode_variant="fa3")
    be = fi_backend.FlashInferBackend(pool)
    tables = [[3, 4, 5, 9], [3, 4, 5, 10, 11], [3, 4, 5, 12]]
    meta = build_metadata(prefix_lens=[49, 69, 48], q_lens=[1, 1, 1], block_tables=tables, page_size=16,
                          device="cpu", detect_shared_prefix=True)
    be.decode(layer, torch.randn(3, 8, 64, dtype=torch.bfloat16), meta, be.prepare(meta))
    shared, rest = (next(iter(d.values())) for d in be._cascade_wrappers[fi_backend.LayerSignature.of(layer)])
    for w in (shared, rest):
        assert w.plans[-1]["kv_data_type"] == torch.float8_e4m3fn and w.plans[-1]["q_data_type"] == torch.bfloat16
        assert w.scales == {"k_scale": 0.5, "v_scale": 2.0}
    assert be.prefill_kernel(64, 64) == "fa2"  # FA3 prefill takes fp8 KV only with fp8 queries


def test_cascade_graph_step_plans_graph_wrappers_with_the_rounded_split(monkeypatch):
    """A cascade graph's step (bucket 4: three requests and a padding row one token after the 10-page shared
    prefix, page size 4): the shared part through a graph-mode prefill wrapper over its own 2-entry buffers
    and int workspace, all four queries as one request; the rest through a graph-mode decode wrapper per
    (bucket, window_left) over the signature's plain buffers. The sliding layer (window 64: gap rounded to
    2 pages) reads pages 4..9 once, not the exact split's 3..9; its key names that window_left."""
    sliding, glob = Attention(0, 4, 2, 64, sliding_window=64), Attention(1, 4, 2, 64)
    be = make_backend(monkeypatch, [sliding, glob], 32, 4)
    be.init_graph_state(max_batch_size=4, max_pages_per_req=20)
    shared = list(range(1, 11))
    tables = [shared + list(range(11, 19)), shared + list(range(19, 28)), shared + [28, 29, 30]]
    seq = [70, 75, 50]
    rows = tables + [shared + [0]]  # the padding row, as DecodeGraphs fills it
    meta = build_metadata(prefix_lens=[s - 1 for s in seq] + [40], q_lens=[1] * 4, block_tables=rows, page_size=4,
                          device="cpu", mode=fi_backend.ForwardMode.DECODE)
    meta.shared_prefix_len = 40
    assert be.cascade_graph_key(meta) == ()  # no layer has run yet: no window known
    plan = be.prepare_graph(meta, capturing=True)
    for layer in (sliding, glob):
        be.decode(layer, torch.randn(4, 4, 64, dtype=torch.bfloat16), meta, plan)
    # longest request 75: keys from 11 on, page 3 (exact gap 7 pages); rounded to 6: pages 4..9, window_left 63 - 24
    assert be.cascade_graph_key(meta) == ((64, 39),)
    assert not be._cascade_wrappers and not be._decode_wrappers and not be._prefill_wrappers  # graph-mode only
    sig_s, sig_g = fi_backend.LayerSignature.of(sliding), fi_backend.LayerSignature.of(glob)
    shared_w = be._graph.prefill((4, "shared"))
    for sig, first in ((sig_s, 4), (sig_g, 0)):
        w = shared_w[sig]
        assert w.kwargs["use_cuda_graph"] is True and w.kwargs["qo_indptr_buf"].shape == (2,)
        assert w.kwargs["float_workspace_buffer"] is fi_backend.workspace(torch.device("cpu"), "cascade_shared")
        assert w.kwargs["paged_kv_indices_buf"].shape == (20,)
        p = w.plans[-1]
        assert p["qo_indptr"].tolist() == [0, 4] and p["causal"] is False and "disable_split_kv" not in p
        assert p["paged_kv_indices"].tolist() == shared[first:] and p["paged_kv_indptr"].tolist() == [0, 10 - first]
    rest_s, rest_g = be._graph.decode((4, "rest", 39))[sig_s], be._graph.decode((4, "rest", -1))[sig_g]
    starts = [max(0, s - 64) // 4 for s in seq] + [0]  # each request's first page in its window
    ends = [-(-s // 4) for s in seq] + [11]
    for w, sig, lo, wl in ((rest_s, sig_s, starts, 39), (rest_g, sig_g, [0] * 4, -1)):
        assert w.kwargs["use_cuda_graph"] is True
        assert w.kwargs["paged_kv_indices_buffer"].data_ptr() == be._graph._of(sig)["kv_indices"].data_ptr()
        assert w.int_workspace is be._graph._of(sig)["int_workspace"]
        assert w.int_workspace is not shared_w[sig].int_workspace
        p = w.plans[-1]
        cut = 4 if sig.window else 0  # the shared segment's start
        want = [page for row, a, b in zip(rows, lo, ends) for page in row[a:cut] + row[10:b]]
        assert p["indices"].tolist() == want and p["window_left"] == wl
        assert p["last_page_len"].tolist() == [2, 3, 2, 1]
    # A shared part of many rows (bucket 1024, Gemma 4's d512 global shape) plans without splitting the KV.
    big = Attention(0, 32, 4, 512)
    be2 = make_backend(monkeypatch, big, 8, 16)
    be2.init_graph_state(max_batch_size=1024, max_pages_per_req=4)
    meta = build_metadata(prefix_lens=[17] * 1024, q_lens=[1] * 1024, block_tables=[[1, 2]] * 1024, page_size=16,
                          device="cpu", detect_shared_prefix=True)
    assert meta.shared_prefix_len == 16
    be2.decode(big, torch.randn(1024, 32, 512, dtype=torch.bfloat16), meta, be2.prepare_graph(meta, capturing=True))
    assert be2._graph.prefill((1024, "shared"))[fi_backend.LayerSignature.of(big)].plans[-1]["disable_split_kv"] is True
