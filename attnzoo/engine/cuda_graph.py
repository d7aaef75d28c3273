"""CUDA-graph capture of the decode step, per batch-size bucket, for backends that declare support.

A decode step's host work (Python per layer, kernel launches) costs more than its GPU work at small
batches. Captured once per bucket, a step becomes: copy this step's metadata into static buffers, replay.
Rows past the real batch are padding: they point at page 0 (never handed out), so their KV writes land
where nobody reads, and their hidden states are dropped. The graph ends at the final hidden states: the
LM head runs eagerly on the sampled rows (one launch), so no bucket keeps a [bucket, vocab] float32
output alive in the graph pool (2.6 GB over the buckets up to 1024 at a 128k vocabulary).

The graphs are sized for contexts up to ``max_context`` tokens and batches up to ``max_batch`` (the
engine's max_running, always a bucket); a decode step with a longer request runs eagerly
(``DecodeGraphs.fits`` decides, and the engine counts those steps in ``Engine.graph_stats``).
"""
from __future__ import annotations


import torch

from attnzoo.attention.backends.base import StepPlan
from attnzoo.attention.backends.hybrid import HybridBackend
from attnzoo.attention.layer import ForwardContext
from attnzoo.attention.metadata import BatchMetadata, ForwardMode

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024,
                   1280, 1536, 2048, 2560, 3072, 4096)


class DecodeGraphs:
    def __init__(self, model, pool, backends: HybridBackend, *, max_batch: int, max_context: int,
                 buckets=DEFAULT_BUCKETS):
        self.model, self.pool, self.backends = model, pool, backends
        dev, ps = pool.device, pool.page_size
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        self.max_batch = self.buckets[-1]
        self.max_pages = -(-max_context // ps)
        self.max_context = self.max_pages * ps
        n = self.max_batch
        # Static inputs: every replay reads these addresses.
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_batch]
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_batch]
        self.slots = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_batch]: padding writes page 0
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)  # [max_batch]
        self.prefix_lens = torch.zeros(n, dtype=torch.int32, device=dev)  # [max_batch]
        self.block_tables = torch.zeros(n, self.max_pages, dtype=torch.int32, device=dev)  # [max_batch, max_pages]
        # A pool with a window page group: that group's table and slots (BatchMetadata.window_*), else None.
        window = pool.has_window_group
        self.window_tables = torch.zeros_like(self.block_tables) if window else None  # [max_batch, max_pages]
        self.window_slots = torch.zeros_like(self.slots) if window else None  # [max_batch]
        self.q_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)  # [max_batch + 1]
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)  # [max_batch]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # bucket -> static output [bucket, hidden]
        self.metas: dict[int, BatchMetadata] = {}  # bucket -> the capture's metadata over the static buffers
        self.plans: dict[int, StepPlan] = {}  # bucket -> the capture's plan (its tensors: the backend's static ones)
        backends.init_graph_state(self.max_batch, self.max_pages)
        self._capture_all()

    def _meta(self, bs: int, seq_lens_cpu: list[int] | None = None) -> BatchMetadata:
        """The bucket's metadata over the static buffers. Host lists: the step's, padded to the bucket
        (padding rows: one token in page 0); at capture (None) the worst case, every row at max_context."""
        return BatchMetadata(
            mode=ForwardMode.DECODE, page_size=self.pool.page_size,
            positions=self.positions[:bs], slot_mapping=self.slots[:bs], q_indptr=self.q_indptr[: bs + 1],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.prefix_lens[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens_cpu=[self.max_context] * bs if seq_lens_cpu is None else list(seq_lens_cpu) + [1] * (bs - len(seq_lens_cpu)),
            q_lens_cpu=[1] * bs, last_token_rows=self.rows[:bs],
            window_block_tables=None if self.window_tables is None else self.window_tables[:bs],
            window_slot_mapping=None if self.window_slots is None else self.window_slots[:bs],
        )

    def _run(self, meta: BatchMetadata, plan: StepPlan) -> torch.Tensor:
        bs = meta.num_reqs
        ctx = ForwardContext(meta, self.pool, self.backends.prefill_backend, self.backends.decode_backend, plan)
        return self.model(self.ids[:bs], self.positions[:bs], ctx)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # The capture's host lists say every row holds max_context tokens (_meta): the device lengths must
        # agree, or a backend that sizes page lists from the host and fills them from the device (FlashInfer's
        # kv_indices) leaves entries unwritten, which the eager warm-up then reads as page ids. The block
        # tables are all page 0 here, so every row reads page 0.
        self.seq_lens.fill_(self.max_context)
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            meta = self.metas[bs] = self._meta(bs)
            # The backend's per-step preparation runs eagerly, outside the graph, before capture and
            # before every replay (the contract of AttentionBackend.prepare_graph).
            plan = self.plans[bs] = self.backends.prepare_graph(meta, capturing=True)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run(meta, plan)  # warm-up: kernels compile, allocator settles
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[bs] = self._run(meta, plan)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def fits(self, meta: BatchMetadata) -> bool:
        return meta.is_decode and meta.num_reqs <= self.max_batch and meta.max_seq_len <= self.max_context

    def replay(self, ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """Final hidden states [num_reqs, hidden] for a decode step that ``fits``."""
        n = meta.num_reqs
        bs = next(b for b in self.buckets if b >= n)
        width = meta.block_tables.shape[1]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(meta.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.prefix_lens[:n].copy_(meta.prefix_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        # padding rows: one token at position 0 in page 0
        self.ids[n:bs].zero_()
        self.positions[n:bs].zero_()
        self.slots[n:bs].zero_()
        self.seq_lens[n:bs].fill_(1)
        self.prefix_lens[n:bs].zero_()
        self.block_tables[n:bs].zero_()
        if self.window_tables is not None:
            self.window_tables[:n, : meta.window_block_tables.shape[1]].copy_(meta.window_block_tables)
            self.window_slots[:n].copy_(meta.window_slot_mapping)
            self.window_tables[n:bs].zero_()
            self.window_slots[n:bs].zero_()
        # refill the backend's static state (the graph reads it, not the returned plan); host-planned
        # backends read the step's lengths
        self.backends.prepare_graph(self._meta(bs, meta.seq_lens_cpu), capturing=False)
        self.graphs[bs].replay()
        return self.hidden[bs][:n]
