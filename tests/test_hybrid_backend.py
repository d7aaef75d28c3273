"""HybridBackend, the one place that picks a step's backend, and the typed plans the backends hand back."""
from types import SimpleNamespace

import pytest
import torch

from attnzoo.attention.backends import flashinfer as fi_backend
from attnzoo.attention.backends import hybrid, trtllm_mha
from attnzoo.attention.backends.base import NSAPlan
from attnzoo.attention.backends.hybrid import HybridBackend
from attnzoo.attention.backends.torch_ref import TorchBackend
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.attention.metadata import build_metadata
from attnzoo.errors import BackendError


class Recording(TorchBackend):
    """The torch backend, recording which phase ran with which plan."""

    def __init__(self, pool):
        super().__init__(pool)
        self.calls = []

    def extend(self, layer, q, meta, plan):
        self.calls.append(("extend", plan))
        return super().extend(layer, q, meta, plan)

    def decode(self, layer, q, meta, plan):
        self.calls.append(("decode", plan))
        return super().decode(layer, q, meta, plan)


def _steps(page_size=4):
    extend = build_metadata(prefix_lens=[0, 3], q_lens=[5, 2], block_tables=[[1, 2], [3, 4]],
                            page_size=page_size, device="cpu")
    decode = build_metadata(prefix_lens=[5, 5], q_lens=[1, 1], block_tables=[[1, 2], [3, 4]],
                            page_size=page_size, device="cpu")
    return extend, decode


def test_the_step_picks_the_backend_and_its_plan_goes_to_every_layer():
    layer = Attention(0, 4, 2, 16)
    pool = KVPool([layer.kv_cache_spec()], num_pages=8, page_size=4, dtype=torch.float32, device="cpu")
    pool.buffer.view(torch.float32).normal_(generator=torch.Generator().manual_seed(0))
    same = HybridBackend.create("torch", "torch", pool)
    assert same.prefill_backend is same.decode_backend and same.distinct() == [same.prefill_backend]

    pre, dec = Recording(pool), Recording(pool)
    backends = HybridBackend(pre, dec)
    assert backends.distinct() == [pre, dec]
    for meta, want in zip(_steps(), ("extend", "decode")):
        plan = backends.prepare(meta)
        assert isinstance(plan, NSAPlan)  # the torch backend serves NSA layers too: its plan is theirs
        q = torch.randn(meta.num_tokens, 4, 16)
        out = backends.run(layer, q, meta, plan)
        ran, idle = (pre, dec) if want == "extend" else (dec, pre)
        assert ran.calls == [(want, plan)] and not idle.calls
        ref = TorchBackend(pool)
        assert torch.equal(out, getattr(ref, want)(layer, q, meta, ref.prepare(meta)))
        # A ForwardContext without a plan prepares the step once, on the step's backend.
        ctx = ForwardContext(meta, pool, pre, dec)
        assert isinstance(ctx.plan, NSAPlan) and ctx.backends.for_step(meta) is ran
        ran.calls.clear()


def _fake_flashinfer(monkeypatch, cc):
    fake = SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=object, BatchDecodeWithPagedKVCacheWrapper=object,
                           merge_state=None)
    for mod in (fi_backend, trtllm_mha):
        monkeypatch.setattr(mod, "load_flashinfer", lambda name: fake)
        monkeypatch.setattr(mod, "compute_capability", lambda name, device: cc)
    monkeypatch.setattr(hybrid, "device_gpu", lambda device: {(9, 0): "sm90", (10, 0): "sm100"}[cc])


@pytest.mark.parametrize("cc", [(9, 0), (10, 0)])
def test_trtllm_mha_prefill_runs_as_its_declared_backend(monkeypatch, cc):
    """Off SM100/SM103 trtllm_mha has no context kernel: its declaration says prefill runs as flashinfer,
    and HybridBackend builds that backend for the prefill phase; trtllm_mha itself refuses extend there."""
    _fake_flashinfer(monkeypatch, cc)
    layer = Attention(0, 8, 2, 64)
    pool = KVPool([layer.kv_cache_spec()], num_pages=8, page_size=16, dtype=torch.bfloat16, device="cpu")
    backends = HybridBackend.create("trtllm_mha", "trtllm_mha", pool)
    extend, _ = _steps(16)
    if cc == (9, 0):
        assert isinstance(backends.prefill_backend, fi_backend.FlashInferBackend)
        assert backends.decode_backend.name == "trtllm_mha"
        assert backends.decode_backend.kernels_for(layer)["prefill"] == "runs as flashinfer: FlashInfer FA3 prefill"
        with pytest.raises(BackendError, match="runs as the flashinfer backend there"):
            backends.decode_backend.prepare(extend)
    else:
        assert backends.prefill_backend is backends.decode_backend
        assert backends.prefill_backend.name == "trtllm_mha"
