"""Shared-prefix reuse: full KV pages of prompt prefixes, found again by content and shared copy-free.

A page is identified by a hash chained over every token up to its end, so two prompts share page i only
if they agree on all tokens before it. The cache holds one reference on each page it knows; requests
using the page hold their own. A page becomes *ready* once its owner has written it; requests that
matched a page still being written wait for it before they prefill past it. Pages only the cache holds
are evicted least-recently-used when the allocator runs short; a page a running request holds counts as in
use, and an eviction that passes it over moves it to the recent end.

With a window page group (``KVPool.has_window_group``) a cached page position also keeps its window-group
page, where one is known. A prefix of k pages is usable only if the window pages its next query can
see are there too: those of columns ``[window_start(k), k)`` (``window_start``). Requests release window
pages as their window moves on, and the cache evicts them on its own (``evict_window``), so ``match``
returns the longest prefix whose full pages and needed window pages are all present.
"""
from __future__ import annotations

from collections import OrderedDict

from attnzoo.attention.kv_cache import PageAllocator


def window_start(num_tokens: int, window: int, page_size: int) -> int:
    """The first page column the token after ``num_tokens`` cached ones can see under ``window``."""
    return max(0, num_tokens - window + 1) // page_size


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, window_allocator: PageAllocator | None = None,
                 window: int | None = None):
        self.allocator = allocator
        self.page_size = page_size
        self.window_allocator, self.window = window_allocator, window  # None: one page group
        self._pages: OrderedDict[int, int] = OrderedDict()  # chained hash -> page id, LRU order
        self._ready: set[int] = set()  # page ids whose contents are written
        self._window: OrderedDict[int, int] = OrderedDict()  # chained hash -> window-group page id, LRU order
        self._wready: set[int] = set()  # window-group page ids whose contents are written

    def _hashes(self, tokens: list[int], num_pages: int) -> list[int]:
        out, h = [], 0
        for i in range(num_pages):
            h = hash((h, tuple(tokens[i * self.page_size : (i + 1) * self.page_size])))
            out.append(h)
        return out

    def match(self, prompt: list[int]) -> tuple[list[int], list[int]]:
        """(full pages of the longest usable cached prefix of ``prompt``, its window-group pages by column,
        0 before ``window_start``; [] without a window group), increfed for the caller.

        The page holding the last prompt token is never shared: that token is recomputed to get the
        logits, and its page must be the request's own to write.
        """
        hashes = []
        for h in self._hashes(prompt, (len(prompt) - 1) // self.page_size):
            if h not in self._pages:
                break
            hashes.append(h)
        wpages: list[int] = []
        if self.window is not None:
            k = self._usable(hashes)
            hashes = hashes[:k]
            lo = window_start(k * self.page_size, self.window, self.page_size)
            wpages = [0] * lo + [self._window[h] for h in hashes[lo:]]
            self.window_allocator.incref(wpages[lo:])
            for h in hashes[lo:]:
                self._window.move_to_end(h)
        pages = []
        for h in hashes:
            self._pages.move_to_end(h)
            pages.append(self._pages[h])
        self.allocator.incref(pages)
        return pages, wpages

    def _usable(self, hashes: list[int]) -> int:
        """The most leading pages of ``hashes`` whose needed window pages are all cached."""
        run = 0  # window pages present in a row, ending at column j
        best = 0
        for j, h in enumerate(hashes):
            run = run + 1 if h in self._window else 0
            k = j + 1
            if run >= k - window_start(k * self.page_size, self.window, self.page_size):
                best = k
        return best

    def insert(self, prompt: list[int], pages: list[int], wpages=()) -> None:
        """Offer a request's full prompt pages (``pages[i]`` holds page i of the prompt) and its live
        window-group pages by column (0: none) to the cache."""
        n = min(len(pages), (len(prompt) - 1) // self.page_size)
        for i, h in enumerate(self._hashes(prompt, n)):
            page = pages[i]
            if h not in self._pages:
                self._pages[h] = page
                self._ready.discard(page)  # a recycled page id: not written for this prefix yet
                self.allocator.incref([page])
            # Any writer's window page of the same tokens will do: equal tokens, equal entries.
            wpage = int(wpages[i]) if i < len(wpages) else 0
            if wpage and h not in self._window:
                self._window[h] = wpage
                self._wready.discard(wpage)
                self.window_allocator.incref([wpage])

    def mark_ready(self, pages: list[int], wpages=()) -> None:
        self._ready.update(pages)
        self._wready.update(int(p) for p in wpages if p)

    def all_ready(self, pages: list[int], wpages=()) -> bool:
        return all(p in self._ready for p in pages) and all(p in self._wready for p in wpages if p)

    def drop_unready(self, pages: list[int], wpages=()) -> None:
        """Forget cache entries among ``pages`` / ``wpages`` that were never written (their writer failed)."""
        gone = set(pages) - self._ready
        for h in [h for h, p in self._pages.items() if p in gone]:
            self._drop_node(h)
        wgone = {int(p) for p in wpages if p} - self._wready
        for h in [h for h, p in self._window.items() if p in wgone]:
            self.window_allocator.free([self._window.pop(h)])

    def _drop_node(self, h: int) -> None:
        page = self._pages.pop(h)
        self._ready.discard(page)
        self.allocator.free([page])
        wpage = self._window.pop(h, None)
        if wpage is not None:
            self.window_allocator.free([wpage])

    def evictable(self) -> int:
        return sum(1 for p in self._pages.values() if self.allocator.refcount(p) == 1)

    def evictable_window(self) -> int:
        return sum(1 for p in self._window.values() if self.window_allocator.refcount(p) == 1)

    @staticmethod
    def _oldest(entries: OrderedDict, n: int, allocator: PageAllocator) -> list[int]:
        """Up to ``n`` hashes of ``entries`` (hash -> page, oldest first) whose page only the cache holds. The
        entries passed over (pages running requests hold) count as just used: the next search starts past them,
        so that a full pool admitting request after request does not walk them again each time."""
        found, held = [], []
        for h, page in entries.items():
            if len(found) == n:
                break
            (found if allocator.refcount(page) == 1 else held).append(h)
        for h in held:
            entries.move_to_end(h)
        return found

    def evict(self, n: int) -> int:
        """Drop up to ``n`` pages only the cache holds, oldest first; returns how many were freed."""
        victims = self._oldest(self._pages, n, self.allocator)
        for h in victims:
            self._drop_node(h)
        return len(victims)

    def evict_window(self, n: int) -> int:
        """Drop up to ``n`` window-group pages only the cache holds, oldest first (their full pages stay,
        but are matched again only where no needed window page is missing); returns how many were freed."""
        victims = self._oldest(self._window, n, self.window_allocator)
        for h in victims:
            wpage = self._window.pop(h)
            self._wready.discard(wpage)
            self.window_allocator.free([wpage])
        return len(victims)

    def __len__(self) -> int:
        return len(self._pages)
