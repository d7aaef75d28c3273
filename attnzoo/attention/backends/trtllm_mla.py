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

from attnzoo.attention.backends.base import AttentionBackend, StepPlan
from attnzoo.attention.backends.capabilities import BackendCapabilities
from attnzoo.attention.backends.gpus import Kernel, gpu_of, gpu_set
from attnzoo.attention.backends.fi_common import (
    GraphBlockTable,
    LayerSignature,
    check_page_size,
    compute_capability,
    load_flashinfer,
    workspace,
)
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.errors import BackendError
from attnzoo.lazy import lazy_module

page_table = lazy_module("attnzoo.attention.kernels.page_table")  # Triton: imported on first use
# DeepSeek's non-absorbed q/k nope width. The kernel computes in the absorbed space and does not use
# it; FlashInfer only keys its tuning cache on it, and our layer (absorbed) does not carry it.
_QK_NOPE_HEAD_DIM = 128


@dataclass
class TrtllmMLAPlan(StepPlan):
    """A decode step's block table (graph steps: the static one, refilled) and longest context."""

    block_table: torch.Tensor  # [num_reqs, num_cols] int32, device; num_cols % (128 / page_size) == 0
    max_seq_len: int  # host: the longest KV length the kernel schedules for


def block_table_columns(max_pages: int, page_size: int) -> int:
    """Columns of the padded block table for a step whose longest request spans ``max_pages`` pages."""
    return page_table.padded_block_table_width(
        max_pages, TrtllmMLABackend.capabilities.block_table_columns_multiple(page_size))


class TrtllmMLABackend(AttentionBackend):
    capabilities = BackendCapabilities(
        name="trtllm_mla",
        description="TRT-LLM MLA decode through FlashInfer (trtllm_batch_decode_with_kv_cache_mla): "
                    "trtllm-gen on SM100/SM103, XQA-MLA on SM120",
        kinds=frozenset({"mla"}),  # dense decode; the V3.2 sparse decode is planned
        prefill=(),
        decode=(
            Kernel("trtllm-gen MLA decode", gpu_set("sm100", "sm103"), page_sizes=frozenset({32, 64}),
                   label="trtllm-gen", variant="trtllm-gen"),
            # FlashInfer 0.7.2 jit/xqa.py gen_xqa_module_mla builds pages of 16..128 and a head group of 128.
            Kernel("XQA-MLA decode", gpu_set("sm120"), page_sizes=frozenset({16, 32, 64, 128}),
                   num_heads=frozenset({128}), note="XQA-MLA builds for 128 query heads only",
                   label="XQA-MLA", variant="xqa"),
        ),
        mla_dims=frozenset({(576, 512)}),  # DeepSeek absorbed MLA: kv_lora_rank 512 + rope 64, values 512
        excluded_num_heads=(65, 127),
        dtypes=frozenset({"bfloat16"}),  # FlashInfer allocates and checks a bfloat16 output
        kv_dtypes=frozenset({"bfloat16"}),
        module="flashinfer",
        extra="flashinfer",
        cuda_graph=True,
        block_table_pad_tokens=128,  # the kernel wants columns * page_size to be a multiple of 128
        notes=(
            "decode only: pair it with an MLA prefill backend",
            "block table column count padded to a multiple of 128/page_size",
            # Kernel capabilities we do not use, and why (FlashInfer 0.7.2 mla/_core.py):
            "unused: the kernel also takes MLA dims 320/256 (latent 256 + rope 64) and 512/512 (latent 512, "
            "no rope), and fp8 KV (trtllm-gen; XQA-MLA fp8 q and KV); attnzoo's MLA models (DeepSeek-V2/V3) "
            "are 576/512 and the pool holds model-dtype (bf16) entries, so only that is declared",
            "unused: sinks (trtllm-gen MLA only; XQA-MLA refuses them): no model here has them",
        ),
    )
    fix = ("choose backend='flashinfer_mla' or 'triton' (a prefill backend: pair it with one, e.g. "
           "prefill_backend='flashinfer_mla'; sparse NSA layers: nsa_triton or torch)")

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        # The package first: without it nothing else matters, and the error names the extra.
        self._fi = load_flashinfer(self.name)
        self._cc = compute_capability(self.name, pool.device)
        self.gpu = gpu_of(self._cc)
        self.require_pool()
        self._graph: GraphBlockTable | None = None

    def decode_kernel(self) -> str:
        """FlashInfer's name for the kernel family that decodes on this GPU (the declaration's variant)."""
        return self.capabilities.kernel_on("decode", self.gpu).variant

    def kernels_for(self, layer) -> dict[str, str]:
        return {"prefill": "none (decode-only backend)",
                "decode": f"{self.decode_kernel()} MLA decode (trtllm_batch_decode_with_kv_cache_mla)"}

    # ---------------------------------------------------------------- per step

    def prepare(self, meta: BatchMetadata) -> StepPlan:
        check_page_size(self.name, meta.page_size, self.pool.page_size)
        if not meta.is_decode:
            return StepPlan()  # extend() raises: this backend has no prefill path
        max_pages = -(-meta.max_seq_len // meta.page_size)
        table = page_table.create_block_table(
            meta.block_tables, meta.seq_lens, meta.page_size,
            num_cols=block_table_columns(max_pages, meta.page_size), pad_value=0, max_pages=max_pages,
        )
        return TrtllmMLAPlan(block_table=table, max_seq_len=meta.max_seq_len)

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        self._graph = GraphBlockTable(self.name, max_batch_size, max_pages_per_req,
                                      num_cols=block_table_columns(max_pages_per_req, self.pool.page_size),
                                      page_size=self.pool.page_size, device=self.pool.device)

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> TrtllmMLAPlan:
        if self._graph is None:
            raise BackendError("prepare_graph before init_graph_state", fix="call init_graph_state first")
        table = self._graph.fill(meta)
        return TrtllmMLAPlan(block_table=table, max_seq_len=self._graph.max_seq_len)

    # ---------------------------------------------------------------- per layer

    def extend(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: StepPlan) -> torch.Tensor:
        self.check_layer("prefill", layer)  # raises: the declaration has no prefill kernel
        raise AssertionError("unreachable: trtllm_mla declares no prefill kernel")

    def decode(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: TrtllmMLAPlan) -> torch.Tensor:
        self.check_layer("decode", layer)
        sig = LayerSignature.of(layer)
        rope = sig.head_dim - sig.v_head_dim
        out = self._fi.trtllm_batch_decode_with_kv_cache_mla(
            query=q.unsqueeze(1),  # [num_reqs, 1 query token, heads, latent + rope]
            kv_cache=self.pool.k(layer.layer_id),  # [num_pages, 1, page_size, latent + rope]
            workspace_buffer=workspace(self.pool.device, "trtllm"),
            qk_nope_head_dim=_QK_NOPE_HEAD_DIM,
            kv_lora_rank=sig.v_head_dim,
            qk_rope_head_dim=rope,
            block_tables=plan.block_table,
            seq_lens=meta.seq_lens,
            max_seq_len=plan.max_seq_len,
            bmm1_scale=sig.scale,  # the full softmax scale (bf16 q and cache: no quantisation scales)
            bmm2_scale=1.0,
            backend=self.decode_kernel(),
        )
        return out.squeeze(1)  # [num_reqs, heads, latent]
