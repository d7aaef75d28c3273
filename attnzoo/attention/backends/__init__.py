"""Attention backends, registered by name and imported only when asked for.

Adding a backend: one file in this folder with a subclass of ``AttentionBackend`` that declares its
``capabilities`` (``capabilities.py``), and one line in ``_REGISTRY``. The policy reads the declarations
through ``capabilities_of``; backend modules import their kernel libraries lazily, so that is cheap and
works without FlashInfer, Triton or a GPU.
"""
from __future__ import annotations

import dataclasses

from attnzoo.errors import BackendError
from attnzoo.lazy import import_object

_REGISTRY: dict[str, str] = {
    "torch": "attnzoo.attention.backends.torch_ref:TorchBackend",
    "triton": "attnzoo.attention.backends.triton:TritonBackend",
    "flashinfer": "attnzoo.attention.backends.flashinfer:FlashInferBackend",
    "trtllm_mha": "attnzoo.attention.backends.trtllm_mha:TrtllmMHABackend",
    "flashinfer_mla": "attnzoo.attention.backends.flashinfer_mla:FlashInferMLABackend",
    "trtllm_mla": "attnzoo.attention.backends.trtllm_mla:TrtllmMLABackend",
    "nsa_triton": "attnzoo.attention.backends.nsa_triton:NSATritonBackend",
    "nsa_triton_fp8": "attnzoo.attention.backends.nsa_triton:NSATritonFP8Backend",
    "compressed_triton": "attnzoo.attention.backends.compressed_triton:CompressedTritonBackend",
}


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def get_backend_class(name: str):
    if name not in _REGISTRY:
        raise BackendError(
            f"unknown attention backend {name!r}",
            fix=f"choose one of: {', '.join(backend_names())}",
        )
    return import_object(_REGISTRY[name])


def capabilities_of(name: str):
    """The declared capabilities of registered backend ``name`` (a ``BackendCapabilities``). A subclass
    without a declaration of its own (a test's variant) runs under its parent's, by its own name."""
    cls = get_backend_class(name)
    caps = getattr(cls, "capabilities", None)
    if caps is None:
        raise BackendError(f"backend {name!r} ({_REGISTRY[name]}) declares no capabilities",
                           fix="set `capabilities = BackendCapabilities(...)` on its class")
    return caps if caps.name == name else dataclasses.replace(caps, name=name)


def all_capabilities() -> dict:
    """Every registered backend's capabilities, by name (sorted)."""
    return {name: capabilities_of(name) for name in backend_names()}
