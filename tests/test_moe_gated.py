"""The grouped MoE's gate_up GEMM ending in the activation (``moe.fused.GATED_GEMM``, unquantized experts) against
the two-launch path it replaces: the GEMM, then ``_act_and_mul``. CPU (Triton's interpreter) and GPU alike."""
from __future__ import annotations

import pytest
import torch

from attnzoo.errors import BackendError
from attnzoo.layers.moe import FP8, MoEConfig, _grouped_gemm, fused_moe, moe_align_block_size
from attnzoo.layers.moe import fused as fm
from test_moe import CUDA, DEVICE, experts, routing

TILE = MoEConfig(16, 32, 32)


def _both(x, w13, b13, weights, ids, act, clamp, k):
    """(gated GEMM's rows, the GEMM's then the activation kernel's rows) for the same assignments."""
    t, i, e = x.shape[0], w13.shape[1] // 2, w13.shape[0]
    align = moe_align_block_size(ids, TILE.block_m, e)
    flat = weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(t * k, 2 * i, dtype=x.dtype, device=DEVICE)
    _grouped_gemm(x, None, w13, None, gate_up, flat, align, TILE, num_valid=t * k, rows_per_a=k, split_n=i,
                  mul_weight=False, bias=b13)
    want, _ = fm._act_and_mul(gate_up, act, False, x.dtype, clamp=clamp)
    got = torch.full((t * k, i), float("nan"), dtype=x.dtype, device=DEVICE)
    _grouped_gemm(x, None, w13, None, got, flat, align, TILE, num_valid=t * k, rows_per_a=k, split_n=i,
                  mul_weight=False, bias=b13, act=act, clamp=clamp)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,clamp,bias", [("silu", 0.0, False), ("gelu_tanh", 0.0, True),
                                            ("swiglu_clamped", 0.0, True), ("silu", 3.0, False)])
def test_gated_gemm_equals_the_gemm_then_the_activation(dtype, act, clamp, bias):
    """The same gate and up (bias included), rounded to the model dtype, through the same activation; I = 40 is
    not a multiple of the 16-wide tile, so the up rows' offset and the masks are exercised."""
    t, k, e, h, i = 5, 2, 4, 48, 40
    w13, _ = experts(e, h, i, dtype, seed=3)
    b13 = (torch.randn(e, 2 * i, generator=torch.Generator().manual_seed(4)) * 0.5).to(DEVICE, dtype) if bias else None
    weights, ids = routing(t, k, e, seed=3)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype) * 2
    got, want = _both(x, w13, b13, weights, ids, act, clamp, k)
    assert not got.isnan().any(), "a row or column of the intermediate was left unwritten"
    if CUDA:  # the GPU's dot may sum a narrower tile's K in another order
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("holds_all", [True, False])
def test_fused_moe_gated_route_equals_the_two_launch_route(monkeypatch, holds_all):
    """With GATED_GEMM on, unquantized experts skip the activation kernel; off, they run it; the outputs agree,
    an expert-parallel share's (other ranks' rows zero) included."""
    calls = []
    real = fm._act_and_mul
    monkeypatch.setattr(fm, "_act_and_mul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    t, k, e, h, i = 6, 2, 4, 32, 24
    w13, w2 = experts(e, h, i, torch.float32, seed=6)
    weights, ids = routing(t, k, e, seed=6)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    share = dict(expert_start=0, holds_all_experts=True) if holds_all else dict(expert_start=1, holds_all_experts=False)
    lo = share["expert_start"]
    outs = []
    for gated in (True, False):
        monkeypatch.setattr(fm, "GATED_GEMM", gated)
        outs.append(fused_moe(x, w13[lo:], w2[lo:], weights, ids, config=TILE, **share))
        assert calls == ([] if gated else [1])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_gated_gemm_refuses_quantized_experts():
    t, k, e, h, i = 2, 2, 4, 32, 16
    w13, _ = experts(e, h, i, torch.float32)
    weights, ids = routing(t, k, e)
    x = torch.randn(t, h, device=DEVICE)
    with pytest.raises(BackendError, match="unquantized"):
        _grouped_gemm(x, None, w13.to(FP8), None, torch.empty(t * k, i, device=DEVICE), weights.reshape(-1),
                      moe_align_block_size(ids, 16, e), TILE, num_valid=t * k, rows_per_a=k, split_n=i,
                      mul_weight=False, act="silu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 64, 512])
def test_gpu_gated_route_at_v2_lite_shapes(monkeypatch, t):
    """DeepSeek-V2-Lite's experts (64 of 2048 x 1408, top-6) in bfloat16 with the table's tiles: the gated route
    gives the two-launch route's output, and both the reference's."""
    from attnzoo.layers.moe import moe_reference
    from test_moe import rel_err

    w13, w2 = experts(64, 2048, 1408, torch.bfloat16, std=0.02)
    weights, ids = routing(t, 6, 64, seed=t)
    x = torch.randn(t, 2048, device=DEVICE, dtype=torch.bfloat16)
    outs = []
    for gated in (True, False):
        monkeypatch.setattr(fm, "GATED_GEMM", gated)
        outs.append(fused_moe(x, w13, w2, weights, ids))
    assert rel_err(outs[0], outs[1]) < 1e-3
    assert rel_err(outs[0], moe_reference(x, w13, w2, weights, ids)) < 1e-2
