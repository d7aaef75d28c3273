"""Explicit KV-cache layouts for MLA caches, and the conversions between them.

One MLA cache entry per token is the normalized latent (``rank`` = kv_lora_rank values) followed by the
shared RoPE key (``rope`` values). Kernels disagree on how that entry is stored:

  BF16                       the model dtype, [latent | rope]: what the KV pool holds and every dense MLA
                             kernel reads. (Named for the serving dtype; a float32 model stores float32.)
  FP8_NOPE_SCALED_BF16_ROPE  the FlashMLA sparse layout: fp8 e4m3 latent with one float32 scale per 128
                             values (amax / 448), the scales, then the rope part in bf16:
                             rank + 4 * rank / 128 + 2 * rope bytes (512 + 16 + 128 = 656 for DeepSeek).

Every NSA backend declares the layout it reads (``mla_kv_layout``); nothing infers it from a flag. The
pool always holds BF16 entries (the shared attention layer writes them); a backend that reads another
layout keeps a ``LayoutCache``, into which each token is converted once, when its layer stores it.

The torch functions here (``pack``, ``unpack``) are the reference for the Triton conversion kernel (``attnzoo/attention/kernels/kv_layout.py``).
"""
from __future__ import annotations

import torch

# The layouts themselves (KVLayout, FP8_BLOCK) live with the pool, below the Triton kernels that read them.
from attnzoo.attention.kv_cache import FP8_BLOCK, KVCacheSpec, KVLayout, KVPool
from attnzoo.attention.kv_cache import FP8_E4M3_MAX as FP8_MAX
from attnzoo.errors import BackendError


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3 bytes, saturating (torch's cast alone turns out-of-range values into NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _from_fp8(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).float()


def pack(entries: torch.Tensor, layout: KVLayout, *, rank: int) -> torch.Tensor:
    """Entries [N, rank + rope] (any float dtype) -> [N, row_bytes] uint8 in ``layout``.

    BF16 returns the entries themselves (that layout is the model dtype).
    """
    rope = entries.shape[-1] - rank
    layout.check(rank, rope)
    if layout is KVLayout.BF16:
        return entries
    x = entries.float()
    n = x.shape[0]
    blocks = x[:, :rank].reshape(n, rank // FP8_BLOCK, FP8_BLOCK)
    scales = (blocks.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [N, rank / 128]
    latent = _to_fp8(blocks / scales[..., None]).reshape(n, rank)
    return torch.cat([
        latent,
        scales.contiguous().view(torch.uint8),
        x[:, rank:].to(torch.bfloat16).contiguous().view(torch.uint8),
    ], dim=-1)


def unpack(rows: torch.Tensor, layout: KVLayout, *, rank: int, rope: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, row_bytes] uint8 in ``layout`` (BF16: entries) -> entries [N, rank + rope] in ``dtype``."""
    layout.check(rank, rope)
    if layout is KVLayout.BF16:
        return rows.to(dtype)
    n, nb = rows.shape[0], rank // FP8_BLOCK
    scales = rows[:, rank : rank + 4 * nb].contiguous().view(torch.float32)  # [N, nb]
    latent = _from_fp8(rows[:, :rank]).reshape(n, nb, FP8_BLOCK) * scales[..., None]
    rope_part = rows[:, rank + 4 * nb :].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent.reshape(n, rank), rope_part], dim=-1).to(dtype)


def _copied(specs: list[KVCacheSpec | None]) -> list[tuple[int, KVCacheSpec]]:
    """(layer id, spec) of the MLA layers a ``LayoutCache`` copies: those whose entries the pool holds itself."""
    return [(lid, s) for lid, s in enumerate(specs) if s is not None and s.v_from_k and s.shared_from is None]


def copy_bytes_per_token(specs, layout: KVLayout, dtype: torch.dtype) -> int:
    """Bytes per token of the pool that a ``LayoutCache`` in ``layout`` adds (0 for BF16: no copy)."""
    if layout is KVLayout.BF16:
        return 0
    return sum(layout.row_bytes(s.v_head_dim, s.head_dim - s.v_head_dim, dtype) for _, s in _copied(specs))


class LayoutCache:
    """A backend's copy, in its own layout, of every MLA layer's cache in ``pool``.

    Indexed by the pool's page ids, so block tables, shared prefixes and page 0's padding role carry
    over unchanged: view(layer) is [num_pages, page_size, row_bytes] uint8. It is filled by ``store``
    with the step's new entries, right after the layer stores them in the pool: every token is
    converted once, from values the layer already holds, and decode never re-reads the pool for it.
    """

    def __init__(self, pool: KVPool, layout: KVLayout):
        if layout is KVLayout.BF16:
            raise BackendError("the BF16 layout is the pool itself and needs no copy",
                               fix="read pool.k(layer) directly")
        self.pool, self.layout = pool, layout
        self.rank: dict[int, int] = {}
        self._rows: dict[int, torch.Tensor] = {}
        for lid, spec in _copied(pool.specs):
            rope = spec.head_dim - spec.v_head_dim
            self.rank[lid] = spec.v_head_dim
            nbytes = layout.row_bytes(spec.v_head_dim, rope, pool.dtype)
            self._rows[lid] = torch.zeros(pool.num_pages, pool.page_size, nbytes, dtype=torch.uint8,
                                          device=pool.device)
        self.nbytes = sum(t.numel() for t in self._rows.values())
        for lid, spec in enumerate(pool.specs):  # KV-sharing layers read their producer's copy, as its pool views
            if spec is not None and spec.shared_from in self._rows:
                self._rows[lid], self.rank[lid] = self._rows[spec.shared_from], self.rank[spec.shared_from]

    def view(self, layer_id: int) -> torch.Tensor:
        return self._rows[layer_id]

    def store(self, layer_id: int, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
        """entries [num_tokens, rank + rope] (model dtype) -> this layout, at their slots."""
        from attnzoo.attention.kernels.kv_layout import pack_rows

        rows = self._rows[layer_id]
        pack_rows(entries, rows.view(-1, rows.shape[-1]), self.layout, rank=self.rank[layer_id], slots=slot_mapping)


POOL_MLA_LAYOUT = KVLayout.BF16.value  # what KVPool holds for MLA/NSA layers: model-dtype [latent | rope] entries


def layout_notes(prefill, decode, kind: str) -> list[str]:
    """What a Decision says about the KV layouts its two backends (their capabilities) read: a mismatch
    between the phases, and every conversion from the pool's entries."""
    pre, dec = prefill.layout_for(kind), decode.layout_for(kind)
    notes = [f"prefill ({prefill.name}) reads KV layout {pre} and decode ({decode.name}) reads {dec}: "
             "the cache is converted between them"] if pre != dec else []
    phases = {"prefill and decode": prefill} if prefill.name == decode.name else {"prefill": prefill, "decode": decode}
    for phase, caps in (phases.items() if kind != "mha" else ()):
        if caps.mla_kv_layout != POOL_MLA_LAYOUT:
            notes.append(f"{phase} backend {caps.name} reads KV layout {caps.mla_kv_layout}: the pool keeps "
                         f"{POOL_MLA_LAYOUT} (model dtype) entries and a Triton kernel (attnzoo/attention/kernels/"
                         f"kv_layout.py) converts each token once, when its layer stores it, into {caps.name}'s "
                         f"{caps.mla_kv_layout} copy")
    return notes
