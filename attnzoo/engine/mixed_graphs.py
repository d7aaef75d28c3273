"""Whole mixed steps as CUDA graphs: a server's steps (decode rows beside prompt chunks) of up to ``max_tokens``
tokens, attention included, replayed from one graph per token bucket.

Piecewise graphs (``engine.piecewise``) leave attention eager between their pieces, and a mixed step of a few
hundred tokens then spends longer launching its attention than the GPU spends on it (tens of microseconds of host
per Triton launch, several a layer: benchmarks/results/host_launch_nvidia_h200.txt). Where both backends declare
``captures_mixed_steps``, the attention is captured too, over static metadata whose shape follows the bucket only:

- tokens: the step's rows in its own order (its decode rows first, as the scheduler puts them, then its chunks),
  padded to the bucket; padding rows store into page 0 (never handed out) and are dropped.
- the decode part runs over every row of the bucket: a decode row over its pages, any other row with length 0 (its
  programs read no key, and write 0). The extend part then runs over ``max_chunks`` request slots whose
  ``q_indptr`` indexes the same rows (an empty slot has none) and writes the chunks' rows over the decode part's
  output (``hybrid.MixedStepPlan``).
- the launch constants (the decode's KV splits, the extend's grid) follow from the bucket and ``max_context``,
  never from the step: the plans made at capture serve every replay.

A step fits when no prefix is shared (cascade reads it in its own way), it has at most ``max_chunks`` chunks and
every request is within ``max_context``; others run as pieces. ``emulate=True`` runs the same padded steps without
graphs (what the CPU tests check).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from attnzoo.attention.backends.hybrid import HybridBackend, MixedStepPlan
from attnzoo.attention.layer import ForwardContext
from attnzoo.attention.metadata import BatchMetadata, ForwardMode

# Chunk slots of a captured step. An empty slot's extend programs return at once; a step with more chunks (many
# short prompts after a cached prefix) runs as pieces.
MAX_CHUNKS = 16


@dataclass
class MixedStaged:
    """A mixed step staged for replay (``MixedGraphs.stage``): its token count and bucket."""

    num_tokens: int
    bucket: int


class MixedGraphs:
    def __init__(self, model, pool, backends: HybridBackend, *, buckets, max_context: int,
                 max_chunks: int | None = None, mempool=None, emulate: bool = False):
        self.model, self.pool, self.backends = model, pool, backends
        self.buckets = sorted(buckets)
        self.max_tokens = self.buckets[-1]
        ps = pool.page_size
        self.max_pages = -(-max_context // ps)
        self.max_context = self.max_pages * ps
        self.max_chunks = MAX_CHUNKS if max_chunks is None else max_chunks
        self.emulate = emulate
        dev, n, e, p = pool.device, self.max_tokens, self.max_chunks, self.max_pages
        window = pool.has_window_group

        def i32(*shape, fill=0):
            return torch.full(shape, fill, dtype=torch.int32, device=dev)

        # Static inputs, shared by every bucket (a bucket reads their first rows).
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_tokens]
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_tokens]
        self.slots = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_tokens]: padding writes page 0
        self.window_slots = torch.zeros_like(self.slots) if window else None  # [max_tokens]
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)  # [max_tokens]
        # the decode part: one request per row
        self.dec_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)  # [max_tokens + 1]
        self.dec_seq_lens, self.dec_prefix = i32(n), i32(n)  # [max_tokens] each
        self.dec_tables = i32(n, p)  # [max_tokens, max_pages]
        self.dec_window = i32(n, p) if window else None  # [max_tokens, max_pages]
        # the extend part: max_chunks request slots over the same rows
        self.ext_indptr = i32(e + 1)  # [max_chunks + 1]: offsets into the step's rows
        self.ext_prefix, self.ext_seq_lens = i32(e), i32(e)  # [max_chunks] each
        self.ext_tables = i32(e, p)  # [max_chunks, max_pages]
        self.ext_window = i32(e, p) if window else None  # [max_chunks, max_pages]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # bucket -> the graph's output [bucket, hidden]
        self.steps: dict[int, tuple[BatchMetadata, MixedStepPlan]] = {}  # bucket -> its metadata and plans
        self._mempool = mempool
        self.capture_s = 0.0
        if not emulate:
            t0 = time.perf_counter()
            self._capture_all()
            self.capture_s = time.perf_counter() - t0

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def fits(self, meta: BatchMetadata) -> bool:
        if meta.is_decode or meta.shared_prefix_len or meta.num_tokens > self.max_tokens:
            return False
        # a table may be wider than max_pages (a prompt's pages are held from admission): stage reads only the
        # columns its rows' lengths reach
        return meta.max_seq_len <= self.max_context and meta.num_reqs - meta.leading_decode_rows() <= self.max_chunks

    def _step(self, bs: int) -> tuple[BatchMetadata, MixedStepPlan]:
        """The bucket's metadata over the static buffers (the extend part's, which the layers' stores read too)
        and its plan. Host lists: the worst case (every row at max_context, one chunk as long as the bucket), so
        the launch constants depend on the bucket alone."""
        if bs in self.steps:
            return self.steps[bs]
        ps, e = self.pool.page_size, self.max_chunks
        window = self.window_slots is not None
        shared = dict(page_size=ps, positions=self.positions[:bs], slot_mapping=self.slots[:bs],
                      window_slot_mapping=self.window_slots[:bs] if window else None)
        dec = BatchMetadata(mode=ForwardMode.DECODE, q_indptr=self.dec_indptr[: bs + 1],
                            seq_lens=self.dec_seq_lens[:bs], prefix_lens=self.dec_prefix[:bs],
                            block_tables=self.dec_tables[:bs], seq_lens_cpu=[self.max_context] * bs,
                            q_lens_cpu=[1] * bs, last_token_rows=self.rows[:bs],
                            window_block_tables=self.dec_window[:bs] if window else None, **shared)
        ext = BatchMetadata(mode=ForwardMode.EXTEND, q_indptr=self.ext_indptr, seq_lens=self.ext_seq_lens,
                            prefix_lens=self.ext_prefix, block_tables=self.ext_tables,
                            seq_lens_cpu=[self.max_context] * e, q_lens_cpu=[bs] + [0] * (e - 1),
                            last_token_rows=self.rows[:e], window_block_tables=self.ext_window, **shared)
        b = self.backends
        plan = MixedStepPlan(dec, b.decode_backend.prepare_graph(dec, capturing=True), ext,
                             b.prefill_backend.prepare(ext))
        self.steps[bs] = (ext, plan)
        return self.steps[bs]

    def _run(self, bs: int) -> torch.Tensor:
        meta, plan = self._step(bs)
        b = self.backends
        ctx = ForwardContext(meta, self.pool, b.prefill_backend, b.decode_backend, plan)
        return self.model(self.ids[:bs], self.positions[:bs], ctx)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # largest first: smaller buckets reuse its memory
            # at capture: one chunk of bs tokens from position 0, every key in page 0; no decode rows
            self.positions.zero_()
            self.slots.zero_()
            self.dec_seq_lens.zero_()
            self.ext_indptr.fill_(bs)
            self.ext_indptr[0] = 0
            self.ext_seq_lens.zero_()
            self.ext_seq_lens[0] = bs
            self.ext_prefix.zero_()
            for t in (self.dec_tables, self.dec_window, self.ext_tables, self.ext_window, self.window_slots):
                if t is not None:
                    t.zero_()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run(bs)  # warm-up: kernels compile, the allocator settles
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                self.hidden[bs] = self._run(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def stage(self, meta: BatchMetadata) -> MixedStaged:
        """A step that ``fits`` into the static buffers (stream-ordered after the work already queued, as
        ``DecodeGraphs.stage``)."""
        t, n = meta.num_tokens, meta.leading_decode_rows()
        e, bs = meta.num_reqs - n, self._bucket(t)
        w = min(meta.block_tables.shape[1], self.max_pages)
        self.positions[:t].copy_(meta.positions)
        self.positions[t:bs].zero_()
        self.slots[:t].copy_(meta.slot_mapping)
        self.slots[t:bs].zero_()
        # decode part: the decode rows over their pages, every other row of length 0
        self.dec_seq_lens[:n].copy_(meta.seq_lens[:n])
        self.dec_seq_lens[n:bs].zero_()
        self.dec_tables[:n, :w].copy_(meta.block_tables[:n, :w])
        # extend part: the chunks at their rows of the step; the slots past them empty
        self.ext_indptr[: e + 1].copy_(meta.q_indptr[n:])
        self.ext_indptr[e + 1:].fill_(t)
        self.ext_prefix[:e].copy_(meta.prefix_lens[n:])
        self.ext_seq_lens[:e].copy_(meta.seq_lens[n:])
        self.ext_tables[:e, :w].copy_(meta.block_tables[n:, :w])
        if self.window_slots is not None:
            ww = min(meta.window_block_tables.shape[1], self.max_pages)
            self.window_slots[:t].copy_(meta.window_slot_mapping)
            self.window_slots[t:bs].zero_()
            self.dec_window[:n, :ww].copy_(meta.window_block_tables[:n, :ww])
            self.ext_window[:e, :ww].copy_(meta.window_block_tables[n:, :ww])
        return MixedStaged(t, bs)

    def launch(self, staged: MixedStaged, ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a staged step, given its input ids [tokens] (on the device)."""
        t, bs = staged.num_tokens, staged.bucket
        self.ids[:t].copy_(ids)
        self.ids[t:bs].zero_()
        if self.emulate:
            with torch.inference_mode():
                return self._run(bs)[:t]
        self.graphs[bs].replay()
        return self.hidden[bs][:t]
