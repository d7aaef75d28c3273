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

Graphs captured on demand, while generating: on the ``capture_after``-th step in a row that needs one
(warm-up and capture on that step's data, into the plain graphs' memory pool, then its replay), at most
``max_on_demand_graphs`` of them, keyed (rows, the backend's ``cascade_graph_key`` or None):
- exact sizes: above ``exact_from`` rows the buckets are an eighth of an octave apart, and a step padded to
  its bucket computes up to 12.5% more rows, which cost GEMM FLOPs where a large batch is compute-bound. A
  batch that keeps its size (rounded up to a multiple of ``EXACT_ROUND``, so that sizes a few requests apart
  share one graph; a size ``prune_buckets`` dropped pads to the bucket it chose) gets a graph of that size;
  until then its step replays the bucket's graph.
- cascade decode steps (a shared prefix read once per step), where the decode backend declares
  ``supports_cascade_graph``; a step whose graph is not there runs without one (``cascade_ready``).
Cascade steps' padding rows hold one token after the shared
prefix: the prefix's pages, then the token in page 0. So they are requests of the step like the others
(the shared part serves their queries too, and the split is theirs as well: a padding row's window starts
no later than a real row's), read only pages that hold data, write only page 0, and are dropped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from attnzoo.attention.backends.base import StepPlan
from attnzoo.attention.backends.hybrid import HybridBackend
from attnzoo.attention.layer import ForwardContext
from attnzoo.attention.metadata import BatchMetadata, ForwardMode
from attnzoo.layers import skinny


def _default_buckets(top: int = 4096) -> tuple[int, ...]:
    """1, 2, 4, then steps of 8 to 256 and an eighth of the octave above: 256, 288, ..., 512, 576, ...
    A step runs at its bucket's size, so the padding rows cost GEMM FLOPs wherever the batch is
    compute-bound: at most 12.5% here. Steps of 8 up to 256 give ``prune_buckets`` sizes to choose from where
    cuBLAS's kernel choice varies most with the rows (benchmarks/results/gemm_rows_nvidia_h200.txt)."""
    out, b = [1, 2, 4], 8
    while b <= top:
        out.append(b)
        b += 8 if b < 256 else 1 << (b.bit_length() - 4)
    return tuple(out)


DEFAULT_BUCKETS = _default_buckets()
# A bucket is dropped when the next larger kept one runs the model's GEMMs this much faster (prune_buckets).
PRUNE_MARGIN = 0.03
# ... and only where the GEMMs measured hold this share of the model's weight matrices (dense bf16 models:
# Llama, Gemma; not MoE or FP8 ones, whose experts and FP8 GEMMs prune_buckets does not time).
PRUNE_MIN_SHARE = 0.9


def gemm_shapes(model) -> dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, int, Callable]]:
    """(out, in, dtype) -> (one such weight, how many layers have that shape, the product they run:
    ``skinny.linear`` for ``parallel.Linear`` layers, ``F.linear`` for plain ones) over the dense linear
    layers a decode graph runs (the LM head runs eagerly after the replay; FP8 layers and fused MoE experts
    have kernels of their own and are left out)."""
    from attnzoo.layers.parallel import Linear, ParallelLMHead

    shapes: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, int, Callable]] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not isinstance(m, ParallelLMHead) and m.weight.dtype in (torch.bfloat16, torch.float16):
            key = (*m.weight.shape, m.weight.dtype)
            fn = skinny.linear if isinstance(m, Linear) else F.linear
            shapes[key] = (m.weight, shapes[key][1] + 1 if key in shapes else 1, fn)
    return shapes


def gemm_share(model, shapes: dict) -> float:
    """The share of the model's weight matrices (embeddings and the LM head aside) that ``shapes`` covers:
    where it is small (MoE experts, FP8 layers) the GEMMs measured are not what a step's time follows."""
    from attnzoo.layers.parallel import ParallelLMHead

    skip = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Embedding, ParallelLMHead))}
    total = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in skip)
    return sum(w.numel() * count for w, count, _ in shapes.values()) / max(total, 1)


def prune_buckets(shapes: dict, buckets, device, margin: float = PRUNE_MARGIN, reps: int = 5, rounds: int = 3):
    """(kept buckets, {dropped bucket: the larger bucket it pads to}), from the measured time of the
    model's GEMMs at each bucket's row count, each by the product its layers run (``gemm_shapes``). A step
    runs at its bucket's size, and the kernel choice is not monotone in the rows (a GEMM can be faster at more
    rows; the skinny kernel stops at 16). A bucket is dropped where the next larger kept one (the one its steps
    then pad to) is ``margin`` faster; the largest is always kept (it is ``max_running``)."""
    if not shapes or device.type != "cuda":
        return list(buckets), {}
    return choose_buckets({b: _graph_cost(shapes, b, device, reps, rounds) for b in buckets}, margin)


