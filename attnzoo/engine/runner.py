"""The step runner: one forward pass per ``Step``, split into a host half (metadata, cascade and CUDA-graph
choices, the backend's plan) and a device half (the pass itself), so that the next step's host work can
run while the GPU computes this one (overlap) and a predictable next step can be launched on this step's
sampled tokens before they are read back (early launch; the loop is ``Engine.step``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from attnzoo.attention.backends.hybrid import MIXED_SPLIT_MIN_ROWS, HybridBackend
from attnzoo.attention.kv_cache import KVPool, layer_kind
from attnzoo.attention.layer import ForwardContext, beyond_the_layer
from attnzoo.attention.metadata import BatchMetadata, build_metadata, to_device
from attnzoo.errors import BackendError


@dataclass(frozen=True)
class Fixed:
    """A step's choices made before the runner sees it: by rank 0 of a tensor-parallel group (the other
    ranks follow them rather than choose), or by a caller that runs its steps eagerly without cascade."""

    shared_prefix_len: int
    graph: bool


EAGER = Fixed(shared_prefix_len=0, graph=False)


@dataclass
class Step:
    """One forward pass, in plain host data: what rank 0 of a tensor-parallel group sends the others."""

    prefix_lens: list[int]  # per request: tokens already in the pool
    q_lens: list[int]  # per request: tokens this step adds
    block_tables: list  # per request: its pages (int32 arrays or lists)
    ids: "list[int] | torch.Tensor | None"  # the new tokens, flat; None until known (a prepared step)
    rows: list[int] | None  # flat token rows whose logits are computed; None: every token
    keys: list[int] | None = None  # per request: its key (tensor parallel sends only new pages per key)
    window_block_tables: list | None = None  # per request: its window-group pages (a pool with that group)
    fixed: Fixed | None = None  # None: the runner chooses cascade and graph replay itself
    # keys of requests ended since the last step: the other ranks of a tensor-parallel group drop their tables
    gone: list[int] | None = None

    def wire(self) -> dict:
        """The step as a dict of its fields (shallow), for the tensor-parallel control channel."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Prepared:
    """A step's host half (``Runner.prepare``), ready to launch once its input ids are known."""

    step: Step
    meta: BatchMetadata
    graph: bool  # replayed as a CUDA graph
    staged: object | None  # DecodeGraphs.stage's result for a graph step
    plan: object | None  # the backends' StepPlan for an eager step
    over_cap: bool = False  # a cascade step whose graph the cap on their number refused
    pieces: bool = False  # replayed as piecewise CUDA graphs, attention eager between them
    mixed: bool = False  # replayed whole from a mixed-step graph (``staged``: MixedGraphs.stage's result)


def check_cascade(decode_backend_cls, prefix_caching: bool, cascade: bool | None) -> bool:
    """Whether cascade decode can run; an explicit ``cascade=True`` that cannot is an error."""
    can = bool(prefix_caching and decode_backend_cls.supports_cascade)
    if cascade and not can:
        why = (f"the decode backend {decode_backend_cls.name!r} has no cascade path"
               if not decode_backend_cls.supports_cascade else "prefix caching is off")
        raise BackendError(f"cascade attention needs prefix caching and a decode backend that supports it; {why}",
                           fix="pass cascade=None (automatic) or False, or use decode backend 'flashinfer' or 'triton'")
    return can


# Layer kinds whose decode path reads and writes each row on its own (positions, pages, window): several rows of
# one request are then that request's tokens one after the other. Not compressed ("csa", "hca") or NSA layers:
# their compressor and indexer stores were not shown to hold with several new tokens of one request in a step.
ROW_KINDS = frozenset({"full", "sliding", "mla"})
# Token rows where the decode graphs run and nobody set Engine.graph_extend_tokens: a 64-token chunk after a cached
# 8-shot prefix reached the client in 12 ms as rows, 29-63 ms as an extend step (results/ttft_token_rows_*).
GRAPH_EXTEND_TOKENS = 64
# Each row reads its whole context: rows whose KV reads exceed this many times the weights' bytes stay an extend
# step, which reads the context once (a 64-token turn after a long chat history).
ROW_READS_PER_WEIGHT_BYTE = 2


