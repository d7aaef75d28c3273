"""The paged KV cache: one preallocated pool, per-layer views by layer id, one or two page groups.

Every layer of a group indexes the pool with the same page ids, so one block table per request and group
serves all its layers, whatever each layer keeps per token (``KVCacheSpec``): Gemma 4 mixes head dims
and KV head counts, MLA keeps one latent vector per token, NSA adds an indexer key. Layers that share
another layer's KV (Gemma 4's ``num_kv_shared_layers``) own no memory: their views are the producer's.

Page groups (the "hybrid KV cache"): with ``num_window_pages`` given, the layers with a sliding window
(and the layers sharing their KV) form the *window* group, with its own page-id space and allocator;
every other layer (global attention, MLA, NSA) the *full* group. A request keeps every full-group page,
but only the window-group pages its sliding window can still see: the engine releases the others, so
the window group is sized for a window per request, not a context. Without ``num_window_pages`` (or
without sliding layers) there is one group: the full one.

Page 0 of each group is never handed out: padded block-table entries, released window pages and padded
CUDA-graph rows point at it, so a write through padding lands in a page nobody reads. It holds zeros or
the padding rows' (finite) entries, and every kernel masks invisible keys by -inf scores (weights of
exactly 0) or does not load them, so nothing in it reaches a result.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from attnzoo.attention.store_rope import RoPE
from attnzoo.errors import BackendError, KVCacheFullError, ModelLoadError
from attnzoo.layers.fused import rope_ref

_ALIGN = 256  # byte alignment of every layer's slab in the pool
MAX_PAGE_SIZE = 128
# kv_cache_dtype names -> the element type the pool stores (None: the model's dtype). The one list of
# them: the policy, the backends' declarations and the command lines read it.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}
FP8_E4M3_MAX = 448.0  # largest finite float8 e4m3fn value
FP8_BLOCK = 128  # latent values per scale in KVLayout.FP8_NOPE_SCALED_BF16_ROPE


# MLA cache entry layouts (attnzoo/attention/kv_layout.py describes them and converts between them). The
# pool holds BF16 entries; the Triton kernels that read the others import the names from here.
class KVLayout(enum.Enum):
    BF16 = "bf16"
    FP8_NOPE_SCALED_BF16_ROPE = "fp8_nope_scaled_bf16_rope"

    def check(self, rank: int, rope: int) -> None:
        """Raise if entries of this geometry cannot be stored in this layout."""
        if self is KVLayout.FP8_NOPE_SCALED_BF16_ROPE and (rank % FP8_BLOCK or rope % 2):
            raise BackendError(
                f"KV layout {self.value} stores the latent in blocks of {FP8_BLOCK} values; this model has "
                f"kv_lora_rank {rank} (rope {rope})",
                fix=f"use a backend that reads the {KVLayout.BF16.value} layout (e.g. nsa_triton or torch)",
            )

    def row_bytes(self, rank: int, rope: int, dtype: torch.dtype) -> int:
        """Bytes one token's entry takes in this layout (BF16: in ``dtype``, the model dtype)."""
        self.check(rank, rope)
        if self is KVLayout.BF16:
            return (rank + rope) * torch.empty((), dtype=dtype).element_size()
        return rank + 4 * (rank // FP8_BLOCK) + 2 * rope


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type the pool stores for ``kv_cache_dtype`` ("auto": the model's dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"unknown kv_cache_dtype {kv_cache_dtype!r}", fix=f"use one of: {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale, saturated to the e4m3 range and rounded to nearest even: what the fp8 pool stores."""
    # Times the inverse, as the store kernel does, so both round the same products.
    return (x.float() * (1.0 / scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer keeps per token in the pool."""

    num_kv_heads: int
    head_dim: int  # width of the stored key; MLA: kv_lora_rank + qk_rope_head_dim
    v_head_dim: int  # width of the value; MLA: kv_lora_rank
    # MLA: values are the first v_head_dim channels of the stored key (the latent), not a buffer.
    v_from_k: bool = False
    index_head_dim: int = 0  # NSA: width of the indexer key cache per token, 0 when absent
    shared_from: int | None = None  # KV-sharing layer: reads this layer's cache and owns none
    sliding_window: int | None = None  # a query at p sees keys j > p - sliding_window (None: all before it)
    # Compressed attention (DeepSeek-V4 CSA/HCA): one entry of ``compressed_dim`` values (and an indexer key
    # of ``index_compressed_dim``) per ``compress_rate`` tokens, kept in the full group's pages (the page
    # holding a block's last token); the compressor's per-token inputs (``state_dim`` values) are kept
    # beside the raw window until their block completes. ``overlap``: an entry also reads the block before.
    compress_rate: int = 0
    compressed_dim: int = 0
    index_compressed_dim: int = 0
    state_dim: int = 0
    overlap: bool = False

    def values_per_token(self) -> int:
        """Values per token in the layer's own group (the window group for a windowed layer); a KV-sharing
        layer stores only its own indexer keys, if any."""
        if self.shared_from is not None:
            return self.index_head_dim
        v = 0 if self.v_from_k else self.num_kv_heads * self.v_head_dim
        return self.num_kv_heads * self.head_dim + v + self.index_head_dim + self.state_dim

    def entries_per_page(self, page_size: int) -> int:
        """Compressed entries one full-group page holds (0: no compressor): one per block ending in it."""
        return -(-page_size // self.compress_rate) if self.compress_rate else 0

    def compressed_values_per_page(self, page_size: int) -> int:
        """Values a full-group page holds for this layer's compressed entries."""
        return self.entries_per_page(page_size) * (self.compressed_dim + self.index_compressed_dim)

    def kept_window(self) -> int | None:
        """Tokens before a query the layer's group must keep: its window, and the compressor's blocks
        (two with overlap) until they complete."""
        if not self.compress_rate:
            return self.sliding_window
        return max(self.sliding_window or 0, self.compress_rate * (2 if self.overlap else 1))


class PageAllocator:
    """Hands out page ids 1..num_pages-1 with reference counts (shared prefixes hold a page twice)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the pool needs at least 2 pages (page 0 is reserved for padding)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFullError(
                f"asked for {n} KV pages, {len(self._free)} free of {self.capacity}",
                fix="lower the batch size or max_new_tokens, or give the KV cache more memory (kv_cache_memory=...)",
            )
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} is not allocated"
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} freed twice"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]


def window_group_layers(specs: list[KVCacheSpec | None]) -> set[int]:
    """The layers a two-group pool puts in the window group: those with a sliding window, and the layers
    reading their KV. A sharing layer must see its producer's keys the same way (Gemma 4 shares within a
    layer type), as its pages are the producer's."""
    out = set()
    for lid, spec in enumerate(specs):
        if spec is None:
            continue
        src = specs[spec.shared_from] if spec.shared_from is not None else spec
        if src is not None and bool(spec.sliding_window) != bool(src.sliding_window):
            raise ModelLoadError(
                f"layer {lid} (window {spec.sliding_window}) shares the KV of layer {spec.shared_from} "
                f"(window {src.sliding_window}); a KV cache with a window page group needs both windowed or neither",
                fix="load the model with window_kv_fraction=None (one page group)",
            )
        if spec.sliding_window:
            out.add(lid)
    return out


class KVPool:
    """One byte buffer holding every layer's pages; typed per-layer views into it.

    ``dtype`` is the model's dtype; the views hold ``kv_dtype`` elements: the same, or float8_e4m3fn
    with ``kv_cache_dtype="fp8_e4m3"``. An fp8 pool stores k / k_scale and v / v_scale (one scale per
    tensor, as vLLM's calculate_kv_scales=False default of 1.0: values beyond +-448 saturate), and
    every reader multiplies by the scale again.

    Layout per owning layer (HND, what FlashInfer and TRT-LLM kernels read; ``num_pages`` is the
    layer's group's: ``num_window_pages`` for the window group):
      k:       [num_pages, num_kv_heads, page_size, head_dim]
      v:       [num_pages, num_kv_heads, page_size, v_head_dim]   (MLA: a view of k's first channels)
      index_k: [num_pages, page_size, index_head_dim]            (NSA indexer keys)
    """

    def __init__(
        self,
        specs: list[KVCacheSpec | None],
        *,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        num_window_pages: int | None = None,
    ):
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be in 1..{MAX_PAGE_SIZE}, got {page_size}")
        if not (k_scale > 0 and v_scale > 0):
            raise ModelLoadError(f"KV scales must be positive, got k_scale={k_scale}, v_scale={v_scale}",
                                 fix="pass positive floats (1.0 keeps values as they are)")
        self.specs = specs
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        self.device = torch.device(device)
        self._window_layers = window_group_layers(specs) if num_window_pages is not None else set()
        # The window group's release point: the widest window among its layers sees every key a narrower one does.
        self.window = max((specs[i].kept_window() for i in self._window_layers), default=None)
        self.num_window_pages = num_window_pages if self.window else None
        elt = torch.empty((), dtype=self.kv_dtype).element_size()
        # (layer id) -> (name -> (byte offset, shape)) for layers that own memory
        layout: dict[int, dict[str, tuple[int, tuple[int, ...]]]] = {}
        groups: dict[tuple[int, str], str] = {}  # (layer, part) -> "full" / "window"
        offset = 0
        for lid, spec in enumerate(specs):
            if spec is None or (spec.shared_from is not None and not spec.index_head_dim):
                continue
            group = "window" if lid in self._window_layers else "full"
            n = num_window_pages if group == "window" else num_pages
            parts = {}  # name -> (shape, page group)
            if spec.shared_from is None:
                parts["k"] = ((n, spec.num_kv_heads, page_size, spec.head_dim), group)
            if spec.shared_from is None and not spec.v_from_k:
                parts["v"] = ((n, spec.num_kv_heads, page_size, spec.v_head_dim), group)
            if spec.index_head_dim:
                parts["index_k"] = ((n, page_size, spec.index_head_dim), group)
            if spec.state_dim:
                parts["state"] = ((n, page_size, spec.state_dim), group)
            if spec.compress_rate:  # full group: entries outlive the window
                parts["compressed"] = ((num_pages, spec.entries_per_page(page_size), spec.compressed_dim), "full")
                if spec.index_compressed_dim:
                    parts["index_compressed"] = ((num_pages, spec.entries_per_page(page_size),
                                                  spec.index_compressed_dim), "full")
            layout[lid] = {}
            for name, (shape, part_group) in parts.items():
                layout[lid][name] = (offset, shape)
                groups[lid, name] = part_group
                nbytes = elt * torch.Size(shape).numel()
                offset += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset
        self.buffer = torch.zeros(offset, dtype=torch.uint8, device=self.device)
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        for lid, parts in layout.items():
            self._views[lid] = {
                name: self.buffer[off : off + elt * torch.Size(shape).numel()].view(self.kv_dtype).view(shape)
                for name, (off, shape) in parts.items()
            }
        # The tensors this pool owns, by page group: what ``bytes_by_group`` measures.
        self._owned = [(groups[lid, name], self._views[lid][name]) for lid, parts in layout.items() for name in parts]
        for lid, spec in enumerate(specs):
            if spec is None:
                continue
            if spec.shared_from is not None:
                src = spec.shared_from
                if src not in self._views or "k" not in self._views[src]:
                    raise ValueError(f"layer {lid} shares the KV of layer {src}, which owns none")
                # Its own indexer keys, if any (Mistral Large 4: a layer sharing a latent may still index)
                self._views[lid] = {**self._views[src], **self._views.get(lid, {})}
            elif spec.v_from_k:
                self._views[lid]["v"] = self._views[lid]["k"][..., : spec.v_head_dim]

    @staticmethod
    def bytes_per_page(specs: list[KVCacheSpec | None], page_size: int, dtype: torch.dtype,
                       group: str | None = None) -> int:
        """Bytes one page takes over every owning layer (``group``: "full" or "window", over that
        group's layers as ``window_group_layers`` splits them)."""
        elt = torch.empty((), dtype=dtype).element_size()
        window = window_group_layers(specs) if group is not None else set()
        layers = [(i, s) for i, s in enumerate(specs) if s is not None]
        own = page_size * sum(s.values_per_token() for i, s in layers
                              if group is None or (i in window) == (group == "window"))
        compressed = (sum(s.compressed_values_per_page(page_size) for _, s in layers if s.shared_from is None)
                      if group != "window" else 0)
        return elt * (own + compressed)

    def bytes_by_group(self) -> dict[str, int]:
        """Bytes of the tensors each page group owns, page 0 included (the buffer adds alignment padding)."""
        out = {"full": 0, "window": 0}
        for group, t in self._owned:
            out[group] += t.nbytes
        return out

    @staticmethod
    def bytes_per_token(specs: list[KVCacheSpec | None], page_size: int, dtype: torch.dtype,
                        group: str | None = None) -> int | float:
        """``bytes_per_page`` per token: compressed entries counted as pages of ``page_size`` hold them."""
        b = KVPool.bytes_per_page(specs, page_size, dtype, group) / page_size
        return int(b) if b.is_integer() else b

    @property
    def has_window_group(self) -> bool:
        return self.window is not None

    def in_window_group(self, layer_id: int) -> bool:
        return layer_id in self._window_layers

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == torch.float8_e4m3fn

    def owns_memory(self, layer_id: int) -> bool:
        spec = self.specs[layer_id]
        return spec is not None and spec.shared_from is None

    def k(self, layer_id: int) -> torch.Tensor:
        return self._views[layer_id]["k"]

    def v(self, layer_id: int) -> torch.Tensor:
        return self._views[layer_id]["v"]

    def index_k(self, layer_id: int) -> torch.Tensor:
        return self._views[layer_id]["index_k"]

    def view(self, layer_id: int, name: str) -> torch.Tensor:
        """A layer's named view: "state", "compressed", "index_compressed" (compressed attention)."""
        return self._views[layer_id][name]

    def store(
        self,
        layer_id: int,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: the indexer keys only
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, v_head_dim]; None when v_from_k
        index_k: torch.Tensor | None = None,  # [num_tokens, index_head_dim]
        *,
        rope: RoPE | None = None,  # rotate k (and rope.q) in place first, in the same launch on a GPU
    ) -> None:
        """The one store path: write this step's new tokens at their slots. A KV-sharing layer stores
        only its own indexer keys (k None)."""
        if k is not None and not self.owns_memory(layer_id):
            raise RuntimeError(f"layer {layer_id} reads a shared KV cache and must not write it")
        if rope is not None and (problem := rope.problem(k, v)):
            raise BackendError(f"store with RoPE: {problem}", fix="rotate q and k first (fused.rope), then store")
        views = self._views[layer_id]
        if self.device.type == "cuda":
            # One Triton launch per layer for k and v (torch indexing costs several kernels each).
            from attnzoo.attention.kernels.store import store_kv, store_rows

            if k is not None:
                store_kv(slot_mapping, k, views["k"], v, views["v"] if v is not None else None,
                         k_scale=self.k_scale, v_scale=self.v_scale, rope=rope)
            if index_k is not None:
                store_rows(slot_mapping, index_k, views["index_k"])
            return
        if rope is not None:
            rope.q.copy_(rope_ref(rope.q, rope.cos, rope.sin, rope.interleaved))
            k.copy_(rope_ref(k, rope.cos, rope.sin, rope.interleaved))
        page = slot_mapping // self.page_size
        off = slot_mapping % self.page_size
        if k is not None:
            views["k"][page, :, off] = quantize_fp8(k, self.k_scale) if self.is_fp8 else k.to(self.kv_dtype)
        if v is not None:
            views["v"][page, :, off] = quantize_fp8(v, self.v_scale) if self.is_fp8 else v.to(self.kv_dtype)
        if index_k is not None:
            views["index_k"][page, off] = index_k.to(self.kv_dtype)


def layer_kind(spec: KVCacheSpec) -> str:
    """How ``kv_bytes_by_kind`` names a layer's cache: "csa", "hca" (compressed attention), "sliding",
    "mla", "nsa", "full"."""
    if spec.compress_rate:
        return "csa" if spec.index_compressed_dim else "hca"
    if spec.sliding_window:
        return "sliding"
    if spec.v_from_k:
        return "nsa" if spec.index_head_dim else "mla"
    return "full"


def kv_bytes_by_kind(specs: list[KVCacheSpec | None], page_size: int, dtype: torch.dtype) -> dict[str, dict]:
    """Per layer kind: its layers, the bytes per token they need while the token is in their window
    (raw keys, compressor state: ``per_window_token``; a pool without a window group keeps these for
    ever), and for every token of context (compressed entries at this page size, or the whole entry of a
    layer without a window: ``per_context_token``), summed over the kind's layers."""
    elt = torch.empty((), dtype=dtype).element_size()
    out: dict[str, dict] = {}
    for s in specs:
        if s is None or s.shared_from is not None:
            continue
        d = out.setdefault(layer_kind(s), {"layers": 0, "per_window_token": 0, "per_context_token": 0.0})
        d["layers"] += 1
        d["per_window_token" if s.sliding_window else "per_context_token"] += elt * s.values_per_token()
        d["per_context_token"] += elt * s.compressed_values_per_page(page_size) / page_size
    return out


def wants_window_group(specs: list[KVCacheSpec | None]) -> bool:
    """Whether ``window_kv_fraction="auto"`` gives the pool a window page group: where a layer compresses its
    keys (DeepSeek-V4 CSA/HCA), whose raw keys and compressor state serve only the window and the unfinished
    blocks (V4-Flash: 29x the bytes per token of what it keeps for every token of context)."""
    return any(s is not None and s.compress_rate for s in specs)


def kv_footprint(pool: KVPool, config=None) -> dict:
    """The pool's bytes per token, measured from its tensors (page 0 included), beside what each layer kind
    needs (``kv_bytes_by_kind``). ``bytes_per_context_token``: the whole pool (window group included) over
    the full group's usable tokens, what a token of context capacity costs. For an MLA-family ``config``
    (a rope part in the key), a plain MLA cache of the same depth, one latent + rope entry per token and
    layer in the model dtype, to compare (V4, which has no kv_lora_rank: its entry width)."""
    ps, measured = pool.page_size, pool.bytes_by_group()
    total = measured["full"] + measured["window"]
    out = {
        "by_kind": kv_bytes_by_kind(pool.specs, ps, pool.kv_dtype),
        "pool_bytes": total,
        "context_tokens": (pool.num_pages - 1) * ps,
        "full_group_bytes_per_token": measured["full"] / (pool.num_pages * ps),
        "window_tokens": (pool.num_window_pages - 1) * ps if pool.has_window_group else None,
        "window_group_bytes_per_token": (measured["window"] / (pool.num_window_pages * ps)
                                         if pool.has_window_group else None),
        "bytes_per_context_token": total / ((pool.num_pages - 1) * ps),
    }
    c = getattr(config, "text_config", None) or config
    rope = getattr(c, "qk_rope_head_dim", None)
    latent = (getattr(c, "kv_lora_rank", None) or getattr(c, "head_dim", None)) if rope else None
    if latent:
        mla = c.num_hidden_layers * (latent + rope) * torch.empty((), dtype=pool.dtype).element_size()
        out["plain_mla_bytes_per_token"] = mla
        out["vs_plain_mla"] = out["bytes_per_context_token"] / mla
    return out
