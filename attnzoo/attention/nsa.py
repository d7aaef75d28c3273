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

The NSA backends (the torch reference backend, ``nsa_triton``, ``nsa_triton_fp8``) derive from
``backends.base.NSABackend``: ``mla_kv_layout`` (the layout their sparse MLA reads, declared), ``kv_copy``
(where that layout is not the pool's), and the hooks ``nsa_topk`` / ``nsa_sparse_mla``, which take the
step's ``NSAPlan`` (where the step's shared matrices are kept).
"""
from __future__ import annotations

import torch

from attnzoo.attention.backends.base import NSABackend, NSAPlan
from attnzoo.attention.kv_layout import KVLayout
from attnzoo.attention.layer import ForwardContext
from attnzoo.attention.mla import MLAAttention, absorbed_query, cache_entry, latent_to_values, split_kv_b
from attnzoo.attention.reference import (  # noqa: F401  (the NSA backends' helpers, read as nsa.<name>)
    entries_of,
    indexer_scores_reference,
    positions_to_slots,
    select_topk,
    sparse_mla_reference,
    token_requests,
    visible_positions,
)
from attnzoo.errors import BackendError, ModelLoadError

def _nsa_backend_names() -> list[str]:
    from attnzoo.attention.backends import all_capabilities  # imports every backend module: only on error

    return [name for name, caps in all_capabilities().items() if "nsa" in caps.kinds]


def nsa_backend(backend) -> NSABackend:
    """The backend itself, once checked to serve NSA layers (an NSABackend, with its layout's copy)."""
    if not isinstance(backend, NSABackend):
        raise BackendError(
            f"backend {backend.name!r} cannot run sparse (NSA) attention",
            fix=f"use one of the NSA backends: {', '.join(_nsa_backend_names())}",
        )
    if backend.mla_kv_layout is not KVLayout.BF16 and backend.kv_copy is None:
        raise BackendError(f"backend {backend.name!r} reads KV layout {backend.mla_kv_layout.value} but keeps no kv_copy",
                           fix="create its LayoutCache in the backend's __init__")
    return backend


class NSAAttention(MLAAttention):
    """The attention core of an NSA layer: MLA's, plus the indexer key cache and top-k selection.

    The model computes the indexer's query, key and head weights (its projections, norm and RoPE); the
    scoring, selection and sparse attention happen here and in the backends.
    """

    def __init__(self, layer_id: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float, index_head_dim: int, index_n_heads: int,
                 index_topk: int, kv_shared_from: int | None = None):
        super().__init__(layer_id, num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                         qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, scale=scale,
                         index_head_dim=index_head_dim, sparse=True, kv_shared_from=kv_shared_from)
        if index_topk < 1:
            raise ModelLoadError(f"index_topk must be a positive token count, the config has {index_topk}",
                                 fix="set index_topk in config.json (2048 in the released models)")
        self.index_topk, self.index_n_heads = index_topk, index_n_heads
        self.index_scale = index_head_dim**-0.5 if index_head_dim else 0.0  # 0: no indexer of its own
        self.index_weight_scale = index_n_heads**-0.5

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, qk_nope]
        q_pe: torch.Tensor,  # [T, H, qk_rope], roped
        latent: torch.Tensor | None,  # [T, kv_lora_rank]; None on KV-sharing layers
        k_pe: torch.Tensor | None,  # [T, qk_rope], roped; None on KV-sharing layers
        kv_b_weight: torch.Tensor,  # [H * (qk_nope + v_head_dim), kv_lora_rank]
        ctx: ForwardContext,
        *,
        index_q: torch.Tensor | None,  # [T, Hi, D], roped; None: reuse the step's last selection
        index_k: torch.Tensor | None,  # [T, D], normed and roped
        index_weights: torch.Tensor | None,  # [T, Hi], the indexer's per-head weights
        q_pe_in_slot: bool = False,  # as MLAAttention's
    ) -> torch.Tensor:  # [T, H * v_head_dim]
        """With index_q None (a layer without its own indexer: GLM-5's "shared" layers) the layer attends
        over the positions the step's previous indexer layer selected (``ctx.nsa_positions``). A KV-sharing
        layer (``kv_shared_from``: Mistral Large 4) stores no entry, only its own indexer keys if it has an
        indexer, and attends over its producer's entries (the pool's and the layout copies' views alias them)."""
        meta, layer = ctx.meta, self.attn
        t = q_nope.shape[0]
        backend, plan = nsa_backend(ctx.backends.for_step(meta)), ctx.plan
        if not isinstance(plan, NSAPlan):
            raise BackendError(f"the step's plan is a {type(plan).__name__}, not the NSAPlan of {backend.name!r}",
                               fix="prepare the step with the backends that run it (HybridBackend.prepare)")
        if layer.kv_shared_from is not None:
            if index_k is not None:
                ctx.pool.store(layer.layer_id, meta.slot_mapping, None, None, index_k=index_k)
        else:
            entry = cache_entry(latent, k_pe)[:, 0]  # [T, rank + rope]
            ctx.pool.store(layer.layer_id, meta.slot_mapping, entry[:, None, :], None, index_k=index_k)
            # Both backends of the engine, not just this step's: a token stored by prefill is read by decode
            # later, in the decode backend's layout. Converting now reads it once, from values in hand.
            for b in ctx.backends.distinct():
                if nsa_backend(b).mla_kv_layout is not KVLayout.BF16:
                    b.kv_copy.store(layer.layer_id, meta.slot_mapping, entry)
        if index_q is None:
            positions = ctx.nsa_positions
            if positions is None:
                raise ModelLoadError(f"NSA layer {layer.layer_id} reuses the previous layer's top-k selection, "
                                     "but no earlier layer of the step selected any",
                                     fix="the first sparse layer must run its own indexer ('full' in indexer_types)")
        elif meta.max_seq_len <= self.index_topk:
            positions = visible_positions(meta, plan.shared)
        else:
            weights = index_weights.float() * self.index_weight_scale
            positions = backend.nsa_topk(layer, index_q, weights, meta, plan, topk=self.index_topk,
                                         scale=self.index_scale)
        ctx.nsa_positions = positions
        w_uk, w_uv = split_kv_b(kv_b_weight, self.num_heads, self.qk_nope_head_dim)
        q = absorbed_query(q_nope, q_pe, w_uk, in_slot=q_pe_in_slot)  # [T, H, rank + rope]
        o = backend.nsa_sparse_mla(layer, q, positions, meta, plan).to(q_nope.dtype)  # [T, H, rank]
        return latent_to_values(o, w_uv).reshape(t, self.num_heads * self.v_head_dim)


