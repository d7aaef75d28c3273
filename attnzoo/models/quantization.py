"""How a checkpoint's weights become the model's: as stored, or FP8 block-quantized (DeepSeek-V3's format).

An FP8 checkpoint stores some linear layers as float8_e4m3fn weights plus ``weight_scale_inv`` block
factors; which ones is the checkpoint's choice (DeepSeek: every attention projection, dense MLP, shared
and routed expert; not the embeddings, norms, router or lm_head). ``WeightPlan.build`` makes exactly those
layers ``Fp8Linear`` (``Fp8MergedLinear`` where the model stacks them: gate/up, q/k/v, q_a/kv_a) while the model is
built, so a GPU never holds a bf16 copy of them, and the weights stream in as stored. Layers are
dequantized at load instead (to the model dtype) when:
  - the model reads the layer's weight as a matrix rather than calling it (``CausalLM.matrix_weights``:
    absorbed MLA folds ``kv_b_proj`` into the query and the output);
  - the run is on CPU (the reference path: plain float GEMMs), or the GPU has no FP8 tensor cores
    (before SM89), or ``fp8_weights="dequantize"`` was asked for.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Iterator

import torch
from torch import nn

from attnzoo.errors import ModelLoadError, WeightError
from attnzoo.layers.fp8 import FP8, Fp8Format, Fp8Linear, Fp8MergedLinear, dequantize, fp8_gemm_supported
from attnzoo.layers.moe import FusedMoE
from attnzoo.layers.parallel import ColumnParallelLinear, RowParallelLinear
from attnzoo.models.common import MergedLinear

FP8_MODES = ("auto", "fp8", "dequantize")
_SCALE = ".weight_scale_inv"
_FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _whole_linear(m: nn.Module) -> bool:
    """A linear layer holding its whole weight: nn.Linear, or a parallel one at tensor parallel size 1.
    Tensor-parallel shards stay in the model dtype (their FP8 weights are dequantized, then cut)."""
    return type(m) is nn.Linear or (
        type(m) in (ColumnParallelLinear, RowParallelLinear) and getattr(m.weight, "tp_shard", None) is None)


def _whole_merged(m: nn.Module) -> bool:
    """A MergedLinear holding every part whole (not a tensor-parallel shard)."""
    return type(m) is MergedLinear and all(cut is None for cut in m.cuts.values())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _part_modules(name: str, merged) -> list[str]:
    """The checkpoint modules a merged projection stacks (its siblings: ``mlp.gate_proj``, ``mlp.up_proj``)."""
    parent = name.rpartition(".")[0]
    return [f"{parent}.{part}".lstrip(".") for part in merged.parts]


class WeightPlan:
    """Unquantized checkpoints: weights load as stored (cast to the model dtype), GEMMs are F.linear."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def build(self, cls, config) -> nn.Module:
        return cls(config)

    def tensors(self, model, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in stream:
            if name.endswith(_SCALE) or t.dtype in _FP8_TYPES:
                raise WeightError(
                    f"checkpoint tensor {name!r} belongs to an FP8 block-quantized checkpoint, but config.json has "
                    "no quantization_config", fix='add the checkpoint\'s quantization_config ({"quant_method": "fp8", '
                    '"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}) to config.json')
            yield name, t

    def finish(self, model) -> None:
        pass

    def describe(self) -> dict:
        return {"format": _name(self.dtype), "gemm": f"torch linear ({_name(self.dtype)})"}


class Fp8Plan(WeightPlan):
    def __init__(self, fmt: Fp8Format, cls, device: torch.device, dtype: torch.dtype, mode: str,
                 checkpoint_names: Iterable[str] | None):
        super().__init__(dtype)
        self.fmt, self.device = fmt, device
        self.matrix_weights = tuple(getattr(cls, "matrix_weights", ()))
        # Checkpoint module names that carry block factors; None for random weights (every eligible
        # linear layer is FP8 then, as in DeepSeek's checkpoints).
        self.scaled = None if checkpoint_names is None else {
            n[: -len(_SCALE)] for n in checkpoint_names if n.endswith(_SCALE)}
        self.leaves = {s.rsplit(".", 1)[-1] for s in self.scaled or ()}
        if self.scaled is not None and not self.scaled:
            raise WeightError(
                "config.json declares an FP8 block-quantized checkpoint, but no tensor is named '*.weight_scale_inv'",
                fix="point to the FP8 checkpoint the config belongs to, or remove quantization_config from config.json")
        if mode == "dequantize":
            self.keep, self.why = False, "fp8_weights='dequantize'"
        elif device.type == "cpu":
            self.keep, self.why = mode == "fp8", "cpu (the reference path)"
        elif fp8_gemm_supported(device):
            self.keep, self.why = True, ""
        elif mode == "fp8":
            cap = "sm%d%d" % torch.cuda.get_device_capability(device)
            raise ModelLoadError(f"fp8_weights='fp8' was asked for, but this GPU ({cap}) has no FP8 tensor cores",
                                 fix="use an SM89+ GPU (Ada, Hopper, Blackwell), or fp8_weights='auto'/'dequantize'")
        else:
            cap = "sm%d%d" % torch.cuda.get_device_capability(device)
            self.keep, self.why = False, f"{cap} has no FP8 tensor cores"
        self.dequantized: Counter = Counter()  # leaf name -> layers dequantized at load
        self.gemms: Counter = Counter()
        self.fp8_modules: set[str] = set()
        self.fp8_moes: tuple[str, ...] = ()

    # ------------------------------------------------------------------ build

    def _wants_fp8(self, leaf: str, linear: nn.Linear) -> bool:
        if not self.keep or leaf in self.matrix_weights or linear.weight.dtype != torch.get_default_dtype():
            return False  # float32 layers (e.g. V3.2's indexer weights_proj) are never FP8 in checkpoints
        return leaf != "lm_head" if self.scaled is None else leaf in self.leaves

    def _fp8_moe(self, moe: FusedMoE) -> FusedMoE:
        return FusedMoE(moe.num_experts, moe.hidden, moe.intermediate, moe.act, quant="fp8", experts=moe.share,
                        block=(self.fmt.block_n, self.fmt.block_k), ue8m0=self.fmt.ue8m0)

    def build(self, cls, config) -> nn.Module:
        """Build the model with FP8 layers in place: each nn.Linear (or stacked MoE) to be FP8 is replaced
        the moment it is registered, so at most one layer's bf16 weights exist at a time."""
        experts = self.keep and (self.scaled is None or any(".experts." in s for s in self.scaled))

        def swap(parent, name, sub):
            if _whole_linear(sub) and self._wants_fp8(name, sub):
                return Fp8Linear.from_linear(sub, self.fmt, quantize=self.scaled is None)
            if _whole_merged(sub) and all(self._wants_fp8(part, sub) for part in sub.parts):
                return Fp8MergedLinear.from_linear(sub, self.fmt, quantize=self.scaled is None)
            if experts and isinstance(sub, FusedMoE) and sub.quant is None:
                return self._fp8_moe(sub)
            return None

        handle = nn.modules.module.register_module_module_registration_hook(swap)
        try:
            model = cls(config)
        finally:
            handle.remove()
        if self.scaled is not None:
            self._reconcile(model)
        self.fp8_modules = set()  # checkpoint-side module names
        for n, m in model.named_modules():
            if isinstance(m, Fp8Linear):
                self.fp8_modules.update(_part_modules(n, m) if isinstance(m, Fp8MergedLinear) else [n])
        self.fp8_moes = tuple(n + "." for n, m in model.named_modules() if isinstance(m, FusedMoE) and m.quant)
        return model

    def _target(self, model, ckpt_module: str) -> str | None:
        name = model.checkpoint_name(ckpt_module + ".weight")
        return None if name is None else name[: -len(".weight")]

    def _reconcile(self, model) -> None:
        """Leaf names chose the layers during the build; make the choice exact per layer."""
        want = set()
        for s in self.scaled:
            t = self._target(model, s)
            if t is not None and self.keep and t.rsplit(".", 1)[-1] not in self.matrix_weights:
                want.add(t)
        for name, mod in list(model.named_modules()):
            if isinstance(mod, FusedMoE):
                fp8 = self.keep and any(t.startswith(name + ".") for t in want)
                if fp8 != (mod.quant == "fp8"):
                    parent, _, leaf = name.rpartition(".")
                    setattr(model.get_submodule(parent), leaf, self._fp8_moe(mod) if fp8 else FusedMoE(
                        mod.num_experts, mod.hidden, mod.intermediate, mod.act, experts=mod.share))
                continue
            if isinstance(mod, (MergedLinear, Fp8MergedLinear)):
                # FP8 only when every part is: one stacked weight has one dtype.
                fp8 = all(p in want for p in _part_modules(name, mod)) and (
                    isinstance(mod, Fp8MergedLinear) or _whole_merged(mod))
                if fp8 != isinstance(mod, Fp8MergedLinear):
                    parent, _, leaf = name.rpartition(".")
                    new = Fp8MergedLinear.from_linear(mod, self.fmt, quantize=False) if fp8 else MergedLinear(
                        mod.in_features, mod.parts, bias=mod.bias is not None).to(mod.weight.device, self.dtype)
                    setattr(model.get_submodule(parent), leaf, new)
                continue
            is_fp8 = isinstance(mod, Fp8Linear)
            if is_fp8 == (name in want) or not (is_fp8 or _whole_linear(mod)):
                continue
            parent, _, leaf = name.rpartition(".")
            if is_fp8:
                new = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                device=mod.weight.device, dtype=self.dtype)
            else:
                new = Fp8Linear.from_linear(mod, self.fmt, quantize=False)
            setattr(model.get_submodule(parent), leaf, new)

    # ------------------------------------------------------------------ load

    def tensors(self, model, stream):
        """The checkpoint's tensors, with the FP8 weights of layers that are not Fp8Linear dequantized
        (weight and factors may arrive in either order, from different shards)."""
        kept = set()
        for s in self.scaled:
            t = self._target(model, s)
            if t is not None and (t in self.fp8_modules or t.startswith(self.fp8_moes)):
                kept.add(s)
        weights: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        for name, t in stream:
            if name.endswith(_SCALE):
                prefix, store = name[: -len(_SCALE)], scales
            elif name.endswith(".weight") and t.dtype == FP8:
                prefix, store = name[: -len(".weight")], weights
            elif t.dtype in _FP8_TYPES:
                raise WeightError(f"tensor {name!r} is {_name(t.dtype)}; FP8 checkpoints here are float8_e4m3fn",
                                  fix="use a checkpoint in the official DeepSeek FP8 format (e4m3)")
            else:
                yield name, t
                continue
            if prefix in kept or model.checkpoint_name(name) is None:
                yield name, t
                continue
            store[prefix] = t
            if prefix in weights and prefix in scales:
                w = dequantize(weights.pop(prefix), scales.pop(prefix), (self.fmt.block_n, self.fmt.block_k),
                               name=prefix + ".weight")
                self.dequantized[prefix.rsplit(".", 1)[-1]] += 1
                yield prefix + ".weight", w
        if weights:
            raise WeightError(f"FP8 weight {next(iter(weights))}.weight has no {_SCALE[1:]} tensor",
                              fix="point to a complete checkpoint (all safetensors shards present)")
        if scales:
            raise WeightError(f"{next(iter(scales))}{_SCALE} has no FP8 weight beside it",
                              fix="point to a complete checkpoint (all safetensors shards present)")

    def finish(self, model) -> None:
        for mod in model.modules():
            if isinstance(mod, Fp8Linear):
                self.gemms[mod.prepare(self.dtype)] += 1
            elif isinstance(mod, FusedMoE) and mod.quant == "fp8":
                on_gpu = mod.w13.is_cuda
                self.gemms["fused MoE, triton w8a8 block fp8" if on_gpu else "MoE reference (float32, cpu)"] += 1

    def describe(self) -> dict:
        out = {"format": self.fmt.describe() + (" (checkpoint)" if self.scaled is not None else " (random weights)")}
        if self.gemms:
            out["gemm"] = "; ".join(f"{path}: {n} layers" for path, n in self.gemms.items())
        else:
            out["gemm"] = f"dequantized to {_name(self.dtype)} at load: {self.why}"
        if self.dequantized:
            text = (f"{sum(self.dequantized.values())} layers ({', '.join(sorted(self.dequantized))}) "
                    f"to {_name(self.dtype)}")
            as_matrix = sorted(leaf for leaf in self.dequantized if leaf in self.matrix_weights)
            if not self.keep:
                text += f": {self.why}"
            elif as_matrix:
                text += f": the model reads the weight of {', '.join(as_matrix)} as a matrix"
            out["dequantized_at_load"] = text
        return out


def plan_weights(config, cls, *, device: torch.device, dtype: torch.dtype, mode: str,
                 checkpoint_names: Iterable[str] | None) -> WeightPlan:
    """The plan for this config: FP8 when its quantization_config says so (other quantizations raise)."""
    if mode not in FP8_MODES:
        raise ModelLoadError(f"unknown fp8_weights {mode!r}", fix=f"use one of: {', '.join(FP8_MODES)}")
    fmt = Fp8Format.from_config(config)
    if fmt is None:
        if mode == "fp8":
            raise ModelLoadError("fp8_weights='fp8' was asked for, but the checkpoint is not FP8 block-quantized",
                                 fix="leave fp8_weights at 'auto' (weights load as stored)")
        return WeightPlan(dtype)
    return Fp8Plan(fmt, cls, device, dtype, mode, checkpoint_names)

