"""Config checks for the model files: each model validates the config.json keys it reads, and only those.

A model calls these from its constructor (which also runs on the meta device when the policy reads the
model's shapes, so a bad config is named before any weight is read), passing what it reads:

    act = validate.activation(config, "hidden_act", {"silu": "silu"}, arch="Llama")
    rope = validate.rope_type(config.rope_parameters, STATIC_ROPE - {"proportional"}, arch="Llama")
    validate.positive_int(config, "max_position_embeddings", arch="Llama")
    validate.head_counts(config, arch="Llama")   # MHA/GQA only: MLA does not read num_key_value_heads

Each raises ``ModelLoadError`` naming the key, the value, what the model supports, and the fix. A key a
model does not read is never checked: transformers fills defaults for keys an architecture ignores.
"""
from __future__ import annotations

from typing import Mapping

from attnzoo.errors import ModelLoadError

# RoPE types whose frequencies depend on the config only. transformers' "dynamic" and "longrope"
# rescale with the batch's sequence length at run time, which RotaryEmbedding's fixed tables cannot do.
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn", "proportional"})


def activation(config, key: str, supported: Mapping[str, str], *, arch: str, default: str | None = None) -> str:
    """config.<key> (an activation name as transformers spells it) -> our kernel's name (``supported``
    maps one to the other); an unknown name is refused, never run as another activation."""
    value = getattr(config, key, default)
    if value not in supported:
        raise ModelLoadError(
            f"config.json: {key}={value!r} is not an activation attnzoo's {arch} implements "
            f"(supported: {', '.join(map(repr, supported))})",
            fix=f"use a checkpoint whose {key} is one of those; running another activation would give wrong outputs")
    return supported[value]


def rope_type(params, supported: frozenset[str] | set[str], *, arch: str, where: str = "rope_parameters") -> str:
    """The rope_type of one rope_parameters dict ("default" when absent), refused unless ``supported``."""
    if not isinstance(params, Mapping):
        raise ModelLoadError(f"config.json: {where} must be an object, got {params!r}",
                             fix=f"write {where} as {{\"rope_type\": \"default\", \"rope_theta\": ...}}")
    value = params.get("rope_type", params.get("type", "default"))
    if value not in supported:
        why = (" (it rescales with the sequence length at run time)" if value in ("dynamic", "longrope") else "")
        raise ModelLoadError(
            f"config.json: {where}.rope_type={value!r} is not supported by attnzoo's {arch}{why}; "
            f"supported: {', '.join(sorted(supported))}",
            fix="use a checkpoint with one of those RoPE types (check rope_parameters / rope_scaling in config.json)")
    return value


def positive_int(config, key: str, *, arch: str, default=None, required: bool = False) -> int | None:
    """config.<key> as a positive integer (None when absent, not required and no default)."""
    value = getattr(config, key, default)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json: {key} must be a positive integer ({arch} reads it), got {value!r}",
                             fix=f"set {key} in config.json to the checkpoint's real value")
    return value


def head_counts(config, *, arch: str, heads_key: str = "num_attention_heads",
                kv_key: str = "num_key_value_heads") -> tuple[int, int]:
    """(query heads, KV heads) of an MHA/GQA model: positive, the first a multiple of the second."""
    heads = positive_int(config, heads_key, arch=arch, required=True)
    kv = positive_int(config, kv_key, arch=arch, default=heads)
    if heads % kv:
        raise ModelLoadError(f"config.json: {heads_key}={heads} is not a multiple of {kv_key}={kv}",
                             fix=f"set {kv_key} to a divisor of {heads_key} (the checkpoint's real value)")
    return heads, kv