def _graph_cost(shapes: dict, rows: int, device, reps: int, rounds: int) -> float:
    """ms of the model's GEMMs at ``rows`` rows: each shape's ``reps`` products replayed from a CUDA graph, as
    a decode step launches them (timed eagerly, the host's launch cost of a small GEMM outweighs the GPU's,
    and at 1 against 2 rows that noise alone crossed the margin), the least of ``rounds`` replays. A weight
    that fits in L2 is read from there after the first product, at every row count alike: the costs are
    compared with each other, never with a step's time. One shape's graph at a time: the memory held is one
    input and one output, as in an eager step."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    total = 0.0
    for w, count, fn in shapes.values():
        x = torch.randn(rows, w.shape[1], device=device, dtype=w.dtype)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(x, w)  # the kernel choice, its compile and first launch, outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn(x, w)
        best = float("inf")
        for _ in range(rounds):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / reps)
        del graph  # its pool goes back before the next shape's capture
        total += best * count
    return total


def choose_buckets(cost: dict[int, float], margin: float = PRUNE_MARGIN) -> tuple[list[int], dict[int, int]]:
    """``prune_buckets``' rule over measured costs {bucket: time}: from the largest down, a bucket is dropped
    where the next bucket up is kept and costs less than (1 - margin) x its own. So a step pads by one
    bucket at most: the rest of its work (attention, norms) grows with the rows the GEMMs measured here
    do not see, and near-equal small GEMMs (launch-bound, noisy) must not pull a batch far up."""
    order = sorted(cost)
    dropped: dict[int, int] = {}
    for b, up in reversed(list(zip(order, order[1:]))):
        if up not in dropped and cost[up] < (1 - margin) * cost[b]:
            dropped[b] = up
    return [b for b in order if b not in dropped], dict(sorted(dropped.items()))


# Graphs captured while generating (each costs a warm-up step and a capture once): the cap bounds that time
# and the graph pool's growth. A workload with one few-shot prefix needs the sizes its batch passes through
# times the window_left values of its sliding layers (fi_common.CASCADE_GRAPH_GAP_STEPS).
DEFAULT_MAX_ON_DEMAND_GRAPHS = 48
# Their outputs ([rows, hidden] each) stay in the graph pool: bounded here, inside the memory the KV cache
# sizing leaves beside a step (engine.memory.HEADROOM), or 48 exact-size graphs of thousands of rows would not be.
DEFAULT_MAX_ON_DEMAND_BYTES = 256 << 20
# Above this many rows a batch that keeps its size gets a graph of its own size: padding to the bucket costs GEMM
# rows where a large batch is compute-bound (benchmarks/results/e2e_exact_graphs_nvidia_h100.json).
EXACT_FROM = 256
EXACT_ROUND = 8


class DecodeGraphs:
    def __init__(self, model, pool, backends: HybridBackend, *, max_batch: int, max_context: int,
                 buckets=DEFAULT_BUCKETS, max_on_demand_graphs: int = DEFAULT_MAX_ON_DEMAND_GRAPHS,
                 capture_after: int = 3, prune: bool = True, exact_from: int = EXACT_FROM,
                 max_on_demand_bytes: int = DEFAULT_MAX_ON_DEMAND_BYTES):
        self.model, self.pool, self.backends = model, pool, backends
        dev, ps = pool.device, pool.page_size
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        # {dropped bucket: the bucket its steps pad to instead}, measured (prune_buckets); tensor-parallel
        # ranks must replay the same sizes, so they pass prune=False rather than each measure their own.
        self.pruned: dict[int, int] = {}
        shapes = gemm_shapes(model) if prune and pool.device.type == "cuda" else {}
        if shapes and gemm_share(model, shapes) >= PRUNE_MIN_SHARE:
            self.buckets, self.pruned = prune_buckets(shapes, self.buckets, pool.device)
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
        self.cascade = backends.supports_cascade_graph
        self.max_on_demand_graphs = max_on_demand_graphs
        self.max_on_demand_bytes = max_on_demand_bytes
        self.exact_from = exact_from
        # (rows, the backend's cascade key or None for a plain step) -> graph, and its static output [rows, hidden]
        self.on_demand: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.on_demand_hidden: dict[tuple, torch.Tensor] = {}
        self._last_key: tuple[BatchMetadata | None, tuple | None] = (None, None)  # the last step's key, by identity
        # An on-demand graph is captured on the ``capture_after``-th step in a row that asks for it: a
        # capture costs a warm-up step and the capture, wasted on a size that a shrinking batch (a wave's
        # requests finishing) passes through in a step or two; the steps before run as if over the cap
        # (results: e2e_llama8b_ca{1,3}).
        self.capture_after = capture_after
        # (the last key asked for, how many steps in a row), for plain and for cascade steps apart: every
        # tensor-parallel rank stages the same plain steps, but only the leader asks cascade_ready
        self._streak: dict[bool, tuple[tuple | None, int]] = {True: (None, 0), False: (None, 0)}
        self.capture_s = 0.0  # host time spent capturing on-demand graphs (warm-up included)
        self._mempool = None
        backends.init_graph_state(self.max_batch, self.max_pages)
        self._capture_all()

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _rows(self, n: int) -> int:
        """The rows of the graph that serves an n-row step once captured: above ``exact_from``, n rounded up to a
        multiple of EXACT_ROUND (at most max_batch), or the bucket ``prune_buckets`` padded that size to."""
        if n <= self.exact_from:
            return self._bucket(n)
        rows = min(-(-n // EXACT_ROUND) * EXACT_ROUND, self.max_batch)
        return self.pruned.get(rows, rows)

    def _meta(self, bs: int, seq_lens_cpu: list[int] | None = None, shared_prefix_len: int = 0) -> BatchMetadata:
        """The bucket's metadata over the static buffers. Host lists: the step's, padded to the bucket
        (padding rows: one token in page 0, after the shared prefix in a cascade step); at capture (None)
        the worst case, every row at max_context."""
        pad = shared_prefix_len + 1
        return BatchMetadata(
            mode=ForwardMode.DECODE, page_size=self.pool.page_size,
            positions=self.positions[:bs], slot_mapping=self.slots[:bs], q_indptr=self.q_indptr[: bs + 1],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.prefix_lens[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens_cpu=[self.max_context] * bs if seq_lens_cpu is None else list(seq_lens_cpu) + [pad] * (bs - len(seq_lens_cpu)),
            q_lens_cpu=[1] * bs, last_token_rows=self.rows[:bs], shared_prefix_len=shared_prefix_len,
            window_block_tables=None if self.window_tables is None else self.window_tables[:bs],
            window_slot_mapping=None if self.window_slots is None else self.window_slots[:bs],
        )

    def _run(self, meta: BatchMetadata, plan: StepPlan) -> torch.Tensor:
        bs = meta.num_reqs
        ctx = ForwardContext(meta, self.pool, self.backends.prefill_backend, self.backends.decode_backend, plan)
        return self.model(self.ids[:bs], self.positions[:bs], ctx)

    def _capture(self, meta: BatchMetadata, plan: StepPlan) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up, then capture one step into the shared pool: (graph, its static output)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run(meta, plan)  # warm-up: kernels compile, allocator settles
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            hidden = self._run(meta, plan)
        return graph, hidden

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._mempool = torch.cuda.graph_pool_handle()
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
            self.graphs[bs], self.hidden[bs] = self._capture(meta, plan)
        torch.cuda.synchronize()
        out = self.hidden[self.buckets[0]]
        self.row_bytes = out[0].numel() * out.element_size()  # an output row's, on-demand graphs' too

    def fits(self, meta: BatchMetadata) -> bool:
        return meta.is_decode and meta.num_reqs <= self.max_batch and meta.max_seq_len <= self.max_context

    def graph_key(self, meta: BatchMetadata) -> tuple:
        """(rows, the backend's cascade_graph_key, or None for a plain step) of a decode step. The cascade key
        is taken over the real rows: padding rows (one token after the prefix) end no later than any real row,
        so they move no window split (``fi_common.cascade_split``: the shared segment starts after the longest
        request's window start), and the backend's plan over the padded rows makes the split this key names."""
        if self._last_key[0] is not meta:  # the engine asks before the replay does: compute it once a step
            cascade = self.backends.cascade_graph_key(meta) if meta.shared_prefix_len else None
            self._last_key = (meta, (self._rows(meta.num_reqs), cascade))
        return self._last_key[1]

    @property
    def on_demand_bytes(self) -> int:
        """The bytes of the on-demand graphs' outputs."""
        return sum(t.numel() * t.element_size() for t in self.on_demand_hidden.values())

    def room_for(self, rows: int) -> bool:
        """Whether one more on-demand graph of ``rows`` rows is within the caps: their number and their outputs'
        bytes. Both are the same on every tensor-parallel rank, so the ranks capture the same graphs."""
        return (len(self.on_demand) < self.max_on_demand_graphs
                and self.on_demand_bytes + rows * self.row_bytes <= self.max_on_demand_bytes)

    @property
    def at_cap(self) -> bool:
        """No on-demand graph of the last step's size fits the caps any more."""
        key = self._last_key[1]
        return not self.room_for(key[0] if key is not None else 0)

    def _wanted(self, key: tuple) -> bool:
        """Whether an on-demand graph serves this step (captured, or captured by its replay); counts the streak."""
        plain = key[1] is None
        last, n = self._streak[plain]
        self._streak[plain] = (key, n + 1 if key == last else 1)
        return key in self.on_demand or (self.room_for(key[0]) and self._streak[plain][1] >= self.capture_after)

    def cascade_ready(self, meta: BatchMetadata) -> bool | None:
        """For a decode step with ``shared_prefix_len`` > 0: True where a cascade graph replays it (captured,
        or captured by this replay), False where none does this step (the cap on their number, or the key
        has not been asked for ``capture_after`` steps in a row), None where none can (the backend captures
        no cascade steps, or the step does not fit the graphs). Called once per prepared step."""
        if not (self.cascade and meta.shared_prefix_len and self.fits(meta)):
            return None
        return self._wanted(self.graph_key(meta))

    def replay(self, ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """Final hidden states [num_reqs, hidden] for a decode step that ``fits`` (and, with
        ``shared_prefix_len`` > 0, is ``cascade_ready``)."""
        return self.launch(self.stage(meta), ids)

    def stage(self, meta: BatchMetadata) -> "Staged":
        """Everything a replay needs but the input ids: the step's metadata into the static buffers and the
        backend's plan into its static state. Stream-ordered after the work already queued, so the engine
        may stage step N+1 while step N's graph still runs (``Engine.overlap``)."""
        n, shared = meta.num_reqs, meta.shared_prefix_len
        key = self.graph_key(meta)
        if not shared and (key[0] in self.graphs or not self._wanted(key)):
            key = None  # the bucket's plain graph
        bs = self._bucket(n) if key is None else key[0]
        width = meta.block_tables.shape[1]
        self.positions[:n].copy_(meta.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.prefix_lens[:n].copy_(meta.prefix_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        # padding rows: one token at position `shared` (0 outside cascade steps) in page 0, after the shared
        # prefix's pages in a cascade step
        self.ids[n:bs].zero_()
        self.positions[n:bs].fill_(shared)
        self.slots[n:bs].zero_()
        self.seq_lens[n:bs].fill_(shared + 1)
        self.prefix_lens[n:bs].fill_(shared)
        self.block_tables[n:bs].zero_()
        if self.window_tables is not None:
            self.window_tables[:n, : meta.window_block_tables.shape[1]].copy_(meta.window_block_tables)
            self.window_slots[:n].copy_(meta.window_slot_mapping)
            self.window_tables[n:bs].zero_()
            self.window_slots[n:bs].zero_()
        if shared and bs > n:
            sp = shared // self.pool.page_size
            self.block_tables[n:bs, :sp].copy_(meta.block_tables[:1, :sp].expand(bs - n, sp))
            if self.window_tables is not None:  # row 0's live window columns; the released ones read page 0
                self.window_tables[n:bs, :sp].copy_(meta.window_block_tables[:1, :sp].expand(bs - n, sp))
        step = self._meta(bs, meta.seq_lens_cpu, shared)
        graph = self.graphs[bs] if key is None else self.on_demand.get(key)
        # refill the backend's static state (the graph reads it, not the returned plan); host-planned
        # backends read the step's lengths
        plan = self.backends.prepare_graph(step, capturing=graph is None)
        return Staged(n, bs, key, graph, step, plan)

    def launch(self, staged: "Staged", ids: torch.Tensor) -> torch.Tensor:
        """Replay a staged step with its input ids [num_reqs] (on the GPU)."""
        n = staged.num_reqs
        self.ids[:n].copy_(ids)
        if staged.key is None:
            staged.graph.replay()
            return self.hidden[staged.bucket][:n]
        if staged.graph is None:
            # The warm-up runs this very step (its KV stores write this step's k/v, which the replay writes
            # again, the same); the capture itself runs nothing.
            t0 = time.perf_counter()
            staged.graph, out = self._capture(staged.meta, staged.plan)
            self.on_demand[staged.key], self.on_demand_hidden[staged.key] = staged.graph, out
            torch.cuda.synchronize()
            self.capture_s += time.perf_counter() - t0
        staged.graph.replay()
        return self.on_demand_hidden[staged.key][:n]


@dataclass
class Staged:
    """A decode step staged for replay (``DecodeGraphs.stage``)."""

    num_reqs: int
    bucket: int
    key: tuple | None  # the on-demand graph's key (graph_key); None: the bucket's plain graph
    graph: torch.cuda.CUDAGraph | None  # None: an on-demand graph to capture at launch
    meta: BatchMetadata  # over the static buffers, padded to the bucket
    plan: StepPlan
