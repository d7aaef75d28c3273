"""DeepSeek-V3.2 sparse attention (NSA / DSA): the lightning indexer's scoring, top-k token selection,
sparse MLA over the selected tokens, and the attention core every NSA layer calls.

Per layer and step (``NSAAttention.forward``):

1. Store. The MLA entry [latent | k_pe] and the indexer key go into the pool at the step's slots
   (``pool.k`` and ``pool.index_k``, model dtype: the BF16 layout). A backend of this step that reads
   another layout (``mla_kv_layout``) gets the new entries converted into its ``LayoutCache`` now, by
   the Triton conversion kernel: once per token, from values already in hand.
2. Select. The query token at position p scores every cached token j <= p of its request:

       I(p, j) = sum_h  w_h(p) / sqrt(Hi) * relu(q_h(p) . k(j) / sqrt(D))

   (Hi indexer heads of width D; w from the indexer's ``weights_proj``), and keeps the ``index_topk``
   best positions (``select_topk``: torch.topk, as the reference; ties at the k-th score are broken as
   torch.topk breaks them). When p + 1 <= index_topk every visible token is kept, so when no request
   is longer than index_topk the scores are not computed at all and the layer is dense MLA.
3. Attend. Absorbed MLA of each query over the entries of its selected positions only: softmax over
   those, the MLA softmax scale (YaRN mscale included), values = latent.

This follows transformers' ``models/deepseek_v32`` (its indexer is the bf16 equivalent of DeepSeek's
FP8 reference; the Hadamard rotation there preserves dot products and is skipped, as transformers does).

The NSA backend contract (the torch reference backend, ``nsa_triton``, ``nsa_triton_fp8``)::

    mla_kv_layout: KVLayout                       # the layout nsa_sparse_mla reads; no flag infers it
    kv_copy: LayoutCache                          # only when mla_kv_layout is not BF16
    nsa_topk(layer, q [T, Hi, D], weights [T, Hi] float32 (already / sqrt(Hi)), meta, *, topk, scale)
        -> [T, min(topk, max_seq_len)] int32 positions in the request's sequence, -1 = none
    nsa_sparse_mla(layer, q [T, H, rank + rope], positions [T, k] int32, meta) -> [T, H, rank]
"""
from __future__ import annotations

import torch

from attnzoo.attention.kv_layout import KVLayout
from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.attention.mla import MLAAttention, absorb_query, latent_to_values, split_kv_b
from attnzoo.errors import BackendError, ModelLoadError

NSA_BACKENDS = ("torch", "nsa_triton", "nsa_triton_fp8")


def token_requests(meta: BatchMetadata) -> torch.Tensor:
    """[num_tokens] int64: the request each row of the flat batch belongs to."""
    dev = meta.positions.device
    lens = torch.tensor(meta.q_lens_cpu, device=dev)
    return torch.repeat_interleave(torch.arange(meta.num_reqs, device=dev), lens, output_size=meta.num_tokens)


def _step_cached(meta: BatchMetadata, key: str, make):
    """``make()``, computed once per step and shared by its layers. Not across a CUDA-graph capture's
    start: a decode graph is captured right after an eager warm-up of the same step, and a tensor cached
    there would be replayed with the warm-up's values; inside the capture it is recomputed (and recorded)."""
    capturing = meta.positions.is_cuda and torch.cuda.is_current_stream_capturing()
    hit = meta.backend_state.get(key)
    if hit is None or hit[1] != capturing:
        hit = meta.backend_state[key] = (make(), capturing)
    return hit[0]


