"""The ``trtllm_mha`` backend: TRT-LLM attention kernels through FlashInfer, for MHA/GQA/MQA models.

decode: ``flashinfer.decode.trtllm_batch_decode_with_kv_cache`` over the HND pool with a 2-D block
  table built by the shared page-table kernel. The kernel family depends on the GPU: trtllm-gen on
  SM100/SM103, XQA on SM90/SM120 (``decode_kernel``). Page size 16, 32 or 64 (XQA also 128); sliding
  windows; attention sinks; no logit soft-capping (the kernels take no soft-cap argument).
extend (prefill): split by GPU, explicitly (``extend_runs_as``):
  - SM100/SM103: ``flashinfer.prefill.trtllm_batch_context_with_kv_cache`` (trtllm-gen context kernels);
  - elsewhere there is no TRT-LLM context kernel, so extend runs the ``flashinfer`` backend's paged
    prefill (FA3 on SM90 where it builds, else FA2): ``HybridBackend.create`` builds that backend for
    the prefill phase, and this class's own ``extend`` refuses those GPUs.
  The class's capability declaration states the split (``Kernel.runs_as``); the hybrid backend and the
  Decision both read it there.

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

from attnzoo.attention.backends.base import AttentionBackend, StepPlan
from attnzoo.attention.backends.capabilities import FP8_KV, HALF, BackendCapabilities
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
_TRTLLM_GEN = gpu_set("sm100", "sm103")  # SM100 (B200/GB200), SM103 (B300/GB300)
_TRTLLM_GEN_PAGES = frozenset({16, 32, 64})
_NOT_WIRED = "not wired for an fp8 KV cache with bf16/fp16 queries"
_HEAD_DIMS = frozenset({64, 128, 256, 512})


@dataclass
class TrtllmMHAPlan(StepPlan):
    """The step's block table (graph steps: the static one, refilled) and the lengths the kernels need."""

    block_table: torch.Tensor  # [num_reqs, num_cols] int32, device
    max_seq_len: int  # host: the longest KV length the kernels schedule for
    max_q_len: int
    cum_seq_lens_q: torch.Tensor | None = None  # [num_reqs + 1] int32, device (trtllm-gen context only)
    cum_seq_lens_kv: torch.Tensor | None = None  # [num_reqs + 1] int32, device (trtllm-gen context only)
    # A pool with a window page group: that group's table, read by the sliding-window layers.
    window_block_table: torch.Tensor | None = None  # [num_reqs, num_cols] int32, device

    def table_for(self, layer) -> torch.Tensor:
        return self.window_block_table if layer.sliding_window and self.window_block_table is not None else self.block_table


