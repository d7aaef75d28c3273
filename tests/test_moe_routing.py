"""MoE routing: the choice kernel (``select_experts``) and the router's GEMV with the choice in one launch
(``route``) against the torch reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnzoo.errors import ModelLoadError
from attnzoo.layers import fused
from attnzoo.layers.moe import arrivals_counter, route, routing, select_experts, select_experts_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# (T, E, k, sigmoid, group score, n_group, topk_group, bias, renormalize): V2 greedy and group-limited
# (group max, zeroed experts), V3 (sigmoid + bias, top-2 group sums, renormalized); E not a power of two.
ROUTERS = [(5, 64, 6, False, None, 1, 1, False, False), (7, 20, 3, False, "max", 4, 2, False, False),
           (6, 32, 4, True, "top2", 8, 3, True, True), (3, 24, 2, True, "top2", 4, 1, True, False),
           (4, 256, 8, True, "top2", 8, 4, True, True)]  # DeepSeek-V3's router


@pytest.mark.parametrize("t,e,k,sigmoid,group,n_group,topk_group,bias,renorm", ROUTERS)
def test_routing_kernel_equals_reference(t, e, k, sigmoid, group, n_group, topk_group, bias, renorm):
    g = torch.Generator().manual_seed(t)
    logits = (torch.randn(t, e, generator=g) * 2).to(DEVICE)
    kw = dict(top_k=k, sigmoid=sigmoid, group_score=group, n_group=n_group, topk_group=topk_group, renormalize=renorm,
              correction_bias=(torch.randn(e, generator=g) * 0.5).to(DEVICE) if bias else None, scale=2.5)
    ref_w, ref_ids = select_experts_reference(logits, **kw)
    with fused.use("triton"):
        w, ids = select_experts(logits, **kw)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (t, k)
    # Any order within a token: compare sorted by expert id.
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)
    if group is not None:  # the limit binds: some token's unrestricted top-k differs
        free = select_experts_reference(logits, **{**kw, "group_score": None})[1]
        assert not torch.equal(free.sort(dim=1).values, ref_ids.sort(dim=1).values)


def _same_choice(w, ids, ref_w, ref_ids):
    """Any order within a token: compared sorted by expert id."""
    order, ref_order = ids.argsort(dim=1), ref_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)


def _no_cublas(monkeypatch):
    """Fail the test if the two-launch path (cuBLAS's GEMV) runs."""
    def boom(*a, **k):
        raise AssertionError("route took the two-launch path")
    monkeypatch.setattr(routing.F, "linear", boom)


# ROUTERS, plus 16 tokens (the counters' limit) over 129 experts (blocks of 2, the last part-empty) and a hidden
# size past one K tile of 512 (1000: one whole tile and a masked one), within ONE_LAUNCH_BYTES.
ONE_LAUNCH = [(*r, 96) for r in ROUTERS] + [(16, 129, 4, False, None, 1, 1, False, True, 1000)]


@pytest.mark.parametrize("t,e,k,sigmoid,group,n_group,topk_group,bias,renorm,h", ONE_LAUNCH)
def test_router_gemv_and_choice_in_one_launch_equal_the_reference(monkeypatch, t, e, k, sigmoid, group, n_group,
                                                                   topk_group, bias, renorm, h):
    """``route``'s one launch (each program a block of experts' logits, each token's last program routes it) gives
    the experts and weights of float32 logits then the reference choice, and leaves its counters zeroed; twice in a
    row, so a counter left over would show."""
    g = torch.Generator().manual_seed(100 + t)
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w = (torch.randn(e, h, generator=g) * 0.3).to(DEVICE)
    kw = dict(top_k=k, sigmoid=sigmoid, group_score=group, n_group=n_group, topk_group=topk_group, renormalize=renorm,
              correction_bias=(torch.randn(e, generator=g) * 0.5).to(DEVICE) if bias else None, scale=2.5)
    ref_w, ref_ids = select_experts_reference(F.linear(x.double(), w.double()).float(), **kw)
    arrivals = arrivals_counter(DEVICE)
    _no_cublas(monkeypatch)
    for _ in range(2):
        with fused.use("triton"):
            wts, ids = route(x, w, arrivals, **kw)
        assert ids.shape == (t, k) and ids.dtype == torch.int64 and wts.dtype == torch.float32
        _same_choice(wts, ids, ref_w, ref_ids)
        assert not arrivals.any()


def test_route_past_its_counters_or_its_byte_budget_takes_the_two_launch_path(monkeypatch):
    """More tokens than counters, or a weight whose per-token reads pass ONE_LAUNCH_BYTES: cuBLAS's logits and the
    choice kernel, the same answer, no counter touched. A weight that does not fit x is refused on either path."""
    x, w = torch.randn(5, 32).to(DEVICE), torch.randn(8, 32).to(DEVICE)
    ref_w, ref_ids = select_experts_reference(F.linear(x, w), top_k=2, sigmoid=False)
    for arrivals, budget in ((torch.zeros(4, dtype=torch.int32, device=DEVICE), routing.ONE_LAUNCH_BYTES),
                             (arrivals_counter(DEVICE), 5 * 8 * 32 * 4 - 1)):
        monkeypatch.setattr(routing, "ONE_LAUNCH_BYTES", budget)
        with fused.use("triton"):
            wts, ids = route(x, w, arrivals, top_k=2, sigmoid=False)
        _same_choice(wts, ids, ref_w, ref_ids)
        assert not arrivals.any()
        for bad in (w.double(), w[:, :16]):
            with pytest.raises(ModelLoadError, match="router weight"), fused.use("triton"):
                route(x, bad, arrivals, top_k=2, sigmoid=False)
