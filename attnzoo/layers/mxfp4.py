"""MXFP4 (OCP MX, gpt-oss's expert weights): the decoding math shared by the checkpoint loader
(``models.mxfp4``), the MoE oracle (``layers.moe.reference``) and the fused MoE's tests.

A weight W [..., N, K] is stored as FP4 (e2m1) codes, two per byte (the even k in the low nibble), one
E8M0 scale byte per 32 consecutive k of a row: value = fp4(code) * 2^(scale - 127). The checkpoint
groups the bytes per block (``blocks`` [..., N, K/32, 16]); the fused MoE keeps them flat
(``packed`` [..., N, K/2], the same bytes) beside ``scales`` [..., N, K/32].
"""
from __future__ import annotations

import torch

from attnzoo.errors import WeightError

# e2m1 code -> value; bit 3 is the sign
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
_CHUNK = 1 << 24  # values dequantized at a time


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., N, G, 16] and scales uint8 [..., N, G] -> [..., N, G * 32] in ``dtype``.
    Every value is an FP4 code times a power of two: exact in bfloat16 and float32 (within range)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise WeightError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair",
                          fix="blocks must be [..., G, 16] bytes with scales [..., G], one per 32 values")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype, device=blocks.device)
    flat_b, flat_s, flat_o = blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1]), out.view(
        -1, out.shape[-1])
    rows = max(1, _CHUNK // (blocks.shape[-2] * 32))  # bounds the int64 code indices' memory
    for r in range(0, flat_b.shape[0], rows):
        b = flat_b[r : r + rows].to(torch.uint8)
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2).long()  # [rows, G, 32], low nibble first
        exp = flat_s[r : r + rows].to(torch.int32) - 127
        flat_o[r : r + rows] = torch.ldexp(lut[codes], exp[..., None].float()).flatten(-2).to(dtype)
    return out


def dequantize_packed(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The fused MoE's layout: packed uint8 [..., N, K/2] with scales uint8 [..., N, K/32] -> [..., N, K]."""
    if packed.shape[-1] != scales.shape[-1] * 16:
        raise WeightError(f"MXFP4 packed weight {tuple(packed.shape)} and scales {tuple(scales.shape)} do not pair",
                          fix="packed must be [..., N, K/2] bytes with scales [..., N, K/32]")
    return dequantize_mxfp4(packed.reshape(*scales.shape, 16), scales, dtype)
