"""Admission and scheduling: which requests run, and what each step computes for them.

Each step packs (a) one new token for every running request that is decoding and (b) prompt chunks of
requests still prefilling, up to a token budget. A step with only (a) runs in DECODE mode on the decode
backend; any prompt chunk makes it an EXTEND step on the prefill backend. Requests join when their
pages fit (``KVPages``) and leave as soon as they finish, so the batch changes between steps.
"""
from __future__ import annotations

from collections import deque

from attnzoo.engine.kv_pages import KVPages
from attnzoo.engine.request import Request
from attnzoo.engine.sampling import SamplingParams
from attnzoo.errors import KVCacheFullError, RequestError

# max_running=None: admission is bounded by the KV pages each request reserves, the token budget (a
# decode step must hold every running request) and this cap, which bounds per-step host work.
MAX_RUNNING_CAP = 4096


class Batch:
    """One step's work: a chunk of new tokens per request, and which requests' last rows are sampled."""

    def __init__(self):
        self.reqs: list[Request] = []
        self.chunks: list[list[int]] = []
        self.sample_rows: list[int] = []  # indices into reqs whose last row is sampled
        self.sampling_reqs: list[Request] = []
        self.shared_prefix_len = 0  # set by the step: KV tokens every request read from the same pages
        # Where a request asks for prompt logprobs (``all_rows``): (request, its first logits row, rows, the
        # prompt position of its chunk) per such request, and the logits row of each sampled request.
        self.spans: list[tuple[Request, int, int, int]] = []
        self.sample_at_host: list[int] = []
        self.sample_at = None  # sample_at_host on the device; None: logits row i is sampled request i

    def summary(self) -> dict:
        """What a roofline model needs: new tokens, and KV tokens read by attention."""
        return {"num_reqs": len(self.reqs), "new_tokens": sum(len(c) for c in self.chunks),
                "kv_tokens": sum(r.num_cached for r in self.reqs),
                "max_seq_len": max(r.num_cached + len(c) for r, c in zip(self.reqs, self.chunks)),
                "shared_prefix_len": self.shared_prefix_len,
                "attn_pairs": sum(len(c) * r.num_cached for r, c in zip(self.reqs, self.chunks))}

    def add(self, req: Request, chunk: list[int], sample: bool) -> None:
        if sample:
            self.sample_rows.append(len(self.reqs))
            self.sampling_reqs.append(req)
        self.reqs.append(req)
        self.chunks.append(chunk)

    @property
    def all_rows(self) -> bool:
        """Whether a request asks for the logits of every prompt token it brings (prompt logprobs)."""
        return any(r.wants_prompt_logprobs and r.prefilling for r in self.reqs)


