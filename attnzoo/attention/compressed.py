"""Compressed attention (DeepSeek-V4): a window of raw keys plus compressed entries, over the paged pool.

Every V4 layer keeps one raw entry per token (the normalized, roped key, which is also the value: one KV
head) for its sliding window. CSA and HCA layers add one *compressed* entry per ``compress_rate``
tokens (4 and 128 in the released models), pooled by the model's compressor from the block's tokens
(CSA: the block and the one before it, ``overlap``), and CSA layers an indexer key per entry, from
which each query keeps its ``index_topk`` best entries. A query at position p attends, in one softmax
with a per-head sink logit, to the raw keys p - window < j <= p and to the entries of the blocks that
ended at or before p (CSA: those of them the indexer picked).

Where each part lives in the pool (``KVCacheSpec``, ``kv_cache.KVPool``):
- raw keys ("k") and the compressor's per-token inputs ("state": its kv and gate projections, in the
  model dtype as the reference buffers them) in the layer's group, the window group where there is one:
  a block's tokens stay there until it completes, which is why the group keeps ``kept_window()`` tokens;
- entries ("compressed", "index_compressed") in the full group, in the page holding the block's last
  token, ``entries_per_page`` slots per page: block w's entry is slot (L % page_size) // rate of the page
  of token L = w * rate + rate - 1. A page shared by the prefix cache is full, so its entries are final.

Per layer and step (``CompressedAttention.forward``): store the step's raw keys and states; pool every
block the step completes (the model's ``compress`` callback does the math, this module the bookkeeping)
and store the entries; then the step's backend scores (CSA) and attends (``backends.base.
CompressedBackend``: ``dsv4_topk``, ``dsv4_attend``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from attnzoo.attention.backends.base import CompressedBackend
from attnzoo.attention.compressed_reference import entry_slots
from attnzoo.attention.kv_cache import KVCacheSpec
from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.attention.metadata import BatchMetadata, to_device
from attnzoo.errors import BackendError, ModelLoadError

# (states [n, span, state_dim], valid [n, span] bool, first positions [n]) -> (entries [n, D], index keys or None)
# (state rows [S, state_dim], their slots [n, span], valid [n, span], first positions [n]) -> (entries, indexer keys)
CompressFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class CompressedAttention(Attention):
    """The attention core of one V4 layer (sliding-only with ``compress_rate`` 0). The model computes the
    query, the raw key, the compressor's per-token state and the indexer's inputs; storage, block
    completion and dispatch to the backend happen here."""

    def __init__(self, layer_id: int, num_heads: int, head_dim: int, *, sliding_window: int, scale: float,
                 compress_rate: int = 0, overlap: bool = False, state_dim: int = 0, index_dim: int = 0,
                 index_n_heads: int = 0, index_topk: int = 0):
        super().__init__(layer_id, num_heads, 1, head_dim, v_head_dim=head_dim, scale=scale,
                         sliding_window=sliding_window, kind="mla")
        self.kind = "dsv4"  # set after the base's check of the kinds it builds itself
        if sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be a positive token count, the config has {sliding_window}",
                                 fix="set sliding_window in config.json (128 in the released models)")
        if compress_rate and bool(index_dim) != bool(index_topk):
            raise ModelLoadError("a CSA layer needs both index_head_dim and index_topk",
                                 fix="set index_head_dim and index_topk in config.json")
        self.compress_rate, self.overlap, self.state_dim = compress_rate, overlap, state_dim
        self.index_dim, self.index_n_heads, self.index_topk = index_dim, index_n_heads, index_topk

    @property
    def layer_kind(self) -> str:
        if not self.compress_rate:
            return "sliding"
        return "csa" if self.index_dim else "hca"

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            num_kv_heads=1, head_dim=self.head_dim, v_head_dim=self.head_dim, v_from_k=True,
            sliding_window=self.sliding_window, compress_rate=self.compress_rate,
            compressed_dim=self.head_dim if self.compress_rate else 0, index_compressed_dim=self.index_dim,
            state_dim=self.state_dim, overlap=self.overlap,
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D], roped
        kv: torch.Tensor,  # [T, D]: the raw key (= value), normed and roped
        ctx: ForwardContext,
        *,
        sinks: torch.Tensor,  # [H] float32: per-head sink logits
        state: torch.Tensor | None = None,  # [T, state_dim]: the compressor's per-token inputs
        compress: CompressFn | None = None,
        index_q: torch.Tensor | None = None,  # [T, Hi, Di], roped (CSA)
        index_weights: torch.Tensor | None = None,  # [T, Hi] float32, already / sqrt(Hi) (CSA)
    ) -> torch.Tensor:  # [T, H, D] float32-accurate, in q's dtype
        meta, pool = ctx.meta, ctx.pool
        if pool.is_fp8:
            raise BackendError("compressed attention keeps its window, entries and compressor state in the model "
                               "dtype", fix="load the model with kv_cache_dtype='auto'")
        slots = meta.slot_mapping_for(self.sliding_window)
        pool.store(self.layer_id, slots, kv[:, None, :], None)
        if self.compress_rate:
            pool.view(self.layer_id, "state").view(-1, self.state_dim)[slots] = state.to(pool.kv_dtype)
            self._compress_completed(meta, pool, compress)
        backend = ctx.backends.for_step(meta)
        if not isinstance(backend, CompressedBackend):
            raise BackendError(f"backend {backend.name!r} cannot run DeepSeek-V4 compressed attention",
                               fix="use backend='torch' (the backends that can: attnzoo policy capabilities)")
        entry_ids = None
        if self.index_dim:
            entry_ids = backend.dsv4_topk(self, index_q, index_weights, meta, ctx.plan, topk=self.index_topk,
                                          scale=self.index_dim**-0.5)
        return backend.dsv4_attend(self, q, sinks, entry_ids, meta, ctx.plan).to(q.dtype)

    def _compress_completed(self, meta: BatchMetadata, pool, compress: CompressFn) -> None:
        """Pool the blocks whose last token is in this step and store their entries.

        EXTEND steps find those blocks on the host. DECODE steps (row i is request i, one token each) pool
        one block per row on the device, whether or not the row's token ends one: rows that do not store
        their entry in page 0, which nobody reads. No host lengths and fixed shapes: a captured decode
        step replays it for any positions."""
        r, ps, dev = self.compress_rate, meta.page_size, meta.positions.device
        span = 2 * r if self.overlap else r
        if meta.is_decode:
            reqs_d = torch.arange(meta.positions.shape[0], device=dev)
            done = (meta.positions + 1) % r == 0
            first_d = meta.positions + 1 - r
            pos_d = first_d[:, None] - (r if self.overlap else 0) + torch.arange(span, device=dev)[None, :]
            valid = (pos_d >= 0) | ~done[:, None]  # rows that store nothing pool finite values
            pos_d = torch.minimum(pos_d.clamp_min(0), meta.positions[:, None])
        else:
            blocks = completed_blocks(meta, r)
            if blocks is None:
                return
            reqs, first = blocks
            pos = first[:, None] - (r if self.overlap else 0) + np.arange(span)[None, :]  # [n, span]
            reqs_d, first_d = to_device(reqs, torch.int64, dev), to_device(first, torch.int64, dev)
            valid, pos_d = to_device(pos >= 0, torch.bool, dev), to_device(np.maximum(pos, 0), torch.int64, dev)
        tables = meta.block_tables_for(self.sliding_window)
        state_slots = tables.long()[reqs_d[:, None], pos_d // ps] * ps + pos_d % ps
        rows = pool.view(self.layer_id, "state").view(-1, self.state_dim)
        entries, index_entries = compress(rows, state_slots, valid, first_d.clamp_min(0))
        eslots = entry_slots(meta.block_tables, reqs_d, first_d.clamp_min(0) // r, r, ps)
        if meta.is_decode:
            eslots = torch.where(done, eslots, 0)
        pool.view(self.layer_id, "compressed").view(-1, self.head_dim)[eslots] = entries.to(pool.kv_dtype)
        if index_entries is not None:
            pool.view(self.layer_id, "index_compressed").view(-1, self.index_dim)[eslots] = \
                index_entries.to(pool.kv_dtype)


def completed_blocks(meta: BatchMetadata, rate: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The blocks whose last token this step adds, from the host lengths: (request of each [n], first
    position of each [n]) int64, or None. Request i completes blocks prefix // rate .. seq_len // rate - 1."""
    seq = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    lo, hi = (seq - np.asarray(meta.q_lens_cpu, dtype=np.int64)) // rate, seq // rate
    counts = hi - lo
    if not counts.any():
        return None
    reqs = np.repeat(np.arange(len(seq)), counts)
    w = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + lo[reqs]
    return reqs, w * rate
