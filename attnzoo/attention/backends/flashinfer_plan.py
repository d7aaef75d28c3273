"""What the ``flashinfer`` backend's wrappers are planned over and run as: a step's plan and page lists,
the cascade run, and the static buffers of CUDA-graph steps.

Page lists: ``FlashInferPlan.page_index`` builds each request's pages in FlashInfer's ragged form once per
step and sliding-window size (pages wholly outside the window are skipped); ``rest_index`` builds a
cascade step's rest. Both read host copies of the lengths, so no step synchronises with the device.

CUDA graphs of cascade decode steps (``supports_cascade_graph``): the wrappers are built with
``use_cuda_graph=True``: the shared part's prefill wrapper over its own static buffers (qo_indptr of 2
entries, [0, bucket]; page list up to a request's pages), the rest's decode wrapper over the plain graphs'
buffers of its signature. ``plan()`` before each replay rewrites page ids and lengths there; what it
cannot change is baked into the launches at capture: the batch size (the bucket), the kernels, and
sm_scale / soft-cap / ``window_left``. The rest's ``window_left`` moves with the split, so graph steps
round the split's gap (``fi_common.gap_quantum_pages``, exact: ``cascade_split``) and the engine keys a
cascade graph by its bucket and ``cascade_graph_key`` (the rest's window_left per window size), one rest
wrapper per (bucket, window_left). FlashInfer's graph-mode plan layout (its plan info: workspace offsets,
padded grid) depends on the batch size and head shape only, never on lengths, so a wrapper planned again
with the same arguments but other lengths matches what its graph captured.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnzoo.attention.backends.base import StepPlan
from attnzoo.attention.backends.fi_common import CascadeSplit, LayerSignature, window_page_start, workspace
from attnzoo.attention.metadata import BatchMetadata, ForwardMode
from attnzoo.lazy import lazy_module

page_table = lazy_module("attnzoo.attention.kernels.page_table")  # Triton: imported on first use


@dataclass
class PageIndex:
    """One step's pages in FlashInfer's ragged form, for one sliding-window size."""

    kv_indptr: torch.Tensor  # [num_reqs + 1] int32, host
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, device
    last_page_len: torch.Tensor  # [num_reqs] int32, host


@dataclass
class FlashInferPlan(StepPlan):
    """One step's planned wrappers and the page indices they were planned over."""

    mode: ForwardMode
    qo_indptr: torch.Tensor  # [num_reqs + 1] int32, host
    shared_pages: int = 0  # cascade: leading pages every request shares (0: no cascade)
    splits: dict[int | None, CascadeSplit | None] = field(default_factory=dict)  # window -> cascade split
    indices: dict[object, PageIndex] = field(default_factory=dict)  # window, or ("rest", window)
    planned: dict[LayerSignature, object] = field(default_factory=dict)  # signature -> planned wrapper
    graph_bucket: int | None = None  # a captured decode step: the batch-size bucket whose wrappers it plans

    def page_index(self, meta: BatchMetadata, window: int | None, device: torch.device) -> PageIndex:
        """Each request's pages, minus those wholly outside ``window``, built once per step."""
        idx = self.indices.get(window)
        if idx is not None:
            return idx
        ps = meta.page_size
        starts = window_page_start(meta.seq_lens_cpu, meta.q_lens_cpu, ps, window)
        seq = torch.tensor(meta.seq_lens_cpu, dtype=torch.int32)  # host, whole-batch ops: no loop per request
        pages = (seq + ps - 1) // ps - (torch.tensor(starts, dtype=torch.int32) if starts else 0)
        indptr_host = torch.zeros(meta.num_reqs + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, dtype=torch.int32, out=indptr_host[1:])
        kv_indices = page_table.create_kv_indices(
            meta.block_tables_for(window), meta.seq_lens, indptr_host.to(device, non_blocking=True), ps,
            num_indices=int(indptr_host[-1]),
            page_start=torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True) if starts else None,
        )
        last = (seq - 1) % ps + 1
        idx = self.indices[window] = PageIndex(kv_indptr=indptr_host, kv_indices=kv_indices, last_page_len=last)
        return idx

    def rest_index(self, meta: BatchMetadata, window: int | None, split: CascadeSplit,
                   device: torch.device) -> PageIndex:
        """A cascade step's rest (``cascade_split``): each request's pages ``[rest_start, shared_start)``
        then those after the shared prefix, one list per request."""
        key = ("rest", window)
        idx = self.indices.get(key)
        if idx is not None:
            return idx
        ps, dev = meta.page_size, device
        tables = meta.block_tables_for(window)
        seq = torch.tensor(meta.seq_lens_cpu, dtype=torch.int32)  # host
        before = split.shared_start - torch.tensor(split.rest_start, dtype=torch.int32)  # [num_reqs] pages
        after = (seq + ps - 1) // ps - split.shared_end
        indptr_host = torch.zeros(meta.num_reqs + 1, dtype=torch.int32)
        torch.cumsum(before + after, 0, dtype=torch.int32, out=indptr_host[1:])
        total = int(indptr_host[-1])
        kv_indices = torch.empty(total, dtype=torch.int32, device=dev)
        if split.shared_start:  # pages before the shared segment, as if each request ended there
            page_table.create_kv_indices(
                tables, torch.full((meta.num_reqs,), split.shared_start * ps, dtype=torch.int32, device=dev),
                indptr_host.to(dev, non_blocking=True), ps, num_indices=total,
                page_start=torch.tensor(split.rest_start, dtype=torch.int32).to(dev, non_blocking=True), out=kv_indices,
            )
        after_at = indptr_host.clone()
        after_at[:-1] += before
        page_table.create_kv_indices(
            tables, meta.seq_lens, after_at.to(dev, non_blocking=True), ps, num_indices=total,
            page_start=torch.full((meta.num_reqs,), split.shared_end, dtype=torch.int32, device=dev), out=kv_indices,
        )
        idx = self.indices[key] = PageIndex(kv_indptr=indptr_host, kv_indices=kv_indices,
                                            last_page_len=(seq - 1) % ps + 1)
        return idx


