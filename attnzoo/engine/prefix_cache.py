"""Shared-prefix reuse: full KV pages of prompt prefixes, found again by content and shared copy-free.

A page is identified by a hash chained over every token up to its end, so two prompts share page i only
if they agree on all tokens before it. The cache holds one reference on each page it knows; requests
using the page hold their own. A page becomes *ready* once its owner has written it; requests that
matched a page still being written wait for it before they prefill past it. Pages only the cache holds
are evicted least-recently-used when the allocator runs short.
"""
from __future__ import annotations

from collections import OrderedDict

from attnzoo.attention.kv_cache import PageAllocator


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._pages: OrderedDict[int, int] = OrderedDict()  # chained hash -> page id, LRU order
        self._ready: set[int] = set()  # page ids whose contents are written

    def _hashes(self, tokens: list[int], num_pages: int) -> list[int]:
        out, h = [], 0
        for i in range(num_pages):
            h = hash((h, tuple(tokens[i * self.page_size : (i + 1) * self.page_size])))
            out.append(h)
        return out

    def match(self, prompt: list[int]) -> list[int]:
        """Pages holding the longest cached prefix of ``prompt``, increfed for the caller.

        The page holding the last prompt token is never shared: that token is recomputed to get the
        logits, and its page must be the request's own to write.
        """
        pages = []
        for h in self._hashes(prompt, (len(prompt) - 1) // self.page_size):
            page = self._pages.get(h)
            if page is None:
                break
            self._pages.move_to_end(h)
            pages.append(page)
        self.allocator.incref(pages)
        return pages

    def insert(self, prompt: list[int], pages: list[int]) -> None:
        """Offer a request's full prompt pages (``pages[i]`` holds page i of the prompt) to the cache."""
        for h, page in zip(self._hashes(prompt, min(len(pages), (len(prompt) - 1) // self.page_size)), pages):
            if h not in self._pages:
                self._pages[h] = page
                self._ready.discard(page)  # a recycled page id: not written for this prefix yet
                self.allocator.incref([page])

    def mark_ready(self, pages: list[int]) -> None:
        self._ready.update(pages)

    def all_ready(self, pages: list[int]) -> bool:
        return all(p in self._ready for p in pages)

    def drop_unready(self, pages: list[int]) -> None:
        """Forget cache entries among ``pages`` that were never written (their writer failed)."""
        gone = set(pages) - self._ready
        for h in [h for h, p in self._pages.items() if p in gone]:
            self.allocator.free([self._pages.pop(h)])

    def evictable(self) -> int:
        return sum(1 for p in self._pages.values() if self.allocator.refcount(p) == 1)

    def evict(self, n: int) -> int:
        """Drop up to ``n`` pages only the cache holds, oldest first; returns how many were freed."""
        freed = 0
        for h in list(self._pages):
            if freed == n:
                break
            page = self._pages[h]
            if self.allocator.refcount(page) == 1:
                del self._pages[h]
                self._ready.discard(page)
                self.allocator.free([page])
                freed += 1
        return freed

    def __len__(self) -> int:
        return len(self._pages)
