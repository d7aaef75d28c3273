"""The ``flashinfer_mla`` backend: FlashInfer's ``BatchMLAPagedAttentionWrapper`` for absorbed MLA layers.

Our MLA pool keeps one entry per token, ``[latent (kv_lora_rank) | rope key (qk_rope_head_dim)]``, in
one buffer ``pool.k(layer)`` of shape [num_pages, 1, page_size, 576] for DeepSeek. The wrapper is given
that buffer as its *packed* KV cache (a [num_pages, page_size, 576] view, no copy); the FA2/FA3
kernels then read the latent and rope parts as two strided views of it. The absorbed query
[tokens, heads, 576] is passed packed the same way (q_nope = first 512 channels, q_pe = last 64). The
output is [tokens, heads, kv_lora_rank], the latent-space values the model projects back.

Kernels: FA3 on SM90, FA2 elsewhere (SM80+); ``variant`` forces one for measurements. Extend is
causal with queries aligned to the end of each request's KV range; decode has one query per request.
Planning is once per step in ``prepare`` per distinct (heads, dims, scale) signature, as in the
``flashinfer`` backend: learned from the first step's layers, planned up front afterwards.

CUDA graphs (decode): FlashInfer fixes a graph wrapper's batch size, so each captured batch bucket gets
its own wrapper per signature (``use_cuda_graph=True``), built over static index buffers that
``init_graph_state`` sizes for the largest bucket and context (shared by the buckets: one replays at a
time). ``prepare_graph`` runs eagerly before capture and before every replay: it writes the step's
page ids into the static ``kv_indices`` buffer and re-plans the bucket's wrappers with the step's real
lengths (``meta.seq_lens_cpu``; padding rows are one token in page 0); only ``run`` is captured.
FlashInfer's MLA plan keeps the launch grid (one CTA cluster per SM group) and its work-list offsets
fixed for a batch size, and writes the work lists into the wrapper's own integer workspace, which a
re-plan reuses, so the captured kernels read the new step's schedule.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnzoo.attention.backends.base import AttentionBackend, PlanFence, StepPlan
from attnzoo.attention.backends.capabilities import HALF, BackendCapabilities
from attnzoo.attention.backends.gpus import Kernel, gpu_of, gpu_set
from attnzoo.attention.backends.fi_common import (
    LayerSignature,
    check_page_size,
    compute_capability,
    load_flashinfer,
    sm_name,
    workspace,
)
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata, ForwardMode
from attnzoo.errors import BackendError
from attnzoo.lazy import lazy_module

page_table = lazy_module("attnzoo.attention.kernels.page_table")  # Triton: imported on first use


@dataclass
class FlashInferMLAPlan(StepPlan):
    """One step's plan metadata and the wrappers planned with it."""

    mode: ForwardMode
    metadata: object  # flashinfer.mla.MLAPlanMetadata (CSR form): host indptrs/lengths, device page ids
    planned: dict[LayerSignature, object] = field(default_factory=dict)
    graph_batch: int | None = None  # under CUDA graphs: the bucket, whose own wrappers are planned


@dataclass
class _GraphBuffers:
    """The index arrays a captured decode reads, all int32 on the pool's device, sized once for the
    largest bucket; a bucket of b requests uses their first b (+ 1) entries."""

    qo_indptr: torch.Tensor  # [max_batch + 1]
    kv_indptr: torch.Tensor  # [max_batch + 1], in pages
    kv_len: torch.Tensor  # [max_batch], in tokens
    kv_indices: torch.Tensor  # [max_batch * max_pages_per_req]: the step's page ids, request after request


