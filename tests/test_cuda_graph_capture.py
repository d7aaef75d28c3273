"""DecodeGraphs' capture and replay metadata, on CPU with torch.cuda's graph calls replaced by no-ops.

The contract (attention/backends/base.py): the meta a backend sees under prepare_graph holds the static
device buffers and host lists padded to the bucket; here we check that the two agree at capture and at
replay, since backends size page lists from the host lists and fill them from the device tensors.
"""
import contextlib
from types import SimpleNamespace

import torch

from attnzoo.attention.backends.base import StepPlan
from attnzoo.attention.backends.hybrid import HybridBackend
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