class Scheduler:
    def __init__(self, pages: KVPages, model, *, context_len: int, max_batch_tokens: int, max_running: int | None):
        self.pages = pages
        self.model = model
        self.context_len = context_len
        self.max_batch_tokens = max_batch_tokens
        if max_running is None:
            max_running = min(MAX_RUNNING_CAP, max_batch_tokens, pages.allocator.capacity)
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.gone: list[int] = []  # keys of running requests removed (tensor-parallel ranks drop their tables)
        self.admitted_tokens = 0  # prompt tokens admitted over the engine's life, of which
        self.cached_tokens = 0  # found in the prefix cache (the server's hit rate)

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
        pages = self.pages
        need = pages.pages_for(max_len)
        if need > pages.allocator.capacity:
            raise KVCacheFullError(
                f"a request of {len(prompt)} prompt + {max_len - len(prompt)} new tokens needs {need} KV pages; the cache has {pages.allocator.capacity}",
                fix="lower max_new_tokens or give the KV cache more memory (kv_cache_tokens=... / kv_cache_memory=...)",
            )
        if pages.window:
            need = pages.window_peak(len(prompt), 0, max_len, 0)
            if need > pages.window_allocator.capacity:
                raise KVCacheFullError(
                    f"a request of {len(prompt)} prompt + {max_len - len(prompt)} new tokens holds up to {need} pages of "
                    f"the sliding-window layers at once; that page group has {pages.window_allocator.capacity}",
                    fix="raise window_kv_fraction, lower max_batch_tokens, or give the KV cache more memory",
                )
        return max_len

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> None:
        """Move waiting requests to running, in arrival order, while their pages fit."""
        waiting, running, pages = self.waiting, self.running, self.pages
        reserved = sum(r.reserved for r in running)
        cache = pages.prefix_cache
        wload = sum(map(pages.req_window_peak, running)) + len(pages.wshared) if pages.window else 0
        while waiting and len(running) < self.max_running:
            req = waiting[0]
            # A request asking for prompt logprobs computes its whole prompt: it reuses no cached prefix.
            use_cache = cache is not None and not req.wants_prompt_logprobs
            shared, wshared = cache.match(req.prompt) if use_cache else ([], [])
            if pages.window:
                peak = lambda m: pages.window_peak(len(req.prompt), m * pages.page_size, req.max_len, m)  # noqa: E731
                fits, wneed = pages.window_fits(wload, peak(len(shared)), wshared)
                if not fits and not running and shared:  # alone and unmatched it fits (check_request)
                    pages.unmatch(shared, wshared)
                    shared, wshared = [], []
                    fits, wneed = pages.window_fits(wload, peak(0), [])
                if not fits:
                    pages.unmatch(shared, wshared)
                    break
            need = pages.pages_for(req.max_len) - len(shared)
            short = need - (pages.allocator.num_free - reserved)
            if short > 0 and cache is not None:
                short -= cache.evict(short)
            if short > 0:
                pages.unmatch(shared, wshared)
                break
            waiting.popleft()
            # Prompt pages are taken now and offered to the cache at once, so that requests admitted
            # right after this one share them instead of computing the same prefix again.
            own = pages.allocator.alloc(pages.pages_for(len(req.prompt)) - len(shared))
            req.pages, req.shared = shared + own, shared
            req.num_cached = len(shared) * pages.page_size
            req.reserved = need - len(own)
            reserved += req.reserved
            self.admitted_tokens += len(req.prompt)
            self.cached_tokens += req.num_cached
            if pages.window:
                wload += wneed
                pages.admit_window(req, wshared)
            if cache is not None:
                cache.insert(req.prompt, req.pages, req.window.table if req.window is not None else ())
            running.append(req)
        if not running and waiting:
            raise RuntimeError("engine bug: nothing running and the first waiting request does not fit")

    def reserved(self) -> int:
        """Pages promised to running requests and not yet allocated: not free for anything else."""
        return sum(r.reserved for r in self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_batch_tokens
        cache = self.pages.prefix_cache
        for req in self.running:  # decoding requests first: they are latency-critical
            if not req.prefilling and budget > 0:
                batch.add(req, [req.out[-1]], sample=True)
                budget -= 1
        for req in self.running:
            if not req.prefilling or budget <= 0:
                continue
            if req.shared and not cache.all_ready(req.shared, req.window.matched if req.window else ()):
                continue  # another request is still writing the prefix this one reuses
            n = min(len(req.prompt) - req.num_cached, budget)
            chunk = req.prompt[req.num_cached : req.num_cached + n]
            batch.add(req, chunk, sample=req.num_cached + n == len(req.prompt))
            budget -= n
        self.grow(batch)
        return batch

    def grow(self, batch: Batch) -> None:
        """Pages (and window-group pages) for the tokens the batch adds."""
        for req, chunk in zip(batch.reqs, batch.chunks):
            self.pages.grow(req, len(chunk))

    def next_decode(self) -> Batch | None:
        """The next step where it is predictable before this step's tokens are read back: every running
        request decoding, those this step ends by length left out (None otherwise). Its tokens are this
        step's outputs, filled in once known; its pages are taken now, as ``schedule`` would take them."""
        running = self.running
        if any(r.prefilling for r in running):
            return None
        reqs = [r for r in running if len(r.prompt) + len(r.out) + 1 < r.max_len]
        if not reqs or len(reqs) > self.max_batch_tokens:
            return None
        batch = Batch()
        for req in reqs:
            batch.add(req, [0], sample=True)
        self.grow(batch)
        return batch

    def advanced(self, batch: Batch) -> None:
        """The batch's tokens are in the pool (launched, stream-ordered): account them."""
        for req, chunk in zip(batch.reqs, batch.chunks):
            req.num_cached += len(chunk)
            self.pages.written(req)

    def remove(self, req: Request, *, unfinished: bool = False) -> None:
        """Take ``req`` out of the queue or the running set and give its pages back."""
        if req in self.running:
            self.running.remove(req)
            self.pages.release(req, unfinished=unfinished)
            self.gone.append(req.key)
        elif req in self.waiting:
            self.waiting.remove(req)