def visible_positions(meta: BatchMetadata) -> torch.Tensor:
    """[num_tokens, max_seq_len] int32: every position a token sees (j <= its position), -1 beyond.
    Built once per step (every layer of a short-context step asks for the same matrix)."""
    def make():
        j = torch.arange(meta.max_seq_len, device=meta.positions.device, dtype=torch.int32)
        return torch.where(j[None, :] <= meta.positions[:, None], j[None, :], -1)

    return _step_cached(meta, "nsa:visible", make)


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Index scores [T, S] float32 (-inf where not visible) -> [T, min(topk, S)] int32 positions, the
    best first; -1 where fewer than topk tokens are visible."""
    vals, idx = scores.topk(min(topk, scores.shape[-1]), dim=-1)
    return idx.masked_fill(vals == float("-inf"), -1).to(torch.int32)


def positions_to_slots(positions: torch.Tensor, meta: BatchMetadata, token_reqs: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Positions [T, k] (-1 = none) -> pool slots [T, k] int64 (page * page_size + offset; -1 = none).
    ``token_reqs``: ``token_requests(meta)`` when the caller already has it."""
    def make():
        ps = meta.page_size
        pos = positions.long()
        clamped = pos.clamp_min(0)
        reqs = token_requests(meta) if token_reqs is None else token_reqs
        pages = meta.block_tables.long()[reqs[:, None], clamped // ps]
        return torch.where(pos >= 0, pages * ps + clamped % ps, -1)

    visible = meta.backend_state.get("nsa:visible")
    if visible is not None and positions is visible[0]:  # the same for every layer of the step
        return _step_cached(meta, "nsa:visible_slots", make)
    return make()


def indexer_scores_reference(
    index_k: torch.Tensor,  # [num_pages, page_size, D] the pool's indexer keys
    q: torch.Tensor,  # [T, Hi, D], roped
    weights: torch.Tensor,  # [T, Hi] float32, already / sqrt(Hi)
    meta: BatchMetadata,
    *,
    scale: float,  # 1 / sqrt(D)
) -> torch.Tensor:  # [T, max_seq_len] float32, -inf where not visible
    """The indexer's scores in float32, one request at a time, in the reference's order of operations."""
    ps = meta.page_size
    out = torch.full((q.shape[0], meta.max_seq_len), float("-inf"), dtype=torch.float32, device=q.device)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.q_lens_cpu)):
        pos = torch.arange(seq_len, device=q.device)
        keys = index_k[meta.block_tables[i].long()[pos // ps], pos % ps].float()  # [S, D]
        rows = slice(start, start + q_len)
        s = torch.relu(torch.matmul(q[rows].float(), keys.T) * scale)  # [q_len, Hi, S]
        scores = torch.matmul(weights[rows, None, :], s)[:, 0]  # [q_len, S]
        visible = pos[None, :] <= meta.positions[rows, None]
        out[rows, :seq_len] = scores.masked_fill(~visible, float("-inf"))
        start += q_len
    return out


def sparse_mla_reference(
    entries: torch.Tensor,  # [num_slots, rank + rope]: the cache's entries, flat by slot
    q: torch.Tensor,  # [T, H, rank + rope], absorbed
    slots: torch.Tensor,  # [T, k] int64 slots of the selected tokens, -1 = none
    *,
    rank: int,
    scale: float,
) -> torch.Tensor:  # [T, H, rank] float32
    """Absorbed MLA of each query over its selected entries only, in float32."""
    kv = entries[slots.clamp_min(0)].float()  # [T, k, rank + rope]
    s = torch.einsum("thd,tkd->thk", q.float(), kv) * scale
    s = s.masked_fill((slots < 0)[:, None, :], float("-inf"))
    return torch.einsum("thk,tkr->thr", torch.softmax(s, dim=-1), kv[..., :rank])


def nsa_backend(backend) -> "object":
    """The backend itself, once checked to serve NSA layers (its declared layout and both hooks)."""
    layout = getattr(backend, "mla_kv_layout", None)
    hooks = all(callable(getattr(backend, h, None)) for h in ("nsa_topk", "nsa_sparse_mla"))
    if not isinstance(layout, KVLayout) or not hooks:
        raise BackendError(
            f"backend {backend.name!r} cannot run sparse (NSA) attention: it declares no mla_kv_layout "
            "or lacks nsa_topk / nsa_sparse_mla",
            fix=f"use one of the NSA backends: {', '.join(NSA_BACKENDS)}",
        )
    if layout is not KVLayout.BF16 and getattr(backend, "kv_copy", None) is None:
        raise BackendError(f"backend {backend.name!r} reads KV layout {layout.value} but keeps no kv_copy",
                           fix="create its LayoutCache in the backend's __init__")
    return backend


class NSAAttention(MLAAttention):
    """The attention core of an NSA layer: MLA's, plus the indexer key cache and top-k selection.

    The model computes the indexer's query, key and head weights (its projections, norm and RoPE); the
    scoring, selection and sparse attention happen here and in the backends.
    """

    def __init__(self, layer_id: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float, index_head_dim: int, index_n_heads: int,
                 index_topk: int):
        super().__init__(layer_id, num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                         qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, scale=scale,
                         index_head_dim=index_head_dim)
        if index_topk < 1:
            raise ModelLoadError(f"index_topk must be a positive token count, the config has {index_topk}",
                                 fix="set index_topk in config.json (2048 in the released models)")
        self.index_topk = index_topk
        self.index_scale = index_head_dim**-0.5
        self.index_weight_scale = index_n_heads**-0.5

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, qk_nope]
        q_pe: torch.Tensor,  # [T, H, qk_rope], roped
        latent: torch.Tensor,  # [T, kv_lora_rank]
        k_pe: torch.Tensor,  # [T, qk_rope], roped
        kv_b_weight: torch.Tensor,  # [H * (qk_nope + v_head_dim), kv_lora_rank]
        ctx: ForwardContext,
        *,
        index_q: torch.Tensor,  # [T, Hi, D], roped
        index_k: torch.Tensor,  # [T, D], normed and roped
        index_weights: torch.Tensor,  # [T, Hi], the indexer's per-head weights
    ) -> torch.Tensor:  # [T, H * v_head_dim]
        meta, layer = ctx.meta, self.attn
        t = q_nope.shape[0]
        backend = nsa_backend(ctx.backend)
        entry = torch.cat([latent, k_pe], dim=-1)  # [T, rank + rope]
        ctx.pool.store(layer.layer_id, meta.slot_mapping, entry[:, None, :], None, index_k=index_k)
        # Both backends of the engine, not just this step's: a token stored by prefill is read by decode
        # later, in the decode backend's layout. Converting now reads it once, from values in hand.
        for b in {id(b): b for b in (ctx.prefill_backend, ctx.decode_backend)}.values():
            if nsa_backend(b).mla_kv_layout is not KVLayout.BF16:
                b.kv_copy.store(layer.layer_id, meta.slot_mapping, entry)
        if meta.max_seq_len <= self.index_topk:
            positions = visible_positions(meta)
        else:
            weights = index_weights.float() * self.index_weight_scale
            positions = backend.nsa_topk(layer, index_q, weights, meta, topk=self.index_topk, scale=self.index_scale)
        w_uk, w_uv = split_kv_b(kv_b_weight, self.num_heads, self.qk_nope_head_dim)
        q = torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)  # [T, H, rank + rope]
        o = backend.nsa_sparse_mla(layer, q, positions, meta).to(q_nope.dtype)  # [T, H, rank]
        return latent_to_values(o, w_uv).reshape(t, self.num_heads * self.v_head_dim)


def entries_of(layer: Attention, pool) -> torch.Tensor:
    """The pool's MLA entries of ``layer``, flat by slot: [num_pages * page_size, rank + rope]."""
    return pool.k(layer.layer_id).view(-1, layer.head_dim)
