"""``FusedMoE``: a layer's routed experts (or one rank's share) as stacked weights, the fused path on CUDA and
the reference elsewhere, and the checkpoint tensors' way into the stacked parameters."""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Callable

import torch
from torch import nn

from attnzoo.errors import ModelLoadError, WeightError
from attnzoo.layers.fp8 import CODE_RMS, random_codes_
from attnzoo.layers.moe.fused import fused_moe
from attnzoo.layers.moe.reference import ACTIVATIONS, FP8, MXFP4, _cdiv, moe_reference
from attnzoo.layers.mxfp4 import BLOCK as MXFP4_BLOCK
from attnzoo.layers.mxfp4 import FP4_VALUES
from attnzoo.layers.moe.routing import _fused_triton


# The weight format of the FusedMoE layers a model builds unquantized, set by ``build_experts_as``.
_BUILD_AS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("attnzoo_fused_moe_build_as", default=None)


@contextlib.contextmanager
def build_experts_as(**kwargs):
    """FusedMoE layers constructed without ``quant`` inside this block take ``kwargs`` (quant, block, ue8m0)
    instead: an FP8 weight plan builds a model's experts FP8 from the start, so no float copy of an expert
    stack is ever allocated (models.quantization)."""
    token = _BUILD_AS.set(kwargs)
    try:
        yield
    finally:
        _BUILD_AS.reset(token)


# Rows up to which the shared experts run beside the routed ones (``FusedMoE.forward``): decode's small batches
# (benchmarks/results/README.md, moe_shared_overlap).
SHARED_OVERLAP_ROWS = 256
# One side stream a device, entered only by FusedMoE.forward's fork, which first makes it wait for the current
# stream: the shared output (allocated there, read by the sum on the current stream) needs no record_stream, as
# the next work that could reuse its memory is ordered after that sum.
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(x: torch.Tensor) -> torch.cuda.Stream | None:
    """The stream the shared experts of ``x``'s device run on, made at first use; None off CUDA (and under the
    interpreter, whose launches ignore streams)."""
    if not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


# checkpoint projection -> (stacked parameter, which half of w13)
_PROJECTIONS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
# transformers' stacked expert tensors (Gemma 4, gpt-oss) and their biases (gpt-oss)
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2", "gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias",
            # MXFP4 (gpt-oss's checkpoints): W [E, N, K] as blocks [E, N, K/32, 16] bytes and E8M0 scales [E, N, K/32]
            "gate_up_proj_blocks": "w13", "gate_up_proj_scales": "w13_scale_inv",
            "down_proj_blocks": "w2", "down_proj_scales": "w2_scale_inv"}
_FP4_RMS = (sum(v * v for v in FP4_VALUES) / len(FP4_VALUES)) ** 0.5  # of uniformly random codes
# How a checkpoint stacks them: "gate_up" [E, 2I, H] gate rows then up rows, down [E, H, I] (Gemma 4);
# "interleaved_t" [E, H, 2I] with gate and up alternating along 2I, down [E, I, H] (gpt-oss).
STACKED_LAYOUTS = ("gate_up", "interleaved_t")


