"""Building blocks shared by the model files: norms, rotary embeddings, MLPs, and the model base class.

Model parameters are named like the Hugging Face checkpoints they load (``model.layers.0.self_attn.
o_proj.weight``), so loading is a name-for-name copy with shape checks and no per-model mapping tables.
The one exception is ``MergedLinear``: projections of the same input stacked into one GEMM (q/k/v,
gate/up), each checkpoint tensor loaded into its rows under its own name.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from attnzoo.attention.kv_cache import KVCacheSpec
from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.errors import WeightError
from attnzoo.layers import fused, skinny
from attnzoo.layers.fp8 import Fp8MergedLinear
from attnzoo.layers.parallel import SINGLE, Linear, RowParallelLinear, TPContext, VocabParallelEmbedding, narrow


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight), computed in float32. Gemma-style norms store weight - 1 (offset 1)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, offset: float = 0.0, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None, *, x_norm: RMSNorm | None = None,
                     scale: torch.Tensor | None = None):
        """-> (this norm of s, s) with s = (residual + x_norm(x)) * scale, in one kernel on a GPU. residual
        None (the first layer): s is x_norm(x), or x itself. x_norm is a post-norm of x (Gemma), scale a
        one-element tensor (Gemma 4's layer scalar)."""
        return fused.add_rms_norm(x, residual, self, x_norm=x_norm, scale=scale)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, from the config's rope parameters (transformers' definitions).

    ``rope_init`` is one of transformers' ROPE_INIT_FUNCTIONS names or "default"; the scaling they
    return (YaRN's attention factor) multiplies cos and sin, as in the reference models.
    """

    def __init__(self, config, *, rope_type: str = "default", layer_type: str | None = None, head_dim: int):
        super().__init__()
        if rope_type == "default":
            params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            kwargs = {"layer_type": layer_type} if layer_type else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = inv_freq.float()
        self.scaling = scaling

    def frequencies(self, device: torch.device) -> torch.Tensor:
        """The inverse frequencies [rotary_dim / 2] float32 on ``device`` (Mistral Large 4 scales them)."""
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, rotary_dim] in float32."""
        freqs = positions.float()[:, None] * self.frequencies(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """RoPE on x [num_tokens, heads, dim] with cos/sin [num_tokens, rotary_dim <= dim]: rotate-half, or
    interleaved pairs written de-interleaved (fused.rope_ref); channels past rotary_dim pass through."""
    return fused.rope(x, None, cos, sin, interleaved=interleaved)[0]


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False):
    """apply_rope on q and k, one kernel on a GPU."""
    return fused.rope(q, k, cos, sin, interleaved=interleaved)


class MergedLinear(Linear):
    """Several projections of the same input as one GEMM, stacked along the output: ``parts`` maps each
    checkpoint module name (a sibling of this one: "q_proj") to its output rows, in order. Checkpoint
    tensors keep their names; ``CausalLM.load_weights`` copies ``<parent>.q_proj.weight`` into its rows.

    Under tensor parallelism every part is column-parallel on its own: this rank keeps rows
    first..first+count of each part (``shards``: part -> (first, count), an even split unless given;
    replicated KV heads pass their own), stacked in part order, and the loader cuts each checkpoint
    tensor to those rows before copying it in."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False, *, tp: TPContext = SINGLE,
                 shards: dict[str, tuple[int, int]] | None = None):
        shards = {name: (shards or {}).get(name) or tp.shard(n, f"{name} output features")
                  for name, n in parts.items()}
        super().__init__(in_features, sum(count for _, count in shards.values()), bias=bias)
        self.parts = {name: count for name, (_, count) in shards.items()}  # this rank's rows of each part
        self.cuts = {name: None if shards[name] == (0, n) else narrow(0, *shards[name], n) for name, n in parts.items()}

    def part_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, n in self.parts.items():
            rows[name] = slice(start, start + n)
            start += n
        return rows

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """The stacked projections, or with ``act`` (parts gate then up) act(gate) * up (``skinny.gated``)."""
        return super().forward(x) if act is None else skinny.gated(x, self.weight, self.bias, act)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This projection's output [..., sum(parts)] -> one view per part."""
        return y.split(list(self.parts.values()), dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for Llama/DeepSeek, GeGLU (tanh gelu) for Gemma."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", *, bias: bool = False,
                 tp: TPContext = SINGLE, reduce: bool = True):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate}, bias=bias,
                                         tp=tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, tp=tp, reduce=reduce)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x, act=self.act))


