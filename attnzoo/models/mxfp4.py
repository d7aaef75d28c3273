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
the same way: the experts run in the model dtype (4x the bytes of MXFP4). With ``fp8_weights="mxfp4"``
the experts are kept as stored instead (``FusedMoE(quant="mxfp4")``, read by the fused MoE's MXFP4 GEMM).
The decoding math lives in ``layers.mxfp4`` (the MoE reference dequantizes with it too).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from attnzoo.errors import ModelLoadError, WeightError
from attnzoo.layers import skinny
from attnzoo.layers.moe import FusedMoE, build_experts_as
from attnzoo.layers.mxfp4 import FP4_VALUES, dequantize_mxfp4  # noqa: F401 (FP4_VALUES: re-exported)
from attnzoo.models.quantization import WeightPlan, _name

_PARTS = ("_blocks", "_scales")


class Mxfp4Plan(WeightPlan):
    """Weights stored as MXFP4 blocks dequantized to the model dtype as they stream in (the default), or,
    with ``keep``, the experts built ``FusedMoE(quant="mxfp4")`` and the blocks and scales loaded as stored
    (read by the fused MoE's MXFP4 GEMM; the CPU reference dequantizes per expert); others as stored."""

    def __init__(self, dtype: torch.dtype, device: torch.device | None = None, keep: bool = False):
        super().__init__(dtype)
        self.device = device  # where the blocks are dequantized (a GPU does it far faster than the host)
        self.keep = keep
        self.count = 0
        self.on_gpu = False  # set by finish: where the kept experts run

    def build(self, cls, config) -> nn.Module:
        if not self.keep:
            return cls(config)
        with build_experts_as(quant="mxfp4"):
            return cls(config)

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
                self.count += 1
                if self.keep:  # the experts' loader takes both parts as stored
                    for p in _PARTS:
                        yield base + p, _read(got[p])
                    continue
                blocks, scales = (_read(got[p]).to(self.device or "cpu") for p in _PARTS)
                w = dequantize_mxfp4(blocks, scales, self.dtype)
                yield base, w.transpose(-1, -2)  # the bf16 checkpoint's [E, K, N] layout, as a view
        if pending:
            base = next(iter(pending))
            raise WeightError(f"MXFP4 tensor {base!r} has {next(iter(pending[base]))} but not its pair",
                              fix="point to a complete checkpoint (all safetensors shards present)")

    def finish(self, model) -> None:
        self.on_gpu = any(isinstance(m, FusedMoE) and m.quant == "mxfp4" and m.w13.is_cuda for m in model.modules())

    def describe(self) -> dict:
        if self.keep:
            kept = f"{self.count} tensors" if self.count else "random MXFP4 codes"
            path = ("read by the fused MoE's MXFP4 path (triton w4a16)" if self.on_gpu
                    else "dequantized per expert by the MoE reference (cpu)")
            return {"format": f"mxfp4 experts ({'checkpoint' if self.count else 'random weights'}), other weights "
                              f"{_name(self.dtype)}",
                    "gemm": f"mxfp4 experts kept as stored ({kept}, fp8_weights='mxfp4'), {path}; "
                            f"{skinny.describe(self.dtype)} elsewhere"}
        if not self.count:  # load_format="random": nothing was dequantized
            return {"format": f"{_name(self.dtype)} (random weights; the config's experts are MXFP4)",
                    "gemm": skinny.describe(self.dtype)}
        return {"format": f"mxfp4 experts (checkpoint), other weights {_name(self.dtype)}",
                "gemm": f"experts dequantized to {_name(self.dtype)} at load ({self.count} tensors; "
                        f"fp8_weights='mxfp4' keeps them as stored); {skinny.describe(self.dtype)} elsewhere"}


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
    """``mode`` (load_model's ``fp8_weights``): "auto" / "dequantize" dequantize the experts at load (the
    default: the MXFP4 kernel is not yet measured against the dequantized one on a GPU); "mxfp4" keeps them."""
    if mode == "fp8":
        raise ModelLoadError("fp8_weights='fp8' was asked for, but the checkpoint is MXFP4",
                             fix="leave fp8_weights at 'auto' (MXFP4 experts are dequantized at load), or "
                                 "'mxfp4' to keep them as stored")
    return Mxfp4Plan(dtype, device, keep=mode == "mxfp4")
