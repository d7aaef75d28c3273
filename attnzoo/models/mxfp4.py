"""MXFP4 expert weights (gpt-oss's official checkpoints), dequantized at load to the model dtype.

The checkpoint stores each stacked expert weight W [E, N, K] (N output rows, K inputs) as
``<name>_blocks`` uint8 [E, N, K/32, 16] and ``<name>_scales`` uint8 [E, N, K/32]: every 32 consecutive
inputs of a row are one block of FP4 (e2m1) codes, two per byte (low nibble first), times one power of
two 2^(scale - 127) per block (the OCP MX format). ``dequantize_mxfp4`` returns W itself, [E, N, K];
transformers' ``integrations.mxfp4.convert_moe_packed_tensors`` returns its transpose [E, K, N], the
layout of transformers' ``GptOssExperts`` parameters and of a bf16 gpt-oss checkpoint.

``Mxfp4Plan`` (``models.weights.plan_weights`` picks it for ``quant_method: "mxfp4"``) pairs each
``_blocks`` with its ``_scales`` in the checkpoint stream and yields the dequantized weight under the
bf16 checkpoint's name and layout (a transposed view, no copy), so the model loads either checkpoint
the same way. No kernel reads MXFP4 here: the experts run in the model dtype (4x the bytes of MXFP4).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from attnzoo.errors import ModelLoadError, WeightError
from attnzoo.models.quantization import WeightPlan, _name

# e2m1 code -> value; bit 3 is the sign
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PARTS = ("_blocks", "_scales")
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


class Mxfp4Plan(WeightPlan):
    """Weights stored as MXFP4 blocks dequantized to the model dtype as they stream in; others as stored."""

    def __init__(self, dtype: torch.dtype, device: torch.device | None = None):
        super().__init__(dtype)
        self.device = device  # where the blocks are dequantized (a GPU does it far faster than the host)
        self.count = 0

    def tensors(self, model, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in stream:
            part = next((p for p in _PARTS if name.endswith(p)), None)
            if part is None:
                yield name, t
                continue
            base = name[: -len(part)]
            got = pending.setdefault(base, {})
            got[part] = t
            if len(got) == 2:
                del pending[base]
                blocks, scales = (_read(got[p]).to(self.device or "cpu") for p in _PARTS)
                w = dequantize_mxfp4(blocks, scales, self.dtype)
                self.count += 1
                yield base, w.transpose(-1, -2)  # the bf16 checkpoint's [E, K, N] layout, as a view
        if pending:
            base = next(iter(pending))
            raise WeightError(f"MXFP4 tensor {base!r} has {next(iter(pending[base]))} but not its pair",
                              fix="point to a complete checkpoint (all safetensors shards present)")

    def describe(self) -> dict:
        if not self.count:  # load_format="random": nothing was dequantized
            return {"format": f"{_name(self.dtype)} (random weights; the config's experts are MXFP4)",
                    "gemm": f"torch linear ({_name(self.dtype)})"}
        return {"format": f"mxfp4 experts (checkpoint), other weights {_name(self.dtype)}",
                "gemm": f"experts dequantized to {_name(self.dtype)} at load ({self.count} tensors): no MXFP4 "
                        f"kernel here; torch linear ({_name(self.dtype)}) elsewhere"}


def _read(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.to(t.dtype)  # a loader.LazyTensor: read it whole


def is_mxfp4(config) -> bool:
    text = getattr(config, "text_config", None) or config
    qc = getattr(text, "quantization_config", None) or getattr(config, "quantization_config", None)
    if qc is None:
        return False
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc.get("quant_method") == "mxfp4"


def plan_mxfp4(dtype: torch.dtype, mode: str, device: torch.device | None = None) -> Mxfp4Plan:
    if mode == "fp8":
        raise ModelLoadError("fp8_weights='fp8' was asked for, but the checkpoint is MXFP4",
                             fix="leave fp8_weights at 'auto' (MXFP4 experts are dequantized at load)")
    return Mxfp4Plan(dtype, device)
