"""The engine's KV pages: the page allocator, the window page group and the prefix cache over both.

KV pages are reserved at admission for the prompt plus max_new_tokens (capped by the context limit),
so an admitted request never runs out of pages and nothing is ever preempted or dropped; requests that
do not fit wait in the queue. With prefix caching on, a request starts from the longest prefix of full
pages already in the cache (``PrefixCache``) and reserves only the pages it adds.

A pool with a window page group (sliding-window layers, ``KVPool.has_window_group``): each request
also holds window-group pages, by block-table column, and releases those wholly before the window of
its next query at every step (their columns become 0). A request never holds more of them at once than
its window plus a page plus its largest prefill chunk (``window_peak``), and admission keeps the sum of
those peaks over the running requests, plus the window pages they share through the prefix cache, within
the group's capacity: a bound that holds whatever order requests release in (``window_fits``).
"""
from __future__ import annotations

import numpy as np

from attnzoo.attention.kv_cache import KVPool, PageAllocator
from attnzoo.engine.prefix_cache import PrefixCache, window_start
from attnzoo.errors import KVCacheFullError


class WindowPages:
    """One request's window-group pages by block-table column (token t in column t // page_size), 0 where
    released or never held; the live ones are the columns ``[first, len(table))``."""

    def __init__(self):
        self.table = np.zeros(0, dtype=np.int32)
        self.first = 0
        self.matched: set[int] = set()  # live pages taken from the prefix cache (not allocated by this request)

    def live(self) -> list[int]:
        return self.table[self.first:].tolist()


