"""What the FlashInfer-backed backends share: the import, the workspaces, the per-layer signature.

Nothing here touches FlashInfer or the GPU at import time. ``load_flashinfer`` imports it when a
backend is constructed and turns a missing or broken install into a ``BackendError`` that names the
pip extra. Workspaces are allocated on first use by a backend instance and then shared by every
backend on that device (kernels on one stream run one after another, so sharing is safe within a
purpose), keyed by purpose because the purposes must not alias:

* ``"wrappers"``: the float workspace of the plan/run wrappers (split-KV partial results), 128 MiB as
  FlashInfer recommends. Contents are scratch.
* ``"trtllm"``: the workspace of the TRT-LLM kernels (XQA keeps its semaphores in the first 8 MiB and
  needs them zeroed before first use; trtllm-gen keeps softmax statistics). Zero-initialised, 512 MiB:
  XQA's multi-block scratch grows with batch x KV heads, and SGLang sizes the same buffer at 512 MiB.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from attnzoo.errors import BackendError

FLASHINFER_FIX = 'pip install "attnzoo[flashinfer]" (flashinfer-python==0.7.2.post1 with apache-tvm-ffi==0.1.15.post2)'

# "cascade_shared": the cascade shared parts' own float workspace, since they run beside the rest's
# kernels (flashinfer.py), which use "wrappers"; split_kv_fits_workspace keeps their partials within it.
_WORKSPACE_BYTES = {"wrappers": 128 << 20, "cascade_shared": 128 << 20, "trtllm": 512 << 20}
_workspaces: dict[tuple[str, str], torch.Tensor] = {}


def load_flashinfer(backend_name: str) -> SimpleNamespace:
    """The FlashInfer entry points the adapters call, or a BackendError naming the extra."""
    try:
        from flashinfer import cascade, decode, mla, prefill
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or a native dependency fails to load
        raise BackendError(
            f"the {backend_name!r} attention backend needs FlashInfer, which cannot be imported "
            f"({type(e).__name__}: {e})",
            fix=f"{FLASHINFER_FIX}, or choose another backend (triton, torch)",
        ) from e
    return SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=decode.BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper=prefill.BatchPrefillWithPagedKVCacheWrapper,
        trtllm_batch_decode_with_kv_cache=decode.trtllm_batch_decode_with_kv_cache,
        trtllm_batch_context_with_kv_cache=prefill.trtllm_batch_context_with_kv_cache,
        BatchMLAPagedAttentionWrapper=mla.BatchMLAPagedAttentionWrapper,
        MLAPlanMetadata=mla.MLAPlanMetadata,
        merge_state=cascade.merge_state,
        trtllm_batch_decode_with_kv_cache_mla=mla.trtllm_batch_decode_with_kv_cache_mla,
    )


def workspace(device: torch.device, purpose: str, min_bytes: int = 0) -> torch.Tensor:
    """The device's workspace for ``purpose`` ("wrappers", "cascade_shared" or "trtllm"), allocated on first
    request and replaced by a larger one when ``min_bytes`` asks for more (wrappers holding the old one keep it)."""
    key = (str(device), purpose)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < min_bytes:
        # zeros, not empty: XQA's semaphores must start at zero, and zeroing the rest once is free.
        buf = torch.zeros(max(_WORKSPACE_BYTES[purpose], min_bytes), dtype=torch.uint8, device=device)
        _workspaces[key] = buf
    return buf


def graph_float_workspace_bytes(specs, max_batch: int, num_sms: int) -> int:
    """An upper bound on the float workspace FlashInfer's split-KV decode needs when planned for CUDA
    graphs at ``max_batch`` requests: its partial outputs are sized for the padded work list, not the step.

    FlashInfer 0.7.2 (scheduler.cuh): the tensor-core path (PrefillPlan) takes num_kv_heads x
    padded_batch x cta_tile_q x head_dim_vo floats, with padded_batch = max(2 x SMs / kv_heads,
    ceil(rows x group / cta_tile_q) + batch - 1) <= 2 x batch + 2 x SMs and cta_tile_q <= 16 for one
    query per request; the CUDA-core path (DecodePlan) num_qo_heads x max(2 x SMs, batch) x head_dim
    floats, within the same bound for groups up to 16. The log-sum-exp adds 1/head_dim of that."""
    rows = 2 * max_batch + 2 * num_sms
    per_row = max((16 * s.num_kv_heads * (s.v_head_dim + 1) * 4 for s in specs
                   if s is not None and s.shared_from is None), default=0)
    return rows * per_row


def compute_capability(backend_name: str, device: torch.device) -> tuple[int, int]:
    """(major, minor) of the pool's GPU; a BackendError when the pool is not on a CUDA device."""
    if device.type != "cuda":
        raise BackendError(
            f"the {backend_name!r} backend runs FlashInfer kernels on CUDA GPUs; the KV cache is on {device}",
            fix="load the model with device='cuda', or choose backend='torch' on CPU",
        )
    return torch.cuda.get_device_capability(device)


