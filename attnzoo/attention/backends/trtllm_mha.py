"""The ``trtllm_mha`` backend: TRT-LLM attention kernels through FlashInfer, for MHA/GQA/MQA models.

decode: ``flashinfer.decode.trtllm_batch_decode_with_kv_cache`` over the HND pool with a 2-D block
  table built by the shared page-table kernel. The kernel family depends on the GPU: trtllm-gen on
  SM100/SM103, XQA on SM90/SM120 (``decode_kernel``). Page size 16, 32 or 64 (XQA also 128); sliding
  windows; no logit soft-capping (the kernels take no soft-cap argument).
extend (prefill): split by GPU, explicitly (``extend_runs_as``):
  - SM100/SM103: ``flashinfer.prefill.trtllm_batch_context_with_kv_cache`` (trtllm-gen context kernels);
  - elsewhere there is no TRT-LLM context kernel, so extend runs the ``flashinfer`` backend's paged
    prefill (FA3 on SM90 where it builds, else FA2), planned and run by an inner ``FlashInferBackend``.
  The policy's capability declaration names the same split (``Kernel.runs_as``), and the Decision shows it.

fp8 KV cache: decode passes the pool's scales as the kernels' fused scales (bmm1 = softmax scale x
k_scale, bmm2 = v_scale) with bf16/fp16 queries (XQA reads fp8 pages natively). The trtllm-gen
context and decode kernels (SM100/SM103) are not declared for an fp8 cache with unquantized
queries: the backend refuses it there.

CUDA graphs (decode): the kernels read the block table and ``meta.seq_lens`` on the device. Under
``init_graph_state`` the block table lives in a static buffer sized for the largest graph, refilled in
place by ``prepare_graph``, and the longest-context bound is the graph's, so replays need nothing else.
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

PAGE_SIZES = (16, 32, 64)  # trtllm-gen
XQA_PAGE_SIZES = (16, 32, 64, 128)  # FlashInfer 0.7.2 jit/xqa.py
TRTLLM_GEN_SMS = ((10, 0), (10, 3))  # SM100 (B200/GB200), SM103 (B300/GB300)
XQA_SMS = ((9, 0), (12, 0), (12, 1))
HEAD_DIMS = (64, 128, 256, 512)


@dataclass
class _Step:
    block_table: torch.Tensor  # [num_reqs, num_cols] int32, device
    max_seq_len: int  # host: the longest KV length the kernels schedule for
    max_q_len: int
    cum_seq_lens_q: torch.Tensor | None = None  # [num_reqs + 1] int32, device (trtllm-gen context only)
    cum_seq_lens_kv: torch.Tensor | None = None  # [num_reqs + 1] int32, device (trtllm-gen context only)


class TrtllmMHABackend(AttentionBackend):
    name = "trtllm_mha"
    supports_cuda_graph = True

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        # The package first: without it nothing else matters, and the error names the extra.
        self._fi = load_flashinfer(self.name)
        self._cc = compute_capability(self.name, pool.device)
        check_dtype(self.name, pool.dtype)
        if self._cc not in TRTLLM_GEN_SMS + XQA_SMS:
            raise BackendError(
                f"trtllm_mha decode runs on SM90/SM120 (XQA) and SM100/SM103 (trtllm-gen); this GPU is {sm_name(self._cc)}",
                fix="choose backend='flashinfer' or 'triton'",
            )
        pages = PAGE_SIZES if self._cc in TRTLLM_GEN_SMS else XQA_PAGE_SIZES
        if pool.page_size not in pages:
            sizes = ", ".join(map(str, pages))
            raise BackendError(
                f"trtllm_mha on {sm_name(self._cc)} needs page size {sizes}; the KV pool has {pool.page_size}",
                fix=f"load the model with page_size one of {sizes}",
            )
        if pool.is_fp8 and self._cc in TRTLLM_GEN_SMS:
            raise BackendError(
                f"trtllm_mha on {sm_name(self._cc)} (trtllm-gen) is not wired for an fp8 KV cache with "
                f"{str(pool.dtype).removeprefix('torch.')} queries",
                fix="use kv_cache_dtype='auto', or backend='flashinfer' or 'triton' for an fp8 KV cache",
            )
        # Off Blackwell the extend path is FlashInfer's prefill, run by a backend of our own.
        self._prefill = None if self._cc in TRTLLM_GEN_SMS else _flashinfer_backend(pool)
        self._state_key = f"{self.name}:{id(self)}"
        self._graph: GraphBlockTable | None = None

    # ---------------------------------------------------------------- kernel choice (reported)

    @staticmethod
    def extend_runs_as(cc: tuple[int, int]) -> str:
        """The backend whose kernels run extend on a GPU of compute capability ``cc``."""
        return "trtllm_mha" if tuple(cc) in TRTLLM_GEN_SMS else "flashinfer"

    def decode_kernel(self) -> str:
        return "trtllm-gen" if self._cc in TRTLLM_GEN_SMS else "xqa"

    def kernels_for(self, layer) -> dict[str, str]:
        """The kernels this backend runs for ``layer``, per phase, for reports and the Decision."""
        if self._prefill is None:
            prefill = "trtllm-gen context (trtllm_batch_context_with_kv_cache)"
        else:
            prefill = "runs as flashinfer: " + self._prefill.kernels_for(layer)["prefill"]
        return {"prefill": prefill, "decode": f"{self.decode_kernel()} (trtllm_batch_decode_with_kv_cache)"}

    # ---------------------------------------------------------------- per step

    def prepare(self, meta: BatchMetadata) -> None:
        check_page_size(self.name, meta.page_size, self.pool.page_size)
        if not meta.is_decode and self._prefill is not None:
            self._prefill.prepare(meta)
            return
        ps = meta.page_size
        max_pages = -(-meta.max_seq_len // ps)
        step = _Step(
            block_table=page_table.create_block_table(
                meta.block_tables, meta.seq_lens, ps, num_cols=max_pages, pad_value=0, max_pages=max_pages,
            ),
            max_seq_len=meta.max_seq_len,
            max_q_len=meta.max_q_len,
        )
        if not meta.is_decode:  # trtllm-gen context: cumulative query and KV lengths
            kv = [0]
            for s in meta.seq_lens_cpu:
                kv.append(kv[-1] + s)
            step.cum_seq_lens_q = meta.q_indptr
            step.cum_seq_lens_kv = torch.tensor(kv, dtype=torch.int32).to(self.pool.device, non_blocking=True)
        meta.backend_state[self._state_key] = step

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        self._graph = GraphBlockTable(self.name, max_batch_size, max_pages_per_req,
                                      num_cols=max_pages_per_req,
                                      page_size=self.pool.page_size, device=self.pool.device)

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> None:
        if self._graph is None:
            raise BackendError("prepare_graph before init_graph_state", fix="call init_graph_state first")
        table = self._graph.fill(meta)
        meta.backend_state[self._state_key] = _Step(block_table=table, max_seq_len=self._graph.max_seq_len, max_q_len=1)

    def _step(self, meta: BatchMetadata) -> _Step:
        step = meta.backend_state.get(self._state_key)
        if step is None:  # a caller that skipped prepare(): planning is cheap
            self.prepare(meta)
            step = meta.backend_state[self._state_key]
        return step

    # ---------------------------------------------------------------- per layer

    def _check_layer(self, layer) -> LayerSignature:
        sig = LayerSignature.of(layer)
        if layer.kind != "mha":
            raise BackendError(
                f"layer {layer.layer_id} is {layer.kind.upper()} attention; trtllm_mha serves MHA/GQA/MQA models only",
                fix="use backend='trtllm_mla' (SM100) or 'flashinfer_mla' for MLA models",
            )
        if sig.softcap:
            raise BackendError(
                f"layer {layer.layer_id} uses attention logit soft-capping ({sig.softcap}), which the TRT-LLM kernels do not implement",
                fix="choose backend='flashinfer' or 'triton' for this model",
            )
        if sig.head_dim != sig.v_head_dim or sig.head_dim not in HEAD_DIMS:
            raise BackendError(
                f"trtllm_mha serves equal q/k and v head dims in {HEAD_DIMS}; layer {layer.layer_id} has "
                f"q/k {sig.head_dim}, v {sig.v_head_dim}",
                fix="choose backend='flashinfer' or 'triton'",
            )
        if self.decode_kernel() == "xqa" and sig.head_dim > 256 and sig.group > 16:
            raise BackendError(
                f"XQA serves head dims above 256 only with at most 16 query heads per KV head; layer "
                f"{layer.layer_id} has head dim {sig.head_dim} with {sig.group}",
                fix="choose backend='flashinfer' or 'triton' for this model on this GPU",
            )
        return sig

    def extend(self, layer, q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        if self._prefill is not None:
            self._check_layer(layer)
            return self._prefill.extend(layer, q, meta)
        sig = self._check_layer(layer)
        step = self._step(meta)
        lid = layer.layer_id
        return self._fi.trtllm_batch_context_with_kv_cache(
            query=q,  # [num_tokens, heads, head_dim]
            kv_cache=(self.pool.k(lid), self.pool.v(lid)),
            workspace_buffer=workspace(self.pool.device, "trtllm"),
            block_tables=step.block_table,
            seq_lens=meta.seq_lens,
            max_q_len=step.max_q_len,
            max_kv_len=step.max_seq_len,
            bmm1_scale=sig.scale,
            bmm2_scale=1.0,
            batch_size=meta.num_reqs,
            cum_seq_lens_q=step.cum_seq_lens_q,
            cum_seq_lens_kv=step.cum_seq_lens_kv,
            window_left=sig.window_left,
            kv_layout="HND",
            causal=True,
        )

    def decode(self, layer, q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        sig = self._check_layer(layer)
        step = self._step(meta)
        lid = layer.layer_id
        return self._fi.trtllm_batch_decode_with_kv_cache(
            query=q,  # [num_reqs, heads, head_dim]: one query token per request
            kv_cache=(self.pool.k(lid), self.pool.v(lid)),
            workspace_buffer=workspace(self.pool.device, "trtllm"),
            block_tables=step.block_table,
            seq_lens=meta.seq_lens,
            max_seq_len=step.max_seq_len,
            bmm1_scale=sig.scale * self.pool.k_scale,  # the softmax scale (q is unscaled; fp8 k times k_scale)
            bmm2_scale=self.pool.v_scale,
            window_left=sig.window_left,
            kv_layout="HND",
            backend=self.decode_kernel(),
            q_len_per_req=1,
        )


def _flashinfer_backend(pool: KVPool):
    from attnzoo.attention.backends.flashinfer import FlashInferBackend

    return FlashInferBackend(pool)