class TrtllmMHABackend(AttentionBackend):
    capabilities = BackendCapabilities(
        name="trtllm_mha",
        description="TRT-LLM attention through FlashInfer: trtllm-gen on SM100/SM103, XQA decode on SM90/SM120",
        kinds=frozenset({"mha"}),
        prefill=(
            Kernel("trtllm-gen context (trtllm_batch_context_with_kv_cache)", _TRTLLM_GEN,
                   page_sizes=_TRTLLM_GEN_PAGES, no_fp8_kv_gpus=_TRTLLM_GEN, note=_NOT_WIRED, label="trtllm-gen"),
            Kernel("FlashInfer FA3 prefill", gpu_set("sm90"), excluded_head_dims=frozenset({512}),
                   runs_as="flashinfer", no_fp8_kv_gpus=gpu_set("sm90"), sinks=False,
                   note="trtllm-gen context kernels are SM100/SM103 only; FA3 takes no fp8 KV with bf16 queries"),
            Kernel("FlashInfer FA2 prefill", gpu_set("sm90", "sm120"), runs_as="flashinfer", sinks=False,
                   note="trtllm-gen context kernels are SM100/SM103 only"),
        ),
        decode=(
            Kernel("trtllm-gen decode (trtllm_batch_decode_with_kv_cache)", _TRTLLM_GEN,
                   page_sizes=_TRTLLM_GEN_PAGES, no_fp8_kv_gpus=_TRTLLM_GEN, note=_NOT_WIRED,
                   label="trtllm-gen", variant="trtllm-gen"),
            # FlashInfer 0.7.2 jit/xqa.py builds XQA for 16, 32, 64 and 128 tokens per page.
            Kernel("XQA decode (trtllm_batch_decode_with_kv_cache)", gpu_set("sm90", "sm120"),
                   max_group_above=(256, 16), page_sizes=frozenset({16, 32, 64, 128}), label="XQA", variant="xqa"),
        ),
        head_dims=_HEAD_DIMS,
        v_head_dims=_HEAD_DIMS,
        same_qk_v_head_dim=True,
        dtypes=HALF,
        kv_dtypes=HALF | FP8_KV,
        sliding_window=True,
        logit_softcap=False,  # the trtllm kernels take no soft-cap argument
        # trtllm-gen (context and decode) and XQA take per-head sinks (`sinks=`, float32 [num_heads]); the
        # FlashInfer prefill it runs as off Blackwell does not (Kernel.sinks=False there).
        attention_sinks=True,
        module="flashinfer",
        extra="flashinfer",
        cuda_graph=True,
        notes=("MHA/GQA models only",
               "trtllm-gen also has page-128 kernels for GQA (SGLang 0.5.23 allows page 128 for trtllm_mha); "
               "not declared on SM100/SM103: unverified here"),
    )
    fix = "choose backend='flashinfer' or 'triton' for this model on this GPU (MLA models: 'trtllm_mla' or 'flashinfer_mla')"

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        # The package first: without it nothing else matters, and the error names the extra.
        self._fi = load_flashinfer(self.name)
        self._cc = compute_capability(self.name, pool.device)
        self.gpu = gpu_of(self._cc)
        self.require_pool()
        self._graph: GraphBlockTable | None = None
        self._window_graph: GraphBlockTable | None = None  # the window group's, where the pool has one

    # ---------------------------------------------------------------- kernel choice (reported)

    @classmethod
    def extend_runs_as(cls, cc: tuple[int, int]) -> str:
        """The backend whose kernels run extend on a GPU of compute capability ``cc`` (the declaration's)."""
        kernel = cls.capabilities.kernel_on("prefill", gpu_of(cc))
        return (kernel.runs_as if kernel else None) or cls.name

    def decode_kernel(self) -> str:
        """FlashInfer's name for the kernel family that decodes on this GPU (the declaration's variant)."""
        return self.capabilities.kernel_on("decode", self.gpu).variant

    def kernels_for(self, layer) -> dict[str, str]:
        """The kernels this backend runs for ``layer``, per phase, for reports and the Decision."""
        runs_as = self.extend_runs_as(self._cc)
        if runs_as == self.name:
            prefill = "trtllm-gen context (trtllm_batch_context_with_kv_cache)"
        else:
            prefill = f"runs as {runs_as}: " + self.check_layer("prefill", layer).name
        return {"prefill": prefill, "decode": f"{self.decode_kernel()} (trtllm_batch_decode_with_kv_cache)"}

    # ---------------------------------------------------------------- per step

    def prepare(self, meta: BatchMetadata) -> TrtllmMHAPlan:
        check_page_size(self.name, meta.page_size, self.pool.page_size)
        if not meta.is_decode:
            self._require_context_kernel()
        ps = meta.page_size
        max_pages = -(-meta.max_seq_len // ps)
        tables = [page_table.create_block_table(t, meta.seq_lens, ps, num_cols=max_pages, pad_value=0, max_pages=max_pages)
                  if t is not None else None for t in (meta.block_tables, meta.window_block_tables)]
        step = TrtllmMHAPlan(block_table=tables[0], max_seq_len=meta.max_seq_len, max_q_len=meta.max_q_len,
                             window_block_table=tables[1])
        if not meta.is_decode:  # trtllm-gen context: cumulative query and KV lengths
            kv = [0]
            for s in meta.seq_lens_cpu:
                kv.append(kv[-1] + s)
            step.cum_seq_lens_q = meta.q_indptr
            step.cum_seq_lens_kv = torch.tensor(kv, dtype=torch.int32).to(self.pool.device, non_blocking=True)
        return step

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        def table():
            return GraphBlockTable(self.name, max_batch_size, max_pages_per_req, num_cols=max_pages_per_req,
                                   page_size=self.pool.page_size, device=self.pool.device)

        self._graph = table()
        self._window_graph = table() if self.pool.has_window_group else None

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> TrtllmMHAPlan:
        if self._graph is None:
            raise BackendError("prepare_graph before init_graph_state", fix="call init_graph_state first")
        table = self._graph.fill(meta)
        window = self._window_graph.fill(meta, meta.window_block_tables) if self._window_graph is not None else None
        return TrtllmMHAPlan(block_table=table, max_seq_len=self._graph.max_seq_len, max_q_len=1,
                             window_block_table=window)

    def _require_context_kernel(self) -> None:
        runs_as = self.extend_runs_as(self._cc)
        if runs_as != self.name:
            raise BackendError(
                f"{self.name} has no context kernel on {self.gpu}: its extend runs as the {runs_as} backend there",
                fix="build the step's backends with HybridBackend.create (load_model does), which runs "
                    f"{runs_as} for prefill",
            )

    # ---------------------------------------------------------------- per layer

    def _check_layer(self, layer, phase: str) -> LayerSignature:
        self.check_layer(phase, layer)
        return LayerSignature.of(layer)

    def extend(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: TrtllmMHAPlan) -> torch.Tensor:
        self._require_context_kernel()
        sig = self._check_layer(layer, "prefill")
        step = plan
        lid = layer.layer_id
        return self._fi.trtllm_batch_context_with_kv_cache(
            query=q,  # [num_tokens, heads, head_dim]
            kv_cache=(self.pool.k(lid), self.pool.v(lid)),
            workspace_buffer=workspace(self.pool.device, "trtllm"),
            block_tables=step.table_for(layer),
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
            sinks=_sinks(layer),
        )

    def decode(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: TrtllmMHAPlan) -> torch.Tensor:
        sig = self._check_layer(layer, "decode")
        step = plan
        lid = layer.layer_id
        return self._fi.trtllm_batch_decode_with_kv_cache(
            query=q,  # [num_reqs, heads, head_dim]: one query token per request
            kv_cache=(self.pool.k(lid), self.pool.v(lid)),
            workspace_buffer=workspace(self.pool.device, "trtllm"),
            block_tables=step.table_for(layer),
            seq_lens=meta.seq_lens,
            max_seq_len=step.max_seq_len,
            bmm1_scale=sig.scale * self.pool.k_scale,  # the softmax scale (q is unscaled; fp8 k times k_scale)
            bmm2_scale=self.pool.v_scale,
            window_left=sig.window_left,
            kv_layout="HND",
            backend=self.decode_kernel(),
            q_len_per_req=1,
            sinks=_sinks(layer),
        )


def _sinks(layer) -> torch.Tensor | None:
    """The layer's sink logits as the kernels take them: float32 [num_heads] (None: no sinks)."""
    if layer.sinks is None:
        return None
    return layer.sinks if layer.sinks.dtype == torch.float32 else layer.sinks.float()

