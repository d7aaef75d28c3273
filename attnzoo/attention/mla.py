"""Multi-head latent attention (DeepSeek MLA) in its absorbed form, and the module every MLA model
(DeepSeek-V2/V3, V3.2) calls with its projected queries and latents.

Per token the KV cache keeps one entry of ``kv_lora_rank + qk_rope_head_dim`` values: the normalized
latent ``c`` and the shared, roped key ``k_pe``. ``kv_b_proj`` splits per head h into
``W_UK[h]`` [qk_nope, kv_lora_rank] and ``W_UV[h]`` [v_head_dim, kv_lora_rank]. The reference models
attend in the expanded form (k_h = [W_UK[h] c, k_pe], v_h = W_UV[h] c); prefill and decode here run
the equal absorbed form: q'_h = [q_nope_h W_UK[h], q_pe_h] attends over [c, k_pe] with values c (MQA
with one latent "head" of dims (rank+rope, rank)), and the latent output o'_h gives o_h = W_UV[h] o'_h.
They agree because q_nope . (W_UK c) = (q_nope W_UK) . c (tests/test_deepseek.py checks both forms),
and the absorbed form reads each cached entry once for all heads.
"""
from __future__ import annotations

import torch
from torch import nn

from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.layers import skinny


def split_kv_b(
    weight: torch.Tensor,  # kv_b_proj.weight [num_heads * (qk_nope + v_head_dim), kv_lora_rank]
    num_heads: int,
    qk_nope_head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> W_UK [H, qk_nope, rank], W_UV [H, v_head_dim, rank]: views of the weight, no copies."""
    w = weight.view(num_heads, -1, weight.shape[-1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope] x W_UK [H, nope, rank] -> [T, H, rank]: the query in latent space."""
    return skinny.batched(q_nope, w_uk.transpose(1, 2))


def absorbed_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, *, in_slot: bool = False
                   ) -> torch.Tensor:
    """q_nope [T, H, nope], roped q_pe [T, H, rope], W_UK [H, nope, rank] -> the absorbed query [T, H, rank + rope].
    ``in_slot``: q_pe is a view ``MLAAttention.rope_slot`` returned, and the absorption is written into its
    buffer's first channels; otherwise (and where autograd records, which ``out=`` does not support) the two
    are concatenated."""
    grad = torch.is_grad_enabled() and (q_nope.requires_grad or q_pe.requires_grad or w_uk.requires_grad)
    if not in_slot or grad:
        return torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)
    t, h, p = q_pe.shape
    r = w_uk.shape[-1]
    w = r + p
    if q_pe.stride() != (h * w, w, 1) or q_pe.storage_offset() < r:
        raise ValueError(f"absorbed_query: q_pe of strides {q_pe.stride()} is not a rope_slot view of a "
                         f"[{t}, {h}, {w}] buffer")
    q = q_pe.as_strided((t, h, w), (h * w, w, 1), q_pe.storage_offset() - r)
    skinny.batched(q_nope, w_uk.transpose(1, 2), out=q[..., :r])
    return q


def cache_entry(latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """latent [T, rank], k_pe [T, rope] -> the cache entry [T, 1, rank + rope]: a view where k_pe already follows
    latent in one buffer (``fused.mla_entry`` writes them so), else their concatenation."""
    t, rank = latent.shape
    if (latent.dtype == k_pe.dtype and latent.untyped_storage().data_ptr() == k_pe.untyped_storage().data_ptr()
            and latent.stride() == k_pe.stride() and latent.stride(1) == 1
            and k_pe.storage_offset() == latent.storage_offset() + rank):
        return latent.as_strided((t, 1, rank + k_pe.shape[1]), (latent.stride(0), latent.stride(0), 1))
    return torch.cat([latent, k_pe], dim=-1)[:, None, :]


def latent_to_values(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Latent attention output [T, H, rank] x W_UV [H, v, rank] -> [T, H, v]."""
    return skinny.batched(o_latent, w_uv)


class MLAAttention(nn.Module):
    """The attention core of an MLA layer, after the projections and RoPE, before ``o_proj``.

    Owns the shared ``Attention`` layer in its "mla" mode (the cache entry is [latent, k_pe], one
    KV head; values are the latent) and no weights: the model passes ``kv_b_proj.weight``, so the
    parameters keep their checkpoint names.
    """

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        index_head_dim: int = 0,  # NSA (V3.2): indexer key width kept beside the entry
        sparse: bool = False,  # NSA: top-k selection (with index_head_dim 0: reused from an earlier layer)
        kv_shared_from: int | None = None,  # read this earlier layer's latent cache; store no entry
    ):
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.attn = Attention(
            layer_id, num_heads, 1, kv_lora_rank + qk_rope_head_dim,
            v_head_dim=kv_lora_rank, scale=scale, kind="mla", index_head_dim=index_head_dim,
            sparse=sparse, kv_shared_from=kv_shared_from,
        )

    @property
    def scale(self) -> float:
        return self.attn.scale

    def rope_slot(self, t: int, like: torch.Tensor) -> torch.Tensor:
        """Where the roped q_pe [T, H, rope] goes: the last channels of a new absorbed-query buffer
        [T, H, rank + rope], whose first channels ``forward`` fills with the absorption (no concatenation)."""
        buf = like.new_empty(t, self.num_heads, self.kv_lora_rank + self.qk_rope_head_dim)
        return buf[..., self.kv_lora_rank:]

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, qk_nope]
        q_pe: torch.Tensor,  # [T, H, qk_rope], roped
        latent: torch.Tensor | None,  # [T, kv_lora_rank], after kv_a_layernorm; None on KV-sharing layers
        k_pe: torch.Tensor | None,  # [T, qk_rope], roped; None on KV-sharing layers
        kv_b_weight: torch.Tensor,  # [H * (qk_nope + v_head_dim), kv_lora_rank]
        ctx: ForwardContext,
        *,
        q_pe_in_slot: bool = False,  # q_pe is this layer's rope_slot(): the absorption fills the rest of its buffer
    ) -> torch.Tensor:  # [T, H * v_head_dim]
        t = q_nope.shape[0]
        w_uk, w_uv = split_kv_b(kv_b_weight, self.num_heads, self.qk_nope_head_dim)
        entry = None if latent is None else cache_entry(latent, k_pe)  # [T, 1, rank + rope]
        q = absorbed_query(q_nope, q_pe, w_uk, in_slot=q_pe_in_slot)  # [T, H, rank + rope]
        o = self.attn(q, entry, None, ctx).view(t, self.num_heads, self.kv_lora_rank)
        return latent_to_values(o, w_uv).reshape(t, self.num_heads * self.v_head_dim)
