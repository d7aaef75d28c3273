"""The fused MoE's MXFP4 (w4a16) path against the dequantized weights: the GEMM's decoding of every e2m1 code
and E8M0 scale, the whole MoE with gpt-oss's biases and clamped SwiGLU (decode and several tokens), the tile
checks; on a GPU, gpt-oss-20b's expert shape at batch 1 and 512 against the dequantized bf16 path.

Without a GPU the kernels run in Triton's interpreter on tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from attnzoo.errors import BackendError, ModelLoadError, WeightError
from attnzoo.layers.moe import (
    MXFP4, FusedMoE, MoEConfig, _grouped_gemm, check_config, default_config, fused_moe, moe_align_block_size,
    moe_reference, tile_config, tile_key, write_tile_table,
)
from attnzoo.layers.mxfp4 import FP4_VALUES, dequantize_mxfp4, dequantize_packed

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def routing(t, k, e, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=g).to(DEVICE), ids.to(DEVICE)


def packed_experts(e, n, k, *, seed=0, scales=(122, 127)):
    """Random MXFP4 weights [E, N, K]: uniform bytes (every code, both nibbles) and scale bytes in ``scales``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.int32).to(MXFP4)
    s = torch.randint(scales[0], scales[1] + 1, (e, n, k // 32), generator=g, dtype=torch.int32).to(MXFP4)
    return w.to(DEVICE), s.to(DEVICE)


def test_shared_dequant_is_the_checkpoint_decoding():
    """layers.mxfp4's flat layout reads the same bytes as the checkpoint's blocks; models.mxfp4 re-exports it."""
    from attnzoo.models import mxfp4 as models_mxfp4

    w, s = packed_experts(2, 3, 64)
    w, s = w.cpu(), s.cpu()
    assert models_mxfp4.dequantize_mxfp4 is dequantize_mxfp4
    assert torch.equal(dequantize_packed(w, s, torch.float32), dequantize_mxfp4(w.view(2, 3, 2, 16), s, torch.float32))
    one = dequantize_packed(torch.tensor([[0x21] + [0] * 15], dtype=MXFP4), torch.tensor([[128]], dtype=MXFP4),
                            torch.float32)
    assert one[0, :2].tolist() == [2 * FP4_VALUES[1], 2 * FP4_VALUES[2]]  # low nibble is the even input


@pytest.mark.parametrize("block_k", [32, 64])
def test_gemm_decodes_every_code_and_scale_exactly(block_k):
    """One-hot activations (float32) make the GEMM return W^T itself: every code (negative, -0 and
    subnormal included) under every scale byte from 0 (2^-127, a float32 subnormal) to 252 matches the
    dequantizer bit for bit; K = 96 leaves a partial K tile at BLOCK_K 64; N = 24 a partial N tile."""
    e, n, k = 2, 24, 96
    w, s = packed_experts(e, n, k, seed=1, scales=(0, 252))
    s[0, :, 0], s[1, :, 1], s[1, :, 2] = 0, 252, 1  # the extremes certainly present
    cfg = MoEConfig(16, 16, block_k)
    x = torch.eye(k, device=DEVICE)
    for expert in range(e):
        ids = torch.full((k, 1), expert, device=DEVICE)
        align = moe_align_block_size(ids, cfg.block_m, e)
        out = torch.full((k, n), float("nan"), device=DEVICE)
        _grouped_gemm(x, None, w, s, out, torch.ones(k, device=DEVICE), align, cfg, num_valid=k, rows_per_a=1,
                      split_n=n, mul_weight=False)
        ref = dequantize_packed(w[expert], s[expert], torch.float32).T
        assert torch.equal(out, ref)


def _moe_case(t, dtype, *, e=4, k=2, h=64, i=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = packed_experts(e, 2 * i, h, seed=seed)
    w2, s2 = packed_experts(e, h, i, seed=seed + 1)
    bias = dict(w13_bias=(torch.randn(e, 2 * i, generator=g) * 0.5).to(DEVICE, dtype),
                w2_bias=(torch.randn(e, h, generator=g) * 0.5).to(DEVICE, dtype))
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    weights, ids = routing(t, k, e, seed=seed)
    return x, (w13, s13, w2, s2), bias, weights, ids


@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mxfp4_equals_the_dequantized_moe(t, dtype):
    """gpt-oss's MoE (biases, clamped SwiGLU) with MXFP4 weights: the w4a16 path against the fused path on the
    dequantized weights and the reference (which dequantizes the uint8 experts itself); decode (one token,
    the constant sort) and several tokens."""
    x, (w13, s13, w2, s2), bias, weights, ids = _moe_case(t, dtype, seed=t)
    d13, d2 = dequantize_packed(w13, s13, dtype), dequantize_packed(w2, s2, dtype)
    kw = dict(act="swiglu_clamped", config=MoEConfig(16, 16, 32), **bias)
    got = fused_moe(x, w13, w2, weights, ids, w13_scale_inv=s13, w2_scale_inv=s2, **kw)
    want = fused_moe(x, d13, d2, weights, ids, **kw)
    ref = moe_reference(x, w13, w2, weights, ids, act="swiglu_clamped", w13_scale_inv=s13, w2_scale_inv=s2, **bias)
    assert ((x.float() @ d13.float()[ids[0, 0]].T).abs() > 7).any()  # the clamps bite
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and rel_err(got, want) < tol and rel_err(ref, want) < tol
    # the same experts dequantized in the reference: identical sums
    assert torch.equal(ref, moe_reference(x, d13, d2, weights, ids, act="swiglu_clamped", **bias))


def test_layer_keeps_the_checkpoint_bytes_and_matches_the_dequantized_layer():
    """FusedMoE(quant="mxfp4") takes gpt-oss's stacked *_blocks / *_scales (gate and up rows interleaved) as
    stored; its output (reference and fused, as two expert-parallel shares too) equals the float layer loaded
    with the dequantized checkpoint tensors."""
    from attnzoo.layers import fused

    e, h, i, t, k = 4, 64, 32, 5, 2
    blocks = {}
    for name, (n, kk) in {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}.items():
        w, s = packed_experts(e, n, kk, seed=len(name), scales=(123, 126))
        blocks[name] = (w.cpu().view(e, n, kk // 32, 16), s.cpu())
    g = torch.Generator().manual_seed(3)
    biases = {"gate_up_proj_bias": torch.randn(e, 2 * i, generator=g), "down_proj_bias": torch.randn(e, h, generator=g)}
    x = torch.randn(t, h, generator=g)
    weights, ids = routing(t, k, e, seed=3)
    weights, ids = weights.cpu(), ids.cpu()

    def layer(quant, share=None):
        m = FusedMoE(e, h, i, "swiglu_clamped", experts=share, bias=True, stacked_layout="interleaved_t", quant=quant)
        for name, (b, s) in blocks.items():
            if quant:
                m.load_checkpoint_tensor(name + "_blocks", b)
                m.load_checkpoint_tensor(name + "_scales", s)
            else:  # the dequantize-at-load plan's tensor: [E, K, N]
                m.load_checkpoint_tensor(name, dequantize_mxfp4(b, s, torch.float32).transpose(1, 2))
        for name, b in biases.items():
            m.load_checkpoint_tensor(name, b)
        return m

    kept, ref_layer = layer("mxfp4"), layer(None)
    assert kept.w13.dtype == MXFP4 and kept.w13.shape == (e, 2 * i, h // 2)
    assert kept.w2_scale_inv.shape == (e, h, i // 32)
    assert set(kept.loaded_parameters()) == {"w13", "w2", "w13_scale_inv", "w2_scale_inv", "w13_bias", "w2_bias"}
    ref = ref_layer(x, weights, ids)
    assert torch.equal(kept(x, weights, ids), ref)
    with fused.use("triton"):
        assert rel_err(kept(x, weights, ids), ref) < 1e-5
        halves = sum(layer("mxfp4", range(a, a + 2))(x, weights, ids) for a in (0, 2))
    assert rel_err(halves, ref) < 1e-5
    with pytest.raises(WeightError, match="is MXFP4, but these experts are built unquantized"):
        ref_layer.load_checkpoint_tensor("down_proj_blocks", blocks["down_proj"][0])
    with pytest.raises(WeightError, match="does not fit experts kept MXFP4"):
        kept.load_checkpoint_tensor("down_proj", torch.zeros(e, i, h))


def test_block_k_not_a_multiple_of_32_is_refused():
    x, (w13, s13, w2, s2), _, weights, ids = _moe_case(3, torch.float32)
    with pytest.raises(ModelLoadError, match="BLOCK_K \\(16\\) a multiple of 32"):
        fused_moe(x, w13, w2, weights, ids, w13_scale_inv=s13, w2_scale_inv=s2, config=MoEConfig(16, 16, 16))
    with pytest.raises(ModelLoadError, match="uint8 E8M0 w13_scale_inv"):
        fused_moe(x, w13, w2, weights, ids, config=MoEConfig(16, 16, 32))


def test_tiles_know_mxfp4(tmp_path):
    """A default MXFP4 tile has whole scale groups per K step; tables key it "dtype=mxfp4", checked as such."""
    for m in (1, 64, 4096):
        cfg = default_config(m * 4, 32, "mxfp4")
        assert cfg.block_k % 32 == 0 and check_config(cfg, "mxfp4", "default") == cfg
    assert default_config(8, 32, True) == default_config(8, 32, "fp8")  # the FP8 flag still works
    assert tile_config(1, 4, 32, 2880, 2880, "mxfp4", torch.device("cpu"), tmp_path) == default_config(4, 32, "mxfp4")
    with pytest.raises(BackendError, match="cannot run"):
        write_tile_table(tmp_path / "x.json", "GPU", "90",
                         {tile_key(32, 2880, 2880, "mxfp4"): {1: MoEConfig(16, 64, 16)}})
    with pytest.raises(BackendError, match="unknown"):
        default_config(4, 32, "int4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 512])
def test_gpu_gpt_oss_20b_expert_shape(t):
    """gpt-oss-20b's experts (H = I = 2880, E = 32, k = 4; K tiles of 128 leave a partial one) in bf16: the
    MXFP4 path against the fused path on the dequantized weights, and the bytes it reads."""
    e, k, h, i = 32, 4, 2880, 2880
    g = torch.Generator().manual_seed(t)
    w13, s13 = packed_experts(e, 2 * i, h, seed=1, scales=(118, 122))
    w2, s2 = packed_experts(e, h, i, seed=2, scales=(118, 122))
    bias = dict(w13_bias=(torch.randn(e, 2 * i, generator=g) * 0.1).to(DEVICE, torch.bfloat16),
                w2_bias=(torch.randn(e, h, generator=g) * 0.1).to(DEVICE, torch.bfloat16))
    x = torch.randn(t, h, generator=g).to(DEVICE, torch.bfloat16)
    weights, ids = routing(t, k, e, seed=t)
    d13, d2 = dequantize_packed(w13, s13), dequantize_packed(w2, s2)
    got = fused_moe(x, w13, w2, weights, ids, act="swiglu_clamped", w13_scale_inv=s13, w2_scale_inv=s2, **bias)
    want = fused_moe(x, d13, d2, weights, ids, act="swiglu_clamped", **bias)
    assert rel_err(got, want) < 2e-2
    if t == 1:
        ref = moe_reference(x, d13, d2, weights, ids, act="swiglu_clamped", **bias)
        assert rel_err(got, ref) < 2e-2
    assert (w13.numel() + w2.numel()) * 4 == (d13.numel() + d2.numel()) * 2  # a quarter of the bf16 bytes
