"""The MoE oracle: the activations, FP8 dequantization and the per-expert loop the fused path is tested
against (float32 accumulation, activations rounded as the kernels round them)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnzoo.layers.fp8 import GROUP as QUANT_GROUP
from attnzoo.layers.fp8 import act_quant_reference
from attnzoo.layers.mxfp4 import dequantize_packed


ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamped")
# gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate): gate clamped above at LIMIT, up
# to [-LIMIT, LIMIT], out = (up + 1) * gate * sigmoid(ALPHA * gate).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
FP8 = torch.float8_e4m3fn
MXFP4 = torch.uint8  # packed FP4 expert weights and their E8M0 scales (layers.mxfp4)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _act_and_mul_ref(gate: torch.Tensor, up: torch.Tensor, act: str, clamp: float = 0.0) -> torch.Tensor:
    if clamp:  # DeepSeek-V4: gate clamped above, up on both sides, before the activation
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    if act == "swiglu_clamped":
        gate, up = gate.clamp(max=SWIGLU_LIMIT), up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


def scale_rows(n: int, split: int, block_n: int, device=None) -> torch.Tensor:
    """Scale-block row of each of ``n`` weight rows whose first ``split`` rows (gate) and the rest (up)
    are blocked separately: rows [0, split) use blocks 0.., rows [split, n) start a new block."""
    r = torch.arange(n, device=device)
    return torch.where(r < split, r // block_n, _cdiv(split, block_n) + (r - split) // block_n)


def dequantize_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, *, split: int, block=(128, 128)) -> torch.Tensor:
    """One expert's FP8 weight [N, K] times its block multipliers [blocks_n, blocks_k] -> float32 [N, K]."""
    n, k = w.shape
    rows = scale_rows(n, split, block[0], w.device)
    cols = torch.arange(k, device=w.device) // block[1]
    return w.float() * scale_inv[rows][:, cols]


def _fake_quant_fp8(x: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """x rounded through the per-token-group FP8 quantization (what the w8a8 kernel's inputs hold)."""
    q, s = act_quant_reference(x, QUANT_GROUP, ue8m0)
    return (q.float() * s.repeat_interleave(QUANT_GROUP, dim=1)[:, : x.shape[1]]).to(x.dtype)


def moe_reference(x, w13, w2, topk_weights, topk_ids, *, act: str = "silu", expert_start: int = 0,
                  w13_scale_inv=None, w2_scale_inv=None, block=(128, 128), quantize_activations: bool = False,
                  ue8m0: bool = False, w13_bias=None, w2_bias=None, swiglu_limit: float = 0.0):
    """The per-expert loop: for each local expert with tokens, its gated MLP on those tokens.

    One float32 row per (token, slot), summed over the slots at the end: deterministic (no atomic
    index_add) and accumulated in float32. FP8 and MXFP4 (uint8, ``fused_moe``'s layout) weights are
    dequantized per expert; with
    ``quantize_activations`` (FP8 weights only) the GEMM inputs are rounded as the w8a8 kernel rounds
    them. ``w13_bias`` [E, 2I] / ``w2_bias`` [E, H] (gpt-oss) are added to each projection, the down
    one before the routing weight (``fp8.act_quant_reference``; scales powers of two under ``ue8m0``): the arithmetic of the
    fused path, as ``Fp8Linear``'s CPU emulation is that of its GEMMs.
    One host sync (the per-expert counts): this is the eager/CPU oracle, never captured.
    """
    t, k = topk_ids.shape
    num_local = w2.shape[0]
    inter = w2.shape[2] * (2 if w2.dtype == MXFP4 else 1)
    local = topk_ids.reshape(-1) - expert_start
    local = torch.where((local >= 0) & (local < num_local), local, num_local)  # others: a dropped bucket
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=num_local + 1).tolist()
    flat_w = topk_weights.reshape(-1).float()
    # FP8 weights dequantized to the model dtype: the same model with dequantized weights. The w8a8
    # emulation computes in float32 on the quantized values, as the kernel's float32 accumulator does.
    wdt = torch.float32 if quantize_activations else x.dtype
    out = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts[:num_local]):
        if n == 0:
            continue
        rows = order[start : start + n]
        start += n
        a, b = w13[e], w2[e]
        if a.dtype == MXFP4:  # MXFP4 kept as stored: its exact values in the model dtype
            a, b = dequantize_packed(a, w13_scale_inv[e], wdt), dequantize_packed(b, w2_scale_inv[e], wdt)
        elif w13_scale_inv is not None:
            a = dequantize_block_fp8(a, w13_scale_inv[e], split=inter, block=block).to(wdt)
            b = dequantize_block_fp8(b, w2_scale_inv[e], split=b.shape[0], block=block).to(wdt)
        h = x[rows // k]
        if quantize_activations:
            h = _fake_quant_fp8(h.float(), ue8m0)
        gate_up = F.linear(h, a, None if w13_bias is None else w13_bias[e].to(a.dtype))
        if quantize_activations:
            gate_up = gate_up.to(x.dtype).float()  # the kernel stores it in the model dtype
        gate, up = gate_up.chunk(2, dim=-1)
        h = _act_and_mul_ref(gate, up, act, swiglu_limit)
        if quantize_activations:
            h = _fake_quant_fp8(h, ue8m0)
        out[rows] = F.linear(h, b, None if w2_bias is None else w2_bias[e].to(b.dtype)).float() * flat_w[rows, None]
    return out.view(t, k, -1).sum(dim=1).to(x.dtype)
