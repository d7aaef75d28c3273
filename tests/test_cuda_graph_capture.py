"""DecodeGraphs' capture and replay metadata, on CPU with torch.cuda's graph calls replaced by no-ops.

The contract (attention/backends/base.py): the meta a backend sees under prepare_graph holds the static
device buffers and host lists padded to the bucket; here we check that the two agree at capture and at
replay, since backends size page lists from the host lists and fill them from the device tensors.
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from attnzoo.attention.backends.base import StepPlan
from attnzoo.attention.backends.hybrid import HybridBackend
from attnzoo.attention.backends.torch_ref import TorchBackend
from attnzoo.attention.metadata import build_metadata
from attnzoo.engine import cuda_graph


class _Stream:
    def wait_stream(self, other):
        pass


class _Graph:
    def replay(self):
        pass


def _no_cuda_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


class RecordingBackend:
    supports_cascade_graph = False

    def __init__(self):
        self.seen = []

    def init_graph_state(self, max_batch_size, max_pages_per_req):
        self.sizes = (max_batch_size, max_pages_per_req)

    def prepare_graph(self, meta, capturing):
        self.seen.append((capturing, meta.num_reqs, meta.seq_lens.tolist(), list(meta.seq_lens_cpu),
                          meta.block_tables.shape))
        return StepPlan()


class TinyModel:
    def __call__(self, ids, positions, ctx):
        return torch.zeros(ids.shape[0], 4)


def test_capture_and_replay_device_lengths_match_the_host_lists(monkeypatch):
    _no_cuda_graphs(monkeypatch)
    pool = SimpleNamespace(device=torch.device("cpu"), page_size=16, has_window_group=False)
    backend = RecordingBackend()
    graphs = cuda_graph.DecodeGraphs(TinyModel(), pool, HybridBackend(backend, backend), max_batch=4, max_context=40, buckets=(1, 2))
    assert backend.sizes == (4, 3) and graphs.max_context == 48
    captured = [s for s in backend.seen if s[0]]
    assert [s[1] for s in captured] == [4, 2, 1]  # largest bucket first
    for _, bs, dev, host, table in captured:
        assert dev == host == [48] * bs and table == (bs, 3)  # every row at the longest context, in page 0
    backend.seen.clear()
    meta = build_metadata(prefix_lens=[20, 33, 5], q_lens=[1, 1, 1], block_tables=[[5, 6], [7, 8, 9], [4]],
                          page_size=16, device="cpu")
    hidden = graphs.replay(torch.tensor([1, 2, 3]), meta)
    assert hidden.shape == (3, 4)
    (capturing, bs, dev, host, _), = backend.seen
    assert not capturing and bs == 4
    assert dev == host == [21, 34, 6, 1]  # padding row: one token in page 0
    assert graphs.block_tables[:4].tolist() == [[5, 6, 0], [7, 8, 9], [4, 0, 0], [0, 0, 0]]


def test_nsa_step_cache_is_recomputed_inside_the_capture(monkeypatch):
    """The NSA matrices shared by a step's layers live on its plan (NSAPlan.shared). DecodeGraphs hands
    the warm-up and the capture of a bucket the same plan: what the warm-up cached must be made again
    inside the capture (recorded in the graph), then reused by the capture's other layers."""
    from attnzoo.attention.backends.base import NSAPlan
    from attnzoo.attention.reference import _step_cached

    _no_cuda_graphs(monkeypatch)
    capturing = [False]

    @contextlib.contextmanager
    def graph(g, pool=None):
        capturing[0] = True
        yield
        capturing[0] = False

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    on_gpu = SimpleNamespace(positions=SimpleNamespace(is_cuda=True))  # _step_cached reads only this
    made, seen = [], []

    class NSARecording(RecordingBackend):
        def prepare_graph(self, meta, capturing):
            super().prepare_graph(meta, capturing)
            return NSAPlan()

    class TwoLayers:
        def __call__(self, ids, positions, ctx):
            for _ in range(2):
                t = _step_cached(on_gpu, ctx.plan.shared, "visible",
                                 lambda: made.append((ids.shape[0], capturing[0])) or torch.zeros(ids.shape[0]))
                seen.append((id(ctx.plan), capturing[0], id(t)))
            return torch.zeros(ids.shape[0], 4)

    pool = SimpleNamespace(device=torch.device("cpu"), page_size=16, has_window_group=False)
    backend = NSARecording()
    cuda_graph.DecodeGraphs(TwoLayers(), pool, HybridBackend(backend, backend), max_batch=2, max_context=16,
                            buckets=(1,))
    # per bucket (2 then 1): made once in the warm-up, once more inside the capture
    assert made == [(2, False), (2, True), (1, False), (1, True)]
    for bucket in (seen[:4], seen[4:]):
        assert len({plan for plan, _, _ in bucket}) == 1  # warm-up and capture share the bucket's plan
        warm, capture = bucket[:2], bucket[2:]
        assert warm[0][2] == warm[1][2] and capture[0][2] == capture[1][2] and warm[0][2] != capture[0][2]
    assert seen[0][0] != seen[4][0]  # each bucket its own plan


