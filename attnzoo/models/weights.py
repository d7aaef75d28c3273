"""Which weight plan a checkpoint loads with: as stored, FP8 block-scaled (``models.quantization``) or MXFP4
experts dequantized at load or kept (``models.mxfp4``), from its quantization_config."""
from __future__ import annotations

from typing import Iterable

import torch

from attnzoo.errors import ModelLoadError
from attnzoo.models import mxfp4
from attnzoo.models.quantization import FP8_MODES, Fp8Format, Fp8Plan, WeightPlan

# load_model's fp8_weights: the FP8 modes, and "mxfp4" (an MXFP4 checkpoint's experts kept as stored)
WEIGHT_MODES = FP8_MODES + ("mxfp4",)


def plan_weights(config, cls, *, device: torch.device, dtype: torch.dtype, mode: str,
                 checkpoint_names: Iterable[str] | None) -> WeightPlan:
    """The plan for this config: FP8 or MXFP4 (``models.mxfp4``: dequantized at load, or kept as stored
    under ``mode="mxfp4"``) when its quantization_config says so (other quantizations raise)."""
    if mode not in WEIGHT_MODES:
        raise ModelLoadError(f"unknown fp8_weights {mode!r}", fix=f"use one of: {', '.join(WEIGHT_MODES)}")
    if mxfp4.is_mxfp4(config):
        return mxfp4.plan_mxfp4(dtype, mode, device)
    if mode == "mxfp4":
        raise ModelLoadError("fp8_weights='mxfp4' was asked for, but the checkpoint is not MXFP4",
                             fix="leave fp8_weights at 'auto'; 'mxfp4' keeps an MXFP4 checkpoint's experts as stored")
    fmt = Fp8Format.from_config(config)
    if fmt is None:
        if mode == "fp8":
            raise ModelLoadError("fp8_weights='fp8' was asked for, but the checkpoint is not FP8 block-quantized",
                                 fix="leave fp8_weights at 'auto' (weights load as stored)")
        return WeightPlan(dtype)
    return Fp8Plan(fmt, cls, device, dtype, mode, checkpoint_names)

