"""The generation loop: continuous batching over the paged KV cache.

Each step packs (a) one new token for every running request that is decoding and (b) prompt chunks of
requests still prefilling, up to a token budget. A step with only (a) runs in DECODE mode on the decode
backend; any prompt chunk makes it an EXTEND step on the prefill backend. Requests join when their
pages fit and leave as soon as they finish, so the batch changes between steps.

KV pages are reserved at admission for the prompt plus max_new_tokens (capped by the context limit),
so an admitted request never runs out of pages and nothing is ever preempted or dropped; requests that
do not fit wait in the queue. With prefix caching on, a request starts from the longest prefix of full
pages already in the cache (``PrefixCache``) and reserves only the pages it adds.

A pool with a window page group (sliding-window layers, ``KVPool.has_window_group``): each request
also holds window-group pages, by block-table column, and releases those wholly before the window of
its next query at every step (their columns become 0). A request never holds more of them at once than
its window plus a page plus its largest prefill chunk (``_window_peak``), and admission keeps the sum of
those peaks over the running requests, plus the window pages they share through the prefix cache, within
the group's capacity: a bound that holds whatever order requests release in (``_window_fits``).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from attnzoo.attention.backends.hybrid import HybridBackend
from attnzoo.attention.kv_cache import KVPool, PageAllocator
from attnzoo.attention.layer import ForwardContext
from attnzoo.attention.metadata import BatchMetadata, build_metadata
from attnzoo.engine.prefix_cache import PrefixCache, window_start
from attnzoo.engine.sampling import OVERFLOW, SamplingParams, process_logits, sample
from attnzoo.errors import BackendError, KVCacheFullError, NumericsError, RequestError

# max_running=None: admission is bounded by the KV pages each request reserves, the token budget (a
# decode step must hold every running request) and this cap, which bounds per-step host work.
MAX_RUNNING_CAP = 4096


def check_cascade(decode_backend_cls, prefix_caching: bool, cascade: bool | None) -> bool:
    """Whether cascade decode can run; an explicit ``cascade=True`` that cannot is an error."""
    can = bool(prefix_caching and decode_backend_cls.supports_cascade)
    if cascade and not can:
        why = (f"the decode backend {decode_backend_cls.name!r} has no cascade path"
               if not decode_backend_cls.supports_cascade else "prefix caching is off")
        raise BackendError(f"cascade attention needs prefix caching and a decode backend that supports it; {why}",
                           fix="pass cascade=None (automatic) or False, or use decode backend 'flashinfer' or 'triton'")
    return can


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_token_ids: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [num_new_tokens, vocab] float32, when asked for
    # seconds from the start of generate(): first token out, last token out
    time_to_first_token: float = 0.0
    latency: float = 0.0


@dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    max_len: int  # prompt + tokens this request may generate (context limit applied)
    generator: torch.Generator | None
    out: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose k/v are in the pool
    reserved: int = 0  # pages promised at admission and not yet allocated
    shared: list[int] = field(default_factory=list)  # prefix pages matched in the cache
    finish: str | None = None
    text: str | None = None  # set when a stop string cut the output
    logits: list[torch.Tensor] = field(default_factory=list)
    first_token_at: float = 0.0
    finished_at: float = 0.0
    _table: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32), repr=False)
    window: "_WindowPages | None" = None  # window-group pages (a pool with a window group)

    def page_table(self) -> np.ndarray:
        """``pages`` as int32 for the step's block table. Pages only grow while a request runs, so only
        those added since the last step are converted, not every page every step."""
        n = len(self._table)
        if n < len(self.pages):
            self._table = np.concatenate([self._table, np.asarray(self.pages[n:], dtype=np.int32)])
        return self._table

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt)


class _WindowPages:
    """One request's window-group pages by block-table column (token t in column t // page_size), 0 where
    released or never held; the live ones are the columns ``[first, len(table))``."""

    def __init__(self):
        self.table = np.zeros(0, dtype=np.int32)
        self.first = 0
        self.matched: set[int] = set()  # live pages taken from the prefix cache (not allocated by this request)

    def live(self) -> list[int]:
        return self.table[self.first:].tolist()


class Engine:
    def __init__(
        self,
        model,
        pool: KVPool,
        backends: HybridBackend,
        *,
        tokenizer=None,
        eos_token_ids: set[int] = frozenset(),
        context_len: int,
        max_batch_tokens: int = 4096,
        max_running: int | None = None,
        prefix_caching: bool = True,
        cascade: bool | None = None,
        cascade_min_saved_tokens: int = 32768,
    ):
        self.model = model
        self.pool = pool
        self.allocator = PageAllocator(pool.num_pages)
        self.window = pool.window  # the window group's release window; None: one page group
        self.window_allocator = PageAllocator(pool.num_window_pages) if self.window else None
        self._wshared: dict[int, int] = {}  # window page -> running requests holding it from the prefix cache
        self.backends = backends  # which backend serves a step: the prefill one or the decode one
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.context_len = context_len
        self.max_batch_tokens = max_batch_tokens
        if max_running is None:
            max_running = min(MAX_RUNNING_CAP, max_batch_tokens, self.allocator.capacity)
        self.max_running = max_running
        self.device = pool.device
        self.prefix_cache = (PrefixCache(self.allocator, pool.page_size, self.window_allocator, self.window)
                             if prefix_caching else None)
        # Cascade decode (the shared prefix read once per step) needs shared pages and a backend that
        # reads them once. Saved KV reads per layer: shared tokens x (requests - 1). A cascade step that
        # runs eagerly gives up what a plain graph replay saves (the launches: ms per step on 60 layers),
        # so it is used only from ``cascade_min_saved_tokens``. Where the decode backend captures cascade
        # steps too (``supports_cascade_graph``), a graph-replayed cascade step costs the host what a plain
        # replay does: only the GPU trade-off is left, the shared part and the merge (two small kernels per
        # layer, a few us) against the reads saved (8192 tokens: 32 MiB per layer on Llama-8B's KV, ~7 us
        # on an H200; an estimate, not a measurement), hence the lower ``cascade_graph_min_saved_tokens``.
        can = check_cascade(type(backends.decode_backend), prefix_caching, cascade)
        self.cascade = can if cascade is None else cascade
        # Extend steps too (prompt chunks after a cached few-shot prefix, beside decode rows), where the
        # prefill backend can: there every request re-reads the prefix, however few queries it brings.
        self.cascade_extend = cascade is not False and prefix_caching and backends.prefill_backend.supports_cascade_extend
        self.cascade_min_saved_tokens = cascade_min_saved_tokens
        self.cascade_graph_min_saved_tokens = 8192
        self.step_log: list[dict] | None = None  # set to [] to record one summary per step (benchmarks)
        self.graphs = None  # DecodeGraphs, set by enable_cuda_graphs()
        # replayed: plain decode graphs; eager: decode/sampling steps run eagerly, of which cascade: with a
        # shared prefix; cascade_replayed: cascade decode graphs; cascade_over_cap: cascade steps whose graph
        # was not captured for the cap on their number (those ran eagerly or as plain graphs)
        self.graph_stats = {"replayed": 0, "eager": 0, "cascade": 0, "cascade_replayed": 0, "cascade_over_cap": 0}
        self.tp = None  # TPGroup (attnzoo.engine.tensor_parallel): rank 0 publishes each step to the others
        # Host work off the critical path: the next decode step's metadata, plan and graph staging are
        # prepared while the GPU runs this one, before its tokens are read back (``_prepare_ahead``).
        self.overlap = True
        # With overlap, a prepared step whose running set cannot change but by an EOS/stop-string stop (no
        # request ends by length this step, none freed pages since the last admission) is launched at once
        # on this step's sampled tokens as they lie on the GPU, before they are read back: the GPU goes from
        # one step to the next without waiting for the host. A request that stops on this step's token then
        # had one row of the next step computed for nothing; it is dropped from that step's results.
        self.early_launch = True
        # prepared: steps prepared ahead; launched: of those, launched as prepared; early: of those, launched
        # before this step's tokens were read back
        self.overlap_stats = {"prepared": 0, "launched": 0, "early": 0}
        self._planned: torch.cuda.Event | None = None  # recorded after the last step's plan was queued
        self._host_tokens: torch.Tensor | None = None  # pinned [>= max_running] int64: each step's sampled tokens

    @property
    def prefill_backend(self):
        return self.backends.prefill_backend

    @property
    def decode_backend(self):
        return self.backends.decode_backend

    def enable_cuda_graphs(self, max_batch: int, max_context: int, batch_sizes=None, prune: bool = True) -> None:
        from attnzoo.engine.cuda_graph import DEFAULT_BUCKETS, DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.pool, self.backends, max_batch=max_batch, max_context=max_context,
                                   buckets=DEFAULT_BUCKETS if batch_sizes is None else batch_sizes, prune=prune)

    # ---------------------------------------------------------------- public

    def check_request(self, prompt: list[int], params: SamplingParams) -> int:
        """Validate one request before any work; returns its max total length."""
        params.validate()
        if not prompt:
            raise RequestError("empty prompt", fix="pass at least one token or a non-empty string")
        self.model.validate_prompt(prompt)
        if len(prompt) >= self.context_len:
            raise RequestError(
                f"prompt of {len(prompt)} tokens does not leave room to generate within the context limit of {self.context_len}",
                fix="shorten the prompt",
            )
        max_len = min(len(prompt) + params.max_new_tokens, self.context_len)
        need = self._pages_for(max_len)
        if need > self.allocator.capacity:
            raise KVCacheFullError(
                f"a request of {len(prompt)} prompt + {max_len - len(prompt)} new tokens needs {need} KV pages; the cache has {self.allocator.capacity}",
                fix="lower max_new_tokens or give the KV cache more memory (kv_cache_tokens=... / kv_cache_memory=...)",
            )
        if self.window:
            need = self._window_peak(len(prompt), 0, max_len, 0)
            if need > self.window_allocator.capacity:
                raise KVCacheFullError(
                    f"a request of {len(prompt)} prompt + {max_len - len(prompt)} new tokens holds up to {need} pages of "
                    f"the sliding-window layers at once; that page group has {self.window_allocator.capacity}",
                    fix="raise window_kv_fraction, lower max_batch_tokens, or give the KV cache more memory",
                )
        return max_len

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], return_logits: bool = False,
        on_finish: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """One Completion per prompt, in input order; ``on_finish(i)`` is called as request i ends."""
        max_lens = [self.check_request(p, sp) for p, sp in zip(prompts, params)]
        waiting = deque(
            _Request(i, list(p), sp, m, self._generator(sp)) for i, (p, sp, m) in enumerate(zip(prompts, params, max_lens))
        )
        running: list[_Request] = []
        done: list[_Request] = []
        processed = any(sp.repetition_penalty != 1.0 or sp.min_new_tokens for sp in params)
        self.t0 = time.perf_counter()
        ahead: tuple[_Batch, _Prepared] | None = None  # the next decode step, prepared during this one
        early: tuple[_Batch, torch.Tensor] | None = None  # the next decode step, launched during this one
        freed = False  # a request ended since the last admission (its pages may admit others)
        try:
            while waiting or running:
                if early is not None:  # launched on the last step's device tokens; nobody could have joined
                    batch, logits = early
                    early = None
                else:
                    self._admit(waiting, running)
                    freed = False
                    if ahead is not None and len(ahead[0].reqs) == len(running) and all(
                            a is r for a, r in zip(ahead[0].reqs, running)):
                        batch = ahead[0]
                        batch.chunks = [[req.out[-1]] for req in batch.reqs]
                        self.overlap_stats["launched"] += 1
                        logits = self._launch(batch, ahead[1])
                    else:  # first step, or the running set changed (a request stopped early, another joined)
                        batch = self._schedule(running)
                        if not batch.reqs:
                            raise RuntimeError("engine bug: a step with no work")
                        logits = self._step(batch)
                tokens = logits.argmax(dim=-1)
                # NaN and +inf win argmax, so a row's top logit is non-finite iff the row holds one (or is all
                # -inf): an O(rows) check whose result comes back as token -1 at the step's one sync.
                finite = torch.isfinite(logits.gather(1, tokens[:, None]))[:, 0]
                scores = process_logits(logits, batch.sampling_reqs, self.eos) if processed else logits
                if scores is not logits:
                    tokens = scores.argmax(dim=-1)
                rows = [i for i, r in enumerate(batch.sampling_reqs) if not r.params.greedy]
                if rows:
                    reqs = [batch.sampling_reqs[i] for i in rows]
                    at = torch.tensor(rows, device=tokens.device)
                    tokens[at] = sample(scores[at], [r.params for r in reqs], [r.generator for r in reqs])
                tokens = torch.where(finite, tokens, -1)
                # The copy to the host is queued now, before any next step: a read-back queued after an
                # early-launched step would wait for that whole step (measured: 8-10% slower end to end).
                host, copied = self._to_host(tokens)
                ahead = self._prepare_ahead(running) if self.overlap else None
                if ahead is not None and self.early_launch and not freed:
                    early = self._launch_early(ahead, batch, tokens, running)
                    if early is not None:
                        ahead = None
                if copied is not None:
                    copied.synchronize()  # one sync a step
                for i, (req, token) in enumerate(zip(batch.sampling_reqs, host.tolist())):
                    if req.finish:  # stopped on the step before, after this step was launched early
                        continue
                    if token == OVERFLOW:
                        p = req.params
                        raise RequestError(
                            f"sampling prompt {req.index} at output token {len(req.out)}: the logits divided by "
                            f"temperature={p.temperature!r} overflow float32 (softmax would be NaN and return token 0)"
                            + ("" if p.repetition_penalty == 1.0 else f"; repetition_penalty={p.repetition_penalty!r} scales them too"),
                            fix="use temperature=0 for greedy decoding, or a temperature of 1e-3 or more",
                        )
                    if token < 0:
                        raise NumericsError(
                            f"the model produced non-finite logits (NaN or inf) for prompt {req.index} at output token "
                            f"{len(req.out)}; generation stopped",
                            fix="check the checkpoint for NaN/inf weights; in float16 try dtype='bfloat16' or 'float32' "
                            "(overflow); compare with backend='torch'",
                        )
                    self._append(req, token, logits[i] if return_logits else None)
                if self.step_log is not None:  # "t": when the step's tokens reached the host
                    self.step_log.append({**batch.summary(), "t": time.perf_counter()})
                for req in [r for r in running if r.finish]:
                    self._release(req)
                    running.remove(req)
                    done.append(req)
                    freed = True
                    if on_finish is not None:
                        on_finish(req.index)
        finally:
            for req in running:  # an exception mid-run must not leak pages or leave unwritten cache entries
                if self.prefix_cache is not None:
                    self.prefix_cache.drop_unready(req.pages, req.window.live() if req.window else ())
                self._release(req)
        if len(done) != len(prompts):
            raise RuntimeError(f"engine bug: {len(prompts)} requests in, {len(done)} out")
        done.sort(key=lambda r: r.index)
        return [self._completion(r, return_logits) for r in done]

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len, vocab] float32 for one sequence, in token-budget chunks."""
        if not token_ids:
            raise RequestError("empty token list", fix="pass at least one token id")
        if len(token_ids) > self.context_len:
            raise RequestError(f"{len(token_ids)} tokens exceed the context limit {self.context_len}", fix="shorten the input")
        need = self._pages_for(len(token_ids))
        if need > self.allocator.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.allocator.num_free)
        if need > self.allocator.num_free:
            raise KVCacheFullError(f"scoring {len(token_ids)} tokens needs {need} free KV pages, {self.allocator.num_free} free", fix="give the KV cache more memory")
        self._check_window_room([len(token_ids)], [len(token_ids)], "scoring")
        pages = self.allocator.alloc(need)
        wp = _WindowPages() if self.window else None
        rows = []
        try:
            for start in range(0, len(token_ids), self.max_batch_tokens):
                chunk = token_ids[start : start + self.max_batch_tokens]
                step = {"prefix_lens": [start], "q_lens": [len(chunk)], "block_tables": [pages], "ids": chunk,
                        "rows": None, "shared_prefix_len": 0, "graph": False}
                if wp is not None:
                    self._window_advance(wp, start, start + len(chunk))
                    step["window_block_tables"] = [wp.table]
                rows.append(self.run_step(step)[0].float())
        finally:
            self.allocator.free(pages)
            if wp is not None:
                self._window_drop(wp)
        return torch.cat(rows)

    @torch.inference_mode()
    def teacher_forced(self, prompts: list[list[int]], continuations: list[list[int]]):
        """Yield (t, request indices, logits [n, vocab] float32 on the device): the logits predicting
        continuation token t of those requests, fed as generation feeds them: each prompt through the
        prefill backend (one request per step, in token-budget chunks), then the continuations one token
        per step for all requests together through the decode backend (its CUDA graphs where they fit).
        Each request gets its own pages (no prefix sharing), so two engines fed the same inputs run the
        same schedule step for step."""
        if not all(prompts):
            raise RequestError("teacher forcing got an empty prompt", fix="pass at least one prompt token per sequence")
        need = [self._pages_for(len(p) + len(c)) for p, c in zip(prompts, continuations)]
        if sum(need) > self.allocator.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(sum(need) - self.allocator.num_free)
        if sum(need) > self.allocator.num_free:
            raise KVCacheFullError(f"teacher forcing {len(prompts)} sequences needs {sum(need)} free KV pages, "
                                   f"{self.allocator.num_free} free", fix="feed fewer sequences at once")
        self._check_window_room([len(p) for p in prompts], [len(p) + len(c) for p, c in zip(prompts, continuations)],
                                "teacher forcing")
        pages = [self.allocator.alloc(n) for n in need]
        wps = [_WindowPages() for _ in prompts] if self.window else None
        try:
            # Steps go through run_step, as generation's do (tensor-parallel ranks follow them).
            last = []
            for i, prompt in enumerate(prompts):
                for start in range(0, len(prompt), self.max_batch_tokens):
                    chunk = prompt[start : start + self.max_batch_tokens]
                    step = {"prefix_lens": [start], "q_lens": [len(chunk)], "block_tables": [pages[i]],
                            "ids": chunk, "rows": [0], "shared_prefix_len": 0, "graph": False}
                    if wps is not None:
                        self._window_advance(wps[i], start, start + len(chunk))
                        step["window_block_tables"] = [wps[i].table]
                    logits, _ = self.run_step(step)
                last.append(logits.float())
            live = [i for i, c in enumerate(continuations) if c]
            if live:
                yield 0, live, torch.cat([last[i] for i in live])
            for t in range(1, max((len(c) for c in continuations), default=0)):
                live = [i for i in live if len(continuations[i]) > t]
                # Own pages per request: no shared prefix, so the step is graph-replayed wherever it fits.
                step = {"prefix_lens": [len(prompts[i]) + t - 1 for i in live], "q_lens": [1] * len(live),
                        "block_tables": [pages[i] for i in live],
                        "ids": [continuations[i][t - 1] for i in live], "rows": list(range(len(live)))}
                if wps is not None:
                    for i in live:
                        self._window_advance(wps[i], len(prompts[i]) + t - 1, len(prompts[i]) + t)
                    step["window_block_tables"] = [wps[i].table for i in live]
                logits, _ = self.run_step(step)
                yield t, live, logits.float()
        finally:
            for p in pages:
                self.allocator.free(p)
            for wp in wps or ():
                self._window_drop(wp)

    # ---------------------------------------------------------------- scheduling

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.page_size)

    # ---------------------------------------------------------------- the window page group

    def _window_peak(self, prompt_len: int, num_cached: int, max_len: int, matched: int) -> int:
        """The most window-group pages a request allocates and holds at once from now on (besides pages
        taken from the prefix cache; ``matched``: its leading pages that came from there): the window, one
        page (a window rarely starts on a page boundary) and its largest chunk to come (the rest of its
        prompt within the token budget; one token once decoding), capped by its pages after ``matched``.
        It never grows as the request advances, which keeps admission's sum of peaks a bound."""
        chunk = max(1, min(self.max_batch_tokens, prompt_len - num_cached))
        return min(self._pages_for(max_len) - matched, -(-(self.window - 1 + chunk) // self.pool.page_size) + 1)

    def _req_window_peak(self, req: _Request) -> int:
        return self._window_peak(len(req.prompt), req.num_cached, req.max_len, len(req.shared))

    def _window_fits(self, load: int, peak: int, matched: list[int]) -> tuple[bool, int]:
        """Whether a request of window ``peak`` holding ``matched`` cache pages fits beside ``load``
        (running requests' peaks plus the window pages they hold from the cache), and its share of the load.

        Why this bound holds: the group's pages are free, cache-only (evictable on demand), held by the
        request that allocated them (at most its peak), or held only by requests that took them from the
        cache (at most the distinct pages counted in ``_wshared``, a set that only shrinks while they run)."""
        need = peak + sum(1 for p in matched if p and p not in self._wshared)
        return load + need <= self.window_allocator.capacity, need

    def _walloc(self, n: int) -> list[int]:
        short = n - self.window_allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict_window(short)
        return self.window_allocator.alloc(n)

    def _window_advance(self, wp: _WindowPages, num_cached: int, end: int) -> list[int]:
        """Release ``wp``'s pages wholly before the window of the query at ``num_cached`` and give it pages
        up to token ``end``; returns the pages allocated."""
        lo = window_start(num_cached, self.window, self.pool.page_size)
        if lo > wp.first:
            gone = wp.table[wp.first : lo].tolist()
            wp.table[wp.first : lo] = 0
            wp.first = lo
            self._window_free(wp, gone)
        need = self._pages_for(end) - len(wp.table)
        if need <= 0:
            return []
        new = self._walloc(need)
        wp.table = np.concatenate([wp.table, np.asarray(new, dtype=np.int32)])
        return new

    def _window_free(self, wp: _WindowPages, pages: list[int]) -> None:
        self.window_allocator.free(pages)
        for p in wp.matched.intersection(pages):
            wp.matched.discard(p)
            self._wshared[p] -= 1
            if not self._wshared[p]:
                del self._wshared[p]

    def _window_drop(self, wp: _WindowPages) -> None:
        self._window_free(wp, wp.live())
        wp.table, wp.first = np.zeros(0, dtype=np.int32), 0

    def _check_window_room(self, prompt_lens: list[int], lens: list[int], what: str) -> None:
        """Raise unless sequences of these lengths, fed together without prefix sharing, fit the window group."""
        if not self.window:
            return
        need = sum(self._window_peak(p, 0, n, 0) for p, n in zip(prompt_lens, lens))
        short = need - self.window_allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict_window(short)
        if need > self.window_allocator.num_free:
            raise KVCacheFullError(f"{what} needs up to {need} free pages of the sliding-window layers, "
                                   f"{self.window_allocator.num_free} free", fix="feed fewer or shorter sequences at once")

    def _generator(self, sp: SamplingParams) -> torch.Generator | None:
        if sp.greedy:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,))))
        return g

    def _admit(self, waiting: deque, running: list[_Request]) -> None:
        reserved = sum(r.reserved for r in running)
        cache = self.prefix_cache
        wload = sum(map(self._req_window_peak, running)) + len(self._wshared) if self.window else 0
        while waiting and len(running) < self.max_running:
            req = waiting[0]
            shared, wshared = cache.match(req.prompt) if cache is not None else ([], [])
            if self.window:
                peak = lambda m: self._window_peak(len(req.prompt), m * self.pool.page_size, req.max_len, m)  # noqa: E731
                fits, wneed = self._window_fits(wload, peak(len(shared)), wshared)
                if not fits and not running and shared:  # alone and unmatched it fits (check_request)
                    self._unmatch(shared, wshared)
                    shared, wshared = [], []
                    fits, wneed = self._window_fits(wload, peak(0), [])
                if not fits:
                    self._unmatch(shared, wshared)
                    break
            need = self._pages_for(req.max_len) - len(shared)
            short = need - (self.allocator.num_free - reserved)
            if short > 0 and cache is not None:
                short -= cache.evict(short)
            if short > 0:
                self._unmatch(shared, wshared)
                break
            waiting.popleft()
            # Prompt pages are taken now and offered to the cache at once, so that requests admitted
            # right after this one share them instead of computing the same prefix again.
            own = self.allocator.alloc(self._pages_for(len(req.prompt)) - len(shared))
            req.pages, req.shared = shared + own, shared
            req.num_cached = len(shared) * self.pool.page_size
            req.reserved = need - len(own)
            reserved += req.reserved
            if self.window:
                wload += wneed
                self._admit_window(req, wshared)
            if cache is not None:
                cache.insert(req.prompt, req.pages, req.window.table if req.window is not None else ())
            running.append(req)
        if not running and waiting:
            raise RuntimeError("engine bug: nothing running and the first waiting request does not fit")

    def _unmatch(self, shared: list[int], wshared: list[int]) -> None:
        self.allocator.free(shared)
        if self.window:
            self.window_allocator.free([p for p in wshared if p])

    def _admit_window(self, req: _Request, wshared: list[int]) -> None:
        wp = req.window = _WindowPages()
        wp.table = np.asarray(wshared, dtype=np.int32)
        wp.first = window_start(req.num_cached, self.window, self.pool.page_size)
        wp.matched = {p for p in wshared if p}
        for p in wp.matched:
            self._wshared[p] = self._wshared.get(p, 0) + 1
        # The prompt's window pages now where holding them all stays within the peak (prompts that fit
        # a chunk, the usual case), so that requests admitted right after share them, as full pages.
        if self._pages_for(len(req.prompt)) - len(req.shared) <= self._req_window_peak(req):
            self._window_advance(wp, req.num_cached, len(req.prompt))

    def _schedule(self, running: list[_Request]) -> "_Batch":
        batch = _Batch()
        budget = self.max_batch_tokens
        for req in running:  # decoding requests first: they are latency-critical
            if not req.prefilling and budget > 0:
                batch.add(req, [req.out[-1]], sample=True)
                budget -= 1
        for req in running:
            if not req.prefilling or budget <= 0:
                continue
            if req.shared and not self.prefix_cache.all_ready(req.shared, req.window.matched if req.window else ()):
                continue  # another request is still writing the prefix this one reuses
            n = min(len(req.prompt) - req.num_cached, budget)
            chunk = req.prompt[req.num_cached : req.num_cached + n]
            batch.add(req, chunk, sample=req.num_cached + n == len(req.prompt))
            budget -= n
        self._grow(batch)
        return batch

    def _grow(self, batch: "_Batch") -> None:
        """Pages (and window-group pages) for the tokens the batch adds."""
        for req, chunk in zip(batch.reqs, batch.chunks):
            need = self._pages_for(req.num_cached + len(chunk)) - len(req.pages)
            if need > 0:
                req.pages += self.allocator.alloc(need)
                req.reserved -= need
            if req.window is not None:
                new = self._window_advance(req.window, req.num_cached, req.num_cached + len(chunk))
                if new and req.prefilling and self.prefix_cache is not None:
                    self.prefix_cache.insert(req.prompt, req.pages, req.window.table)

    def _prepare_ahead(self, running: list[_Request]) -> "tuple[_Batch, _Prepared] | None":
        """The next step's host work, done while this step runs on the GPU (its tokens not yet read back),
        where the next step is predictable: every running request decoding, those this step ends by length
        left out. The tokens decide only whether it holds (no request stopped otherwise, none joined), and
        fill its input ids. Pages for its tokens are taken now, as ``_schedule`` would take them."""
        if self.tp is not None or any(r.prefilling for r in running):
            return None
        reqs = [r for r in running if len(r.prompt) + len(r.out) + 1 < r.max_len]
        if not reqs or len(reqs) > self.max_batch_tokens:
            return None
        batch = _Batch()
        for req in reqs:
            batch.add(req, [0], sample=True)  # the token is this step's output, known after the sync
        self._grow(batch)
        self.overlap_stats["prepared"] += 1
        return batch, self.prepare_step(self._step_dict(batch))

    def _to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``tokens`` [rows] int64 to a pinned host buffer: (the host view, the event that
        marks the copy done; None off CUDA, where the copy is done on return). One buffer serves every
        step: it is read before the next step's copy is queued."""
        if tokens.device.type != "cuda":
            return tokens.cpu(), None
        n = tokens.shape[0]
        if self._host_tokens is None or self._host_tokens.shape[0] < n:
            self._host_tokens = torch.empty(max(n, self.max_running), dtype=torch.int64, pin_memory=True)
        host = self._host_tokens[:n]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _launch_early(self, ahead, batch: "_Batch", tokens: torch.Tensor, running: list[_Request]):
        """(the next step, its logits) launched on this step's sampled ``tokens`` [rows] still on the GPU, where
        the next step holds every running request (none ends by length now): the running set then changes
        only by a request stopping on the token this step sampled. None where it cannot be launched so."""
        nxt, prep = ahead
        if len(nxt.reqs) != len(running) or len(batch.sampling_reqs) != len(running):
            return None
        row = {id(r): i for i, r in enumerate(batch.sampling_reqs)}
        idx = [row.get(id(r), -1) for r in nxt.reqs]
        if -1 in idx:
            return None
        ids = tokens if idx == list(range(len(idx))) else tokens[torch.tensor(idx, device=tokens.device)]
        ids = ids.clamp(min=0)  # a non-finite row's -1 raises NumericsError at the sync, not an index fault here
        nxt.chunks = [[-1] for _ in nxt.reqs]  # known on the host after the sync; only their lengths are read
        self.overlap_stats["launched"] += 1
        self.overlap_stats["early"] += 1
        return nxt, self._launch(nxt, prep, ids)

    def _step_dict(self, batch: "_Batch") -> dict:
        step = {"prefix_lens": [r.num_cached for r in batch.reqs], "q_lens": [len(c) for c in batch.chunks],
                "block_tables": [r.page_table() for r in batch.reqs], "ids": [t for c in batch.chunks for t in c],
                "rows": batch.sample_rows, "keys": [r.index for r in batch.reqs]}
        if self.window:
            step["window_block_tables"] = [r.window.table for r in batch.reqs]
        return step

    def _step(self, batch: "_Batch") -> torch.Tensor:
        return self._launch(batch, self.prepare_step(self._step_dict(batch)))

    def _launch(self, batch: "_Batch", prep: "_Prepared", ids: torch.Tensor | None = None) -> torch.Tensor:
        logits, batch.shared_prefix_len = self.launch_step(prep, [t for c in batch.chunks for t in c] if ids is None else ids)
        for req, chunk in zip(batch.reqs, batch.chunks):
            req.num_cached += len(chunk)
            if self.prefix_cache is not None and len(req.out) == 0:
                written = min(req.num_cached, len(req.prompt)) // self.pool.page_size
                self.prefix_cache.mark_ready(req.pages[:written], req.window.table[:written] if req.window else ())
        return logits

    def run_step(self, step: dict) -> tuple[torch.Tensor, int]:
        """One forward pass -> (logits of the last token of requests ``step["rows"]`` (None: of every
        token), the shared prefix length cascade read). ``step`` holds plain lists: what rank 0 of a
        tensor-parallel group sends the other ranks, which run the same pass with the choices it made
        (graph replay or eager, cascade or not) rather than their own."""
        return self.launch_step(self.prepare_step(step), step["ids"])

    @torch.inference_mode()
    def prepare_step(self, step: dict) -> "_Prepared":
        """The host half of ``run_step`` (everything but ``step["ids"]``): metadata, the cascade and graph
        choices, the backend's plan, and for a graph step its staging (``DecodeGraphs.stage``). Its device
        copies are stream-ordered behind the work already queued, so step N+1 may be prepared while step N
        runs (``overlap``)."""
        if self._planned is not None:
            # FlashInfer's plan stages page lists in pinned host buffers and copies them asynchronously: the
            # last plan's copies must have reached the GPU before this one rewrites those buffers (as a rule
            # they have: they ran before that step's kernels).
            self._planned.synchronize()
        decided = "graph" in step
        meta = build_metadata(
            prefix_lens=step["prefix_lens"], q_lens=step["q_lens"], block_tables=step["block_tables"],
            page_size=self.pool.page_size, device=self.device,
            detect_shared_prefix=(self.cascade or self.cascade_extend) and not decided,
            window_block_tables=step.get("window_block_tables"),
        )
        cascade_graph = over_cap = False  # a cascade step a CUDA graph serves; one the cap on them refused
        if decided:
            meta.shared_prefix_len = step["shared_prefix_len"]
        elif meta.shared_prefix_len:
            on = self.cascade if meta.is_decode else self.cascade_extend
            saved = meta.shared_prefix_len * (meta.num_reqs - 1)
            if on and self.graphs is not None and saved >= self.cascade_graph_min_saved_tokens:
                ready = self.graphs.cascade_ready(meta)
                cascade_graph = bool(ready)
                over_cap = ready is False and self.graphs.at_cap
            if not on or (not cascade_graph and saved < self.cascade_min_saved_tokens):
                meta.shared_prefix_len = 0
        graph = step["graph"] if decided else (
            self.graphs is not None and self.graphs.fits(meta) and (cascade_graph or not meta.shared_prefix_len))
        staged = self.graphs.stage(meta) if graph else None
        plan = None if graph else self.backends.prepare(meta)
        if self.device.type == "cuda":
            self._planned = torch.cuda.Event()
            self._planned.record()
        return _Prepared(step, meta, graph, staged, plan, over_cap)

    def launch_step(self, prep: "_Prepared", ids: "list[int] | torch.Tensor") -> tuple[torch.Tensor, int]:
        """The device half of ``run_step``: the forward pass of a prepared step over ``ids`` (a list, or
        an int64 tensor on the device: an early launch's sampled tokens; not under tensor parallelism)."""
        step, meta = prep.step, prep.meta
        self.graph_stats["cascade_over_cap"] += prep.over_cap
        if self.tp is not None and self.tp.leader:
            self.tp.publish(("step", {**step, "ids": ids, "shared_prefix_len": meta.shared_prefix_len,
                                      "graph": prep.graph}))
        if not isinstance(ids, torch.Tensor):
            ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        rows = None if step["rows"] is None else torch.tensor(step["rows"], dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            if prep.graph:
                hidden = self.graphs.launch(prep.staged, ids)  # decode: row i is request i
                logits = self.model.compute_logits(hidden[rows])
                self.graph_stats["cascade_replayed" if meta.shared_prefix_len else "replayed"] += 1
            else:
                hidden = self._forward(ids, meta, prep.plan)
                logits = self.model.compute_logits(hidden if rows is None else hidden[meta.last_token_rows[rows]])
                if rows is not None:
                    self.graph_stats["eager"] += 1
                    self.graph_stats["cascade"] += bool(meta.shared_prefix_len)
        return logits, meta.shared_prefix_len

    def _forward(self, ids: torch.Tensor, meta: BatchMetadata, plan) -> torch.Tensor:
        b = self.backends
        ctx = ForwardContext(meta, self.pool, b.prefill_backend, b.decode_backend, plan=plan)
        return self.model(ids, meta.positions, ctx)

    # ---------------------------------------------------------------- results

    def _append(self, req: _Request, token: int, logits: torch.Tensor | None) -> None:
        sp = req.params
        if logits is not None:
            req.logits.append(logits.float().cpu())
        req.out.append(token)
        now = time.perf_counter() - self.t0
        if len(req.out) == 1:
            req.first_token_at = now
        req.finished_at = now
        if not sp.ignore_eos and token in self.eos:
            req.finish = "stop"
        elif sp.stop and self._hit_stop(req):
            req.finish = "stop"
        elif len(req.prompt) + len(req.out) >= req.max_len:
            req.finish = "length"

    def _hit_stop(self, req: _Request) -> bool:
        # A stop string ending at this token lies within its last few tokens: decode only that tail
        # (a token is at least one character, plus slack for tokens that decode to nothing alone).
        window = max(len(s) for s in req.params.stop) + 8
        tail = self.tokenizer.decode(req.out[-window:], skip_special_tokens=True)
        if not any(s in tail for s in req.params.stop):
            return False
        text = self.tokenizer.decode(req.out, skip_special_tokens=True)
        req.text = text[: min(text.find(s) for s in req.params.stop if s in text)]
        return True

    def _release(self, req: _Request) -> None:
        self.allocator.free(req.pages)
        req.pages, req.reserved = [], 0
        if req.window is not None:
            self._window_drop(req.window)

    def _completion(self, req: _Request, keep_logits: bool) -> Completion:
        text = req.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(req.out, skip_special_tokens=True)
        logits = torch.stack(req.logits) if keep_logits else None
        return Completion(
            text=text, token_ids=req.out, finish_reason=req.finish, prompt_token_ids=req.prompt, logits=logits,
            time_to_first_token=req.first_token_at, latency=req.finished_at,
        )


@dataclass
class _Prepared:
    """A step's host half (``Engine.prepare_step``), ready to launch once its input ids are known."""

    step: dict
    meta: BatchMetadata
    graph: bool  # replayed as a CUDA graph
    staged: object | None  # DecodeGraphs.stage's result for a graph step
    plan: object | None  # the backends' StepPlan for an eager step
    over_cap: bool = False  # a cascade step whose graph the cap on their number refused


class _Batch:
    def __init__(self):
        self.reqs: list[_Request] = []
        self.chunks: list[list[int]] = []
        self.sample_rows: list[int] = []  # indices into reqs whose last row is sampled
        self.sampling_reqs: list[_Request] = []
        self.shared_prefix_len = 0  # set by the step: KV tokens every request read from the same pages

    def summary(self) -> dict:
        """What a roofline model needs: new tokens, and KV tokens read by attention."""
        return {"num_reqs": len(self.reqs), "new_tokens": sum(len(c) for c in self.chunks),
                "kv_tokens": sum(r.num_cached for r in self.reqs),
                "max_seq_len": max(r.num_cached + len(c) for r, c in zip(self.reqs, self.chunks)),
                "shared_prefix_len": self.shared_prefix_len,
                "attn_pairs": sum(len(c) * r.num_cached for r, c in zip(self.reqs, self.chunks))}

    def add(self, req: _Request, chunk: list[int], sample: bool) -> None:
        if sample:
            self.sample_rows.append(len(self.reqs))
            self.sampling_reqs.append(req)
        self.reqs.append(req)
        self.chunks.append(chunk)
