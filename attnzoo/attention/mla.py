"""Multi-head latent attention (DeepSeek MLA): the absorbed and expanded forms, and the module every
MLA model (DeepSeek-V2/V3, V3.2) calls with its projected queries and latents.

Per token the KV cache keeps one entry of ``kv_lora_rank + qk_rope_head_dim`` values: the normalized
latent ``c`` and the shared, roped key ``k_pe``. ``kv_b_proj`` splits per head h into
``W_UK[h]`` [qk_nope, kv_lora_rank] and ``W_UV[h]`` [v_head_dim, kv_lora_rank]. Two equal forms:

  expanded:  k_h = [W_UK[h] c, k_pe],  v_h = W_UV[h] c,  plain attention with head dims (nope+rope, v)
  absorbed:  q'_h = [q_nope_h W_UK[h], q_pe_h] attends over [c, k_pe] with values c (MQA with one
             latent "head" of dims (rank+rope, rank)); the latent output o'_h gives o_h = W_UV[h] o'_h

They agree because q_nope . (W_UK c) = (q_nope W_UK) . c. Decode always runs absorbed: it reads each
cached entry once for all heads. Prefill runs absorbed too unless the prefill backend declares
``mla_prefill = "expanded"`` (fewer FLOPs for long prompts without a prefix). Such a backend
implements the ragged attention hook::

    extend_ragged(q [T, H, nope+rope], k [S, H, nope+rope], v [S, H, v_head_dim],
                  kv_indptr [num_reqs + 1] int32, meta, *, scale) -> [T, H, v_head_dim]

where request i's keys (its whole context, prefix included, positions 0..seq_len-1) are rows
``kv_indptr[i]:kv_indptr[i+1]`` and its queries are the rows of ``meta.q_indptr``, causal.
``ragged_attention_reference`` is that hook in plain torch. The choice is made here, in one place,
so model files never see it.
"""
from __future__ import annotations

import torch
from torch import nn

from attnzoo.attention.kv_cache import KVPool
from attnzoo.attention.layer import Attention, ForwardContext
from attnzoo.attention.metadata import BatchMetadata
from attnzoo.attention.reference import attention_reference
from attnzoo.errors import BackendError

PREFILL_FORMS = ("absorbed", "expanded")


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
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def latent_to_values(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Latent attention output [T, H, rank] x W_UV [H, v, rank] -> [T, H, v]."""
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def expand_kv(
    latent: torch.Tensor,  # [S, rank]
    k_pe: torch.Tensor,  # [S, rope]
    w_uk: torch.Tensor,  # [H, nope, rank]
    w_uv: torch.Tensor,  # [H, v, rank]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys [S, H, nope + rope] and values [S, H, v] from the cached latents."""
    k_nope = torch.einsum("sr,hnr->shn", latent, w_uk)
    v = torch.einsum("sr,hvr->shv", latent, w_uv)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, w_uk.shape[0], -1)], dim=-1)
    return k, v


def mla_absorbed(q_nope, q_pe, latent, k_pe, w_uk, w_uv, q_positions, *, scale: float) -> torch.Tensor:
    """One sequence, contiguous (no cache), absorbed form. Shapes as in ``mla_expanded``."""
    q = torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)  # [T, H, rank + rope]
    kv = torch.cat([latent, k_pe], dim=-1)[:, None]  # [S, 1, rank + rope]
    o = attention_reference(q, kv, kv[..., : latent.shape[-1]], q_positions, scale=scale)
    return latent_to_values(o.to(q_nope.dtype), w_uv)


def mla_expanded(
    q_nope: torch.Tensor,  # [T, H, nope]
    q_pe: torch.Tensor,  # [T, H, rope], roped
    latent: torch.Tensor,  # [S, rank], normalized
    k_pe: torch.Tensor,  # [S, rope], roped
    w_uk: torch.Tensor,  # [H, nope, rank]
    w_uv: torch.Tensor,  # [H, v, rank]
    q_positions: torch.Tensor,  # [T]; keys sit at positions 0..S-1
    *,
    scale: float,
) -> torch.Tensor:  # [T, H, v]
    """One sequence, contiguous (no cache), expanded form: the reference models' computation."""
    k, v = expand_kv(latent, k_pe, w_uk, w_uv)
    o = attention_reference(torch.cat([q_nope, q_pe], dim=-1), k, v, q_positions, scale=scale)
    return o.to(q_nope.dtype)