class FusedMoE(nn.Module):
    """A layer's routed experts (or the contiguous share ``experts`` of them) as stacked weights.

    forward(x [T, H], topk_weights [T, k] float32, topk_ids [T, k] global ids) -> [T, H]: the fused
    Triton path on CUDA, the per-expert reference elsewhere. Checkpoint tensors reach the stacked
    parameters through ``load_checkpoint_tensor`` (per-expert ``{e}.gate_proj.weight`` / ``up_proj`` /
    ``down_proj`` and their ``.weight_scale_inv``, or stacked ``gate_up_proj`` / ``down_proj``).
    ``quant="mxfp4"`` keeps MXFP4 experts as stored (stacked ``*_blocks`` / ``*_scales``): ``w13`` / ``w2``
    uint8 [E, N, K/2] and ``w13_scale_inv`` / ``w2_scale_inv`` uint8 E8M0 [E, N, K/32] (``fused_moe``'s
    MXFP4 layout; the reference path dequantizes them per expert).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu", *,
                 experts: range | None = None, quant: str | None = None, block=(128, 128), ue8m0: bool = False,
                 init_std: float = 0.02, bias: bool = False, stacked_layout: str = "gate_up", swiglu_limit: float = 0.0):
        super().__init__()
        build_as = _BUILD_AS.get()
        if quant is None and build_as is not None:
            quant, block, ue8m0 = build_as["quant"], build_as.get("block", block), build_as.get("ue8m0", ue8m0)
        experts = range(num_experts) if experts is None else experts
        if not (isinstance(experts, range) and experts.step == 1 and len(experts)
                and 0 <= experts.start and experts.stop <= num_experts):
            raise ModelLoadError(f"expert share {experts!r} is not a non-empty contiguous range of 0..{num_experts - 1}",
                                 fix="give each rank range(start, stop) of the layer's experts")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"MoE activation {act!r} is not supported", fix=f"use one of {ACTIVATIONS}")
        if quant not in (None, "fp8", "mxfp4"):
            raise ModelLoadError(f"MoE weight format {quant!r} is not supported", fix="use quant=None, 'fp8' or 'mxfp4'")
        if quant == "mxfp4" and (hidden % MXFP4_BLOCK or intermediate % MXFP4_BLOCK):
            raise ModelLoadError(f"MXFP4 experts need hidden ({hidden}) and intermediate ({intermediate}) multiples of "
                                 f"{MXFP4_BLOCK}", fix="load the experts dequantized (fp8_weights='auto')")
        if stacked_layout not in STACKED_LAYOUTS:
            raise ModelLoadError(f"stacked expert layout {stacked_layout!r} is unknown", fix=f"use one of {STACKED_LAYOUTS}")
        self.stacked_layout = stacked_layout
        self.num_experts, self.hidden, self.intermediate, self.act = num_experts, hidden, intermediate, act
        self.swiglu_limit = float(swiglu_limit or 0.0)  # > 0: gate and up clamped (DeepSeek-V4)
        self.expert_start, self.num_local = experts.start, len(experts)
        self.quant, self.block = quant, tuple(block)
        self.ue8m0 = quant == "fp8" and ue8m0  # FP8 activation scales rounded up to powers of two (scale_fmt)
        shapes = {"w13": (self.num_local, 2 * intermediate, hidden), "w2": (self.num_local, hidden, intermediate)}
        for name, shape in shapes.items():
            if quant == "mxfp4":
                # Random codes and one scale giving the float experts' spread (init_std), as the FP8 branch.
                n, k = shape[1], shape[2]
                codes = torch.randint(0, 256, (self.num_local, n, k // 2), dtype=torch.int32).to(MXFP4)
                exp = 127 + round(math.log2(init_std / _FP4_RMS))
                setattr(self, name, nn.Parameter(codes, requires_grad=False))
                setattr(self, name + "_scale_inv", nn.Parameter(
                    torch.full((self.num_local, n, k // MXFP4_BLOCK), exp, dtype=MXFP4), requires_grad=False))
            elif quant is None:
                # Initialised (not torch.empty) so that load_format="random" models compute finite numbers.
                setattr(self, name, nn.Parameter(torch.empty(shape).normal_(0, init_std)))
            else:
                # Random FP8 codes drawn for the whole stack at once, on its device, and block multipliers
                # giving the float experts' spread (init_std): no float copy of the stack, no loop over experts.
                setattr(self, name, nn.Parameter(random_codes_(torch.empty(shape, dtype=FP8)), requires_grad=False))
                setattr(self, name + "_scale_inv", nn.Parameter(
                    torch.full(self._scale_shape(name), init_std / CODE_RMS, dtype=torch.float32), requires_grad=False))
        # Per-expert biases (gpt-oss): w13_bias [E_local, 2I] gate then up, w2_bias [E_local, H].
        self.w13_bias = nn.Parameter(torch.zeros(self.num_local, 2 * intermediate)) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(self.num_local, hidden)) if bias else None
        self._loaded: set[tuple[str, int, int]] = set()

    def _scale_shape(self, name: str) -> tuple[int, int, int]:
        bn, bk = self.block
        if name == "w13":
            return self.num_local, 2 * _cdiv(self.intermediate, bn), _cdiv(self.hidden, bk)
        return self.num_local, _cdiv(self.hidden, bn), _cdiv(self.intermediate, bk)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must neither widen the FP8 weights nor round their float32 multipliers: what a
        # conversion changed the dtype of is put back from the original (moved to the new device).
        kept = {n: getattr(self, n).data for n in ("w13", "w2", "w13_scale_inv", "w2_scale_inv")} if self.quant else {}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            p = getattr(self, name)
            if p.dtype != before.dtype:
                p.data = before.to(p.device)
        return self

    def extra_repr(self) -> str:
        share = f"experts {self.expert_start}..{self.expert_start + self.num_local - 1} of {self.num_experts}"
        quant = f"{self.quant}, ue8m0 scales" if self.ue8m0 else self.quant
        bias = ", bias" if self.w13_bias is not None else ""
        return f"{share}, hidden={self.hidden}, intermediate={self.intermediate}, act={self.act}, quant={quant}{bias}"

    @property
    def share(self) -> range:
        """The global ids of the experts held here (this rank's share under expert parallelism)."""
        return range(self.expert_start, self.expert_start + self.num_local)

    def holds(self, expert: int) -> bool:
        """Whether expert ``expert`` (global id) is held here: the one place that says which rank owns it
        (checkpoint loaders ask this before reading or dequantizing an expert's tensors)."""
        return self.expert_start <= expert < self.expert_start + self.num_local

    def _weights(self) -> dict:
        biases = {"w13_bias": self.w13_bias, "w2_bias": self.w2_bias} if self.w13_bias is not None else {}
        if self.quant is None:
            return biases
        if self.quant == "mxfp4":
            return {**biases, "w13_scale_inv": self.w13_scale_inv, "w2_scale_inv": self.w2_scale_inv}
        return {**biases, "w13_scale_inv": self.w13_scale_inv, "w2_scale_inv": self.w2_scale_inv, "block": self.block,
                "ue8m0": self.ue8m0}

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                add: torch.Tensor | None = None, shared: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> torch.Tensor:
        """-> the experts' weighted sum per token [T, H], plus ``add`` [T, H] or ``shared(x)`` (the shared
        experts' output; the same kernel on a GPU). At up to ``SHARED_OVERLAP_ROWS`` rows on a GPU ``shared``
        runs on a side stream beside the routed experts' GEMMs, which leave most of the bandwidth idle there; so
        ``shared`` must not synchronise with the host or run collectives (DeepSeek's reduces after the sum)."""
        side = None
        if shared is not None:
            if add is not None:
                raise ValueError("FusedMoE: pass the shared experts as add= (their output) or shared=, not both")
            side = _side_stream(x) if x.shape[0] <= SHARED_OVERLAP_ROWS else None
            if side is None:
                add = shared(x)
        if side is None:
            return self._routed(x, topk_weights, topk_ids, add)
        side.wait_stream(torch.cuda.current_stream(x.device))
        try:
            with torch.cuda.stream(side):
                add = shared(x)
            return self._routed(x, topk_weights, topk_ids, add, add_stream=side)
        finally:  # joined on every path: an error must not leave a capture unjoined or x read after its free
            torch.cuda.current_stream(x.device).wait_stream(side)

    def _routed(self, x, topk_weights, topk_ids, add, add_stream=None) -> torch.Tensor:
        """The routed experts' weighted sum plus ``add``: the fused path, or the reference (``add_stream`` is
        set only on CUDA, where the fused path runs)."""
        if _fused_triton(x):
            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, act=self.act,
                             expert_start=self.expert_start, holds_all_experts=self.num_local == self.num_experts,
                             add=add, swiglu_limit=self.swiglu_limit, add_stream=add_stream, **self._weights())
        # FP8 on CPU: the w8a8 arithmetic in float32, as Fp8Linear's CPU emulation.
        out = moe_reference(x, self.w13, self.w2, topk_weights, topk_ids, act=self.act,
                            expert_start=self.expert_start, quantize_activations=self.quant == "fp8",
                            swiglu_limit=self.swiglu_limit, **self._weights())
        return out if add is None else out + add

    # -- loading --------------------------------------------------------------------------------

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor, *, full_name: str | None = None) -> None:
        """Copy one checkpoint tensor (``name`` relative to this module) into its slice of the stacked
        parameters; tensors of experts held by other ranks are skipped."""
        full_name = full_name or name
        parts = name.split(".")
        if len(parts) == 1 and parts[0] in _STACKED:
            param = _STACKED[parts[0]]
            if tensor.shape[0] != self.num_experts:
                raise WeightError(f"stacked expert tensor {full_name!r} has {tensor.shape[0]} experts, expected "
                                  f"{self.num_experts}", fix="the checkpoint does not match its config.json")
            packed = parts[0].endswith(("_blocks", "_scales"))
            if packed:
                self._check_mxfp4(full_name, tensor)
            if getattr(self, param) is None:
                raise WeightError(f"checkpoint tensor {full_name!r} is an expert bias, but these experts have none",
                                  fix="build the MoE with bias=True for this checkpoint")
            if not packed and not param.endswith("_bias"):
                self._check_format(full_name, tensor, False)
            share = tensor[self.expert_start : self.expert_start + self.num_local]
            if parts[0].endswith("_blocks"):  # [E, N, K/32, 16] -> [E, N, K/2], the same bytes
                share = share.reshape(*share.shape[:2], -1)
            share = self._packed_layout(param, share) if packed else self._from_layout(param, share)
            self._copy(getattr(self, param), share, full_name)
            halves = (0, 1) if param.startswith("w13") else (0,)
            self._loaded.update((param, e, h) for e in range(self.num_local) for h in halves)
            return
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _PROJECTIONS \
                or parts[2] not in ("weight", "weight_scale_inv"):
            raise WeightError(f"checkpoint tensor {full_name!r} is not an expert weight",
                              fix="check that config.json's architectures matches the weights")
        expert = int(parts[0])
        if expert >= self.num_experts:
            raise WeightError(f"checkpoint tensor {full_name!r} names expert {expert} of {self.num_experts}",
                              fix="the checkpoint does not match its config.json (n_routed_experts)")
        if not self.holds(expert):
            return
        e = expert - self.expert_start
        param, half = _PROJECTIONS[parts[1]]
        scale = parts[2] == "weight_scale_inv"
        self._check_format(full_name, tensor, scale)
        if scale:
            param += "_scale_inv"
        dst = getattr(self, param)[e]
        if param.startswith("w13"):
            rows = dst.shape[0] // 2
            dst = dst[half * rows : (half + 1) * rows]
        self._copy(dst, tensor, full_name)
        self._loaded.add((param, e, half))

    def _packed_layout(self, param: str, share: torch.Tensor) -> torch.Tensor:
        """MXFP4 bytes or scales [E, N, ...] are stored by output row N already: only gpt-oss's interleaved
        gate / up rows move."""
        if self.stacked_layout == "interleaved_t" and param.startswith("w13"):
            share = torch.cat([share[:, 0::2], share[:, 1::2]], dim=1)
        return share

    def _check_mxfp4(self, full_name: str, tensor: torch.Tensor) -> None:
        if self.quant != "mxfp4" or tensor.dtype != MXFP4:
            raise WeightError(f"expert tensor {full_name!r} ({tensor.dtype}) is MXFP4, but these experts are built "
                              f"{self.quant or 'unquantized'}", fix="load MXFP4 checkpoints through models.mxfp4's "
                              "plan (load_model does): it dequantizes them, or keeps them with fp8_weights='mxfp4'")

    def _from_layout(self, param: str, share: torch.Tensor) -> torch.Tensor:
        """A stacked checkpoint tensor's share of experts in this module's layout (``stacked_layout``)."""
        if self.stacked_layout == "gate_up":
            return share
        if share.dim() == 3:  # [E, in, out] -> [E, out, in]
            share = share.transpose(1, 2)
        if param.startswith("w13"):  # gate, up, gate, up... rows -> gate rows then up rows
            share = torch.cat([share[:, 0::2], share[:, 1::2]], dim=1)
        return share

    def _check_format(self, full_name: str, tensor: torch.Tensor, scale: bool) -> None:
        if self.quant == "mxfp4":
            raise WeightError(f"expert tensor {full_name!r} ({tensor.dtype}) does not fit experts kept MXFP4",
                              fix="keep experts MXFP4 (fp8_weights='mxfp4') only for an MXFP4 checkpoint")
        fp8 = self.quant == "fp8"
        if (scale and not fp8) or (not scale and fp8 != (tensor.dtype == FP8)):
            raise WeightError(
                f"expert tensor {full_name!r} ({tensor.dtype}) does not fit experts built "
                f"{'FP8 block-quantized' if fp8 else 'unquantized'}",
                fix="build the MoE with quant='fp8' for an FP8 block-quantized checkpoint, quant=None otherwise",
            )

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, full_name: str) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise WeightError(f"weight {full_name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}",
                              fix="the checkpoint does not match its config.json; re-export it")
        with torch.no_grad():
            dst.copy_(src.to(dst.dtype))

    def loaded_parameters(self) -> list[str]:
        """Names of the parameters every slice of which has been loaded."""
        names = ["w13", "w2"] + (["w13_scale_inv", "w2_scale_inv"] if self.quant else []) \
            + (["w13_bias", "w2_bias"] if self.w13_bias is not None else [])
        return [n for n in names
                if all((n, e, h) in self._loaded for e in range(self.num_local) for h in ((0, 1) if n.startswith("w13") else (0,)))]