def as_token_rows(step: Step, page_size: int) -> Step:
    """``step`` with each new token a request of its own: one query row at its position, over its request's
    pages. Every row's key is stored before any row attends (the one store path), so row j of a chunk reads
    the chunk's rows up to j: the extend step's causal attention, computed as a decode step. The flat token
    order, and so ``rows`` and the input ids, are the step's own. A table is cut to the pages the chunk
    reaches: a request holds its whole prompt's pages, which may be wider than the decode graphs' tables."""
    prefix, tables, windows = [], [], []
    for i, (p, q) in enumerate(zip(step.prefix_lens, step.q_lens)):
        cols = -(-(p + q) // page_size)
        prefix += range(p, p + q)
        tables += [step.block_tables[i][:cols]] * q
        if step.window_block_tables is not None:
            windows += [step.window_block_tables[i][:cols]] * q
    return Step(prefix, [1] * len(prefix), tables, step.ids, step.rows,
                window_block_tables=windows if step.window_block_tables is not None else None)


def row_context_tokens(prefix_lens: list[int], q_lens: list[int], window: int | None = None) -> int:
    """The KV tokens a step's chunks (q > 1) read as token rows, a row seeing at most ``window`` of them: a chunk
    of q after p cached tokens, p+1 + ... + p+q. Decode rows (q == 1) read what they would read anyway."""
    total = 0
    for p, q in zip(prefix_lens, q_lens):
        if q > 1:
            total += sum(min(c, window) for c in range(p + 1, p + q + 1)) if window else q * p + q * (q + 1) // 2
    return total


def row_read_bytes(pool: KVPool) -> dict[int | None, int]:
    """KV bytes a row reads per context token, by the window that bounds it (None: the whole context); a
    KV-sharing layer reads its source's entries again."""
    elt = torch.empty((), dtype=pool.kv_dtype).element_size()
    out: dict[int | None, int] = {}
    for s in pool.specs:
        if s is None:
            continue
        src = pool.specs[s.shared_from] if s.shared_from is not None else s
        out[s.sliding_window] = out.get(s.sliding_window, 0) + elt * src.values_per_token()
    return out


def step_weight_bytes(model) -> int:
    """The weights a decode step of one row reads at least: every parameter but the routed experts' (a row
    reads a few) and the embedding tables (a row reads one line; a table tied to the LM head is read whole)."""
    def params(embedding: bool) -> set[int]:
        return {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) == embedding
                for p in m.parameters(recurse=False)}
    skip = params(True) - params(False)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".experts." not in n and id(p) not in skip)


def last_rows(q_lens: list[int], reqs: list[int]) -> list[int]:
    """The flat row of the last new token of each request of ``reqs`` (indices into ``q_lens``)."""
    ends = np.cumsum(q_lens) - 1
    return ends[reqs].tolist()