def sm_name(cc: tuple[int, int]) -> str:
    return f"sm{cc[0]}{cc[1]}"


def check_page_size(backend_name: str, meta_page_size: int, pool_page_size: int) -> None:
    if meta_page_size != pool_page_size:
        raise BackendError(
            f"{backend_name}: the step's page size {meta_page_size} differs from the KV pool's {pool_page_size}",
            fix="build the step's metadata with the pool's page size",
        )


@dataclass(frozen=True)
class LayerSignature:
    """Everything a FlashInfer plan bakes in about a layer. Layers with equal signatures share a plan;
    a model whose layers differ (Gemma 4: sliding d256 and global d512 layers) gets one plan each."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None  # our convention: a query at p sees keys j with p - window < j <= p
    softcap: float | None
    scale: float

    @classmethod
    def of(cls, layer) -> "LayerSignature":
        return cls(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            v_head_dim=layer.v_head_dim,
            window=layer.sliding_window or None,
            softcap=layer.logit_softcap or None,
            scale=float(layer.scale),
        )

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def window_left(self) -> int:
        """FlashInfer's ``window_left`` (a query at p sees keys j >= p - window_left, inclusive), or -1
        for no window. Ours excludes p - window, so it is one less than our window."""
        return self.window - 1 if self.window else -1


def window_page_start(seq_lens: list[int], q_lens: list[int], page_size: int, window: int | None) -> list[int] | None:
    """Per request, the first page any of its queries can see under a sliding window (None: no window).

    The first query of request i sits at ``seq_lens[i] - q_lens[i]`` and sees keys from
    ``pos - window + 1``; whole pages before that are skipped. Kernels mask relative to the end of the
    KV range, so dropping whole leading pages leaves every visible key where it was.
    """
    if not window:
        return None
    return [max(0, s - q - window + 1) // page_size for s, q in zip(seq_lens, q_lens)]


@dataclass(frozen=True)
class CascadeSplit:
    """How one layer signature splits a cascade step (page numbers are block-table columns).

    shared: columns ``[shared_start, shared_end)`` of request 0's table, read once for every query of the
    step, non-causal. rest: per request, columns ``[rest_start[i], shared_start)`` then
    ``[shared_end, its last page]``, read per request with FlashInfer's ``window_left``, causal for
    extend. Pure host arithmetic (no FlashInfer, no device), so it is tested on CPU.
    """

    shared_start: int
    shared_end: int
    rest_start: list[int]  # [num_reqs], host
    window_left: int  # for the rest: the layer's window_left minus the gap, or -1 (no window)

    @property
    def gap_pages(self) -> int:
        return self.shared_end - self.shared_start


def cascade_split(seq_lens: list[int], q_lens: list[int], shared_pages: int, page_size: int,
                  window: int | None, quantum_pages: int = 1) -> CascadeSplit | None:
    """The shared segment and per-request rest of a cascade step for a layer with ``window`` (ours:
    query p sees keys j with p - window < j <= p; None: no window), or None when no page of the shared
    prefix is seen by every query (the layer then runs its plain path).

    ``shared_pages``: leading pages every request holds at the same ids, all within every request's
    cached prefix (``BatchMetadata.shared_prefix_len // page_size``), so every query of the step sits at
    p >= P = shared_pages x page_size. FlashInfer masks a key at list index j' for a query at list index
    p' (queries aligned to the end of the list) iff j' < p' - window_left, and, causal, j' > p'.

    Without a window, the shared segment is the whole prefix and the rest each request's pages after it.

    With one (wl = window - 1, key j visible to p iff p - wl <= j <= p):
    * shared segment: pages [S, shared_pages) with S = ceil(max_i(last query of i - wl) / page_size): every
      key there is >= p - wl for every query p of the step (and < P <= p), so all queries see all of it.
    * rest of request i: pages [w_i, S) (w_i: the first page its first query can see, as
      ``window_page_start``; w_i <= S because its first query is at or before its last) and its pages
      from ``shared_pages`` on. The list skips G = (shared_pages - S) x page_size keys in the middle.
    * window_left' = wl - G is exact on this list. With the list starting at token W = w_i x page_size,
      a key j before the gap is at j' = j - W, a key after it at j' = j - W - G, and a query p (after the
      gap) at p' = p - W - G. Before the gap: j' >= p' - wl' <=> j - W >= p - W - G - wl + G <=> j >= p - wl,
      the real window; and j' <= p' since j < S x page_size <= P - G <= p - G. After the gap:
      j' >= p' - wl' <=> j >= p - wl + G, which holds for every such key because
      j >= P = S x page_size + G >= p - wl + G (the choice of S); and j' <= p' <=> j <= p, the real causal
      mask. Keys before W are outside every query's window of request i (``window_page_start``).
      wl' >= 0: G <= P - S x page_size <= P - max(0, s_i - window) <= window - 1 for any request i, as
      P <= s_i - q_i (the prefix is cached) with q_i >= 1 and P <= s_i - 1; so wl' is a window
      (FlashInfer reads -1 as none, 0 as "the query's own position onwards").

    ``quantum_pages`` = q > 1 (CUDA-graph steps, whose launches bake wl' in): the gap is rounded DOWN to
    a multiple of q pages, G' = q x floor(G / (q x page_size)) x page_size, i.e. S' = shared_pages - G' /
    page_size >= S. Still exact: the proof above uses only that every key from S x page_size on is in
    every query's window (so from S' x page_size on too: a subset) and w_i <= S (so w_i <= S'); with
    G' for G it goes through unchanged, and wl' = wl - G' >= wl - G >= 0. A gap rounded to 0 leaves no
    shared segment: None (the plain path). So wl' depends on the step only through floor(G / q pages):
    at most window / (q x page_size) values per window size, whatever the prefix length.
    """
    if shared_pages <= 0:
        return None
    num_reqs = len(seq_lens)
    if not window:
        return CascadeSplit(0, shared_pages, [0] * num_reqs, -1)
    shared_tokens = shared_pages * page_size
    if any(s - q < shared_tokens for s, q in zip(seq_lens, q_lens)):
        raise BackendError(
            f"a cascade step's shared prefix of {shared_tokens} tokens is longer than a request's cached prefix",
            fix="set shared_prefix_len from shared_prefix_pages() of the step's cached prefixes",
        )
    wl = window - 1
    reach = max(s - 1 - wl for s in seq_lens)  # the latest first visible key of any last query
    start = -(-max(reach, 0) // page_size)
    gap = (shared_pages - start) // quantum_pages * quantum_pages  # pages; quantum 1: shared_pages - start
    if gap <= 0:
        return None
    rest = window_page_start(seq_lens, q_lens, page_size, window)
    return CascadeSplit(shared_pages - gap, shared_pages, rest, wl - gap * page_size)


# A CUDA-graph cascade split rounds its gap to about window / CASCADE_GRAPH_GAP_STEPS tokens: each
# window size's rest then takes at most this many window_left values (each one graph per bucket),
# and a request reads at most that many more tokens of the prefix itself than the exact split has it.
CASCADE_GRAPH_GAP_STEPS = 8


def gap_quantum_pages(window: int, page_size: int) -> int:
    """The ``quantum_pages`` of ``cascade_split`` for a CUDA-graph step of a layer with ``window``."""
    return max(1, window // (CASCADE_GRAPH_GAP_STEPS * page_size))


def cascade_graph_key(seq_lens: list[int], q_lens: list[int], shared_pages: int, page_size: int,
                      windows: list[int]) -> tuple:
    """What a captured cascade decode step bakes in beyond its batch size: for each sliding ``window``
    of the layers that cascade, the rest's ``window_left`` under the graph's rounded split (None: those
    layers run their plain path this step). Layers without a window plan -1 every step, so they add
    nothing. Steps with equal keys (and buckets) replay the same graph; only page ids and lengths,
    which ``plan()`` writes into the graph's buffers, differ."""
    return tuple((w, None if split is None else split.window_left)
                 for w in windows
                 for split in [cascade_split(seq_lens, q_lens, shared_pages, page_size, w,
                                             quantum_pages=gap_quantum_pages(w, page_size))])


def split_kv_fits_workspace(rows: int, num_heads: int, v_head_dim: int) -> bool:
    """Whether a CUDA-graph prefill plan over ``rows`` query rows may split the KV: FlashInfer's graph
    planner always splits then, keeping float32 partial outputs for about max(rows, a grid's worth)
    rows x heads x (v_head_dim + 1) in the "cascade_shared" workspace. A quarter of it is the budget
    (room for the padding to a grid); past it the rows' query tiles fill the GPU without splitting."""
    return rows * num_heads * (v_head_dim + 1) * 4 <= _WORKSPACE_BYTES["cascade_shared"] // 4


class GraphBlockTable:
    """The padded block table a captured decode step reads (the TRT-LLM kernels take one): allocated once
    for the largest batch and context, refilled in place before each replay, so the graph's address holds."""

    def __init__(self, backend_name: str, max_batch_size: int, max_pages_per_req: int, num_cols: int,
                 page_size: int, device: torch.device):
        self.backend_name = backend_name
        self.table = torch.zeros(max_batch_size, num_cols, dtype=torch.int32, device=device)  # [max_batch, num_cols]
        # The kernels are scheduled for the longest context any replay may see.
        self.max_seq_len = max_pages_per_req * page_size

    def fill(self, meta, tables: torch.Tensor | None = None) -> torch.Tensor:
        """This step's rows of ``tables`` (default: ``meta.block_tables``), written into the static table:
        [num_reqs, num_cols] int32, device."""
        if not meta.is_decode:
            raise BackendError(f"{self.backend_name} captures decode steps only", fix="run extend steps eagerly")
        from attnzoo.attention.kernels import page_table  # Triton: imported when a graph is captured, not here

        return page_table.create_block_table(
            meta.block_tables if tables is None else tables, meta.seq_lens, meta.page_size, num_cols=self.table.shape[1],
            pad_value=0, max_pages=-(-meta.max_seq_len // meta.page_size), out=self.table,
        )
