"""flashinfer_mla under CUDA graphs, on CPU with FlashInfer replaced by a recorder: one graph wrapper per
batch bucket over static index buffers, re-planned before each replay with the step's real lengths.

The kernels themselves are checked on a GPU (test_gpu_backends.py: graph replay equals eager decode);
here we check what the backend hands FlashInfer. The page-index kernel runs in the Triton interpreter.
"""
from types import SimpleNamespace

import pytest
import torch

from attnzoo.attention.backends import flashinfer_mla as fi_mla
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention
from attnzoo.attention.metadata import ForwardMode, build_metadata
from attnzoo.errors import BackendError

PS = 16


class RecordingMLAWrapper:
    """Stands in for BatchMLAPagedAttentionWrapper: records its buffers and plans, returns zeros."""

    def __init__(self, **kwargs):
        self.kwargs, self.plans, self.runs = kwargs, [], 0

    def plan(self, **kwargs):
        self.plans.append(kwargs)

    def run(self, *, query, kv_cache, out):
        self.runs += 1
        return out.zero_()


def make_backend(monkeypatch, layer, num_pages=32):
    csr = lambda **kw: SimpleNamespace(**kw)  # noqa: E731
    fake = SimpleNamespace(BatchMLAPagedAttentionWrapper=RecordingMLAWrapper, MLAPlanMetadata=SimpleNamespace(csr=csr))
    monkeypatch.setattr(fi_mla, "load_flashinfer", lambda name: fake)
    monkeypatch.setattr(fi_mla, "compute_capability", lambda name, device: (9, 0))
    pool = KVPool([layer.kv_cache_spec()], num_pages=num_pages, page_size=PS, dtype=torch.bfloat16, device="cpu")
    return fi_mla.FlashInferMLABackend(pool)


def graph_step(seq_lens, tables, bucket):
    """A decode step as DecodeGraphs hands it to prepare_graph: real rows, then padding rows of one
    token in page 0, up to the bucket."""
    pad = bucket - len(seq_lens)
    seq, tables = list(seq_lens) + [1] * pad, list(tables) + [[0]] * pad
    return build_metadata(prefix_lens=[s - 1 for s in seq], q_lens=[1] * bucket, block_tables=tables,
                          page_size=PS, device="cpu", mode=ForwardMode.DECODE)


def test_csr_plan_arrays():
    # decode rows (one padding row of one token) and an extend row of 5 queries over 40 tokens
    assert fi_mla.csr_plan_arrays([1, 1, 5], [17, 1, 40], 16) == ([0, 1, 2, 7], [0, 2, 3, 6], [17, 1, 40])
    assert fi_mla.csr_plan_arrays([1], [16], 16) == ([0, 1], [0, 1], [16])


def test_graph_wrapper_per_bucket_replanned_with_real_lengths(monkeypatch):
    layer = Attention(0, 16, 1, 576, v_head_dim=512, kind="mla")
    be = make_backend(monkeypatch, layer)
    be.init_graph_state(max_batch_size=4, max_pages_per_req=6)
    g = be._graph
    q = torch.randn(4, 16, 576, dtype=torch.bfloat16)

    # Capture of bucket 4: the layer's first run learns its signature and builds the bucket's wrapper.
    cap = graph_step([17, 40, 2], [[3, 4], [5, 6, 7], [8]], bucket=4)
    out = be.decode(layer, q, cap, be.prepare_graph(cap, capturing=True))
    assert out.shape == (4, 16, 512)
    (key, w4), = be._wrappers.items()
    assert key[1] == 4
    assert w4.kwargs["use_cuda_graph"] is True and w4.kwargs["backend"] == "fa3"
    for name, buf, n in (("qo_indptr", g.qo_indptr, 5), ("kv_indptr", g.kv_indptr, 5), ("kv_len_arr", g.kv_len, 4)):
        assert w4.kwargs[name].data_ptr() == buf.data_ptr() and w4.kwargs[name].shape == (n,), name
    assert w4.kwargs["kv_indices"].data_ptr() == g.kv_indices.data_ptr()
    plan = w4.plans[-1]
    assert plan["causal"] is False and plan["page_size"] == PS
    md = plan["metadata"]
    assert md.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert md.kv_indptr.tolist() == [0, 2, 5, 6, 7] and md.kv_len_arr.tolist() == [17, 40, 2, 1]
    # The page ids sit in the static buffer itself (FlashInfer's copy onto it is then a no-op).
    assert md.kv_indices.data_ptr() == g.kv_indices.data_ptr()
    assert g.kv_indices[:7].tolist() == [3, 4, 5, 6, 7, 8, 0]
    assert g.kv_indptr[:5].tolist() == [0, 2, 5, 6, 7]

    # Replay of bucket 4 with another step: the same wrapper, re-planned before the replay.
    rep = graph_step([33, 3], [[9, 10, 11], [12]], bucket=4)
    be.prepare_graph(rep, capturing=False)
    assert len(be._wrappers) == 1 and len(w4.plans) == 2
    md = w4.plans[-1]["metadata"]
    assert md.kv_indptr.tolist() == [0, 3, 4, 5, 6] and md.kv_len_arr.tolist() == [33, 3, 1, 1]
    assert g.kv_indices[:6].tolist() == [9, 10, 11, 12, 0, 0]

    # Bucket 2 gets its own wrapper (FlashInfer fixes a graph wrapper's batch size), planned up front.
    b2 = graph_step([5], [[13]], bucket=2)
    plan2 = be.prepare_graph(b2, capturing=True)
    w2 = be._wrappers[(key[0], 2)]
    assert w2 is not w4 and w2.kwargs["qo_indptr"].shape == (3,) and len(w2.plans) == 1
    be.decode(layer, q[:2], b2, plan2)
    assert w2.runs == 1 and w4.runs == 1

    # Eager steps keep their own wrapper, without graph buffers.
    eager = build_metadata(prefix_lens=[20], q_lens=[1], block_tables=[[1, 2]], page_size=PS, device="cpu")
    be.decode(layer, q[:1], eager, be.prepare(eager))
    assert "use_cuda_graph" not in be._wrappers[(key[0], None)].kwargs


def test_graph_state_errors(monkeypatch):
    layer = Attention(0, 16, 1, 576, v_head_dim=512, kind="mla")
    be = make_backend(monkeypatch, layer)
    step = graph_step([17], [[3, 4]], bucket=1)
    with pytest.raises(BackendError, match="init_graph_state first"):
        be.prepare_graph(step, capturing=True)
    be.init_graph_state(max_batch_size=2, max_pages_per_req=2)
    extend = build_metadata(prefix_lens=[0], q_lens=[3], block_tables=[[1]], page_size=PS, device="cpu")
    with pytest.raises(BackendError, match="captures decode steps only"):
        be.prepare_graph(extend, capturing=False)
    with pytest.raises(BackendError, match="exceeds the static buffers"):
        be.prepare_graph(graph_step([40, 40], [[1, 2, 3], [4, 5, 6]], bucket=2), capturing=False)
