"""Find a checkpoint (local dir, hub id, GGUF file, or the embedded default), read its config,
tokenizer and weights, and build our model from the registry."""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from attnzoo.errors import ModelLoadError, UnsupportedArchitectureError, WeightError
from attnzoo.network import hub_host, reachable
from attnzoo.models import registry

log = logging.getLogger("attnzoo")



@dataclass
class CheckpointSource:
    name: str  # what the user asked for (hub id, path, or the default's name)
    directory: Path | None  # None for a random-weight model built from a config object
    gguf_file: str | None = None  # file name inside ``directory`` for GGUF checkpoints

    @property
    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_model_path(*, download: bool = True) -> Path:
    """The embedded default model's GGUF (downloaded once where it is not here: ``default_model.path``)."""
    from attnzoo.models import default_model

    return default_model.path(download=download)


def _is_hub_id(name: str) -> bool:
    return re.fullmatch(r"[\w][\w.-]*/[\w][\w.-]*", name) is not None and not name.endswith(".gguf")


def resolve_source(name_or_path: str | os.PathLike | None, *, local_only: bool = False) -> CheckpointSource:
    if name_or_path is None:
        p = default_model_path(download=not local_only)
        return CheckpointSource("SmolLM2-135M-Instruct (embedded GGUF)", p.parent, p.name)
    name = str(name_or_path)
    p = Path(name).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return CheckpointSource(name, p.parent, p.name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return CheckpointSource(name, p, ggufs[0].name)
            raise ModelLoadError(f"directory {name!r} has no config.json", fix="point to a Hugging Face checkpoint directory or a .gguf file")
        return CheckpointSource(name, p)
    if not _is_hub_id(name):
        raise ModelLoadError(f"model path {name!r} does not exist", fix="check the path, or pass a hub id like 'org/name'")
    return CheckpointSource(name, _hub_snapshot(name, local_only))


def _hub_snapshot(repo_id: str, local_only: bool = False) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=patterns))
    except Exception:
        pass
    not_cached = f"hub model {repo_id!r} is not in the local Hugging Face cache"
    local_fix = "pass a local checkpoint directory, or download it where there is a network (`hf download REPO`)"
    if local_only:
        raise ModelLoadError(not_cached, fix=local_fix)
    # Without these checks the hub client retries each file for tens of seconds, one log line a retry.
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelLoadError(f"{not_cached} and HF_HUB_OFFLINE is set", fix=f"unset HF_HUB_OFFLINE, or {local_fix}")
    host = hub_host()
    if not reachable(host):
        raise ModelLoadError(f"{not_cached} and {host} cannot be reached (no network?)",
                             fix=f"connect to the network, or {local_fix}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except (GatedRepoError, RepositoryNotFoundError) as e:
        gated = isinstance(e, GatedRepoError)
        raise ModelLoadError(
            f"hub model {repo_id!r} is {'gated' if gated else 'not found, or private'}",
            fix=("accept its license on huggingface.co, then `hf auth login`" if gated
                 else "check the id, or `hf auth login` for a private model"),
        ) from None
    except Exception as e:  # network errors mid-download: the hub library raises many types
        raise ModelLoadError(
            f"{not_cached} and could not be downloaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
            fix=f"check the network (and `hf auth login` for gated models), or {local_fix}",
        ) from None


def _global_attr(cfg, key: str):
    """cfg.<key>, or None where transformers keeps it per layer only (a heterogeneous config: Gemma 4 with
    its own global-layer KV head count raises on the global read); the model reads those per layer."""
    try:
        return getattr(cfg, key, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError (not an AttributeError)
        return None


def check_config(config, name: str) -> None:
    """Reject head/size counts no model can be built from, naming the config key (not a ZeroDivisionError)."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        for key in keys:
            value = _global_attr(cfg, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ModelLoadError(f"config.json of {name!r}: {key} must be a positive integer, got {value!r}",
                                     fix=f"set {key} in config.json to the checkpoint's real value")
        heads, kv = _global_attr(cfg, "num_attention_heads"), _global_attr(cfg, "num_key_value_heads")
        # MLA (DeepSeek and its relatives) has one latent KV entry per token and never reads
        # num_key_value_heads: transformers' DeepseekV3Config keeps its default of 128 whatever the heads.
        if heads and kv and heads % kv and _global_attr(cfg, "kv_lora_rank") is None:
            raise ModelLoadError(
                f"config.json of {name!r}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}",
                fix="set num_key_value_heads to a divisor of num_attention_heads (the checkpoint's real value)")


def load_config(src: CheckpointSource):
    from transformers import AutoConfig

    if src.gguf_file:
        _require_gguf()
    try:
        config = AutoConfig.from_pretrained(src.directory, **src.hf_kwargs)
    except Exception as e:
        if not src.gguf_file and (config := _unknown_llama_shaped(src.directory / "config.json")) is not None:
            check_config(config, src.name)
            return config
        if src.gguf_file:
            raise _corrupt(src.directory / src.gguf_file, e) from None
        raise ModelLoadError(f"cannot read {src.directory / 'config.json'} of {src.name!r} ({type(e).__name__}: {e})",
                             fix="repair or re-download config.json") from None
    check_config(config, src.name)
    return config


def _unknown_llama_shaped(path: Path):
    """A config.json of a model_type transformers does not know: a LlamaConfig when its layers are Llama's,
    else the UnsupportedArchitectureError saying so; None for any other reading problem."""
    from transformers import CONFIG_MAPPING

    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("model_type") in CONFIG_MAPPING:
        return None
    arch = registry.architecture_of(d) or "?"
    if arch not in registry.supported_architectures() and not registry.llama_shaped(d):
        raise UnsupportedArchitectureError(
            f"{path}: model_type {d.get('model_type')!r} ({arch}) is unknown to transformers and its layers are not "
            "Llama's (latent attention, experts, windows, biases or another activation)",
            fix=f"use a checkpoint of one of: {', '.join(registry.supported_architectures())}")
    return registry.config_object(d, arch) if arch not in registry.supported_architectures() else None


def has_tokenizer(src: CheckpointSource) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return bool(src.gguf_file) or any((src.directory / n).is_file() for n in names)


def load_tokenizer(src: CheckpointSource):
    """The checkpoint's tokenizer, or None when it ships none (then prompts must be token ids)."""
    from transformers import AutoTokenizer

    if not has_tokenizer(src):
        log.info("%s has no tokenizer files: prompts must be token ids", src.name)
        return None

    try:
        return AutoTokenizer.from_pretrained(src.directory, **src.hf_kwargs)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer of {src.name!r}: {e}", fix="the checkpoint needs tokenizer files") from e


def architecture_of(config) -> str:
    arch = registry.architecture_of(config)
    if not arch:
        raise ModelLoadError("config.json names no architectures", fix="add an 'architectures' entry, e.g. ['LlamaForCausalLM']")
    return arch


# ----------------------------------------------------------------------------------------------
# Weights


def _safetensors_files(directory: Path) -> list[str]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})",
                              fix="re-download model.safetensors.index.json (it needs a 'weight_map' object)") from None
        absent = [f for f in files if not (directory / f).is_file()]
        if absent:
            raise WeightError(f"shard {absent[0]!r} listed in the index is missing", fix="download all shards")
    else:
        files = sorted(f.name for f in directory.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no .safetensors files in {directory}", fix="point to a checkpoint saved with safetensors")
    return files


# safetensors' dtype names (its header) -> torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class LazyTensor:
    """A safetensors tensor not read yet: shape and dtype come from the file's header; ``narrow`` and
    ``[a:b]`` read only that part (safetensors slices), ``to`` reads it whole. Tensor-parallel ranks cut
    their shard from it (``layers.parallel``), so each reads about 1/N of a checkpoint's split layers;
    tensors a rank skips (other ranks' experts) are never read."""

    def __init__(self, handle, key: str, path: Path):
        self.handle, self.key, self.path = handle, key, path
        try:
            self._slice = handle.get_slice(key)
            self.shape = torch.Size(self._slice.get_shape())
            name = self._slice.get_dtype()
        except Exception as e:
            raise _corrupt(path, e, key) from None
        self.dtype = _SAFETENSORS_DTYPES.get(name) or self._read(None).dtype

    def _read(self, index) -> torch.Tensor:
        try:
            return self.handle.get_tensor(self.key) if index is None else self._slice[index]
        except Exception as e:  # SafetensorError, OSError: the reader's own types
            raise _corrupt(self.path, e, self.key) from None

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) of a tensor of shape {tuple(self.shape)}")
        return self._read((slice(None),) * dim + (slice(start, start + length),))

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, slice) and index.step in (None, 1) and self.shape:
            start, stop, _ = index.indices(self.shape[0])  # clamped, as torch's slicing is
            return self.narrow(0, start, max(0, stop - start))
        return self._read(None)[index]

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self._read(None).to(*args, **kwargs)


