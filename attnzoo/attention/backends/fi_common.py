"""What the FlashInfer-backed backends share: the import, the workspaces, the per-layer signature.

Nothing here touches FlashInfer or the GPU at import time. ``load_flashinfer`` imports it when a
backend is constructed and turns a missing or broken install into a ``BackendError`` that names the
pip extra. Workspaces are allocated on first use by a backend instance and then shared by every
backend on that device (kernels on one stream run one after another, so sharing is safe within a
purpose), keyed by purpose because the purposes must not alias:

* ``"wrappers"``: the float workspace of the plan/run wrappers (split-KV partial results), 128 MiB as
  FlashInfer recommends. Contents are scratch.
* ``"trtllm"``: the workspace of the TRT-LLM kernels (XQA keeps its semaphores in the first 8 MiB and
  needs them zeroed before first use; trtllm-gen keeps softmax statistics). Zero-initialised, 512 MiB:
  XQA's multi-block scratch grows with batch x KV heads, and SGLang sizes the same buffer at 512 MiB.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from attnzoo.errors import BackendError

FLASHINFER_FIX = 'pip install "attnzoo[flashinfer]" (flashinfer-python==0.7.2.post1 with apache-tvm-ffi==0.1.15.post2)'

_WORKSPACE_BYTES = {"wrappers": 128 << 20, "trtllm": 512 << 20}
_workspaces: dict[tuple[str, str], torch.Tensor] = {}


def load_flashinfer(backend_name: str) -> SimpleNamespace:
    """The FlashInfer entry points the adapters call, or a BackendError naming the extra."""
    try:
        from flashinfer import cascade, decode, mla, prefill
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or a native dependency fails to load
        raise BackendError(
            f"the {backend_name!r} attention backend needs FlashInfer, which cannot be imported "
            f"({type(e).__name__}: {e})",
            fix=f"{FLASHINFER_FIX}, or choose another backend (triton, torch)",
        ) from e
    return SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=decode.BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper=prefill.BatchPrefillWithPagedKVCacheWrapper,
        trtllm_batch_decode_with_kv_cache=decode.trtllm_batch_decode_with_kv_cache,
        trtllm_batch_context_with_kv_cache=prefill.trtllm_batch_context_with_kv_cache,
        BatchMLAPagedAttentionWrapper=mla.BatchMLAPagedAttentionWrapper,
        MLAPlanMetadata=mla.MLAPlanMetadata,
        merge_state=cascade.merge_state,
        trtllm_batch_decode_with_kv_cache_mla=mla.trtllm_batch_decode_with_kv_cache_mla,
    )


def workspace(device: torch.device, purpose: str) -> torch.Tensor:
    """The device's workspace for ``purpose`` ("wrappers" or "trtllm"), allocated on first request."""
    key = (str(device), purpose)
    buf = _workspaces.get(key)
    if buf is None:
        # zeros, not empty: XQA's semaphores must start at zero, and zeroing the rest once is free.
        buf = torch.zeros(_WORKSPACE_BYTES[purpose], dtype=torch.uint8, device=device)
        _workspaces[key] = buf
    return buf


def compute_capability(backend_name: str, device: torch.device) -> tuple[int, int]:
    """(major, minor) of the pool's GPU; a BackendError when the pool is not on a CUDA device."""
    if device.type != "cuda":
        raise BackendError(
            f"the {backend_name!r} backend runs FlashInfer kernels on CUDA GPUs; the KV cache is on {device}",
            fix="load the model with device='cuda', or choose backend='torch' on CPU",
        )
    return torch.cuda.get_device_capability(device)


def sm_name(cc: tuple[int, int]) -> str:
    return f"sm{cc[0]}{cc[1]}"


def check_page_size(backend_name: str, meta_page_size: int, pool_page_size: int) -> None:
    if meta_page_size != pool_page_size:
        raise BackendError(
            f"{backend_name}: the step's page size {meta_page_size} differs from the KV pool's {pool_page_size}",
            fix="build the step's metadata with the pool's page size",
        )


@dataclass(frozen=True)
class LayerSignature:
    """Everything a FlashInfer plan bakes in about a layer. Layers with equal signatures share a plan;
    a model whose layers differ (Gemma 4: sliding d256 and global d512 layers) gets one plan each."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None  # our convention: a query at p sees keys j with p - window < j <= p
    softcap: float | None
    scale: float

    @classmethod
    def of(cls, layer) -> "LayerSignature":
        return cls(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            v_head_dim=layer.v_head_dim,
            window=layer.sliding_window or None,
            softcap=layer.logit_softcap or None,
            scale=float(layer.scale),
        )

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def window_left(self) -> int:
        """FlashInfer's ``window_left`` (a query at p sees keys j >= p - window_left, inclusive), or -1
        for no window. Ours excludes p - window, so it is one less than our window."""
        return self.window - 1 if self.window else -1


def window_page_start(seq_lens: list[int], q_lens: list[int], page_size: int, window: int | None) -> list[int] | None:
    """Per request, the first page any of its queries can see under a sliding window (None: no window).

    The first query of request i sits at ``seq_lens[i] - q_lens[i]`` and sees keys from
    ``pos - window + 1``; whole pages before that are skipped. Kernels mask relative to the end of the
    KV range, so dropping whole leading pages leaves every visible key where it was.
    """
    if not window:
        return None
    return [max(0, s - q - window + 1) // page_size for s, q in zip(seq_lens, q_lens)]


class GraphBlockTable:
    """The padded block table a captured decode step reads (the TRT-LLM kernels take one): allocated once
    for the largest batch and context, refilled in place before each replay, so the graph's address holds."""

    def __init__(self, backend_name: str, max_batch_size: int, max_pages_per_req: int, num_cols: int,
                 page_size: int, device: torch.device):
        self.backend_name = backend_name
        self.table = torch.zeros(max_batch_size, num_cols, dtype=torch.int32, device=device)  # [max_batch, num_cols]
        # The kernels are scheduled for the longest context any replay may see.
        self.max_seq_len = max_pages_per_req * page_size

    def fill(self, meta) -> torch.Tensor:
        """This step's rows, written into the static table: [num_reqs, num_cols] int32, device."""
        if not meta.is_decode:
            raise BackendError(f"{self.backend_name} captures decode steps only", fix="run extend steps eagerly")
        from attnzoo.attention.kernels import page_table  # Triton: imported when a graph is captured, not here

        return page_table.create_block_table(
            meta.block_tables, meta.seq_lens, meta.page_size, num_cols=self.table.shape[1],
            pad_value=0, max_pages=-(-meta.max_seq_len // meta.page_size), out=self.table,
        )
