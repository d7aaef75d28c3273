"""Attention backends, registered by name and imported only when asked for.

Adding a backend: one file in this folder with a subclass of ``AttentionBackend``, one line in
``_REGISTRY``, and its capabilities in ``attnzoo/defaults/capabilities.py``.
"""
from __future__ import annotations

import importlib

from attnzoo.errors import BackendError

_REGISTRY: dict[str, str] = {
    "torch": "attnzoo.attention.backends.torch_ref:TorchBackend",
    "triton": "attnzoo.attention.backends.triton:TritonBackend",
    "flashinfer": "attnzoo.attention.backends.flashinfer:FlashInferBackend",
    "trtllm_mha": "attnzoo.attention.backends.trtllm_mha:TrtllmMHABackend",
    "flashinfer_mla": "attnzoo.attention.backends.flashinfer_mla:FlashInferMLABackend",
    "trtllm_mla": "attnzoo.attention.backends.trtllm_mla:TrtllmMLABackend",
    "nsa_triton": "attnzoo.attention.backends.nsa_triton:NSATritonBackend",
    "nsa_triton_fp8": "attnzoo.attention.backends.nsa_triton:NSATritonFP8Backend",
}


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def get_backend_class(name: str):
    if name not in _REGISTRY:
        raise BackendError(
            f"unknown attention backend {name!r}",
            fix=f"choose one of: {', '.join(backend_names())}",
        )
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)
