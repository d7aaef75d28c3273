"""What the policy needs to know about a model's attention, read from its Hugging Face config.

Only attention facts matter here: the attention kind, the q/k and v head dims every layer uses (Gemma 4
mixes 256-wide sliding and 512-wide global layers; MLA is described in its absorbed form, as the
shared attention layer runs it), sliding windows, attention logit soft-capping, head counts and dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from attnzoo.errors import PolicyError


@dataclass(frozen=True)
class ModelProfile:
    architecture: str
    family: str
    kind: str  # "mha" (MHA/GQA/MQA), "mla" (absorbed latent attention) or "nsa" (sparse MLA)
    head_dims: frozenset[int]  # q/k head dims over all layers
    v_head_dims: frozenset[int]  # v head dims over all layers
    uses_sliding_window: bool = False
    uses_softcap: bool = False  # attention logit soft-capping (not the final-logit cap)
    uses_sinks: bool = False
    num_heads: int | None = None
    num_kv_heads: frozenset[int] = frozenset()  # MLA: {1}, the latent is one shared "head"
    dtype: str | None = None  # the checkpoint's dtype from the config, informational
    final_logit_softcap: float | None = None  # informational: applied to logits, not in attention
    # "config" when read from a config, else why it is assumed (e.g. "family fallback for X").
    source: str = "config"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "family": self.family,
            "kind": self.kind,
            "head_dims": sorted(self.head_dims),
            "v_head_dims": sorted(self.v_head_dims),
            "uses_sliding_window": self.uses_sliding_window,
            "uses_softcap": self.uses_softcap,
            "uses_sinks": self.uses_sinks,
            "num_heads": self.num_heads,
            "num_kv_heads": sorted(self.num_kv_heads),
            "dtype": self.dtype,
            "final_logit_softcap": self.final_logit_softcap,
            "source": self.source,
            **({"extra": self.extra} if self.extra else {}),
        }

    def describe(self) -> str:
        def s(x):
            return "/".join(str(v) for v in sorted(x)) or "?"

        bits = [
            self.kind.upper(),
            f"head dims q/k {s(self.head_dims)} v {s(self.v_head_dims)}",
            f"heads {self.num_heads or '?'} kv {s(self.num_kv_heads)}"
            + (f" per rank (tensor parallel {self.extra['tensor_parallel_size']})"
               if "tensor_parallel_size" in self.extra else ""),
            f"sliding window {'yes' if self.uses_sliding_window else 'no'}",
            f"attn soft-cap {'yes' if self.uses_softcap else 'no'}",
            f"dtype {self.dtype or '?'}",
        ]
        return ", ".join(bits) + f" ({self.source})"


def _get(cfg, name: str, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _config_dtype(cfg):
    # config.json files written before transformers 5 say torch_dtype; reading it from a config object
    # only triggers a deprecation warning.
    if isinstance(cfg, dict):
        return cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(cfg, "dtype", None)


def _dtype_name(value) -> str | None:
    if value is None:
        return None
    name = str(value).replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}.get(name, name)


# Configs read from GGUF files carry only a model_type; each maps to one causal-LM class.
_MODEL_TYPE_ARCH = {
    "llama": "LlamaForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}


def architecture_of(cfg) -> str | None:
    archs = _get(cfg, "architectures") or []
    if archs:
        return archs[0]
    return _MODEL_TYPE_ARCH.get(str(_get(cfg, "model_type") or ""))


def profile_from_config(hf_config, *, architecture: str | None = None, family: str | None = None) -> ModelProfile:
    """Read a model's attention profile from an HF config object or a config.json dict.

    ``architecture`` overrides the config's ``architectures[0]``; ``family`` is looked up in the shipped
    policy table when not given.
    """
    arch = architecture or architecture_of(hf_config)
    if not arch:
        raise PolicyError(
            "the model config names no architecture (config.json has no 'architectures')",
            fix="give the architecture explicitly (attnzoo policy explain ... --arch ARCH)",
        )
    if family is None:
        from attnzoo.defaults.table import SHIPPED_POLICY, load_table

        table = load_table(SHIPPED_POLICY, shipped=True)
        family = table.family_of(arch)
        if family is None:
            raise PolicyError(
                f"architecture {arch!r} is not in the policy table",
                fix=f"use one of: {', '.join(table.architectures())}",
            )
    text = _get(hf_config, "text_config") or hf_config
    dtype = _dtype_name(_config_dtype(hf_config) or _config_dtype(text))
    if _get(text, "kv_lora_rank"):
        return _mla_profile(text, arch, family, dtype)
    return _mha_profile(text, arch, family, dtype)


def _mha_profile(cfg, arch: str, family: str, dtype: str | None) -> ModelProfile:
    heads = _get(cfg, "num_attention_heads")
    n_layers = int(_get(cfg, "num_hidden_layers") or 0)
    layer_types = list(_get(cfg, "layer_types") or [])
    per_layer = _get(cfg, "per_layer_config")
    if per_layer is not None and not isinstance(per_layer, dict):
        # A transformers config with per-layer attributes refuses global reads of head_dim and
        # num_key_value_heads (they vary by layer): read every layer's own config.
        layers = list(per_layer)
        head_dims = {int(_get(lc, "head_dim") or _derived_head_dim(lc, arch)) for lc in layers}
        kv_heads = {int(_get(lc, "num_key_value_heads") or heads) for lc in layers}
    else:
        kv = _get(cfg, "num_key_value_heads") or heads
        head_dim = _get(cfg, "head_dim") or _derived_head_dim(cfg, arch)
        head_dims, kv_heads = _per_layer_attention(cfg, int(head_dim), int(kv) if kv else None, n_layers, layer_types)

    window = _get(cfg, "sliding_window")
    if layer_types:
        uses_window = bool(window) and any("sliding" in t for t in layer_types)
    else:
        uses_window = bool(window) and bool(_get(cfg, "use_sliding_window", True))
    softcap = _get(cfg, "attn_logit_softcapping")
    return ModelProfile(
        architecture=arch, family=family, kind="mha",
        head_dims=frozenset(head_dims), v_head_dims=frozenset(head_dims),
        uses_sliding_window=uses_window, uses_softcap=bool(softcap),
        num_heads=int(heads) if heads else None, num_kv_heads=frozenset(kv_heads), dtype=dtype,
        final_logit_softcap=_get(cfg, "final_logit_softcapping"),
        extra={"sliding_window": window} if uses_window else {},
    )


def rank_local(profile: ModelProfile, tensor_parallel_size: int) -> ModelProfile:
    """What one rank's attention runs at tensor parallel N: the query heads split N ways, the KV heads
    too, or one per rank where there are fewer than N (each rank keeps a copy); MLA's latent head stays
    whole. Backend choices that depend on head counts (XQA's group size, FlashInfer's kernels) follow."""
    n = tensor_parallel_size
    if n == 1:
        return profile
    kv = profile.num_kv_heads if profile.kind != "mha" else frozenset(max(1, k // n) for k in profile.num_kv_heads)
    return replace(profile, num_heads=profile.num_heads // n if profile.num_heads else None, num_kv_heads=kv,
                   extra={**profile.extra, "tensor_parallel_size": n})


def _derived_head_dim(cfg, arch: str) -> int:
    hidden, heads = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads")
    if not (hidden and heads):
        raise PolicyError(
            f"{arch} config gives neither head_dim nor hidden_size and num_attention_heads",
            fix="check the model's config.json",
        )
    return int(hidden) // int(heads)


def _per_layer_attention(cfg, head_dim: int, kv: int | None, n_layers: int, layer_types: list[str]):
    """-> (q/k head dims, kv head counts) over all layers.

    Gemma 4's full-attention layers have their own width and KV head count. A config.json written by
    transformers stores them as ``per_layer_config`` {layer index: fields}; the released checkpoints'
    config.json says ``global_head_dim`` / ``num_global_key_value_heads`` instead.
    """
    base_kv = {kv} if kv else set()
    per_layer = _get(cfg, "per_layer_config")
    if isinstance(per_layer, dict) and per_layer:
        overrides = {int(k): v for k, v in per_layer.items()}
        untouched = n_layers == 0 or len(overrides) < n_layers
        dims = ({head_dim} if untouched else set()) | {int(_get(o, "head_dim") or head_dim) for o in overrides.values()}
        kvs = (base_kv if untouched else set()) | {
            int(_get(o, "num_key_value_heads")) for o in overrides.values() if _get(o, "num_key_value_heads")
        }
        return dims, kvs or base_kv
    full = [t == "full_attention" for t in layer_types]
    model_type = str(_get(cfg, "model_type") or "")
    ghd = _get(cfg, "global_head_dim") or (512 if model_type.startswith("gemma4") else None)  # transformers' default
    if ghd and any(full):
        dims = ({head_dim} if not all(full) else set()) | {int(ghd)}
        gkv = _get(cfg, "num_global_key_value_heads")
        kvs = set(base_kv) if not all(full) else set()
        kvs.add(int(gkv) if gkv and _get(cfg, "attention_k_eq_v", False) else kv)
        return dims, {k for k in kvs if k}
    return {head_dim}, base_kv


def _mla_profile(cfg, arch: str, family: str, dtype: str | None) -> ModelProfile:
    rank = int(_get(cfg, "kv_lora_rank"))
    rope = int(_get(cfg, "qk_rope_head_dim") or 0)
    if not rope:
        raise PolicyError(f"{arch} config has kv_lora_rank but no qk_rope_head_dim",
                          fix="check the model's config.json")
    # Absorbed form, as the shared attention layer runs MLA: keys are latent + rope, values the latent.
    nsa = bool(_get(cfg, "index_topk"))
    extra = {"kv_lora_rank": rank, "qk_rope_head_dim": rope,
             "qk_nope_head_dim": _get(cfg, "qk_nope_head_dim"), "v_head_dim": _get(cfg, "v_head_dim")}
    if nsa:
        extra.update(index_topk=_get(cfg, "index_topk"), index_head_dim=_get(cfg, "index_head_dim"),
                     index_n_heads=_get(cfg, "index_n_heads"))
    heads = _get(cfg, "num_attention_heads")
    return ModelProfile(
        architecture=arch, family=family, kind="nsa" if nsa else "mla",
        head_dims=frozenset({rank + rope}), v_head_dims=frozenset({rank}),
        num_heads=int(heads) if heads else None, num_kv_heads=frozenset({1}), dtype=dtype,
        extra=extra,
    )


def profile_from_table(architecture: str, family: str, fields: dict[str, Any] | None) -> ModelProfile:
    """The assumed profile when only an architecture name is known (the table's ``profile`` fields)."""
    if not fields or "kind" not in fields or "head_dims" not in fields:
        raise PolicyError(
            f"the policy table has no fallback profile for {architecture!r}",
            fix="pass the model's config (a local dir or a cached hub id) instead of the architecture name",
        )
    return ModelProfile(
        architecture=architecture, family=family, kind=fields["kind"],
        head_dims=frozenset(fields["head_dims"]),
        v_head_dims=frozenset(fields.get("v_head_dims", fields["head_dims"])),
        uses_sliding_window=bool(fields.get("sliding_window", False)),
        uses_softcap=bool(fields.get("softcap", False)),
        num_heads=fields.get("num_heads"),
        num_kv_heads=frozenset(fields.get("num_kv_heads", [])),
        dtype=fields.get("dtype"),
        source=f"assumed from the architecture name, shaped like {fields['example']}" if fields.get("example")
        else "assumed from the architecture name",
    )
