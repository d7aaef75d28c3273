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
    (before SM89), or ``fp8_weights="dequantize"`` was asked for;
  - tensor parallel: the layer's shard on this rank does not begin and end on 128-blocks, so its rows
    would share a block (and its one factor) with another rank's.

Tensor-parallel shards whose blocks fall whole on each rank stay FP8: the weight and its
``weight_scale_inv`` are cut along whole blocks (column-parallel: output blocks; row-parallel: input
blocks, ``layers.parallel.Fp8RowParallelLinear``), so every rank computes exactly its part of the
unsplit FP8 layer. Dequantized shards are dequantized from the covering blocks only.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterable, Iterator

import torch
from torch import nn

from attnzoo.errors import ModelLoadError, WeightError
from attnzoo.layers import skinny
from attnzoo.layers.fp8 import (
    FP8, Fp8Format, Fp8Linear, Fp8MergedLinear, dequantize, fp8_gemm_supported,
)
from attnzoo.layers.moe import FusedMoE, build_experts_as
from attnzoo.layers.parallel import (
    ColumnParallelLinear, Fp8RowParallelLinear, Linear, RowParallelLinear, mark_shard,
)
from attnzoo.models.common import MergedLinear

FP8_MODES = ("auto", "fp8", "dequantize")
_SCALE = ".weight_scale_inv"
_FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _is_linear(m: nn.Module) -> bool:
    """A float linear layer, whole or a tensor-parallel shard (``weight.tp_shard``)."""
    return type(m) in (nn.Linear, Linear, ColumnParallelLinear, RowParallelLinear)


