"""What the policy knows of a model's attention: its kind (which an architecture missing from the table
resolves by), head dims (MLA absorbed, as the shared layer runs it), windows, soft-cap, sinks, head counts
and dtype; read from the layers its model class builds on the meta device, or from the config's keys."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from attnzoo.attention.mla import MLAAttention
from attnzoo.attention.nsa import NSAAttention
from attnzoo.errors import PolicyError, UnsupportedArchitectureError
from attnzoo.models.registry import architecture_of, config_object, model_class


@dataclass(frozen=True)
class ModelProfile:
    architecture: str
    family: str | None  # None: not in the table; resolve() picks the family by attention_kind
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
    source: str = "config"  # "config", else why it is assumed
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    declared_kind: str | None = None  # the model class's `attention_kind`, when it declares one

    @property
    def attention_kind(self) -> str:
        """mha, mha_window, mha_sinks, mla or nsa; or what the model class declares (e.g. a new kind)."""
        if self.declared_kind or self.kind != "mha":
            return self.declared_kind or self.kind
        return "mha_sinks" if self.uses_sinks else "mha_window" if self.uses_sliding_window else "mha"

    def to_dict(self) -> dict[str, Any]:
        d = {k: sorted(v) if isinstance(v, frozenset) else v for k, v in self.__dict__.items()
             if k not in ("extra", "declared_kind")}
        return {**d, "attention_kind": self.attention_kind, **({"extra": self.extra} if self.extra else {})}

    def describe(self) -> str:
        s = lambda x: "/".join(str(v) for v in sorted(x)) or "?"  # noqa: E731
        tp = self.extra.get("tensor_parallel_size")
        return ", ".join([
            self.kind.upper(), f"head dims q/k {s(self.head_dims)} v {s(self.v_head_dims)}",
            f"heads {self.num_heads or '?'} kv {s(self.num_kv_heads)}" + (f" per rank (tensor parallel {tp})" if tp else ""),
            f"sliding window {'yes' if self.uses_sliding_window else 'no'}",
            f"attn soft-cap {'yes' if self.uses_softcap else 'no'}", *(["attention sinks"] if self.uses_sinks else []),
            f"dtype {self.dtype or '?'}",
        ]) + f" ({self.source})"


def dtype_name(value) -> str | None:
    name = None if value is None else str(value).replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}.get(name, name)


def _get(cfg, key):
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def _dtype(cfg):  # config.json files written before transformers 5 say torch_dtype
    return (cfg.get("dtype") or cfg.get("torch_dtype")) if isinstance(cfg, dict) else getattr(cfg, "dtype", None)


def profile_from_config(hf_config, *, architecture: str | None = None, family: str | None = None) -> ModelProfile:
    """The profile of an HF config object or config.json dict; ``architecture`` overrides the config's. The
    family is resolve()'s to fill in (the table's, or the attention kind's) when not given."""
    arch = architecture or architecture_of(hf_config)
    if not arch:
        raise PolicyError("the model config names no architecture (config.json has no 'architectures')",
                          fix="give the architecture explicitly (attnzoo policy explain ... --arch ARCH)")
    text = _get(hf_config, "text_config")
    dtype = dtype_name(_dtype(hf_config) or (_dtype(text) if text is not None else None))
    try:
        cls = model_class(arch, hf_config)
    except UnsupportedArchitectureError:
        return _profile_from_keys(text or hf_config, arch, family, dtype)
    model = cls.shapes_only(config_object(hf_config, arch))
    layers = model.attention_layers()
    windows = {a.sliding_window for a in layers if a.sliding_window}
    mla = next((m for m in model.modules() if isinstance(m, MLAAttention)), None)
    extra: dict[str, Any] = {"sliding_window": max(windows)} if windows else {}
    if mla is not None:  # absorbed form: keys are latent + rope, values the latent
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
        uses_sinks=any(a.sinks is not None for a in layers), num_heads=max(a.num_heads for a in layers), num_kv_heads=frozenset(a.num_kv_heads for a in layers),
        dtype=dtype, final_logit_softcap=model.softcap, extra=extra, declared_kind=getattr(cls, "attention_kind", None),
    )


def _profile_from_keys(cfg, arch: str, family: str | None, dtype: str | None) -> ModelProfile:
    """The profile of a config no model class is registered for: kv_lora_rank means MLA, index_topk sparse
    MLA, sliding_window / layer_types windowed layers."""
    heads = _get(cfg, "num_attention_heads")
    if not heads:
        raise PolicyError(f"architecture {arch!r} is not implemented and its config has no num_attention_heads",
                          fix="pass the config of a decoder model (or --arch with a listed architecture)")
    window = (bool(_get(cfg, "sliding_window")) and _get(cfg, "use_sliding_window") is not False
              or "sliding_attention" in (_get(cfg, "layer_types") or ()))
    rank = _get(cfg, "kv_lora_rank")
    if rank:
        dims, vdims, kv = {rank + _get(cfg, "qk_rope_head_dim")}, {rank}, {1}
        kind = "nsa" if _get(cfg, "index_topk") else "mla"
    else:
        dims = vdims = {_get(cfg, "head_dim") or _get(cfg, "hidden_size") // heads}
        kind, kv = "mha", {_get(cfg, "num_key_value_heads") or heads}
    return ModelProfile(architecture=arch, family=family, kind=kind, head_dims=frozenset(dims),
                        v_head_dims=frozenset(vdims), uses_sliding_window=window and kind == "mha",
                        uses_softcap=bool(_get(cfg, "attn_logit_softcapping")), num_heads=heads,
                        num_kv_heads=frozenset(kv), dtype=dtype, source="read from the config's keys "
                        f"(no model class for {arch})")


def rank_local(profile: ModelProfile, tensor_parallel_size: int) -> ModelProfile:
    """One rank's attention at tensor parallel N: query heads split N ways, KV heads too or one per rank
    where there are fewer (each keeps a copy); MLA's latent head stays whole. Head-count checks follow."""
    if (n := tensor_parallel_size) == 1:
        return profile
    kv = profile.num_kv_heads if profile.kind != "mha" else frozenset(max(1, k // n) for k in profile.num_kv_heads)
    return replace(profile, num_heads=profile.num_heads // n if profile.num_heads else None, num_kv_heads=kv,
                   extra={**profile.extra, "tensor_parallel_size": n})

