"""What the policy needs to know about a model's attention, read from the attention layers its model
class builds for a Hugging Face config (on the meta device: no memory, no weights).

Only attention facts matter here: the attention kind, the q/k and v head dims every layer uses (Gemma 4
mixes 256-wide sliding and 512-wide global layers; MLA is described in its absorbed form, as the
shared attention layer runs it), sliding windows, attention logit soft-capping, head counts and dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from attnzoo.attention.mla import MLAAttention
from attnzoo.attention.nsa import NSAAttention
from attnzoo.errors import PolicyError
from attnzoo.models.registry import architecture_of, config_object, model_class


@dataclass(frozen=True)
class ModelProfile:
    architecture: str
    family: str
    kind: str  # "mha" (MHA/GQA/MQA), "mla" (absorbed latent attention), "nsa" (sparse MLA), "dsv4" (compressed)
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


def profile_from_config(hf_config, *, architecture: str | None = None, family: str | None = None) -> ModelProfile:
    """A model's attention profile, from its attention layers as its model class builds them (on the meta
    device) for an HF config object or a config.json dict.

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
    model = model_class(arch).shapes_only(config_object(hf_config, arch))
    text = (hf_config.get("text_config") if isinstance(hf_config, dict) else getattr(hf_config, "text_config", None))
    dtype = _dtype_name(_config_dtype(hf_config) or _config_dtype(text or hf_config))
    layers = model.attention_layers()
    windows = {a.sliding_window for a in layers if a.sliding_window}
    mla = next((m for m in model.modules() if isinstance(m, MLAAttention)), None)
    extra: dict[str, Any] = {"sliding_window": max(windows)} if windows else {}
    if mla is not None:
        # Absorbed form, as the shared attention layer runs MLA: keys are latent + rope, values the latent.
        extra = {"kv_lora_rank": mla.kv_lora_rank, "qk_rope_head_dim": mla.qk_rope_head_dim,
                 "qk_nope_head_dim": mla.qk_nope_head_dim, "v_head_dim": mla.v_head_dim}
        if isinstance(mla, NSAAttention):
            extra.update(index_topk=mla.index_topk, index_head_dim=mla.attn.index_head_dim,
                         index_n_heads=mla.index_n_heads)
    return ModelProfile(
        architecture=arch, family=family,
        kind="dsv4" if any(a.kind == "dsv4" for a in layers)
        else "mha" if mla is None else "nsa" if isinstance(mla, NSAAttention) else "mla",
        head_dims=frozenset(a.head_dim for a in layers), v_head_dims=frozenset(a.v_head_dim for a in layers),
        uses_sliding_window=bool(windows), uses_softcap=any(a.logit_softcap for a in layers),
        num_heads=max(a.num_heads for a in layers), num_kv_heads=frozenset(a.num_kv_heads for a in layers),
        dtype=dtype, final_logit_softcap=model.softcap, extra=extra,
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