class Runner:
    def __init__(self, model, pool: KVPool, backends: HybridBackend, *, prefix_caching: bool, cascade: bool | None,
                 cascade_min_saved_tokens: int, max_rows: int):
        self.max_rows = max_rows  # the most rows a step samples (the host token buffer's size)
        self.model, self.pool, self.backends = model, pool, backends
        self.device = pool.device
        backends.mixed_refused = beyond_the_layer(model, pool)  # a mixed step's decode rows on the decode backend
        if backends.mixed_refused is None:
            backends.mixed_min_rows = MIXED_SPLIT_MIN_ROWS
        # Cascade decode (the shared prefix read once per step) needs shared pages and a backend that
        # reads them once. Saved KV reads per layer: shared tokens x (requests - 1). A cascade step that
        # runs eagerly gives up what a plain graph replay saves (the launches), so it is used only from
        # ``cascade_min_saved_tokens``. Where the decode backend captures cascade steps too
        # (``supports_cascade_graph``), a replayed cascade step costs the host what a plain replay does:
        # only the GPU trade-off is left (two small kernels per layer against the reads saved), hence
        # the lower ``cascade_graph_min_saved_tokens``.
        can = check_cascade(type(backends.decode_backend), prefix_caching, cascade)
        self.cascade = can if cascade is None else cascade
        # Extend steps too (prompt chunks after a cached few-shot prefix, beside decode rows), where the
        # prefill backend can: there every request re-reads the prefix, however few queries it brings.
        self.cascade_extend = cascade is not False and prefix_caching and backends.prefill_backend.supports_cascade_extend
        self.cascade_min_saved_tokens = cascade_min_saved_tokens
        self.cascade_graph_min_saved_tokens = 8192
        self.graphs = None  # DecodeGraphs, set by enable_cuda_graphs()
        self.pieces = None  # PiecewiseGraphs, set by enable_piecewise_graphs(): the steps the decode graphs do not serve
        # MixedGraphs, set with the pieces where the backends capture mixed steps whole (attention included), and
        # why not where they do not
        self.mixed = None
        self.mixed_why: str | None = "no piecewise CUDA graphs (piecewise_graph_tokens=0)"
        # replayed: plain decode graphs; eager: decode/sampling steps run eagerly, of which cascade: with a
        # shared prefix; cascade_replayed: cascade decode graphs; cascade_over_cap: cascade steps whose graph
        # was not captured for the cap on their number (those ran eagerly or as plain graphs)
        # piecewise: steps replayed as piecewise graphs (eager attention between them), not counted as eager;
        # mixed: steps the piecewise graphs would serve replayed whole from a mixed-step graph instead
        self.graph_stats = {"replayed": 0, "eager": 0, "cascade": 0, "cascade_replayed": 0, "cascade_over_cap": 0,
                            "token_rows": 0, "piecewise": 0, "mixed": 0}
        # A step of prompt chunks with at most this many new tokens in all runs as decode rows, one per token
        # (``as_token_rows``), in the decode graphs where they fit: an extend step runs eagerly, and with few
        # tokens its launches outlast its GPU work. Each row reads its whole context, so the reads grow with
        # the rows; 0: never; None: GRAPH_EXTEND_TOKENS with decode graphs, else 0. (graph_stats["token_rows"].)
        self.graph_extend_tokens: int | None = None
        self._rows_fit = all(layer_kind(s) in ROW_KINDS for s in pool.specs if s is not None)
        self._row_read_bytes = row_read_bytes(pool)
        self._row_reads_cap = ROW_READS_PER_WEIGHT_BYTE * step_weight_bytes(model)
        self.tp = None  # TPGroup (attnzoo.engine.tensor_parallel): rank 0 publishes each step to the others
        self._host_tokens: torch.Tensor | None = None  # pinned int64: each step's sampled tokens
        self.gone: list[int] = []  # keys of requests ended since the last step (the scheduler appends)

    def enable_cuda_graphs(self, max_batch: int, max_context: int, batch_sizes=None, prune: bool = True) -> None:
        from attnzoo.engine.cuda_graph import DEFAULT_BUCKETS, DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.pool, self.backends, max_batch=max_batch, max_context=max_context,
                                   buckets=DEFAULT_BUCKETS if batch_sizes is None else batch_sizes, prune=prune)
        if self.mixed is not None:  # their decode part's scratch went with the backend's graph state
            self.mixed = None
            self.mixed_why = "the decode graphs were captured again since: enable_piecewise_graphs again"

    def enable_piecewise_graphs(self, max_tokens: int, buckets=None, emulate: bool = False, *, whole: bool = True,
                                max_context: int | None = None) -> None:
        """Capture piecewise graphs (``engine.piecewise``) for steps of up to ``max_tokens`` tokens that the decode
        graphs do not serve, and where the backends allow (``whole``), mixed-step graphs of the same buckets with
        the attention inside (``engine.mixed_graphs``), which serve the steps they fit in the pieces' place;
        ``emulate``: the same steps without graphs (CPU tests). ``max_context``: the mixed graphs' longest request
        where there are no decode graphs to take it from."""
        from attnzoo.engine.mixed_graphs import MixedGraphs
        from attnzoo.engine.piecewise import PiecewiseGraphs

        if self.tp is not None:  # the ranks replay the leader's steps as they are
            raise BackendError("piecewise CUDA graphs are not supported under tensor parallelism",
                               fix="leave piecewise_graph_tokens at 0, or load with tensor_parallel_size=1")
        if not emulate and self.device.type != "cuda":
            raise BackendError(f"piecewise CUDA graphs need a CUDA device, the model is on {self.device}",
                               fix="leave piecewise_graph_tokens at 0 off CUDA")
        if max_tokens < 1:
            raise BackendError(f"piecewise_graph_tokens must be positive, got {max_tokens}",
                               fix="pass the most tokens a captured step may hold, e.g. 512, or 0 for none")
        self.pieces = PiecewiseGraphs(self.model, self.pool, self.backends, max_tokens=max_tokens, buckets=buckets,
                                      emulate=emulate)
        self.mixed, self.mixed_why = None, self.backends.mixed_capture()
        if not whole:
            self.mixed_why = "off (whole=False)"
        elif self.mixed_why is None and self.graphs is None and not emulate:
            self.mixed_why = "no decode CUDA graphs (the decode part's launch constants come from their state)"
        if self.mixed_why is not None:
            return
        if self.graphs is None:  # emulated: the decode backend's graph state is the mixed graphs' alone
            max_context = max_context or self.pool.page_size * 64
            self.backends.init_graph_state(self.pieces.max_tokens, -(-max_context // self.pool.page_size))
        self.mixed_why = "their capture failed"  # until it succeeds: an error below leaves no graphs and this reason
        self.mixed = MixedGraphs(self.model, self.pool, self.backends, buckets=self.pieces.buckets,
                                 max_context=self.graphs.max_context if self.graphs is not None else max_context,
                                 mempool=self.pieces.mempool, emulate=emulate)
        self.mixed_why = None

    def run(self, step: Step) -> tuple[torch.Tensor, int]:
        """One forward pass -> (logits of rows ``step.rows``, the shared prefix length cascade read)."""
        return self.launch(self.prepare(step), step.ids)

    @torch.inference_mode()
    def prepare(self, step: Step) -> Prepared:
        """The host half of ``run`` (everything but ``step.ids``): metadata, the cascade and graph choices,
        the backend's plan, and for a graph step its staging (``DecodeGraphs.stage``). Its device copies are
        stream-ordered behind the work already queued, so step N+1 may be prepared while step N runs."""
        fixed = step.fixed
        if (rows := self._token_rows(step)) is not None:
            return rows
        meta = build_metadata(
            prefix_lens=step.prefix_lens, q_lens=step.q_lens, block_tables=step.block_tables,
            page_size=self.pool.page_size, device=self.device,
            detect_shared_prefix=(self.cascade or self.cascade_extend) and fixed is None,
            window_block_tables=step.window_block_tables,
        )
        cascade_graph = over_cap = False  # a cascade step a CUDA graph serves; one the cap on them refused
        if fixed is not None:
            meta.shared_prefix_len = fixed.shared_prefix_len
        elif meta.shared_prefix_len:
            on = self.cascade if meta.is_decode else self.cascade_extend
            saved = meta.shared_prefix_len * (meta.num_reqs - 1)
            if on and self.graphs is not None and saved >= self.cascade_graph_min_saved_tokens:
                ready = self.graphs.cascade_ready(meta)
                cascade_graph = bool(ready)
                over_cap = ready is False and self.graphs.at_cap
            if not on or (not cascade_graph and saved < self.cascade_min_saved_tokens):
                meta.shared_prefix_len = 0
        graph = fixed.graph if fixed is not None else (
            self.graphs is not None and self.graphs.fits(meta) and (cascade_graph or not meta.shared_prefix_len))
        pieces = not graph and self.pieces is not None and self.pieces.fits(meta)
        mixed = pieces and self.mixed is not None and self.mixed.fits(meta)
        staged = self.graphs.stage(meta) if graph else self.mixed.stage(meta) if mixed else None
        plan = None if graph or mixed else self.backends.prepare(meta)
        return Prepared(step, meta, graph, staged, plan, over_cap, pieces and not mixed, mixed)

    def token_rows_limit(self) -> tuple[int, str]:
        """(the most new tokens a step of prompt chunks may bring to run as token rows, why; 0: never)."""
        asked = self.graph_extend_tokens
        if asked == 0:
            return 0, "off (graph_extend_tokens=0)"
        if self.tp is not None:
            return 0, "not under tensor parallelism (the ranks replay the leader's steps as they are)"
        if not self._rows_fit:
            return 0, "the model has NSA or compressed layers, whose stores take one new token per request"
        if self.graphs is None:  # eager rows cost the extend step's launches and more reads: CPU tests only
            if asked is not None and self.device.type == "cpu":
                return asked, f"graph_extend_tokens={asked}, eager on a CPU (no decode graphs)"
            return 0, "no decode CUDA graphs to replay the rows in"
        n = GRAPH_EXTEND_TOKENS if asked is None else asked
        # past exact_from a step would feed the capture streaks of decode batches of its size
        top = min(self.graphs.exact_from, self.graphs.max_batch)
        if n > top:
            return top, f"graph_extend_tokens={n}, cut to the {top} rows of the largest decode graph bucket it may use"
        return n, ("the default where the decode graphs run" if asked is None else f"graph_extend_tokens={n}") + \
            f", while the rows read at most {ROW_READS_PER_WEIGHT_BYTE}x the weights' bytes of KV"

    def _token_rows(self, step: Step) -> Prepared | None:
        """``step`` prepared as token rows (``graph_extend_tokens``): replayed from the decode graphs where the
        rows fit them, eagerly on a CPU; None where it does not apply (then the step runs as it is)."""
        limit = self.token_rows_limit()[0]
        if not (limit and step.fixed is None and len(step.q_lens) <= limit  # no scan of a large decode step's rows
                and sum(step.q_lens) <= limit and max(step.q_lens) > 1 and min(step.prefix_lens) > 0):
            return None
        if self.graphs is not None and max(p + q for p, q in zip(step.prefix_lens, step.q_lens)) > self.graphs.max_context:
            return None  # wider than the graphs' tables: no metadata built for nothing
        reads = sum(b * row_context_tokens(step.prefix_lens, step.q_lens, w) for w, b in self._row_read_bytes.items())
        if reads > self._row_reads_cap:
            return None
        rows = as_token_rows(step, self.pool.page_size)
        # no cascade: the rows of one chunk share its request's whole prefix, but a cascade graph is captured
        # only for a key asked for steps in a row, and eager cascade is the launch cost this avoids
        meta = build_metadata(prefix_lens=rows.prefix_lens, q_lens=rows.q_lens, block_tables=rows.block_tables,
                              page_size=self.pool.page_size, device=self.device,
                              window_block_tables=rows.window_block_tables)
        if self.graphs is not None and not self.graphs.fits(meta):
            return None
        self.graph_stats["token_rows"] += meta.num_reqs
        graph = self.graphs is not None
        return Prepared(rows, meta, graph, self.graphs.stage(meta) if graph else None,
                        None if graph else self.backends.prepare(meta))

    def launch(self, prep: Prepared, ids: "list[int] | torch.Tensor") -> tuple[torch.Tensor, int]:
        """The device half of ``run``: the forward pass of a prepared step over ``ids`` (a list, or an int64
        tensor on the device: an early launch's sampled tokens; not under tensor parallelism)."""
        step, meta = prep.step, prep.meta
        self.graph_stats["cascade_over_cap"] += prep.over_cap
        if self.tp is not None and self.tp.leader:
            self.tp.publish(("step", {**step.wire(), "ids": ids, "gone": list(self.gone),
                                      "fixed": Fixed(meta.shared_prefix_len, prep.graph)}))
        self.gone.clear()
        if not isinstance(ids, torch.Tensor):
            ids = to_device(ids, torch.int64, self.device)
        rows = None if step.rows is None else to_device(step.rows, torch.int64, self.device)
        with torch.inference_mode():
            if prep.graph:
                hidden = self.graphs.launch(prep.staged, ids)  # decode: row i is request i
                logits = self.model.compute_logits(hidden[rows])
                self.graph_stats["cascade_replayed" if meta.shared_prefix_len else "replayed"] += 1
            elif prep.mixed:
                hidden = self.mixed.launch(prep.staged, ids)
                logits = self.model.compute_logits(hidden if rows is None else hidden[rows])
                self.graph_stats["mixed"] += 1
            elif prep.pieces:
                hidden = self.pieces.launch(ids, meta, prep.plan)
                logits = self.model.compute_logits(hidden if rows is None else hidden[rows])
                self.graph_stats["piecewise"] += 1
            else:
                hidden = self.forward(ids, meta, prep.plan)
                logits = self.model.compute_logits(hidden if rows is None else hidden[rows])
                if rows is not None:
                    self.graph_stats["eager"] += 1
                    self.graph_stats["cascade"] += bool(meta.shared_prefix_len)
        return logits, meta.shared_prefix_len

    def forward(self, ids: torch.Tensor, meta: BatchMetadata, plan) -> torch.Tensor:
        b = self.backends
        return self.model(ids, meta.positions, ForwardContext(meta, self.pool, b.prefill_backend, b.decode_backend, plan=plan))

    def to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``tokens`` [rows] int64 to a pinned host buffer: (the host view, the event that
        marks the copy done; None off CUDA, where the copy is done on return). One buffer serves every
        step: it is read before the next step's copy is queued."""
        if tokens.device.type != "cuda":
            return tokens.cpu(), None
        n = tokens.shape[0]
        if self._host_tokens is None or self._host_tokens.shape[0] < n:
            self._host_tokens = torch.empty(max(n, self.max_rows), dtype=torch.int64, pin_memory=True)
        host = self._host_tokens[:n]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done