class LazyDequantized:
    """An FP8 checkpoint weight to be dequantized, not read yet: a tensor-parallel cut (``narrow``) reads
    and dequantizes only the blocks that hold its rows (``models.loader.LazyTensor``); ``to`` does all."""

    def __init__(self, w8, scale_inv, block: tuple[int, int], name: str):
        self.w8, self.scale_inv, self.block, self.name = w8, scale_inv, block, name
        self.shape, self.dtype = torch.Size(w8.shape), torch.float32

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        b = self.block[dim]
        first, stop = start // b, -(-(start + size) // b)
        end = min(stop * b, self.shape[dim])
        w = self.w8.narrow(dim, first * b, end - first * b)
        return dequantize(w, self.scale_inv.narrow(dim, first, stop - first), self.block,
                          name=self.name).narrow(dim, start - first * b, size)

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(self.shape[0])
            return self.narrow(0, start, max(0, stop - start))
        return self.to(torch.float32)[index]

    def to(self, *args, **kwargs) -> torch.Tensor:
        w8, s = (t if isinstance(t, torch.Tensor) else t.to(t.dtype) for t in (self.w8, self.scale_inv))  # read
        return dequantize(w8, s, self.block, name=self.name).to(*args, **kwargs)


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
        return {"format": _name(self.dtype), "gemm": skinny.describe(self.dtype)}


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
        self.shards: Counter = Counter()  # leaf name -> FP8 layers that are tensor-parallel shards
        self.split_blocks: dict[str, str] = {}  # leaf name -> why its shard cannot stay FP8 (kept float)
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
                        block=(self.fmt.block_n, self.fmt.block_k), ue8m0=self.fmt.ue8m0, swiglu_limit=moe.swiglu_limit)

    def _fp8_linear(self, leaf: str, sub: nn.Module) -> Fp8Linear | None:
        """The FP8 form of a float linear layer; None for a tensor-parallel shard not made of whole blocks.
        Random weights (no checkpoint) are drawn as FP8 codes on the layer's device, a rank's own shard only."""
        random = self.scaled is None and sub.weight.device.type != "meta"
        cut = getattr(sub.weight, "tp_shard", None)
        if cut is None:
            return Fp8Linear.from_linear(sub, self.fmt, random=random)
        blocks = cut.blocks(self.fmt.block_n if cut.dim == 0 else self.fmt.block_k)
        if blocks is None:
            what = "output rows" if cut.dim == 0 else "input features"
            self.split_blocks.setdefault(leaf, f"{cut.size} of {cut.full_size} {what} per rank, from {cut.start}: "
                                               f"not whole {self.fmt.block_n}-blocks")
            return None
        if type(sub) is RowParallelLinear:
            mod = Fp8RowParallelLinear(sub.in_features, sub.out_features, sub.bias is not None, self.fmt, tp=sub.tp,
                                       reduce=sub.reduce, cut=cut, device=sub.weight.device)
            if sub.bias is not None and not sub.tp.rank:
                mod.bias.data = sub.bias.data
            if random:
                mod.init_random_()
        else:  # column parallel: the bias keeps its cut
            mod = Fp8Linear.from_linear(sub, self.fmt, random=random)
            mark_shard(mod.weight, cut)
            mark_shard(mod.weight_scale_inv, blocks)
        self.shards[leaf] += 1
        return mod

    def _fp8_merged(self, name: str, sub: MergedLinear) -> Fp8MergedLinear | None:
        """The FP8 form of a merged projection; None when a part's tensor-parallel shard is not whole blocks."""
        blocks = {part: None if cut is None else cut.blocks(self.fmt.block_n) for part, cut in sub.cuts.items()}
        split = [part for part, cut in sub.cuts.items() if cut is not None and blocks[part] is None]
        if split:
            cut = sub.cuts[split[0]]
            self.split_blocks.setdefault(name, f"{split[0]}: {cut.size} of {cut.full_size} output rows per rank, "
                                               f"from {cut.start}: not whole {self.fmt.block_n}-blocks")
            return None
        mod = Fp8MergedLinear.from_linear(sub, self.fmt, random=self.scaled is None and sub.weight.device.type != "meta")
        mod.cuts, mod.scale_cuts = dict(sub.cuts), blocks
        if any(cut is not None for cut in sub.cuts.values()):
            self.shards[name] += 1
        return mod

    def _float_twin(self, mod: Fp8Linear) -> nn.Module:
        """The float layer an FP8 layer stands for (a checkpoint that stores it unquantized)."""
        bias, dev = mod.bias is not None, mod.weight.device
        if isinstance(mod, Fp8MergedLinear):
            new = MergedLinear(mod.in_features, mod.parts, bias=bias).to(dev, self.dtype)
            new.cuts = dict(mod.cuts)
            return new
        if isinstance(mod, Fp8RowParallelLinear):
            return RowParallelLinear(mod.cut.full_size, mod.out_features, bias, tp=mod.tp, reduce=mod.reduce).to(
                dev, self.dtype)
        new = Linear(mod.in_features, mod.out_features, bias=bias, device=dev, dtype=self.dtype)
        for pname in ("weight", "bias"):
            cut = getattr(getattr(mod, pname), "tp_shard", None)
            if cut is not None:
                mark_shard(getattr(new, pname), cut)
        return new

    def build(self, cls, config) -> nn.Module:
        """Build the model with FP8 layers in place: each nn.Linear (or stacked MoE) to be FP8 is replaced
        the moment it is registered, so at most one layer's bf16 weights exist at a time."""
        experts = self.keep and (self.scaled is None or any(".experts." in s for s in self.scaled))

        def swap(parent, name, sub):
            if _is_linear(sub) and self._wants_fp8(name, sub):
                return self._fp8_linear(name, sub)
            if type(sub) is MergedLinear and all(self._wants_fp8(part, sub) for part in sub.parts):
                return self._fp8_merged(name, sub)
            if experts and isinstance(sub, FusedMoE) and sub.quant is None:
                return self._fp8_moe(sub)
            return None

        # FP8 experts are built FP8 from the start: a float stack first would put a float copy of each
        # layer's experts on the GPU (7.5 GB for 128 of V3's experts) before the swap above could drop it.
        fp8_experts = build_experts_as(quant="fp8", block=(self.fmt.block_n, self.fmt.block_k), ue8m0=self.fmt.ue8m0)
        handle = nn.modules.module.register_module_module_registration_hook(swap)
        try:
            with fp8_experts if experts else contextlib.nullcontext():
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
                        mod.num_experts, mod.hidden, mod.intermediate, mod.act, experts=mod.share,
                        swiglu_limit=mod.swiglu_limit))
                continue
            parent, _, leaf = name.rpartition(".")
            if isinstance(mod, (MergedLinear, Fp8MergedLinear)):
                # FP8 only when every part is: one stacked weight has one dtype.
                fp8 = all(p in want for p in _part_modules(name, mod))
                if fp8 != isinstance(mod, Fp8MergedLinear):
                    new = self._fp8_merged(leaf, mod) if fp8 else self._float_twin(mod)
                    if new is not None:
                        setattr(model.get_submodule(parent), leaf, new)
                continue
            is_fp8 = isinstance(mod, Fp8Linear)
            if is_fp8 == (name in want) or not (is_fp8 or _is_linear(mod)):
                continue
            new = self._float_twin(mod) if is_fp8 else self._fp8_linear(leaf, mod)
            if new is not None:
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
                # Dequantized as the model reads it: a tensor-parallel rank's cut reads its blocks only.
                w = LazyDequantized(weights.pop(prefix), scales.pop(prefix), (self.fmt.block_n, self.fmt.block_k),
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
        if self.split_blocks:
            out["split_blocks"] = f"tensor-parallel shards kept {_name(self.dtype)} (not whole blocks): " + "; ".join(
                f"{leaf} ({why})" for leaf, why in sorted(self.split_blocks.items()))
        if self.shards:
            out["fp8_shards"] = (f"per rank: {sum(self.shards.values())} tensor-parallel layers "
                                 f"({', '.join(sorted(self.shards))}) hold the rank's own whole blocks in FP8")
        return out