class CausalLM(nn.Module):
    """What the engine needs from every model.

    forward(input_ids [num_tokens], positions [num_tokens], ctx) -> hidden [num_tokens, hidden]
    compute_logits(hidden [n, hidden]) -> logits [n, vocab] in the LM head's dtype (float32 where the model computes
        them in float32: a soft-capped head); what needs float32 (sampling, log-probabilities) converts them itself,
        greedy decoding reads them as they are (a bf16 row's argmax is its float32 copy's)
    """

    # Checkpoint tensors that are allowed to be absent (e.g. tied lm_head) or present but unused.
    tied_lm_head: bool = False
    # Names of nn.Linear layers whose weight the model reads as a matrix instead of calling the layer
    # (quantized checkpoints dequantize these at load).
    matrix_weights: tuple[str, ...] = ()
    softcap: float | None = None  # final-logit soft-cap (not an attention one)
    # The attention kind the policy resolves an unlisted architecture by, when the layers do not show it
    # (e.g. "mha_sinks"); None: read from the layers (mha, mha_window, mla, nsa).
    attention_kind: str | None = None

    @classmethod
    def shapes_only(cls, config) -> "CausalLM":
        """The model built on the meta device: every module and shape, no memory, no weights. What reads a
        model's structure without running it (the policy's profile, ``attnzoo tune``) reads this."""
        with torch.device("meta"):
            return cls(config)

    def attention_layers(self) -> list[Attention]:
        return sorted((m for m in self.modules() if isinstance(m, Attention)), key=lambda a: a.layer_id)

    def kv_cache_specs(self) -> list[KVCacheSpec | None]:
        layers = self.attention_layers()
        specs: list[KVCacheSpec | None] = [None] * (max(a.layer_id for a in layers) + 1)
        for a in layers:
            specs[a.layer_id] = a.kv_cache_spec()
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def validate_prompt(self, token_ids: list[int]) -> None:
        """Reject prompts this model cannot serve (raise RequestError) before any work is scheduled."""

    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to our parameter name; None skips the tensor."""
        return name

    @staticmethod
    def layer_index(name: str, parts: list[str], at: int = 2) -> int | None:
        """The layer number of a '...layers.<N>...' tensor name (``parts`` is its split, N at ``at``);
        None when the name is not under 'layers'. A name with no number there is named, not a ValueError."""
        if parts[at - 1 : at] != ["layers"]:
            return None
        if len(parts) <= at or not parts[at].isdigit():
            raise WeightError(f"checkpoint tensor {name!r} does not name a layer number after 'layers.'",
                              fix="check that config.json's architectures matches the weights (an extra module's "
                              "tensors, e.g. a multi-token-prediction head, must be named layers.<N>...)")
        return int(parts[at])

    def merged_parts(self) -> dict[str, tuple[str, slice, Callable | None]]:
        """Checkpoint-side name of each MergedLinear part's tensor -> (our parameter, its rows, the cut
        of the full tensor to this rank's rows or None)."""
        out = {}
        for mod_name, mod in self.named_modules():
            if isinstance(mod, (MergedLinear, Fp8MergedLinear)):
                parent = mod_name.rpartition(".")[0]
                for pname, _ in mod.named_parameters(recurse=False):
                    # FP8 block factors have one row per block of weight rows (layers/fp8.py, Fp8MergedLinear).
                    scale = pname == "weight_scale_inv"
                    part_rows, cuts = (mod.scale_rows(), mod.scale_cuts) if scale else (mod.part_rows(), mod.cuts)
                    for part, rows in part_rows.items():
                        out[f"{parent}.{part}.{pname}".lstrip(".")] = (f"{mod_name}.{pname}", rows, cuts[part])
        return out

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        # Modules whose parameters are not named like the checkpoint's tensors (stacked MoE experts)
        # map their tensors themselves.
        loaders = {n + ".": m for n, m in self.named_modules() if hasattr(m, "load_checkpoint_tensor")}
        parts = self.merged_parts()
        merged = {p for p, _, _ in parts.values()}
        expected = [n for n in params if n not in merged] + list(parts)
        seen: set[str] = set()
        for ckpt_name, tensor in tensors:
            name = self.checkpoint_name(ckpt_name)
            if name is None:
                continue
            owner = next((p for p in loaders if name.startswith(p)), None)
            if owner is not None:
                loaders[owner].load_checkpoint_tensor(name[len(owner):], tensor, full_name=ckpt_name)
                continue
            if name in parts:
                pname, rows, cut = parts[name]
                p = params[pname][rows]
            elif name in params:
                # Sharded parameters say how to cut this rank's part of the full tensor.
                p, cut = params[name], getattr(params[name], "tp_shard", None)
            else:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise WeightError(
                    f"checkpoint tensor {ckpt_name!r} has no matching parameter in {type(self).__name__}",
                    fix="check that config.json's architectures matches the weights",
                )
            if cut is not None:  # tensor parallel: this rank's slice of the full tensor
                tensor = cut(tensor)
            if tuple(tensor.shape) != tuple(p.shape):
                raise WeightError(
                    f"weight {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}",
                    fix="the checkpoint does not match its config.json; re-export it",
                )
            with torch.no_grad():
                p.copy_(tensor.to(p.dtype))
            seen.add(name)
        for prefix, module in loaders.items():
            seen.update(prefix + n for n in module.loaded_parameters())
        missing = [n for n in expected if n not in seen and not self._may_be_missing(n)]
        if missing:
            raise WeightError(
                f"checkpoint is missing {len(missing)} weight(s), first: {missing[0]!r}",
                fix="point to a complete checkpoint (all safetensors shards present)",
            )
        self.after_weights_loaded()

    def _may_be_missing(self, name: str) -> bool:
        return self.tied_lm_head and name == "lm_head.weight"

    def after_weights_loaded(self) -> None:
        if self.tied_lm_head and hasattr(self, "lm_head"):
            self.lm_head.weight = self.model.embed_tokens.weight



class DecoderLayer(nn.Module):
    """The pre-norm residual block of Llama, DeepSeek and Qwen3: x + self_attn(norm(x)), then + mlp(norm(x)).
    The model file builds ``self_attn`` (forward(x, cos, sin, ctx)) and ``mlp`` (forward(x))."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, residual, cos, sin, ctx):
        """x: the previous layer's output; residual: the stream before it (None in the first layer).
        -> this layer's output and the stream before it: each add is fused with the norm after it."""
        x, residual = self.input_layernorm.add_and_norm(x, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(x, cos, sin, ctx), residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """``model.*`` of a checkpoint: embed_tokens, the layers, the final norm."""

    def __init__(self, config, layers: Iterable[nn.Module], tp: TPContext = SINGLE, *, norm_offset: float = 0.0):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=norm_offset)


class DecoderLM(CausalLM):
    """A ``DecoderModel`` of ``DecoderLayer`` s that share one RoPE (``self.rotary``), and ``lm_head``."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        cos, sin = self.rotary(positions)
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.model.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # no float32 copy: [rows, vocab] of them cost 0.5 ms a 1319-row step
