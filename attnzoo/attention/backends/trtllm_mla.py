"""The ``trtllm_mla`` backend: TRT-LLM's MLA decode kernels through FlashInfer: trtllm-gen on SM100/SM103,
XQA-MLA on SM120/SM121 (128 query heads only).

Decode only: ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` over our MLA pool entry
``pool.k(layer)`` = [num_pages, 1, page_size, kv_lora_rank + rope] (the kernel's own 4-D layout, read in
place), with the absorbed query [num_reqs, 1, heads, 576] and output [num_reqs, heads, kv_lora_rank].
Page size 32 or 64 (XQA-MLA: 16, 32, 64 or 128); the block table comes from the shared page-table kernel with its column count
padded to a multiple of 128 / page_size (pad entries point at the reserved page 0). bfloat16 only:
FlashInfer allocates and checks a bfloat16 output. Extend has no TRT-LLM MLA kernel here (the field's
trtllm_mla prefills with ``trtllm_ragged_attention_deepseek`` over non-absorbed K/V, which the absorbed
MLA layer does not form): pair this backend with an MLA prefill backend (``prefill_backend='flashinfer_mla'``,
``'triton'`` or ``'torch'``).

CUDA graphs (decode): the block table lives in a static buffer sized by ``init_graph_state`` and is
refilled in place by ``prepare_graph``; sequence lengths are read from ``meta.seq_lens`` on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attnzoo.attention.backends.base import AttentionBackend
from attnzoo.attention.backends.fi_common import (
    GraphBlockTable,
    LayerSignature,
    check_dtype,
    check_page_size,
    compute_capability,
    load_flashinfer,
    sm_name,
    workspace,
)
from attnzoo.attention.kernels import page_table
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.errors import BackendError

PAGE_SIZES = (32, 64)  # trtllm-gen
XQA_PAGE_SIZES = (16, 32, 64, 128)  # FlashInfer 0.7.2 jit/xqa.py gen_xqa_module_mla
TRTLLM_GEN_SMS = ((10, 0), (10, 3))
XQA_SMS = ((12, 0), (12, 1))
XQA_NUM_HEADS = 128  # XQA-MLA builds for a head group of 128 only
BLOCK_TABLE_PAD_TOKENS = 128  # the kernel wants columns * page_size to be a multiple of 128
# DeepSeek's non-absorbed q/k nope width. The kernel computes in the absorbed space and does not use
# it; FlashInfer only keys its tuning cache on it, and our layer (absorbed) does not carry it.
_QK_NOPE_HEAD_DIM = 128


@dataclass
class _Step:
    block_table: torch.Tensor  # [num_reqs, num_cols] int32, device; num_cols % (128 / page_size) == 0
    max_seq_len: int


def block_table_columns(max_pages: int, page_size: int) -> int:
    """Columns of the padded block table for a step whose longest request spans ``max_pages`` pages."""
    return page_table.padded_block_table_width(max_pages, BLOCK_TABLE_PAD_TOKENS // page_size)


class TrtllmMLABackend(AttentionBackend):
    name = "trtllm_mla"
    supports_cuda_graph = True

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        # The package first: without it nothing else matters, and the error names the extra.
        self._fi = load_flashinfer(self.name)
        self._cc = compute_capability(self.name, pool.device)
        if self._cc not in TRTLLM_GEN_SMS + XQA_SMS:
            raise BackendError(
                f"trtllm_mla runs on SM100/SM103 (trtllm-gen) and SM120/SM121 (XQA-MLA); this GPU is "
                f"{sm_name(self._cc)}",
                fix="choose backend='flashinfer_mla' or 'triton'",
            )
        check_dtype(self.name, pool.dtype, allowed=(torch.bfloat16,))
        pages = PAGE_SIZES if self._cc in TRTLLM_GEN_SMS else XQA_PAGE_SIZES
        if pool.page_size not in pages:
            sizes = ", ".join(map(str, pages))
            raise BackendError(
                f"trtllm_mla on {sm_name(self._cc)} needs page size {sizes}; the KV pool has {pool.page_size}",
                fix=f"load the model with page_size one of {sizes}",
            )
        self._state_key = f"{self.name}:{id(self)}"
        self._graph: GraphBlockTable | None = None

    def decode_kernel(self) -> str:
        """FlashInfer's name for the kernel family that decodes on this GPU."""
        return "trtllm-gen" if self._cc in TRTLLM_GEN_SMS else "xqa"

    def kernels_for(self, layer) -> dict[str, str]:
        return {"prefill": "none (decode-only backend)",
                "decode": f"{self.decode_kernel()} MLA decode (trtllm_batch_decode_with_kv_cache_mla)"}

    # ---------------------------------------------------------------- per step

    def prepare(self, meta: BatchMetadata) -> None:
        check_page_size(self.name, meta.page_size, self.pool.page_size)
        if not meta.is_decode:
            return  # extend() raises: this backend has no prefill path
        max_pages = -(-meta.max_seq_len // meta.page_size)
        table = page_table.create_block_table(
            meta.block_tables, meta.seq_lens, meta.page_size,
            num_cols=block_table_columns(max_pages, meta.page_size), pad_value=0, max_pages=max_pages,
        )
        meta.backend_state[self._state_key] = _Step(block_table=table, max_seq_len=meta.max_seq_len)

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        self._graph = GraphBlockTable(self.name, max_batch_size, max_pages_per_req,
                                      num_cols=block_table_columns(max_pages_per_req, self.pool.page_size),
                                      page_size=self.pool.page_size, device=self.pool.device)

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> None:
        if self._graph is None:
            raise BackendError("prepare_graph before init_graph_state", fix="call init_graph_state first")
        table = self._graph.fill(meta)
        meta.backend_state[self._state_key] = _Step(block_table=table, max_seq_len=self._graph.max_seq_len)

    # ---------------------------------------------------------------- per layer

    def extend(self, layer, q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        raise BackendError(
            "trtllm_mla is a decode-only backend: it has no extend (prefill) kernel",
            fix="pair it with an MLA prefill backend, e.g. prefill_backend='flashinfer_mla' (or 'triton'), "
                "decode_backend='trtllm_mla'",
        )

    def decode(self, layer, q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        sig = LayerSignature.of(layer)
        rope = sig.head_dim - sig.v_head_dim
        if layer.kind != "mla" or (sig.v_head_dim, rope) != (512, 64):
            raise BackendError(
                f"trtllm_mla serves DeepSeek MLA layers (latent 512, rope 64); layer {layer.layer_id} is "
                f"{layer.kind} with q/k {sig.head_dim}, v {sig.v_head_dim}",
                fix="choose backend='flashinfer_mla' or 'triton'",
            )
        if layer.index_head_dim:
            raise BackendError(
                f"layer {layer.layer_id} is sparse (NSA) MLA; trtllm_mla runs dense MLA decode here, which would "
                "ignore the indexer's top-k selection",
                fix="choose an NSA decode backend (triton or torch)",
            )
        if 64 < sig.num_heads < 128:
            raise BackendError(
                f"trtllm-gen MLA decode does not run {sig.num_heads} query heads (64 < heads < 128)",
                fix="choose backend='flashinfer_mla' or 'triton'",
            )
        if self.decode_kernel() == "xqa" and sig.num_heads != XQA_NUM_HEADS:
            raise BackendError(
                f"XQA-MLA ({sm_name(self._cc)}) runs {XQA_NUM_HEADS} query heads only; layer {layer.layer_id} has "
                f"{sig.num_heads}",
                fix="choose backend='triton' on this GPU",
            )
        step = meta.backend_state.get(self._state_key)
        if step is None:
            self.prepare(meta)
            step = meta.backend_state[self._state_key]
        out = self._fi.trtllm_batch_decode_with_kv_cache_mla(
            query=q.unsqueeze(1),  # [num_reqs, 1 query token, heads, latent + rope]
            kv_cache=self.pool.k(layer.layer_id),  # [num_pages, 1, page_size, latent + rope]
            workspace_buffer=workspace(self.pool.device, "trtllm"),
            qk_nope_head_dim=_QK_NOPE_HEAD_DIM,
            kv_lora_rank=sig.v_head_dim,
            qk_rope_head_dim=rope,
            block_tables=step.block_table,
            seq_lens=meta.seq_lens,
            max_seq_len=step.max_seq_len,
            bmm1_scale=sig.scale,  # the full softmax scale (bf16 q and cache: no quantisation scales)
            bmm2_scale=1.0,
            backend=self.decode_kernel(),
        )
        return out.squeeze(1)  # [num_reqs, heads, latent]