class KVPages:
    def __init__(self, pool: KVPool, *, max_batch_tokens: int, prefix_caching: bool):
        self.page_size = pool.page_size
        self.max_batch_tokens = max_batch_tokens  # a request's largest prefill chunk
        self.allocator = PageAllocator(pool.num_pages)
        self.window = pool.window  # the window group's release window; None: one page group
        self.window_allocator = PageAllocator(pool.num_window_pages) if self.window else None
        self.wshared: dict[int, int] = {}  # window page -> running requests holding it from the prefix cache
        self.prefix_cache = (PrefixCache(self.allocator, pool.page_size, self.window_allocator, self.window)
                             if prefix_caching else None)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def in_use(self) -> int:
        """Pages held by requests or by the cache alone (what a gauge of KV use reports)."""
        return self.allocator.capacity - self.allocator.num_free

    def alloc_now(self, n: int, what: str) -> list[int]:
        """``n`` pages at once (evicting cache-only pages as needed), or KVCacheFullError; ``reserved``
        pages promised to running requests are not free (``Scheduler.reserved``)."""
        if n > self.allocator.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(n - self.allocator.num_free)
        if n > self.allocator.num_free:
            raise KVCacheFullError(f"{what} needs {n} free KV pages, {self.allocator.num_free} free",
                                   fix="feed fewer or shorter sequences at once, or give the KV cache more memory")
        return self.allocator.alloc(n)

    # ---------------------------------------------------------------- the window page group

    def window_peak(self, prompt_len: int, num_cached: int, max_len: int, matched: int) -> int:
        """The most window-group pages a request allocates and holds at once from now on (besides pages
        taken from the prefix cache; ``matched``: its leading pages that came from there): the window, one
        page (a window rarely starts on a page boundary) and its largest chunk to come (the rest of its
        prompt within the token budget; one token once decoding), capped by its pages after ``matched``.
        It never grows as the request advances, which keeps admission's sum of peaks a bound."""
        chunk = max(1, min(self.max_batch_tokens, prompt_len - num_cached))
        return min(self.pages_for(max_len) - matched, -(-(self.window - 1 + chunk) // self.page_size) + 1)

    def req_window_peak(self, req) -> int:
        return self.window_peak(len(req.prompt), req.num_cached, req.max_len, len(req.shared))

    def window_fits(self, load: int, peak: int, matched: list[int]) -> tuple[bool, int]:
        """Whether a request of window ``peak`` holding ``matched`` cache pages fits beside ``load``
        (running requests' peaks plus the window pages they hold from the cache), and its share of the load.

        Why this bound holds: the group's pages are free, cache-only (evictable on demand), held by the
        request that allocated them (at most its peak), or held only by requests that took them from the
        cache (at most the distinct pages counted in ``wshared``, a set that only shrinks while they run)."""
        need = peak + sum(1 for p in matched if p and p not in self.wshared)
        return load + need <= self.window_allocator.capacity, need

    def _walloc(self, n: int) -> list[int]:
        short = n - self.window_allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict_window(short)
        return self.window_allocator.alloc(n)

    def window_advance(self, wp: WindowPages, num_cached: int, end: int) -> list[int]:
        """Release ``wp``'s pages wholly before the window of the query at ``num_cached`` and give it pages
        up to token ``end``; returns the pages allocated."""
        lo = window_start(num_cached, self.window, self.page_size)
        if lo > wp.first:
            gone = wp.table[wp.first : lo].tolist()
            wp.table[wp.first : lo] = 0
            wp.first = lo
            self._window_free(wp, gone)
        need = self.pages_for(end) - len(wp.table)
        if need <= 0:
            return []
        new = self._walloc(need)
        wp.table = np.concatenate([wp.table, np.asarray(new, dtype=np.int32)])
        return new

    def _window_free(self, wp: WindowPages, pages: list[int]) -> None:
        self.window_allocator.free(pages)
        for p in wp.matched.intersection(pages):
            wp.matched.discard(p)
            self.wshared[p] -= 1
            if not self.wshared[p]:
                del self.wshared[p]

    def window_drop(self, wp: WindowPages) -> None:
        self._window_free(wp, wp.live())
        wp.table, wp.first = np.zeros(0, dtype=np.int32), 0

    def check_window_room(self, prompt_lens: list[int], lens: list[int], what: str) -> None:
        """Raise unless sequences of these lengths, fed together without prefix sharing, fit the window group."""
        if not self.window:
            return
        need = sum(self.window_peak(p, 0, n, 0) for p, n in zip(prompt_lens, lens))
        short = need - self.window_allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict_window(short)
        if need > self.window_allocator.num_free:
            raise KVCacheFullError(f"{what} needs up to {need} free pages of the sliding-window layers, "
                                   f"{self.window_allocator.num_free} free", fix="feed fewer or shorter sequences at once")

    # ---------------------------------------------------------------- a request's pages

    def unmatch(self, shared: list[int], wshared: list[int]) -> None:
        self.allocator.free(shared)
        if self.window:
            self.window_allocator.free([p for p in wshared if p])

    def admit_window(self, req, wshared: list[int]) -> None:
        wp = req.window = WindowPages()
        wp.table = np.asarray(wshared, dtype=np.int32)
        wp.first = window_start(req.num_cached, self.window, self.page_size)
        wp.matched = {p for p in wshared if p}
        for p in wp.matched:
            self.wshared[p] = self.wshared.get(p, 0) + 1
        # The prompt's window pages now where holding them all stays within the peak (prompts that fit
        # a chunk, the usual case), so that requests admitted right after share them, as full pages.
        if self.pages_for(len(req.prompt)) - len(req.shared) <= self.req_window_peak(req):
            self.window_advance(wp, req.num_cached, len(req.prompt))

    def grow(self, req, num_new: int) -> None:
        """Pages (and window-group pages) for ``num_new`` more tokens of ``req``."""
        need = self.pages_for(req.num_cached + num_new) - len(req.pages)
        if need > 0:
            req.pages += self.allocator.alloc(need)
            req.reserved -= need
        if req.window is not None:
            new = self.window_advance(req.window, req.num_cached, req.num_cached + num_new)
            if new and req.prefilling and self.prefix_cache is not None:
                self.prefix_cache.insert(req.prompt, req.pages, req.window.table)

    def written(self, req) -> None:
        """``req``'s prompt pages up to ``num_cached`` hold their k/v: requests that share them may read."""
        if self.prefix_cache is not None and len(req.out) == 0:
            n = min(req.num_cached, len(req.prompt)) // self.page_size
            self.prefix_cache.mark_ready(req.pages[:n], req.window.table[:n] if req.window else ())

    def release(self, req, *, unfinished: bool = False) -> None:
        """Give back ``req``'s pages; ``unfinished``: it stopped mid-way (an error, a cancel), so cache
        entries it had not written yet are dropped."""
        if unfinished and self.prefix_cache is not None:
            self.prefix_cache.drop_unready(req.pages, req.window.live() if req.window else ())
        self.allocator.free(req.pages)
        req.pages, req.reserved = [], 0
        if req.window is not None:
            self.window_drop(req.window)