def csr_plan_arrays(q_lens: list[int], seq_lens: list[int], page_size: int) -> tuple[list[int], list[int], list[int]]:
    """Host-side CSR description of a step: (qo_indptr [n + 1] in query rows, kv_indptr [n + 1] in pages,
    kv_len [n] in tokens). Request i's page ids are kv_indices[kv_indptr[i]:kv_indptr[i + 1]]."""
    qo, kv = [0], [0]
    for q, s in zip(q_lens, seq_lens):
        qo.append(qo[-1] + q)
        kv.append(kv[-1] + -(-s // page_size))
    return qo, kv, list(seq_lens)


class FlashInferMLABackend(AttentionBackend):
    capabilities = BackendCapabilities(
        name="flashinfer_mla",
        description="FlashInfer BatchMLAPagedAttentionWrapper over the absorbed latent cache",
        kinds=frozenset({"mla"}),
        prefill=(
            Kernel("FlashInfer MLA FA3", gpu_set("sm90")),
            Kernel("FlashInfer MLA FA2", gpu_set("sm80", "sm89", "sm100", "sm103", "sm120")),
        ),
        decode=(
            Kernel("FlashInfer MLA FA3", gpu_set("sm90")),
            Kernel("FlashInfer MLA FA2", gpu_set("sm80", "sm89", "sm100", "sm103", "sm120")),
        ),
        mla_multiples=(128, 64),
        dtypes=HALF,
        kv_dtypes=HALF,
        module="flashinfer",
        extra="flashinfer",
        cuda_graph=True,
        notes=("dense MLA only: sparse (NSA) layers need an NSA backend",),
    )
    fix = "choose backend='triton' or 'torch' for this MLA shape (MHA models: 'flashinfer'; NSA layers: an NSA backend)"

    def __init__(self, pool: KVPool, *, variant: str | None = None):
        super().__init__(pool)
        self._fence = PlanFence(pool.device)
        # The package first: without it nothing else matters, and the error names the extra.
        self._fi = load_flashinfer(self.name)
        self._cc = compute_capability(self.name, pool.device)
        self.gpu = gpu_of(self._cc)
        self.require_pool()
        if variant not in (None, "fa2", "fa3"):
            raise BackendError(f"unknown FlashInfer MLA variant {variant!r}", fix="use 'fa2', 'fa3' or None")
        if variant == "fa3" and self._cc[0] != 9:
            raise BackendError(f"FlashInfer's FA3 MLA kernels run on SM90 only; this GPU is {sm_name(self._cc)}",
                               fix="use variant='fa2' or None")
        self.variant = variant or ("fa3" if self._cc[0] == 9 else "fa2")
        # (signature, graph bucket or None for eager steps) -> wrapper
        self._wrappers: dict[tuple[LayerSignature, int | None], object] = {}
        self._known: dict[LayerSignature, None] = {}
        self._graph: _GraphBuffers | None = None

    def kernels_for(self, layer) -> dict[str, str]:
        k = f"FlashInfer MLA {self.variant} (BatchMLAPagedAttentionWrapper)"
        return {"prefill": k, "decode": k}

    # ---------------------------------------------------------------- per step

    def prepare(self, meta: BatchMetadata) -> FlashInferMLAPlan:
        check_page_size(self.name, meta.page_size, self.pool.page_size)
        qo, kv, kv_len = csr_plan_arrays(meta.q_lens_cpu, meta.seq_lens_cpu, meta.page_size)
        kv_indptr = torch.tensor(kv, dtype=torch.int32)
        kv_indices = page_table.create_kv_indices(
            meta.block_tables, meta.seq_lens, kv_indptr.to(self.pool.device, non_blocking=True), meta.page_size,
            num_indices=kv[-1],
        )
        return self._publish(meta, qo, kv_indptr, kv_indices, kv_len, graph_batch=None)

    def _publish(self, meta, qo, kv_indptr, kv_indices, kv_len, *, graph_batch: int | None) -> FlashInferMLAPlan:
        metadata = self._fi.MLAPlanMetadata.csr(
            qo_indptr=torch.tensor(qo, dtype=torch.int32),  # host copies: planning reads them without a sync
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_len_arr=torch.tensor(kv_len, dtype=torch.int32),
        )
        step = FlashInferMLAPlan(mode=meta.mode, metadata=metadata, graph_batch=graph_batch)
        self._fence.wait()  # the wrappers' pinned buffers: the last plan's copies must have left them
        for sig in self._known:
            self._plan(meta, step, sig)
        self._fence.mark()
        return step

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        def buf(n, fill):
            return torch.full((n,), fill, dtype=torch.int32, device=self.pool.device)

        self._graph = _GraphBuffers(
            qo_indptr=buf(max_batch_size + 1, 0), kv_indptr=buf(max_batch_size + 1, 0), kv_len=buf(max_batch_size, 1),
            kv_indices=buf(max_batch_size * max_pages_per_req, 0),
        )
        for key in [k for k in self._wrappers if k[1] is not None]:  # wrappers over an older set of buffers
            del self._wrappers[key]

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> FlashInferMLAPlan:
        g = self._graph
        if g is None:
            raise BackendError("prepare_graph before init_graph_state", fix="call init_graph_state first")
        if not meta.is_decode:
            raise BackendError(f"{self.name} captures decode steps only", fix="run extend steps eagerly")
        check_page_size(self.name, meta.page_size, self.pool.page_size)
        n = meta.num_reqs
        qo, kv, kv_len = csr_plan_arrays(meta.q_lens_cpu, meta.seq_lens_cpu, meta.page_size)
        if n > g.kv_len.shape[0] or kv[-1] > g.kv_indices.shape[0]:
            raise BackendError(
                f"{self.name}: a graph step of {n} requests and {kv[-1]} pages exceeds the static buffers "
                f"({g.kv_len.shape[0]} requests, {g.kv_indices.shape[0]} pages)",
                fix="size init_graph_state for the largest bucket and context",
            )
        kv_indptr = torch.tensor(kv, dtype=torch.int32)
        g.kv_indptr[: n + 1].copy_(kv_indptr, non_blocking=True)  # the page-index kernel reads it on the device
        # Written in place: the plan then finds the page ids already where the captured kernels read them.
        kv_indices = page_table.create_kv_indices(meta.block_tables, meta.seq_lens, g.kv_indptr[: n + 1],
                                                  meta.page_size, num_indices=kv[-1], out=g.kv_indices)
        return self._publish(meta, qo, kv_indptr, kv_indices, kv_len, graph_batch=n)

    def _check_layer(self, layer, meta: BatchMetadata) -> None:
        self.check_layer("decode" if meta.is_decode else "prefill", layer)

    def _wrapper(self, sig: LayerSignature, graph_batch: int | None):
        wrapper = self._wrappers.get((sig, graph_batch))
        if wrapper is not None:
            return wrapper
        ws = workspace(self.pool.device, "wrappers")
        if graph_batch is None:
            wrapper = self._fi.BatchMLAPagedAttentionWrapper(float_workspace_buffer=ws, backend=self.variant)
        else:
            g, n = self._graph, graph_batch
            wrapper = self._fi.BatchMLAPagedAttentionWrapper(
                float_workspace_buffer=ws, use_cuda_graph=True, qo_indptr=g.qo_indptr[: n + 1],
                kv_indptr=g.kv_indptr[: n + 1], kv_indices=g.kv_indices, kv_len_arr=g.kv_len[:n],
                backend=self.variant,
            )
        self._wrappers[(sig, graph_batch)] = wrapper
        return wrapper

    def _plan(self, meta: BatchMetadata, step: FlashInferMLAPlan, sig: LayerSignature):
        wrapper = self._wrapper(sig, step.graph_batch)
        wrapper.plan(
            metadata=step.metadata,
            num_heads=sig.num_heads,
            head_dim_ckv=sig.v_head_dim,
            head_dim_kpe=sig.head_dim - sig.v_head_dim,
            page_size=meta.page_size,
            # extend: bottom-right aligned causal mask; decode: the one query sees its whole KV range.
            causal=step.mode is ForwardMode.EXTEND,
            sm_scale=sig.scale,
            q_data_type=self.pool.dtype,
            kv_data_type=self.pool.dtype,
            query_layout="packed",  # [tokens, heads, latent | rope] in one tensor
            kv_cache_layout="packed",  # [pages, page_size, latent | rope]: our pool entry as is
        )
        step.planned[sig] = wrapper
        return wrapper

    # ---------------------------------------------------------------- per layer

    def _run(self, layer, q: torch.Tensor, meta: BatchMetadata, step: FlashInferMLAPlan) -> torch.Tensor:
        sig = LayerSignature.of(layer)
        wrapper = step.planned.get(sig)
        if wrapper is None:
            self._check_layer(layer, meta)
            wrapper = self._plan(meta, step, sig)
            self._known[sig] = None
        cache = self.pool.k(layer.layer_id)  # [num_pages, 1, page_size, latent + rope]
        out = torch.empty(q.shape[0], sig.num_heads, sig.v_head_dim, dtype=q.dtype, device=q.device)
        return wrapper.run(query=q, kv_cache=cache[:, 0], out=out)  # -> [tokens, heads, latent]

    def extend(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: FlashInferMLAPlan) -> torch.Tensor:
        return self._run(layer, q, meta, plan)

    def decode(self, layer, q: torch.Tensor, meta: BatchMetadata, plan: FlashInferMLAPlan) -> torch.Tensor:
        return self._run(layer, q, meta, plan)
