"""The one attention layer every model calls.

A model computes q, k, v (projections, norms, RoPE) and hands them here; this layer stores k/v in the
paged pool at the step's slots and runs the step's backend. It never knows which kernel runs. A model may
leave plain RoPE to the layer (``rope=(cos, sin)``): the store then rotates q and k in place as it stores k,
one launch where there were two.

MLA (DeepSeek) uses the same layer in its absorbed form: the query is projected into the latent
space, the "key" stored per token is the latent plus the shared RoPE key (one KV head), and the values
are the latent's first ``kv_lora_rank`` channels of that same entry (``v_from_k``). To a backend this
is multi-query attention with head dims (kv_lora_rank + rope_dim, kv_lora_rank).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from attnzoo.attention.backends.base import AttentionBackend, StepPlan
from attnzoo.attention.backends.hybrid import HybridBackend
from attnzoo.attention.kv_cache import KVCacheSpec, KVPool, layer_kind
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.attention.store_rope import RoPE
from attnzoo.errors import BackendError
from attnzoo.layers import fused


# KV layer kinds whose attention is the shared layer's call and nothing else: NSA's indexer and the
# compressed layers' compressor (DeepSeek-V4) compute theirs around it, over more of the step than its rows.
PLAIN_KINDS = frozenset({"full", "sliding", "mla"})


def beyond_the_layer(model, pool: KVPool) -> str | None:
    """Why some attention of ``model`` is more than ``Attention.attend`` over the step's rows, or None: piecewise
    CUDA graphs cut the forward there, and mixed steps split it there."""
    kinds = sorted({layer_kind(s) for s in pool.specs if s is not None} - PLAIN_KINDS)
    if kinds:
        return f"its {', '.join(kinds)} layers' attention is more than the shared layer's call"
    own = sorted({type(m).__name__ for m in model.modules()
                  if isinstance(m, Attention) and type(m).forward is not Attention.forward})
    if own:
        return f"{', '.join(own)} runs its own forward"
    return None


@dataclass
class ForwardContext:
    """What a model's forward needs besides its inputs: the step's metadata, the pool, the backends
    (``backends`` decides which one serves the step) and the step's plan."""

    meta: BatchMetadata
    pool: KVPool
    prefill_backend: AttentionBackend
    decode_backend: AttentionBackend
    plan: StepPlan | None = None  # what backends.prepare(meta) returned; None: prepared here, once
    # Piecewise CUDA graphs (engine.piecewise): every attention call goes to split(layer, q, k, v) instead,
    # which ends the piece being captured and returns where the attention's output will be.
    split: Callable | None = None
    backends: HybridBackend = field(init=False)
    # NSA: the top-k positions the step's last indexer layer selected (GLM-5's "shared" layers reuse them).
    nsa_positions: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self):
        if self.pool.has_window_group and self.meta.window_block_tables is None:
            raise BackendError("the KV pool has a window page group but the step's metadata has no window block "
                               "tables: its sliding layers would write through full-group page ids",
                               fix="build the step with build_metadata(window_block_tables=...), or load the model "
                                   "with window_kv_fraction=None (one page group)")
        self.backends = HybridBackend(self.prefill_backend, self.decode_backend)
        if self.plan is None:
            self.plan = self.backends.prepare(self.meta)


class Attention(nn.Module):
    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
        scale: float | None = None,
        sliding_window: int | None = None,  # a query at p sees keys j with p - sliding_window < j <= p
        logit_softcap: float | None = None,  # scores -> cap * tanh(scores / cap)
        kv_shared_from: int | None = None,  # read this earlier layer's KV cache; store nothing
        kind: str = "mha",  # "mha" (MHA/GQA/MQA) or "mla" (absorbed latent attention)
        index_head_dim: int = 0,  # NSA indexer key width kept beside the MLA cache
        sparse: bool = False,  # NSA without its own indexer cache (GLM-5's layers that reuse a selection)
        sinks: bool = False,  # a learned logit per query head in every softmax denominator (gpt-oss)
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if kind not in ("mha", "mla"):
            raise ValueError(f"unknown attention kind {kind!r}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.kv_shared_from = kv_shared_from
        self.kind = kind
        self.index_head_dim = index_head_dim
        self.sparse = sparse or index_head_dim > 0
        # This layer's query heads' sink logits (checkpoint ``self_attn.sinks``); backends read it here.
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            v_from_k=self.kind == "mla",
            index_head_dim=self.index_head_dim,
            shared_from=self.kv_shared_from,
            sliding_window=self.sliding_window,
        )

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None on KV-sharing layers
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, v_head_dim]; None on sharing and MLA layers
        ctx: ForwardContext,
        *,
        # (cos, sin) float32 [T, R], cat(f, f): q and k not yet rotated; where the store rotates them, in place
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads * v_head_dim]
        in_store = None
        if rope is not None:
            in_store = None if ctx.split is not None else self._store_rope(q, k, v, rope, ctx)
            if in_store is None:
                q, k = fused.rope(q, k, *rope)
        if ctx.split is not None:
            return ctx.split(self, q, k, v)
        return self.attend(q, k, v, ctx, rope=in_store)

    def _store_rope(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> RoPE | None:
        """The RoPE this layer's store applies to q and k: in place (no autograd, v apart from k), with Triton's
        ops on, rows the store's kernel takes, for backends that read q through its strides; None: ``fused.rope``."""
        if self.kv_shared_from is not None or k is None or not fused.enabled(q):
            return None
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return None
        if not ctx.backends.strided_query:
            return None
        in_store = RoPE(q, *rope)
        return in_store if in_store.problem(k, v) is None else None

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               ctx: ForwardContext, *, rope: RoPE | None = None) -> torch.Tensor:
        """``forward``'s work: store k/v at the step's slots (``rope``: q and k rotated first, in the same launch),
        then the step's backend."""
        meta = ctx.meta
        if self.kv_shared_from is None:
            ctx.pool.store(self.layer_id, meta.slot_mapping_for(self.sliding_window), k, v, rope=rope)
        out = ctx.backends.run(self, q, meta, ctx.plan)
        return out.reshape(q.shape[0], self.num_heads * self.v_head_dim)
