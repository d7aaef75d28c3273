"""The compressed-attention (DeepSeek-V4) backend on attnzoo's Triton kernels
(``attnzoo/attention/kernels/compressed.py``): the CSA indexer's scores with top-k selection
(``reference.select_topk``), and attention over the raw window plus the compressed entries in one kernel,
for prefill and decode. It serves compressed layers only (``base.CompressedBackend``, called by
``attention/compressed.py``); its plan holds the request of each row of the step.

CUDA graphs (decode): a decode step pools one block per row on the device (``CompressedAttention``), the
attention kernel's loops are bounded by values it reads on the device, and the indexer's score width
(the most entries of any request) is the captured step's, whose lengths are the graph's longest context.
The request of each decode row (row i is request i) comes from a static buffer.
"""
from __future__ import annotations

import torch

from attnzoo.attention.backends.base import AttentionBackend, CompressedBackend, NSAPlan, import_triton_kernels
from attnzoo.attention.backends.capabilities import BackendCapabilities
from attnzoo.attention.backends.gpus import triton_kernels
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.attention.reference import select_topk, token_requests
from attnzoo.errors import BackendError


_KERNELS = triton_kernels("triton window + compressed gather")


class CompressedTritonBackend(AttentionBackend, CompressedBackend):
    capabilities = BackendCapabilities(
        name="compressed_triton",
        description="attnzoo's Triton compressed-attention kernels: CSA indexer scores + top-k, and the raw "
                    "window plus compressed entries (CSA picks / every HCA entry) with sinks in one kernel",
        kinds=frozenset({"dsv4"}),
        prefill=_KERNELS,
        decode=_KERNELS,
        max_head_dim=1024,
        sliding_window=True,
        attention_sinks=True,
        module="triton",
        extra="triton",
        cuda_graph=True,
        notes=("compressed (CSA/HCA/sliding) layers only: DeepSeek-V4",
               "no FlashInfer backend serves these layers: FlashInfer 0.7.2.post1's deepseek_v41_decode is SM100 "
               "decode only over its own MXFP8 window / FP4 compressed caches (window 128, 64 heads of 512), and its "
               "dsa_* kernels are MLA-shaped training kernels without sinks or a raw window"),
    )
    fix = "use backend='torch' on CPU (or set TRITON_INTERPRET=1 before importing attnzoo, for tests)"

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        self.require_pool()
        self._kernels = import_triton_kernels("compressed_triton", "compressed")
        self._graph_reqs: torch.Tensor | None = None  # [max_batch] int64, device: row i -> request i

    def prepare(self, meta: BatchMetadata) -> NSAPlan:
        return NSAPlan(token_reqs=token_requests(meta))

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        self._graph_reqs = torch.arange(max_batch_size, device=self.pool.device)

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> NSAPlan:
        if self._graph_reqs is None:
            raise BackendError("prepare_graph before init_graph_state", fix="call init_graph_state first")
        if not meta.is_decode:
            raise BackendError(f"{self.name} captures decode steps only", fix="run extend steps eagerly")
        return NSAPlan(token_reqs=self._graph_reqs[: meta.num_reqs])

    def _reqs(self, meta, plan):
        return plan.token_reqs if isinstance(plan, NSAPlan) and plan.token_reqs is not None else token_requests(meta)

    def extend(self, layer, q, meta, plan):
        raise BackendError(f"the {self.name} backend runs compressed (DeepSeek-V4) layers only, not {layer.kind}",
                           fix="use the triton or torch backend for other models")

    decode = extend

    def dsv4_topk(self, layer, q, weights, meta, plan, *, topk, scale):
        rate = layer.compress_rate
        width = max(meta.seq_lens_cpu) // rate
        keys = self.pool.view(layer.layer_id, "index_compressed")
        s = self._kernels.scores(q, weights, keys.reshape(-1, keys.shape[-1]), meta.block_tables,
                                 self._reqs(meta, plan), meta.positions, width=width, rate=rate,
                                 page_size=meta.page_size, scale=scale)
        return select_topk(s, topk)

    def dsv4_attend(self, layer, q, sinks, entry_ids, meta, plan):
        self.check_layer("decode" if meta.is_decode else "prefill", layer)
        d = layer.head_dim
        comp = self.pool.view(layer.layer_id, "compressed").reshape(-1, d) if layer.compress_rate else None
        return self._kernels.attend(
            q, self.pool.k(layer.layer_id).reshape(-1, d), comp, sinks, meta.block_tables_for(layer.sliding_window),
            meta.block_tables, self._reqs(meta, plan), meta.positions, entry_ids, window=layer.sliding_window,
            rate=layer.compress_rate, page_size=meta.page_size, scale=layer.scale)