def ragged_attention_reference(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [S, H, D]
    v: torch.Tensor,  # [S, H, Dv]
    kv_indptr: torch.Tensor,  # [num_reqs + 1]
    meta: BatchMetadata,
    *,
    scale: float,
) -> torch.Tensor:  # [T, H, Dv]
    """The ``extend_ragged`` hook in plain float32 torch, one request at a time."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    kv_bounds = kv_indptr.tolist()
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.q_lens_cpu)):
        ks = slice(kv_bounds[i], kv_bounds[i + 1])
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        o = attention_reference(q[start : start + q_len], k[ks], v[ks], q_pos, scale=scale)
        out[start : start + q_len] = o.to(q.dtype)
        start += q_len
    return out


def gather_context(pool: KVPool, layer_id: int, meta: BatchMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's cached entries (prefix and this step's tokens), packed: [S, rank + rope] and
    kv_indptr [num_reqs + 1] int32 (request i owns rows kv_indptr[i]:kv_indptr[i+1])."""
    cache = pool.k(layer_id)  # [num_pages, 1, page_size, rank + rope]
    ps = meta.page_size
    rows = []
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(seq_len, device=cache.device)
        pages = meta.block_tables[i].to(cache.device).long()[pos // ps]
        rows.append(cache[pages, 0, pos % ps])
    indptr = [0]
    for s in meta.seq_lens_cpu:
        indptr.append(indptr[-1] + s)
    return torch.cat(rows), torch.tensor(indptr, dtype=torch.int32, device=cache.device)


def prefill_form(backend) -> str:
    """The MLA prefill form a backend asks for: ``mla_prefill``, "absorbed" unless declared."""
    form = getattr(backend, "mla_prefill", "absorbed")
    if form not in PREFILL_FORMS:
        raise BackendError(
            f"backend {backend.name!r} declares mla_prefill={form!r}",
            fix=f"declare one of {PREFILL_FORMS} in the backend class",
        )
    if form == "expanded" and not callable(getattr(backend, "extend_ragged", None)):
        raise BackendError(
            f"backend {backend.name!r} asks for expanded MLA prefill but has no extend_ragged method",
            fix="implement extend_ragged (see attnzoo/attention/mla.py) or declare mla_prefill = 'absorbed'",
        )
    return form


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
        )

    @property
    def scale(self) -> float:
        return self.attn.scale

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, qk_nope]
        q_pe: torch.Tensor,  # [T, H, qk_rope], roped
        latent: torch.Tensor,  # [T, kv_lora_rank], after kv_a_layernorm
        k_pe: torch.Tensor,  # [T, qk_rope], roped
        kv_b_weight: torch.Tensor,  # [H * (qk_nope + v_head_dim), kv_lora_rank]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, H * v_head_dim]
        t = q_nope.shape[0]
        w_uk, w_uv = split_kv_b(kv_b_weight, self.num_heads, self.qk_nope_head_dim)
        entry = torch.cat([latent, k_pe], dim=-1)[:, None, :]  # [T, 1, rank + rope]
        if not ctx.meta.is_decode and prefill_form(ctx.prefill_backend) == "expanded":
            out = self._expanded(q_nope, q_pe, entry, w_uk, w_uv, ctx)
        else:
            q = torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)  # [T, H, rank + rope]
            o = self.attn(q, entry, None, ctx).view(t, self.num_heads, self.kv_lora_rank)
            out = latent_to_values(o, w_uv)
        return out.reshape(t, self.num_heads * self.v_head_dim)

    def _expanded(self, q_nope, q_pe, entry, w_uk, w_uv, ctx: ForwardContext) -> torch.Tensor:
        # The cache holds latents only, whatever the prefill form, so decode can follow any prefill.
        ctx.pool.store(self.attn.layer_id, ctx.meta.slot_mapping, entry, None)
        ctx_entries, kv_indptr = gather_context(ctx.pool, self.attn.layer_id, ctx.meta)
        ctx_entries = ctx_entries.to(q_nope.dtype)
        k, v = expand_kv(ctx_entries[:, : self.kv_lora_rank], ctx_entries[:, self.kv_lora_rank :], w_uk, w_uv)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return ctx.prefill_backend.extend_ragged(q, k, v, kv_indptr, ctx.meta, scale=self.scale)