def float_workspace(shared: bool) -> str:
    """A cascade shared part runs beside its rest (``CascadeRun``): its split-KV partials get their own
    float workspace, where the rest's decode writes its own at the same offsets of "wrappers"."""
    return "cascade_shared" if shared else "wrappers"


@dataclass
class CascadeRun:
    """A planned cascade step: the shared prefix once for all queries, the rest per request."""

    shared: object  # BatchPrefillWithPagedKVCacheWrapper planned over the shared pages
    rest: object  # decode (DECODE) or causal prefill (EXTEND) wrapper over each request's other pages
    merge_state: object
    side: torch.cuda.Stream | None = None  # runs the shared part beside the rest (None: one after the other)

    def run(self, *, q: torch.Tensor, paged_kv_cache, **scales) -> torch.Tensor:
        kw = dict(q=q, paged_kv_cache=paged_kv_cache, return_lse=True, **scales)
        if self.side is None:
            o_shared, lse_shared = self.shared.run(**kw)
            o_rest, lse_rest = self.rest.run(**kw)
        else:
            # The shared part is a few compute-bound CTAs, the rest's decode a memory-bound full grid: side by
            # side the shared part can hide under the rest. The side
            # stream joins the main one before the merge (inside a graph capture too), and every tensor it
            # allocates is dropped after that merge.
            main = torch.cuda.current_stream(q.device)
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                o_shared, lse_shared = self.shared.run(**kw)
            o_rest, lse_rest = self.rest.run(**kw)
            main.wait_stream(self.side)
        return self.merge_state(v_a=o_shared, s_a=lse_shared, v_b=o_rest, s_b=lse_rest)[0]