class CascadeRecording(RecordingBackend):
    """Declares cascade graphs; its key: the longest request's page count (a stand-in for a window_left)."""

    supports_cascade_graph = True

    def prepare_graph(self, meta, capturing):
        self.seen.append((capturing, meta.num_reqs, meta.seq_lens.tolist(), list(meta.seq_lens_cpu),
                          meta.shared_prefix_len, meta.block_tables.tolist(), meta.positions.tolist()))
        return StepPlan()

    def cascade_graph_key(self, meta):
        return -(-max(meta.seq_lens_cpu) // meta.page_size)


def _counted_graphs(monkeypatch) -> list:
    """No CUDA graphs, and the list of the stand-in graphs made, each counting its replays."""
    _no_cuda_graphs(monkeypatch)
    made = []

    class Graph(_Graph):
        def __init__(self):
            made.append(self)
            self.replays = 0

        def replay(self):
            self.replays += 1

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    return made


def test_cascade_graphs_are_captured_lazily_per_key_up_to_the_cap(monkeypatch):
    made = _counted_graphs(monkeypatch)
    pool = SimpleNamespace(device=torch.device("cpu"), page_size=16, has_window_group=False)
    backend = CascadeRecording()
    graphs = cuda_graph.DecodeGraphs(TinyModel(), pool, HybridBackend(backend, backend), max_batch=4, max_context=64,
                                     buckets=(1, 2), max_on_demand_graphs=2, capture_after=1)
    assert len(made) == 3 and not graphs.on_demand  # the plain buckets 4, 2, 1; no cascade graph yet
    backend.seen.clear()

    def step(seq, shared=32):
        tables = [[5, 6] + list(range(10 + 4 * i, 10 + 4 * i + (-(-s // 16) - 2))) for i, s in enumerate(seq)]
        meta = build_metadata(prefix_lens=[s - 1 for s in seq], q_lens=[1] * len(seq), block_tables=tables,
                              page_size=16, device="cpu", detect_shared_prefix=True)
        assert meta.shared_prefix_len == shared
        return meta

    meta = step([40, 50, 35])
    assert graphs.cascade_ready(meta) is True
    assert graphs.replay(torch.tensor([1, 2, 3]), meta).shape == (3, 4)
    assert len(made) == 4 and list(graphs.on_demand) == [(4, 4)] and made[-1].replays == 1
    (capturing, bs, dev, host, shared, table, positions), = backend.seen
    assert capturing and bs == 4 and shared == 32
    assert dev == host == [40, 50, 35, 33]  # padding row: one token after the 2 shared pages
    assert table[3] == [5, 6, 0, 0] and positions[3] == 32  # its pages: the prefix's, then page 0
    # the same key replays what was captured; another key is captured; past the cap, none is
    graphs.replay(torch.tensor([1, 2, 3]), step([41, 51, 36]))
    assert len(made) == 4 and made[-1].replays == 2 and backend.seen[-1][0] is False
    graphs.replay(torch.tensor([1, 2]), step([60, 45]))
    assert len(made) == 5 and set(graphs.on_demand) == {(4, 4), (2, 4)}
    assert graphs.on_demand_hidden[(2, 4)] is not graphs.on_demand_hidden[(4, 4)]
    assert graphs.cascade_ready(step([64, 45])) is True  # (2, 4): captured
    assert graphs.cascade_ready(step([40, 50, 35, 62])) is True  # (4, 4)
    assert graphs.cascade_ready(step([20, 45], shared=16)) is False  # (2, 3): over the cap
    assert graphs.cascade_ready(step([64, 45, 60, 61, 62], shared=32)) is None  # 5 requests: no bucket
    plain = build_metadata(prefix_lens=[20, 30], q_lens=[1, 1], block_tables=[[1, 2], [3, 4]], page_size=16,
                           device="cpu")
    assert graphs.cascade_ready(plain) is None
    graphs.replay(torch.tensor([1, 2]), plain)  # a plain step afterwards: padding rows back to page 0
    assert graphs.seq_lens[:2].tolist() == [21, 31] and graphs.block_tables[1, :2].tolist() == [3, 4]
    assert graphs.block_tables[3].tolist() == [5, 6, 0, 0]  # bucket 4's padding row, from the cascade steps
    graphs.replay(torch.tensor([1, 2, 3]), build_metadata(prefix_lens=[20, 30, 5], q_lens=[1, 1, 1],
                                                          block_tables=[[1, 2], [3, 4], [7]], page_size=16, device="cpu"))
    assert graphs.seq_lens.tolist() == [21, 31, 6, 1] and graphs.block_tables[3].tolist() == [0, 0, 0, 0]
    assert graphs.positions[3].item() == 0 and graphs.prefix_lens[3].item() == 0
    no = RecordingBackend()
    assert cuda_graph.DecodeGraphs(TinyModel(), pool, HybridBackend(no, no), max_batch=2, max_context=64,
                                   buckets=(1,)).cascade_ready(meta) is None  # the backend has no cascade graphs


def test_a_cascade_graph_is_captured_once_its_key_was_asked_for_capture_after_steps_in_a_row(monkeypatch):
    _no_cuda_graphs(monkeypatch)
    pool = SimpleNamespace(device=torch.device("cpu"), page_size=16, has_window_group=False)
    backend = CascadeRecording()
    graphs = cuda_graph.DecodeGraphs(TinyModel(), pool, HybridBackend(backend, backend), max_batch=4, max_context=64,
                                     buckets=(1, 2), capture_after=2)

    def step(seq):
        tables = [[5, 6] + list(range(10 + 4 * i, 10 + 4 * i + (-(-s // 16) - 2))) for i, s in enumerate(seq)]
        return build_metadata(prefix_lens=[s - 1 for s in seq], q_lens=[1] * len(seq), block_tables=tables,
                              page_size=16, device="cpu", detect_shared_prefix=True)

    assert graphs.cascade_ready(step([40, 50, 35])) is False  # (4, 4): first ask, not at the cap
    assert not graphs.at_cap
    assert graphs.cascade_ready(step([60, 45])) is False  # (2, 4): another key breaks the streak
    assert graphs.cascade_ready(step([41, 51, 36])) is False  # (4, 4) again, but not twice in a row
    meta = step([42, 52, 37])
    assert graphs.cascade_ready(meta) is True  # second step in a row: captured by this replay
    graphs.replay(torch.tensor([1, 2, 3]), meta)
    assert list(graphs.on_demand) == [(4, 4)] and graphs.capture_s >= 0
    assert graphs.cascade_ready(step([61, 46])) is False  # (2, 4) first ask in a row
    assert graphs.cascade_ready(step([43, 53, 38])) is True  # captured keys replay at once


def test_a_batch_above_exact_from_that_keeps_its_size_gets_a_graph_of_that_size(monkeypatch):
    """Plain steps: up to ``exact_from`` rows, and at a bucket's size, the bucket's graph; above it, a batch
    replays its bucket's graph (padded) until it kept its size (rounded up to a multiple of 8) ``capture_after``
    steps, then one of that size, captured then, which nearby sizes share; under the cap on graphs captured on
    demand; a size prune_buckets dropped takes the bucket it pads to."""
    made = _counted_graphs(monkeypatch)
    pool = SimpleNamespace(device=torch.device("cpu"), page_size=16, has_window_group=False)
    backend = RecordingBackend()
    graphs = cuda_graph.DecodeGraphs(TinyModel(), pool, HybridBackend(backend, backend), max_batch=32, max_context=64,
                                     buckets=(1, 2, 4, 8), max_on_demand_graphs=1, capture_after=2, exact_from=4)
    assert graphs.buckets == [1, 2, 4, 8, 32] and len(made) == 5
    backend.seen.clear()

    def step(n):
        return build_metadata(prefix_lens=[20 + i % 10 for i in range(n)], q_lens=[1] * n,
                              block_tables=[[40 + 2 * i, 41 + 2 * i] for i in range(n)], page_size=16, device="cpu")

    def replay(n):
        assert graphs.replay(torch.arange(n), step(n)).shape == (n, 4)
        capturing, rows, dev, host, _ = backend.seen[-1]
        return capturing, rows, len(dev) - n

    assert replay(12) == (False, 32, 20) and made[0].replays == 1  # first 12-row step: bucket 32, 20 padding rows
    assert replay(12) == (True, 16, 4) and len(made) == 6 and made[-1].replays == 1  # second: a graph of 16 rows
    assert list(graphs.on_demand) == [(16, None)] and graphs.on_demand_hidden[(16, None)].shape == (16, 4)
    assert replay(14) == (False, 16, 2) and made[-1].replays == 2  # 14 rows: the same graph, refilled
    assert replay(3) == (False, 4, 1)  # up to exact_from: the bucket
    assert replay(8) == (False, 8, 0)  # a bucket's size: the bucket's own graph, no streak needed
    assert replay(20) == (False, 32, 12) and replay(20) == (False, 32, 12)  # past the cap: the bucket, padded
    assert len(made) == 6 and graphs.at_cap
    graphs.pruned = {24: 32}  # as if prune_buckets had dropped 24 for 32: that size takes bucket 32's graph
    assert graphs.graph_key(step(21)) == (32, None)


def test_graphs_captured_while_generating_stay_within_their_bytes(monkeypatch):
    """The outputs of on-demand graphs ([rows, hidden] each) are capped in bytes as well as in number: a size whose
    output would pass the budget replays its bucket, while a smaller one still fits and gets its graph."""
    made = _counted_graphs(monkeypatch)
    pool = SimpleNamespace(device=torch.device("cpu"), page_size=16, has_window_group=False)
    backend = RecordingBackend()
    row = 4 * torch.empty(0).element_size()  # TinyModel's hidden of 4, float32
    graphs = cuda_graph.DecodeGraphs(TinyModel(), pool, HybridBackend(backend, backend), max_batch=64, max_context=64,
                                     buckets=(1, 2, 4, 8), capture_after=1, exact_from=4, max_on_demand_bytes=30 * row)
    assert graphs.row_bytes == row

    def step(n):
        return build_metadata(prefix_lens=[20] * n, q_lens=[1] * n,
                              block_tables=[[40 + 2 * i, 41 + 2 * i] for i in range(n)], page_size=16, device="cpu")

    graphs.replay(torch.arange(12), step(12))  # a 16-row graph: 16 rows of the 30 budgeted
    assert list(graphs.on_demand) == [(16, None)] and graphs.on_demand_bytes == 16 * row
    n_made = len(made)
    graphs.replay(torch.arange(20), step(20))  # 24 rows would pass 30: bucket 64, nothing captured
    assert len(made) == n_made and list(graphs.on_demand) == [(16, None)] and graphs.at_cap
    graphs.replay(torch.arange(6), step(6))  # rounds to 8, a bucket's size: the bucket's own graph
    graphs.replay(torch.arange(9), step(9))  # 9 -> 16: already captured, replayed
    assert len(made) == n_made and graphs.room_for(14) and not graphs.room_for(15)


def test_cascade_asks_leave_the_plain_streak_alone(monkeypatch):
    """Tensor-parallel ranks stage the same plain steps but only the leader asks ``cascade_ready``: a cascade
    ask between two plain steps of one size must not decide differently on the leader (no padding there)."""
    _no_cuda_graphs(monkeypatch)
    pool = SimpleNamespace(device=torch.device("cpu"), page_size=16, has_window_group=False)
    backend = CascadeRecording()
    graphs = cuda_graph.DecodeGraphs(TinyModel(), pool, HybridBackend(backend, backend), max_batch=32, max_context=64,
                                     buckets=(1, 2, 4, 8), capture_after=2, exact_from=4)
    plain = build_metadata(prefix_lens=[20 + i for i in range(12)], q_lens=[1] * 12,
                           block_tables=[[40 + 2 * i, 41 + 2 * i] for i in range(12)], page_size=16, device="cpu")
    shared = build_metadata(prefix_lens=[40, 45, 35], q_lens=[1] * 3, block_tables=[[5, 6, 10], [5, 6, 11], [5, 6, 12]],
                            page_size=16, device="cpu", detect_shared_prefix=True)
    graphs.replay(torch.arange(12), plain)  # first plain step of 12 rows: the bucket
    assert graphs.cascade_ready(shared) is False  # the leader's ask, between the two
    graphs.replay(torch.arange(12), plain)
    assert (16, None) in graphs.on_demand and backend.seen[-1][1] == 16  # the second plain step: its own graph


def test_cuda_graph_batch_sizes_default_pads_at_most_an_eighth_from_64():
    b = cuda_graph.DEFAULT_BUCKETS
    assert b[:4] == (1, 2, 4, 8) and b[-1] == 4096 and list(b) == sorted(set(b))
    for n in range(64, 4097):
        assert (next(x for x in b if x >= n) - n) / n <= 0.125, n
    assert 248 in b and 1408 in b  # Gemma's 239-request batch, Llama's 1319-request wave (GSM8K workload)


class GraphTorch(TorchBackend):
    """The torch reference as a graph-capable decode backend: its plan notes the meta it was handed."""

    def init_graph_state(self, max_batch_size, max_pages_per_req):
        pass

    def prepare_graph(self, meta, capturing):
        self.step_meta = meta
        return StepPlan()


def _rerun_graphs(monkeypatch) -> None:
    """Graphs whose replay runs the step again over the static buffers and the (padded) metadata the decode
    backend (a GraphTorch) was last handed: the engine's choices with the numbers of a real forward."""
    _no_cuda_graphs(monkeypatch)

    def capture(self, meta, plan):
        hidden = self._run(meta, plan)
        backend = self.backends.decode_backend
        return SimpleNamespace(replay=lambda: hidden.copy_(self._run(backend.step_meta, plan))), hidden

    monkeypatch.setattr(cuda_graph.DecodeGraphs, "_capture", capture)


def test_engine_replays_cascade_graphs_where_they_pay_and_counts_them(monkeypatch, tmp_path):
    """The engine's choice on CPU: a decode backend declaring cascade graphs (the torch reference, which
    reads every request's pages whatever the shared prefix: its numbers cannot change with the choice;
    its key: the rounded split of a window of 16) under graphs whose replay runs the step again over the
    static buffers and the padded metadata the backend was handed (padding rows included). Greedy tokens
    equal a run without graphs; steps saving enough replay cascade graphs, the others plain ones; keys past
    the cap run as plain graphs, or eagerly with cascade where that pays by the eager threshold."""
    import attnzoo
    from attnzoo.attention.backends.fi_common import cascade_graph_key
    from helpers import random_prompts, save_checkpoint
    from test_llama import tiny_llama

    _rerun_graphs(monkeypatch)

    class CascadeGraphTorch(GraphTorch):
        supports_cascade_graph = True

        def cascade_graph_key(self, meta):
            return cascade_graph_key(meta.seq_lens_cpu, meta.q_lens_cpu, meta.shared_prefix_len // meta.page_size,
                                     meta.page_size, [16])

    path = save_checkpoint(tiny_llama(kv_heads=2, heads=4), tmp_path / "llama")
    prefix = random_prompts(160, [24], seed=3)[0]  # 6 pages of 4
    prompts = [prefix + p for p in random_prompts(160, [2, 5, 3, 7, 1], seed=4)]
    kw = dict(backend="torch", dtype="float32", page_size=4, max_running=3)
    want = [c.token_ids for c in attnzoo.load_model(path, **kw).generate(prompts, max_new_tokens=8, ignore_eos=True)]
    llm = attnzoo.load_model(path, **kw)
    e = llm.engine
    e.backends.decode_backend, e.cascade = CascadeGraphTorch(llm.pool), True
    e.graphs = cuda_graph.DecodeGraphs(e.model, e.pool, e.backends, max_batch=4, max_context=64, buckets=(1, 2),
                                       max_on_demand_graphs=1, capture_after=1)
    e.cascade_graph_min_saved_tokens, e.cascade_min_saved_tokens = 48, 10**9  # 24 shared x 2 others; eager never
    e.step_log = []
    assert [c.token_ids for c in llm.generate(prompts, max_new_tokens=8, ignore_eos=True)] == want
    stats = dict(e.graph_stats)
    decode = [s for s in e.step_log if s["new_tokens"] == s["num_reqs"]]
    three = [s for s in decode if s["num_reqs"] == 3]
    assert three and all(s["shared_prefix_len"] == 24 for s in three[:stats["cascade_replayed"]])
    assert len(e.graphs.on_demand) == 1 and stats["cascade_over_cap"] > 0 and stats["cascade"] == 0
    assert stats["cascade_replayed"] + stats["cascade_over_cap"] == len(three)  # every 3-request step asked
    assert stats["replayed"] == len(decode) - stats["cascade_replayed"]  # the rest: plain graphs
    # Where the eager threshold says so, the steps past the cap cascade eagerly instead.
    e.cascade_min_saved_tokens = 48
    e.graph_stats = dict.fromkeys(e.graph_stats, 0)
    assert [c.token_ids for c in llm.generate(prompts, max_new_tokens=8, ignore_eos=True)] == want
    assert e.graph_stats["cascade"] == e.graph_stats["cascade_over_cap"] > 0 and e.graph_stats["cascade_replayed"] > 0


def test_engine_replays_exact_size_graphs_with_the_tokens_of_no_graphs(monkeypatch, tmp_path):
    """Above exact_from the engine's plain decode steps replay their bucket's graph, then, once the batch kept
    its size, a graph of that size (no padding rows): the greedy tokens of a run without graphs."""
    import attnzoo
    from helpers import random_prompts, save_checkpoint
    from test_llama import tiny_llama

    _rerun_graphs(monkeypatch)
    path = save_checkpoint(tiny_llama(kv_heads=2, heads=4), tmp_path / "llama")
    prompts = random_prompts(160, [3, 9, 5, 7, 4, 6, 8, 2, 5, 3], seed=5)
    kw = dict(backend="torch", dtype="float32", page_size=4, max_running=16, cascade=False)
    want = [c.token_ids for c in attnzoo.load_model(path, **kw).generate(prompts, max_new_tokens=10, ignore_eos=True)]
    llm = attnzoo.load_model(path, **kw)
    e = llm.engine
    e.backends.decode_backend = GraphTorch(llm.pool)
    e.graphs = cuda_graph.DecodeGraphs(e.model, e.pool, e.backends, max_batch=32, max_context=64,
                                       buckets=(1, 2, 4, 8), capture_after=2, exact_from=4)
    assert [c.token_ids for c in llm.generate(prompts, max_new_tokens=10, ignore_eos=True)] == want
    assert list(e.graphs.on_demand) == [(16, None)] and e.graph_stats["replayed"] >= 9  # 10 rows in a graph of 16


def test_window_group_tables_are_static_buffers_refilled_per_replay(monkeypatch):
    """A pool with a window page group: the capture's metadata carries that group's table and slots as
    static buffers, and a replay copies the step's (released columns 0) and zeroes the padding rows."""
    _no_cuda_graphs(monkeypatch)
    pool = SimpleNamespace(device=torch.device("cpu"), page_size=4, has_window_group=True)
    seen = []

    class Recording(RecordingBackend):
        def prepare_graph(self, meta, capturing):
            seen.append((meta.window_block_tables, meta.window_slot_mapping))
            return StepPlan()

    backend = Recording()
    graphs = cuda_graph.DecodeGraphs(TinyModel(), pool, HybridBackend(backend, backend), max_batch=2, max_context=16,
                                     buckets=(2,))
    assert seen[0][0].data_ptr() == graphs.window_tables.data_ptr() and seen[0][1].data_ptr() == graphs.window_slots.data_ptr()
    graphs.window_tables.fill_(7)
    meta = build_metadata(prefix_lens=[9], q_lens=[1], block_tables=[[1, 2, 3]], page_size=4, device="cpu",
                          window_block_tables=[[0, 5, 6]])
    graphs.replay(torch.tensor([1]), meta)
    assert graphs.window_tables.tolist() == [[0, 5, 6, 7], [0, 0, 0, 0]]  # past the step's width: unread
    assert graphs.window_slots.tolist() == [6 * 4 + 1, 0] and graphs.slots.tolist() == [3 * 4 + 1, 0]


def test_buckets_whose_gemms_measured_slower_than_the_next_kept_one_are_dropped():
    # Gemma-4-31B's decode GEMMs per layer on an H200 (us, from cuBLAS): 240 rows ran slower than 248
    cost = {224: 367, 240: 442, 248: 377, 256: 393, 288: 430}
    assert cuda_graph.choose_buckets(cost) == ([224, 248, 256, 288], {240: 248})
    # near ties (within the 3% margin) keep the smaller bucket; the largest always stays
    assert cuda_graph.choose_buckets({8: 10.2, 16: 10.0, 24: 10.1}) == ([8, 16, 24], {})
    # a step pads by one bucket at most: 2 is not dropped for 8 (4, next up, was dropped itself)
    assert cuda_graph.choose_buckets({1: 3.0, 2: 9.0, 4: 8.0, 8: 4.0}) == ([1, 2, 8], {4: 8})
    # DeepSeek-V2-Lite's few dense GEMMs on an H200 (launch-bound): a faster 768 must not take 248..704 along
    assert cuda_graph.choose_buckets({640: 50.0, 704: 52.0, 768: 48.0})[1] == {704: 768}


def test_gemm_shapes_counts_the_dense_linears_a_decode_graph_runs():
    from attnzoo.layers import skinny
    from attnzoo.layers.parallel import Linear, ParallelLMHead

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.ModuleList(torch.nn.Linear(8, 16, bias=False, dtype=torch.bfloat16) for _ in range(3))
            self.b = torch.nn.Linear(16, 8, bias=False, dtype=torch.bfloat16)
            self.f32 = torch.nn.Linear(16, 8, bias=False)  # float32: not a decode GEMM of a bf16 model here
            self.lm_head = ParallelLMHead(8, 32).to(torch.bfloat16)

    m = M()
    shapes = cuda_graph.gemm_shapes(m)
    assert cuda_graph.gemm_share(m, shapes) == (3 * 128 + 128) / (3 * 128 + 128 + 128)  # lm_head aside
    assert {k: c for k, (w, c, _) in shapes.items()} == {(16, 8, torch.bfloat16): 3, (8, 16, torch.bfloat16): 1}
    assert shapes[(8, 16, torch.bfloat16)][0] is m.b.weight
    assert shapes[(8, 16, torch.bfloat16)][2] is torch.nn.functional.linear  # a plain nn.Linear: cuBLAS
    m.b = Linear(16, 8, bias=False, dtype=torch.bfloat16)
    assert cuda_graph.gemm_shapes(m)[(8, 16, torch.bfloat16)][2] is skinny.linear
    assert cuda_graph.prune_buckets(shapes, [1, 2], torch.device("cpu")) == ([1, 2], {})  # measured on GPUs only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_prune_times_the_gemms_as_a_graph_replays_them():
    """Timed from graph replays, a bucket's cost repeats within the margin, and two rows of Llama's projections
    (the same weights, read by the same skinny kernel) are not cheaper than one: batch-1 steps keep their own
    bucket. Timed eagerly, the launches' noise dropped bucket 1 for 2 on some runs."""
    from attnzoo.layers import skinny

    dev = torch.device("cuda")
    shapes = {(n, k, torch.bfloat16): (torch.randn(n, k, device=dev, dtype=torch.bfloat16), 4, skinny.linear)
              for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))}
    one, again, two = (cuda_graph._graph_cost(shapes, rows, dev, reps=5, rounds=3) for rows in (1, 1, 2))
    assert abs(one - again) < cuda_graph.PRUNE_MARGIN * one, (one, again)
    assert two > (1 - cuda_graph.PRUNE_MARGIN) * one, (one, two)
    kept, dropped = cuda_graph.prune_buckets(shapes, [1, 2, 4], dev)
    assert 1 in kept and 1 not in dropped, (kept, dropped)
    # 32 rows take cuBLAS (F.linear) under the capture; a capture that recorded nothing would cost ~0 instead of
    # at least the weights' bytes at an L2-fast 20 TB/s
    cublas = {key: (w, count, torch.nn.functional.linear) for key, (w, count, _) in shapes.items()}
    weight_bytes = sum(w.numel() * w.element_size() * count for w, count, _ in shapes.values())
    for table, rows in ((shapes, 1), (cublas, 32)):
        assert cuda_graph._graph_cost(table, rows, dev, reps=5, rounds=3) * 1e-3 > weight_bytes / 20e12, rows
