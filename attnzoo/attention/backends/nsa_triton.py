"""The NSA (DeepSeek-V3.2 sparse attention) backends on attnzoo's Triton kernels
(``attnzoo/attention/kernels/nsa.py``): indexer scores over the paged indexer-key cache, top-k selection
(``attnzoo.attention.nsa.select_topk``), and sparse MLA over the selected slots, for prefill and decode.

``nsa_triton`` reads the pool's own entries (layout BF16: the model dtype). ``nsa_triton_fp8`` reads
the FlashMLA sparse layout (FP8_NOPE_SCALED_BF16_ROPE: fp8 latent with per-128 scales, bf16 rope) from
its own copy of the cache, into which each token is converted once when its layer stores it; pairing it
with a BF16 prefill backend is the mixed prefill/decode configuration of the field (the policy's
Decision names the conversion).

They serve NSA layers only (``base.NSABackend``: ``mla_kv_layout`` + ``nsa_topk`` / ``nsa_sparse_mla``,
called by ``attnzoo/attention/nsa.py``); dense MHA/MLA layers belong to the ``triton`` backend. Their plan
(``NSAPlan``) holds the request of each row of the step.

CUDA graphs (decode): every launch shape is set by host ints that a captured step fixes (rows, the
score width, top-k), and the kernels read positions, block tables and slots on the device: no host
sync, no data-dependent shape. The width and the dense-or-top-k choice (``NSAAttention``: dense while
the longest context is <= index_topk) come from the step the graph is captured on, whose lengths are
the graph's longest context: a graph sized beyond index_topk scores ``max_context`` columns per decode
row and selects top-k for every step it replays (the same tokens as the eager dense path selects for
short steps, summed in score order); a graph sized within index_topk runs the dense path. The request
of each decode row (row i is request i) comes from a static buffer, not from the host's lengths.
"""
from __future__ import annotations

import torch

from attnzoo.attention import nsa
from attnzoo.attention.backends.base import NSABackend, NSAPlan, import_triton_kernels
from attnzoo.attention.backends.capabilities import BackendCapabilities
from attnzoo.attention.backends.gpus import triton_kernels
from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.kv_layout import LayoutCache
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.errors import BackendError

# Index scores are materialised per block of query rows: [rows, longest context] float32 at most this big.
SCORE_BYTES = 256 << 20


_KERNELS = triton_kernels("triton indexer + sparse MLA")


class NSATritonBackend(NSABackend):
    capabilities = BackendCapabilities(
        name="nsa_triton",
        description="attnzoo's Triton NSA kernels: indexer scores over the paged indexer cache, top-k, "
                    "sparse MLA over the selected tokens (prefill and decode)",
        kinds=frozenset({"nsa"}),
        prefill=_KERNELS,
        decode=_KERNELS,
        max_head_dim=1024,
        module="triton",
        extra="triton",
        cuda_graph=True,
        mla_kv_layout="bf16",
        notes=("sparse (NSA) layers only: DeepSeek-V3.2, GLM-5 (its layers without an indexer reuse a selection)",),
    )
    fix = "use backend='torch' on CPU (or set TRITON_INTERPRET=1 before importing attnzoo, for tests)"

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        self.require_pool()
        self._kernels = import_triton_kernels("NSA triton", "nsa")
        self.kv_copy = self._make_copy(pool)
        self._graph_reqs: torch.Tensor | None = None  # [max_batch] int64, device: row i -> request i

    def _make_copy(self, pool: KVPool) -> LayoutCache | None:
        return None  # BF16: it reads the pool itself

    def prepare(self, meta: BatchMetadata) -> NSAPlan:
        return NSAPlan(token_reqs=nsa.token_requests(meta))

    def init_graph_state(self, max_batch_size: int, max_pages_per_req: int) -> None:
        self._graph_reqs = torch.arange(max_batch_size, device=self.pool.device)

    def prepare_graph(self, meta: BatchMetadata, capturing: bool) -> NSAPlan:
        if self._graph_reqs is None:
            raise BackendError("prepare_graph before init_graph_state", fix="call init_graph_state first")
        if not meta.is_decode:
            raise BackendError(f"{self.name} captures decode steps only", fix="run extend steps eagerly")
        return NSAPlan(token_reqs=self._graph_reqs[: meta.num_reqs])

    def _token_reqs(self, meta: BatchMetadata, plan: NSAPlan) -> torch.Tensor:
        return plan.token_reqs if plan.token_reqs is not None else nsa.token_requests(meta)

    def extend(self, layer, q, meta, plan):
        raise BackendError(f"the {self.name} backend runs sparse (NSA) layers only, not dense {layer.kind} attention",
                           fix="use the triton or torch backend for models without an indexer")

    decode = extend

    # ---- NSA hooks ----
    def nsa_topk(self, layer, q, weights, meta, plan: NSAPlan, *, topk, scale):
        reqs = self._token_reqs(meta, plan)
        width = meta.max_seq_len
        rows = max(1, SCORE_BYTES // (4 * width))
        index_k = self.pool.index_k(layer.layer_id)
        out = []
        for r in range(0, q.shape[0], rows):
            sl = slice(r, r + rows)
            scores = self._kernels.index_scores(q[sl], weights[sl], index_k, meta.block_tables, reqs[sl],
                                                meta.positions[sl], width=width, scale=scale)
            out.append(nsa.select_topk(scores, topk))
        return torch.cat(out)

    def _kv_rows(self, layer) -> torch.Tensor:
        return nsa.entries_of(layer, self.pool)

    def nsa_sparse_mla(self, layer, q, positions, meta, plan: NSAPlan):
        slots = nsa.positions_to_slots(positions, meta, self._token_reqs(meta, plan), plan.shared)
        return self._kernels.sparse_mla(q, self._kv_rows(layer), slots, self.mla_kv_layout, rank=layer.v_head_dim,
                                        scale=layer.scale)


class NSATritonFP8Backend(NSATritonBackend):
    capabilities = BackendCapabilities(
        name="nsa_triton_fp8",
        description="nsa_triton's kernels reading the FlashMLA sparse layout: fp8 latent with one scale per "
                    "128 values, bf16 rope (656 bytes per token for DeepSeek)",
        kinds=frozenset({"nsa"}),
        prefill=_KERNELS,
        decode=_KERNELS,
        mla_multiples=(128, 2),
        module="triton",
        extra="triton",
        cuda_graph=True,
        mla_kv_layout="fp8_nope_scaled_bf16_rope",
        notes=(
            "sparse (NSA) layers only: DeepSeek-V3.2, GLM-5 (its layers without an indexer reuse a selection)",
            "keeps an fp8 copy of the MLA cache beside the pool's model-dtype entries (a memory-sized KV cache "
            "leaves it its share; kv_cache_tokens sizes the pool alone); attention reads fp8 values: expect "
            "fp8-level differences from the bf16 backends",
        ),
    )

    def _make_copy(self, pool: KVPool) -> LayoutCache:
        return LayoutCache(pool, self.mla_kv_layout)

    def _kv_rows(self, layer) -> torch.Tensor:
        rows = self.kv_copy.view(layer.layer_id)
        return rows.view(-1, rows.shape[-1])