class GraphState:
    """CUDA-graph decode state: per batch-size bucket, wrappers built with ``use_cuda_graph=True``; per
    layer signature, static index buffers sized for the largest bucket. Only one bucket's graph replays
    per step, so every bucket's wrappers of a signature share that signature's buffers (as prefixes)."""

    def __init__(self, max_batch: int, max_pages: int, device: torch.device):
        self.max_batch, self.max_pages, self.device = max_batch, max_pages, device
        self._buffers: dict[LayerSignature, dict[str, torch.Tensor]] = {}
        self._decode: dict[int, dict] = {}  # bucket -> signature -> wrapper
        self._prefill: dict[int, dict] = {}

    def decode(self, bucket) -> dict:
        """A bucket's decode wrappers (cascade rests: key (bucket, "rest", window_left))."""
        return self._decode.setdefault(bucket, {})

    def prefill(self, bucket) -> dict:
        """A bucket's prefill wrappers (cascade shared parts: key (bucket, "shared"))."""
        return self._prefill.setdefault(bucket, {})

    def _shared_of(self, sig: LayerSignature) -> dict[str, torch.Tensor]:
        """A cascade graph's shared part, one request holding every query: its own buffers and int
        workspace, since it is planned in the same step as the rest, which uses the plain ones."""
        buf = self._buffers.get(("shared", sig))
        if buf is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            buf = self._buffers[("shared", sig)] = {
                "qo_indptr": torch.zeros(2, **i32),  # [2]: [0, bucket]
                "kv_indptr": torch.zeros(2, **i32),  # [2]
                "kv_indices": torch.zeros(self.max_pages, **i32),  # [max_pages]
                "last_page_len": torch.ones(1, **i32),  # [1]
            }
        return buf

    def shared_buffers(self, sig: LayerSignature) -> dict:
        b = self._shared_of(sig)
        return dict(use_cuda_graph=True, qo_indptr_buf=b["qo_indptr"], paged_kv_indptr_buf=b["kv_indptr"],
                    paged_kv_indices_buf=b["kv_indices"], paged_kv_last_page_len_buf=b["last_page_len"])

    def _of(self, sig: LayerSignature) -> dict[str, torch.Tensor]:
        buf = self._buffers.get(sig)
        if buf is None:
            n, i32 = self.max_batch, dict(dtype=torch.int32, device=self.device)
            buf = self._buffers[sig] = {
                "qo_indptr": torch.arange(n + 1, **i32),  # [max_batch + 1]: one query per request
                "kv_indptr": torch.zeros(n + 1, **i32),  # [max_batch + 1]
                "kv_indices": torch.zeros(n * self.max_pages, **i32),  # [max_batch x max_pages]
                "last_page_len": torch.ones(n, **i32),  # [max_batch]
            }
        return buf

    def share_int_workspace(self, sig: LayerSignature, wrapper, shared: bool = False) -> None:
        """Give a bucket's wrapper its signature's int workspace (plan info, 8 MiB as FlashInfer allocates):
        a wrapper's own would cost 8 MiB of GPU memory per bucket and signature. Safe for the same reason
        as the index buffers: a replay re-plans its bucket's wrappers first. ``shared``: a cascade
        graph's shared part, which has its own."""
        buf = self._shared_of(sig) if shared else self._of(sig)
        if "int_workspace" not in buf:
            buf["int_workspace"] = torch.empty(8 << 20, dtype=torch.uint8, device=self.device)
        wrapper.reset_workspace_buffer(float_workspace_buffer=workspace(self.device, float_workspace(shared)),
                                       int_workspace_buffer=buf["int_workspace"])

    def decode_buffers(self, sig: LayerSignature, bucket: int) -> dict:
        b = self._of(sig)
        return dict(use_cuda_graph=True, paged_kv_indptr_buffer=b["kv_indptr"][: bucket + 1],
                    paged_kv_indices_buffer=b["kv_indices"],
                    paged_kv_last_page_len_buffer=b["last_page_len"][:bucket])

    def prefill_buffers(self, sig: LayerSignature, bucket: int) -> dict:
        b = self._of(sig)
        return dict(use_cuda_graph=True, qo_indptr_buf=b["qo_indptr"][: bucket + 1],
                    paged_kv_indptr_buf=b["kv_indptr"][: bucket + 1], paged_kv_indices_buf=b["kv_indices"],
                    paged_kv_last_page_len_buf=b["last_page_len"][:bucket])
