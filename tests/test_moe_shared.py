"""FusedMoE with its shared experts as a module (``shared=``): the same bits as their output added, and on a GPU
at decode's rows the shared experts on a side stream beside the routed GEMMs, eagerly and in a CUDA graph."""
import pytest
import torch

from attnzoo.layers.moe import FusedMoE
from attnzoo.layers.moe import layer as moe_layer
from attnzoo.models.common import GatedMLP
from test_moe import DEVICE, gpu, needs_cuda, routing


def test_shared_experts_fail_cleanly_and_leave_no_stream_unjoined():
    """An error inside the shared experts reaches the caller; on a GPU the side stream is joined all the same."""
    moe = FusedMoE(4, 32, 16, init_std=0.2).to(DEVICE)
    weights, ids = routing(2, 2, 4, seed=1)
    x = torch.randn(2, 32, device=DEVICE)

    def broken(v):
        raise RuntimeError("shared experts broke")

    with torch.no_grad(), pytest.raises(RuntimeError, match="shared experts broke"):
        moe(x, weights, ids, shared=broken)
    if DEVICE.type == "cuda":  # in a capture, an unjoined side stream would fail capture_end with an error of its own
        with torch.no_grad(), pytest.raises(RuntimeError, match="shared experts broke"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                moe(x, weights, ids, shared=broken)


def test_shared_experts_as_a_module_equal_their_output_added():
    t, k, e, h, i = 5, 2, 4, 32, 16
    moe = FusedMoE(e, h, i, init_std=0.2).to(DEVICE)
    mlp = GatedMLP(h, 24).to(DEVICE)
    weights, ids = routing(t, k, e, seed=3)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        assert torch.equal(moe(x, weights, ids, shared=mlp), moe(x, weights, ids, add=mlp(x)))
        with pytest.raises(ValueError, match="not both"):
            moe(x, weights, ids, add=mlp(x), shared=mlp)


@gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 16, 256])
def test_gpu_shared_experts_beside_the_routed_ones_same_bits_eager_and_in_a_graph(t):
    """At up to SHARED_OVERLAP_ROWS rows the shared experts run on a side stream; the sum waits for them. The
    graph's replay after new inputs is also checked, so a sum that did not wait would read a stale output."""
    assert t <= moe_layer.SHARED_OVERLAP_ROWS

    e, k, h, i = 64, 6, 2048, 1408
    moe = FusedMoE(e, h, i, init_std=0.02).to(DEVICE, torch.bfloat16)
    mlp = GatedMLP(h, 2 * i).to(DEVICE, torch.bfloat16)
    weights, ids = routing(t, k, e, seed=1)
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        want = moe(x, weights, ids, add=mlp(x))
        assert moe_layer._side_stream(x) is not None
        # a shared path that spins first (~1 ms): a sum that did not wait for it would miss its output
        slow = lambda v: (torch.cuda._sleep(2_000_000), mlp(v))[1]  # noqa: E731
        assert torch.equal(moe(x, weights, ids, shared=slow), want)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x, weights, ids, shared=slow)
        x.normal_()
        want = moe(x, weights, ids, add=mlp(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