def iter_safetensors(directory: Path) -> Iterator[tuple[str, LazyTensor]]:
    """Every tensor of a safetensors checkpoint, not read yet (``LazyTensor``): the model reads what it keeps."""
    from safetensors import safe_open

    for f in _safetensors_files(directory):
        path = directory / f
        try:
            fh = safe_open(path, framework="pt")
            keys = list(fh.keys())
        except Exception as e:  # SafetensorError, OSError: the reader's own types
            raise _corrupt(path, e) from None
        for key in keys:
            yield key, LazyTensor(fh, key, path)


def _require_gguf() -> None:
    """A missing ``gguf`` package surfaces inside transformers as an ImportError that would otherwise read
    as a corrupt file; name the real problem first."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("reading a GGUF checkpoint needs the `gguf` package, which is not installed",
                             fix="pip install 'gguf>=0.10' (a dependency of attnzoo: reinstall with pip install -e .)") from None


def _corrupt(path: Path, e: Exception, key: str | None = None) -> WeightError:
    what = f" (tensor {key!r})" if key else ""
    return WeightError(f"cannot read {path}{what}: the file is truncated or corrupt ({type(e).__name__}: {e})",
                       fix=f"re-download {path.name} (compare its size with the hub's)")


# llama.cpp tensor names -> Hugging Face names (block tensors relative to model.layers.N).
_GGUF_LLAMA_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GEMMA3_NAMES = {
    **_GGUF_LLAMA_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class _GGUFFormat:
    names: dict[str, str]
    unpermute_rope: bool  # llama.cpp interleaves Llama's q/k rows per rotary pair (not Gemma's)
    norm_shift: float  # subtracted from norm weights: llama.cpp stores Gemma's as 1 + w


_GGUF_FORMATS = {
    "LlamaForCausalLM": _GGUFFormat(_GGUF_LLAMA_NAMES, unpermute_rope=True, norm_shift=0.0),
    "Gemma3ForCausalLM": _GGUFFormat(_GGUF_GEMMA3_NAMES, unpermute_rope=False, norm_shift=1.0),
}


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair; undo it back to rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(path: Path, config) -> Iterator[tuple[str, torch.Tensor]]:
    """A GGUF file's tensors under Hugging Face names, dequantized to float32 (Q4_K, Q6_K, Q8_0, ...)."""
    _require_gguf()
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # a truncated file fails inside numpy (memmap / reshape)
        raise _corrupt(path, e) from None
    arch = architecture_of(config)
    fmt = _GGUF_FORMATS.get(arch)
    if fmt is None:
        raise ModelLoadError(f"GGUF loading supports {', '.join(_GGUF_FORMATS)} files, this one is {arch}",
                             fix="use a safetensors checkpoint")
    for t in reader.tensors:
        parts = t.name.split(".")
        block = parts[0] == "blk"
        if len(parts) != (4 if block else 2) or (block and not parts[1].isdigit()):
            raise WeightError(f"GGUF tensor {t.name!r} is not a {arch} tensor name (blk.<N>.<name>.<kind> or "
                              "<name>.<kind>)", fix=f"use a {arch} GGUF file")
        base, suffix = (parts[2], parts[3]) if block else (parts[0], parts[1])
        if base not in fmt.names:
            raise WeightError(f"GGUF tensor {t.name!r} is not a {arch} tensor", fix=f"use a {arch} GGUF file")
        name = f"model.layers.{parts[1]}.{fmt.names[base]}.{suffix}" if block else f"{fmt.names[base]}.{suffix}"
        try:
            w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        except Exception as e:
            raise _corrupt(path, e, t.name) from None
        if block and fmt.unpermute_rope and base == "attn_q":
            w = _unpermute_rope(w, config.num_attention_heads)
        elif block and fmt.unpermute_rope and base == "attn_k":
            w = _unpermute_rope(w, config.num_key_value_heads)
        w = np.array(w, dtype=np.float32)  # a copy: GGUF data is a read-only memmap
        if fmt.norm_shift and "norm" in base:
            w -= fmt.norm_shift
        yield name, torch.from_numpy(w)


def checkpoint_tensor_names(src: CheckpointSource) -> list[str]:
    """Every tensor name of a safetensors checkpoint, from the shard headers (no tensor is read)."""
    from safetensors import safe_open

    if src.gguf_file:
        return []
    names: list[str] = []
    for f in _safetensors_files(src.directory):
        try:
            names += list(safe_open(src.directory / f, framework="pt").keys())
        except Exception as e:  # SafetensorError, OSError: the reader's own types
            raise _corrupt(src.directory / f, e) from None
    return names


def iter_weights(src: CheckpointSource, config) -> Iterator[tuple[str, torch.Tensor]]:
    if src.gguf_file:
        return iter_gguf(src.directory / src.gguf_file, config)
    return iter_safetensors(src.directory)
